"""Host-side execution flags in the simulator: async scheduling, CUDA graphs, -O and eager mode."""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Any

import pytest

from autotune.hardware.catalog import GPUS, MODELS
from autotune.sim.cost import CostModel, Execution
from autotune.sim.flags import ServeFlags
from autotune.sim.startup import StartupPlan, plan_startup

MODEL = "Llama-3.1-8B"
ARCH, GPU = MODELS[MODEL], GPUS["H100-80GB"]


def _plan(**kwargs: Any) -> StartupPlan:
    flags = replace(ServeFlags(model=MODEL, hardware=GPU, max_model_len=4096), **kwargs)
    plan = plan_startup(flags, ARCH, random.Random(0))
    assert plan.ok, plan.error
    return plan


def _decode(execution: Execution, seqs: int) -> float:
    """One pure decode step of ``seqs`` sequences with 500 tokens of context each."""
    cost = CostModel(ARCH, GPU, execution=execution)
    return cost.step_time(seqs, seqs, 500 * seqs, 500.0 * seqs, seqs, prefill=False)


def test_async_scheduling_hides_the_schedulers_time() -> None:
    """--no-async-scheduling adds the scheduler's per-step time (1 ms + 10 us per sequence) to every
    step; async scheduling (vLLM 0.34's default) overlaps it with the GPU."""
    on, off = _decode(Execution(async_scheduling=True), 64), _decode(Execution(async_scheduling=False), 64)
    assert off - on == pytest.approx(1e-3 + 64 * 10e-6)
    assert _plan().config.async_scheduling is True  # type: ignore[union-attr]
    assert _plan(async_scheduling=False).config.async_scheduling is False  # type: ignore[union-attr]


def test_decode_batches_covered_by_a_cuda_graph_are_faster_than_eager() -> None:
    """Eager decode pays kernel launches per layer; a batch within the largest captured size does not, a
    batch above it does; piecewise graphs (-O1) leave part of the launches."""
    full = Execution(cudagraph="full", max_graph_tokens=64)
    assert _decode(full, 64) < _decode(Execution(cudagraph="piecewise", max_graph_tokens=64), 64)
    assert _decode(Execution(cudagraph="piecewise", max_graph_tokens=64), 64) < _decode(
        Execution(cudagraph="none"), 64
    )
    eager_gap = _decode(Execution(cudagraph="none"), 64) - _decode(full, 64)
    assert _decode(full, 65) == pytest.approx(_decode(Execution(cudagraph="none"), 65))
    assert eager_gap == pytest.approx(32 * 30e-6)
    prefill = CostModel(ARCH, GPU, execution=full).step_time(2048, 1, 2048, 2048 * 1024.0, 1)
    assert prefill == CostModel(ARCH, GPU).step_time(2048, 1, 2048, 2048 * 1024.0, 1)


def test_capture_sizes_cost_memory_and_start_time_eager_mode_captures_nothing() -> None:
    """More captured sizes take more CUDA-graph memory (less KV cache) and a longer start; --enforce-eager
    and -O0 capture nothing; explicit --cudagraph-capture-sizes and --max-cudagraph-capture-size set the
    sizes, as vLLM resolves them."""
    default, few = _plan(), _plan(cudagraph_capture_sizes=(1, 2, 4, 8))
    eager, o0 = _plan(enforce_eager=True), _plan(optimization_level="0")
    assert default.config is not None and few.config is not None and default.memory is not None
    assert few.memory is not None and eager.memory is not None and eager.config is not None
    assert default.config.max_cudagraph_capture_size == 512 and few.config.cudagraph_capture_sizes == (
        1,
        2,
        4,
        8,
    )
    assert eager.config.cudagraph_capture_sizes == () and eager.memory.cuda_graph_bytes == 0
    assert o0.config is not None and o0.config.cudagraph_mode == "NONE"
    assert default.memory.cuda_graph_bytes > few.memory.cuda_graph_bytes > 0
    assert default.memory.kv_tokens < few.memory.kv_tokens < eager.memory.kv_tokens
    assert default.delay_s > few.delay_s > eager.delay_s
    capped = _plan(max_cudagraph_capture_size=300)
    assert capped.config is not None
    sizes = capped.config.cudagraph_capture_sizes
    assert sizes[:4] == (1, 2, 4, 8) and 248 in sizes and 256 in sizes and 272 in sizes and sizes[-1] == 288


def test_inconsistent_capture_size_flags_fail_with_vllms_text() -> None:
    """Explicit sizes whose largest is not --max-cudagraph-capture-size fail VllmConfig like vLLM."""
    flags = replace(ServeFlags(model=MODEL, hardware=GPU, max_model_len=4096),
                    cudagraph_capture_sizes=(1, 2, 4), max_cudagraph_capture_size=8)  # fmt: skip
    plan = plan_startup(flags, ARCH, random.Random(0))
    text = "\n".join(e.text for e in plan.events)
    assert "customized max_cudagraph_capture_size(=8) should be consistent with the max value of " \
        "cudagraph_capture_sizes(=4)" in text  # fmt: skip
