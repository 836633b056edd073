"""A minimal HTTP/1.1 streaming client on non-blocking sockets (the ``raw`` engine of the load client).

It speaks only what the load client needs: ``POST`` with a JSON body and extra headers to a plain-``http``
server, a response with ``Transfer-Encoding: chunked``, ``Content-Length`` or close-delimited body,
keep-alive reuse of idle connections, and connections opened ahead of a run (:meth:`RawPool.preconnect`).
Each connection is read by the event loop's reader callback with ``recvmsg``, which also returns the
kernel's receive time of the newest bytes (``SO_TIMESTAMPNS``: the last socket buffer copied, whose time
is that of the newest data merged into it): every chunk carries how long it waited in the socket before
the client read it, an exact witness of the client's own lateness (:mod:`autotune.load.selfcheck`).

When one read brings several chunks, only the newest is timed exactly; the older ones arrived at most
``early`` before it, where ``early`` is the read's kernel time minus the last moment the socket was known
to hold none of its bytes: the connection's previous read that drained it (or the request's send), or
the pool's last **sweep**, whichever is later. A sweep (every :data:`SWEEP_S` while requests run) takes
the time, asks a second epoll set holding every connection which sockets hold data, and reads those at
once: so any byte read later arrived after the sweep began. A punctual loop sweeps every millisecond or
two and an older chunk's allowance stays that small; a loop that stalls does not sweep, and the
allowance grows with the stall (a bound, not an estimate from a timer's lateness). Two exceptions keep
the floor where it was: a read that filled the buffer (older bytes may remain), and, for the rest of
the response, a read of :data:`HELD_BYTES` or more (TCP may have held the server's writes back: they
reach the socket late, even after the read, so neither that read's newest chunk nor any later one is
exact). A read whose bytes came in one TCP segment is exact whole: they reached the socket at one
instant, its kernel time (a server that writes several events at once). The kernel's counters tell
(``TCP_INFO``, read after each read but one of exactly one event: :meth:`_Segments.read`), and where
they do, the pile-up is counted in segments (:data:`HELD_SEGMENTS`) rather than bytes.

A request's send time is taken when it is written, after its connection is ready. Chunks are handled in
the reader callback itself (no stream reader, future or task switch per chunk), which is what makes it
cheaper per chunk than aiohttp (benchmarks/RESULTS.md). The SSE decoding is
:class:`~autotune.load.exchange.Exchange`, as for the aiohttp engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import select
import socket
import struct
import time
from collections.abc import Mapping
from urllib.parse import urlsplit

from autotune.errors import LoadError
from autotune.interrupts import shielded
from autotune.load.aio import start_task
from autotune.load.exchange import Exchange

_MAX_ERROR_BODY = 2000
_TIMESPEC = struct.Struct("qq")
_MAX_WAIT = 60.0
"""A wait longer than this is a clock step (NTP), not a wait: the read time is kept."""


def _header(name: str, value: str) -> bytes:
    if any(c in name + value for c in "\r\n"):
        raise LoadError(f"header {name!r} holds a line break")
    return f"{name}: {value}\r\n".encode("latin-1")


_SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)
_READ_SIZE = 1 << 16
_ANCILLARY = socket.CMSG_SPACE(16)
#: Seconds between two sweeps of the pool's sockets while requests run (the event loop's timers have a
#: resolution of 1 ms).
SWEEP_S = 0.001
#: A read that brings this many bytes or more let data pile up: the server's writes may have been held
#: back (its send buffer full of data this client's kernel has not yet acknowledged: Linux delays the
#: ACK while data is not read), so they may reach the socket long after they were written. That read
#: and the rest of the response are then bounded from the floor of that read, and none of their chunks
#: is taken as exact. (Measured in benchmarks/truth.py: hold-back after 17-18 events of ~290 bytes, about
#: 5 KiB, unread on one connection; this threshold keeps a margin of 2.5 for such events.)
HELD_BYTES = 2048
#: ... or that came in this many TCP data segments or more, where the kernel's counters tell (the same
#: measurement in segments: the pile-ups came as one segment per event, 17-18 of them; a margin of 2.5).
HELD_SEGMENTS = 7
#: ``struct tcp_info`` (``linux/tcp.h``): the offsets of ``tcpi_bytes_received`` (u64: in-order bytes
#: received) and ``tcpi_data_segs_in`` (u32: segments that carried data, Linux 4.6+), and the length that
#: holds both.
_BYTES_RECEIVED = struct.Struct("Q")
_BYTES_RECEIVED_AT = 128
_DATA_SEGS_IN = struct.Struct("I")
_DATA_SEGS_IN_AT = 152
_TCP_INFO_LEN = 160
_TCP_INFO = getattr(socket, "TCP_INFO", 11)


class _Segments:
    """The TCP data segments that brought each read of one socket, from the kernel's counters."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.consumed = 0
        """Bytes read from the socket so far."""
        self.base: int | None = None
        """The kernel's count of data segments received when it last had received nothing this client had
        not read (the base of the next read's count); ``None`` when not known."""
        self.read(0)  # the base: a new connection has received nothing yet

    def read(self, n: int, count: bool = True) -> int | None:
        """How many TCP data segments brought the ``n`` bytes just read, where the kernel's counters
        (``TCP_INFO``) tell exactly: the previous read and this one were counted, each left nothing
        received unread, and nothing arrived between either read and its count; else ``None`` (and
        without ``count`` the kernel is not asked). Segments only ever count more than the writes that
        made them (a lost, repeated or split segment counts again), never fewer."""
        self.consumed += n
        if not count:
            self.base = None
            return None
        try:
            info = self.sock.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, _TCP_INFO_LEN)
        except OSError:
            info = b""
        base = self.base
        if len(info) < _TCP_INFO_LEN:  # a kernel before 4.6 (no tcpi_data_segs_in)
            self.base = None
            return None
        received = int(_BYTES_RECEIVED.unpack_from(info, _BYTES_RECEIVED_AT)[0])
        segments = int(_DATA_SEGS_IN.unpack_from(info, _DATA_SEGS_IN_AT)[0])
        self.base = segments if received == self.consumed else None
        if base is None or self.base is None:
            return None
        return (segments - base) % (1 << 32)


class _Conn:
    """One connection: a non-blocking socket read by the loop's reader callback."""

    def __init__(self, pool: RawPool, sock: socket.socket) -> None:
        self.pool = pool
        self.sock = sock
        self.closed = False
        self.result: Exchange | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.since = -math.inf
        """No byte still unread arrived before this (perf_counter): the last read that drained the socket,
        or the request's send."""
        self.backlog = False
        """The last read filled the buffer: older bytes may remain (the pool's sweep does not bound them)."""
        self.held = False
        """This response piled :data:`HELD_BYTES` up in one read: the server may be holding writes back."""
        self.segments = _Segments(sock)
        """How many TCP segments brought each read (the kernel's counters)."""
        self._out = bytearray()
        self._loop = asyncio.get_running_loop()
        self._reset()
        self._loop.add_reader(sock.fileno(), self._readable)
        pool.watch(self)

    def _reset(self) -> None:
        self.head = b""
        self.in_body = False
        self.mode = ""  # "chunked", "length" or "close"
        self.remaining = 0  # bytes left of the current HTTP chunk / of the body
        self.skip = 0  # CRLF bytes to skip after an HTTP chunk
        self.pending = b""  # undecoded framing bytes
        self.keep_alive = True
        self.errbody = b""

    # -- the socket ------------------------------------------------------------------------
    def is_closing(self) -> bool:
        """Whether the connection is closed (or closing)."""
        return self.closed

    def write(self, data: bytes) -> None:
        """Send ``data``; what the kernel does not take at once is sent when the socket is writable."""
        if self.closed:
            return
        if self._out:
            self._out += data
            return
        try:
            sent = self.sock.send(data)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError as exc:
            self.close(exc)
            return
        if sent < len(data):
            self._out += data[sent:]
            self._loop.add_writer(self.sock.fileno(), self._writable)

    def _writable(self) -> None:
        try:
            sent = self.sock.send(self._out)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self.close(exc)
            return
        del self._out[:sent]
        if not self._out:
            self._loop.remove_writer(self.sock.fileno())

    def close(self, exc: Exception | None = None) -> None:
        """Close the socket (idempotent); a request still running fails with why."""
        if self.closed:
            return
        self.closed = True
        fd = self.sock.fileno()
        if fd >= 0:
            self._loop.remove_reader(fd)
            self._loop.remove_writer(fd)
            self.pool.unwatch(fd)
        self.sock.close()
        if self.result is not None and not self.result.done:
            if self.in_body and self.mode == "close" and exc is None:  # the close ends the body
                if self.result.status != 200:
                    self._fail(f"HTTP {self.result.status}: {self._error_text()}")
                else:
                    self._finish()
            else:
                self._fail(f"connection lost: {exc}" if exc else "connection closed by the server")
        self.pool.discard(self)

    def _readable(self) -> None:
        t = time.perf_counter()
        try:
            data, ancillary, _, _ = self.sock.recvmsg(_READ_SIZE, _ANCILLARY)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self.close(exc)
            return
        if not data:
            self.close()
            return
        # Counted except in a read of exactly one event, whose chunk is timed by its newest bytes anyway
        # (a system call per read is a fifth of the client's cost per chunk where each write is one
        # event); a read not counted leaves the next one's base unknown.
        segments = self.segments.read(len(data), count=data.count(b"data:") != 1)
        # Every byte of this read arrived after `floor`; those a full buffer left behind may not have, nor
        # what the server held back once this connection had piled data up (HELD_BYTES, HELD_SEGMENTS):
        # from then on the floor stays where the pile-up's was, and no chunk of the response is exact.
        floor = self.since if self.held or self.backlog else max(self.since, self.pool.swept)
        drained = len(data) < _READ_SIZE
        piled = len(data) >= HELD_BYTES if segments is None else segments >= HELD_SEGMENTS
        if not self.held:
            if piled:  # the pile-up's own newest may have been held back already
                self.held = True
                self.since = floor
            elif drained:
                self.since = t
        # One segment brought every byte of this read: they reached the socket at one instant, the kernel's
        # time, so no chunk of it arrived earlier (a server that writes several events at once).
        together = segments == 1 and not self.held
        self.backlog = not drained
        waited: float | None = None
        for level, kind, raw in ancillary:
            if level == socket.SOL_SOCKET and kind == _SO_TIMESTAMPNS and len(raw) >= 16:
                sec, nsec = _TIMESPEC.unpack_from(raw)
                wait = t - (sec + nsec * 1e-9 + self.pool.clock_offset)
                waited = max(0.0, wait) if wait < _MAX_WAIT else None
        if waited is None:  # no kernel time: timed at the read, and no chunk of it is exact
            self.data_received(data, t, 0.0, max(0.0, t - floor), False)
        elif together:
            self.data_received(data, t, waited, 0.0, True)
        else:
            self.data_received(data, t, waited, max(0.0, t - waited - floor), drained and not self.held)

    def data_received(self, data: bytes, t: float, late: float, early: float, whole: bool) -> None:
        """Bytes read at ``t`` whose newest had waited ``late`` seconds in the socket and whose others
        arrived at most ``early`` before those; ``whole``: the read emptied the socket and nothing was held
        back, so its newest bytes' time is theirs."""
        res = self.result
        if res is None or res.done:
            return
        if not self.in_body:
            data = self._head(data)
            if not self.in_body:
                return
        if res.status != 200:
            self._error_body(data)
            return
        if self.mode == "chunked":
            self._chunked(data, t, late, early, whole)
        elif self.mode == "length":
            take = data[: self.remaining]
            self.remaining -= len(take)
            res.feed(take, t, late, early, whole and len(take) == len(data))
            if self.remaining <= 0:
                self._finish()
        else:
            res.feed(data, t, late, early, whole)

    # -- parsing ---------------------------------------------------------------------------
    def _head(self, data: bytes) -> bytes:
        self.head += data
        end = self.head.find(b"\r\n\r\n")
        if end < 0:
            return b""
        head, rest = self.head[:end].decode("latin-1"), self.head[end + 4 :]
        self.head = b""
        lines = head.split("\r\n")
        assert self.result is not None
        try:
            self.result.status = int(lines[0].split(" ", 2)[1])
        except (IndexError, ValueError):
            self._fail(f"malformed HTTP status line: {lines[0][:100]!r}")
            return b""
        self.mode = "close"
        for line in lines[1:]:
            key, _, value = line.partition(":")
            key = key.strip().lower()
            value = value.strip().lower()
            if key == "transfer-encoding" and "chunked" in value:
                self.mode = "chunked"
            elif key == "content-length" and self.mode != "chunked":
                self.mode = "length"
                self.remaining = int(value)
            elif key == "connection" and value == "close":
                self.keep_alive = False
        if self.mode == "close":
            self.keep_alive = False
        self.in_body = True
        if self.mode == "length" and self.remaining == 0:
            if self.result.status != 200:
                self._fail(f"HTTP {self.result.status}")
            else:
                self._finish()
        return rest

    def _chunked(self, data: bytes, t: float, late: float, early: float, whole: bool) -> None:
        """Decode HTTP chunk framing; the payload of one read is fed to the exchange in one piece (so it
        can tell which chunk came last in the read)."""
        if self.pending:
            data = self.pending + data
            self.pending = b""
        res = self.result
        assert res is not None
        pieces: list[bytes] = []
        pos = 0
        size = len(data)
        while pos < size:
            if self.skip:
                n = min(self.skip, size - pos)
                self.skip -= n
                pos += n
                continue
            if self.remaining:
                end = min(size, pos + self.remaining)
                pieces.append(data[pos:end])
                self.remaining -= end - pos
                pos = end
                if not self.remaining:
                    self.skip = 2
                continue
            nl = data.find(b"\r\n", pos)
            if nl < 0:
                self.pending = data[pos:]
                break
            try:
                chunk = int(data[pos:nl].split(b";", 1)[0], 16)
            except ValueError:
                _feed(res, pieces, t, late, early, False)
                self._fail(f"malformed chunk size: {data[pos:nl][:40]!r}")
                return
            pos = nl + 2
            if chunk == 0:
                _feed(res, pieces, t, late, early, False)  # the end of the body came after them
                self._finish()  # trailers (if any) are ignored; the connection is not reused then
                if data[pos:] != b"\r\n":
                    self.keep_alive = False
                return
            self.remaining = chunk
        # The read ended on a frame boundary: no byte of a later chunk (size line, payload) came with it.
        _feed(res, pieces, t, late, early, whole and not self.pending and not self.remaining)

    def _error_body(self, data: bytes) -> None:
        assert self.result is not None
        if self.mode == "chunked":
            # Good enough for an error message: strip chunk framing lines crudely.
            self.errbody += data
            if self.errbody.endswith(b"0\r\n\r\n"):
                self._fail(f"HTTP {self.result.status}: {self._error_text()}")
            return
        self.errbody += data
        if self.mode == "length":
            self.remaining -= len(data)
            if self.remaining <= 0:
                self._fail(f"HTTP {self.result.status}: {self._error_text()}")

    def _error_text(self) -> str:
        return self.errbody[:_MAX_ERROR_BODY].decode("utf-8", "replace")[:300]

    # -- completion ------------------------------------------------------------------------
    def _finish(self) -> None:
        res = self.result
        assert res is not None
        res.flush(time.perf_counter())
        res.done = True
        self._wake()

    def _fail(self, error: str) -> None:
        res = self.result
        assert res is not None
        res.error = error
        res.done = True
        self.keep_alive = False
        self._wake()

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)


def _feed(res: Exchange, pieces: list[bytes], t: float, late: float, early: float, whole: bool) -> None:
    """Feed one read's payload pieces to ``res`` at once."""
    if pieces:
        res.feed(pieces[0] if len(pieces) == 1 else b"".join(pieces), t, late, early, whole)


class RawPool:
    """Connections to one ``http[s]://host:port``, reused when the server keeps them alive.

    ``headers`` are sent with every request (an ``Authorization`` header, the workload's own); a request
    may add its own (its ``X-Request-Id``).
    """

    def __init__(self, base_url: str, headers: Mapping[str, str] | None = None) -> None:
        parts = urlsplit(base_url)
        if parts.scheme != "http" or not parts.hostname:
            raise LoadError(
                f"the raw engine needs an http:// base URL, got {base_url!r} (https: use the aiohttp engine)"
            )
        self.host = parts.hostname
        self.port = parts.port or 80
        self.clock_offset = time.perf_counter() - time.time()
        """perf_counter minus CLOCK_REALTIME: puts the kernel's receive times on the client's clock."""
        self._idle: list[_Conn] = []
        self._all: set[_Conn] = set()
        self.swept = -math.inf
        """When the last sweep began (perf_counter): every byte read since by a connection that was not
        left with a backlog arrived after it."""
        self._watched: dict[int, _Conn] = {}
        self._sweeper: select.epoll | None = None
        self._sweep_timer: asyncio.TimerHandle | None = None
        self._running = 0
        self._head = (
            b"Host: %s:%d\r\nContent-Type: application/json\r\nAccept: text/event-stream\r\n"
            % (self.host.encode(), self.port)
        ) + b"".join(_header(k, v) for k, v in (headers or {}).items())

    def discard(self, conn: _Conn) -> None:
        """Forget a closed connection."""
        self._all.discard(conn)
        if conn in self._idle:
            self._idle.remove(conn)

    def watch(self, conn: _Conn) -> None:
        """Add a new connection's socket to the sweep's epoll set."""
        if self._sweeper is None:
            self._sweeper = select.epoll()
        fd = conn.sock.fileno()
        self._sweeper.register(fd, select.EPOLLIN)
        self._watched[fd] = conn

    def unwatch(self, fd: int) -> None:
        """Remove a socket (about to be closed) from the sweep's epoll set."""
        if self._watched.pop(fd, None) is not None and self._sweeper is not None:
            with contextlib.suppress(OSError):
                self._sweeper.unregister(fd)

    def _sweep(self) -> None:
        """Read every socket that holds data now; then any byte read later arrived after this sweep."""
        self._sweep_timer = None
        if not self._running:
            return
        began = time.perf_counter()
        self.clock_offset = began - time.time()  # follows a slewed CLOCK_REALTIME (the kernel's times)
        ready: list[tuple[int, int]] = []
        if self._sweeper is not None:
            with contextlib.suppress(OSError):
                ready = self._sweeper.poll(0, len(self._watched) + 1)  # one more: never a full answer
        for fd, _ in ready:
            conn = self._watched.get(fd)
            if conn is not None and not conn.closed:
                conn._readable()
        self.swept = began
        self._sweep_timer = asyncio.get_running_loop().call_later(SWEEP_S, self._sweep)

    def _started(self) -> None:
        self._running += 1
        if self._sweep_timer is None:
            self._sweep_timer = asyncio.get_running_loop().call_later(SWEEP_S, self._sweep)

    def _ended(self) -> None:
        self._running -= 1
        if not self._running and self._sweep_timer is not None:
            self._sweep_timer.cancel()
            self._sweep_timer = None

    async def close(self) -> None:
        """Close every connection."""
        for conn in list(self._all):
            conn.close()
        self._idle.clear()
        if self._sweep_timer is not None:
            self._sweep_timer.cancel()
            self._sweep_timer = None
        if self._sweeper is not None:
            self._sweeper.close()
            self._sweeper = None

    async def _open(self) -> _Conn:
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
        family, kind, proto, _, address = infos[0]
        sock: socket.socket | None = None
        try:
            sock = socket.socket(family, kind, proto)
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, _SO_TIMESTAMPNS, 1)
            await loop.sock_connect(sock, address)
        except BaseException:
            if sock is not None:
                sock.close()
            raise
        with shielded():  # registered and recorded at once: close() closes every socket it registered
            conn = _Conn(self, sock)
            self._all.add(conn)
        return conn

    async def _connection(self, fresh: bool) -> tuple[_Conn, bool]:
        while self._idle and not fresh:
            conn = self._idle.pop()
            if not conn.closed:
                return conn, True
        return await self._open(), False

    async def preconnect(self, count: int, timeout: float) -> int:
        """Open connections until ``count`` are idle (at most ``timeout`` s); returns how many are idle.

        A connection that cannot be opened is left to the request that needs it (it will say why)."""
        missing = max(0, count - len(self._idle))
        if not missing:
            return len(self._idle)
        tasks = [start_task(self._open) for _ in range(missing)]
        done, pending = await asyncio.wait(tasks, timeout=timeout)
        for task in pending:
            task.cancel()
        for task in done:
            if task.exception() is None:
                self._idle.append(task.result())
        return len(self._idle)

    async def post(
        self,
        path: str,
        body: bytes,
        result: Exchange,
        timeout: float,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        """POST ``body`` to ``path`` and fill ``result`` until the response ends, fails or times out.

        A reused keep-alive connection that the server closed before answering (the idle-timeout race)
        is retried once on a fresh connection; nothing else is retried.
        """
        deadline = time.perf_counter() + timeout
        extra = b"".join(_header(k, v) for k, v in (headers or {}).items())
        self._started()
        try:
            reused = await self._attempt(path, body, extra, result, timeout, fresh=False)
            if reused and result.status is None and result.error and not result.times:
                result.error = ""
                result.done = False
                remaining = max(0.001, deadline - time.perf_counter())
                await self._attempt(path, body, extra, result, remaining, fresh=True)
        finally:
            self._ended()

    async def _attempt(
        self, path: str, body: bytes, extra: bytes, result: Exchange, timeout: float, fresh: bool
    ) -> bool:
        try:  # awaited at once: a coroutine handed to wait_for could be dropped unstarted by a signal
            async with asyncio.timeout(timeout):
                conn, reused = await self._connection(fresh)
        except TimeoutError:
            result.error = f"timed out after {timeout:g} s (connecting)"
            return False
        except OSError as exc:
            result.error = f"{type(exc).__name__}: {exc}"
            return False
        conn._reset()
        conn.result = result
        loop = asyncio.get_running_loop()
        conn.waiter = loop.create_future()
        request = b"POST %s HTTP/1.1\r\n%s%sContent-Length: %d\r\n\r\n%s" % (
            path.encode(),
            self._head,
            extra,
            len(body),
            body,
        )
        result.send = time.perf_counter()  # the request leaves now: connecting is not the server's time
        conn.since = max(conn.since, result.send)  # no byte of the answer can come before the question
        conn.held = False
        conn.write(request)
        result.sent = time.perf_counter()
        try:
            await asyncio.wait_for(conn.waiter, timeout)
        except TimeoutError:
            result.error = f"timed out after {timeout:g} s"
            conn.keep_alive = False
        except asyncio.CancelledError:
            conn.result = None
            conn.close()
            raise
        finally:
            conn.result = None
            conn.waiter = None
        if conn.keep_alive and not conn.closed:
            self._idle.append(conn)
        else:
            conn.close()
        return reused
