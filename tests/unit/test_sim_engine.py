"""Physics of the simulated engine (scheduler + step-time model), checked in process and virtual time."""

from __future__ import annotations

import math

import pytest

from autotune.hardware.catalog import GPUS, MODELS
from autotune.sim.engine import CostModel, Engine, EngineConfig, Request, attention_efficiency
from autotune.sim.model import percentile, simulate, synthetic_workload

HW, MODEL = "RTX-4090-24GB", "Llama-3.1-8B"


def _engine(num_blocks: int = 1000, *, seqs: int = 8, budget: int = 256, chunked: bool = True) -> Engine:
    cost = CostModel(MODELS[MODEL], GPUS[HW])
    return Engine(EngineConfig(seqs, budget, 16, num_blocks, chunked), cost)


def test_throughput_rises_with_max_num_seqs_until_kv_binds_then_falls_with_preemption() -> None:
    """At saturation, throughput grows with max_num_seqs, peaks where KV capacity binds, then falls."""
    wl = synthetic_workload(300, input_len=(256, 768), output_len=(256, 768), seed=1)
    flags = {"max_model_len": 2048, "gpu_memory_utilization": 0.8}
    runs = {s: simulate({**flags, "max_num_seqs": s}, HW, MODEL, wl, rate=math.inf) for s in (8, 16, 32, 512)}
    tput = {s: r.output_throughput for s, r in runs.items()}
    assert tput[8] < tput[16] < tput[32]
    assert tput[512] < 0.8 * tput[32]
    assert runs[16].num_preemptions == 0
    assert runs[512].num_preemptions > 100


def test_tpot_rises_with_batch_size() -> None:
    """Median TPOT grows with the number of sequences decoding together."""
    wl = synthetic_workload(200, seed=2)
    tpot = [
        simulate({"max_model_len": 2048, "max_num_seqs": s}, HW, MODEL, wl, rate=math.inf).stat("tpot", 50)
        for s in (4, 16, 64)
    ]
    assert tpot[0] < tpot[1] < tpot[2]
    assert 0.015 < tpot[0] < 0.03  # a 4090 reads 16 GB of bf16 weights in ~19 ms


def test_fp8_roughly_doubles_kv_capacity() -> None:
    """The KV capacity of a started engine doubles with an fp8 KV cache."""
    wl = synthetic_workload(5, seed=0)
    auto = simulate({"max_model_len": 2048}, HW, MODEL, wl)
    fp8 = simulate({"max_model_len": 2048, "kv_cache_dtype": "fp8"}, HW, MODEL, wl)
    assert fp8.kv_tokens / auto.kv_tokens == pytest.approx(2.0, rel=0.02)


def test_decode_is_memory_bound_and_prefill_compute_bound() -> None:
    """One decode token costs a weight read; prefill time grows linearly with tokens (compute-bound)."""
    cost = CostModel(MODELS[MODEL], GPUS[HW])
    decode = cost.step_time(1, 1, 100, 100.0, 1)
    # every weight but the embedding table (15.0 GB in bf16) at 85 % of 1008 GB/s, plus step overhead
    assert decode == pytest.approx(15.0e9 / (1008e9 * 0.85) + 1.5e-3, rel=0.05)
    p1, p2 = cost.step_time(1024, 1, 1024, 512 * 1024, 1), cost.step_time(2048, 1, 2048, 1024 * 2048, 1)
    assert p2 / p1 == pytest.approx(2.0, rel=0.1)
    assert p1 > 5 * decode


def test_block_size_16_reads_kv_slower_than_64() -> None:
    """Paged attention reaches a higher bandwidth fraction with bigger blocks."""
    assert attention_efficiency(16) < attention_efficiency(32) < attention_efficiency(64)


def test_fp8_kv_reads_fewer_bytes_with_a_dequant_cost() -> None:
    """A KV-heavy decode step is faster with fp8 KV, but not twice as fast on the KV part."""
    arch, gpu = MODELS[MODEL], GPUS[HW]
    auto = CostModel(arch, gpu)
    fp8 = CostModel(arch, gpu, kv_cache_dtype="fp8")
    weights_only = auto.step_time(64, 64, 0, 0.0, 64)
    kv_auto = auto.step_time(64, 64, 200_000, 0.0, 64) - weights_only
    kv_fp8 = fp8.step_time(64, 64, 200_000, 0.0, 64) - weights_only
    assert 0.5 * kv_auto < kv_fp8 < 0.6 * kv_auto


def test_chunked_prefill_splits_a_long_prompt_within_the_budget() -> None:
    """With chunked prefill a 600-token prompt takes three 256-token steps, then decodes one token a step."""
    engine = _engine(budget=256)
    req = Request(0, 600, 3)
    engine.add(req)
    tokens = [engine.step().scheduled_tokens for _ in range(5)]
    assert tokens == [256, 256, 88, 1, 1]
    assert req.finished
    assert engine.free_blocks == 1000


def test_without_chunked_prefill_a_prompt_that_does_not_fit_waits() -> None:
    """Without chunked prefill a prompt larger than the remaining budget waits for a later step."""
    engine = _engine(budget=512, chunked=False)
    first, second = Request(0, 500, 2), Request(1, 512, 2)
    engine.add(first)
    engine.add(second)
    assert engine.step().scheduled_tokens == 500
    assert second in engine.waiting
    assert engine.step().scheduled_tokens == 1  # first decodes; 512 more tokens would exceed 512
    assert engine.step().scheduled_tokens == 512


def test_kv_blocks_are_paged_and_the_newest_request_is_preempted() -> None:
    """Blocks hold block_size tokens (last one partly empty); out of blocks, the newest running request
    is preempted, recomputes later, and every block is returned at the end."""
    engine = _engine(num_blocks=6, seqs=8, budget=512)
    old, new = Request(0, 33, 40), Request(1, 33, 40)
    engine.add(old)
    engine.add(new)
    engine.step()
    assert (old.blocks, new.blocks) == (3, 3)  # 33 tokens -> 3 blocks of 16
    preempted = 0
    while engine.has_work():
        preempted += engine.step().preempted
    assert preempted >= 1 and new.num_preemptions >= 1 and old.num_preemptions == 0
    assert old.finished and new.finished
    assert engine.free_blocks == 6
    assert engine.num_preemptions == preempted


def test_simulate_is_deterministic_and_fast_enough_for_1000_requests() -> None:
    """The same workload and seed give the same metrics; a 1,000-request run completes every request."""
    wl = synthetic_workload(1000, rate=10.0, seed=4)
    a = simulate({"max_model_len": 2048}, HW, MODEL, wl)
    b = simulate({"max_model_len": 2048}, HW, MODEL, wl)
    assert a.requests == b.requests
    assert len(a.requests) == 1000 and a.failed == 0
    assert a.output_tokens == sum(w.output_len for w in wl)
    assert len(a.itl) == a.output_tokens - 1000


def test_summary_uses_vllm_bench_keys() -> None:
    """SimResult.summary() reports vllm bench serve's keys, latencies in milliseconds."""
    result = simulate({"max_model_len": 2048}, HW, MODEL, synthetic_workload(50, rate=5.0, seed=0))
    summary = result.summary()
    assert summary["completed"] == 50 and summary["failed"] == 0
    assert summary["median_ttft_ms"] == pytest.approx(1000 * result.stat("ttft", 50))
    assert summary["output_throughput"] == pytest.approx(result.output_throughput)
    assert {"mean_itl_ms", "p99_tpot_ms", "median_e2el_ms", "total_input_tokens"} <= summary.keys()


def test_requests_longer_than_max_model_len_fail() -> None:
    """A request whose prompt + output exceeds max_model_len is rejected and counted as failed."""
    wl = synthetic_workload(3, seed=0)
    from autotune.sim.model import WorkloadRequest

    result = simulate({"max_model_len": 1024}, HW, MODEL, [*wl, WorkloadRequest(1000, 100, 0.0)])
    assert result.failed == 1 and len(result.requests) == 3


def test_percentile_interpolates_like_numpy() -> None:
    """percentile() uses linear interpolation between order statistics."""
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([5.0], 95) == 5.0
    assert math.isnan(percentile([], 50))
