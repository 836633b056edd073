"""Cost of the simulated vLLM server: server CPU per streamed token, and in-process evaluation time.

Usage: ``python -m benchmarks.sim_cost [--streams 256] [--requests 1024] [--speedup 2] [--write]``.

1. Starts ``python -m autotune.sim`` (Llama-3.1-8B on the RTX-4090 profile, max_model_len 2048,
   max_num_seqs = streams) and drives it with ``--streams`` concurrent streaming completions
   (prompts of 256 words, 128 output tokens, ignore_eos) from an aiohttp client in this process. The
   server's CPU time (user + system, from /proc via psutil) over the run is divided by the generated
   tokens counted by its /metrics.
2. Replays 300 Poisson arrivals against the server at speedup 1 and compares its TTFT/TPOT with
   :func:`autotune.sim.simulate` on the same arrivals.
3. Times :func:`autotune.sim.simulate` on a 1,000-request workload of the demo shape (inputs 128-512,
   outputs 32-128) at a Poisson rate of 10 req/s and with all requests at once (CPU seconds).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import aiohttp
import httpx
import psutil

from autotune.sim import SimResult, WorkloadRequest, simulate, synthetic_workload
from autotune.sim.model import percentile
from benchmarks import QUICK_HELP


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    match = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} ([\d.e+-]+)$", text, re.M)
    assert match, f"no {name} in /metrics"
    return float(match.group(1))


@contextmanager
def _server(extra: list[str]) -> Iterator[tuple[str, int]]:
    """A simulated demo server (Llama-3.1-8B, RTX-4090-24GB); yields (url, pid); stopped afterwards."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "autotune.sim", "Llama-3.1-8B", "--sim-hardware", "RTX-4090-24GB",
           "--max-model-len", "2048", "--sim-start-delay", "0.5", "--sim-seed", "0", *extra,
           "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError("simulated server did not start")
            time.sleep(0.05)
        yield url, proc.pid
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


async def _drive(url: str, streams: int, requests: int) -> tuple[int, float]:
    body = {"prompt": "word " * 256, "max_tokens": 128, "ignore_eos": True, "stream": True}
    remaining = requests
    chunks = 0

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal remaining, chunks
        while remaining > 0:
            remaining -= 1
            async with session.post(f"{url}/v1/completions", json=body) as response:
                async for line in response.content:
                    if line.startswith(b"data: {"):
                        chunks += 1

    connector = aiohttp.TCPConnector(limit=streams)
    started = time.perf_counter()
    async with aiohttp.ClientSession(connector=connector) as session:
        await asyncio.gather(*(worker(session) for _ in range(streams)))
    return chunks, time.perf_counter() - started


def server_cost(streams: int, requests: int, speedup: float) -> dict[str, float]:
    """Server CPU microseconds per generated token under ``streams`` concurrent streams."""
    with _server(["--max-num-seqs", str(streams), "--sim-speedup", str(speedup)]) as (url, pid):
        ps = psutil.Process(pid)
        before_user, before_sys = ps.cpu_times()[:2]
        before_tokens = _metric(url, "vllm:generation_tokens_total")
        client_before = time.process_time()
        chunks, wall = asyncio.run(_drive(url, streams, requests))
        client_cpu = time.process_time() - client_before
        after_user, after_sys = ps.cpu_times()[:2]
        server_user, server_sys = after_user - before_user, after_sys - before_sys
        server_cpu = server_user + server_sys
        tokens = _metric(url, "vllm:generation_tokens_total") - before_tokens
    return {
        "tokens": tokens,
        "chunks": chunks,
        "wall_s": wall,
        "tok_per_s": tokens / wall,
        "server_cpu_s": server_cpu,
        "server_us_per_token": 1e6 * server_cpu / tokens,
        "server_user_us_per_token": 1e6 * server_user / tokens,
        "server_sys_us_per_token": 1e6 * server_sys / tokens,
        "client_us_per_token": 1e6 * client_cpu / tokens,
    }


def eval_cost(requests: int = 1000, repeats: int = 3) -> dict[str, float]:
    """CPU seconds of simulate() on ``requests`` requests (Poisson 10 req/s, and all at once), the least
    of ``repeats`` runs."""
    out = {}
    for label, rate in (("rate10", 10.0), ("inf", math.inf)):
        wl = synthetic_workload(requests, seed=1)
        best = math.inf
        for _ in range(repeats):
            t = time.process_time()
            result = simulate({"max_model_len": 2048}, "RTX-4090-24GB", "Llama-3.1-8B", wl, rate=rate)
            best = min(best, time.process_time() - t)
        assert len(result.requests) == requests
        out[f"eval_{label}_cpu_s"] = best
    return out


async def _replay(url: str, workload: list[WorkloadRequest]) -> list[tuple[float, float, int]]:
    """Send each request at its arrival time; (TTFT, E2EL, chunks) per request, as bench serve measures."""
    out: list[tuple[float, float, int]] = []

    async def one(session: aiohttp.ClientSession, w: WorkloadRequest, start: float) -> None:
        await asyncio.sleep(max(0.0, start + w.arrival - time.perf_counter()))
        body = {"prompt": "w " * w.prompt_len, "max_tokens": w.output_len, "ignore_eos": True, "stream": True}
        sent = time.perf_counter()
        times = []
        async with session.post(f"{url}/v1/completions", json=body) as response:
            async for line in response.content:
                if line.startswith(b'data: {"id"') and b'"choices":[{' in line:
                    times.append(time.perf_counter())
        out.append((times[0] - sent, times[-1] - sent, len(times)))

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        start = time.perf_counter() + 0.1
        await asyncio.gather(*(one(session, w, start) for w in workload))
    return out


def agreement(rate: float = 10.0, n: int = 300) -> list[str]:
    """Markdown rows: the HTTP server (speedup 1) against simulate() on the same Poisson arrivals."""
    workload = synthetic_workload(n, rate=rate, seed=5)
    with _server(["--max-num-seqs", "256", "--sim-speedup", "1"]) as (url, _):
        measured = asyncio.run(_replay(url, workload))
        lag = _metric(url, "autotune_sim:lag_seconds_total")
    sim = simulate({"max_model_len": 2048}, "RTX-4090-24GB", "Llama-3.1-8B", workload)
    ttft = [m[0] for m in measured]
    tpot = [(m[1] - m[0]) / (m[2] - 1) for m in measured if m[2] > 1]
    rows = []
    for name, values in (("ttft", ttft), ("tpot", tpot)):
        for q in (50, 95):
            http, model = percentile(values, q) * 1000, sim.stat(name, q) * 1000
            rows.append(
                f"| {name} p{q} | {http:.1f} ms | {model:.1f} ms | {100 * (http / model - 1):+.1f} % |"
            )
    rows.append(f"| engine-loop lag (autotune_sim:lag_seconds_total) | {lag:.3f} s | | |")
    return rows


def _slo_run(flags: dict[str, object], workload: list[WorkloadRequest]) -> SimResult | None:
    """The run at the highest Poisson rate meeting ttft:p95<=500ms and tpot:p95<=50ms (bisection)."""
    lo, hi, best = 0.0, 32.0, None
    for _ in range(8):
        mid = (lo + hi) / 2
        result = simulate({"max_model_len": 2048, **flags}, "RTX-4090-24GB", "Llama-3.1-8B", workload,
                          rate=mid, seed=7)  # fmt: skip
        if not result.ok:
            return result
        good = result.failed == 0 and result.stat("ttft", 95) <= 0.5 and result.stat("tpot", 95) <= 0.05
        if good:
            lo, best = mid, result
        else:
            hi = mid
    return best


def demo_landscape(requests: int = 600, most: int | None = None) -> list[str]:
    """Markdown rows: SLO-constrained throughput of a few demo configs (the first ``most``; in-process,
    virtual time)."""
    workload = synthetic_workload(requests, seed=1)
    rows = []
    sweep: list[dict[str, object]] = [
        {"max_num_seqs": s, "max_num_batched_tokens": 512, "gpu_memory_utilization": u}
        for u in (0.8, 0.9)
        for s in (16, 32, 64, 128, 512)
    ]
    configs: list[dict[str, object]] = [*sweep,
        {"max_num_seqs": 64, "max_num_batched_tokens": 2048},
        {"max_num_seqs": 64, "max_num_batched_tokens": 8192},
        {"max_num_seqs": 64, "max_num_batched_tokens": 512, "kv_cache_dtype": "fp8"},
        {"max_num_seqs": 256, "max_num_batched_tokens": 2048, "gpu_memory_utilization": 0.98},
        {"enable_chunked_prefill": False, "max_num_batched_tokens": 1024},
    ]  # fmt: skip
    for flags in configs[:most]:
        result = _slo_run(flags, workload)
        shown = ", ".join(f"{k}={v}" for k, v in flags.items())
        if result is None:
            rows.append(f"| {shown} | no rate meets the SLOs | | | |")
        elif not result.ok:
            rows.append(f"| {shown} | start fails: {result.failure} | | | |")
        else:
            rows.append(
                f"| {shown} | {result.output_throughput:,.0f} | {result.stat('ttft', 95) * 1000:.0f} | "
                f"{result.stat('tpot', 95) * 1000:.1f} | {result.kv_tokens:,} |"
            )
    return rows


def main() -> None:
    """Run both measurements and print them as Markdown (the section of benchmarks/RESULTS.md)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--requests", type=int, default=1024)
    parser.add_argument("--speedup", type=float, default=2.0)
    parser.add_argument("--quick", action="store_true", help=QUICK_HELP)
    args = parser.parse_args()
    if args.quick:
        args.streams, args.requests = 16, 32
    srv = server_cost(args.streams, args.requests, args.speedup)
    ev = eval_cost(200, 1) if args.quick else eval_cost()
    lines = [
        "## Simulated server (`benchmarks/sim_cost.py`)",
        "",
        f"Measured {time.strftime('%Y-%m-%d')} on this machine ({psutil.cpu_count()} cores, Python "
        f"{sys.version.split()[0]}), `python -m benchmarks.sim_cost --streams {args.streams} "
        f"--requests {args.requests} --speedup {args.speedup:g}`.",
        "",
        "| measurement | result |",
        "|---|---|",
        f"| server CPU per streamed token, {args.streams} concurrent streams | "
        f"{srv['server_us_per_token']:.1f} µs ({srv['server_user_us_per_token']:.1f} user + "
        f"{srv['server_sys_us_per_token']:.1f} system) |",
        f"| streamed throughput during that run (server + client on the same cores) | "
        f"{srv['tok_per_s']:,.0f} tok/s ({srv['tokens']:,.0f} tokens in {srv['wall_s']:.1f} s) |",
        f"| client (aiohttp, this process) CPU per token | {srv['client_us_per_token']:.1f} µs |",
        f"| `simulate()` 1,000 requests, Poisson 10 req/s (CPU) | {ev['eval_rate10_cpu_s'] * 1000:.0f} ms |",
        f"| `simulate()` 1,000 requests, all at once (CPU) | {ev['eval_inf_cpu_s'] * 1000:.0f} ms |",
        "",
        "The HTTP server at speedup 1 against `simulate()` on the same 300 Poisson arrivals (10 req/s,",
        "demo workload, defaults otherwise), latencies measured by an aiohttp client as `vllm bench serve`",
        "defines them:",
        "",
        "| metric | HTTP server | simulate() | difference |",
        "|---|---|---|---|",
        *(agreement(n=20) if args.quick else agreement()),
        "",
        "Demo landscape (Llama-3.1-8B, RTX-4090-24GB, max_model_len 2048, inputs 128-512, outputs 32-128,",
        "Poisson arrivals, 600 requests, in-process): highest throughput meeting ttft:p95<=500ms and",
        "tpot:p95<=50ms. Flags not shown are vLLM's defaults (utilisation 0.9, block 16, chunked",
        "prefill on).",
        "",
        "| flags | output tok/s | p95 TTFT ms | p95 TPOT ms | KV tokens |",
        "|---|---|---|---|---|",
        *(demo_landscape(150, 2) if args.quick else demo_landscape()),
        "",
    ]  # fmt: skip
    text = "\n".join(lines)
    print(text)


if __name__ == "__main__":
    main()
