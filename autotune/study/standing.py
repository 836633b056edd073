"""Where a study stands: which finished trials spent the budget (launches), what was rejected before a
launch, what runs now, and the one line of the config it recommends now."""

from __future__ import annotations

from dataclasses import dataclass

import optuna
from optuna.trial import FrozenTrial, TrialState

from autotune.inputs.loader import LoadedStudy
from autotune.inputs.spec import objective_unit
from autotune.store.record import TrialRecord
from autotune.study.finalists import pick
from autotune.units import format_figure, plural

FINISHED = (TrialState.COMPLETE, TrialState.PRUNED)
"""The states of a trial that ended as data (measured, or pruned with its cause)."""


def finished_trials(study: optuna.Study) -> list[FrozenTrial]:
    """COMPLETE and PRUNED trials."""
    return study.get_trials(deepcopy=False, states=FINISHED)


def is_launch(trial: FrozenTrial) -> bool:
    """Whether a finished trial spent the budget: it launched a server (rejected configs did not)."""
    return trial.state in FINISHED and TrialRecord.from_trial(trial).launched is not False


def best_line(study: optuna.Study, loaded: LoadedStudy) -> str | None:
    """A one-line summary of the config the study recommends now (:func:`autotune.study.finalists.pick`): its
    first objective, from its reruns once it was measured again."""
    chosen = pick(study, loaded)
    if chosen is None:
        return None
    metric = loaded.spec.objectives[0].metric
    if chosen.confirmed and chosen.finalist is not None and chosen.finalist.throughput is not None:
        runs = len(chosen.finalist.met)
        shown = format_figure(chosen.finalist.throughput, "tok/s")
        return f"trial {chosen.trial.number}: {metric}={shown} ({plural(runs, 'rerun')})"
    shown = format_figure(chosen.trial.values[0], objective_unit(metric))
    return f"trial {chosen.trial.number}: {metric}={shown}"


def pick_key(study: optuna.Study, loaded: LoadedStudy) -> tuple[int, bool] | None:
    """Which config the study recommends now and whether reruns confirmed it."""
    chosen = pick(study, loaded)
    return None if chosen is None else (chosen.trial.number, chosen.confirmed)


def best_trial(study: optuna.Study, loaded: LoadedStudy) -> FrozenTrial | None:
    """The feasible COMPLETE trial best by the first objective (measured ones, not repeats)."""
    objective = loaded.spec.objectives[0]
    complete = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)) if t.values]
    feasible = [t for t in complete if all(c <= 0 for c in (t.constraints or {}).values()) and is_launch(t)]
    if not feasible:
        return None
    sign = 1 if objective.direction == "maximize" else -1
    return max(feasible, key=lambda t: (sign * t.values[0], -t.number))


@dataclass(frozen=True)
class Standing:
    """Where the study stands: what spent the budget, what was rejected, what runs now."""

    launches: int
    rejected: int
    running: int
    best: str | None

    @classmethod
    def of(cls, study: optuna.Study, loaded: LoadedStudy) -> Standing:
        """Read the standing from storage."""
        trials = study.get_trials(deepcopy=False)
        finished = [t for t in trials if t.state in FINISHED]
        launches = sum(1 for t in finished if is_launch(t))
        return cls(
            launches=launches,
            rejected=len(finished) - launches,
            running=sum(1 for t in trials if t.state == TrialState.RUNNING),
            best=best_line(study, loaded),
        )
