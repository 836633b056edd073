"""Giving trials back, and recovering those a dead tuner left: who a tuner is and whether it lives, a
trial failed with the reason and its config queued again (at most ``faults.retries`` times, the baseline
always), the heartbeat beaten while a trial runs, and the stale trials of dead tuners found and given back
(on this host by their worker process, elsewhere by Optuna's heartbeat)."""

from __future__ import annotations

import contextlib
import datetime
import socket
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence

import optuna
import psutil
from optuna.exceptions import UpdateFinishedTrialError
from optuna.trial import FrozenTrial, TrialState

from autotune.interrupts import shielded
from autotune.store import optuna_private
from autotune.store.record import TrialRecord
from autotune.study.finalists import is_ledger
from autotune.study.finalists import requeue as requeue_rerun

ORPHAN_TRIAL_S = 60.0
"""A RUNNING trial that has no worker recorded this long after it started was left by a dead tuner."""


@contextlib.contextmanager
def experimental_ok() -> Iterator[None]:
    """Metric names, heartbeats and stale-trial checks are marked experimental in Optuna; used on purpose."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        yield


def worker_id() -> str:
    """This tuner process as ``host:pid:create_time`` (create_time guards against pid reuse)."""
    me = psutil.Process()
    return f"{socket.gethostname()}:{me.pid}:{me.create_time():.3f}"


def worker_alive(worker: str) -> bool | None:
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


def retries_of(trials: Sequence[FrozenTrial], number: int) -> int:
    """How many times the config of trial ``number`` was tried again already (the chain of retry_of)."""
    by_number = {t.number: TrialRecord.from_trial(t).retry_of for t in trials}
    depth = 0
    seen = {number}
    current = by_number.get(number)
    while current is not None and current not in seen:
        seen.add(current)
        depth += 1
        current = by_number.get(current)
    return depth


def gives_up(study: optuna.Study, trial: FrozenTrial, retries: int) -> bool:
    """Whether ``trial``'s config was given up by the tuner ``retries`` times already (``faults.retries``),
    so that it is not queued again this time. Never for the baseline (vLLM's defaults)."""
    if TrialRecord.from_trial(trial).baseline:
        return False
    return retries_of(study.get_trials(deepcopy=False), trial.number) >= retries


def given_up(why: str, retries: int) -> str:
    return f"{why}; not retried: its config was given up {retries + 1} times (faults.retries is {retries})"


def requeue(study: optuna.Study, trial: FrozenTrial, *, retries: int | None) -> int | None:
    """Queue ``trial``'s config again (``retry_of``), unless a retry exists, it was discarded, or it was
    retried ``retries`` times already (``None``: no limit); returns the number of the queued trial.

    A trial interrupted by a signal is requeued without a limit: stopping a study is not the config's
    fault, however often it happens. The baseline (vLLM's defaults) is requeued without a limit too: every
    gain is measured against it, and the tuner's faults are not the config's."""
    trials = study.get_trials(deepcopy=False)
    record = TrialRecord.from_trial(trial)
    if record.discarded or any(TrialRecord.from_trial(t).retry_of == trial.number for t in trials):
        return None
    limited = retries is not None and not record.baseline
    if not trial.params or (limited and retries_of(trials, trial.number) >= (retries or 0)):
        return None
    attrs = TrialRecord(baseline=record.baseline, retry_of=trial.number).to_attrs()
    optuna_private.queue(study, trial.params, trial.distributions, attrs)
    queued = [
        t for t in study.get_trials(deepcopy=False) if TrialRecord.from_trial(t).retry_of == trial.number
    ]
    return queued[0].number if queued else None


def requeue_stale(study: optuna.Study, trial: FrozenTrial, *, retries: int) -> None:
    """Optuna's heartbeat callback: this tuner failed ``trial`` (its tuner went silent): queue it again
    (at most ``retries`` times, ``faults.retries``; a rerun of the finalists' ledger as a rerun)."""
    if is_ledger(study):
        requeue_rerun(study, trial)
    else:
        requeue(study, trial, retries=retries)


def fail(study: optuna.Study, trial: FrozenTrial, record: TrialRecord) -> bool:
    """Mark a RUNNING trial FAIL with ``record``'s facts; False when another process already ended it
    (the state change is atomic in the storage, so exactly one process wins)."""
    try:
        optuna_private.set_user_attrs(study, trial, record.to_attrs())
        return optuna_private.fail(study, trial)
    except UpdateFinishedTrialError:
        return False


def abandoned(trial: FrozenTrial, now: datetime.datetime) -> bool:
    """Whether a RUNNING trial was left by a tuner that died on this host (a tuner elsewhere is taken to
    live: Optuna's heartbeat fails its trials, :func:`recover`)."""
    worker = TrialRecord.from_trial(trial).worker
    if worker is None:
        # A tuner records itself on its trial right after asking for it: a trial without a worker for a
        # minute belongs to a tuner that died in between (it has no heartbeat either).
        started = trial.datetime_start
        return started is not None and (now - started).total_seconds() >= ORPHAN_TRIAL_S
    return worker_alive(worker) is False


def recover(study: optuna.Study, on_stale: Callable[[FrozenTrial], None], retries: int) -> list[int]:
    """Fail trials left RUNNING by a tuner that died on this host (``on_stale`` first, to kill its
    orphaned server) or, through Optuna's heartbeat, anywhere; queue their configs again (each at most
    ``retries`` times, ``faults.retries``; the baseline always).

    Returns the numbers of the trials given back.
    """
    with experimental_ok():  # heartbeat: calls requeue_stale for what this process failed
        optuna.storages.fail_stale_trials(study)
    recovered = []
    now = datetime.datetime.now()
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if not abandoned(trial, now):
            continue
        on_stale(trial)
        why = "the tuner running it died"
        with shielded():
            if not trial.params:
                if fail(study, trial, TrialRecord(discarded=f"{why} before its config was drawn")):
                    recovered.append(trial.number)
                continue
            last = gives_up(study, trial, retries)
            if fail(study, trial, TrialRecord(failed_because=given_up(why, retries) if last else why)):
                requeue(study, trial, retries=retries)
                recovered.append(trial.number)
    return recovered


def stored_trial(study: optuna.Study, trial: optuna.Trial) -> FrozenTrial | None:
    for stored in study.get_trials(deepcopy=False):
        if stored.number == trial.number:
            return stored
    return None


@contextlib.contextmanager
def heartbeat(study: optuna.Study, trial: optuna.Trial) -> Iterator[None]:
    """Beat the storage's heartbeat for ``trial`` while it runs (database storages; a no-op otherwise).

    Optuna beats only inside ``study.optimize``, on a thread that would keep the process alive if a
    signal fell between its start and its join; this one is a daemon.
    """
    interval = optuna_private.heartbeat_interval(study)
    if not interval:
        yield
        return
    stop = threading.Event()

    def beat() -> None:
        while True:
            with contextlib.suppress(Exception):  # a missed beat is retried; the grace period is long
                optuna_private.beat(study, trial)
            if stop.wait(interval):
                return

    thread = threading.Thread(target=beat, name="autotune-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=5.0)
