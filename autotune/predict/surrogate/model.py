"""The study's surrogate: a config's SLO-constrained rate predicted by the fluid model, calibrated to the
trials' measured latencies.

:class:`Surrogate` turns a config (the space's flags over the study's fixed flags) into the fluid model's
:class:`~autotune.predict.surrogate.fluid.Engine`: the simulator's flag parser and resolver give the
scheduler's limits, block size, KV dtype, parallelism and CUDA-graph coverage (:mod:`autotune.sim.resolve`),
the memory model the KV capacity (a launched trial's reported one where known). :class:`Params` are what is
calibrated: the cost model's :class:`~autotune.sim.cost.Scales` and one factor per SLO term (how far the
measured statistic lies from the model's: request-length tails, burstiness, the client's view).

:func:`calibrate` fits them to every measured probe of the study (a maximum a posteriori fit in log
space: the residuals log(predicted / measured) over a prior around the simulator's constants, with a
robust loss, by Levenberg-Marquardt), and keeps their covariance, so a prediction carries an interval
(:meth:`Calibration.draws`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from optuna.trial import FrozenTrial, TrialState

from autotune.flags import FlagValue
from autotune.hardware.catalog import GpuProfile, ModelArch
from autotune.inputs.slo_terms import SloTerm
from autotune.inputs.space import SearchSpace
from autotune.outcome import Cause
from autotune.predict.feasibility import Calibration as MemoryCalibration
from autotune.predict.feasibility import MemoryModel
from autotune.predict.surrogate.fluid import (
    MAX_QUANTILE,
    Bound,
    Engine,
    Traffic,
    capacity,
    latency,
    slo_rate,
    state,
)
from autotune.sim.cost import CostModel, Execution, Scales
from autotune.sim.flags import FlagError, parse_flags
from autotune.sim.resolve import ConfigError, resolve
from autotune.store.record import TrialRecord

#: Prior spread (log scale) of each cost scale: how far a real GPU may sit from the simulator's constant.
SCALE_PRIOR = {
    "compute": 0.3,
    "weights": 0.2,
    "attention": 0.3,
    "step_overhead": 0.7,
    "per_seq_overhead": 0.9,
}
#: Prior spread (log scale) of each SLO term's factor around 1.
FACTOR_PRIOR = 0.5
#: Spread (log scale) of one measured statistic around the model's (the residuals' scale).
OBSERVATION_SIGMA = 0.15
#: Spread (log scale) of the saturation probe's completed requests per second around the model's capacity
#: (a burst that ramps up and drains, not a steady state).
CAPACITY_SIGMA = 0.3
#: A measured value beyond this multiple of its term's limit is an overloaded probe: its queue grew
#: through the probe, so it says little about the steady state and is left out of the fit.
OVERLOAD = 4.0


@dataclass(frozen=True)
class Params:
    """What a calibration sets: the cost model's scales and each SLO term's factor."""

    scales: Scales = field(default_factory=Scales)
    factors: Mapping[str, float] = field(default_factory=dict)

    def vector(self, terms: Sequence[str]) -> np.ndarray:
        names = Scales.names()
        values = [getattr(self.scales, n) for n in names] + [self.factors.get(t, 1.0) for t in terms]
        out: np.ndarray = np.log(np.array(values, dtype=float))
        return out

    @classmethod
    def of(cls, x: np.ndarray, terms: Sequence[str]) -> Params:
        names = Scales.names()
        values = np.exp(x)
        scales = Scales(**{n: float(values[i]) for i, n in enumerate(names)})
        return cls(scales, {t: float(values[len(names) + i]) for i, t in enumerate(terms)})

    def as_dict(self) -> dict[str, float]:
        out = {n: round(getattr(self.scales, n), 4) for n in Scales.names()}
        return out | {f"factor {t}": round(v, 4) for t, v in self.factors.items()}


@dataclass(frozen=True)
class Point:
    """One measured probe: its arrival rate and each SLO term's value (seconds)."""

    rate: float
    values: Mapping[str, float]


@dataclass(frozen=True)
class Observation:
    """What one launched trial measured."""

    trial: int
    flags: Mapping[str, FlagValue]
    kv_tokens: int | None
    points: tuple[Point, ...]
    slo_rate: float | None
    """The measured SLO-constrained rate (requests per second); 0.0 when no rate met the SLO."""
    baseline: bool = False
    capacity: float | None = None
    """Requests per second the saturation probe completed."""


def observations(trials: Sequence[FrozenTrial]) -> list[Observation]:
    """Every launched trial's measurement (its curve), in trial order; repeats and failures to start
    carry none."""
    out = []
    for trial in sorted(trials, key=lambda t: t.number):
        if trial.state not in (TrialState.COMPLETE, TrialState.PRUNED):
            continue
        record = TrialRecord.from_trial(trial)
        curve = record.curve or {}
        terms = list(curve.get("terms") or [])
        points = tuple(
            Point(float(p[0]), dict(zip(terms, map(float, p[1:]), strict=True)))
            for p in curve.get("points") or []
            if len(p) == len(terms) + 1
        )
        capacity = curve.get("capacity")
        if record.launched is False or not (points or capacity):
            continue
        measured: float | None = None
        if trial.state == TrialState.COMPLETE and record.estimate and record.estimate.get("rate"):
            measured = float(record.estimate["rate"])
        elif record.cause is Cause.SLO_UNREACHABLE:
            measured = 0.0
        kv = (record.capacity or {}).get("kv_tokens")
        out.append(
            Observation(
                trial.number,
                dict(record.flags),
                int(kv) if isinstance(kv, int | float) and kv > 0 else None,
                points,
                measured,
                bool(record.baseline),
                float(capacity) if isinstance(capacity, int | float) and capacity > 0 else None,
            )
        )
    return out


def _quantile(term: SloTerm) -> float | None:
    """The quantile the fluid model reads a term at (``max``: the 99.9th percentile)."""
    return MAX_QUANTILE if term.statistic == "max" else term.quantile


@dataclass(frozen=True)
class _Resolved:
    """What the fluid model takes of a config the simulator resolved (a subset of
    :class:`autotune.sim.resolve.ResolvedConfig`, without the memory utilization: configs that differ
    only there share a :meth:`Surrogate.signature` unless their KV capacity changes the slots)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    tensor_parallel_size: int
    kv_cache_dtype: str
    dtype: str
    replicas: int
    execution: Execution


class Surrogate:
    """The fluid model of one study's configs: its model on its GPU, its fixed flags, its traffic, its
    SLO terms and its memory model."""

    def __init__(
        self,
        arch: ModelArch,
        gpu: GpuProfile,
        space: SearchSpace,
        traffic: Traffic,
        terms: Sequence[SloTerm],
        memory: MemoryModel,
    ) -> None:
        self.arch = arch
        self.gpu = gpu
        self.space = space
        self.traffic = traffic
        self.terms = tuple(terms)
        self.keys = tuple(t.key for t in terms)
        self.memory = memory
        self._configs: dict[str, _Resolved | None] = {}

    def resolved(self, flags: Mapping[str, FlagValue]) -> _Resolved | None:
        """The scheduler's view of ``flags`` (cached): None when the simulator refuses them."""
        key = self.space.launch_key(flags)
        if key not in self._configs:
            argv = ["surrogate", "--sim-hardware", self.gpu.name, *self.space.argv(flags)]
            try:
                serve = parse_flags(argv, ignore_unknown=True)
                cfg = resolve(serve, self.arch)
            except (FlagError, ConfigError, ValueError):
                self._configs[key] = None
            else:
                self._configs[key] = _Resolved(
                    cfg.max_num_seqs,
                    cfg.max_num_batched_tokens,
                    cfg.block_size,
                    cfg.tensor_parallel_size,
                    cfg.kv_cache_dtype,
                    serve.dtype,
                    cfg.data_parallel_size,
                    cfg.execution,
                )
        return self._configs[key]

    def signature(self, flags: Mapping[str, FlagValue], kv_tokens: int) -> tuple[object, ...] | None:
        """What the fluid model sees of a config (None: the simulator refuses it): configs of one
        signature get one prediction, as they differ only where the model is blind (a KV cache larger
        than the running sequences use; slots within 5 % of each other)."""
        r = self.resolved(flags)
        if r is None:
            return None
        per_seq = self.traffic.prompt + self.traffic.output / 2.0
        slots = max(1.0, min(float(r.max_num_seqs), kv_tokens / max(per_seq, 1.0)))
        return (r, round(math.log(slots) / math.log(1.05)))

    def kv_tokens(self, flags: Mapping[str, FlagValue], calibration: MemoryCalibration | None) -> int:
        """The KV capacity the memory model predicts for ``flags`` (tokens, one replica)."""
        prediction = self.memory.predict(flags, calibration)
        return max(0, prediction.kv_cache_bytes) // max(1, prediction.plan.kv_bytes_per_token)

    def engine(self, flags: Mapping[str, FlagValue], scales: Scales, kv_tokens: int) -> Engine | None:
        """The fluid model's engine for ``flags`` with ``scales`` (None: the simulator refuses them)."""
        r = self.resolved(flags)
        if r is None:
            return None
        cost = CostModel(
            self.arch,
            self.gpu,
            kv_cache_dtype=r.kv_cache_dtype,
            dtype=r.dtype,
            tensor_parallel_size=r.tensor_parallel_size,
            block_size=r.block_size,
            execution=r.execution,
            scales=scales,
        )
        return Engine(cost, r.max_num_seqs, r.max_num_batched_tokens, kv_tokens, replicas=r.replicas)

    def bounds(self, params: Params) -> list[Bound]:
        return [
            Bound(
                t.metric,
                t.quantile if t.statistic != "max" else MAX_QUANTILE,
                t.limit_s,
                params.factors.get(t.key, 1.0),
            )
            for t in self.terms
        ]

    def slo_rate(self, engine: Engine, params: Params) -> float:
        """The predicted SLO-constrained rate (requests per second)."""
        return slo_rate(engine, self.traffic, self.bounds(params))

    def predicted(self, engine: Engine, params: Params, point: Point) -> dict[str, float]:
        """Each measured term's value predicted at ``point``'s rate (an overflowing queue: extrapolated
        steeply from just under capacity, so a fit sees how far past it the rate is)."""
        rate = point.rate
        st = state(engine, self.traffic, rate)
        scale = 1.0
        if st is None:
            cap = capacity(engine, self.traffic)
            edge = 0.995 * cap
            st = state(engine, self.traffic, edge) if edge > 0 else None
            if st is None:
                return dict.fromkeys(point.values, 1000.0)
            scale = (rate / edge) ** 8
        out = {}
        for term in self.terms:
            if term.key not in point.values:
                continue
            value = latency(st, engine, self.traffic, term.metric, _quantile(term)) * params.factors.get(
                term.key, 1.0
            )
            out[term.key] = value * scale
        return out


@dataclass(frozen=True)
class Calibration:
    """A fit of :class:`Params` to a study's observations, with its covariance (log space)."""

    params: Params
    mean: np.ndarray
    covariance: np.ndarray
    observations: int
    """Trials it was fitted to."""
    points: int
    error: float
    """Median |log(predicted / measured)| over the fitted values."""

    def draws(self, n: int, seed: int = 0) -> list[Params]:
        """``n`` parameter sets drawn from the fit's normal approximation (the first is the fit itself)."""
        rng = np.random.default_rng(seed)
        keys = list(self.params.factors)
        try:
            samples = rng.multivariate_normal(self.mean, self.covariance, size=max(0, n - 1))
        except (np.linalg.LinAlgError, ValueError):
            samples = np.tile(self.mean, (max(0, n - 1), 1))
        return [self.params, *(Params.of(x, keys) for x in samples)]


def prior(surrogate: Surrogate) -> Calibration:
    """No measurement yet: the simulator's constants, factors of 1, the prior's spread."""
    keys = list(surrogate.keys)
    params = Params(Scales(), dict.fromkeys(keys, 1.0))
    sigma = np.array([SCALE_PRIOR[n] for n in Scales.names()] + [FACTOR_PRIOR] * len(keys))
    return Calibration(params, params.vector(keys), np.diag(sigma**2), 0, 0, math.nan)


def _minimize(
    residuals: Callable[[np.ndarray], np.ndarray],
    objective: Callable[[np.ndarray], tuple[np.ndarray, float]],
    x: np.ndarray,
    mean: np.ndarray,
    sigma: np.ndarray,
    iterations: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Levenberg-Marquardt on the Cauchy loss, reweighted each step, from ``x`` under the prior
    (``mean``, ``sigma``): the fit, its residuals and the last Jacobian (forward differences)."""
    r, cost = objective(x)
    damping = 1e-2
    step = 1e-3
    jac = np.zeros((len(r), len(x)))
    for _ in range(iterations):
        for j in range(len(x)):
            dx = np.zeros_like(x)
            dx[j] = step
            jac[:, j] = (residuals(x + dx) - r) / step
        weights = 1.0 / (1.0 + r**2)  # iteratively reweighted: the Cauchy loss's weights
        a = (jac * weights[:, None]).T @ jac + np.diag(1.0 / sigma**2)
        g = (jac * weights[:, None]).T @ r + (x - mean) / sigma**2
        improved = False
        for _ in range(6):
            delta = np.linalg.solve(a + damping * np.diag(np.diag(a)), -g)
            r_new, cost_new = objective(x + delta)
            if cost_new < cost:
                x, r, cost = x + delta, r_new, cost_new
                damping = max(damping / 3.0, 1e-6)
                improved = True
                break
            damping *= 4.0
        if not improved or float(np.max(np.abs(delta))) < 1e-3:
            break
    return x, r, jac


def calibrate(
    surrogate: Surrogate,
    found: Sequence[Observation],
    memory: MemoryCalibration | None = None,
    start: Calibration | None = None,
    iterations: int = 12,
) -> Calibration:
    """Fit :class:`Params` to ``found`` (the prior when none carries a point)."""
    keys = list(surrogate.keys)
    limits = {t.key: t.limit_s for t in surrogate.terms}
    base = prior(surrogate)
    sigma = np.sqrt(np.diag(base.covariance))
    engines = []
    for obs in found:
        kv = obs.kv_tokens if obs.kv_tokens is not None else surrogate.kv_tokens(obs.flags, memory)
        kept = tuple(
            p for p in obs.points if all(v <= OVERLOAD * limits.get(k, math.inf) for k, v in p.values.items())
        )
        if (kept or obs.capacity) and surrogate.resolved(obs.flags) is not None:
            engines.append((obs, kv, kept))
    if not engines:
        return base

    scale: list[float] = []
    """Each residual's sigma, in the order :func:`residuals` gives them (to read them back as log errors)."""

    def residuals(x: np.ndarray) -> np.ndarray:
        params = Params.of(x, keys)
        out: list[float] = []
        scale.clear()
        for obs, kv, kept in engines:
            engine = surrogate.engine(obs.flags, params.scales, kv)
            assert engine is not None
            for point in kept:
                predicted = surrogate.predicted(engine, params, point)
                for key, measured in point.values.items():
                    if key in predicted:
                        out.append(math.log(predicted[key] / measured) / OBSERVATION_SIGMA)
                        scale.append(OBSERVATION_SIGMA)
            if obs.capacity:
                modelled = max(capacity(engine, surrogate.traffic), 1e-9)
                out.append(math.log(modelled / obs.capacity) / CAPACITY_SIGMA)
                scale.append(CAPACITY_SIGMA)
        return np.array(out)

    def objective(x: np.ndarray) -> tuple[np.ndarray, float]:
        r = residuals(x)
        robust = np.log1p(r**2)  # Cauchy loss: a few odd probes do not drag the fit
        prior_r = (x - base.mean) / sigma
        return r, float(robust.sum() + (prior_r**2).sum())

    x = (start.mean if start is not None and start.mean.shape == base.mean.shape else base.mean).copy()
    x, r, jac = _minimize(residuals, objective, x, base.mean, sigma, iterations)
    weights = 1.0 / (1.0 + r**2)
    information = (jac * weights[:, None]).T @ jac + np.diag(1.0 / sigma**2)
    try:
        covariance = np.linalg.inv(information)
    except np.linalg.LinAlgError:
        covariance = base.covariance
    r = residuals(x)  # at the fit (and the scale with it)
    errors = np.abs(r) * np.array(scale)
    return Calibration(
        Params.of(x, keys),
        x,
        covariance,
        len(engines),
        len(r),
        float(np.median(errors)) if len(errors) else math.nan,
    )
