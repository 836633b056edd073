"""The crash boundary: a config that asks at least as much memory as one that failed for memory is not
launched; the device edge the memory model predicts moves with what launches showed."""

from __future__ import annotations

import pytest
from optuna.trial import TrialState

from autotune.hardware.catalog import GPUS, MODELS
from autotune.hardware.memory import DeviceEdge, MemoryPlan, edge_start_probability
from autotune.outcome import Cause
from autotune.predict.boundary import asks_at_least, beyond_boundary
from autotune.predict.feasibility import MemoryModel, PreLaunchCheck

from .test_feasibility import trial

BASE = {
    "gpu_memory_utilization": 0.96,
    "max_num_seqs": 128,
    "max_num_batched_tokens": 4096,
    "kv_cache_dtype": "auto",
    "block_size": 16,
}


@pytest.mark.parametrize(
    ("change", "dominates"),
    [
        ({"gpu_memory_utilization": 0.98}, True),
        ({"max_num_seqs": 256, "max_num_batched_tokens": 8192}, True),
        ({"gpu_memory_utilization": 0.98, "max_num_seqs": 64}, False),  # one flag asks less
        ({"gpu_memory_utilization": 0.94}, False),
        ({"block_size": 32}, False),  # not ordered: must be equal
        ({"kv_cache_dtype": "fp8"}, False),  # the KV dtype does not move an OOM (KV fills the budget)
    ],
)
def test_oom_dominance(change: dict[str, object], dominates: bool) -> None:
    assert asks_at_least({**BASE, **change}, BASE, Cause.OOM) is dominates  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("change", "dominates"),
    [
        ({"gpu_memory_utilization": 0.9}, True),  # less budget, less KV
        ({"max_num_seqs": 256}, True),  # bigger activations, less KV
        ({"gpu_memory_utilization": 0.98}, False),
        ({"kv_cache_dtype": "fp8"}, False),  # half the bytes per token: may now fit
    ],
)
def test_kv_too_small_dominance(change: dict[str, object], dominates: bool) -> None:
    assert asks_at_least({**BASE, **change}, BASE, Cause.KV_TOO_SMALL) is dominates  # type: ignore[arg-type]


def test_kv_dtype_order_for_kv_too_small() -> None:
    """fp8 failed for KV: auto (two bytes or more) fails too; bfloat16 against auto is unknown."""
    fp8 = {**BASE, "kv_cache_dtype": "fp8"}
    assert asks_at_least(BASE, fp8, Cause.KV_TOO_SMALL)
    assert not asks_at_least({**BASE, "kv_cache_dtype": "bfloat16"}, BASE, Cause.KV_TOO_SMALL)


def test_a_missing_conditional_flag_makes_configs_incomparable() -> None:
    bigger = {**BASE, "gpu_memory_utilization": 0.98}
    del bigger["block_size"]
    assert not asks_at_least(bigger, BASE, Cause.OOM)


def test_only_launched_memory_failures_draw_the_boundary() -> None:
    oom = trial(3, TrialState.PRUNED, {"flags": BASE, "cause": "oom", "launched": True})
    slo = trial(4, TrialState.PRUNED, {"flags": BASE, "cause": "slo_unreachable", "launched": True})
    rejected = trial(5, TrialState.PRUNED, {"flags": BASE, "cause": "oom", "launched": False})
    higher = {**BASE, "gpu_memory_utilization": 0.98}
    found = beyond_boundary(higher, [slo, rejected, oom])
    assert found is not None and found.trial == 3 and found.cause == Cause.OOM
    assert "gpu_memory_utilization 0.98 > 0.96" in found.reason(higher)
    assert beyond_boundary(higher, [slo, rejected]) is None


def test_pre_launch_check_rejects_beyond_the_boundary_without_a_memory_model() -> None:
    oom = trial(2, TrialState.PRUNED, {"flags": BASE, "cause": "oom", "launched": True})
    check = PreLaunchCheck(None, lambda: [oom])
    decision = check({**BASE, "max_num_seqs": 256})
    assert decision.outcome is not None
    assert decision.outcome.cause == Cause.PREDICTED_INFEASIBLE
    assert decision.outcome.attrs["beyond"] == 2 and decision.outcome.attrs["launched"] is False
    assert "trial 2" in decision.outcome.summary
    assert check({**BASE, "max_num_seqs": 64}).outcome is None


def _edge_model() -> MemoryModel:
    return MemoryModel(MODELS["Llama-3.1-8B"], GPUS["H100-80GB"], {"max_model_len": 8192})


FLAGS = {"max_num_seqs": 256, "max_num_batched_tokens": 8192}


def _plans(m: MemoryModel, *utils: float) -> dict[float, MemoryPlan]:
    return {u: m.plan({**FLAGS, "gpu_memory_utilization": u}) for u in utils}


def test_the_edge_moves_after_out_of_memory_starts() -> None:
    """Out of memory at 0.98 (the prior said it starts), a start at 0.9: 0.98 and above are now lost causes
    whatever the other flags, 0.97 and 0.96 doubtful, 0.9 as safe as it was."""
    m = _edge_model()
    plan = _plans(m, 0.9, 0.96, 0.97, 0.98, 0.99)
    assert edge_start_probability(plan[0.98]) > 0.99
    edge = DeviceEdge.of([(plan[0.98], False), (plan[0.98], False), (plan[0.9], True)])
    assert edge.start_probability(plan[0.98]) == 0.0
    assert edge.start_probability(plan[0.99]) == 0.0
    assert edge.start_probability(m.plan({"gpu_memory_utilization": 0.98, "max_num_seqs": 8})) == 0.0
    assert edge.start_probability(plan[0.97]) < 0.2
    assert edge.start_probability(plan[0.97]) < edge.start_probability(plan[0.96]) < 0.5
    assert edge.start_probability(plan[0.9]) == edge_start_probability(plan[0.9])


def test_a_start_proves_configs_with_as_much_spare_memory() -> None:
    m = _edge_model()
    plan = _plans(m, 0.975, 0.98, 0.99)
    edge = DeviceEdge.of([(plan[0.99], True)])
    assert edge.start_probability(plan[0.99]) >= 0.99 > edge_start_probability(plan[0.99])
    assert edge.start_probability(plan[0.975]) >= edge_start_probability(plan[0.975])


def test_contradicting_launches_leave_the_prior() -> None:
    """A failure with more spare memory than a start (noise at the edge): the prior stands."""
    m = _edge_model()
    plan = _plans(m, 0.95, 0.97, 0.98)
    edge = DeviceEdge.of([(plan[0.95], False), (plan[0.98], True)])
    assert edge.start_probability(plan[0.97]) == edge_start_probability(plan[0.97])


def test_the_memory_model_skips_configs_past_a_learned_edge() -> None:
    """Through calibration: after an OOM at 0.96 a config at 0.96 with fewer sequences is predicted oom."""
    m = _edge_model()
    ran = trial(0, TrialState.COMPLETE, {"flags": {**FLAGS, "gpu_memory_utilization": 0.9}, "start_s": 20.0})
    oom = trial(1, TrialState.PRUNED, {"flags": {**FLAGS, "gpu_memory_utilization": 0.96}, "cause": "oom",
                                       "launched": True})  # fmt: skip
    candidate = {"gpu_memory_utilization": 0.96, "max_num_seqs": 64, "max_num_batched_tokens": 8192}
    assert m.predict(candidate).feasible
    prediction = m.predict(candidate, m.calibrate([ran, oom]))
    assert prediction.failure == Cause.OOM and prediction.start_probability == 0.0


def test_calibration_collects_edge_evidence_from_trials() -> None:
    m = _edge_model()
    flags = {"gpu_memory_utilization": 0.98}
    ran = trial(0, TrialState.COMPLETE, {"flags": {"gpu_memory_utilization": 0.9}, "start_s": 20.0})
    oom = trial(1, TrialState.PRUNED, {"flags": flags, "cause": "oom", "launched": True})
    skipped = trial(2, TrialState.PRUNED, {"flags": {"gpu_memory_utilization": 0.99}, "cause": "oom",
                                           "launched": False})  # fmt: skip
    edge = m.calibrate([ran, oom, skipped]).edge
    assert edge.failed_spare == m.plan(flags).device_bytes - m.plan(flags).budget_bytes
    assert (
        edge.started_spare
        == m.plan({"gpu_memory_utilization": 0.9}).device_bytes
        - m.plan({"gpu_memory_utilization": 0.9}).budget_bytes
    )
