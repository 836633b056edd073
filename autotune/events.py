"""What a study run tells the world: events (progress, faults, results) and their JSON-lines log.

The study loop emits an :class:`Event` for everything that happens; the CLI shows them as progress lines,
:class:`EventLog` appends each as one JSON line to ``<workdir>/events.jsonl`` (for ``autotune status``
and the report, from any terminal or host that sees the folder), and notifications fire on some kinds.
"""

from __future__ import annotations

import enum
import errno
import json
import os
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autotune.errors import DiskFullError, StudyError


class Kind(enum.StrEnum):
    """What an event reports."""

    STARTED = "started"
    """A tuner started (or resumed) the study."""
    REQUEUED = "requeued"
    """Interrupted trials were queued again with the same flags."""
    TRIAL = "trial"
    """A trial began (its flags are in ``data``)."""
    PHASE = "phase"
    """A trial moved on: starting, ready, a probe, ..."""
    TRIAL_DONE = "trial_done"
    """A trial ended: complete or pruned (``data`` holds its outcome, cause and values)."""
    NEW_BEST = "new_best"
    """A trial beat the best feasible result so far."""
    FAULT = "fault"
    """A fault of the tuner or its environment (port taken, GPU busy, invalid measurement, storage)."""
    RETRY = "retry"
    """After a fault: the trial is given up (not data) and its config will be tried again after a pause."""
    CONFIRMED = "confirmed"
    """A finalist's config was measured again (``data``: the trial, its values, whether it met the SLOs)."""
    FINISHED = "finished"
    """The study's budget is spent (or, with several workers, this worker found nothing left to do)."""
    STOPPED = "stopped"
    """The study stopped before its budget: a fault that retries did not mend, or a signal."""
    NOTIFY_FAILED = "notify_failed"
    """A notification (command or webhook, :mod:`autotune.results.notify`) failed; the study goes on."""


@dataclass(frozen=True)
class Event:
    """One thing that happened while a study ran, with where the study stood."""

    kind: Kind
    text: str
    trial: int | None = None
    launches: int = 0
    """Trials that launched a server and finished (the budget counts these)."""
    budget: int = 0
    running: int = 0
    """Trials running in the study when the event was made (any tuner's, this one's among them)."""
    elapsed_s: float = 0.0
    """Seconds since this tuner started."""
    best: str | None = None
    """The best feasible result so far, one line."""
    data: Mapping[str, Any] = field(default_factory=dict)
    time: float = field(default_factory=time.time)
    """Wall-clock time (Unix seconds)."""
    worker: str = ""

    def as_dict(self) -> dict[str, Any]:
        """The event as one JSON object."""
        return {
            "time": round(self.time, 3),
            "kind": self.kind.value,
            "text": self.text,
            "trial": self.trial,
            "launches": self.launches,
            "budget": self.budget,
            "running": self.running,
            "elapsed_s": round(self.elapsed_s, 3),
            "best": self.best,
            "worker": self.worker,
            "data": dict(self.data),
        }

    @classmethod
    def from_dict(cls, obj: Mapping[str, Any]) -> Event:
        """An event read back from its JSON object (unknown kinds become ``phase``)."""
        try:
            kind = Kind(str(obj.get("kind")))
        except ValueError:
            kind = Kind.PHASE
        data = obj.get("data")
        trial = obj.get("trial")
        return cls(
            kind=kind,
            text=str(obj.get("text", "")),
            trial=trial if isinstance(trial, int) else None,
            launches=int(obj.get("launches") or 0),
            budget=int(obj.get("budget") or 0),
            running=int(obj.get("running") or 0),
            elapsed_s=float(obj.get("elapsed_s") or 0.0),
            best=obj.get("best") if isinstance(obj.get("best"), str) else None,
            data=data if isinstance(data, dict) else {},
            time=float(obj.get("time") or 0.0),
            worker=str(obj.get("worker", "")),
        )


class EventLog:
    """Appends events to a JSON-lines file, one line per event (several tuners may share the file: each
    line is written with one ``write`` on a file opened for appending, which the OS keeps whole)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __call__(self, event: Event) -> None:
        """Append ``event``; a failure to write is raised as :class:`StudyError`."""
        line = json.dumps(event.as_dict(), separators=(",", ":"), default=str) + "\n"
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line.encode("utf-8"))
            finally:
                os.close(fd)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise DiskFullError(
                    f"no space left on the device of the event log {str(self.path)!r}: free space there, "
                    "then rerun to resume"
                ) from exc
            raise StudyError(f"cannot write the event log {str(self.path)!r}: {exc.strerror or exc}") from exc


def read_events(path: Path) -> Iterator[Event]:
    """The events of a log file in order (lines that do not parse are skipped); none when it is missing."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return
    except OSError as exc:
        raise StudyError(f"cannot read the event log {str(path)!r}: {exc.strerror or exc}") from exc
    for line in text.splitlines():
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict):
            yield Event.from_dict(obj)
