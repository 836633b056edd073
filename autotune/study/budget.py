"""The budget between trials: what a tuner does next by where the study stands (search on, the finalists'
reruns once the launches are spent, finish when the wall time is spent, stop at the cap of rejected
configs, or wait while every slot is held)."""

from __future__ import annotations

import enum

from autotune.inputs.spec import BudgetSpec
from autotune.study.slots import all_held
from autotune.study.standing import Standing


class Next(enum.Enum):
    """What a tuner does next, between trials."""

    TRIAL = "trial"
    """Ask for a trial and run it."""
    FINALISTS = "finalists"
    """The launches are spent: the finalists' reruns (once no trial runs anywhere), then finish."""
    WALL_TIME = "wall_time"
    """The wall time is spent: finish."""
    REJECTED = "rejected"
    """The cap of configs rejected before a launch is reached: stop (:func:`rejected_cap`)."""
    WAIT = "wait"
    """Every slot is held by a running trial: wait for one to end."""


def next_step(standing: Standing, budget: BudgetSpec, *, wall_spent: bool) -> Next:
    """What to do next where the study stands at ``standing`` (``wall_spent``: ``budget.wall_time`` is
    spent)."""
    if standing.launches >= budget.launches:
        return Next.FINALISTS
    if wall_spent:
        return Next.WALL_TIME
    if standing.rejected >= budget.rejected_cap:
        return Next.REJECTED
    if all_held(standing, budget.launches):
        return Next.WAIT
    return Next.TRIAL


def rejected_cap(standing: Standing, budget: BudgetSpec) -> str:
    """Why the study stops at the cap of rejected configs."""
    return (
        f"{standing.rejected} configs were rejected before a launch (budget.max_rejected "
        f"{budget.rejected_cap}): the search space yields almost only configs that cannot run; "
        "check it with `autotune validate`"
    )
