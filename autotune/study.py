"""The study loop: Optuna's ask and tell around trials, to an exact budget of launches, with resume,
retries, several workers, and signals.

Why TPE and PRUNED: crashes and OOMs are recorded as PRUNED trials with their cause. Of Optuna 5's
samplers, TPE is the one that learns from PRUNED trials (they join its "bad" density), so the search
moves away from crash regions without inventing objective values for crashed configs (docs/optuna.md:
a crash recorded as FAIL pulls TPE *into* the crash region; GPSampler and NSGA-II ignore PRUNED). TPE is
Optuna 5's default for multi-objective studies, with ``constant_liar`` for parallel workers. Random and
NSGA-II are offered for comparison; GPSampler when torch is installed.

The budget counts launches: trials that launched a server and ended (complete, or pruned for what the
server did). A config is screened first (known constraints, a repeat of a config already tried, the
memory model): a rejected one is recorded as PRUNED with its cause but spends nothing, up to a cap
(``budget.max_rejected``). With several workers on one study the budget stays exact: a worker launches
only while the launches finished, plus the RUNNING trials numbered before its own (the storage numbers
trials atomically, so every worker sees the same order), are fewer than the budget; otherwise it waits,
or gives its trial up unlaunched when the budget is spent.

Giving a trial up: the tuner's own faults, signals and deaths never become data. Such a trial is marked
FAIL with ``failed_because`` and its config is queued again (``retry_of``), at most :data:`MAX_RETRIES`
times. A trial dropped before launch (budget spent elsewhere, the same config running elsewhere) is FAIL
with ``discarded`` and never retried. A trial left RUNNING by a tuner that died on this host is failed at
the next start (its worker process is gone) and its orphaned server killed; on other hosts Optuna's
heartbeat fails it after the grace period. Failing a RUNNING trial is an atomic state change in the
storage, so exactly one tuner re-queues it.

Faults of the tuner or its environment that may pass (:attr:`~autotune.errors.AutotuneError.transient`:
a port taken, a GPU held by another process, a probe the client could not measure, storage briefly
unreachable) are retried with a doubling pause, ``faults.retries`` times in a row, before the study
stops. Other errors stop it at once. :class:`~autotune.errors.Interrupted` (SIGTERM, SIGINT, SIGHUP) gives
the trial back and re-raises.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
import math
import socket
import threading
import time
import warnings
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import optuna
import psutil
import sqlalchemy.exc
from optuna.exceptions import UpdateFinishedTrialError
from optuna.storages._heartbeat import BaseHeartbeat
from optuna.trial import FrozenTrial, TrialState

from autotune.errors import AutotuneError, Interrupted, StorageUnavailableError, StudyError
from autotune.events import Event, Kind
from autotune.feasibility import Decision
from autotune.finalists import Confirmation, finalists, pending, store
from autotune.interrupts import acknowledge, shielded
from autotune.loader import LoadedStudy
from autotune.outcome import Cause, TrialOutcome
from autotune.record import TrialRecord, outcome_attrs
from autotune.spec import FlagValue, SamplerSpec
from autotune.storage import close_storage, create_or_load_study, open_storage, redact_url

FINISHED = (TrialState.COMPLETE, TrialState.PRUNED)
MAX_RETRIES = 2
"""How many times a config given up by the tuner (a fault, a signal, a death) is queued again."""
SLOT_POLL_S = 2.0
"""How often a worker waiting for a budget slot looks again."""
RECOVER_EVERY_S = 15.0
"""While waiting, how often a worker looks for trials whose tuner died."""
MAX_FAULT_PAUSE_S = 600.0
ORPHAN_TRIAL_S = 60.0
"""A RUNNING trial that has no worker recorded this long after it started was left by a dead tuner."""
STORAGE_ERRORS = (sqlalchemy.exc.OperationalError, sqlalchemy.exc.InterfaceError, OSError)
"""What a storage that does not answer raises (a database restarting, a lost connection)."""

Phase = Callable[[str], None]
EventFn = Callable[[Event], None]


class Trials(Protocol):
    """What the study loop asks of a study's trials (:class:`autotune.trial.TrialRunner`)."""

    def screen(self, flags: Mapping[str, FlagValue]) -> Decision:
        """Decide before a launch: an outcome when the config must not be launched (rejected)."""
        ...

    def launch(
        self, number: int, flags: Mapping[str, FlagValue], decision: Decision, phase: Phase
    ) -> TrialOutcome:
        """Launch the server with ``flags``, measure, tear down; raise on the tuner's own faults."""
        ...

    def confirm(self, number: int, flags: Mapping[str, FlagValue], phase: Phase) -> TrialOutcome:
        """Launch trial ``number``'s config again and measure it with the finalists' longer probes and
        fresh prompts (:mod:`autotune.finalists`); raise on the tuner's own faults."""
        ...


@contextlib.contextmanager
def _experimental_ok() -> Iterator[None]:
    """Metric names, heartbeats and stale-trial checks are marked experimental in Optuna; used on purpose."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        yield


def worker_id() -> str:
    """This tuner process as ``host:pid:create_time`` (create_time guards against pid reuse)."""
    me = psutil.Process()
    return f"{socket.gethostname()}:{me.pid}:{me.create_time():.3f}"


def _worker_alive(worker: str) -> bool | None:
    """True/False for a worker on this host; None when it ran elsewhere (heartbeat decides)."""
    try:
        host, pid, created = worker.rsplit(":", 2)
    except ValueError:
        return None
    if host != socket.gethostname():
        return None
    try:
        proc = psutil.Process(int(pid))
        return abs(proc.create_time() - float(created)) < 0.01
    except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError):
        return False


def make_sampler(spec: SamplerSpec, history: int = 0, label: str = "") -> optuna.samplers.BaseSampler:
    """Build the configured sampler (see the module docstring for why TPE is the default).

    ``history`` is the number of trials already stored: a resumed study seeds its sampler with
    ``seed + history``, so a rerun continues the random stream instead of replaying it (a replay would
    suggest the configs of the interrupted run again). ``label`` names the worker (its GPU set): workers
    that start together on one study get different seeds. Deterministic given both.
    """
    if spec.seed is not None and (history or label):
        offset = zlib.crc32(label.encode()) % 1_000_003 if label else 0
        spec = spec.model_copy(update={"seed": spec.seed + history + offset})
    if spec.name == "random":
        return optuna.samplers.RandomSampler(seed=spec.seed)
    if spec.name == "nsga2":
        return optuna.samplers.NSGAIISampler(seed=spec.seed)
    if spec.name == "gp":
        try:
            return optuna.samplers.GPSampler(seed=spec.seed, n_startup_trials=spec.startup_trials)
        except ImportError as exc:
            raise StudyError(f"sampler 'gp' needs torch and scipy installed: {exc}") from exc
    return optuna.samplers.TPESampler(
        seed=spec.seed,
        n_startup_trials=spec.startup_trials,
        multivariate=True,
        constant_liar=True,
    )


def close_study(study: optuna.Study) -> None:
    """Close the database connections of a study from :func:`open_study`. (Optuna has no public accessor
    to a study's storage, ``_storage``, and wraps a database storage in a cache whose ``_backend`` holds
    the connections.)"""
    storage = study._storage
    close_storage(getattr(storage, "_backend", storage))


def open_study(loaded: LoadedStudy, *, create: bool, heartbeat: bool = True, label: str = "") -> optuna.Study:
    """Open the study in storage. With ``create`` make it when new (only the process that creates it
    stores its objectives and queues the vLLM defaults as the baseline trial) and check that a stored one
    matches the spec; without, a missing study is a :class:`StudyError`."""
    spec = loaded.spec
    shown = redact_url(loaded.storage_url)
    storage = open_storage(
        loaded.storage_url, heartbeat=heartbeat, on_stale=requeue_stale if heartbeat else None
    )
    name = spec.study.name
    objectives = [o.metric for o in spec.objectives]
    sampler = make_sampler(spec.sampler, label=label)
    created = False
    try:
        if create:
            study, created = create_or_load_study(
                storage, name, [o.direction for o in spec.objectives], sampler
            )
        else:
            study = optuna.load_study(study_name=name, storage=storage, sampler=sampler)
    except KeyError as exc:
        raise StudyError(f"no study named {name!r} in {shown}: run `autotune tune` first") from exc
    except ValueError as exc:
        raise StudyError(f"study {name!r} in {shown} does not match the spec: {exc}") from exc
    if created:
        with _experimental_ok():
            study.set_metric_names(objectives)
        study.set_user_attr("objectives", objectives)
        study.set_user_attr("slo", [str(t) for t in spec.slo.terms])
        study.set_user_attr("params", list(loaded.space.params))
        enqueue_baseline(study, loaded)
    else:
        stored = study.user_attrs.get("objectives")
        if stored is not None and stored != objectives:
            raise StudyError(
                f"study {name!r} was created with objectives {stored}, the spec now says {objectives}: "
                "use a new study name"
            )
    history = len(study.get_trials(deepcopy=False))
    if history or label:
        study.sampler = make_sampler(spec.sampler, history, label)
    return study


def enqueue_baseline(study: optuna.Study, loaded: LoadedStudy) -> None:
    """Queue the vLLM defaults as the baseline trial (once: the study's creator does it)."""
    study.enqueue_trial(
        dict(loaded.search_space.defaults()),
        user_attrs=TrialRecord(baseline=True).to_attrs(),
        skip_if_exists=True,
    )


def finished_trials(study: optuna.Study) -> list[FrozenTrial]:
    """COMPLETE and PRUNED trials."""
    return study.get_trials(deepcopy=False, states=FINISHED)


def is_launch(trial: FrozenTrial) -> bool:
    """Whether a finished trial spent the budget: it launched a server (rejected configs did not)."""
    return trial.state in FINISHED and TrialRecord.from_trial(trial).launched is not False


# ----------------------------------------------------------------------------------------------
# Giving trials back, and recovering them
# ----------------------------------------------------------------------------------------------


def _retries_of(trials: Sequence[FrozenTrial], number: int) -> int:
    """How many times the config of trial ``number`` was tried again already (the chain of retry_of)."""
    by_number = {t.number: TrialRecord.from_trial(t).retry_of for t in trials}
    depth = 0
    current = by_number.get(number)
    while current is not None and depth <= MAX_RETRIES:
        depth += 1
        current = by_number.get(current)
    return depth


def gives_up(study: optuna.Study, trial: FrozenTrial) -> bool:
    """Whether ``trial``'s config was given up by the tuner :data:`MAX_RETRIES` times already."""
    return _retries_of(study.get_trials(deepcopy=False), trial.number) >= MAX_RETRIES


def _given_up(why: str) -> str:
    return f"{why}; not retried: its config was given up {MAX_RETRIES + 1} times"


def requeue(study: optuna.Study, trial: FrozenTrial, *, limit: bool = True) -> int | None:
    """Queue ``trial``'s config again (``retry_of``), unless a retry exists, it was discarded, or (with
    ``limit``) it was retried :data:`MAX_RETRIES` times already; returns the number of the queued trial.

    A trial interrupted by a signal is requeued without ``limit``: stopping a study is not the config's
    fault, however often it happens."""
    trials = study.get_trials(deepcopy=False)
    record = TrialRecord.from_trial(trial)
    if record.discarded or any(TrialRecord.from_trial(t).retry_of == trial.number for t in trials):
        return None
    if not trial.params or (limit and _retries_of(trials, trial.number) >= MAX_RETRIES):
        return None
    attrs = TrialRecord(baseline=record.baseline, retry_of=trial.number).to_attrs()
    study.add_trial(  # as enqueue_trial, but with the params visible while the trial waits
        optuna.trial.create_trial(
            state=TrialState.WAITING,
            params=dict(trial.params),
            distributions=dict(trial.distributions),
            user_attrs=attrs,
            system_attrs={"fixed_params": dict(trial.params)},
        )
    )
    queued = [
        t for t in study.get_trials(deepcopy=False) if TrialRecord.from_trial(t).retry_of == trial.number
    ]
    return queued[0].number if queued else None


def requeue_stale(study: optuna.Study, trial: FrozenTrial) -> None:
    """Optuna's heartbeat callback: this tuner failed ``trial`` (its tuner went silent): queue it again."""
    requeue(study, trial)


def _set_attrs(study: optuna.Study, trial_id: int, attrs: Mapping[str, Any]) -> None:
    # No public API writes to a trial this process did not ask for (a stale one): the storage does.
    for key, value in attrs.items():
        study._storage.set_trial_user_attr(trial_id, key, value)


def _fail(study: optuna.Study, trial: FrozenTrial, record: TrialRecord) -> bool:
    """Mark a RUNNING trial FAIL with ``record``'s facts; False when another process already ended it
    (the state change is atomic in the storage, so exactly one process wins)."""
    try:
        _set_attrs(study, trial._trial_id, record.to_attrs())
        return bool(study._storage.set_trial_state_values(trial._trial_id, TrialState.FAIL))
    except UpdateFinishedTrialError:
        return False


def recover(study: optuna.Study, on_stale: Callable[[FrozenTrial], None]) -> list[int]:
    """Fail trials left RUNNING by a tuner that died on this host (``on_stale`` first, to kill its
    orphaned server) or, through Optuna's heartbeat, anywhere; queue their configs again.

    Returns the numbers of the trials given back.
    """
    with _experimental_ok():  # heartbeat: calls requeue_stale for what this process failed
        optuna.storages.fail_stale_trials(study)
    recovered = []
    now = datetime.datetime.now()
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        worker = TrialRecord.from_trial(trial).worker
        if worker is None:
            # A tuner records itself on its trial right after asking for it: a trial without a worker
            # for a minute belongs to a tuner that died in between (it has no heartbeat either).
            started = trial.datetime_start
            if started is None or (now - started).total_seconds() < ORPHAN_TRIAL_S:
                continue
        elif _worker_alive(worker) is not False:
            continue
        on_stale(trial)
        why = "the tuner running it died"
        with shielded():
            if not trial.params:
                if _fail(study, trial, TrialRecord(discarded=f"{why} before its config was drawn")):
                    recovered.append(trial.number)
                continue
            last = gives_up(study, trial)
            if _fail(study, trial, TrialRecord(failed_because=_given_up(why) if last else why)):
                requeue(study, trial)
                recovered.append(trial.number)
    return recovered


# ----------------------------------------------------------------------------------------------
# Recording outcomes
# ----------------------------------------------------------------------------------------------


def constraint_keys(loaded: LoadedStudy) -> list[str]:
    """Names of a trial's constraints, in order: each SLO term, then the error budget."""
    return [f"slo {term}" for term in loaded.spec.slo.terms] + ["error budget"]


def record(trial: optuna.Trial, outcome: TrialOutcome, keys: Sequence[str]) -> None:
    """Store an outcome's facts, cause, summary and constraints on the trial (before it is told)."""
    for key, value in {**outcome.attrs, **outcome_attrs(outcome.cause, outcome.summary)}.items():
        trial.set_user_attr(key, value)
    if outcome.constraints:
        if len(outcome.constraints) != len(keys):
            raise StudyError(f"trial {trial.number}: {len(outcome.constraints)} constraints for {list(keys)}")
        for key, value in zip(keys, outcome.constraints, strict=True):
            trial.set_constraint(key, float(value))


def best_line(study: optuna.Study, loaded: LoadedStudy) -> str | None:
    """A one-line summary of the best feasible trial by the first objective."""
    best = best_trial(study, loaded)
    if best is None:
        return None
    return f"trial {best.number}: {loaded.spec.objectives[0].metric}={best.values[0]:.4g}"


def best_trial(study: optuna.Study, loaded: LoadedStudy) -> FrozenTrial | None:
    """The feasible COMPLETE trial best by the first objective (measured ones, not repeats)."""
    objective = loaded.spec.objectives[0]
    complete = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)) if t.values]
    feasible = [t for t in complete if all(c <= 0 for c in (t.constraints or {}).values()) and is_launch(t)]
    if not feasible:
        return None
    sign = 1 if objective.direction == "maximize" else -1
    return max(feasible, key=lambda t: (sign * t.values[0], -t.number))


@dataclass(frozen=True)
class Standing:
    """Where the study stands: what spent the budget, what was rejected, what runs now."""

    launches: int
    rejected: int
    running: int
    best: str | None

    @classmethod
    def of(cls, study: optuna.Study, loaded: LoadedStudy) -> Standing:
        """Read the standing from storage."""
        trials = study.get_trials(deepcopy=False)
        finished = [t for t in trials if t.state in FINISHED]
        launches = sum(1 for t in finished if is_launch(t))
        return cls(
            launches=launches,
            rejected=len(finished) - launches,
            running=sum(1 for t in trials if t.state == TrialState.RUNNING),
            best=best_line(study, loaded),
        )


def _flags_key(flags: Mapping[str, Any]) -> str:
    return json.dumps(dict(flags), sort_keys=True, default=str)


# ----------------------------------------------------------------------------------------------
# The loop
# ----------------------------------------------------------------------------------------------


class StudyRunner:
    """Runs a study to its budget of launches: ask → screen → claim a slot → launch → tell."""

    def __init__(
        self,
        loaded: LoadedStudy,
        study: optuna.Study,
        trials: Trials,
        *,
        on_event: EventFn,
        on_stale: Callable[[FrozenTrial], None],
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.loaded = loaded
        self.study = study
        """The study, opened with :func:`open_study` (``create=True``) by the caller."""
        self.space = loaded.search_space
        self._trials = trials
        self._on_event = on_event
        self._on_stale = on_stale
        self._clock = clock
        self._sleep = sleep
        self._started = clock()
        self._worker = worker_id()
        self._keys = constraint_keys(loaded)
        self._best = best_line(study, loaded)
        self._recovered_at = clock()
        self._stopped = False

    # -- events ------------------------------------------------------------------------------

    def _emit(
        self,
        kind: Kind,
        text: str,
        trial: int | None = None,
        standing: Standing | None = None,
        data: Mapping[str, Any] | None = None,
    ) -> None:
        standing = standing or Standing.of(self.study, self.loaded)
        self._on_event(
            Event(
                kind=kind,
                text=text,
                trial=trial,
                launches=standing.launches,
                budget=self.loaded.spec.budget.launches,
                elapsed_s=self._clock() - self._started,
                best=standing.best,
                data=dict(data or {}),
                worker=self._worker,
            )
        )

    # -- the loop ----------------------------------------------------------------------------

    def run(self) -> optuna.Study:
        """Run until the budget of launches or the wall time is spent; returns the study."""
        try:
            return self._loop()
        except Interrupted as sig:
            if not self._stopped:  # between trials: nothing to give back
                acknowledge()
                self._emit(
                    Kind.STOPPED, f"interrupted by {sig.name} between trials", data={"signal": sig.name}
                )
            raise

    def _loop(self) -> optuna.Study:
        budget = self.loaded.spec.budget
        faults = self.loaded.spec.faults
        study = self.study
        self._emit(Kind.STARTED, f"tuner {self._worker} started")
        self._recover()
        in_a_row = 0
        while True:
            if self._clock() - self._recovered_at >= RECOVER_EVERY_S:
                self._recover()  # another worker of this host may have died: give its trial back
            standing = Standing.of(study, self.loaded)
            wall_spent = budget.wall_time is not None and self._clock() - self._started >= budget.wall_time
            step: Callable[[], None] = self._one_trial
            if standing.launches >= budget.launches:
                # Finalists are chosen once no trial runs anywhere (a running one could still join them).
                todo = [] if standing.running or wall_spent else pending(study, self.loaded)
                if not todo:
                    self._finish(standing)
                    return study
                step = functools.partial(self._confirm, todo[0])
            elif wall_spent:
                self._emit(Kind.FINISHED, "wall-time budget spent", standing=standing)
                return study
            elif standing.rejected >= budget.rejected_cap:
                message = (
                    f"{standing.rejected} configs were rejected before a launch (budget.max_rejected "
                    f"{budget.rejected_cap}): the search space yields almost only configs that cannot run; "
                    "check it with `autotune validate`"
                )
                self._emit(Kind.STOPPED, message, standing=standing)
                raise StudyError(message)
            elif standing.launches + standing.running >= budget.launches and not self._wait_for_slot():
                continue
            try:
                step()
            except AutotuneError as exc:
                if not exc.transient or in_a_row >= faults.retries:
                    why = f" after {in_a_row} retries" if exc.transient else ""
                    self._emit(Kind.STOPPED, f"stopped{why}: {exc}", data={"error": str(exc)})
                    raise
                pause = min(faults.pause * 2**in_a_row, MAX_FAULT_PAUSE_S)
                in_a_row += 1
                self._emit(
                    Kind.RETRY,
                    f"retry {in_a_row} of {faults.retries} in {pause:g} s after: {exc}",
                    data={"error": str(exc), "pause_s": pause, "retry": in_a_row},
                )
                self._sleep(pause)
            else:
                in_a_row = 0

    def verify(self) -> optuna.Study:
        """Measure every finalist and the defaults once more now, whatever the budget (``autotune
        verify``); returns the study."""
        chosen = finalists(self.study, self.loaded)
        if not chosen:
            raise StudyError(
                "no measured trial meets the SLOs yet (or finalists.count is 0): nothing to verify"
            )
        self._emit(Kind.STARTED, f"tuner {self._worker} measures {len(chosen)} finalists again")
        for trial in chosen:
            self._confirm(trial)
        return self.study

    def _confirm(self, trial: FrozenTrial) -> None:
        """Measure ``trial``'s config again (:mod:`autotune.finalists`) and keep the result on the study."""
        number = trial.number
        flags = TrialRecord.from_trial(trial).flags
        standing = Standing.of(self.study, self.loaded)

        def phase(text: str) -> None:
            self._emit(Kind.PHASE, f"confirming: {text}", trial=number, standing=standing)

        self._emit(
            Kind.PHASE,
            f"measuring the finalist again: {_flags_text(flags)}",
            trial=number,
            standing=standing,
            data={"flags": dict(flags)},
        )
        outcome = self._trials.confirm(number, flags, phase)
        met = outcome.complete and all(c <= 0 for c in outcome.constraints)
        confirmation = Confirmation(
            trial=number,
            values=tuple(outcome.values) if outcome.complete and outcome.values else None,
            cause=outcome.cause.value if outcome.cause else None,
            summary=outcome.summary,
            feasible=met,
            slo_throughput=TrialRecord.from_attrs(outcome.attrs).slo_throughput if met else None,
        )
        with shielded():
            store(self.study, confirmation)
        status = "met the SLOs" if met else f"missed ({outcome.cause or 'SLOs'})"
        self._emit(
            Kind.CONFIRMED,
            f"measured again: {status}: {outcome.summary}",
            trial=number,
            data=confirmation.to_attr(),
        )

    def _finish(self, standing: Standing) -> None:
        elsewhere = standing.running
        if elsewhere:
            text = f"finished here: the budget is spent, {elsewhere} trials still running elsewhere"
        else:
            text = "study finished"
        self._emit(Kind.FINISHED, text, standing=standing, data={"running_elsewhere": elsewhere})

    def _wait_for_slot(self) -> bool:
        """Every slot is held by a running trial: wait until one ends (True: a slot may be free now)."""
        self._sleep(SLOT_POLL_S)
        if self._clock() - self._recovered_at >= RECOVER_EVERY_S:
            self._recover()
        return False

    def _recover(self) -> None:
        """Give back the trials of dead tuners (:func:`recover`) and say so."""
        self._recovered_at = self._clock()
        recovered = recover(self.study, self._on_stale)
        if recovered:
            self._emit(Kind.REQUEUED, f"re-queued interrupted trials {recovered}")

    def _ask(self) -> optuna.Trial:
        try:
            with warnings.catch_warnings():  # we beat the heartbeat ourselves (_heartbeat)
                warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used")
                return self.study.ask()
        except STORAGE_ERRORS as exc:
            raise StorageUnavailableError(f"the study's storage did not answer: {_first_line(exc)}") from exc

    def _one_trial(self) -> None:
        trial = self._ask()
        number = trial.number
        try:
            with _heartbeat(self.study, trial):
                self._run(trial)
        except Interrupted as sig:
            acknowledge()
            self._give_back(trial, f"interrupted by {sig.name}", limit=False)
            self._stopped = True
            self._emit(
                Kind.STOPPED,
                f"interrupted by {sig.name}: trial {number} given back, its config will run again",
                trial=number,
                data={"signal": sig.name},
            )
            raise
        except BaseException as exc:
            self._give_back(trial, f"{type(exc).__name__}: {exc}")
            self._emit(
                Kind.FAULT, f"trial {number} given back: {exc}", trial=number, data={"error": str(exc)}
            )
            raise

    def _give_back(self, trial: optuna.Trial, why: str, *, limit: bool = True) -> None:
        """FAIL ``trial`` with ``why`` and queue its config again (retry first: a death in between then
        leaves a RUNNING trial whose retry exists, never a lost one)."""
        with shielded(), contextlib.suppress(Exception):  # the storage may be what failed: a start recovers
            stored = _frozen(self.study, trial)
            if stored is not None and stored.state == TrialState.RUNNING and not stored.params:
                _fail(self.study, stored, TrialRecord(discarded=f"{why} before its config was drawn"))
            elif stored is not None and stored.state == TrialState.RUNNING:
                last = limit and gives_up(self.study, stored)
                requeue(self.study, stored, limit=limit)
                _fail(self.study, stored, TrialRecord(failed_because=_given_up(why) if last else why))

    def _discard(self, trial: optuna.Trial, why: str) -> None:
        stored = _frozen(self.study, trial)
        if stored is not None:
            with shielded():
                _fail(self.study, stored, TrialRecord(discarded=why))

    def _run(self, trial: optuna.Trial) -> None:
        number = trial.number
        flags = self.space.suggest(trial)
        for key, value in TrialRecord(worker=self._worker, flags=flags).to_attrs().items():
            trial.set_user_attr(key, value)
        same = self._running_elsewhere(trial, flags)
        if same is not None:
            self._discard(trial, f"the same config is running in trial {same}")
            return
        standing = Standing.of(self.study, self.loaded)

        def phase(text: str) -> None:
            self._emit(Kind.PHASE, text, trial=number, standing=standing)

        decision = self._screen(flags)
        if decision.outcome is not None:
            self._tell(trial, decision.outcome)
            return
        refused = self._claim_slot(number, standing)
        if refused is not None:
            self._discard(trial, refused)
            return
        self._emit(
            Kind.TRIAL,
            f"launching {_flags_text(flags)}",
            trial=number,
            standing=standing,
            data={"flags": dict(flags)},
        )
        phase("starting")
        outcome = self._trials.launch(number, flags, decision, phase)
        self._tell(trial, outcome)

    def _screen(self, flags: Mapping[str, FlagValue]) -> Decision:
        """A config already measured, or failed at start, is not launched again; then the trial's own
        screening (known constraints, repeats, the memory model)."""
        key = _flags_key(flags)
        for done in self.study.get_trials(deepcopy=False, states=FINISHED):
            seen = TrialRecord.from_trial(done)
            if _flags_key(seen.flags) != key or not is_launch(done):
                continue
            origin = seen.repeat_of if seen.repeat_of is not None else done.number
            summary = f"not launched: the same config was measured in trial {origin}"
            record = TrialRecord(launched=False, repeat_of=origin)
            if done.state == TrialState.COMPLETE and done.values:
                return Decision(
                    TrialOutcome(
                        None,
                        summary,
                        values=tuple(done.values),
                        constraints=tuple((done.constraints or {}).values()),
                        attrs=record.to_attrs(),
                    )
                )
            cause = seen.cause or Cause.START_FAILED
            return Decision(TrialOutcome(cause, f"{summary} ({cause})", attrs=record.to_attrs()))
        return self._trials.screen(flags)

    def _running_elsewhere(self, trial: optuna.Trial, flags: Mapping[str, FlagValue]) -> int | None:
        key = _flags_key(flags)
        for other in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            if other.number == trial.number:
                continue
            seen = TrialRecord.from_trial(other)
            if seen.flags and _flags_key(seen.flags) == key:
                return other.number
        return None

    def _claim_slot(self, number: int, standing: Standing) -> str | None:
        """Wait until trial ``number`` may launch within the budget (None); or why it must not: the
        budget is spent, or a queued trial (a retry of a dead tuner's trial) needs the slot left. Queued
        trials are asked before new ones, so a worker that gives its new trial up gets the queued one."""
        budget = self.loaded.spec.budget.launches
        told = False
        while True:
            trials = self.study.get_trials(deepcopy=False)
            launches = sum(1 for t in trials if is_launch(t))
            if launches >= budget:
                return "the budget was spent by other workers"
            ahead = sum(
                1
                for t in trials
                if t.state == TrialState.RUNNING
                and t.number < number
                and not TrialRecord.from_trial(t).discarded
            )
            queued = sum(1 for t in trials if t.state == TrialState.WAITING)
            if queued and launches + ahead + queued >= budget:
                return "a queued trial needs the budget's last slots"
            if launches + ahead < budget:
                return None
            if not told:
                self._emit(
                    Kind.PHASE,
                    f"waiting for a budget slot: {ahead} earlier trials are running elsewhere",
                    trial=number,
                    standing=standing,
                )
                told = True
            self._wait_for_slot()

    def _tell(self, trial: optuna.Trial, outcome: TrialOutcome) -> None:
        number = trial.number
        if outcome.complete:
            assert outcome.values is not None
            if any(not math.isfinite(v) for v in outcome.values):
                raise StudyError(f"trial {number} produced non-finite objective values {outcome.values}")
        with shielded():  # the outcome is stored whole or not at all
            record(trial, outcome, self._keys)
            if outcome.complete:
                assert outcome.values is not None
                self.study.tell(trial, list(outcome.values))
            else:
                self.study.tell(trial, state=TrialState.PRUNED)
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
        self._emit(Kind.TRIAL_DONE, f"{status}: {outcome.summary}", trial=number, standing=after, data=data)
        if after.best is not None and after.best != self._best:
            self._best = after.best
            self._emit(Kind.NEW_BEST, f"new best: {after.best}", trial=number, standing=after)


def _flags_text(flags: Mapping[str, FlagValue]) -> str:
    return " ".join(f"{k.replace('_', '-')}={v}" for k, v in flags.items())


def _frozen(study: optuna.Study, trial: optuna.Trial) -> FrozenTrial | None:
    for stored in study.get_trials(deepcopy=False):
        if stored.number == trial.number:
            return stored
    return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


@contextlib.contextmanager
def _heartbeat(study: optuna.Study, trial: optuna.Trial) -> Iterator[None]:
    """Beat the storage's heartbeat for ``trial`` while it runs (database storages; a no-op otherwise).

    Optuna beats only inside ``study.optimize``, on a thread that would keep the process alive if a
    signal fell between its start and its join; this one is a daemon. (A trial's storage id has no
    public accessor: ``_trial_id``.)
    """
    storage = study._storage
    interval = storage.get_heartbeat_interval() if isinstance(storage, BaseHeartbeat) else None
    if not interval:
        yield
        return
    assert isinstance(storage, BaseHeartbeat)
    trial_id = trial._trial_id
    stop = threading.Event()

    def beat() -> None:
        while True:
            with contextlib.suppress(Exception):  # a missed beat is retried; the grace period is long
                storage.record_heartbeat(trial_id)
            if stop.wait(interval):
                return

    thread = threading.Thread(target=beat, name="autotune-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=5.0)


def default_trial(study: optuna.Study) -> FrozenTrial | None:
    """The finished baseline trial (the vLLM defaults), newest first if it was retried."""
    for trial in reversed(study.get_trials(deepcopy=False, states=FINISHED)):
        if TrialRecord.from_trial(trial).baseline:
            return trial
    return None
