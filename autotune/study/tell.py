"""How a trial ends in storage: told with its outcome (its record stored first, then Optuna's tell, whole
or not at all), or failed without data: given back with its config queued again, or discarded before its
launch."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence

import optuna
from optuna.trial import TrialState

from autotune.errors import StudyError
from autotune.inputs.loader import LoadedStudy
from autotune.interrupts import shielded
from autotune.outcome import TrialOutcome
from autotune.store.record import TrialRecord, outcome_attrs, save_record, set_constraints, stored_attrs
from autotune.study.recovery import fail, given_up, gives_up, requeue, stored_trial


def constraint_keys(loaded: LoadedStudy) -> list[str]:
    """Names of a trial's constraints, in order: each SLO term, then the error budget."""
    return [f"slo {term}" for term in loaded.spec.slo.terms] + ["error budget"]


def record(
    trial: optuna.Trial,
    outcome: TrialOutcome,
    keys: Sequence[str],
    loaded: LoadedStudy,
    *,
    named: bool = False,
) -> None:
    """Store an outcome's facts, cause, summary and constraints on the trial (before it is told): each
    attribute within optuna-dashboard's limit, the whole record in the trial's folder when one was
    shortened (:func:`autotune.store.record.stored_attrs`); constraints as
    :func:`autotune.store.record.set_constraints` writes them (``named``: the study already has Optuna 5's
    named constraints)."""
    attrs = {**outcome.attrs, **outcome_attrs(outcome.cause, outcome.summary)}
    stored, shortened = stored_attrs(attrs)
    if shortened:
        stored.update(save_record(loaded.trial_dir(trial.number), loaded.workdir, attrs))
    for key, value in stored.items():
        trial.set_user_attr(key, value)
    if outcome.constraints:
        if len(outcome.constraints) != len(keys):
            raise StudyError(f"trial {trial.number}: {len(outcome.constraints)} constraints for {list(keys)}")
        set_constraints(trial, keys, outcome.constraints, named=named)


def tell(
    study: optuna.Study,
    trial: optuna.Trial,
    outcome: TrialOutcome,
    keys: Sequence[str],
    loaded: LoadedStudy,
    *,
    named: bool,
) -> None:
    """Store ``outcome`` on ``trial`` (:func:`record`) and tell the study: COMPLETE with its values, else
    PRUNED. Non-finite objective values are a :class:`StudyError`; a signal waits until both are stored."""
    if outcome.complete:
        assert outcome.values is not None
        if any(not math.isfinite(v) for v in outcome.values):
            raise StudyError(f"trial {trial.number} produced non-finite objective values {outcome.values}")
    with shielded():  # the outcome is stored whole or not at all
        record(trial, outcome, keys, loaded, named=named)
        if outcome.complete:
            assert outcome.values is not None
            study.tell(trial, list(outcome.values))
        else:
            study.tell(trial, state=TrialState.PRUNED)


def give_back(study: optuna.Study, trial: optuna.Trial, why: str, *, retries: int | None) -> None:
    """FAIL ``trial`` with ``why`` and queue its config again, at most ``retries`` times (None: no
    limit) (retry first: a death in between then leaves a RUNNING trial whose retry exists, never a
    lost one). A trial whose config was not drawn yet is discarded instead."""
    with shielded(), contextlib.suppress(Exception):  # the storage may be what failed: a start recovers
        stored = stored_trial(study, trial)
        if stored is not None and stored.state == TrialState.RUNNING and not stored.params:
            fail(study, stored, TrialRecord(discarded=f"{why} before its config was drawn"))
        elif stored is not None and stored.state == TrialState.RUNNING:
            last = retries is not None and gives_up(study, stored, retries)
            requeue(study, stored, retries=retries)
            failed = given_up(why, retries) if last and retries is not None else why
            fail(study, stored, TrialRecord(failed_because=failed))


def discard(study: optuna.Study, trial: optuna.Trial, why: str) -> None:
    """FAIL ``trial`` before its launch with ``why`` (``discarded``: never retried)."""
    stored = stored_trial(study, trial)
    if stored is not None:
        with shielded():
            fail(study, stored, TrialRecord(discarded=why))
