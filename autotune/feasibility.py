"""Before each launch: skip configs the memory model says cannot start, and configs already seen to crash.

A launch costs minutes of GPU time; a config that cannot fit should cost nothing. :class:`MemoryModel`
predicts one config's memory (:func:`autotune.memory.plan_memory`) and calls it infeasible only when the
start would fail beyond reasonable doubt (conservative: a config that could start is never skipped):

* ``oom``: the weights alone do not fit on the device;
* ``kv_too_small``: even with the uncertainty margin there is no KV memory, or too little for one
  ``max_model_len`` sequence;
* ``oom`` at the device edge: the chance that CUDA-graph capture still fits
  (:func:`autotune.memory.edge_start_probability`) is below ``min_start_probability``.

Calibration: the study's own trials correct the model's overhead estimate for this model and device.
Each trial that reported its KV memory (the capacity line's ``Available KV cache memory`` or KV tokens,
or a ``KV cache is needed ...`` failure's available GiB / estimated max model length) gives a residual
(observed - predicted KV bytes); the median corrects the prediction and their spread sets the margin.
Without observations the margin is 5 % of the estimated overhead (activations, CUDA graphs, non-torch
memory), the memory model's stated accuracy. It is derived from storage at every trial (stateless, so
resume works).

Repeats: a config identical to a trial already pruned with a start-failure cause is pruned with the
same cause and ``repeat_of``, without a launch.

Preemption storms (Δ ``vllm:num_preemptions_total`` at the operating point, from ``server_delta``) are
recorded as attrs and a summary note, not as a constraint: every trial must carry the same constraint
keys (GPSampler requires it, and :func:`autotune.study.constraint_keys` fixes them), and the cost of
preemption (recomputed prefills) is already charged by the SLO terms and the throughput objective at
the operating point. The note tells the user the KV cache is the binding limit of that config.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from optuna.trial import FrozenTrial, TrialState

from autotune.catalog import GIB, GpuProfile, ModelArch, gpu_profile, load_model_arch
from autotune.gpu import Device, device_profile
from autotune.memory import MemoryPlan, edge_start_probability, kv_bytes_for_tokens, plan_memory
from autotune.outcome import Cause, TrialOutcome
from autotune.spec import FlagValue, LoadedStudy, resolve_model_path

START_FAILURES = (Cause.OOM, Cause.KV_TOO_SMALL, Cause.INVALID_CONFIG, Cause.START_FAILED)
"""Causes that make an identical config a known repeat (never launched again)."""
PRIOR_MARGIN = 0.05
"""Uncalibrated uncertainty of the overhead estimate (activations + CUDA graphs + non-torch)."""
CALIBRATED_MARGIN = 0.02
"""Floor of the margin once observations exist (fraction of the overhead estimate)."""
WEIGHTS_MARGIN = 0.9
"""Weights are called too big only when 90 % of the estimate already exceeds the device."""
PREEMPTION_STORM_RATIO = 0.1
"""Preemptions per completed request at the operating point from which it is called a storm."""


@dataclass(frozen=True)
class Calibration:
    """What the study's trials taught about this model on this device."""

    offset_bytes: int = 0
    """Median of observed - predicted KV-cache bytes (added to predictions)."""
    spread_bytes: int = 0
    """Largest distance of a residual from the median."""
    observations: int = 0


@dataclass(frozen=True)
class Prediction:
    """The memory model's verdict on one config, with the numbers behind it."""

    plan: MemoryPlan
    kv_cache_bytes: int
    """Predicted KV memory after calibration."""
    margin_bytes: int
    needed_bytes: int
    """KV bytes one max_model_len sequence needs."""
    start_probability: float
    failure: Cause | None
    """The start failure predicted beyond doubt (``oom`` or ``kv_too_small``), or None."""
    reason: str
    calibration: Calibration = field(default_factory=Calibration)

    @property
    def feasible(self) -> bool:
        """Whether the config may be launched."""
        return self.failure is None

    def attrs(self) -> dict[str, Any]:
        """The numbers, in GiB, for the trial's user attrs."""
        plan = self.plan

        def gib(n: int) -> float:
            return round(n / GIB, 3)

        return {
            "predicted_failure": self.failure.value if self.failure else None,
            "reason": self.reason,
            "device_gib": gib(plan.device_bytes),
            "budget_gib": gib(plan.budget_bytes),
            "weights_gib": gib(plan.weights_bytes),
            "activation_gib": gib(plan.activation_bytes),
            "cuda_graph_gib": gib(plan.cuda_graph_bytes),
            "non_torch_gib": gib(plan.non_torch_bytes),
            "kv_cache_gib": gib(self.kv_cache_bytes),
            "margin_gib": gib(self.margin_bytes),
            "needed_gib": gib(self.needed_bytes),
            "kv_bytes_per_token": plan.kv_bytes_per_token,
            "kv_tokens": max(0, self.kv_cache_bytes) // plan.kv_bytes_per_token,
            "max_model_len": plan.max_model_len,
            "start_probability": round(self.start_probability, 6),
            "calibration_offset_gib": gib(self.calibration.offset_bytes),
            "calibration_observations": self.calibration.observations,
        }


def _int(env: Mapping[str, FlagValue], key: str, default: int) -> int:
    value = env.get(key)
    return default if value is None or isinstance(value, bool) else int(value)


class MemoryModel:
    """Predicts whether a config starts, for one architecture on one device with the study's fixed flags."""

    def __init__(
        self,
        arch: ModelArch,
        gpu: GpuProfile,
        fixed: Mapping[str, FlagValue] | None = None,
        *,
        min_start_probability: float = 0.005,
    ) -> None:
        self.arch = arch
        self.gpu = gpu
        self.fixed: Mapping[str, FlagValue] = dict(fixed or {})
        self.min_start_probability = min_start_probability

    def plan(self, flags: Mapping[str, FlagValue]) -> MemoryPlan:
        """The memory plan of ``flags`` over the fixed flags, with vLLM's defaults for what is unset."""
        env = {**self.fixed, **flags}
        mml = _int(env, "max_model_len", self.arch.max_position_embeddings)
        chunked = bool(env.get("enable_chunked_prefill", True))
        mnbt = _int(env, "max_num_batched_tokens", 2048 if chunked else max(mml, 2048))
        return plan_memory(
            self.arch,
            self.gpu,
            gpu_memory_utilization=float(env.get("gpu_memory_utilization", 0.9)),
            max_num_batched_tokens=mnbt,
            max_num_seqs=_int(env, "max_num_seqs", 256),
            block_size=_int(env, "block_size", 16),
            kv_cache_dtype=str(env.get("kv_cache_dtype", "auto")),
            dtype=str(env.get("dtype", "auto")),
            tensor_parallel_size=_int(env, "tensor_parallel_size", 1),
            max_model_len=mml,
        )

    def predict(self, flags: Mapping[str, FlagValue], calibration: Calibration | None = None) -> Prediction:
        """Predict whether ``flags`` start; ``failure`` is set only when the start cannot succeed."""
        cal = calibration or Calibration()
        plan = self.plan(flags)
        env = {**self.fixed, **flags}
        overhead = plan.activation_bytes + plan.cuda_graph_bytes + plan.non_torch_bytes
        if cal.observations:
            margin = cal.spread_bytes + int(CALIBRATED_MARGIN * overhead) + 16 * 1024**2
        else:
            margin = int(PRIOR_MARGIN * overhead)
        kv = plan.kv_cache_bytes + cal.offset_bytes
        fixed_kv = env.get("kv_cache_memory_bytes")
        if fixed_kv is not None and not isinstance(fixed_kv, bool):
            kv, margin = int(fixed_kv), 0  # vLLM sizes the KV cache to exactly this
        needed = kv_bytes_for_tokens(
            self.arch,
            plan.max_model_len,
            str(env.get("kv_cache_dtype", "auto")),
            str(env.get("dtype", "auto")),
            _int(env, "tensor_parallel_size", 1),
        )
        failure: Cause | None = None
        probability = 1.0
        if WEIGHTS_MARGIN * plan.weights_bytes + plan.non_torch_bytes > plan.device_bytes:
            failure, probability = Cause.OOM, 0.0
            reason = (
                f"weights ({plan.weights_bytes / GIB:.2f} GiB per GPU) do not fit on the device "
                f"({plan.device_bytes / GIB:.2f} GiB)"
            )
        elif kv + margin <= 0:
            failure, probability = Cause.KV_TOO_SMALL, 0.0
            reason = (
                f"no memory left for the KV cache: predicted {kv / GIB:.2f} GiB "
                f"(margin {margin / GIB:.2f} GiB)"
            )
        elif kv + margin < needed:
            failure, probability = Cause.KV_TOO_SMALL, 0.0
            reason = (
                f"KV cache {kv / GIB:.2f} GiB (margin {margin / GIB:.2f} GiB) is smaller than one "
                f"max_model_len ({plan.max_model_len}) sequence needs ({needed / GIB:.2f} GiB)"
            )
        else:
            probability = 1.0 if fixed_kv is not None else edge_start_probability(plan)
            if probability < self.min_start_probability:
                failure = Cause.OOM
                reason = (
                    f"CUDA-graph capture at the device edge: budget {plan.budget_bytes / GIB:.2f} of "
                    f"{plan.device_bytes / GIB:.2f} GiB leaves a start chance of {probability:.2g}"
                )
            else:
                reason = f"fits: KV cache {kv / GIB:.2f} GiB, start chance {probability:.3g}"
        return Prediction(plan, kv, margin, needed, probability, failure, reason, cal)

    def calibrate(self, trials: Sequence[FrozenTrial]) -> Calibration:
        """Residuals (observed - predicted KV bytes) of every trial that reported its KV memory."""
        residuals = []
        for trial in trials:
            observed = self._observed_kv_bytes(trial)
            flags = trial.user_attrs.get("flags")
            if observed is None or not isinstance(flags, dict):
                continue
            residuals.append(observed - self.plan(flags).kv_cache_bytes)
        if not residuals:
            return Calibration()
        median = int(statistics.median(residuals))
        spread = max(abs(r - median) for r in residuals)
        return Calibration(median, spread, len(residuals))

    def _observed_kv_bytes(self, trial: FrozenTrial) -> int | None:
        attrs = trial.user_attrs
        capacity = attrs.get("capacity")
        if isinstance(capacity, dict):
            gib = capacity.get("available_kv_cache_gib")
            if isinstance(gib, int | float):
                return int(gib * GIB)
            tokens = capacity.get("kv_tokens")
            flags = attrs.get("flags")
            if isinstance(tokens, int) and isinstance(flags, dict):
                return tokens * self.plan(flags).kv_bytes_per_token
        diagnosis = attrs.get("diagnosis")
        if attrs.get("cause") == Cause.KV_TOO_SMALL.value and isinstance(diagnosis, dict):
            gib = diagnosis.get("available_gib")
            if isinstance(gib, int | float):
                return int(gib * GIB)
            tokens = diagnosis.get("estimated_max_model_len")
            flags = attrs.get("flags")
            if isinstance(tokens, int | float) and isinstance(flags, dict):
                return int(tokens) * self.plan(flags).kv_bytes_per_token
        return None


def _key(flags: Mapping[str, Any]) -> str:
    return json.dumps(dict(flags), sort_keys=True, default=str)


@dataclass(frozen=True)
class Decision:
    """Before a launch: an outcome when the config must not be launched, and attrs to record either way."""

    outcome: TrialOutcome | None
    attrs: Mapping[str, Any] = field(default_factory=dict)


class PreLaunchCheck:
    """Repeat and feasibility checks, re-derived from the study's stored trials before every launch."""

    def __init__(self, model: MemoryModel | None, history: Callable[[], Sequence[FrozenTrial]]) -> None:
        self.model = model
        self._history = history

    def __call__(self, flags: Mapping[str, FlagValue]) -> Decision:
        """Decide on ``flags``: a repeat of a start failure, predicted infeasible, or free to launch."""
        trials = [t for t in self._history() if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
        key = _key(flags)
        starts = {c.value for c in START_FAILURES}
        for trial in trials:
            cause = trial.user_attrs.get("cause")
            if trial.state == TrialState.PRUNED and cause in starts:
                seen = trial.user_attrs.get("flags")
                if isinstance(seen, dict) and _key(seen) == key:
                    origin = int(trial.user_attrs.get("repeat_of", trial.number))
                    return Decision(
                        TrialOutcome(
                            cause=Cause(cause),
                            summary=f"not launched: the same config failed to start in trial {origin} "
                            f"({cause})",
                            attrs={"launched": False, "repeat_of": origin},
                        )
                    )
        if self.model is None:
            return Decision(None)
        prediction = self.model.predict(flags, self.model.calibrate(trials))
        attrs = {"memory_prediction": prediction.attrs()}
        if prediction.feasible:
            return Decision(None, attrs)
        return Decision(
            TrialOutcome(
                cause=Cause.PREDICTED_INFEASIBLE,
                summary=f"not launched: predicted {prediction.failure}: {prediction.reason}",
                attrs={"launched": False, **attrs},
            ),
            attrs,
        )


def note_preemptions(outcome: TrialOutcome) -> TrialOutcome:
    """Record the preemptions at the operating point (``server_delta``) and flag a storm in the summary.

    A storm: at least ``PREEMPTION_STORM_RATIO`` preemptions per completed request. See the module
    docstring for why this is a note, not a constraint.
    """
    delta = outcome.attrs.get("server_delta")
    if not isinstance(delta, Mapping):
        return outcome
    count = delta.get("preemptions")
    if not isinstance(count, int | float) or count <= 0:
        return outcome
    point = outcome.attrs.get("operating_point")
    completed = point.get("completed") if isinstance(point, Mapping) else None
    probes = outcome.attrs.get("probes")
    if not isinstance(completed, int | float) and isinstance(probes, list) and probes:
        last = probes[-1]
        completed = last.get("completed") if isinstance(last, Mapping) else None
    per_request = count / completed if isinstance(completed, int | float) and completed > 0 else None
    storm = per_request is None or per_request >= PREEMPTION_STORM_RATIO
    attrs = {**outcome.attrs, "preemptions": count, "preemption_storm": storm}
    summary = outcome.summary
    if storm:
        summary += f"; preemption storm: {count:.0f} preemptions (KV cache too small for this batch)"
    return replace(outcome, summary=summary, attrs=attrs)


def memory_model_for(loaded: LoadedStudy, device: Device) -> MemoryModel | None:
    """The study's memory model (``memory_model`` in the spec), or None when it is off or ``gpu: auto``
    finds no GPU (then the feasibility check steps aside)."""
    section = loaded.spec.memory_model
    if section is None:
        return None
    arch = load_model_arch(resolve_model_path(section.model, loaded.base_dir))
    gpu = device_profile(device) if section.gpu == "auto" else gpu_profile(section.gpu)
    if gpu is None:
        return None
    return MemoryModel(
        arch, gpu, loaded.spec.server.args, min_start_probability=section.min_start_probability
    )
