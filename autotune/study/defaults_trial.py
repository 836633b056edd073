"""The defaults' trial in a study: vLLM's defaults queued first, queued again while none is measured,
running or queued, launched by one tuner at a time, and its record completed from what the server reported
(:func:`autotune.study.defaults.check_defaults`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from autotune.flags import FlagValue
from autotune.inputs.loader import LoadedStudy
from autotune.inputs.space import SearchSpace
from autotune.outcome import TrialOutcome
from autotune.server.effective import Effective
from autotune.store import optuna_private
from autotune.store.record import TrialRecord
from autotune.study.defaults import check_defaults
from autotune.study.recovery import stored_trial
from autotune.study.standing import is_launch


def enqueue_baseline(study: optuna.Study, loaded: LoadedStudy) -> None:
    """Queue the vLLM defaults as the baseline trial (once: the study's creator does it)."""
    study.enqueue_trial(
        dict(loaded.search_space.defaults()),
        user_attrs=TrialRecord(baseline=True).to_attrs(),
        skip_if_exists=True,
    )


def ensure_baseline(study: optuna.Study, loaded: LoadedStudy) -> int | None:
    """Queue vLLM's defaults again when the study has none measured, running or queued, but launches
    left: its baseline trials were all given up (by a tuner of an earlier version, or dropped before their
    config was drawn), or its creator died before queueing it. Returns the number of the queued trial.

    A new study without trials is left alone (its creator queues the baseline: :func:`enqueue_baseline`).
    """
    trials = study.get_trials(deepcopy=False)
    baselines = [t for t in trials if TrialRecord.from_trial(t).baseline]
    if not trials or any(t.state != TrialState.FAIL for t in baselines):
        return None
    launches = sum(1 for t in trials if is_launch(t))
    running = sum(1 for t in trials if t.state == TrialState.RUNNING)
    if launches + running >= loaded.spec.budget.launches:
        return None
    last = baselines[-1] if baselines else None
    retried = last is not None and any(TrialRecord.from_trial(t).retry_of == last.number for t in trials)
    retry_of = None if last is None or retried or TrialRecord.from_trial(last).discarded else last.number
    study.enqueue_trial(
        dict(loaded.search_space.defaults()),
        user_attrs=TrialRecord(baseline=True, retry_of=retry_of).to_attrs(),
    )
    queued = [t for t in study.get_trials(deepcopy=False) if t.state == TrialState.WAITING]
    return queued[-1].number if queued else None


def baseline_elsewhere(trials: Sequence[FrozenTrial], number: int) -> int | None:
    """The other trial that measures vLLM's defaults in place of trial ``number`` (a baseline too), or
    None when ``number`` should launch them: one already launched (finished), or one running with a
    lower number and no retry queued (a retry means it is being given back). Two baselines can be queued
    at once by tuners that recover the same lost one together; the lowest running one launches."""
    retried = {TrialRecord.from_trial(t).retry_of for t in trials}
    for other in trials:
        if other.number == number or not TrialRecord.from_trial(other).baseline:
            continue
        if is_launch(other):
            return other.number
        if other.state == TrialState.RUNNING and other.number < number and other.number not in retried:
            return other.number
    return None


def fixed_params(study: optuna.Study, trial: optuna.Trial) -> list[str]:
    """The names of the params queued with ``trial`` (the defaults' values known before the launch: the
    space's declared defaults, or a retried trial's)."""
    stored = stored_trial(study, trial)
    return list(optuna_private.queued_params(stored)) if stored is not None else []


def complete_baseline(
    study: optuna.Study,
    space: SearchSpace,
    trial: optuna.Trial,
    flags: Mapping[str, FlagValue],
    outcome: TrialOutcome,
    phase: Callable[[str], None],
) -> TrialOutcome:
    """After the defaults' launch: a value for each parameter it has none of yet, from what the server
    reported (:func:`autotune.study.defaults.check_defaults`), a warning for each mismatch, and the record's
    flags as the trial ran (a declared default the server contradicted: the reported value)."""
    record = TrialRecord.from_attrs(outcome.attrs)
    effective = _effective(record.reported_defaults)
    check = check_defaults(space, flags, effective)
    for warning in check.warnings:
        phase(f"warning: {warning}")
    if check.params:
        trial = _with_fixed(study, trial, dict(check.params))
        flags = {**flags, **space.suggest(trial, names=check.params)}
    ran = {**flags, **check.contradicted}
    full = {name: ran[name] for name in space.names if name in ran}
    trial.set_user_attr("flags", dict(full))
    extra = TrialRecord(default_warnings=check.warnings).to_attrs()
    return TrialOutcome(
        outcome.cause, outcome.summary, outcome.values, outcome.constraints, {**outcome.attrs, **extra}
    )


def _with_fixed(study: optuna.Study, trial: optuna.Trial, values: Mapping[str, FlagValue]) -> optuna.Trial:
    """``trial`` with ``values`` added to its queued params, so that the next suggestions return them."""
    return optuna_private.fix_params(study, trial, stored_trial(study, trial), values)


def _effective(reported: Mapping[str, Any] | None) -> Effective:
    """The stored ``reported_defaults`` back as :class:`~autotune.server.effective.Effective`."""
    values = {k: v for k, v in (reported or {}).items() if k != "_source"}
    sources = (reported or {}).get("_source")
    return Effective(values, dict(sources) if isinstance(sources, Mapping) else {})
