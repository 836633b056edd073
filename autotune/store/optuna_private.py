"""Optuna's private names, in one place: every use of them in autotune goes through this module.

Each function says why no public API serves. ``tests/unit/test_optuna_private.py`` pins what each one relies
on (attribute names, storage methods, what ``enqueue_trial`` stores), so an Optuna upgrade that changes
them fails there first, naming the function, instead of somewhere in a study.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import optuna
from optuna.distributions import BaseDistribution
from optuna.storages import BaseStorage
from optuna.storages._heartbeat import BaseHeartbeat
from optuna.trial import FrozenTrial, TrialState

FIXED_PARAMS = "fixed_params"
"""The system attribute in which ``Study.enqueue_trial`` stores a queued trial's params, which
``optuna.Trial`` reads when it is made and ``suggest_*`` then returns (``optuna/trial/_trial.py``)."""


def storage(study: optuna.Study) -> BaseStorage:
    """A study's storage: ``Study`` has no public accessor to it (``_storage``)."""
    found: BaseStorage = study._storage
    return found


def connections(study: optuna.Study) -> BaseStorage:
    """The storage that holds a study's database connections: Optuna wraps an RDB storage in a cache
    whose ``_backend`` is the RDB storage (no public accessor either)."""
    outer = storage(study)
    inner: BaseStorage = getattr(outer, "_backend", outer)
    return inner


def trial_id(trial: optuna.Trial | FrozenTrial) -> int:
    """A trial's id in its storage (``_trial_id``): the storage's methods take it, and a trial has no
    public accessor to it (its ``number`` is per study, not per storage)."""
    found: int = trial._trial_id
    return found


def set_user_attrs(study: optuna.Study, trial: FrozenTrial, attrs: Mapping[str, Any]) -> None:
    """Write ``attrs`` to a trial this process did not ask for (a stale one, another worker's): the public
    ``Trial.set_user_attr`` exists only on the live trial object of the process that asked for it."""
    for key, value in attrs.items():
        storage(study).set_trial_user_attr(trial_id(trial), key, value)


def fail(study: optuna.Study, trial: FrozenTrial) -> bool:
    """Mark a RUNNING trial FAIL, atomically in the storage; False when another process ended it first.
    ``Study.tell`` would raise for a trial this process did not ask for. Raises
    ``optuna.exceptions.UpdateFinishedTrialError`` when it had already finished."""
    return bool(storage(study).set_trial_state_values(trial_id(trial), TrialState.FAIL))


def queued_params(trial: FrozenTrial) -> dict[str, Any]:
    """The params queued with a trial (:data:`FIXED_PARAMS`); empty when none were. (No public reader.)"""
    fixed = trial.system_attrs.get(FIXED_PARAMS)
    return dict(fixed) if isinstance(fixed, Mapping) else {}


def queue(
    study: optuna.Study,
    params: Mapping[str, Any],
    distributions: Mapping[str, BaseDistribution],
    user_attrs: Mapping[str, Any],
) -> None:
    """Queue a trial of ``params`` as ``enqueue_trial`` does, but with the params and their distributions
    visible on the waiting trial (``enqueue_trial`` shows none until it is asked for): a WAITING trial
    added with :data:`FIXED_PARAMS` set, which the next ``ask`` takes."""
    study.add_trial(
        optuna.trial.create_trial(
            state=TrialState.WAITING,
            params=dict(params),
            distributions=dict(distributions),
            user_attrs=dict(user_attrs),
            system_attrs={FIXED_PARAMS: dict(params)},
        )
    )


def fix_params(
    study: optuna.Study, trial: optuna.Trial, stored: FrozenTrial | None, values: Mapping[str, Any]
) -> optuna.Trial:
    """``trial`` with ``values`` added to its queued params (``stored``: its stored state), so that the next
    suggestions return them. Optuna reads them only when a trial object is made, and has no public way to
    add them to a running trial: the storage writes them and a new object is made for the same id."""
    fixed = queued_params(stored) if stored is not None else {}
    storage(study).set_trial_system_attr(trial_id(trial), FIXED_PARAMS, {**fixed, **values})
    return optuna.Trial(study, trial_id(trial))


def heartbeat_interval(study: optuna.Study) -> int | None:
    """The study's heartbeat interval in seconds, or None when its storage keeps no heartbeat. Optuna
    beats only inside ``Study.optimize``, on a thread that is not a daemon; its heartbeat interface is
    private (``optuna.storages._heartbeat``)."""
    found = storage(study)
    if not isinstance(found, BaseHeartbeat):
        return None
    interval: int | None = found.get_heartbeat_interval()
    return interval or None


def beat(study: optuna.Study, trial: optuna.Trial) -> None:
    """Record one heartbeat of a running trial (its storage keeps heartbeats: :func:`heartbeat_interval`)."""
    found = storage(study)
    assert isinstance(found, BaseHeartbeat)
    found.record_heartbeat(trial_id(trial))


def set_system_attr(trial: optuna.Trial, key: str, value: Any) -> None:
    """Write a system attribute of a live trial: Optuna 5 has no public writer (``Trial.set_system_attr``
    was removed); its trial's storage writes it, as Optuna's own code does."""
    trial.storage.set_trial_system_attr(trial_id(trial), key, value)
