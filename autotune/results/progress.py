"""What a running study shows: each event as one line fitted to a width, and the progress bar's figures.

A line puts what matters first, so that a line cut to the terminal keeps it: the elapsed time, launches
of the budget, the best result so far, the trial, then its verdict (``complete``, ``pruned (oom)``, a
probe's ``pass``/``fail``) and only then the detail. :class:`Tracker` follows the events for the
progress bar: the trial and its phase, and an ETA (the mean duration of this study's launches times the
launches left). Pure: the CLI prints.
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Iterable
from dataclasses import dataclass

from autotune.events import Event, Kind
from autotune.units import format_duration, format_figure

ELLIPSIS = "…"

_BEST = re.compile(r"^trial (\d+): [^=]+=(.+)$")
_PROBE = re.compile(
    r"probe (?P<k>\d+) at rate (?P<rate>\S+): (?P<verdict>pass|fail) "
    r"\((?P<n>\d+) requests, (?P<s>[\d.]+) s\) - (?P<why>.*)$"
)


def fit(text: str, width: int) -> str:
    """``text`` on one line of at most ``width`` characters (cut with an ellipsis); ``width`` 0: whole."""
    text = " ".join(text.split("\n"))
    if width <= 0 or len(text) <= width:
        return text
    return text[: max(0, width - 1)] + ELLIPSIS


def best_short(best: str | None) -> str:
    """The best-so-far line (``trial 7: slo_throughput=19,926 tok/s``) as ``#7 19,926 tok/s``; other shapes
    unchanged."""
    if not best:
        return ""
    match = _BEST.match(best)
    return f"#{match.group(1)} {match.group(2)}" if match else best


def body(event: Event) -> str:
    """An event's text with its verdict first (a probe's ``pass``/``fail`` before its numbers)."""
    text = event.text
    match = _PROBE.search(text)
    if match is None:
        return text
    why = match["why"].removeprefix("fail: ")
    return (
        f"{text[: match.start()]}probe {match['k']} at {_figure(match['rate'])} req/s: {match['verdict']}: "
        f"{why} ({match['n']} requests, {match['s']} s)"
    )


def _figure(text: str) -> str:
    """A number as the rate search wrote it (``1.99e+03``, ``inf``) as people read it (``1,990``)."""
    try:
        return format_figure(float(text))
    except ValueError:
        return text


def event_line(event: Event, width: int = 0, *, clock: bool = True) -> str:
    """One line for ``event``: ``[elapsed] launches/budget best #N value | #trial verdict: detail``, cut
    to ``width`` (0: never cut)."""
    head = f"[{format_duration(event.elapsed_s):>6}] " if clock else ""
    head += f"{event.launches}/{event.budget}"
    best = best_short(event.best)
    if best:
        head += f" best {best}"
    where = f"#{event.trial} " if event.trial is not None else ""
    return fit(f"{head} | {where}{body(event)}", width)


MILESTONES = frozenset(Kind) - {Kind.PHASE}
"""The kinds a progress bar prints as lines (a phase only updates the bar)."""


@dataclass(frozen=True)
class Snapshot:
    """What the progress bar shows."""

    launches: int
    budget: int
    trial: int | None
    phase: str
    mean_launch_s: float | None
    """Mean duration of the launches seen (this run's, and earlier runs' from the event log)."""
    eta_s: float | None
    """Mean launch × launches left ÷ the trials running at once (the tuners sharing the budget, as the
    latest event counted them); ``None`` until one launch was timed, or once the budget is spent. The
    finalists' reruns are not in it (``autotune status`` adds them)."""
    tuners: int = 1
    """The trials running at once that the ETA divides by."""

    def eta_text(self) -> str:
        """``ETA 4m10s (43s × 5 launches left)``, or what is known instead."""
        left = max(0, self.budget - self.launches)
        if not left:
            return "budget spent"
        if self.eta_s is None or self.mean_launch_s is None:
            return "ETA after the first launch"
        shared = f" ÷ {self.tuners} running" if self.tuners > 1 else ""
        return (
            f"ETA {format_duration(self.eta_s)} ({format_duration(self.mean_launch_s)} × {left} left{shared})"
        )

    def phase_text(self) -> str:
        """``#8 probe 2 at 15.4 req/s: fail: ...`` (the trial and its latest phase)."""
        where = f"#{self.trial} " if self.trial is not None else ""
        return f"{where}{self.phase}"


class Tracker:
    """Follows a run's events: the trial and its phase, and how long launches take (for the ETA)."""

    def __init__(self, budget: int = 0) -> None:
        self._started: dict[tuple[str, int], float] = {}
        self._durations: list[float] = []
        self._launches = 0
        self._budget = budget
        self._running = 0
        self._trial: int | None = None
        self._phase = "starting"

    def seed(self, past: Iterable[Event]) -> None:
        """Learn launch durations from earlier runs (``events.jsonl``) without taking their phase."""
        for event in past:
            self._time(event)

    def update(self, event: Event) -> None:
        """Take ``event`` into account."""
        self._time(event)
        self._launches, self._budget, self._running = event.launches, event.budget, event.running
        if event.kind is not Kind.NEW_BEST:
            self._trial = event.trial
            self._phase = body(event)

    def _time(self, event: Event) -> None:
        if event.trial is None:
            return
        key = (event.worker, event.trial)
        if event.kind is Kind.TRIAL:
            self._started[key] = event.time
        elif event.kind is Kind.TRIAL_DONE:
            start = self._started.pop(key, None)
            if start is not None and event.data.get("launched", True) and event.time >= start:
                self._durations.append(event.time - start)

    def standing(self) -> Snapshot:
        """Where the run stands now."""
        mean = statistics.fmean(self._durations) if self._durations else None
        left = max(0, self._budget - self._launches)
        tuners = max(1, min(self._running, left))
        eta = mean * left / tuners if mean is not None and left and math.isfinite(mean) else None
        return Snapshot(self._launches, self._budget, self._trial, self._phase, mean, eta, tuners)
