"""Before each launch: skip configs the memory model says cannot start, and configs already seen to crash.

A launch costs minutes of GPU time; a config that cannot fit should cost nothing. :class:`MemoryModel`
predicts one config's memory (:func:`autotune.hardware.memory.plan_memory`) and calls it infeasible only when
the start would fail beyond reasonable doubt (conservative: a config that could start is never skipped):

* ``oom``: the weights alone do not fit on the device;
* ``kv_too_small``: even with the uncertainty margin there is no KV memory, or too little for one
  ``max_model_len`` sequence;
* ``oom`` at the device edge: the chance that CUDA-graph capture still fits
  (:func:`autotune.hardware.memory.edge_start_probability`) is below ``min_start_probability``;
* ``crashed_under_load``: the chance that it starts and then survives a large batch (the crash chance
  that this study's crashes under load teach, :mod:`autotune.hardware.headroom`) is below
  ``min_start_probability``.

Calibration: the study's own trials correct the model's overhead estimate for this model and device,
and the launches that started or ran out of memory at start draw the device edge
(:class:`autotune.hardware.memory.DeviceEdge`): a config with no more spare memory than one that ran out is
not launched, and the start chance climbs back only towards the smallest spare that started. Each trial that
reported its KV memory (the capacity line's ``Available KV cache memory`` or KV tokens, or a ``KV cache is
needed ...`` failure's available GiB / estimated max model length) gives a residual (observed - predicted KV
bytes). :func:`autotune.hardware.memfit.fit_residuals` fits them to an offset plus factors on the plan's
activation and CUDA-graph estimates (the constant median offset while those did not vary); the fit's
correction for a config is added to its prediction, and its uncertainty there (the residuals' spread, growing
outside the activation and graph sizes launched so far) sets the margin. Without observations the margin is 5
% of the estimated overhead (activations, CUDA graphs, non-torch memory), the memory model's stated accuracy.
It is derived from storage at every trial (stateless, so resume works).

Repeats: a config identical to a trial already pruned with a start-failure cause is pruned with the
same cause and ``repeat_of``, without a launch. Beyond the crash boundary (:mod:`autotune.predict.boundary`):
a config that asks at least as much memory as one that failed to start for memory is not launched either
(``beyond``); this needs no memory model.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from optuna.trial import FrozenTrial, TrialState

from autotune.flags import FlagValue
from autotune.hardware.catalog import GIB, GpuProfile, ModelArch, gpu_profile, load_model_arch
from autotune.hardware.gpu import Device, device_profile
from autotune.hardware.headroom import Run, RuntimeEdge
from autotune.hardware.memfit import Observation, ResidualFit, fit_residuals
from autotune.hardware.memory import (
    DeviceEdge,
    MemoryPlan,
    dtype_bytes,
    kv_bytes_for_tokens,
    kv_bytes_per_token,
    plan_memory,
    weight_bytes,
)
from autotune.inputs.loader import LoadedStudy, resolve_model_path
from autotune.outcome import Cause, TrialOutcome
from autotune.predict.boundary import beyond_boundary
from autotune.sim.speculative import HEAD_DRAFTERS, SpecConfigError, parse_speculative_config
from autotune.store.record import TrialRecord

START_FAILURES = (Cause.OOM, Cause.KV_TOO_SMALL, Cause.INVALID_CONFIG, Cause.START_FAILED)
"""Causes that make an identical config a known repeat (never launched again)."""
PRIOR_MARGIN = 0.05
"""Uncalibrated uncertainty of the overhead estimate (activations + CUDA graphs + non-torch)."""
CALIBRATED_MARGIN = 0.02
"""Floor of the margin once observations exist (fraction of the overhead estimate)."""
WEIGHTS_MARGIN = 0.9
"""Weights are called too big only when 90 % of the estimate already exceeds the device."""


@dataclass(frozen=True)
class Calibration:
    """What the study's trials taught about this model on this device."""

    fit: ResidualFit = field(default_factory=ResidualFit)
    """Observed - predicted KV-cache bytes fitted over the plans' activation and CUDA-graph estimates."""
    edge: DeviceEdge = field(default_factory=DeviceEdge)
    """The device edge as launches showed it (started, or out of memory at start)."""
    runtime: RuntimeEdge = field(default_factory=RuntimeEdge)
    """The headroom past the budget that launches under load showed (crashed, or ran through)."""

    @property
    def offset_bytes(self) -> int:
        """The fit's constant term (the median residual while the estimates did not vary)."""
        return self.fit.offset_bytes

    @property
    def spread_bytes(self) -> int:
        """Largest distance of a residual from the fit."""
        return self.fit.spread_bytes

    @property
    def observations(self) -> int:
        """Trials that reported their KV memory."""
        return self.fit.observations


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
    """The failure predicted beyond doubt (``oom`` or ``kv_too_small`` at start, ``crashed_under_load``),
    or None."""
    reason: str
    calibration: Calibration = field(default_factory=Calibration)
    correction_bytes: int = 0
    """What the calibration added to the plan's KV prediction for this config."""
    uncertainty_bytes: int = 0
    """How far that correction may be off for this config (part of the margin)."""
    crash_probability: float = 0.0
    """The chance that it crashes under load once started (:mod:`autotune.hardware.headroom`)."""

    @property
    def feasible(self) -> bool:
        """Whether the config may be launched."""
        return self.failure is None

    @property
    def run_probability(self) -> float:
        """The chance that it starts and runs its probes through: the start chance times no crash."""
        return self.start_probability * (1.0 - self.crash_probability)

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
            "calibration_offset_gib": gib(self.correction_bytes),
            "calibration_uncertainty_gib": gib(self.uncertainty_bytes),
            "activation_factor": round(self.calibration.fit.activation_factor, 3),
            "cuda_graph_factor": round(self.calibration.fit.cuda_graph_factor, 3),
            "calibration_observations": self.calibration.observations,
            **self.calibration.runtime.attrs(plan),
        }


def _int(env: Mapping[str, FlagValue], key: str, default: int) -> int:
    value = env.get(key)
    return default if value is None or isinstance(value, bool) else int(value)


def _cuda_graphs(env: Mapping[str, FlagValue]) -> int | None:
    """How many CUDA graphs the flags capture: none in eager mode or at ``-O0``; with
    ``max_cudagraph_capture_size``, vLLM's grid up to it; ``None``: vLLM's default for max_num_seqs."""
    if env.get("enforce_eager") is True or str(env.get("optimization_level", "2")).lstrip("O") == "0":
        return 0
    largest = env.get("max_cudagraph_capture_size")
    if not isinstance(largest, int) or isinstance(largest, bool):
        return None
    sizes = [s for s in (1, 2, 4) if s <= largest]
    return len(sizes) + len(range(8, min(largest + 1, 256), 8)) + len(range(256, largest + 1, 16))


def _draft(env: Mapping[str, FlagValue], arch: ModelArch) -> tuple[int, int]:
    """(weight bytes, KV bytes per token) per GPU of the speculative drafter the flags name (its
    ``speculative_config.KEY`` values; none for n-gram drafting, a head for EAGLE/MTP, a whole model)."""
    keys = {k.partition(".")[2]: v for k, v in env.items() if k.startswith("speculative_config.")}
    method = keys.get("method")
    if not keys or method in (None, "off"):
        return 0, 0
    tp = _int(env, "tensor_parallel_size", 1)
    try:
        spec = parse_speculative_config(keys, arch, tp)
    except (SpecConfigError, ValueError):
        return 0, 0  # vLLM refuses it at start: invalid_config, not a memory question
    if spec.draft is None:
        return 0, 0
    dtype = str(env.get("dtype", "auto"))
    weights = weight_bytes(spec.draft, dtype, spec.draft_tensor_parallel_size)
    if spec.method in HEAD_DRAFTERS or spec.method.endswith("_mtp"):  # shares the target's LM head
        name = arch.torch_dtype if dtype == "auto" else dtype
        weights -= spec.draft.vocab_size * spec.draft.hidden_size * dtype_bytes(name) // tp
    kv = kv_bytes_per_token(spec.draft, str(env.get("kv_cache_dtype", "auto")), dtype, tp)
    return weights, kv


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
        draft_weights, draft_kv = _draft(env, self.arch)
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
            num_cuda_graphs=_cuda_graphs(env),
            extra_weight_bytes=draft_weights,
            extra_kv_bytes_per_token=draft_kv,
        )

    def predict(self, flags: Mapping[str, FlagValue], calibration: Calibration | None = None) -> Prediction:
        """Predict whether ``flags`` start; ``failure`` is set only when the start cannot succeed."""
        cal = calibration or Calibration()
        plan = self.plan(flags)
        env = {**self.fixed, **flags}
        overhead = plan.activation_bytes + plan.cuda_graph_bytes + plan.non_torch_bytes
        correction, uncertainty = cal.fit.predict(plan)
        if cal.observations:
            margin = uncertainty + int(CALIBRATED_MARGIN * overhead) + 16 * 1024**2
        else:
            margin = int(PRIOR_MARGIN * overhead)
        kv = plan.kv_cache_bytes + correction
        fixed_kv = env.get("kv_cache_memory_bytes")
        if fixed_kv is not None and not isinstance(fixed_kv, bool):
            kv, margin = int(fixed_kv), 0  # vLLM sizes the KV cache to exactly this
            correction = uncertainty = 0
        needed = kv_bytes_for_tokens(
            self.arch,
            plan.max_model_len,
            str(env.get("kv_cache_dtype", "auto")),
            str(env.get("dtype", "auto")),
            _int(env, "tensor_parallel_size", 1),
        )
        failure: Cause | None = None
        probability, crash = 1.0, 0.0
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
            probability = 1.0 if fixed_kv is not None else cal.edge.start_probability(plan)
            crash = 0.0 if fixed_kv is not None else cal.runtime.crash_probability(plan)
            if probability < self.min_start_probability:
                failure = Cause.OOM
                reason = (
                    f"CUDA-graph capture at the device edge: budget {plan.budget_bytes / GIB:.2f} of "
                    f"{plan.device_bytes / GIB:.2f} GiB leaves a start chance of {probability:.2g}"
                )
            elif cal.runtime.crashed is not None and probability * (1.0 - crash) < self.min_start_probability:
                # Only a crash this study saw refuses a launch; untried headroom's risk ranks, never refuses.
                failure = Cause.CRASHED_UNDER_LOAD
                reason = f"runtime headroom: {cal.runtime.reason(plan)}"
            else:
                reason = f"fits: KV cache {kv / GIB:.2f} GiB, start chance {probability:.3g}"
                if crash > 0:
                    reason += f", crash chance under load {crash:.2g} ({cal.runtime.reason(plan)})"
        return Prediction(
            plan, kv, margin, needed, probability, failure, reason, cal, correction, uncertainty, crash
        )

    def calibrate(self, trials: Sequence[FrozenTrial]) -> Calibration:
        """The residuals (observed - predicted KV bytes) of every trial that reported its KV memory, fitted
        (:func:`autotune.hardware.memfit.fit_residuals`), and the launches seen at the device edge (started,
        or out of memory at start)."""
        observations = []
        starts = []
        runs = []
        for trial in trials:
            record = TrialRecord.from_trial(trial)
            observed = self._observed_kv_bytes(record)
            if observed is not None:
                observations.append(Observation.of(self.plan(record.flags), observed))
            started = self._edge_outcome(trial, record)
            if started is not None:
                starts.append((self.plan(record.flags), started))
            crashed = self._load_outcome(trial, record)
            if crashed is not None:
                runs.append(Run(trial.number, self.plan(record.flags), crashed))
        return Calibration(fit_residuals(observations), DeviceEdge.of(starts), RuntimeEdge.of(runs))

    def _edge_outcome(self, trial: FrozenTrial, record: TrialRecord) -> bool | None:
        """True: the launch started (it got past CUDA-graph capture); False: out of memory at start past
        the weights; None: no evidence about the device edge (not launched, KV sized by bytes, other)."""
        if record.launched is False or "kv_cache_memory_bytes" in {**self.fixed, **record.flags}:
            return None
        if trial.state == TrialState.COMPLETE or record.start_s is not None or record.capacity is not None:
            return True
        if trial.state == TrialState.PRUNED and record.cause is Cause.OOM:
            plan = self.plan(record.flags)
            weights_fit = WEIGHTS_MARGIN * plan.weights_bytes + plan.non_torch_bytes <= plan.device_bytes
            return False if weights_fit else None
        return None

    def _load_outcome(self, trial: FrozenTrial, record: TrialRecord) -> bool | None:
        """True: the launch started and crashed under load; False: it ran its probes through (measured, no
        rate met the SLOs, or the client could not measure it); None: no evidence about the runtime
        headroom (never under load, KV sized by bytes)."""
        if record.launched is False or "kv_cache_memory_bytes" in {**self.fixed, **record.flags}:
            return None
        if record.cause is Cause.CRASHED_UNDER_LOAD:
            return True
        if trial.state == TrialState.COMPLETE or record.cause in (Cause.SLO_UNREACHABLE, Cause.UNMEASURABLE):
            return False
        return None

    def _observed_kv_bytes(self, record: TrialRecord) -> int | None:
        capacity = record.capacity
        if isinstance(capacity, Mapping):
            gib = capacity.get("available_kv_cache_gib")
            if isinstance(gib, int | float):
                return int(gib * GIB)
            tokens = capacity.get("kv_tokens")
            if isinstance(tokens, int):
                return tokens * self.plan(record.flags).kv_bytes_per_token
        diagnosis = record.diagnosis
        if record.cause is Cause.KV_TOO_SMALL and isinstance(diagnosis, Mapping):
            gib = diagnosis.get("available_gib")
            if isinstance(gib, int | float):
                return int(gib * GIB)
            tokens = diagnosis.get("estimated_max_model_len")
            if isinstance(tokens, int | float):
                return int(tokens) * self.plan(record.flags).kv_bytes_per_token
        return None


def _key(flags: Mapping[str, Any]) -> str:
    return json.dumps(dict(flags), sort_keys=True, default=str)


@dataclass(frozen=True)
class Decision:
    """Before a launch: an outcome when the config must not be launched, and the memory model's numbers
    (recorded either way; ``None`` without a memory model)."""

    outcome: TrialOutcome | None
    prediction: Mapping[str, Any] | None = None


class PreLaunchCheck:
    """Repeat and feasibility checks, re-derived from the study's stored trials before every launch."""

    def __init__(self, model: MemoryModel | None, history: Callable[[], Sequence[FrozenTrial]]) -> None:
        self.model = model
        self._history = history

    def __call__(self, flags: Mapping[str, FlagValue]) -> Decision:
        """Decide on ``flags``: a repeat of a start failure, predicted infeasible, or free to launch."""
        trials = [t for t in self._history() if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
        key = _key(flags)
        for trial in trials:
            record = TrialRecord.from_trial(trial)
            cause = record.cause
            if trial.state == TrialState.PRUNED and cause in START_FAILURES and _key(record.flags) == key:
                assert cause is not None
                origin = record.repeat_of if record.repeat_of is not None else trial.number
                return Decision(
                    TrialOutcome(
                        cause=cause,
                        summary=f"not launched: the same config failed to start in trial {origin} ({cause})",
                        attrs=TrialRecord(launched=False, repeat_of=origin).to_attrs(),
                    )
                )
        beyond = beyond_boundary(flags, trials)
        if beyond is not None:
            return Decision(
                TrialOutcome(
                    cause=Cause.PREDICTED_INFEASIBLE,
                    summary=f"not launched: predicted {beyond.cause}: {beyond.reason(flags)}",
                    attrs=TrialRecord(launched=False, beyond=beyond.trial).to_attrs(),
                )
            )
        if self.model is None:
            return Decision(None)
        prediction = self.model.predict(flags, self.model.calibrate(trials))
        numbers = prediction.attrs()
        if prediction.feasible:
            return Decision(None, numbers)
        return Decision(
            TrialOutcome(
                cause=Cause.PREDICTED_INFEASIBLE,
                summary=f"not launched: predicted {prediction.failure}: {prediction.reason}",
                attrs=TrialRecord(launched=False, memory_prediction=numbers).to_attrs(),
            ),
            numbers,
        )


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
