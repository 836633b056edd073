"""Benchmark: autotune's streaming client against a vLLM-bench-style aiohttp client, side by side.

A fast SSE server (:mod:`benchmarks.sse_server`, non-blocking sockets on uvloop, in its own process, no
prefill delay) streams vLLM-format completion chunks (~230 bytes each) at known times, and records the
perf_counter time of every write (perf_counter is CLOCK_MONOTONIC, shared by all processes), per request
(autotune's by their ``X-Request-Id``, the baseline's by their prompt). The model name sets the pacing:
``pace-<ms>`` paces every stream on its own clock from its own start (streams out of step: each chunk
wakes the client on its own, the worst case for a client's CPU per chunk); ``step-<ms>`` paces all
streams on one engine-step clock, as vLLM does (every running sequence gets its token in the same step,
so the chunks of one step leave together and a new request's first chunk waits for the next step).
The clients record when they read each chunk, so every gap can be compared with the server's own gap.

Figures per run: client CPU µs per chunk, chunks/s received, ITL error (|client gap - server gap|) p50/p99,
lag (client read - server write) p99, and the client's self-check verdict.

    python -m benchmarks.loadgen                 # every scenario (about 2 minutes on 2 cores)
    python -m benchmarks.loadgen --quick         # the 256-stream 20 ms scenarios, 1 round (seconds)
    python -m benchmarks.loadgen serve --port 0  # only the server (prints its port)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass
from typing import Any

from benchmarks import QUICK_HELP, sse_server

#: The server's chunk: a full-length completion id, as vLLM's (about 230 bytes an event).
_EVENT = sse_server.chunk_event("cmpl-8f1e2d3c4b5a69788796a5b4c3d2e1f0", "bench")


def serve(port: int) -> None:
    """Run the SSE server (:mod:`benchmarks.sse_server`, no prefill delay, these chunks) until killed."""
    sse_server.serve(port, sse_server.Options(prefill_s=0.0, event=_EVENT))


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
    """The server's write times per request since the last dump (the baseline's requests by prompt)."""
    return {key: got["writes"] for key, got in sse_server.dump(base).items()}


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
    from autotune.load.client import load_job, run_requests
    from autotune.load.request import RequestSpec

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
            load_job(
                base,
                model,
                "completions",
                requests,
                [0.0] * n,
                max_concurrency=streams,
                engine="raw" if engine == "raw" else "aiohttp",
            ),
            workers=workers,
        )
        wall = result.duration
        cpu = result.client.cpu_s
        got = {r.request_id: list(r.chunk_times) for r in result.records}
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
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_HELP}: the 256-stream 20 ms scenarios")
    parser.add_argument(
        "--rounds",
        type=int,
        help="requests per stream in every scenario (default: 3, or 1 with --quick; 10 in the "
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
    rounds = args.rounds or (1 if args.quick else 3)
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
    if args.quick:
        scenarios = [sc for sc in scenarios if sc[2:4] == (256, 20) and not sc[5]]
    if args.only:
        scenarios = [
            sc
            for sc in scenarios
            if args.only in f"{sc[0]} {sc[1]} {sc[2]}@{sc[3]}{' step' if sc[5] else ''} x{sc[4]}"
        ]
    serve_argv = [sys.executable, "-m", "benchmarks.loadgen", "serve", "--port", str(args.port)]
    with sse_server.running(serve_argv) as base:
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


if __name__ == "__main__":
    main()
