"""The next launch, proposed by the calibrated surrogate; and when it predicts badly, no proposal.

Before each launch :class:`Proposer` re-derives everything from the study's stored trials (so every
worker of a study agrees): it calibrates the surrogate to the measured trials
(:func:`autotune.predict.surrogate.model.calibrate`, warm-started from its last fit), predicts the SLO rate
of a fixed, seeded sample of the space's configs (the defaults and ``candidates`` random ones; a small
discrete space is ranked whole), skipping those that break a known constraint, that the memory model rules
out, that lie beyond the crash boundary (:mod:`autotune.predict.boundary`), that any trial holds, or that the
model cannot tell from a measured one; draws the calibration's uncertainty for the best of them; and proposes
the one with the highest expected rate, plus a quarter of its 10-90 % spread (a little optimism where the
model is unsure), times its predicted chance to start and then run through its probes (the memory model's
start chance, and the crash chance under load that this study's crashes teach,
:mod:`autotune.hardware.headroom`): the same memory the screen before every launch judges the sampler's
configs by. The prediction is stored on the trial (``TrialRecord.surrogate``).

Falling back: each proposal that was measured has an error ``|ln(measured / predicted)|`` (a proposal
that met the SLO at no rate counts as far off). Once the median error of ``window`` measured proposals in
a row exceeds ``ln(1 + tolerance)``, the surrogate has handed over for the rest of the study and the
study's own sampler draws every config (:func:`track_record` says why). The fit itself is judged too
(:class:`FitCheck`): once ``window`` trials are measured, a calibration whose median error on their SLO
rates exceeds the same limit is fitted again from the prior (the warm start may have wandered); the
better of the two ranks, and the proposal says it was refitted. When even that one is off, the surrogate
hands over; the study records why on the trial the sampler then draws (``TrialRecord.surrogate``'s
``handed_over``), which :func:`track_record` reads.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)
from optuna.trial import FrozenTrial, TrialState

from autotune.errors import AutotuneError
from autotune.flags import FlagValue
from autotune.inputs.loader import LoadedStudy
from autotune.inputs.space import SearchSpace
from autotune.load.probe import ProbeSchedule
from autotune.outcome import Cause
from autotune.predict.boundary import beyond, memory_failures
from autotune.predict.dryrun import sample_configs
from autotune.predict.feasibility import START_FAILURES, MemoryModel
from autotune.predict.feasibility import Calibration as MemoryCalibration
from autotune.predict.surrogate.fluid import Traffic
from autotune.predict.surrogate.model import Calibration, Observation, Surrogate, calibrate, observations
from autotune.store.record import TrialRecord
from autotune.units import format_figure

#: Configs of the space the surrogate ranks (plus the defaults), when the space is too big to rank whole.
CANDIDATES = 600
#: A discrete space of at most this many configs is ranked whole.
GRID_LIMIT = 2000
#: At most this many values of one parameter, for the space to count as discrete.
GRID_VALUES = 64
#: Parameter sets drawn from the calibration for the interval of the best-ranked configs.
DRAWS = 8
#: How many of the best point predictions get an interval.
TOP = 8
#: Measured proposals whose median error decides a hand-over.
WINDOW = 3
#: A median relative error beyond this hands over to the sampler.
TOLERANCE = 0.3
#: The error of a proposal that met the SLO at no rate (as if off by a factor of e^3 = 20).
UNREACHABLE_ERROR = 3.0


@dataclass(frozen=True)
class Proposal:
    """A config the surrogate would launch, with what it predicts."""

    flags: Mapping[str, FlagValue]
    rate: float
    """Predicted SLO-constrained rate (requests per second): the mean over the calibration's draws."""
    lo: float
    hi: float
    """The draws' 10th and 90th percentiles."""
    throughput: float
    """Predicted SLO-constrained output throughput (tok/s): ``rate`` times the mean output length."""
    start_probability: float
    calibrated_on: int
    """Measured trials the calibration was fitted to."""
    crash_probability: float = 0.0
    """The chance that it crashes under load once started."""
    fit: FitCheck | None = None
    """How the calibration it was ranked by reproduces the measured trials."""

    @property
    def run_probability(self) -> float:
        """The chance that it starts and runs through its probes."""
        return self.start_probability * (1.0 - self.crash_probability)

    def attrs(self) -> dict[str, float | int | str]:
        out: dict[str, float | int | str] = {
            "slo_rate": round(self.rate, 6),
            "lo": round(self.lo, 6),
            "hi": round(self.hi, 6),
            "slo_throughput": round(self.throughput, 3),
            "start_probability": round(self.start_probability, 4),
            "crash_probability": round(self.crash_probability, 4),
            "calibrated_on": self.calibrated_on,
        }
        if self.fit is not None and self.fit.trials:
            out["fit_error"] = round(math.expm1(self.fit.error), 4)
            if self.fit.refit:
                out["refit"] = "prior"
        return out


def rate_error(predicted: float, measured: float) -> float:
    """``|ln(measured / predicted)|`` of two SLO rates; a rate of 0 against a positive one counts as
    :data:`UNREACHABLE_ERROR`, two of 0 as none."""
    if measured <= 0 and predicted <= 0:
        return 0.0
    if measured <= 0 or predicted <= 0:
        return UNREACHABLE_ERROR
    return abs(math.log(measured / predicted))


@dataclass(frozen=True)
class FitCheck:
    """How a calibration reproduces the SLO rates of the measured trials."""

    error: float
    """Median :func:`rate_error` over them (0 without any)."""
    trials: int
    """Measured trials (an SLO rate, 0 included: met at no rate)."""
    refit: bool = False
    """The warm-started fit was over the limit and this one was fitted again from the prior."""
    window: int = WINDOW
    tolerance: float = TOLERANCE

    @property
    def over(self) -> bool:
        """Whether it is judged (``window`` measured trials or more) and off by more than the limit."""
        return self.trials >= self.window and self.error > math.log1p(self.tolerance)

    def handed_over(self) -> str:
        """Why the surrogate hands over for this fit, in words."""
        again = ", fitted again from the prior as well" if self.refit else ""
        return (
            f"the surrogate's fit was off by a median {math.expm1(self.error):.0%} on the SLO rates of the "
            f"{self.trials} measured trials{again} (limit {self.tolerance:.0%}): the sampler chooses "
            "from here on"
        )


@dataclass(frozen=True)
class Prediction:
    """How one proposal fared: what the surrogate predicted and what was measured (rates, req/s)."""

    trial: int
    predicted: float
    measured: float

    @property
    def error(self) -> float:
        return rate_error(self.predicted, self.measured)


@dataclass(frozen=True)
class TrackRecord:
    """Every measured proposal of a study, in trial order, and whether the surrogate has handed over."""

    predictions: tuple[Prediction, ...]
    handed_over: str | None
    """Why the surrogate stopped proposing (None: it still proposes)."""
    refits: tuple[int, ...] = ()
    """The proposals (trial numbers) ranked by a fit made again from the prior (the warm one was off)."""


def track_record(
    trials: Sequence[FrozenTrial], window: int = WINDOW, tolerance: float = TOLERANCE
) -> TrackRecord:
    """The surrogate's proposals that were measured, and the first run of ``window`` of them whose median
    error passed ``ln(1 + tolerance)`` (from then on it hands over)."""
    measured = {o.trial: o.slo_rate for o in observations(trials)}
    found = []
    fitted: str | None = None
    refits = []
    for trial in sorted(trials, key=lambda t: t.number):
        record = TrialRecord.from_trial(trial)
        said = (record.surrogate or {}).get("handed_over")
        if fitted is None and isinstance(said, str):
            fitted = said  # the fit was off: the study stored it on the trial the sampler then drew
        if (record.surrogate or {}).get("refit"):
            refits.append(trial.number)
        rate = measured.get(trial.number)
        if record.surrogate is None or "slo_rate" not in record.surrogate or rate is None:
            continue
        found.append(Prediction(trial.number, float(record.surrogate.get("slo_rate") or 0.0), rate))
    if fitted is not None:
        return TrackRecord(tuple(found), fitted, tuple(refits))
    limit = math.log1p(tolerance)
    for end in range(window, len(found) + 1):
        recent = found[end - window : end]
        median = statistics.median(p.error for p in recent)
        if median > limit:
            shown = ", ".join(
                f"trial {p.trial} {format_figure(p.measured)} vs {format_figure(p.predicted, 'req/s')}"
                for p in recent
            )
            why = (
                f"the surrogate's last {window} proposals were off by a median {math.expm1(median):.0%} "
                f"(limit {tolerance:.0%}: {shown}): the sampler chooses from here on"
            )
            return TrackRecord(tuple(found), why, tuple(refits))
    return TrackRecord(tuple(found), None, tuple(refits))


def _values(dist: BaseDistribution) -> list[FlagValue] | None:
    """Every value of a parameter's distribution, or None when it has more than :data:`GRID_VALUES`."""
    if isinstance(dist, CategoricalDistribution):
        return list(dist.choices)  # type: ignore[arg-type]
    if isinstance(dist, IntDistribution):
        count = (dist.high - dist.low) // dist.step + 1
        return list(range(dist.low, dist.high + 1, dist.step)) if count <= GRID_VALUES else None
    if isinstance(dist, FloatDistribution) and dist.step is not None:
        count = round((dist.high - dist.low) / dist.step) + 1
        if count <= GRID_VALUES:
            return [round(dist.low + i * dist.step, 10) for i in range(count)]
    return None


def grid(space: SearchSpace, limit: int) -> list[dict[str, FlagValue]] | None:
    """Every config of a small discrete space (the defaults first), or None when a parameter is continuous
    or has many values, or the space holds more than ``limit`` configs."""
    values: dict[str, list[FlagValue]] = {}
    for name, dist in space.distributions().items():
        found = _values(dist)
        if found is None:
            return None
        values[name] = found
    if math.prod(len(v) for v in values.values()) > limit:
        return None
    defaults = dict(space.defaults())
    combos = [dict(zip(values, combo, strict=True)) for combo in itertools.product(*values.values())]
    return [defaults, *(c for c in combos if c != defaults)]


def describe(record: TrackRecord) -> str | None:
    """One sentence on the surrogate's proposals that were measured (None when there were none)."""
    found = record.predictions
    if not found:
        return None
    median = statistics.median(p.error for p in found)
    text = (
        f"The surrogate proposed {len(found)} measured launch{'es' if len(found) > 1 else ''}: median "
        f"error of its predicted SLO rate {math.expm1(median):.0%}"
    )
    if record.refits:
        shown = ", ".join(str(n) for n in record.refits)
        plural = "s" if len(record.refits) > 1 else ""
        text += f"; its fit was off and made again from the prior for trial{plural} {shown}"
    return text + (f"; it handed over ({record.handed_over})." if record.handed_over else ".")


class Proposer:
    """Proposes the next config of a study from its calibrated surrogate."""

    def __init__(
        self,
        surrogate: Surrogate,
        *,
        candidates: int = CANDIDATES,
        seed: int = 0,
        draws: int = DRAWS,
        top: int = TOP,
    ) -> None:
        self.surrogate = surrogate
        self.space = surrogate.space
        configs = grid(self.space, GRID_LIMIT) or sample_configs(self.space, candidates, seed)
        self._candidates = [c for c in configs if not self.space.violations(c)]
        self._draws = draws
        self._top = top
        self._seed = seed
        self._last: Calibration | None = None
        self.calibration: Calibration | None = None
        """The latest calibration (after :meth:`propose` or :meth:`ranked`)."""
        self.memory_calibration: MemoryCalibration | None = None
        """The memory model's calibration that ranking used."""
        self.fit: FitCheck | None = None
        """How that calibration reproduces the measured trials (after :meth:`ranked`)."""

    def ranked(self, trials: Sequence[FrozenTrial], limit: int | None = None) -> list[Proposal]:
        """The configs no trial holds yet, best predicted first; ``limit`` cuts the list (the first ``top``
        of them, or all ``limit``, carry an interval from the calibration's draws, the rest none)."""
        memory_cal: MemoryCalibration = self.surrogate.memory.calibrate(
            [t for t in trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
        )
        found = observations(trials)
        cal = calibrate(self.surrogate, found, memory_cal, start=self._last)
        fit = self.check(cal, found, memory_cal)
        if fit.over and self._last is not None:  # the warm start may have wandered: fit from the prior
            fresh = calibrate(self.surrogate, found, memory_cal)
            again = replace(self.check(fresh, found, memory_cal), refit=True)
            if again.error < fit.error:
                cal, fit = fresh, again
        self._last = self.calibration = cal
        self.memory_calibration = memory_cal
        self.fit = fit
        taken = {self.space.launch_key(TrialRecord.from_trial(t).flags) for t in trials}
        seen = self._measured_signatures(trials, memory_cal)
        failures = memory_failures(trials)
        point: list[tuple[float, tuple[float, float], dict[str, FlagValue], int, tuple[object, ...]]] = []
        for flags in self._candidates:
            if self.space.launch_key(flags) in taken:
                continue
            prediction = self.surrogate.memory.predict(flags, memory_cal)
            if not prediction.feasible or beyond(flags, failures) is not None:
                continue
            kv = max(0, prediction.kv_cache_bytes) // max(1, prediction.plan.kv_bytes_per_token)
            signature = self.surrogate.signature(flags, kv)
            engine = self.surrogate.engine(flags, cal.params.scales, kv)
            if engine is None or signature is None or signature in seen:
                continue
            rate = self.surrogate.slo_rate(engine, cal.params)
            chances = (prediction.start_probability, prediction.crash_probability)
            point.append((prediction.run_probability * rate, chances, flags, kv, signature))
        point.sort(key=lambda p: -p[0])
        # One config per signature (the likeliest to start of the best): the others would be measured to
        # learn nothing the model can tell apart.
        unique = []
        for p in point:
            if p[4] not in seen:
                seen.add(p[4])
                unique.append(p[:4])
        draws = cal.draws(self._draws, seed=self._seed + cal.observations)
        out = []
        for i, (_, (start, crash), flags, kv) in enumerate(unique[: limit or len(unique)]):
            if i < max(self._top, limit or 0):
                rates = []
                for params in draws:
                    engine = self.surrogate.engine(flags, params.scales, kv)
                    assert engine is not None
                    rates.append(self.surrogate.slo_rate(engine, params))
                ordered = sorted(rates)
                mean = statistics.fmean(rates)
                lo, hi = ordered[len(ordered) // 10], ordered[(9 * len(ordered)) // 10]
            else:
                engine = self.surrogate.engine(flags, cal.params.scales, kv)
                assert engine is not None
                mean = lo = hi = self.surrogate.slo_rate(engine, cal.params)
            out.append(
                Proposal(
                    dict(flags),
                    mean,
                    lo,
                    hi,
                    mean * self.surrogate.traffic.output,
                    start,
                    cal.observations,
                    crash,
                    fit,
                )
            )
        head = sorted(out[: self._top], key=lambda p: -p.run_probability * (p.rate + (p.hi - p.lo) / 4.0))
        return head + out[self._top :]

    def reproduced(
        self, cal: Calibration, found: Sequence[Observation], memory_cal: MemoryCalibration | None
    ) -> list[tuple[Observation, float]]:
        """Each measured observation (an SLO rate, 0 included) with the SLO rate ``cal`` predicts for it."""
        out = []
        for obs in found:
            if obs.slo_rate is None:
                continue
            kv = (
                obs.kv_tokens
                if obs.kv_tokens is not None
                else self.surrogate.kv_tokens(obs.flags, memory_cal)
            )
            engine = self.surrogate.engine(obs.flags, cal.params.scales, kv)
            if engine is not None:
                out.append((obs, self.surrogate.slo_rate(engine, cal.params)))
        return out

    def check(
        self, cal: Calibration, found: Sequence[Observation], memory_cal: MemoryCalibration | None
    ) -> FitCheck:
        """How ``cal`` reproduces the measured trials' SLO rates."""
        errors = [
            rate_error(predicted, obs.slo_rate or 0.0)
            for obs, predicted in self.reproduced(cal, found, memory_cal)
        ]
        return FitCheck(statistics.median(errors) if errors else 0.0, len(errors))

    def _measured_signatures(
        self, trials: Sequence[FrozenTrial], memory_cal: MemoryCalibration
    ) -> set[tuple[object, ...]]:
        """The signatures of the configs measured, being measured or queued (a config that failed to start
        or crashed under load leaves its signature free: a smaller variant of it may run)."""
        out: set[tuple[object, ...]] = set()
        for trial in trials:
            record = TrialRecord.from_trial(trial)
            if record.launched is False or record.cause in (*START_FAILURES, Cause.CRASHED_UNDER_LOAD):
                continue
            if trial.state in (TrialState.COMPLETE, TrialState.PRUNED) and not record.curve:
                continue
            reported = (record.capacity or {}).get("kv_tokens")
            kv = (
                int(reported)
                if isinstance(reported, int | float) and reported > 0
                else self.surrogate.kv_tokens(record.flags, memory_cal)
            )
            signature = self.surrogate.signature(record.flags, kv)
            if signature is not None:
                out.add(signature)
        return out

    def propose(self, trials: Sequence[FrozenTrial]) -> Proposal | None:
        """The next config to launch, or None when every candidate is taken or the fit is off even from
        the prior (:attr:`fit`'s ``over``: the caller hands over, and stores why). Whether the surrogate
        has handed over before is the caller's to check first, with :func:`track_record`."""
        ranked = self.ranked(trials, limit=self._top)
        if self.fit is not None and self.fit.over:
            return None
        return ranked[0] if ranked else None


def traffic_of(loaded: LoadedStudy, requests: int = 600) -> Traffic:
    """The study's workload as the fluid model needs it: prompt and output lengths of ``requests`` of its
    probes' stream (the lengths a trial's probes send)."""
    spec = loaded.spec
    schedule = ProbeSchedule(spec.workload, spec.slo, spec.measurement, loaded.base_dir, prompts=False)
    plan = schedule.plan(1, 1.0, 0.0, float(requests))
    sent = plan.requests[:requests] or plan.requests
    return Traffic.of([r.input_len for r in sent], [r.output_len for r in sent])


def proposer_for(loaded: LoadedStudy, memory: MemoryModel | None) -> Proposer | None:
    """The study's proposer (:func:`build_proposer`), unless ``sampler.surrogate`` is off."""
    return build_proposer(loaded, memory) if loaded.spec.sampler.surrogate else None


def build_proposer(loaded: LoadedStudy, memory: MemoryModel | None) -> Proposer | None:
    """A proposer for the study: it needs the memory model (the model's architecture and the GPU) and a
    workload sent at arrival rates whose request lengths it can read (None without them: a
    ``concurrency`` workload's probes are numbers of streams, which the model does not take)."""
    if memory is None or loaded.spec.workload.arrival.process == "concurrency":
        return None
    try:
        traffic = traffic_of(loaded)
    except AutotuneError:
        return None
    terms = loaded.spec.slo.terms
    surrogate = Surrogate(memory.arch, memory.gpu, loaded.search_space, traffic, terms, memory)
    return Proposer(surrogate, seed=loaded.spec.sampler.seed or 0)
