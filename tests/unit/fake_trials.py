"""A study's trials with a stand-in for the server, for tests of the study loop and what reads a study."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from autotune.flags import FlagValue
from autotune.load.ratesearch import Start
from autotune.outcome import TrialOutcome
from autotune.predict.feasibility import Decision

Run = Callable[[int, Mapping[str, FlagValue], Callable[[str], None]], TrialOutcome]


class FakeTrials:
    """``run(number, flags, phase)`` stands for the launch, ``again`` (default: ``run``) for the launch of
    a finalist measured again; nothing is screened out."""

    def __init__(self, run: Run, again: Run | None = None) -> None:
        self.run = run
        self.again = again or run
        self.confirmed: list[int] = []
        """The trials whose config was measured again, in order."""
        self.seeds: list[int] = []
        """The workload seed of each of those reruns."""
        self.starts: list[Start | None] = []
        """Where each rerun's search started."""
        self.baselines: list[int] = []
        """The trials launched as vLLM's defaults (no tuned flag), launches and reruns."""

    def screen(self, flags: Mapping[str, FlagValue]) -> Decision:
        """Every config may be launched."""
        return Decision(None)

    def launch(
        self,
        number: int,
        flags: Mapping[str, FlagValue],
        decision: Decision,
        phase: Callable[[str], None],
        *,
        baseline: bool = False,
    ) -> TrialOutcome:
        """The stand-in's outcome (``baseline`` runs are listed in :attr:`baselines`)."""
        if baseline:
            self.baselines.append(number)
        return self.run(number, flags, phase)

    def confirm(
        self,
        number: int,
        flags: Mapping[str, FlagValue],
        phase: Callable[[str], None],
        *,
        seed: int,
        start: Start | None,
        baseline: bool = False,
    ) -> TrialOutcome:
        """The stand-in's outcome for a finalist measured again (on the stream of ``seed``)."""
        if baseline:
            self.baselines.append(number)
        self.confirmed.append(number)
        self.seeds.append(seed)
        self.starts.append(start)
        return self.again(number, flags, phase)
