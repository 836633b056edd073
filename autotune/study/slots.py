"""Launch slots: how the tuners sharing one storage spend one budget of launches exactly, trial by trial
(launch now, wait for a slot, or give way: the budget spent, a queued trial needing the last slots, the
same config running elsewhere).

The storage numbers trials atomically, so every tuner sees the same order: a trial may launch while the
launches finished, plus the RUNNING trials numbered before it, are fewer than the budget.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import optuna
from optuna.trial import FrozenTrial, TrialState

from autotune.flags import FlagValue
from autotune.inputs.space import SearchSpace
from autotune.store.record import TrialRecord
from autotune.study.standing import Standing, is_launch

SLOT_POLL_S = 2.0
"""How often a worker waiting for a budget slot looks again."""
SPENT = "the budget was spent by other workers"
QUEUED_FIRST = "a queued trial needs the budget's last slots"
REFUSALS = (SPENT, QUEUED_FIRST)
"""Why a trial gives its slot way (its ``discarded`` reason): a refused slot, not a config drawn twice."""


@dataclass(frozen=True)
class Slot:
    """What trial ``number`` may do now: launch (``free``), give way (``refused``: why), or wait for the
    ``ahead`` earlier trials running elsewhere."""

    free: bool
    refused: str | None = None
    ahead: int = 0


def all_held(standing: Standing, launches: int) -> bool:
    """Every slot of the budget of ``launches`` is spent or held by a running trial: a new trial would
    only wait (so the tuner waits before asking for one)."""
    return standing.launches + standing.running >= launches


def slot(trials: Sequence[FrozenTrial], number: int, launches: int) -> Slot:
    """Whether trial ``number`` may launch within the budget of ``launches`` now. Queued trials (a retry of
    a dead tuner's trial) are asked before new ones, so a worker that gives its new trial up for one gets
    the queued one."""
    spent = sum(1 for t in trials if is_launch(t))
    if spent >= launches:
        return Slot(False, SPENT)
    ahead = sum(
        1
        for t in trials
        if t.state == TrialState.RUNNING and t.number < number and not TrialRecord.from_trial(t).discarded
    )
    queued = sum(1 for t in trials if t.state == TrialState.WAITING)
    if queued and spent + ahead + queued >= launches:
        return Slot(False, QUEUED_FIRST)
    return Slot(spent + ahead < launches, ahead=ahead)


def claim_slot(
    study: optuna.Study,
    number: int,
    launches: int,
    *,
    waiting: Callable[[int], None],
    wait: Callable[[], None],
) -> str | None:
    """Wait until trial ``number`` may launch within the budget (None); or why it must not
    (:func:`slot`). While it waits, ``waiting`` is told once how many earlier trials hold the slots, and
    ``wait`` pauses between looks."""
    told = False
    while True:
        now = slot(study.get_trials(deepcopy=False), number, launches)
        if now.free or now.refused is not None:
            return now.refused
        if not told:
            waiting(now.ahead)
            told = True
        wait()


def running_elsewhere(
    study: optuna.Study, space: SearchSpace, number: int, flags: Mapping[str, FlagValue]
) -> int | None:
    """Another RUNNING trial that launches the same config as trial ``number`` (``flags``), if any."""
    key = space.launch_key(flags)
    for other in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if other.number == number:
            continue
        seen = TrialRecord.from_trial(other)
        if seen.flags and not seen.baseline and space.launch_key(seen.flags) == key:
            return other.number
    return None
