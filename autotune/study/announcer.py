"""What a tuner says: each event stamped with where the study stands, the budget, the time since the
tuner started and who it is; how each trial ended; and a new best, said once each time it changes."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import optuna

from autotune.events import Event, Kind
from autotune.inputs.loader import LoadedStudy
from autotune.outcome import TrialOutcome
from autotune.store.record import TrialRecord
from autotune.study.standing import Standing, best_line


class Announcer:
    """Says a tuner's events to ``on_event`` (the CLI, the event log, notifications)."""

    def __init__(
        self,
        loaded: LoadedStudy,
        study: optuna.Study,
        worker: str,
        on_event: Callable[[Event], None],
        *,
        clock: Callable[[], float],
        started: float,
    ) -> None:
        self.loaded = loaded
        self.study = study
        self.worker = worker
        """Who this tuner is (:func:`autotune.study.recovery.worker_id`)."""
        self._on_event = on_event
        self._clock = clock
        self._started = started
        self._best = best_line(study, loaded)
        """The best as this tuner last said it."""

    def emit(
        self,
        kind: Kind,
        text: str,
        trial: int | None = None,
        standing: Standing | None = None,
        data: Mapping[str, Any] | None = None,
    ) -> None:
        """Say ``text`` as an event of ``kind`` (``standing``: read from storage when not given)."""
        standing = standing or Standing.of(self.study, self.loaded)
        self._on_event(
            Event(
                kind=kind,
                text=text,
                trial=trial,
                launches=standing.launches,
                budget=self.loaded.spec.budget.launches,
                running=standing.running,
                elapsed_s=self._clock() - self._started,
                best=standing.best,
                data=dict(data or {}),
                worker=self.worker,
            )
        )

    def new_best(self, number: int, after: Standing, *, confirmed: bool, notify: bool) -> None:
        """Say the best when it changed since this tuner last said it (``notify``: a notification is due,
        :func:`autotune.results.notify.notification_for`)."""
        if after.best is not None and after.best != self._best:
            self._best = after.best
            data = {"confirmed": confirmed, "notify": notify}
            self.emit(Kind.NEW_BEST, f"new best: {after.best}", trial=number, standing=after, data=data)

    def trial_done(self, number: int, outcome: TrialOutcome) -> None:
        """Say how trial ``number`` ended (its ``outcome``, told into storage), then the best if that
        changed."""
        launched = TrialRecord.from_attrs(outcome.attrs).launched is not False
        after = Standing.of(self.study, self.loaded)
        status = "complete" if outcome.complete else f"pruned ({outcome.cause})"
        data = {
            "outcome": "complete" if outcome.complete else "pruned",
            "cause": outcome.cause.value if outcome.cause else None,
            "launched": launched,
            "values": list(outcome.values) if outcome.values else None,
            "summary": outcome.summary,
        }
        self.emit(Kind.TRIAL_DONE, f"{status}: {outcome.summary}", trial=number, standing=after, data=data)
        # The search's best is unconfirmed (the luckiest first figure): it notifies only in a study without
        # finalists, and only from the tuner that measured it.
        mine = after.best is not None and after.best.startswith(f"trial {number}:")
        self.new_best(number, after, confirmed=False, notify=mine and self.loaded.spec.finalists.count == 0)
