"""The fluid model of a config's latencies (autotune/predict/surrogate/fluid.py) and the cost model's
scales."""

from __future__ import annotations

import math
import random

import pytest

from autotune.hardware.catalog import GPUS, MODELS
from autotune.predict.surrogate.fluid import (
    Bound,
    Engine,
    Traffic,
    capacity,
    holds,
    latency,
    slo_rate,
    slots,
    state,
)
from autotune.sim import simulate, synthetic_workload
from autotune.sim.cost import CostModel, Scales
from autotune.sim.flags import ServeFlags
from autotune.sim.model import percentile
from autotune.sim.startup import plan_startup

ARCH = MODELS["Llama-3.1-8B"]
GPU = GPUS["H100-80GB"]
TRAFFIC = Traffic.of([384 + (i * 37) % 257 for i in range(400)], [96 + (i * 13) % 65 for i in range(400)])


def engine(
    seqs: int = 256, budget: int = 8192, kv_tokens: int = 400_000, scales: Scales | None = None
) -> Engine:
    return Engine(CostModel(ARCH, GPU, scales=scales), seqs, budget, kv_tokens)


def test_default_scales_keep_the_cost_models_step_times() -> None:
    """Scales of 1.0 are the simulator's own constants; each scale moves the term it names."""
    args = (64, 64, 64 * 1024, 64 * 1024.0, 64)
    base = CostModel(ARCH, GPU).step_time(*args, prefill=False)
    assert CostModel(ARCH, GPU, scales=Scales()).step_time(*args, prefill=False) == base
    faster = CostModel(ARCH, GPU, scales=Scales(weights=2.0, attention=2.0)).step_time(*args, prefill=False)
    assert faster < base
    slower = CostModel(ARCH, GPU, scales=Scales(step_overhead=3.0)).step_time(*args, prefill=False)
    assert slower > base
    prefill = (4096, 8, 4096, 4096 * 2048.0, 8)
    assert CostModel(ARCH, GPU, scales=Scales(compute=0.5)).step_time(*prefill) > CostModel(
        ARCH, GPU
    ).step_time(*prefill)


def test_latencies_grow_with_the_rate_up_to_capacity() -> None:
    e = engine()
    cap = capacity(e, TRAFFIC)
    assert cap > 0
    assert state(e, TRAFFIC, 0.99 * cap) is not None
    assert state(e, TRAFFIC, 1.01 * cap) is None
    for metric in ("ttft", "tpot", "e2el"):
        values = []
        for frac in (0.1, 0.3, 0.5, 0.7, 0.9, 0.98):
            st = state(e, TRAFFIC, frac * cap)
            assert st is not None
            values.append(latency(st, e, TRAFFIC, metric, 0.95))
        assert values == sorted(values), (metric, values)
        assert all(v > 0 for v in values)


def test_slots_are_max_num_seqs_or_what_the_kv_cache_holds() -> None:
    per_seq = TRAFFIC.prompt + TRAFFIC.output / 2.0
    assert slots(engine(seqs=64, kv_tokens=10**7), TRAFFIC) == 64
    assert slots(engine(seqs=1024, kv_tokens=100_000), TRAFFIC) == pytest.approx(100_000 / per_seq)
    # Fewer slots, less capacity; a KV cache that holds more than max_num_seqs changes nothing.
    assert capacity(engine(seqs=16), TRAFFIC) < capacity(engine(seqs=64), TRAFFIC)
    assert capacity(engine(seqs=64, kv_tokens=10**6), TRAFFIC) == capacity(
        engine(seqs=64, kv_tokens=10**7), TRAFFIC
    )


def test_slo_rate_is_the_edge_of_the_bounds() -> None:
    e = engine()
    bounds = [Bound("ttft", 0.95, 0.2), Bound("tpot", 0.95, 0.012)]
    rate = slo_rate(e, TRAFFIC, bounds)
    assert 0 < rate < capacity(e, TRAFFIC)
    assert holds(e, TRAFFIC, bounds, rate)
    assert not holds(e, TRAFFIC, bounds, rate * 1.01)
    # A factor (what a calibration fits) tightens a bound; a bound below a lone request's latency: none.
    tighter = [Bound("ttft", 0.95, 0.2), Bound("tpot", 0.95, 0.012, factor=1.1)]
    assert slo_rate(e, TRAFFIC, tighter) < rate
    assert slo_rate(e, TRAFFIC, [Bound("tpot", 0.95, 1e-4)]) == 0.0


def test_mean_step_and_capacity_agree_with_the_simulator() -> None:
    """At a steady 40 % and 80 % of the model's capacity, the simulator's mean TPOT (middle half of 1,200
    Poisson requests) is within 20 % of the model's, and its output throughput matches the offered rate."""
    flags = ServeFlags(model=ARCH.name, hardware=GPU, max_model_len=8192, max_num_seqs=256)
    plan = plan_startup(flags, ARCH, random.Random(0))
    assert plan.ok and plan.config is not None and plan.memory is not None
    cfg = plan.config
    cost = CostModel(ARCH, GPU, block_size=cfg.block_size, execution=cfg.execution)
    e = Engine(cost, cfg.max_num_seqs, cfg.max_num_batched_tokens, plan.memory.kv_tokens)
    requests = synthetic_workload(1200, input_len=(384, 640), output_len=(96, 160), seed=0)
    traffic = Traffic.of([r.prompt_len for r in requests], [r.output_len for r in requests])
    cap = capacity(e, traffic)
    for frac in (0.4, 0.8):
        run = simulate(flags, GPU, ARCH, requests, rate=frac * cap, seed=0)
        middle = sorted(run.requests, key=lambda r: r.arrival)[300:900]
        tpot = sum(sum(r.itls) / len(r.itls) for r in middle) / len(middle)
        st = state(e, traffic, frac * cap)
        assert st is not None
        assert math.isclose(latency(st, e, traffic, "tpot", None), tpot, rel_tol=0.2), (frac, tpot, st)
        assert math.isclose(run.output_throughput, frac * cap * traffic.output, rel_tol=0.1)


def test_a_cap_on_running_sequences_holds_the_tail_of_tpot() -> None:
    """Prompts of several chunks (3-5k tokens through a 1,024-token budget) under load: while 32
    sequences run, the prompts that arrive wait for a slot instead of sharing the running requests'
    steps, so the p95 TPOT at 32 slots stays below that at 64 in the simulator (a fixed seed: the
    simulator is deterministic), and the model, which sees the same mean TPOT for both, predicts that
    tail within 15 % for both."""
    arch, gpu = MODELS["Llama-3.1-8B"], GPUS["A100-80GB"]
    requests = synthetic_workload(1200, input_len=(3072, 5120), output_len=(128, 256), seed=0)
    traffic = Traffic.of([r.prompt_len for r in requests], [r.output_len for r in requests])
    rate = 2.3
    simulated, modelled, means = [], [], []
    for cap in (32, 64):
        flags = ServeFlags(
            model=arch.name,
            hardware=gpu,
            max_model_len=8192,
            max_num_seqs=cap,
            max_num_batched_tokens=1024,
            kv_cache_dtype="fp8",
            gpu_memory_utilization=0.8,
        )
        plan = plan_startup(flags, arch, random.Random(0))
        assert plan.ok and plan.config is not None and plan.memory is not None
        cfg = plan.config
        cost = CostModel(
            arch, gpu, kv_cache_dtype=cfg.kv_cache_dtype, block_size=cfg.block_size, execution=cfg.execution
        )
        e = Engine(cost, cfg.max_num_seqs, cfg.max_num_batched_tokens, plan.memory.kv_tokens)
        run = simulate(flags, gpu, arch, requests, rate=rate, seed=0)
        middle = sorted(run.requests, key=lambda r: r.arrival)[300:900]
        simulated.append(percentile([r.tpot for r in middle if r.output_len > 1], 95))
        st = state(e, traffic, rate)
        assert st is not None
        modelled.append(latency(st, e, traffic, "tpot", 0.95))
        means.append(latency(st, e, traffic, "tpot", None))
    assert simulated[0] < simulated[1], simulated
    assert modelled[0] < modelled[1], modelled
    assert means[0] == pytest.approx(means[1], rel=1e-3), means
    for sim_p95, model_p95 in zip(simulated, modelled, strict=True):
        assert math.isclose(model_p95, sim_p95, rel_tol=0.15), (simulated, modelled)
