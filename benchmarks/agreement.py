"""Agreement with a real peer: our client's TTFT/TPOT/ITL/E2EL against ``vllm bench serve`` on ONE server.

Same server, same prompts in kind and length (text, fixed input/output tokens, ``ignore_eos``,
temperature 0): by default the peer reads prompts made by our builder (calibrated through ``/tokenize``)
as a ShareGPT file, so only the clients differ.

Together mode (the default): both clients run at the same time, each at half the rate, and ours is
compared over the peer's own window (its ``start_times``, on the shared monotonic clock), so the server's
drifting speed is the same for both. Each draws its own Poisson arrivals (rescaled to the nominal rate):
two uniform schedules side by side would keep one phase for the whole run, and the server would then
serve one client's requests first every time. With root or CAP_NET_RAW, ``benchmarks/wiretap.py`` records
the kernel's timestamps of every request and content chunk on ``lo``: the wire's own TTFT and E2EL, so
"client minus wire" is what each client added itself.

Interleaved mode (needs the wire): uniform schedules, each request of ours sent halfway between two of
the peer's, started from the peer's first request as the wire sees it. Each client's request then meets
the same server state (the other client's previous request started half a period before), so the
server treats both alike and what remains between them is their own clients. Sent at the same time
instead, the server serves one of a pair first, by a whole prefill.

Alternate mode: one client after the other at the full rate (``vllm bench serve`` first in even
repetitions, ours first in odd ones), by default on the same uniform schedule; the server's speed drifts
between runs on a shared CPU box, which swamps a 5% comparison.

Each repetition has a fresh seed; each statistic is compared as the median over repetitions, and the
spread of repeated runs of the SAME client ((max - min) / median over repetitions) is the noise floor.

Usage (real vLLM on the CPU; a model built by tests/vllm/make_tiny_model.py, ``--hidden 512 --layers 4``
for TTFTs in the tens of milliseconds)::

    .venv/bin/python -m benchmarks.agreement --server vllm --model-dir /tmp/small --mode interleaved \\
        --reps 3 --rate 3 --num-prompts 120 --input-len 512 --output-len 64 --out /tmp/agreement.json

``--url URL --served-model NAME`` measures a server that is already running instead of launching one.
``--server sim`` launches the simulated server (``python -m autotune.sim``) and points ``vllm bench
serve`` at the tiny model's tokenizer. Results: benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from autotune.inputs.spec import ArrivalSpec, DatasetSpec, LengthDist, WorkloadSpec
from autotune.load import prom
from autotune.load.aio import run_sync
from autotune.load.calibrate import PromptCalibration, calibrate_workload
from autotune.load.client import load_job, run_requests, run_requests_async
from autotune.load.metrics import summarize
from autotune.load.records import RequestRecord, RunResult
from autotune.load.workload import RequestSpec, arrival_times, build_requests
from autotune.server.launcher import ServerProcess
from autotune.study.trial import free_port
from benchmarks import QUICK_HELP
from benchmarks.vllm_cpu import launch_env, launch_vars, vllm_python
from benchmarks.wiretap import WireRequest, Wiretap

REPO = Path(__file__).resolve().parents[1]

METRICS = ("ttft", "tpot", "itl", "e2el")
STATS = ("mean", "median", "p90", "p99")
TOLERANCE = 0.05
#: Below this many milliseconds two values agree whatever their ratio (e.g. ITL medians of 0 ms when the
#: server writes several tokens in one network read: both clients then see zero gaps).
ABS_FLOOR_MS = 0.5


def vllm_env(work: Path) -> dict[str, str]:
    """The launch environment of tests/vllm (offline, caches under ``work``, one engine process)."""
    return launch_env(launch_vars(work))


@contextmanager
def launched(kind: str, model_dir: Path, work: Path) -> Iterator[tuple[str, str]]:
    """Start the server (``vllm`` or ``sim``) on a free port; yield ``(base_url, served model)``."""
    port = free_port("127.0.0.1")
    if kind == "vllm":
        served = str(model_dir)
        argv = [
            str(vllm_python()),
            *("-m", "vllm.entrypoints.cli.main", "serve", served, "--enforce-eager"),
            *("--host", "127.0.0.1", "--port", str(port)),
            *("--max-model-len", "2048", "--kv-cache-memory-bytes", "1G"),
        ]
        env: dict[str, str | None] = dict(vllm_env(work))
        timeout = 300.0
    else:
        served = "Llama-3.1-8B"
        argv = [
            sys.executable,
            *("-m", "autotune.sim", served, "--sim-hardware", "H100-80GB", "--sim-start-delay", "0.2"),
            *("--sim-seed", "1", "--max-model-len", "2048", "--host", "127.0.0.1", "--port", str(port)),
        ]
        env = {}
        timeout = 60.0
    with ServerProcess(
        argv, env=env, log_path=work / f"{kind}-server.log", host="127.0.0.1", port=port, model=served
    ) as proc:
        proc.wait_ready(timeout)
        yield f"http://127.0.0.1:{port}", served


#: Server-side histograms (vLLM's own clock): the witness of whether the server itself was slower.
SERVER_HISTOGRAMS = {
    "ttft": "vllm:time_to_first_token_seconds",
    "itl": "vllm:inter_token_latency_seconds",
    "e2el": "vllm:e2e_request_latency_seconds",
    "queue": "vllm:request_queue_time_seconds",
    "prefill": "vllm:request_prefill_time_seconds",
    "decode": "vllm:request_decode_time_seconds",
}


@contextmanager
def server_side(url: str, into: dict[str, Any]) -> Iterator[None]:
    """Mean of each of :data:`SERVER_HISTOGRAMS` over the block, in ms, from /metrics before and after."""
    with httpx.Client(timeout=5.0) as client:
        before = prom.scrape(client, url)
        yield
        after = prom.scrape(client, url)
    for short, name in SERVER_HISTOGRAMS.items():
        total = (after.sum(name + "_sum") or 0.0) - (before.sum(name + "_sum") or 0.0)
        count = (after.sum(name + "_count") or 0.0) - (before.sum(name + "_count") or 0.0)
        into[f"server_mean_{short}_ms"] = total / count * 1e3 if count else None


def run_peer(
    url: str,
    served: str,
    tokenizer: Path,
    args: argparse.Namespace,
    seed: int,
    out: Path,
    work: Path,
    rate: float,
) -> dict[str, Any]:
    """One ``vllm bench serve`` run at ``rate``; returns its ``--save-result --save-detailed`` JSON (with
    each request's ``start_times`` on the shared monotonic clock) plus the wall time it took."""
    name = f"peer-{seed}.json"
    if args.peer_prompts == "ours":
        prompts = peer_prompt_file(url, served, args, seed, work)
        dataset = [
            *("--dataset-name", "sharegpt", "--dataset-path", str(prompts), "--disable-shuffle"),
            *("--sharegpt-output-len", str(args.output_len)),
        ]
    else:
        dataset = [
            *("--dataset-name", "random", "--random-input-len", str(args.input_len)),
            *("--random-output-len", str(args.output_len), "--random-range-ratio", "0"),
        ]
    cmd = [
        str(vllm_python()),
        *("-m", "vllm.entrypoints.cli.main", "bench", "serve"),
        *("--backend", "vllm", "--base-url", url, "--model", served, "--tokenizer", str(tokenizer)),
        *dataset,
        *("--ignore-eos", "--temperature", "0", "--request-rate", str(rate)),
        *("--ready-check-timeout-sec", "0"),  # no test request first (0.32's default, made explicit)
        *(("--burstiness", "inf") if args.arrivals == "uniform" else ()),
        *("--num-prompts", str(args.num_prompts), "--seed", str(seed)),
        *("--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99"),
        *("--disable-tqdm", "--save-result", "--save-detailed"),
        *("--result-dir", str(out), "--result-filename", name),
    ]
    t0 = time.monotonic()
    log = work / f"peer-{seed}.log"
    server: dict[str, Any] = {}
    with log.open("wb") as fh, server_side(url, server):
        proc = subprocess.run(cmd, env=vllm_env(work), stdout=fh, stderr=subprocess.STDOUT, check=False)
    if proc.returncode != 0:
        tail = log.read_text(errors="replace").splitlines()[-20:]
        raise RuntimeError(f"vllm bench serve exited {proc.returncode}:\n" + "\n".join(tail))
    data: dict[str, Any] = json.loads((out / name).read_text())
    data["wall_s"] = time.monotonic() - t0
    data.update(server)
    return data


def our_workload(args: argparse.Namespace, seed: int) -> WorkloadSpec:
    """The benchmark's workload as an autotune spec: fixed lengths, ``ignore_eos``, temperature 0."""
    return WorkloadSpec(
        endpoint="completions",
        dataset=DatasetSpec(
            kind="synthetic",
            input_len=LengthDist(dist="fixed", value=args.input_len),
            output_len=LengthDist(dist="fixed", value=args.output_len),
        ),
        arrival=ArrivalSpec(process="poisson"),
        ignore_eos=True,
        seed=seed,
        temperature=0.0,
        prompt_format=args.prompt_format,
    )


@functools.cache
def _calibration(url: str, served: str, endpoint: str, prompt_format: str) -> PromptCalibration | None:
    workload = WorkloadSpec.model_validate({"endpoint": endpoint, "prompt_format": prompt_format})
    return calibrate_workload(url, served, workload, None)


def calibrated(url: str, served: str, workload: WorkloadSpec) -> PromptCalibration | None:
    """The server's prompt calibration for ``workload``, measured once per server and prompt kind."""
    return _calibration(url, served, workload.endpoint, workload.prompt_format)


def our_requests(
    url: str, served: str, args: argparse.Namespace, seed: int, n: int, rate: float
) -> tuple[list[RequestSpec], list[float]]:
    """Our ``n`` prompts (calibrated text, or token ids) and send offsets at ``rate``, after one warm-up."""
    workload = our_workload(args, seed)
    cal = calibrated(url, served, workload)
    fmt = args.prompt_format
    warm = build_requests(workload, 1, -1, REPO, prompt_format=fmt, calibration=cal)
    run_requests(load_job(url, served, "completions", warm, [0.0], ignore_eos=True, temperature=0.0))
    requests = build_requests(workload, n, seed, REPO, prompt_format=fmt, calibration=cal)
    if args.arrivals == "uniform":  # the peer's --burstiness inf: a request every 1/rate seconds
        arrivals = [i / rate for i in range(n)]
    else:
        arrivals = arrival_times(workload.arrival, rate, n, seed)
    return requests, arrivals


def peer_prompt_file(url: str, served: str, args: argparse.Namespace, seed: int, work: Path) -> Path:
    """Prompts made by our builder (calibrated text, another seed than ours) as a ShareGPT file for the
    peer (its ``custom`` JSONL dataset needs pandas, which vllm-cpu does not install)."""
    workload = our_workload(args, seed).model_copy(update={"prompt_format": "text"})
    cal = calibrated(url, served, workload)
    requests = build_requests(workload, args.num_prompts, seed + PEER_SEED_OFFSET, REPO, calibration=cal)
    path = work / f"peer-prompts-{seed}.json"
    rows = [
        {"conversations": [{"from": "human", "value": r.prompt}, {"from": "gpt", "value": "-"}]}
        for r in requests
    ]
    path.write_text(json.dumps(rows))
    return path


#: The peer's prompts come from this seed offset, so the two clients never send the same prompt (no
#: prefix-cache hits across clients).
PEER_SEED_OFFSET = 1000


def our_summary(run: RunResult, records: list[RequestRecord], duration: float) -> dict[str, Any]:
    """``vllm bench serve`` keys over ``records`` plus our client's self-check witnesses."""
    return {
        **summarize(records, duration, None).to_bench_json(),
        "problems": list(run.problems),
        "client_cpu_s": run.client.cpu_s,
        "loop_lag_p99_ms": run.client.lag_p99_s * 1e3,
        "chunk_lag_p99_ms": run.client.chunk_lag_p99_s * 1e3,
        "server_bursts": run.server_bursts,
        "chunks_per_token": run.chunks_per_token,
    }


def run_ours(url: str, served: str, args: argparse.Namespace, seed: int, out: Path) -> dict[str, Any]:
    """One run of our client alone with the same lengths, rate and count; returns ``vllm bench serve``
    keys."""
    requests, arrivals = our_requests(url, served, args, seed, args.num_prompts, args.rate)
    t0 = time.monotonic()
    server: dict[str, Any] = {}
    with server_side(url, server):
        run = run_requests(
            load_job(url, served, "completions", requests, arrivals, ignore_eos=True, temperature=0.0)
        )
    data = {**our_summary(run, list(run.records), run.duration), "wall_s": time.monotonic() - t0, **server}
    (out / f"ours-{seed}.json").write_text(json.dumps(data, indent=1) + "\n")
    return data


#: Seconds of our schedule planned beyond the peer's in ``together`` mode (the peer takes several seconds
#: to import vLLM and send its warm-up request before its own schedule starts); ours stops ``TAIL_S``
#: after the peer exits.
TOGETHER_MARGIN_S = 60.0
TAIL_S = 3.0


def run_together(
    url: str, served: str, args: argparse.Namespace, seed: int, out: Path
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Both clients at once, each at half the rate: the server's state is the same for both.

    Together mode: our client sends from before the peer starts until after it ends; only our requests
    sent inside the peer's own window (its first to last send, read from its ``start_times`` on the same
    monotonic clock) are compared. Interleaved mode: the wire announces the peer's first request (it runs
    with no ready-check request), and ours follow the peer's uniform schedule half a period behind it:
    each client's request meets the other's previous one started half a period before (a symmetric
    phase; sent at the same time instead, the server serves one of a pair first, by a whole prefill).
    Returns ``(peer, ours)``.
    """
    half = args.rate / 2
    n = args.num_prompts
    interval = 1 / half  # the peer's uniform schedule: request i at its start + (i + 1) / rate
    interleaved = args.mode == "interleaved"
    tap = open_wiretap(url, announce=("peer", 1) if interleaved else ("", 0)) if args.wire else None
    if interleaved and tap is None:
        raise SystemExit("--mode interleaved needs the wire (root or CAP_NET_RAW) to see the peer's requests")
    if interleaved:
        requests, _ = our_requests(url, served, args, seed, n - 1, half)
        arrivals = [i * interval for i in range(n - 1)]
    else:
        span = args.num_prompts / half + TOGETHER_MARGIN_S
        requests, arrivals = our_requests(url, served, args, seed, math.ceil(span * half), half)
    result: list[RunResult] = []
    peer_done = threading.Event()
    offset = time.time() - time.perf_counter()  # wire (CLOCK_REALTIME) minus the clients' clock

    def ours() -> None:
        stop = lambda _: "the peer has finished" if peer_done.is_set() else None  # noqa: E731
        start_at: Callable[[], float] | None = None
        if interleaved:
            assert tap is not None
            announced = tap

            def peer_start() -> float:  # called once our connections are open and warmed
                return float(announced.next_announced(PEER_START_TIMEOUT_S) - offset + interval / 2)

            start_at = peer_start

        result.append(
            run_sync(
                lambda: run_requests_async(
                    load_job(
                        url, served, "completions", requests, arrivals, ignore_eos=True, temperature=0.0
                    ),
                    stop=stop,
                    start_at=start_at,
                )
            )
        )

    thread = threading.Thread(target=ours, name="autotune-client")
    server: dict[str, Any] = {}
    with server_side(url, server):
        thread.start()
        try:
            peer = run_peer(url, served, args.model_dir, args, seed, out, args.work, half)
            time.sleep(TAIL_S)  # our last requests inside the peer's window finish
        finally:
            peer_done.set()
            thread.join()
            wire = tap.stop() if tap is not None else []
    if not result:
        raise RuntimeError("our client did not run (see the error above)")
    run = result[0]
    first, last = min(peer["start_times"]), max(peer["start_times"])
    inside, extra = (
        interleaved_records(run, wire, n)
        if interleaved
        else window_records(run, first, last, args.num_prompts)
    )
    ours_data = {**our_summary(run, inside, last - first), **server, **extra}
    peer.update(server)
    window = (first + offset - WIRE_SLACK_S, last + offset + WIRE_SLACK_S)
    for who, data in (("peer", peer), ("ours", ours_data)):
        data.update(wire_stats([w for w in wire if w.client == who and window[0] <= w.sent <= window[1]]))
    (out / f"ours-{seed}.json").write_text(json.dumps(ours_data, indent=1) + "\n")
    return peer, ours_data


def window_records(
    run: RunResult, first: float, last: float, num_prompts: int
) -> tuple[list[RequestRecord], dict[str, Any]]:
    """Together mode: our requests sent inside the peer's window ``[first, last]`` (no extra keys)."""
    inside = [r for r in run.records if first <= r.send_time <= last]
    # About num_prompts of ours fall inside the peer's window (Poisson: give or take 2 sqrt(n)).
    if len(inside) < num_prompts - 4 * math.sqrt(num_prompts):
        raise RuntimeError(
            f"only {len(inside)} of our requests fell inside the peer's window: raise TOGETHER_MARGIN_S"
        )
    return inside, {}


def interleaved_records(
    run: RunResult, wire: list[WireRequest], n: int
) -> tuple[list[RequestRecord], dict[str, Any]]:
    """Interleaved mode: all our requests (request i went halfway between the peer's i and i + 1), checked
    on the wire (what the server saw, each client's own send overhead included) to have arrived there, with
    how far from halfway they went (``skew_*_ms``)."""
    inside = list(run.records)
    peer_sent = sorted(w.sent for w in wire if w.client == "peer")
    ours_sent = sorted(w.sent for w in wire if w.client == "ours" and peer_sent and w.sent > peer_sent[0])
    pairs = zip(ours_sent, itertools.pairwise(peer_sent), strict=False)
    skew = sorted(abs(ours - (a + b) / 2) * 1e3 for ours, (a, b) in pairs)
    if len(inside) < n - 1 - 2 or not skew or statistics.median(skew) > MAX_SKEW_MS:
        raise RuntimeError(
            f"interleaving failed: {len(inside)} of {n - 1} of ours finished, median send skew on the wire "
            f"{statistics.median(skew) if skew else math.nan:.1f} ms from halfway (limit {MAX_SKEW_MS:g} ms)"
        )
    return inside, {
        "skew_median_ms": statistics.median(skew),
        "skew_p90_ms": skew[int(0.9 * (len(skew) - 1))],
    }


#: Interleaved mode: how long to wait for the peer's first request on the wire (it imports vLLM first).
PEER_START_TIMEOUT_S = 180.0
#: Interleaved mode: the largest median distance of our sends from halfway between the peer's.
MAX_SKEW_MS = 5.0


#: Seconds of slack around the peer's window when picking wire requests (the clocks are read apart).
WIRE_SLACK_S = 0.002


def open_wiretap(url: str, announce: tuple[str, int] = ("", 0)) -> Wiretap | None:
    """A started :class:`~wiretap.Wiretap` on the server's port, or ``None`` without CAP_NET_RAW."""
    tap = Wiretap(int(url.rsplit(":", 1)[1]), classify_body, announce=announce)
    try:
        tap.start()
    except PermissionError:
        print("wire timestamps skipped: a raw socket on lo needs root or CAP_NET_RAW", flush=True)
        return None
    return tap


def classify_body(body: bytes) -> str:
    """Which client sent a request: ours writes compact JSON, the peer's aiohttp ``json=`` does not."""
    if b'"model":"' in body:
        return "ours"
    return "peer" if b'"model": "' in body else "unknown"


def wire_stats(requests: list[WireRequest]) -> dict[str, Any]:
    """The wire's TTFT and E2EL (first and last content packet after the request) over ``requests``."""
    ttft = [r.ttft * 1e3 for r in requests if r.ttft is not None]
    e2el = [r.e2el * 1e3 for r in requests if r.e2el is not None]
    if not ttft or not e2el:
        return {}
    return {
        "wire_requests": len(ttft),
        "wire_median_ttft_ms": statistics.median(ttft),
        "wire_mean_ttft_ms": statistics.fmean(ttft),
        "wire_median_e2el_ms": statistics.median(e2el),
        "wire_mean_e2el_ms": statistics.fmean(e2el),
        # Where the wire's TTFT goes: headers to body (the client's two writes), body to the response's
        # headers (the API server), response headers to the first content chunk (the engine).
        "wire_median_body_gap_ms": statistics.median((r.body - r.sent) * 1e3 for r in requests),
        "wire_median_to_head_ms": statistics.median(
            (r.head - r.body) * 1e3 for r in requests if r.head is not None
        ),
        "wire_median_head_to_first_ms": statistics.median(
            (r.first - r.head) * 1e3 for r in requests if r.head is not None and r.first is not None
        ),
    }


def key(metric: str, stat: str) -> str:
    """The ``--save-result`` key of a statistic (``median_ttft_ms``, ``p90_itl_ms`` ...)."""
    return f"{stat}_{metric}_ms"


def spread(values: list[float]) -> float:
    """(max - min) / median: how far repeated runs of one client fall apart (0.0 for one run)."""
    mid = statistics.median(values)
    if len(values) < 2 or mid <= ABS_FLOOR_MS:
        return 0.0
    return (max(values) - min(values)) / mid


def compare(peer: list[dict[str, Any]], ours: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per metric and statistic: both medians over repetitions, their ratio, agreement, noise floors."""
    rows = []
    for metric in METRICS:
        for stat in STATS:
            k = key(metric, stat)
            p = [float(r[k]) for r in peer]
            o = [float(r[k]) for r in ours]
            mp, mo = statistics.median(p), statistics.median(o)
            both_tiny = mp <= ABS_FLOOR_MS and mo <= ABS_FLOOR_MS
            ratio = mo / mp if mp > 0 else (1.0 if mo == 0 else math.inf)
            rows.append(
                {
                    "metric": metric,
                    "stat": stat,
                    "peer_ms": mp,
                    "ours_ms": mo,
                    "ratio": ratio,
                    "agree": both_tiny or abs(ratio - 1.0) <= TOLERANCE,
                    "peer_runs": p,
                    "ours_runs": o,
                    "peer_spread": spread(p),
                    "ours_spread": spread(o),
                }
            )
    return rows


def render(result: dict[str, Any]) -> str:
    """A markdown table of :func:`compare`'s rows."""
    lines = [
        "| metric | stat | vllm bench serve (ms) | autotune (ms) | ratio | within 5% "
        "| spread peer | spread ours |",
        "|---|---|---:|---:|---:|:-:|---:|---:|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['metric'].upper()} | {r['stat']} | {r['peer_ms']:.2f} | {r['ours_ms']:.2f} | "
            f"{r['ratio']:.3f} | {'yes' if r['agree'] else 'NO'} | {r['peer_spread']:.1%} | "
            f"{r['ours_spread']:.1%} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", choices=("vllm", "sim"), default="vllm")
    parser.add_argument("--model-dir", type=Path, required=True, help="tiny model (tokenizer for vllm bench)")
    parser.add_argument("--url", default=None, help="measure this running server instead of launching one")
    parser.add_argument("--served-model", default=None, help="model name at --url (default: --model-dir)")
    parser.add_argument("--rate", type=float, default=4.0)
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--mode",
        choices=("together", "interleaved", "alternate"),
        default="together",
        help="together: both clients at once, each at half the rate, compared over the same window; "
        "interleaved: as together on uniform schedules, each request of ours sent halfway between two "
        "of the peer's (started from the peer's first request on the wire: needs root or CAP_NET_RAW), "
        "so each client's requests meet the same server state, the other's previous request started "
        "half a period before; alternate: one after the other at the full rate (the server's speed "
        "drifts between runs)",
    )
    parser.add_argument(
        "--arrivals",
        choices=("poisson", "uniform"),
        help="uniform: one request every 1/rate s (alternate mode's default: both clients send the same "
        "schedule); poisson: each client draws its own Poisson arrivals, rescaled to the nominal rate "
        "(together mode's default: two uniform schedules side by side keep one phase for the whole run, "
        "so the server would serve one client's requests first every time)",
    )
    parser.add_argument(
        "--no-wire",
        dest="wire",
        action="store_false",
        help="together and interleaved modes record kernel timestamps of each request and chunk on lo (needs "
        "root or CAP_NET_RAW) as the ground truth for both clients; this turns it off",
    )
    parser.add_argument(
        "--peer-prompts",
        choices=("ours", "random"),
        default="ours",
        help="ours: the peer sends prompts made by our builder (custom dataset), so only the clients "
        "differ; random: its own random dataset (text decoded from random token ids)",
    )
    parser.add_argument(
        "--prompt-format",
        choices=("text", "token_ids"),
        default="text",
        help="our prompts: text calibrated through /tokenize (as the peer sends text), or token ids",
    )
    parser.add_argument("--work", type=Path, default=Path("/tmp/autotune-agreement"))
    parser.add_argument("--out", type=Path, default=None, help="write the comparison JSON here")
    parser.add_argument(
        "--quick", action="store_true", help=f"{QUICK_HELP}: one rep of 12 short prompts, no wire"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.reps, args.num_prompts, args.rate, args.input_len, args.output_len = 1, 12, 6.0, 32, 8
        args.wire = False
    if args.mode == "interleaved" and args.arrivals == "poisson":
        parser.error("--mode interleaved sends uniform schedules: drop --arrivals poisson")
    if args.arrivals is None:
        args.arrivals = "poisson" if args.mode == "together" else "uniform"
    args.work.mkdir(parents=True, exist_ok=True)
    results = args.work / "results"
    results.mkdir(exist_ok=True)

    @contextmanager
    def server() -> Iterator[tuple[str, str]]:
        if args.url:
            yield args.url.rstrip("/"), args.served_model or str(args.model_dir)
        else:
            with launched(args.server, args.model_dir, args.work) as pair:
                yield pair

    peer: list[dict[str, Any]] = []
    ours: list[dict[str, Any]] = []
    t0 = time.monotonic()

    def show(rep: int, who: str, last: dict[str, Any]) -> None:
        print(
            f"rep {rep + 1} {who}: ttft p50 {last['median_ttft_ms']:.2f} ms, tpot p50 "
            f"{last['median_tpot_ms']:.2f} ms, e2el p50 {last['median_e2el_ms']:.2f} ms, "
            f"{last['completed']} done, in {last['duration']:.1f} s; server-side means: "
            + ", ".join(f"{k} {last.get(f'server_mean_{k}_ms') or 0:.1f}" for k in SERVER_HISTOGRAMS)
            + (
                f"; wire: ttft p50 {last['wire_median_ttft_ms']:.2f} ms, e2el p50 "
                f"{last['wire_median_e2el_ms']:.2f} ms ({last['wire_requests']} requests); ttft parts p50: "
                f"body gap {last['wire_median_body_gap_ms']:.2f}, to response head "
                f"{last['wire_median_to_head_ms']:.2f}, head to first "
                f"{last['wire_median_head_to_first_ms']:.2f}"
                if "wire_requests" in last
                else ""
            )
            + (
                f"; skew from halfway p50 {last['skew_median_ms']:.2f} ms" if "skew_median_ms" in last else ""
            ),
            flush=True,
        )

    with server() as (url, served):
        for rep in range(args.reps):
            seed = rep + 1
            if args.mode in ("together", "interleaved"):
                pair = run_together(url, served, args, seed, results)
                peer.append(pair[0])
                ours.append(pair[1])
                show(rep, "peer", pair[0])
                show(rep, "ours", pair[1])
                continue
            for who in ("peer", "ours") if rep % 2 == 0 else ("ours", "peer"):
                if who == "peer":
                    peer.append(
                        run_peer(url, served, args.model_dir, args, seed, results, args.work, args.rate)
                    )
                else:
                    ours.append(run_ours(url, served, args, seed, results))
                show(rep, who, (peer if who == "peer" else ours)[-1])
    result = {
        "server": args.server,
        "rate": args.rate,
        "mode": args.mode,
        "arrivals": args.arrivals,
        "prompt_format": args.prompt_format,
        "peer_prompts": args.peer_prompts,
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "reps": args.reps,
        "seconds": time.monotonic() - t0,
        "rows": compare(peer, ours),
        "peer_input_tokens": [r["total_input_tokens"] for r in peer],
        "ours_input_tokens": [r["total_input_tokens"] for r in ours],
        "ours_problems": [r["problems"] for r in ours],
        "ours_server_bursts": [r["server_bursts"] for r in ours],
        "ours_chunks_per_token": [r["chunks_per_token"] for r in ours],
        # Alternate mode: each run's client-side mean E2EL against the server's own (its /metrics
        # histogram). Together mode has no per-client server clock: the wire is its ground truth.
        "clock": [
            {
                "client": who,
                "mean_e2el_ms": r["mean_e2el_ms"],
                "server_mean_e2el_ms": r.get("server_mean_e2el_ms"),
            }
            for who, runs in (("peer", peer), ("ours", ours))
            for r in runs
            if args.mode == "alternate"
        ],
        # Together mode: what each client added to the wire's own TTFT and E2EL, per repetition (ms).
        "client_minus_wire": [
            {
                "client": who,
                **{
                    f"{stat}_{metric}_ms": r[f"{stat}_{metric}_ms"] - r[f"wire_{stat}_{metric}_ms"]
                    for stat in ("median", "mean")
                    for metric in ("ttft", "e2el")
                },
            }
            for who, runs in (("peer", peer), ("ours", ours))
            for r in runs
            if "wire_requests" in r
        ],
    }
    print(render(result))
    for row in result["client_minus_wire"]:
        print(
            f"{row['client']}: client minus wire, ttft p50 {row['median_ttft_ms']:+.2f} ms, mean "
            f"{row['mean_ttft_ms']:+.2f} ms; e2el p50 {row['median_e2el_ms']:+.2f} ms, mean "
            f"{row['mean_e2el_ms']:+.2f} ms"
        )
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
