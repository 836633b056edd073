"""Runtime headroom: where this study's launches crashed under load, and the crash chance of another config.

vLLM sizes its KV cache from a profile run and keeps the rest of its budget for it; what a running batch
needs beyond that profile (activation peaks at the batch's token count, the sampler's tensors at its
sequences, allocator fragmentation) must come out of the memory past the budget,
``device - gpu_memory_utilization x device``. That need grows with the plan's activation estimate
(:attr:`autotune.hardware.memory.MemoryPlan.activation_bytes`: ``max_num_batched_tokens`` tokens through the
model, the sampler at ``max_num_seqs``), by a factor of this model on this device that no start shows: a
config starts, then dies under load once a large batch forms. So each launch that ran under load is read on
one scale, its **headroom ratio** (spare memory / activation estimate):

* a launch that crashed under load says the factor is above its ratio;
* a launch that ran its probes to the end (measured, or no rate met the SLOs, or the client could not
  measure it) says the factor is at most its ratio.

:class:`RuntimeEdge` keeps the largest crashed ratio and the smallest that ran through. A config's crash
chance is 1 at or below the crashed ratio, and falls linearly to 0 at the smallest that ran through (or
:data:`LEARN_WIDTH` above the crash when none did yet). Before any crash, a config with less headroom
than every launch that ran through is untried: its chance is :data:`UNTRIED_PRIOR` times how far below
them it goes, so a proposer steps into less headroom only where the gain outweighs the risk, and the
first crash is not taken for free. A crash with more headroom than a launch that ran through is not
memory's (another cause, or noise): it is left out, and counted.

The scale is monotone in the flags as the crash boundary is for ``oom`` (more utilization, more
sequences, more batched tokens: less headroom), so every config that asks at least as much as a crashed
one gets chance 1. It is re-derived from the study's stored trials before every launch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from autotune.hardware.catalog import GIB
from autotune.hardware.memory import MemoryPlan

UNTRIED_PRIOR = 0.5
"""Before any crash under load: the chance that this model on this device needs memory past its profile
at all. A config with less headroom than every launch that ran through then crashes with this chance
times how far below them it goes (``1 - ratio / least ratio that ran through``): the runtime factor is
unknown, at most that least ratio, and as likely anywhere below it."""

LEARN_WIDTH = 0.5
"""After crashes under load and no run through with more headroom: how far above the crashed ratio (as
a fraction of it) the crash chance falls back to 0."""


def headroom_ratio(plan: MemoryPlan) -> float:
    """Spare memory past the budget over the plan's activation estimate (inf with no activation)."""
    spare = plan.device_bytes - plan.budget_bytes
    return spare / plan.activation_bytes if plan.activation_bytes > 0 else float("inf")


@dataclass(frozen=True)
class Run:
    """One launch that ran under load: its trial number, its plan, and whether it crashed."""

    trial: int
    plan: MemoryPlan
    crashed: bool


@dataclass(frozen=True)
class RuntimeEdge:
    """Crashes under load as the study's launches showed them, on the headroom ratio's scale."""

    crashed: float | None = None
    """Largest headroom ratio of a launch that crashed under load with less headroom than every launch
    that ran through."""
    crashed_trial: int | None = None
    """The trial that crashed with that ratio."""
    survived: float | None = None
    """Smallest headroom ratio of a launch that ran its probes through."""
    unexplained: int = 0
    """Crashes under load with at least the headroom of a launch that ran through (left out)."""

    @classmethod
    def of(cls, runs: Sequence[Run]) -> RuntimeEdge:
        """The edge that ``runs`` show."""
        through = [headroom_ratio(r.plan) for r in runs if not r.crashed]
        lowest = min(through, default=None)
        crashes = [(headroom_ratio(r.plan), r.trial) for r in runs if r.crashed]
        memory = [c for c in crashes if lowest is None or c[0] < lowest]
        crashed, trial = max(memory, default=(None, None))
        return cls(crashed, trial, lowest, len(crashes) - len(memory))

    def crash_probability(self, plan: MemoryPlan) -> float:
        """The chance that ``plan`` crashes under load, as this study's launches show it."""
        ratio = headroom_ratio(plan)
        if self.crashed is None:
            if self.survived is None or ratio >= self.survived:
                return 0.0
            return UNTRIED_PRIOR * (1.0 - ratio / self.survived)
        if ratio <= self.crashed:
            return 1.0
        top = self.survived if self.survived is not None else self.crashed * (1.0 + LEARN_WIDTH)
        return max(0.0, min(1.0, (top - ratio) / (top - self.crashed)))

    def reason(self, plan: MemoryPlan) -> str:
        """Why ``plan`` gets its crash chance, in words."""
        ratio = headroom_ratio(plan)
        spare = (plan.device_bytes - plan.budget_bytes) / GIB
        said = (
            f"{spare:.2f} GiB past the budget for an activation estimate of "
            f"{plan.activation_bytes / GIB:.2f} GiB (headroom {ratio:.2f}x)"
        )
        left = f" ({self.unexplained} crash(es) with more headroom left out)" if self.unexplained else ""
        if self.crashed is None:
            untried = (
                f", below the least that ran through ({self.survived:.2f}x): untried"
                if self.survived is not None and ratio < self.survived
                else ""
            )
            return f"{said}; no launch crashed under load for memory{untried}{left}"
        known = f", one ran through at {self.survived:.2f}x" if self.survived is not None else ""
        return f"{said}; trial {self.crashed_trial} crashed under load at {self.crashed:.2f}x{known}{left}"

    def attrs(self, plan: MemoryPlan) -> dict[str, Any]:
        """The numbers behind ``plan``'s crash chance, for ``memory_prediction``."""
        return {
            "crash_probability": round(self.crash_probability(plan), 4),
            "runtime_headroom_ratio": round(headroom_ratio(plan), 4),
            "runtime_crashed_ratio": None if self.crashed is None else round(self.crashed, 4),
            "runtime_survived_ratio": None if self.survived is None else round(self.survived, 4),
        }
