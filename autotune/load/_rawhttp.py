"""A minimal HTTP/1.1 streaming client on a raw asyncio protocol (the ``raw`` engine of the load client).

It speaks only what the load client needs: ``POST`` with a JSON body to a plain-``http`` server, a response
with ``Transfer-Encoding: chunked``, ``Content-Length`` or close-delimited body, keep-alive reuse of idle
connections. Chunks are handled in ``data_received`` itself (no stream reader, future or task switch per
chunk), which is what makes it cheaper per chunk than aiohttp (benchmarks/RESULTS.md). The SSE decoding
(:class:`~autotune.load.exchange.Exchange`) and the per-read ``perf_counter()`` are the aiohttp engine's.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any
from urllib.parse import urlsplit

from autotune.errors import LoadError
from autotune.load.exchange import Exchange

_MAX_ERROR_BODY = 2000


class _Conn(asyncio.Protocol):
    def __init__(self, pool: RawPool) -> None:
        self.pool = pool
        self.transport: Any = None
        self.closed = False
        self.result: Exchange | None = None
        self.waiter: asyncio.Future[None] | None = None
        self._reset()

    def _reset(self) -> None:
        self.head = b""
        self.in_body = False
        self.mode = ""  # "chunked", "length" or "close"
        self.remaining = 0  # bytes left of the current HTTP chunk / of the body
        self.skip = 0  # CRLF bytes to skip after an HTTP chunk
        self.pending = b""  # undecoded framing bytes
        self.keep_alive = True
        self.errbody = b""

    # -- asyncio.Protocol ------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.result is not None and not self.result.done:
            if self.in_body and self.mode == "close":
                self._finish()
            else:
                self._fail(f"connection lost: {exc}" if exc else "connection closed by the server")
        self.pool.discard(self)

    def data_received(self, data: bytes) -> None:
        t = time.perf_counter()
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
            self._chunked(data, t)
        elif self.mode == "length":
            take = data[: self.remaining]
            self.remaining -= len(take)
            res.feed(take, t)
            if self.remaining <= 0:
                self._finish()
        else:
            res.feed(data, t)

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

    def _chunked(self, data: bytes, t: float) -> None:
        if self.pending:
            data = self.pending + data
            self.pending = b""
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
                assert self.result is not None
                self.result.feed(data[pos:end], t)
                self.remaining -= end - pos
                pos = end
                if not self.remaining:
                    self.skip = 2
                continue
            nl = data.find(b"\r\n", pos)
            if nl < 0:
                self.pending = data[pos:]
                return
            try:
                chunk = int(data[pos:nl].split(b";", 1)[0], 16)
            except ValueError:
                self._fail(f"malformed chunk size: {data[pos:nl][:40]!r}")
                return
            pos = nl + 2
            if chunk == 0:
                self._finish()  # trailers (if any) are ignored; the connection is not reused then
                if data[pos:] != b"\r\n":
                    self.keep_alive = False
                return
            self.remaining = chunk

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


class RawPool:
    """Connections to one ``http://host:port``, reused when the server keeps them alive."""

    def __init__(self, base_url: str) -> None:
        parts = urlsplit(base_url)
        if parts.scheme != "http" or not parts.hostname:
            raise LoadError(f"the raw engine needs an http:// base URL, got {base_url!r}")
        self.host = parts.hostname
        self.port = parts.port or 80
        self._idle: list[_Conn] = []
        self._all: set[_Conn] = set()

    def discard(self, conn: _Conn) -> None:
        """Forget a closed connection."""
        self._all.discard(conn)
        if conn in self._idle:
            self._idle.remove(conn)

    async def close(self) -> None:
        """Close every connection."""
        for conn in list(self._all):
            if conn.transport is not None:
                conn.transport.close()
        self._idle.clear()

    async def _connection(self, fresh: bool) -> tuple[_Conn, bool]:
        while self._idle and not fresh:
            conn = self._idle.pop()
            if not conn.closed and not conn.transport.is_closing():
                return conn, True
        loop = asyncio.get_running_loop()
        _, conn = await loop.create_connection(lambda: _Conn(self), self.host, self.port)
        self._all.add(conn)
        return conn, False

    async def post(self, path: str, body: bytes, result: Exchange, timeout: float) -> None:
        """POST ``body`` to ``path`` and fill ``result`` until the response ends, fails or times out.

        A reused keep-alive connection that the server closed before answering (the idle-timeout race)
        is retried once on a fresh connection; nothing else is retried.
        """
        deadline = time.perf_counter() + timeout
        reused = await self._attempt(path, body, result, timeout, fresh=False)
        if reused and result.status is None and result.error and not result.times:
            result.error = ""
            result.done = False
            await self._attempt(path, body, result, max(0.001, deadline - time.perf_counter()), fresh=True)

    async def _attempt(self, path: str, body: bytes, result: Exchange, timeout: float, fresh: bool) -> bool:
        try:
            conn, reused = await asyncio.wait_for(self._connection(fresh), timeout)
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
        conn.transport.write(
            b"POST %s HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: application/json\r\n"
            b"Accept: text/event-stream\r\nContent-Length: %d\r\n\r\n%s"
            % (path.encode(), self.host.encode(), self.port, len(body), body)
        )
        try:
            await asyncio.wait_for(conn.waiter, timeout)
        except TimeoutError:
            result.error = f"timed out after {timeout:g} s"
            conn.keep_alive = False
        except asyncio.CancelledError:
            conn.transport.abort()
            raise
        finally:
            conn.result = None
            conn.waiter = None
        if conn.keep_alive and not conn.closed:
            self._idle.append(conn)
        else:
            conn.transport.close()
        return reused
