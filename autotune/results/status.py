"""Where a study stands, read without writing anything: ``autotune status`` from any terminal or host that
reaches the storage, while tuners run or after.

The storage is opened read-only (:func:`autotune.store.storage.open_storage_readonly`); the event log
``<workdir>/events.jsonl`` adds the running trial's phase and the last fault when this host sees the
folder. The best config and its gain are the export's (:func:`autotune.results.export.choose`,
:func:`autotune.results.export.headline`), never worked out here.

The ETA is the mean wall time of the launches that finished (start to end of each trial, rejected configs
left out) times the launches still to run, less what the running trials have done already, divided by
the tuners running now (at least one); the finalists' runs still due (``finalists.count`` best plus the
defaults, ``finalists.rounds`` times) are counted at the same mean.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from autotune.errors import ExportError, SpecError, StudyError
from autotune.events import Event, Kind, read_events
from autotune.flags import dashed_flags
from autotune.inputs.loader import LoadedStudy
from autotune.results.export import choose, gain_fields, headline, reruns_fields, throughput_fields
from autotune.store.record import TrialRecord
from autotune.store.storage import close_storage, open_storage_readonly, redact_url
from autotune.study.finalists import existing_ledger, finalists, pending, scheduled
from autotune.study.loop import close_study
from autotune.study.standing import is_launch
from autotune.units import format_duration, wrap

FAULT_KINDS = (Kind.FAULT, Kind.RETRY, Kind.STOPPED)


def read_study(loaded: LoadedStudy) -> optuna.Study | None:
    """The study in storage opened for reading only; ``None`` when there is none yet (no storage file,
    or no study of that name). Close it with :func:`autotune.study.loop.close_study`."""
    storage = open_storage_readonly(loaded.storage_url, loaded.storage_field)
    if storage is None:
        return None
    name = loaded.spec.study.name
    try:
        return optuna.load_study(study_name=name, storage=storage, sampler=optuna.samplers.RandomSampler())
    except KeyError:
        close_storage(storage)
        return None
    except Exception as exc:  # the storage's own errors come in many types
        close_storage(storage)
        raise StudyError(f"cannot read study {name!r} in {redact_url(loaded.storage_url)}: {exc}") from exc


def pick_summary(study: optuna.Study, loaded: LoadedStudy) -> dict[str, Any] | None:
    """The config the export picks now (:func:`autotune.results.export.choose`), with its headline, SLO
    throughput and interval and gain; ``None`` while no trial meets the SLOs."""
    try:
        choice = choose(study, loaded, trial=None, policy=None)
    except (ExportError, SpecError):
        return None
    return {
        "trial": choice.trial.number,
        "headline": headline(choice),
        "flags": dashed_flags(choice.tuned),
        **throughput_fields(choice.figure),
        **gain_fields(choice.gain),
        "reruns": reruns_fields(choice.finalist),
    }


@dataclass(frozen=True)
class RunningTrial:
    """A trial some tuner runs now."""

    number: int
    worker: str | None
    flags: Mapping[str, Any]
    elapsed_s: float | None
    """Since the trial started (storage time)."""
    phase: str | None
    """The last thing the event log says about it."""
    phase_age_s: float | None
    server_log: str
    rerun_round: int | None = None
    """For a finalist measured again (a rerun of the ledger, not a trial of the budget): its round."""


@dataclass(frozen=True)
class Status:
    """Where a study stands (``as_dict`` for ``--json``, ``render`` for people)."""

    study: str
    storage: str
    state: str
    """``not started``, ``running``, ``measuring the finalists again (N runs to go)``, ``finished``,
    ``stopped`` (the event log's last word), or ``idle`` (nothing runs, budget left: no tuner, or one
    waiting)."""
    launches: int = 0
    budget: int = 0
    rejected: int = 0
    given_back: int = 0
    waiting: int = 0
    running: tuple[RunningTrial, ...] = ()
    counts: Mapping[str, int] = field(default_factory=dict)
    """``complete``, ``pruned:<cause>`` (launched), ``rejected:<cause>`` (not launched)."""
    best: Mapping[str, Any] | None = None
    mean_launch_s: float | None = None
    eta_s: float | None = None
    eta_how: str = ""
    last_fault: Mapping[str, Any] | None = None
    last_event: Mapping[str, Any] | None = None
    records: Mapping[str, str] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return asdict(self)

    def render(self, width: int = 0) -> str:
        """Lines for a terminal, each wrapped within ``width`` columns (0: not wrapped) with its
        continuation lines indented (:func:`autotune.units.wrap`)."""
        return wrap("\n".join(self._lines()), width)

    def _lines(self) -> list[str]:
        """The lines of :meth:`render`, unwrapped."""
        lines = [f"study {self.study!r} ({self.storage}): {self.state}"]
        if self.state == "not started":
            lines.append(f"records: {self.records.get('workdir', '')}")
            return lines
        extra = [f"{self.rejected} rejected before launch"]
        if self.given_back:
            extra.append(f"{self.given_back} given back by the tuner")
        if self.waiting:
            extra.append(f"{self.waiting} queued")
        lines.append(f"launches: {self.launches}/{self.budget} ({', '.join(extra)})")
        for trial in self.running:
            took = f" for {format_duration(trial.elapsed_s)}" if trial.elapsed_s is not None else ""
            what = f"trial {trial.number}"
            if trial.rerun_round is not None:
                what = f"finalist trial {trial.number} measured again (round {trial.rerun_round})"
            lines.append(f"running: {what}{took} on {trial.worker or 'an unknown tuner'}")
            if trial.phase:
                age = f" ({format_duration(trial.phase_age_s)} ago)" if trial.phase_age_s is not None else ""
                lines.append(f"  phase: {trial.phase}{age}")
            lines.append("  flags: " + " ".join(f"{k.replace('_', '-')}={v}" for k, v in trial.flags.items()))
            lines.append(f"  log: {trial.server_log}")
        if self.eta_s is not None:
            lines.append(f"ETA: about {format_duration(self.eta_s)} ({self.eta_how})")
        elif self.eta_how:
            lines.append(f"ETA: {self.eta_how}")
        if self.best is not None:
            lines.append(f"best so far: {self.best['headline']}")
        else:
            lines.append("best so far: no trial meets the SLOs yet")
        order = sorted(self.counts, key=lambda k: (k != "complete", k.startswith("rejected"), k))
        lines.append("outcomes: " + (", ".join(f"{self.counts[k]} {k}" for k in order) or "none yet"))
        if self.last_fault is not None:
            lines.append(f"last fault: {_when(self.last_fault)}{self.last_fault['text']}")
        if self.last_event is not None:
            lines.append(f"last event: {_when(self.last_event)}{self.last_event['text']}")
        lines.append("records:")
        lines.extend(f"  {name}: {where}" for name, where in self.records.items())
        return lines


def _when(event: Mapping[str, Any]) -> str:
    trial = f"trial {event['trial']}, " if event.get("trial") is not None else ""
    age = event.get("age_s")
    return f"{trial}{format_duration(age)} ago: " if isinstance(age, int | float) else trial


def records(loaded: LoadedStudy) -> dict[str, str]:
    """Where a study's records are."""
    workdir = loaded.workdir
    return {
        "storage": redact_url(loaded.storage_url),
        "workdir": str(workdir),
        "events": str(workdir / "events.jsonl"),
        "server logs": str(workdir / "trials" / "<n>" / "server.log"),
        "probes": str(workdir / "trials" / "<n>" / "probes" / "probe-<k>.json"),
        "finalists": str(workdir / "confirmations"),
    }


def _counts(trials: Sequence[FrozenTrial]) -> Counter[str]:
    counts: Counter[str] = Counter()
    for trial in trials:
        if trial.state == TrialState.COMPLETE:
            counts["complete" if is_launch(trial) else "rejected:repeat"] += 1
        elif trial.state == TrialState.PRUNED:
            cause = TrialRecord.from_trial(trial).cause
            counts[f"{'pruned' if is_launch(trial) else 'rejected'}:{cause or '?'}"] += 1
    return counts


def _seconds(trial: FrozenTrial) -> float | None:
    if trial.datetime_start is None or trial.datetime_complete is None:
        return None
    return (trial.datetime_complete - trial.datetime_start).total_seconds()


def _event_dict(event: Event, now: float) -> dict[str, Any]:
    return {
        "time": event.time,
        "age_s": max(0.0, now - event.time),
        "kind": event.kind.value,
        "trial": event.trial,
        "text": event.text,
    }


def read_status(loaded: LoadedStudy, *, now: float | None = None) -> Status:
    """The status of ``loaded``'s study, read-only (storage and event log)."""
    now = time.time() if now is None else now
    name = loaded.spec.study.name
    shown = redact_url(loaded.storage_url)
    study = read_study(loaded)
    if study is None:
        return Status(study=name, storage=shown, state="not started", records=records(loaded))
    try:
        events = list(read_events(loaded.workdir / "events.jsonl"))
        return status_of(study, loaded, events, now=now)
    finally:
        close_study(study)


def status_of(study: optuna.Study, loaded: LoadedStudy, events: Sequence[Event], *, now: float) -> Status:
    """The status of an open study given its event log (oldest first)."""
    spec = loaded.spec
    trials = study.get_trials(deepcopy=False)
    launched = [t for t in trials if is_launch(t)]
    finished = [t for t in trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
    running_trials = [t for t in trials if t.state == TrialState.RUNNING]
    last_by_trial: dict[int, Event] = {}
    for event in events:
        if event.trial is not None:
            last_by_trial[event.trial] = event
    searching = tuple(_running(t, last_by_trial.get(t.number), loaded, now) for t in running_trials)
    running = searching + _reruns_running(study, trials, last_by_trial, loaded, now)

    budget = spec.budget.launches
    durations = [s for s in (_seconds(t) for t in launched) if s is not None]
    mean = sum(durations) / len(durations) if durations else None
    eta, how = _eta(study, loaded, len(launched), searching, mean)

    faults = [e for e in events if e.kind in FAULT_KINDS]
    last = events[-1] if events else None
    if searching:
        state = "running"
    elif last is not None and last.kind is Kind.STOPPED:
        state = "stopped"
    elif len(launched) >= budget:
        due = finalist_runs_due(study, loaded, 0)
        state = "finished" if not due else f"measuring the finalists again ({due} runs to go)"
    else:
        state = "idle"
    return Status(
        study=spec.study.name,
        storage=redact_url(loaded.storage_url),
        state=state,
        launches=len(launched),
        budget=budget,
        rejected=len(finished) - len(launched),
        given_back=sum(1 for t in trials if t.state == TrialState.FAIL),
        waiting=sum(1 for t in trials if t.state == TrialState.WAITING),
        running=running,
        counts=dict(_counts(trials)),
        best=pick_summary(study, loaded),
        mean_launch_s=mean,
        eta_s=eta,
        eta_how=how,
        last_fault=_event_dict(faults[-1], now) if faults else None,
        last_event=_event_dict(last, now) if last is not None else None,
        records=records(loaded),
    )


def finalist_runs_due(study: optuna.Study, loaded: LoadedStudy, launches_left: int) -> int:
    """How many finalist reruns are still due: once they are queued, those waiting or running in the
    ledger (:mod:`autotune.study.finalists`); before, the finalists as the search stands now (at most
    ``finalists.count`` configs and the defaults), ``finalists.rounds`` times each."""
    spec = loaded.spec.finalists
    if not spec.count:
        return 0
    book = existing_ledger(study)
    if not launches_left and book is not None and scheduled(book):
        waiting, running = pending(book)
        return waiting + running
    if launches_left:
        return (spec.count + 1) * spec.rounds
    return len(finalists(study, loaded)) * spec.rounds


def _running(trial: FrozenTrial, last: Event | None, loaded: LoadedStudy, now: float) -> RunningTrial:
    record = TrialRecord.from_trial(trial)
    started = trial.datetime_start.timestamp() if trial.datetime_start is not None else None
    return RunningTrial(
        number=trial.number,
        worker=record.worker,
        flags=dict(record.flags),
        elapsed_s=max(0.0, now - started) if started is not None else None,
        phase=last.text if last is not None else None,
        phase_age_s=max(0.0, now - last.time) if last is not None else None,
        server_log=str(loaded.trial_dir(trial.number) / "server.log"),
    )


def _reruns_running(
    study: optuna.Study,
    trials: Sequence[FrozenTrial],
    last_by_trial: Mapping[int, Event],
    loaded: LoadedStudy,
    now: float,
) -> tuple[RunningTrial, ...]:
    """The finalists being measured again now (running trials of the ledger), as running trials: the
    finalist's number and flags, the rerun's round, time and folder."""
    book = existing_ledger(study)
    if book is None:
        return ()
    by_number = {t.number: t for t in trials}
    out = []
    for rerun in book.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        number, round_number, seed = (rerun.user_attrs.get(k) for k in ("finalist", "round", "seed"))
        if not isinstance(number, int) or not isinstance(seed, int) or number not in by_number:
            continue
        trial = _running(by_number[number], last_by_trial.get(number), loaded, now)
        started = rerun.datetime_start.timestamp() if rerun.datetime_start is not None else None
        log = loaded.rerun_dir(number, seed) / "server.log"
        out.append(
            dataclasses.replace(
                trial,
                worker=TrialRecord.from_trial(rerun).worker or trial.worker,
                elapsed_s=max(0.0, now - started) if started is not None else None,
                server_log=str(log),
                rerun_round=round_number if isinstance(round_number, int) else None,
            )
        )
    return tuple(out)


def _eta(
    study: optuna.Study,
    loaded: LoadedStudy,
    launches: int,
    running: Sequence[RunningTrial],
    mean: float | None,
) -> tuple[float | None, str]:
    """Seconds left and how they were worked out (see the module docstring)."""
    spec = loaded.spec
    left = max(0, spec.budget.launches - launches)
    rounds_due = finalist_runs_due(study, loaded, left)
    if not left and not running and not rounds_due:
        return None, ""
    if mean is None:
        return None, "unknown until a launch has finished"
    workers = max(1, len({t.worker for t in running}))
    new = max(0, left - len(running))
    busy = sum(max(0.0, mean - (t.elapsed_s or 0.0)) for t in running)
    eta = (busy + (new + rounds_due) * mean) / workers
    parts = [f"{left} launches left × {format_duration(mean)} mean launch"]
    if running:
        parts.append(f"less the {len(running)} running trial(s)' time so far")
    if rounds_due:
        parts.append(f"+ {'up to ' if left else ''}{rounds_due} finalist runs at the same mean")
    parts.append(f"÷ {workers} tuner(s) running")
    return eta, ", ".join(parts)
