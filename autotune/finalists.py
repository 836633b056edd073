"""Finalists confirmed: the best configs and vLLM's defaults measured again, and the figures that rank them.

One probe's figures carry its noise: on a real GPU, configs within a few percent of each other trade
places from one measurement to the next, and the first measurement of the winner is the luckiest of
many (the search picked it for being high). So before a study ends, its ``finalists.count`` best feasible
configs (by the first objective) and the trial of vLLM's defaults are launched again
``finalists.rounds`` times, with probes ``finalists.probe_scale`` times longer and fresh prompts and
arrivals. A confirmation is not a trial (it spends no launch of the budget and is not shown to the
sampler): it is stored on the study as a user attribute ``confirm:<trial>:<id>``.

:class:`Confirmed` holds every run of a config (the trial's own, then each confirmation): the export
ranks the finalists by their mean and states the spread; a gain over the defaults smaller than the
spread of either side is reported as within the noise.
"""

from __future__ import annotations

import math
import statistics
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from autotune.loader import LoadedStudy
from autotune.record import TrialRecord

PREFIX = "confirm:"


@dataclass(frozen=True)
class Confirmation:
    """One measurement again of trial ``trial``'s config."""

    trial: int
    values: tuple[float, ...] | None
    """The objectives, in the study's order; None when the rerun met no SLO or failed."""
    cause: str | None = None
    summary: str = ""
    feasible: bool = True
    """Whether the rerun met the SLOs at its operating point."""
    slo_throughput: float | None = None
    """Output tok/s at the rerun's operating point."""

    def to_attr(self) -> dict[str, Any]:
        return {
            "trial": self.trial,
            "values": list(self.values) if self.values is not None else None,
            "cause": self.cause,
            "summary": self.summary,
            "feasible": self.feasible,
            "slo_throughput": self.slo_throughput,
        }

    @classmethod
    def from_attr(cls, value: Mapping[str, Any]) -> Confirmation:
        values = value.get("values")
        throughput = value.get("slo_throughput")
        return cls(
            trial=int(value["trial"]),
            values=tuple(float(v) for v in values) if isinstance(values, list) else None,
            cause=value.get("cause"),
            summary=str(value.get("summary", "")),
            feasible=bool(value.get("feasible", True)),
            slo_throughput=float(throughput) if throughput is not None else None,
        )


@dataclass(frozen=True)
class Confirmed:
    """Every measurement of one config: the trial's own first, then its confirmations."""

    trial: int
    runs: tuple[tuple[float, ...], ...]
    """The objectives of each run that met the SLOs."""
    throughputs: tuple[float, ...]
    """SLO-constrained output tok/s of each run that met the SLOs."""
    misses: int
    """Confirmations that met no SLO, or failed."""

    def mean(self, index: int = 0) -> float:
        """Mean of objective ``index`` over the runs that met the SLOs."""
        return statistics.fmean(run[index] for run in self.runs)

    def spread(self, index: int = 0) -> float:
        """(largest - smallest) / mean of objective ``index`` over its runs (0.0 for one run)."""
        return _spread([run[index] for run in self.runs])

    @property
    def throughput(self) -> float:
        """Mean SLO-constrained throughput over the runs that met the SLOs."""
        return statistics.fmean(self.throughputs)

    @property
    def throughput_spread(self) -> float:
        return _spread(list(self.throughputs))

    @property
    def confirmed(self) -> bool:
        """Whether it was measured again at all (a miss counts: it is evidence too)."""
        return len(self.runs) + self.misses > 1


def _spread(values: Sequence[float]) -> float:
    mean = statistics.fmean(values)
    return (max(values) - min(values)) / abs(mean) if mean else math.inf


def _feasible(trial: FrozenTrial) -> bool:
    return all(c <= 0 for c in (trial.constraints or {}).values())


def is_measured(trial: FrozenTrial) -> bool:
    """A COMPLETE trial that launched its own server (not a repeat answered from another trial)."""
    record = TrialRecord.from_trial(trial)
    return trial.state == TrialState.COMPLETE and bool(trial.values) and record.repeat_of is None


def finalists(study: optuna.Study, loaded: LoadedStudy) -> list[FrozenTrial]:
    """The ``finalists.count`` best feasible measured trials by the first objective (one per config),
    then the trial of vLLM's defaults when it was measured."""
    spec = loaded.spec
    sign = 1 if spec.objectives[0].direction == "maximize" else -1
    measured = [t for t in study.get_trials(deepcopy=False) if is_measured(t)]
    ranked = sorted((t for t in measured if _feasible(t)), key=lambda t: (-sign * t.values[0], t.number))
    out: list[FrozenTrial] = []
    seen: set[str] = set()
    for trial in ranked:
        key = repr(sorted(TrialRecord.from_trial(trial).flags.items()))
        if key not in seen and len(out) < spec.finalists.count:
            seen.add(key)
            out.append(trial)
    baseline = [t for t in measured if TrialRecord.from_trial(t).baseline]
    if baseline and baseline[0] not in out and spec.finalists.count:
        out.append(baseline[0])
    return out


def confirmations(study: optuna.Study) -> dict[int, list[Confirmation]]:
    """The stored confirmations, by the trial whose config they measured."""
    out: dict[int, list[Confirmation]] = {}
    for key, value in study.user_attrs.items():
        if key.startswith(PREFIX) and isinstance(value, Mapping):
            confirmation = Confirmation.from_attr(value)
            out.setdefault(confirmation.trial, []).append(confirmation)
    return out


def pending(study: optuna.Study, loaded: LoadedStudy) -> list[FrozenTrial]:
    """Finalists measured again fewer than ``finalists.rounds`` times, best first."""
    done = confirmations(study)
    return [t for t in finalists(study, loaded) if len(done.get(t.number, [])) < loaded.spec.finalists.rounds]


def store(study: optuna.Study, confirmation: Confirmation) -> None:
    """Keep a confirmation on the study (a key of its own: tuners never overwrite each other's)."""
    study.set_user_attr(f"{PREFIX}{confirmation.trial}:{uuid.uuid4().hex[:12]}", confirmation.to_attr())


def confirmed(study: optuna.Study) -> dict[int, Confirmed]:
    """Every confirmed config's runs, by trial number."""
    by_number = {t.number: t for t in study.get_trials(deepcopy=False)}
    out: dict[int, Confirmed] = {}
    for number, found in confirmations(study).items():
        trial = by_number.get(number)
        if trial is None or not trial.values:
            continue
        met = [c for c in found if c.values is not None and c.feasible and c.slo_throughput is not None]
        own = TrialRecord.from_trial(trial).slo_throughput
        first = [(tuple(trial.values), own)] if _feasible(trial) and own is not None else []
        runs = first + [(c.values, c.slo_throughput) for c in met if c.values is not None]
        if runs:
            out[number] = Confirmed(
                number,
                tuple(values for values, _ in runs),
                tuple(float(t) for _, t in runs if t is not None),
                len(found) - len(met),
            )
    return out


@dataclass(frozen=True)
class Gain:
    """A config's SLO-constrained throughput over the defaults', with the noise it must clear."""

    value: float
    """Relative gain (0.05: 5 % more)."""
    noise: float
    """The larger relative spread of the two sides' runs (0.0 when neither was measured again)."""
    confirmed: bool
    """Both sides were measured again."""

    @property
    def within_noise(self) -> bool:
        return self.confirmed and abs(self.value) <= self.noise

    def text(self) -> str:
        if self.within_noise:
            return f"{self.value:+.1%} over the vLLM defaults: within the noise (spread {self.noise:.1%})"
        if self.confirmed:
            return f"{self.value:+.1%} over the vLLM defaults (confirmed; spread {self.noise:.1%})"
        return f"{self.value:+.1%} over the vLLM defaults"


def throughput_gain(
    table: Mapping[int, Confirmed], trial: FrozenTrial, baseline: FrozenTrial | None
) -> Gain | None:
    """``trial``'s SLO-constrained throughput over ``baseline``'s, by their confirmed means (``table``:
    :func:`confirmed`) where both were measured again; None when either was not measured."""
    if baseline is None:
        return None
    mine, base = table.get(trial.number), table.get(baseline.number)
    mine_value = mine.throughput if mine else TrialRecord.from_trial(trial).slo_throughput
    base_value = base.throughput if base else TrialRecord.from_trial(baseline).slo_throughput
    if trial.state != TrialState.COMPLETE or baseline.state != TrialState.COMPLETE:
        return None
    if mine_value is None or base_value is None or base_value <= 0:
        return None
    both = mine is not None and base is not None
    noise = max(mine.throughput_spread if mine else 0.0, base.throughput_spread if base else 0.0)
    return Gain(mine_value / base_value - 1.0, noise, both)
