"""Benchmark: autotune's streaming client against a vLLM-bench-style aiohttp client, side by side.

A fast SSE server (raw asyncio protocol on uvloop, in its own process) streams vLLM-format completion chunks
(~250 bytes each) at known times, and records the perf_counter time of every write (perf_counter is
CLOCK_MONOTONIC, shared by all processes). The model name sets the pacing: ``pace-<ms>`` paces every stream
on its own clock from its own start (streams out of step: each chunk wakes the client on its own, the
worst case for a client's CPU per chunk); ``step-<ms>`` paces all streams on one engine-step clock, as
vLLM does (every running sequence gets its token in the same step, so the chunks of one step leave
together and a new request's first chunk waits for the next step).
The clients record when they read each chunk, so every gap can be compared with the server's own gap.

Figures per run: client CPU µs per chunk, chunks/s received, ITL error (|client gap - server gap|) p50/p99,
lag (client read - server write) p99, and the client's self-check verdict.

    python -m benchmarks.loadgen                 # every scenario (about 2 minutes on 2 cores)
    python -m benchmarks.loadgen --quick         # smaller runs
    python -m benchmarks.loadgen serve --port 0  # only the server (prints its port)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

REPO = Path(__file__).resolve().parents[1]

_CHUNK_JSON = (
    '{"id":"cmpl-8f1e2d3c4b5a69788796a5b4c3d2e1f0","object":"text_completion","created":1733000000,'
    '"model":"bench","choices":[{"index":0,"text":" word","logprobs":null,"finish_reason":null,'
    '"stop_reason":null}],"usage":null}'
)


def _frame(payload: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(payload), payload)


_EVENT = _frame(b"data: " + _CHUNK_JSON.encode() + b"\n\n")
_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
    b"Connection: keep-alive\r\n\r\n"
)


# ----------------------------------------------------------------------------------------------
# Server
# ----------------------------------------------------------------------------------------------


class _Stepper:
    """One engine-step clock: every ``period`` seconds, each registered stream writes its next chunk."""

    def __init__(self, period: float) -> None:
        self.period = period
        self.streams: list[Callable[[], bool]] = []
        self.running = False

    def add(self, step: Callable[[], bool]) -> None:
        self.streams.append(step)
        if not self.running:
            self.running = True
            loop = asyncio.get_running_loop()
            loop.call_at(loop.time() + self.period, self._tick, loop.time() + self.period)

    def _tick(self, at: float) -> None:
        self.streams = [step for step in self.streams if step()]
        if not self.streams:
            self.running = False
            return
        loop = asyncio.get_running_loop()
        loop.call_at(at + self.period, self._tick, at + self.period)


class _Conn(asyncio.Protocol):
    sends: ClassVar[dict[str, list[float]]] = {}
    steppers: ClassVar[dict[float, _Stepper]] = {}

    def __init__(self) -> None:
        self.buf = b""
        self.transport: Any = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end].decode("latin-1")
            length = 0
            for line in head.split("\r\n")[1:]:
                key, _, value = line.partition(":")
                if key.strip().lower() == "content-length":
                    length = int(value)
            if len(self.buf) < end + 4 + length:
                return
            body = self.buf[end + 4 : end + 4 + length]
            self.buf = self.buf[end + 4 + length :]
            self._handle(head.split(" ")[1], body)

    def _reply(self, status: str, payload: bytes) -> None:
        assert self.transport is not None
        self.transport.write(
            b"HTTP/1.1 %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
            % (status.encode(), len(payload), payload)
        )

    def _handle(self, path: str, body: bytes) -> None:
        if path == "/dump":
            data = json.dumps(_Conn.sends).encode()
            _Conn.sends = {}
            self._reply("200 OK", data)
            return
        if path != "/v1/completions":
            self._reply("404 Not Found", b"{}")
            return
        req = json.loads(body)
        n = int(req["max_tokens"])
        kind, _, ms = str(req["model"]).partition("-")
        pace = float(ms) / 1000.0
        times: list[float] = []
        _Conn.sends[str(req["prompt"])] = times
        assert self.transport is not None
        transport = self.transport
        transport.write(_HEAD)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        usage = json.dumps(
            {"id": "x", "choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": n}},
            separators=(",", ":"),
        ).encode()
        tail = _frame(b"data: " + usage + b"\n\n") + _frame(b"data: [DONE]\n\n") + b"0\r\n\r\n"

        def write() -> bool:
            """Write the next chunk (and the tail after the last); whether more chunks are left."""
            if transport.is_closing():
                return False
            times.append(time.perf_counter())
            transport.write(_EVENT)
            if len(times) < n:
                return True
            transport.write(tail)
            return False

        def send(k: int) -> None:
            if write():
                loop.call_at(t0 + (k + 1) * pace, send, k + 1)

        if kind == "step":
            stepper = _Conn.steppers.setdefault(pace, _Stepper(pace))
            stepper.add(write)
        else:
            send(0)


async def _serve(port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(_Conn, "127.0.0.1", port, backlog=4096)
    print(server.sockets[0].getsockname()[1], flush=True)
    async with server:
        await server.serve_forever()


def serve(port: int) -> None:
    """Run the SSE server until killed."""
    import uvloop

    uvloop.run(_serve(port))


# ----------------------------------------------------------------------------------------------
# The vLLM-bench-style client (aiohttp line iteration + json.loads per chunk, default asyncio loop)
# ----------------------------------------------------------------------------------------------


async def _baseline_one(
    session: Any, url: str, payload: dict[str, Any], sem: asyncio.Semaphore, out: dict[str, list[float]]
) -> None:
    async with sem:
        times: list[float] = []
        async with session.post(url=url, json=payload) as response:
            if response.status == 200:
                async for chunk_bytes in response.content:
                    chunk_bytes = chunk_bytes.strip()
                    if not chunk_bytes:
                        continue
                    chunk = chunk_bytes.decode("utf-8").removeprefix("data: ")
                    if chunk != "[DONE]":
                        data = json.loads(chunk)
                        if choices := data.get("choices"):
                            _ = choices[0].get("text")
                            times.append(time.perf_counter())
                        elif usage := data.get("usage"):
                            _ = usage.get("completion_tokens")
        out[payload["prompt"]] = times


async def _baseline(url: str, payloads: list[dict[str, Any]], streams: int) -> dict[str, list[float]]:
    import aiohttp

    out: dict[str, list[float]] = {}
    sem = asyncio.Semaphore(streams)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        await asyncio.gather(*(_baseline_one(session, url, p, sem, out) for p in payloads))
    return out


# ----------------------------------------------------------------------------------------------
# Driver
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Figures:
    client: str
    streams: int
    pace_ms: float
    step: bool
    chunks: int
    wall_s: float
    cpu_us_per_chunk: float
    chunks_per_s: float
    itl_err_p50_ms: float
    itl_err_p99_ms: float
    lag_p99_ms: float
    itl_p50_client_ms: float
    itl_p50_server_ms: float
    verdict: str


def _pct(xs: list[float], q: float) -> float:
    from autotune.load.metrics import percentile

    return percentile(xs, q)


def _compare(
    client: dict[str, list[float]], server: dict[str, list[float]]
) -> tuple[list[float], list[float], list[float], list[float]]:
    errs: list[float] = []
    lags: list[float] = []
    cgaps: list[float] = []
    sgaps: list[float] = []
    for key, ct in client.items():
        st = server.get(key, [])
        if len(st) != len(ct):
            continue
        for k in range(len(ct)):
            lags.append(ct[k] - st[k])
            if k:
                cg, sg = ct[k] - ct[k - 1], st[k] - st[k - 1]
                errs.append(abs(cg - sg))
                cgaps.append(cg)
                sgaps.append(sg)
    return errs, lags, cgaps, sgaps


def _dump(base: str) -> dict[str, list[float]]:
    import httpx

    with httpx.Client(timeout=30.0) as client:
        data: dict[str, list[float]] = client.post(base + "/dump", content=b"").json()
        return data


def run_scenario(
    base: str,
    client: str,
    streams: int,
    pace_ms: float,
    rounds: int,
    workers: int,
    engine: str = "raw",
    step: bool = False,
) -> Figures:
    """Run ``client`` on ``streams`` concurrent streams, ``rounds`` requests each; compare with the server.

    ``step`` paces the streams on one engine-step clock (vLLM's way) instead of each on its own.
    """
    from autotune.load.client import run_requests
    from autotune.load.workload import RequestSpec

    rng = random.Random(streams)
    n = streams * rounds
    lengths = [rng.randint(50, 150) for _ in range(n)]
    model = f"{'step' if step else 'pace'}-{pace_ms:g}"
    _dump(base)  # clear
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    if client == "baseline":
        payloads = [
            {
                "model": model,
                "prompt": f"req-{i}",
                "max_tokens": lengths[i],
                "stream": True,
                "stream_options": {"include_usage": True},
                "ignore_eos": True,
            }
            for i in range(n)
        ]
        got = asyncio.run(_baseline(base + "/v1/completions", payloads, streams))
        wall = time.perf_counter() - t0
        cpu = time.process_time() - cpu0
        verdict = "n/a"
    else:
        requests = [RequestSpec(prompt=f"req-{i}", input_len=1, output_len=lengths[i]) for i in range(n)]
        result = run_requests(
            base,
            model,
            "completions",
            requests,
            [0.0] * n,
            max_concurrency=streams,
            workers=workers,
            engine="raw" if engine == "raw" else "aiohttp",
        )
        wall = result.duration
        cpu = result.client.cpu_s
        got = {f"req-{r.index}": list(r.chunk_times) for r in result.records}
        verdict = "valid" if result.valid else "INVALID: " + "; ".join(result.problems)
    server = _dump(base)
    chunks = sum(len(v) for v in got.values())
    errs, lags, cgaps, sgaps = _compare(got, server)
    return Figures(
        client=client if client == "baseline" else f"autotune {engine} x{workers}",
        streams=streams,
        pace_ms=pace_ms,
        step=step,
        chunks=chunks,
        wall_s=wall,
        cpu_us_per_chunk=cpu / max(chunks, 1) * 1e6,
        chunks_per_s=chunks / wall,
        itl_err_p50_ms=_pct(errs, 50) * 1e3,
        itl_err_p99_ms=_pct(errs, 99) * 1e3,
        lag_p99_ms=_pct(lags, 99) * 1e3,
        itl_p50_client_ms=_pct(cgaps, 50) * 1e3,
        itl_p50_server_ms=_pct(sgaps, 50) * 1e3,
        verdict=verdict,
    )


def _table(rows: list[Figures]) -> str:
    head = (
        "| client | streams | pace | chunks | chunks/s | CPU µs/chunk | ITL err p50 | ITL err p99 | lag p99 "
        "| ITL p50 client / server | self-check |\n|" + "---|" * 11
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"| {r.client} | {r.streams} | {r.pace_ms:g} ms{' step' if r.step else ''} | {r.chunks} | "
            f"{r.chunks_per_s:,.0f} | "
            f"{r.cpu_us_per_chunk:.1f} | {r.itl_err_p50_ms:.2f} ms | {r.itl_err_p99_ms:.1f} ms | "
            f"{r.lag_p99_ms:.1f} ms | {r.itl_p50_client_ms:.1f} / {r.itl_p50_server_ms:.1f} ms "
            f"| {r.verdict} |"
        )
    return "\n".join(lines)


#: Requests per stream in the saturated (1 ms) scenarios: about 2 s of streaming.
SATURATED_ROUNDS = 10


def main() -> None:
    """Start the server in its own process and run every scenario with both clients."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", nargs="?", default="bench", choices=["bench", "serve"])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--rounds",
        type=int,
        help="requests per stream in every scenario (default: 3, or 2 with --quick; 10 in the "
        "saturated 1 ms ones)",
    )
    parser.add_argument("--json", help="also write the figures to this JSON file")
    parser.add_argument(
        "--only",
        help="run only scenarios whose 'client engine streams@pace[ step] xworkers' (e.g. 'autotune raw "
        "256@20 step x1') contains this",
    )
    args = parser.parse_args()
    if args.mode == "serve":
        serve(args.port)
        return
    rounds = args.rounds or (2 if args.quick else 3)
    scenarios = [
        # (client, engine, streams, pace ms, workers, one step clock for all streams)
        ("autotune", "raw", 256, 1, 1, False),
        ("autotune", "aiohttp", 256, 1, 1, False),
        ("baseline", "", 256, 1, 1, False),
        ("autotune", "raw", 256, 20, 1, False),
        ("autotune", "aiohttp", 256, 20, 1, False),
        ("baseline", "", 256, 20, 1, False),
        ("autotune", "raw", 1024, 20, 1, False),
        ("autotune", "raw", 1024, 20, 2, False),
        ("autotune", "aiohttp", 1024, 20, 2, False),
        ("baseline", "", 1024, 20, 1, False),
        ("autotune", "raw", 1024, 5, 1, False),
        ("autotune", "raw", 1024, 5, 2, False),
        ("autotune", "aiohttp", 1024, 5, 2, False),
        ("baseline", "", 1024, 5, 1, False),
        ("autotune", "raw", 256, 20, 1, True),
        ("autotune", "aiohttp", 256, 20, 1, True),
        ("baseline", "", 256, 20, 1, True),
        ("autotune", "raw", 1024, 20, 1, True),
        ("baseline", "", 1024, 20, 1, True),
    ]
    if args.only:
        scenarios = [
            sc
            for sc in scenarios
            if args.only in f"{sc[0]} {sc[1]} {sc[2]}@{sc[3]}{' step' if sc[5] else ''} x{sc[4]}"
        ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.loadgen", "serve", "--port", str(args.port)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        base = f"http://127.0.0.1:{port}"
        rows = []
        for client, engine, streams, pace, workers, step in scenarios:
            # Saturated (1 ms) runs get more rounds: 3 would end in under a second, and the client's
            # self-check judges only runs of a second and more.
            n = max(rounds, SATURATED_ROUNDS) if pace < 2 and not args.rounds else rounds
            fig = run_scenario(base, client, streams, pace, n, workers, engine, step)
            rows.append(fig)
            print(_table([fig]).splitlines()[-1], flush=True)
        print()
        print(_table(rows))
        if args.json:
            with open(args.json, "w", encoding="utf-8") as fh:
                json.dump([r.__dict__ for r in rows], fh, indent=1)
    finally:
        proc.terminate()
        proc.wait(10)


if __name__ == "__main__":
    main()
