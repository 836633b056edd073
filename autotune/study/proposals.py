"""The surrogate's turn before each ask: its proposal queued as the next trial's config, until it hands
over to the sampler (said once)."""

from __future__ import annotations

import math

from optuna.trial import TrialState

from autotune.events import Kind
from autotune.predict.surrogate.propose import Proposer, track_record
from autotune.store.record import TrialRecord
from autotune.study.announcer import Announcer


class Proposals:
    """Queues the calibrated surrogate's proposals (:class:`autotune.predict.surrogate.propose.Proposer`) into
    its announcer's study, saying through ``announcer`` when it cannot rank the configs or hands over."""

    def __init__(self, proposer: Proposer, announcer: Announcer) -> None:
        self._proposer = proposer
        self.study = announcer.study
        self._emit = announcer.emit
        self._said_handed_over = False

    def queue_next(self) -> TrialRecord | None:
        """Queue the surrogate's proposal for the next ask, unless a config is queued already (the
        defaults, a retry) or the surrogate has handed over (said once). When its fit turns out off even
        from the prior it hands over now: the record returned says why, for the trial the sampler draws."""
        trials = self.study.get_trials(deepcopy=False)
        if any(t.state == TrialState.WAITING for t in trials):
            return None
        handed_over = track_record(trials).handed_over
        if handed_over is not None:
            self._say_handed_over(handed_over)
            return None
        try:
            proposal = self._proposer.propose(trials)
        except (ArithmeticError, ValueError) as exc:  # numpy's LinAlgError is a ValueError
            self._emit(
                Kind.PHASE,
                f"the surrogate could not rank the configs ({type(exc).__name__}: {exc}): the sampler draws "
                "this one",
                data={"surrogate": "failed"},
            )
            return None
        fit = self._proposer.fit
        if proposal is None and fit is not None and fit.over:
            why = fit.handed_over()
            self._say_handed_over(why)
            return TrialRecord(surrogate={"handed_over": why, "fit_error": round(math.expm1(fit.error), 4)})
        if proposal is not None:
            self.study.enqueue_trial(
                dict(proposal.flags), user_attrs=TrialRecord(surrogate=proposal.attrs()).to_attrs()
            )
        return None

    def _say_handed_over(self, why: str) -> None:
        if not self._said_handed_over:
            self._said_handed_over = True
            self._emit(Kind.PHASE, why, data={"surrogate": "handed over"})
