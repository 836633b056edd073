"""The demo study's landscape, swept in process: Llama-3.1-8B on an RTX 4090, max_model_len 2048,
inputs 128-512 and outputs 32-128 tokens, Poisson arrivals, SLOs ttft:p95<=500ms and tpot:p95<=50ms."""

from __future__ import annotations

import math
import random
from collections import Counter

from autotune.sim.model import SimResult, simulate, synthetic_workload

HW, MODEL = "RTX-4090-24GB", "Llama-3.1-8B"
WORKLOAD = synthetic_workload(400, input_len=(128, 512), output_len=(32, 128), seed=1)


def _meets_slo(result: SimResult) -> bool:
    return result.failed == 0 and result.stat("ttft", 95) <= 0.5 and result.stat("tpot", 95) <= 0.05


def _slo_throughput(**flags: object) -> SimResult | None:
    """The run at the highest Poisson rate (bisection over 0-32 req/s) that meets both SLOs."""
    lo, hi, best = 0.0, 32.0, None
    for _ in range(8):
        mid = (lo + hi) / 2
        result = simulate({"max_model_len": 2048, **flags}, HW, MODEL, WORKLOAD, rate=mid, seed=7)
        assert result.ok, result.startup.error
        if _meets_slo(result):
            lo, best = mid, result
        else:
            hi = mid
    return best


def _tput(result: SimResult | None) -> float:
    return result.output_throughput if result else 0.0


def test_max_num_seqs_has_an_interior_slo_optimum() -> None:
    """SLO-constrained throughput rises with max_num_seqs, peaks in between, and the largest is worse:
    a cap protects TPOT from bursts and a huge one leaves too little KV (preemptions)."""
    tput = {
        s: _tput(_slo_throughput(max_num_seqs=s, max_num_batched_tokens=512, gpu_memory_utilization=0.8))
        for s in (8, 16, 32, 64, 128, 512)
    }
    best = max(tput, key=tput.__getitem__)
    assert best in (32, 64, 128), tput
    assert tput[8] < tput[16] < tput[32], tput
    assert tput[512] < 0.8 * tput[best], tput


def test_saturated_throughput_peaks_where_kv_capacity_binds() -> None:
    """At saturation (all requests at once) throughput peaks near the max_num_seqs whose batch fills the
    KV cache and falls beyond it, where preemptions start."""
    runs = {
        s: simulate({"max_model_len": 2048, "max_num_seqs": s}, HW, MODEL, WORKLOAD, rate=math.inf)
        for s in (16, 32, 64, 96, 512)
    }
    tput = {s: r.output_throughput for s, r in runs.items()}
    best = max(tput, key=tput.__getitem__)
    assert best in (64, 96), tput
    assert runs[best].num_preemptions == 0 < runs[512].num_preemptions
    assert tput[512] < 0.95 * tput[best], tput


def test_throughput_trades_against_ttft() -> None:
    """A smaller token budget per step sustains more throughput under the TPOT SLO but with a higher TTFT."""
    small = _slo_throughput(max_num_seqs=64, max_num_batched_tokens=512)
    large = _slo_throughput(max_num_seqs=64, max_num_batched_tokens=4096)
    assert small is not None and large is not None
    assert small.output_throughput > large.output_throughput
    assert small.stat("ttft", 95) > large.stat("ttft", 95)


def test_demo_space_mixes_oom_invalid_and_working_configs_below_6k_tokens_per_second() -> None:
    """Random points of the demo space: some OOM (near high utilisation), some fail validation, most
    start; even at saturation no config exceeds ~6k output tok/s (a 2-core machine can stream it)."""
    rng = random.Random(0)
    outcomes: Counter[str] = Counter()
    oom_utils: list[float] = []
    peak = 0.0
    for trial in range(80):
        util = round(0.80 + 0.02 * rng.randint(0, 9), 2)
        flags: dict[str, object] = {
            "gpu_memory_utilization": util,
            "block_size": rng.choice([16, 32, 64, 128]),
            "max_num_seqs": round(math.exp(rng.uniform(math.log(8), math.log(512)))),
            "max_num_batched_tokens": round(math.exp(rng.uniform(math.log(512), math.log(8192)))),
            "kv_cache_dtype": rng.choice(["auto", "fp8"]),
            "enable_chunked_prefill": rng.choice([True, False]),
            "max_model_len": 2048,
        }
        result = simulate(flags, HW, MODEL, WORKLOAD[:150], rate=math.inf, seed=trial)
        outcomes[str(result.failure) if result.failure else "ok"] += 1
        if str(result.failure) == "oom":
            oom_utils.append(util)
        peak = max(peak, result.output_throughput)
    assert outcomes["ok"] > 40, outcomes
    assert outcomes["oom"] >= 1 and outcomes["invalid_config"] >= 5, outcomes
    assert min(oom_utils) >= 0.94
    assert 1000 < peak < 6000
