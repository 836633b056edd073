"""The finalists' stage inside a study's run: once the search is done, queue the rounds of reruns
(:mod:`autotune.study.finalists`), claim one at a time (however many tuners share the study), measure it with
its trial's config on the round's stream, and keep it on the ledger; ``autotune verify`` adds a round.

The runner (:class:`autotune.study.loop.StudyRunner`) owns the loop and the events: it hands this stage its
:class:`autotune.study.announcer.Announcer`, which says something and says a new best.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import optuna
from optuna.trial import TrialState

from autotune.errors import StudyError
from autotune.events import Kind
from autotune.flags import FlagValue
from autotune.interrupts import shielded
from autotune.load.ratesearch import Start
from autotune.outcome import TrialOutcome
from autotune.store.record import TrialRecord
from autotune.store.storage import queue_lock, recovery_lock
from autotune.study.announcer import Announcer
from autotune.study.finalists import Rerun, claim, finalists, ledger, next_round, rounds_done, schedule
from autotune.study.finalists import record as record_rerun
from autotune.study.finalists import requeue as requeue_rerun
from autotune.study.recovery import fail, heartbeat, stored_trial, worker_alive
from autotune.study.standing import Standing, pick_key


class Confirms(Protocol):
    """What measures a finalist again (:meth:`autotune.study.trial.TrialRunner.confirm`)."""

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
        """Launch trial ``number``'s config again and measure it on the workload stream of ``seed``,
        starting at ``start`` (:mod:`autotune.study.finalists`); raise on the tuner's own faults."""
        ...


def flags_text(flags: Mapping[str, FlagValue]) -> str:
    """Flags as ``vllm serve`` takes them, on one line (``max-num-seqs=128 block-size=16``)."""
    return " ".join(f"{k.replace('_', '-')}={v}" for k, v in flags.items())


def start_of(estimate: Mapping[str, Any] | None) -> Start | None:
    """Where a rerun's search starts: the trial's estimated boundary and pace (``None`` without one)."""
    if not estimate or estimate.get("kind") != "crossed":
        return None
    rate, pace = estimate.get("rate"), estimate.get("pace")
    if not isinstance(rate, int | float) or rate <= 0:
        return None
    if isinstance(pace, list) and len(pace) == 2 and all(isinstance(x, int | float) for x in pace):
        return Start(float(rate), (float(pace[0]), float(pace[1])))
    return Start(float(rate), (0.0, 0.0))


class RerunStage:
    """The finalists' reruns of one study, as one tuner runs them."""

    def __init__(self, announcer: Announcer, trials: Confirms) -> None:
        self.loaded = announcer.loaded
        self.study = announcer.study
        self._announcer = announcer
        self._emit = announcer.emit
        self._trials = trials

    def verify(self) -> optuna.Study:
        """Measure every finalist and the defaults in one more round now, whatever the budget (``autotune
        verify``); returns the study."""
        chosen = finalists(self.study, self.loaded)
        if not chosen:
            raise StudyError(
                "no measured trial meets the SLOs yet (or finalists.count is 0): nothing to verify"
            )
        book = ledger(self.study)
        round_number = rounds_done(book) + 1
        schedule(book, chosen, [round_number], self.loaded.spec.workload.seed)
        self._emit(
            Kind.STARTED,
            f"tuner {self._announcer.worker} measures {len(chosen)} finalists again (round {round_number})",
        )
        while (rerun := self.next(first=False)) is not None:
            self.confirm(*rerun)
        return self.study

    def next(self, *, first: bool) -> tuple[optuna.Study, optuna.Trial] | None:
        """Claim the next queued rerun of the finalists (with ``first``, queue the study's rounds when
        none is queued yet); ``None`` when none waits."""
        spec = self.loaded.spec
        if not spec.finalists.count:
            return None
        book = ledger(self.study)
        self._recover(book)
        if first and not rounds_done(book):
            chosen = finalists(self.study, self.loaded)
            if chosen:
                schedule(book, chosen, range(1, spec.finalists.rounds + 1), spec.workload.seed)
        with queue_lock(self.loaded.storage_url):
            trial = claim(book)
        if trial is None and first and self._race(book):
            with queue_lock(self.loaded.storage_url):
                trial = claim(book)
        if trial is None:
            return None
        trial.set_user_attr("worker", self._announcer.worker)
        return book, trial

    def _race(self, book: optuna.Study) -> bool:
        """Queue the race's next round when it goes on (:func:`autotune.study.finalists.next_round`; one
        tuner decides, under the recovery lock); whether it did."""
        with recovery_lock(self.loaded.storage_url):
            racing = next_round(self.study, self.loaded, book)
            if not racing:
                return False
            number = rounds_done(book) + 1
            schedule(book, racing, [number], self.loaded.spec.workload.seed)
        names = ", ".join(str(t.number) for t in racing[:-1])
        self._emit(
            Kind.PHASE,
            f"racing the finalists: round {number} for trials {names} and vLLM's defaults (the gain is not "
            f"yet within ±{(self.loaded.spec.finalists.target or 0) * 100:g} points)",
            data={"round": number, "racing": [t.number for t in racing]},
        )
        return True

    def _recover(self, book: optuna.Study) -> None:
        """Queue again the reruns left RUNNING by a tuner that died on this host (other hosts: the
        heartbeat's callback)."""
        with recovery_lock(self.loaded.storage_url):
            for trial in book.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
                worker = trial.user_attrs.get("worker")
                if isinstance(worker, str) and worker_alive(worker) is False:
                    with shielded():
                        if fail(book, trial, TrialRecord(failed_because="the tuner running it died")):
                            requeue_rerun(book, trial)

    def confirm(self, book: optuna.Study, claimed: optuna.Trial) -> None:
        """Measure a finalist again in one round (:mod:`autotune.study.finalists`) and keep it on the
        ledger."""
        attrs = stored_trial(book, claimed)
        assert attrs is not None
        number, round_number, seed = (int(attrs.user_attrs[k]) for k in ("finalist", "round", "seed"))
        trial = next(t for t in self.study.get_trials(deepcopy=False) if t.number == number)
        record = TrialRecord.from_trial(trial)
        flags = record.flags
        standing = Standing.of(self.study, self.loaded)

        def phase(text: str) -> None:
            self._emit(Kind.PHASE, f"rerun {round_number}: {text}", trial=number, standing=standing)

        self._emit(
            Kind.PHASE,
            f"measuring the finalist again (round {round_number}): {flags_text(flags)}",
            trial=number,
            standing=standing,
            data={"flags": dict(flags), "round": round_number},
        )
        start = start_of(record.estimate)
        try:
            with heartbeat(book, claimed):
                outcome = self._trials.confirm(
                    number, flags, phase, seed=seed, start=start, baseline=bool(record.baseline)
                )
        except BaseException:
            with shielded(), contextlib.suppress(Exception):
                stored = stored_trial(book, claimed)
                if stored is not None and fail(book, stored, TrialRecord(failed_because="given back")):
                    requeue_rerun(book, stored)
            raise
        met = outcome.complete and all(c <= 0 for c in outcome.constraints)
        result = TrialRecord.from_attrs(outcome.attrs)
        rerun = Rerun(
            number,
            round_number,
            result.slo_throughput if met else None,
            result.estimate,
            outcome.cause.value if outcome.cause else None,
            outcome.summary,
        )
        before = pick_key(self.study, self.loaded)
        with shielded():
            record_rerun(book, claimed, rerun)
        status = "met the SLOs" if met else f"missed ({outcome.cause or 'SLOs'})"
        after = Standing.of(self.study, self.loaded)
        # A new confirmed best: this rerun made another config the pick, or confirmed the pick first.
        changed = pick_key(self.study, self.loaded) != before
        self._emit(
            Kind.CONFIRMED,
            f"measured again (round {round_number}): {status}: {outcome.summary}",
            trial=number,
            standing=after,
            data={"round": round_number, "slo_throughput": rerun.slo_throughput, "cause": rerun.cause},
        )
        self._announcer.new_best(number, after, confirmed=True, notify=changed)
