"""The benchmark scripts' own logic (benchmarks/): the search benchmark's crash-under-load truth and how its
truth reaches the simulator, and the truth benchmark's chunk-rate ladder, checked without running them."""

from __future__ import annotations

import importlib
import itertools
import math
import random
from dataclasses import replace
from types import ModuleType
from typing import Any

import pytest

from autotune.hardware.catalog import GIB, GPUS, MODELS
from autotune.outcome import Cause
from autotune.sim import simulate, synthetic_workload
from autotune.sim.cost import CostModel, Physics
from autotune.sim.flags import ServeFlags
from autotune.sim.startup import StartFailure, plan_startup


def _script(name: str) -> ModuleType:
    """``benchmarks/<name>.py``, imported as ``benchmarks.<name>``."""
    return importlib.import_module(f"benchmarks.{name}")


@pytest.fixture(scope="module")
def search() -> ModuleType:
    return _script("search")


@pytest.fixture(scope="module")
def truth() -> ModuleType:
    return _script("truth")


def test_every_hidden_truth_crashes_under_load_near_the_top_and_monotonely(search: ModuleType) -> None:
    """Every scenario's hidden truth has configs that crash under load, all at a high utilization, none of
    them vLLM's defaults; more utilization, sequences or batched tokens never turn a crash into a run; the
    library's own model (``Truth()``) crashes nothing."""
    for scenario in search.SCENARIOS:
        crashing = [f for f in search.grid() if search.crashes_under_load(scenario, f)]
        assert crashing, scenario.name
        assert min(f["gpu_memory_utilization"] for f in crashing) >= 0.9, scenario.name
        assert not search.crashes_under_load(scenario, scenario.defaults)
        for f in crashing:
            for name, values in (
                ("gpu_memory_utilization", search.UTILS),
                ("max_num_seqs", search.SEQS),
                ("max_num_batched_tokens", search.BATCHED),
            ):
                for value in (v for v in values if v > f[name]):
                    assert search.crashes_under_load(scenario, {**f, name: value}), (scenario.name, f, name)
        plain = replace(scenario, truth=search.Truth())
        assert not any(search.crashes_under_load(plain, f) for f in search.grid())


def test_a_crash_under_load_replaces_a_started_configs_figure_only(search: ModuleType) -> None:
    """In the table, a config that started and crashes under load loses its figure and keeps its KV
    capacity; one that failed to start keeps its cause; one that runs is untouched."""
    scenario = search.SCENARIOS[0]
    crashing = next(f for f in search.grid() if search.crashes_under_load(scenario, f))
    running = scenario.defaults
    capacity = {"kv_tokens": 1000.0, "available_kv_cache_gib": 1.0}
    measured = search.Measured(None, 500.0, "met", capacity, {"terms": [], "points": [[1, 2, 3]]}, 2.0)
    oom = search.Measured(Cause.OOM, 0.0, "oom")
    other = next(f for f in search.grid() if search.crashes_under_load(scenario, f) and f != crashing)
    table = {search.key(crashing): measured, search.key(running): measured, search.key(other): oom}
    out = search.with_crashes(scenario, table)
    crashed = out[search.key(crashing)]
    assert crashed.cause is Cause.CRASHED_UNDER_LOAD and crashed.value == 0.0 and crashed.rate is None
    assert crashed.capacity == capacity and crashed.curve == {"terms": ["ttft:p95", "tpot:p95"], "points": []}
    assert "under load" in crashed.summary
    assert out[search.key(running)] is measured and out[search.key(other)] is oom
    assert Cause.CRASHED_UNDER_LOAD in search.FAILED


def test_a_truth_reaches_the_startups_memory_and_the_step_time(search: ModuleType) -> None:
    """A scenario's truth as the simulator takes it (``Truth.physics``) scales the start's activation peak
    and CUDA-graph memory, adds its non-torch memory and post-profile reserve, and changes the step time
    (of the cost model and of a simulated run); ``Truth()`` is the library's own model."""
    scenario = search.SCENARIOS[1]
    truth, physics = scenario.truth, scenario.truth.physics()
    arch, gpu = MODELS[scenario.model], GPUS[scenario.gpu]
    serve = ServeFlags(model=scenario.model, hardware=gpu, max_model_len=8192, **scenario.defaults)
    model = plan_startup(serve, arch, random.Random(0)).memory
    true = plan_startup(serve, arch, random.Random(0), physics=physics).memory
    assert model is not None and true is not None
    assert true.activation_bytes == round(model.activation_bytes * truth.activation_factor)
    assert true.cuda_graph_bytes == round(model.cuda_graph_bytes * truth.cuda_graph_factor)
    assert true.non_torch_bytes == model.non_torch_bytes + round(truth.extra_non_torch_gib * GIB)
    assert plan_startup(serve, arch, random.Random(0)).ok
    reserve = Physics(extra_reserve_bytes=3 * GIB)
    assert plan_startup(serve, arch, random.Random(0), physics=reserve).failure is StartFailure.OOM
    batch = (64, 64, 64 * 1024, 64 * 1024.0, 64)
    model_step = CostModel(arch, gpu).step_time(*batch, prefill=False)
    assert CostModel(arch, gpu, physics=physics).step_time(*batch, prefill=False) != model_step
    workload = synthetic_workload(20, input_len=scenario.input_len, output_len=scenario.output_len)
    run = simulate(serve, gpu, arch, workload, rate=math.inf)
    assert simulate(serve, gpu, arch, workload, rate=math.inf, physics=physics).duration != run.duration
    assert search.Truth().physics() == Physics()


def _row(mode: str, burst: int, rate: int, valid: bool, agrees: bool) -> dict[str, Any]:
    return {"mode": mode, "burst": burst, "rate": rate, "valid": valid, "agrees": agrees, "workers": 1}


def test_the_ladder_names_the_highest_rate_measured_validly_at_every_rung_up_to_it(truth: ModuleType) -> None:
    """Per events a write and mode, the highest rung whose every run was valid and right, with every rung
    below it so: a valid rung above a failed one does not count, nor a valid run that was wrong."""
    rates, bursts = truth.LADDER_RATES, truth.LADDER_BURSTS
    rows = []
    for burst, rate in itertools.product(bursts, rates):
        one_ok = rate <= rates[1] or (burst == 3 and rate == rates[3])  # rung 3 fails for 3, rung 4 valid
        rows.append(_row("one worker", burst, rate, one_ok, one_ok))
        rows.append(_row("one worker", burst, rate, True, True))
        auto_valid = rate <= rates[2]
        rows.append(
            _row("auto", burst, rate, auto_valid, auto_valid and not (burst == 8 and rate == rates[2]))
        )
    table = truth._ladder_table(rows)
    lines = table.splitlines()
    assert f"| {rates[0]:,} | {bursts[0]} | 2/2 (2) | 1/1 (1) | 1 |" in lines
    assert f"| {rates[2]:,} | {bursts[0]} | 1/2 (1) | 1/1 (1) | 1 |" in lines
    summary = {line.split(" ")[0]: line for line in lines if "highest chunks/s" in line}
    assert summary["1"].endswith(f"one worker {rates[1]:,}, auto {rates[2]:,}")
    assert summary["3"].endswith(f"one worker {rates[1]:,}, auto {rates[2]:,}")
    assert summary["8"].endswith(f"one worker {rates[1]:,}, auto {rates[1]:,}")
