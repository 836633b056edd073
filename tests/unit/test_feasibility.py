"""Pre-launch checks (autotune/predict/feasibility.py): memory predictions, calibration, repeats, preemption
notes."""

from __future__ import annotations

from pathlib import Path

import optuna
import pytest
import yaml
from optuna.distributions import FloatDistribution
from optuna.trial import FrozenTrial, TrialState

from autotune.errors import SpecError
from autotune.hardware.catalog import GIB, GPUS, MODELS
from autotune.inputs.loader import load_study
from autotune.outcome import Cause, TrialOutcome
from autotune.predict.feasibility import MemoryModel, PreLaunchCheck
from autotune.study.judge import note_preemptions

FIXED = {"max_model_len": 2048}
GOOD = {"gpu_memory_utilization": 0.9, "max_num_seqs": 64, "max_num_batched_tokens": 2048}


def model() -> MemoryModel:
    return MemoryModel(MODELS["Llama-3.1-8B"], GPUS["RTX-4090-24GB"], FIXED)


def trial(number: int, state: TrialState, attrs: dict[str, object]) -> FrozenTrial:
    frozen = optuna.trial.create_trial(
        state=state,
        values=[1.0] if state == TrialState.COMPLETE else None,
        params={"x": 0.5},
        distributions={"x": FloatDistribution(0, 1)},
        user_attrs=attrs,
    )
    frozen.number = number
    return frozen


def test_a_config_that_fits_is_launched() -> None:
    """The demo's default-ish config fits on the RTX 4090: feasible, with its numbers."""
    prediction = model().predict(GOOD)
    assert prediction.feasible
    assert prediction.attrs()["kv_tokens"] > 2048


def test_no_kv_memory_is_predicted_infeasible() -> None:
    """Huge batches on a small GPU leave no KV memory: kv_too_small, start chance 0."""
    prediction = model().predict(
        {"gpu_memory_utilization": 0.8, "max_num_seqs": 512, "max_num_batched_tokens": 8192}
    )
    assert prediction.failure == Cause.KV_TOO_SMALL
    assert prediction.start_probability == 0.0


def test_weights_that_do_not_fit_are_an_oom() -> None:
    """Llama-3.1-70B on one 24 GiB GPU is an OOM before anything else."""
    prediction = MemoryModel(MODELS["Llama-3.1-70B"], GPUS["RTX-4090-24GB"], FIXED).predict(GOOD)
    assert prediction.failure == Cause.OOM


def test_the_device_edge_is_judged_by_start_probability() -> None:
    """At utilization 1.0 graph capture almost never fits (oom predicted); at 0.9 it almost always does."""
    m = MemoryModel(
        MODELS["Llama-3.1-70B"], GPUS["H100-80GB"], {"max_model_len": 8192, "tensor_parallel_size": 4}
    )
    edge = m.predict({**GOOD, "gpu_memory_utilization": 1.0})
    safe = m.predict(GOOD)
    assert edge.failure == Cause.OOM and edge.start_probability < 0.005
    assert safe.feasible and safe.start_probability > 0.99


def test_calibration_moves_predictions_by_the_observed_residual() -> None:
    """A trial that reported 2 GiB less KV memory than predicted lowers later predictions by 2 GiB."""
    m = model()
    predicted = m.plan(GOOD).kv_cache_bytes
    observed = (predicted - 2 * GIB) / GIB
    seen = trial(
        0,
        TrialState.COMPLETE,
        {"flags": GOOD, "capacity": {"kv_tokens": 1, "available_kv_cache_gib": observed}},
    )
    calibration = m.calibrate([seen])
    assert calibration.observations == 1
    assert calibration.offset_bytes == pytest.approx(-2 * GIB, abs=1024)
    assert m.predict(GOOD, calibration).kv_cache_bytes == pytest.approx(predicted - 2 * GIB, abs=1024)


def test_kv_too_small_diagnosis_calibrates_too() -> None:
    """A `KV cache is needed` failure's available GiB is an observation of KV memory."""
    m = model()
    predicted = m.plan(GOOD).kv_cache_bytes / GIB
    seen = trial(0, TrialState.PRUNED, {"flags": GOOD, "cause": "kv_too_small",
                                        "diagnosis": {"available_gib": predicted + 1.0}})  # fmt: skip
    assert m.calibrate([seen]).offset_bytes == pytest.approx(GIB, abs=1024)


def test_a_config_that_failed_to_start_is_not_launched_again() -> None:
    """A config identical to one pruned with a start-failure cause is pruned with that cause and repeat_of."""
    crashed = trial(0, TrialState.PRUNED, {"flags": GOOD, "cause": "oom", "launched": True})
    check = PreLaunchCheck(model(), lambda: [crashed])
    decision = check(dict(GOOD))
    assert decision.outcome is not None
    assert decision.outcome.cause == Cause.OOM
    assert decision.outcome.attrs["repeat_of"] == crashed.number
    assert decision.outcome.attrs["launched"] is False
    # Asks less memory: not ruled out by the boundary (the memory model's learned edge is tested apart).
    assert PreLaunchCheck(None, lambda: [crashed])({**GOOD, "max_num_seqs": 63}).outcome is None


def test_slo_misses_are_not_repeats() -> None:
    """A config pruned as slo_unreachable may be suggested again (it is not a start failure)."""
    missed = trial(0, TrialState.PRUNED, {"flags": GOOD, "cause": "slo_unreachable"})
    assert PreLaunchCheck(None, lambda: [missed])(dict(GOOD)).outcome is None


def test_predicted_infeasible_is_pruned_with_the_prediction_numbers() -> None:
    """A doomed config becomes PRUNED predicted_infeasible, never launched, with the prediction's numbers."""
    flags = {"gpu_memory_utilization": 0.8, "max_num_seqs": 512, "max_num_batched_tokens": 8192}
    decision = PreLaunchCheck(model(), list)(flags)
    assert decision.outcome is not None
    assert decision.outcome.cause == Cause.PREDICTED_INFEASIBLE
    numbers = decision.outcome.attrs["memory_prediction"]
    assert numbers["predicted_failure"] == "kv_too_small"
    assert numbers["kv_bytes_per_token"] == 131072


def test_without_a_memory_model_only_repeats_are_checked() -> None:
    """With the memory model off, a doomed config is launched (no prediction attrs)."""
    decision = PreLaunchCheck(None, list)({"gpu_memory_utilization": 0.8, "max_num_batched_tokens": 8192})
    assert decision.outcome is None and decision.prediction is None


def test_a_preemption_storm_is_noted() -> None:
    """Many preemptions per completed request at the operating point: attrs and a summary note."""
    outcome = TrialOutcome(None, "ok", values=(1.0,), attrs={
        "server_delta": {"preemptions": 40.0}, "operating_point": {"completed": 100}})  # fmt: skip
    noted = note_preemptions(outcome)
    assert noted.attrs["preemption_storm"] is True
    assert "preemption storm" in noted.summary
    calm = note_preemptions(TrialOutcome(None, "ok", values=(1.0,), attrs={
        "server_delta": {"preemptions": 2.0}, "operating_point": {"completed": 100}}))  # fmt: skip
    assert calm.attrs["preemption_storm"] is False and calm.summary == "ok"


def _spec(tmp_path: Path, memory_model: object) -> Path:
    (tmp_path / "space.yaml").write_text(yaml.safe_dump({"params": {"max_num_seqs": {
        "type": "int", "low": 8, "high": 64, "default": 8}}}))  # fmt: skip
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump({
        "study": {"name": "s"}, "server": {"command": ["x"], "model": "m"}, "search_space": "space.yaml",
        "slo": {"terms": ["ttft:p95<=1s"]}, "memory_model": memory_model}))  # fmt: skip
    return path


def test_spec_memory_model_is_validated(tmp_path: Path) -> None:
    """memory_model: an unknown GPU or model is a SpecError naming the field and the value."""
    with pytest.raises(SpecError, match=r"^memory_model\.gpu: .*'TPU'"):
        load_study(_spec(tmp_path, {"model": "Llama-3.1-8B", "gpu": "TPU"}))
    with pytest.raises(SpecError, match=r"^memory_model\.model: .*'nope'"):
        load_study(_spec(tmp_path, {"model": "nope", "gpu": "auto"}))
    loaded = load_study(_spec(tmp_path, {"model": "Llama-3.1-8B", "gpu": "rtx-4090-24gb"}))
    assert loaded.spec.memory_model is not None and loaded.spec.memory_model.gpu == "RTX-4090-24GB"
