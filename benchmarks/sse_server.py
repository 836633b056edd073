"""The benchmarks' fake vLLM server: streams SSE completion chunks at known times and records every write.

One process, non-blocking sockets on uvloop, shared by ``benchmarks/loadgen.py`` and
``benchmarks/truth.py`` (each starts it with its own ``serve`` mode, see :func:`running`). It answers

* ``POST /v1/completions`` (``max_tokens`` chunks of the vLLM completion format, one HTTP chunk each,
  then the usage chunk and ``[DONE]``), paced by the request's model name: ``pace-<ms>`` paces each
  stream on its own clock from its own first chunk; ``step-<ms>`` paces all streams on one engine-step
  clock as vLLM does (the chunks of one step leave together, a new stream's first chunk waits for the
  next step); ``burst<k>-<ms>`` is ``pace`` with ``k`` chunks in each write (coalesced reads with a
  punctual client);
* ``POST /dump``: what it recorded since the last dump, then forgets it: per request (its
  ``X-Request-Id``, else its prompt), ``arrive``, when the request arrived (the kernel's receive time of
  its first bytes, ``SO_TIMESTAMPNS``: the server's own delay in reading it counts in its TTFT), and
  ``writes``, the ``perf_counter()`` of every chunk it wrote (CLOCK_MONOTONIC, one clock for every
  process of the machine);
* ``GET /health``.

Options (:class:`Options`): ``prefill_s``, how long after its arrival a request's first chunk leaves (plus
the wait for the next step with ``step``), and ``event``, the bytes of one chunk (:func:`chunk_event`).
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

_SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)
_TIMESPEC = struct.Struct("qq")

HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
    b"Connection: keep-alive\r\n\r\n"
)
"""The head of a streamed response."""


def frame(payload: bytes) -> bytes:
    """``payload`` as one HTTP/1.1 chunk."""
    return b"%x\r\n%s\r\n" % (len(payload), payload)


def _sse(data: bytes) -> bytes:
    return frame(b"data: " + data + b"\n\n")


def chunk_event(completion_id: str, model: str) -> bytes:
    """One vLLM completion chunk (the token " word") as a framed SSE event; the id and model set its size."""
    chunk = {
        "id": completion_id,
        "object": "text_completion",
        "created": 1733000000,
        "model": model,
        "choices": [
            {"index": 0, "text": " word", "logprobs": None, "finish_reason": None, "stop_reason": None}
        ],
        "usage": None,
    }
    return _sse(json.dumps(chunk, separators=(",", ":")).encode())


def _tail(tokens: int) -> bytes:
    """What ends a stream of ``tokens`` chunks: the usage chunk, ``[DONE]`` and the last HTTP chunk."""
    usage = {"id": "x", "choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": tokens}}
    return _sse(json.dumps(usage, separators=(",", ":")).encode()) + _sse(b"[DONE]") + b"0\r\n\r\n"


@dataclass(frozen=True)
class Options:
    """How the server streams."""

    prefill_s: float = 0.0
    """A request's first chunk leaves this long after the request arrived."""
    event: bytes = field(default_factory=lambda: chunk_event("cmpl-truth", "truth"))
    """One chunk's bytes, framed."""


@dataclass(frozen=True)
class Pacing:
    """A stream's pacing, from its model name: ``pace-<ms>``, ``step-<ms>`` or ``burst<k>-<ms>``."""

    step: bool
    burst: int
    period_s: float

    @classmethod
    def of(cls, model: str) -> Pacing:
        kind, _, ms = model.partition("-")
        burst = int(kind[5:]) if kind.startswith("burst") else 1
        return cls(step=kind == "step", burst=burst, period_s=float(ms) / 1000.0)


@dataclass(frozen=True)
class Request:
    """One parsed HTTP request."""

    path: str
    headers: dict[str, str]
    body: bytes


def parse_request(buf: bytes) -> tuple[Request, bytes] | None:
    """The first whole request in ``buf`` and the bytes after it, or None while it is incomplete."""
    end = buf.find(b"\r\n\r\n")
    if end < 0:
        return None
    head = buf[:end].decode("latin-1").split("\r\n")
    headers = {}
    for line in head[1:]:
        key, _, value = line.partition(":")
        headers[key.strip().lower()] = value.strip()
    length = int(headers.get("content-length", "0"))
    if len(buf) < end + 4 + length:
        return None
    return Request(head[0].split(" ")[1], headers, buf[end + 4 : end + 4 + length]), buf[end + 4 + length :]


class _Steps:
    """One engine-step clock: every ``period`` s each registered stream writes its next chunk."""

    def __init__(self, period: float) -> None:
        self.period = period
        self.streams: list[Callable[[], bool]] = []
        self.running = False

    def add(self, step: Callable[[], bool]) -> None:
        self.streams.append(step)
        if not self.running:
            self.running = True
            at = asyncio.get_running_loop().time() + self.period
            asyncio.get_running_loop().call_at(at, self._tick, at)

    def _tick(self, at: float) -> None:
        self.streams = [s for s in self.streams if s()]
        if not self.streams:
            self.running = False
            return
        asyncio.get_running_loop().call_at(at + self.period, self._tick, at + self.period)


@dataclass
class _State:
    """What the server shares between its connections."""

    options: Options
    offset: float = field(default_factory=lambda: time.perf_counter() - time.time())
    """perf_counter - CLOCK_REALTIME, to put the kernel's receive times on the perf_counter clock."""
    truth: dict[str, dict[str, Any]] = field(default_factory=dict)
    steps: dict[float, _Steps] = field(default_factory=dict)

    def received_at(self, ancillary: list[tuple[int, int, bytes]]) -> float:
        """The kernel's receive time of a read (its ``SO_TIMESTAMPNS``), else now."""
        for level, kind, raw in ancillary:
            if level == socket.SOL_SOCKET and kind == _SO_TIMESTAMPNS:
                sec, nsec = _TIMESPEC.unpack(raw[: _TIMESPEC.size])
                return float(sec + nsec / 1e9 + self.offset)
        return time.perf_counter()


class _Conn:
    """One client connection, read with ``recvmsg`` for the kernel's receive time of each request."""

    def __init__(self, sock: socket.socket, loop: asyncio.AbstractEventLoop, state: _State) -> None:
        self.sock = sock
        self.loop = loop
        self.state = state
        self.buf = b""
        self.arrived: float | None = None
        self.out = bytearray()
        self.closed = False
        sock.setblocking(False)
        sock.setsockopt(socket.SOL_SOCKET, _SO_TIMESTAMPNS, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        loop.add_reader(sock, self._readable)

    def _readable(self) -> None:
        try:
            data, ancillary, _, _ = self.sock.recvmsg(1 << 16, 256)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self.close()
            return
        if self.arrived is None:  # the first bytes of a request: the kernel says when they came
            self.arrived = self.state.received_at(ancillary)
        self.buf += data
        # A request's bytes left after another's (pipelined) arrived by the time that one was read.
        while self.arrived is not None and (parsed := parse_request(self.buf)):
            request, self.buf = parsed
            arrived, self.arrived = self.arrived, time.perf_counter() if self.buf else None
            self._handle(request, arrived)

    def write(self, data: bytes) -> None:
        """Send ``data`` now; what the kernel does not take waits for the socket to be writable."""
        if self.closed:
            return
        if self.out:
            self.out += data
            return
        try:
            sent = self.sock.send(data)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            self.close()
            return
        if sent < len(data):
            self.out += data[sent:]
            self.loop.add_writer(self.sock, self._writable)

    def _writable(self) -> None:
        try:
            sent = self.sock.send(self.out)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self.close()
            return
        del self.out[:sent]
        if not self.out:
            self.loop.remove_writer(self.sock)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.loop.remove_reader(self.sock)
            self.loop.remove_writer(self.sock)
            self.sock.close()

    def _reply(self, status: str, payload: bytes) -> None:
        self.write(
            b"HTTP/1.1 %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
            % (status.encode(), len(payload), payload)
        )

    def _handle(self, request: Request, arrived: float) -> None:
        if request.path == "/dump":
            self._reply("200 OK", json.dumps(self.state.truth).encode())
            self.state.truth = {}
        elif request.path == "/health":
            self._reply("200 OK", b"{}")
        elif request.path == "/v1/completions":
            self._stream(request, arrived)
        else:
            self._reply("404 Not Found", b"{}")

    def _stream(self, request: Request, arrived: float) -> None:
        """Stream the completion, recording the time of every chunk's write."""
        req = json.loads(request.body)
        n = int(req["max_tokens"])
        pacing = Pacing.of(str(req["model"]))
        truth = self.state.truth
        writes: list[float] = []
        truth[request.headers.get("x-request-id", str(req.get("prompt", f"anon-{len(truth)}")))] = {
            "arrive": arrived,
            "writes": writes,
        }
        self.write(HEAD)
        event, tail, loop = self.state.options.event, _tail(n), self.loop

        def write() -> bool:
            """Write the next chunk(s) (and the tail after the last); whether more are left."""
            if self.closed:
                return False
            k = min(pacing.burst, n - len(writes))
            self.write(event * k)  # a burst: k chunks in one write
            writes.extend([time.perf_counter()] * k)
            if len(writes) < n:
                return True
            self.write(tail)
            return False

        # The first chunk leaves prefill after the request arrived (the kernel's time), whenever the
        # server got round to reading it: its own delays are part of its TTFT.
        t0 = loop.time() + max(0.0, arrived + self.state.options.prefill_s - time.perf_counter())

        def paced(k: int) -> None:
            if write():
                loop.call_at(t0 + (k + 1) * pacing.period_s, paced, k + 1)

        if pacing.step:
            steps = self.state.steps.setdefault(pacing.period_s, _Steps(pacing.period_s))
            loop.call_at(t0, steps.add, write)
        else:
            loop.call_at(t0, paced, 0)


async def _serve(port: int, options: Options) -> None:
    loop = asyncio.get_running_loop()
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(8192)
    listener.setblocking(False)
    state = _State(options)
    conns: list[_Conn] = []

    def accept() -> None:
        while True:
            try:
                sock, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            conns.append(_Conn(sock, loop, state))

    loop.add_reader(listener, accept)
    print(listener.getsockname()[1], flush=True)
    await asyncio.Event().wait()


def serve(port: int, options: Options) -> None:
    """Run the server on ``port`` (0: any free one; it prints the port) until killed."""
    import uvloop

    uvloop.run(_serve(port, options))


@contextmanager
def running(serve_argv: Sequence[str], cores: str | None = None) -> Iterator[str]:
    """Run ``serve_argv`` (a command that calls :func:`serve`) in its own process, on ``cores`` (``taskset
    -c``) if given; yield the server's base URL; stop the process when done."""
    prefix = ["taskset", "-c", cores] if cores else []
    proc = subprocess.Popen([*prefix, *serve_argv], stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert proc.stdout is not None
        yield f"http://127.0.0.1:{int(proc.stdout.readline())}"
    finally:
        proc.terminate()
        proc.wait(10)


def dump(base: str) -> dict[str, dict[str, Any]]:
    """The server's records since the last dump, which it then forgets: per request id, ``arrive`` (its
    arrival) and ``writes`` (every chunk's write), perf_counter seconds."""
    import httpx

    data: dict[str, dict[str, Any]] = httpx.post(base + "/dump", timeout=30).json()
    return data
