"""A vLLM-like SSE server for the client's tests, in its own process (``python -m tests.unit.sse_server``)."""

from __future__ import annotations

import asyncio
import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from aiohttp import web

METRICS = """# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0"} 0.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0"} 0.125
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0"} 0.0
"""


PREFILL_S = 0.03
#: Seconds the server may take to start and print its port.
START_TIMEOUT_S = 30.0


def _chunk(text: str, *, chat: bool, finish: str | None = None) -> bytes:
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
    if chat:
        choice["delta"] = {"content": text}
    else:
        choice["text"] = text
    body = {"id": "cmpl-1", "object": "x", "created": 1, "model": "m", "choices": [choice], "usage": None}
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


class _App:
    """A vLLM-like SSE server. The model name picks a behaviour:

    ``pace-<ms>``: one chunk per token every <ms>; ``http500``; ``error-event``: an error event mid-stream;
    ``lying-usage``: usage reports one token whatever was sent; ``slow-first``: first chunk after 300 ms;
    ``drop-reused``: a request on a reused connection is dropped unanswered (the keep-alive idle race);
    ``bursty``: like vLLM's API server when it lags: three tokens merged into one chunk, two such chunks
    written in one write, writes every 50 ms (usage counts every token).

    The ``perf_counter()`` after each content chunk's write of the ``pace-`` models (CLOCK_MONOTONIC: the
    client's clock too) is kept per ``X-Request-Id`` (:meth:`SseServer.seen`'s ``writes``): the truth.
    """

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.connections: set[int] = set()
        self.seen: set[Any] = set()
        self.writes: dict[str, list[float]] = {}

    async def _stream(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.headers.append(dict(request.headers))
        self.connections.add(id(request.transport))
        model = body["model"]
        chat = request.path.endswith("/chat/completions")
        if model == "http500":
            return web.Response(status=500, text="engine dead")
        if model == "drop-reused":  # a kept-alive connection closed as the next request arrives
            transport = request.transport
            assert transport is not None
            if transport in self.seen:
                transport.abort()
                raise asyncio.CancelledError
            self.seen.add(transport)  # keeps the transport alive, so no id or hash is reused
        n = int(body["max_tokens"])
        pace = float(model.split("-")[1]) / 1000 if model.startswith("pace-") else 0.002
        writes = self.writes.setdefault(request.headers.get("X-Request-Id", ""), [])
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        # A first token after a prefill, as a real server: a TTFT of a client's read time alone would be
        # a figure no client could certify.
        await asyncio.sleep(0.3 if model == "slow-first" else PREFILL_S)
        if chat:
            await resp.write(b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n')
            writes.append(time.perf_counter())
        if model == "bursty":
            chunks = [" ".join(f"w{j}" for j in range(i, min(n, i + 3))) for i in range(0, n, 3)]
            for k in range(0, len(chunks), 2):
                await asyncio.sleep(0.05)
                last = len(chunks) - 1
                pair = [_chunk(c, chat=chat, finish="length" if k + j == last else None)
                        for j, c in enumerate(chunks[k : k + 2])]  # fmt: skip
                await resp.write(b"".join(pair))
            n = 0
        for i in range(n):
            if i:
                await asyncio.sleep(pace)
            if model == "error-event" and i == 2:
                await resp.write(b'data: {"error":{"message":"boom","code":500}}\n\n')
                break
            await resp.write(_chunk(f" w{i}", chat=chat, finish="length" if i == n - 1 else None))
            writes.append(time.perf_counter())
        tokens = 1 if model == "lying-usage" else int(body["max_tokens"])
        usage = {"prompt_tokens": 7, "completion_tokens": tokens, "total_tokens": 7 + tokens}
        final = {"id": "cmpl-1", "choices": [], "usage": usage}
        await resp.write(b"data: " + json.dumps(final, separators=(",", ":")).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=METRICS)

    async def _health(self, request: web.Request) -> web.Response:
        self.connections.add(id(request.transport))
        return web.Response(text="")

    async def _seen(self, request: web.Request) -> web.Response:
        out = {
            "bodies": self.bodies,
            "headers": self.headers,
            "connections": len(self.connections),
            "writes": self.writes,
        }
        self.bodies, self.headers, self.writes = [], [], {}
        self.connections = set()
        return web.json_response(out)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self._stream)
        app.router.add_post("/v1/chat/completions", self._stream)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/health", self._health)
        app.router.add_get("/_seen", self._seen)
        return app


class SseServer:
    """The SSE server in its own process (in-process, it would steal the client's GIL and make it late):
    ``url`` is its base URL, :meth:`seen` what it received since the last call."""

    def __init__(self) -> None:
        self.url = ""
        self._proc: subprocess.Popen[str] | None = None

    def __enter__(self) -> SseServer:
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tests.unit.sse_server"],
            stdout=subprocess.PIPE,
            text=True,
            cwd=Path(__file__).resolve().parents[2],
        )
        stdout = self._proc.stdout
        assert stdout is not None
        line, why = self._port_line(stdout.fileno())
        if why:
            self._proc.kill()
            self._proc.wait(10)
            stdout.close()
            raise RuntimeError(f"the SSE test server (python -m tests.unit.sse_server) {why}")
        self.url = f"http://127.0.0.1:{int(line)}"
        return self

    def _port_line(self, fd: int) -> tuple[str, str]:
        """The line the server prints once it listens (its port), read within :data:`START_TIMEOUT_S`; and
        what went wrong instead (empty when nothing did)."""
        assert self._proc is not None
        deadline = time.monotonic() + START_TIMEOUT_S
        got = b""
        while b"\n" not in got:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([fd], [], [], max(0.0, left))
            if not ready:
                return "", f"did not print its port within {START_TIMEOUT_S:g} s"
            data = os.read(fd, 4096)
            if not data:
                code = self._proc.wait(10)
                return "", f"exited with {code} before printing its port (its stderr is above)"
            got += data
        line = got.decode(errors="replace").strip()
        return (line, "") if line.isdigit() else ("", f"printed {line!r} instead of its port")

    def __exit__(self, *exc: object) -> None:
        assert self._proc is not None
        self._proc.terminate()
        self._proc.wait(10)
        if self._proc.stdout is not None:
            self._proc.stdout.close()

    def seen(self) -> dict[str, Any]:
        """The request bodies and headers received, connections made, and content chunks' write times per
        request id, since the last call."""
        return dict(httpx.get(self.url + "/_seen", timeout=10).json())


async def _main() -> None:
    runner = web.AppRunner(_App().app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    print(runner.addresses[0][1], flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(_main())
