"""Optuna wiring: storage, sampler, objectives, constraints, outcome recording, resume and retries.

Why TPE and PRUNED: crashes and OOMs are recorded as PRUNED trials with their cause. Of Optuna 5's
samplers, TPE is the one that learns from PRUNED trials (they join its "bad" density), so the search
moves away from crash regions without inventing objective values for crashed configs (docs/optuna.md:
a crash recorded as FAIL pulls TPE *into* the crash region; GPSampler and NSGA-II ignore PRUNED). TPE is
Optuna 5's default for multi-objective studies, with ``constant_liar`` for parallel workers. Random and
NSGA-II are offered for comparison; GPSampler when torch is installed.

Resume: the study lives in storage (SQLite by default). A trial left RUNNING by a tuner that was killed
on this host is noticed at the next start (its worker process is gone), its server's process group is
killed, the trial is marked FAIL and re-queued with the same flags; on other hosts Optuna's heartbeat
does the same after the grace period. FAIL never counts toward the trial budget: only COMPLETE and
PRUNED do, so no trial is lost or counted twice.
"""

from __future__ import annotations

import contextlib
import math
import socket
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import optuna
import psutil
from optuna.storages import RetryHeartbeatStaleTrialCallback
from optuna.trial import FrozenTrial, TrialState

from autotune.errors import StudyError
from autotune.loader import LoadedStudy
from autotune.outcome import TrialOutcome
from autotune.record import TrialRecord, outcome_attrs
from autotune.spec import FlagValue, SamplerSpec
from autotune.storage import MAX_RETRIES, open_storage

FINISHED = (TrialState.COMPLETE, TrialState.PRUNED)

TrialFn = Callable[[int, Mapping[str, FlagValue], Callable[[str], None]], TrialOutcome]
"""Runs one trial: (trial number, flags, phase callback) → outcome. Raises on the tuner's own faults."""


@dataclass(frozen=True)
class Progress:
    """A progress event for the CLI: where the study is and the best feasible result so far."""

    trial: int | None
    finished: int
    budget: int
    phase: str
    elapsed_s: float
    best: str | None


ProgressFn = Callable[[Progress], None]


@contextlib.contextmanager
def _experimental_ok() -> Iterator[None]:
    """Heartbeats and the retry callback are marked experimental in Optuna; we use them on purpose."""
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


def make_sampler(spec: SamplerSpec, history: int = 0) -> optuna.samplers.BaseSampler:
    """Build the configured sampler (see the module docstring for why TPE is the default).

    ``history`` is the number of trials already stored: a resumed study seeds its sampler with
    ``seed + history``, so a rerun continues the random stream instead of replaying it (a replay
    would suggest the configs of the interrupted run again). Still deterministic given the history.
    """
    if spec.seed is not None and history:
        spec = spec.model_copy(update={"seed": spec.seed + history})
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


def open_study(loaded: LoadedStudy, *, create: bool, heartbeat: bool = True) -> optuna.Study:
    """Open the study in storage; with ``create`` make it (and check a resumed one matches the spec)."""
    spec = loaded.spec
    storage = open_storage(loaded.storage_url, heartbeat=heartbeat)
    sampler = make_sampler(spec.sampler)
    name = spec.study.name
    objectives = [o.metric for o in spec.objectives]
    try:
        if not create:
            study = optuna.load_study(study_name=name, storage=storage, sampler=sampler)
        else:
            study = optuna.create_study(
                study_name=name,
                storage=storage,
                sampler=sampler,
                directions=[o.direction for o in spec.objectives],
                load_if_exists=True,
            )
    except KeyError as exc:
        raise StudyError(
            f"no study named {name!r} in {loaded.storage_url}: run `autotune tune` first"
        ) from exc
    except ValueError as exc:
        raise StudyError(f"study {name!r} in {loaded.storage_url} does not match the spec: {exc}") from exc
    history = len(study.get_trials(deepcopy=False))
    if history:
        study.sampler = make_sampler(spec.sampler, history)
    stored = study.user_attrs.get("objectives")
    if stored is None and create:
        study.set_user_attr("objectives", objectives)
        study.set_user_attr("slo", [str(t) for t in spec.slo.terms])
        study.set_user_attr("params", list(loaded.space.params))
    elif stored is not None and stored != objectives:
        raise StudyError(
            f"study {name!r} was created with objectives {stored}, the spec now says {objectives}: "
            "use a new study name"
        )
    return study


def finished_trials(study: optuna.Study) -> list[FrozenTrial]:
    """COMPLETE and PRUNED trials: the ones the budget counts."""
    return study.get_trials(deepcopy=False, states=FINISHED)


def recover(study: optuna.Study, on_stale: Callable[[FrozenTrial], None]) -> list[int]:
    """Fail trials left RUNNING by a dead tuner on this host and re-queue every unretried FAIL.

    ``on_stale`` is called for each such trial before it is failed (to kill its orphaned server).
    Returns the numbers of the trials re-queued.
    """
    storage = study._storage
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if _worker_alive(TrialRecord.from_trial(trial).worker or "") is False:
            on_stale(trial)
            for key, value in TrialRecord(failed_because="the tuner running it died").to_attrs().items():
                storage.set_trial_user_attr(trial._trial_id, key, value)
            storage.set_trial_state_values(trial._trial_id, TrialState.FAIL)
    trials = study.get_trials(deepcopy=False)
    requeued = []
    with _experimental_ok():
        retried: set[int] = set()
        for trial in trials:
            retried.update(RetryHeartbeatStaleTrialCallback.retry_history(trial))
        retry = RetryHeartbeatStaleTrialCallback(max_retry=MAX_RETRIES)
        for trial in trials:
            if trial.state == TrialState.FAIL and trial.number not in retried:
                before = len(study.get_trials(deepcopy=False))
                retry(study, trial)
                if len(study.get_trials(deepcopy=False)) > before:
                    requeued.append(trial.number)
    return requeued


def constraint_keys(loaded: LoadedStudy) -> list[str]:
    """Names of a trial's constraints, in order: each SLO term, then the error budget."""
    return [f"slo {term}" for term in loaded.spec.slo.terms] + ["error budget"]


def record(trial: optuna.Trial, outcome: TrialOutcome, keys: Sequence[str]) -> None:
    """Store an outcome's cause, summary, constraints and facts on the trial (before it is told)."""
    for key, value in {**outcome.attrs, **outcome_attrs(outcome.cause, outcome.summary)}.items():
        trial.set_user_attr(key, value)
    if outcome.constraints:
        if len(outcome.constraints) != len(keys):
            raise StudyError(f"trial {trial.number}: {len(outcome.constraints)} constraints for {list(keys)}")
        for key, value in zip(keys, outcome.constraints, strict=True):
            trial.set_constraint(key, float(value))


def best_line(study: optuna.Study, loaded: LoadedStudy) -> str | None:
    """A one-line summary of the best feasible trial by the first objective."""
    objective = loaded.spec.objectives[0]
    complete = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)) if t.values]
    feasible = [t for t in complete if all(c <= 0 for c in (t.constraints or {}).values())]
    if not feasible:
        return None
    sign = 1 if objective.direction == "maximize" else -1
    best = max(feasible, key=lambda t: sign * t.values[0])
    return f"trial {best.number}: {objective.metric}={best.values[0]:.4g}"


class StudyRunner:
    """Runs a study to its budget: ask → run one trial → record → tell, with resume and progress."""

    def __init__(
        self,
        loaded: LoadedStudy,
        study: optuna.Study,
        run_trial: TrialFn,
        *,
        on_progress: ProgressFn,
        on_stale: Callable[[FrozenTrial], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.loaded = loaded
        self.study = study
        """The study, opened with :func:`open_study` (``create=True``) by the caller."""
        self.space = loaded.search_space
        self._run_trial = run_trial
        self._on_progress = on_progress
        self._on_stale = on_stale
        self._clock = clock
        self._started = clock()
        self._worker = worker_id()

    def run(self) -> optuna.Study:
        """Run until the trial budget or the wall-time budget is spent; returns the study."""
        budget = self.loaded.spec.budget
        study = self.study
        requeued = recover(study, self._on_stale)
        if requeued:
            self._emit(study, None, f"re-queued interrupted trials {requeued}")
        study.enqueue_trial(
            self.space.defaults(), user_attrs=TrialRecord(baseline=True).to_attrs(), skip_if_exists=True
        )
        remaining = budget.trials - len(finished_trials(study))
        if remaining <= 0:
            self._emit(study, None, "trial budget already spent")
            return study
        callbacks = [optuna.study.MaxTrialsCallback(budget.trials, states=FINISHED)]
        with _experimental_ok():
            study.optimize(
                lambda trial: self._objective(study, trial),
                callbacks=callbacks,
                timeout=budget.wall_time,
                gc_after_trial=False,
                catch=(),
            )
        self._emit(study, None, "study finished")
        return study

    def _objective(self, study: optuna.Study, trial: optuna.Trial) -> Sequence[float]:
        flags = self.space.suggest(trial)
        for key, value in TrialRecord(worker=self._worker, flags=flags).to_attrs().items():
            trial.set_user_attr(key, value)

        standing = self._standing(study)  # read once per trial, not on every progress line

        def phase(text: str) -> None:
            self._emit(study, trial.number, text, standing)

        phase("starting")
        outcome = self._run_trial(trial.number, flags, phase)
        record(trial, outcome, constraint_keys(self.loaded))
        if not outcome.complete:
            assert outcome.cause is not None
            phase(f"pruned ({outcome.cause.value}): {outcome.summary}")
            raise optuna.TrialPruned(f"{outcome.cause.value}: {outcome.summary}")
        assert outcome.values is not None
        if any(not math.isfinite(v) for v in outcome.values):
            raise StudyError(f"trial {trial.number} produced non-finite objective values {outcome.values}")
        phase("complete: " + outcome.summary)
        return list(outcome.values)

    def _standing(self, study: optuna.Study) -> tuple[int, str | None]:
        """Finished trials and the best feasible result, from storage."""
        return len(finished_trials(study)), best_line(study, self.loaded)

    def _emit(
        self,
        study: optuna.Study,
        number: int | None,
        text: str,
        standing: tuple[int, str | None] | None = None,
    ) -> None:
        finished, best = standing if standing is not None else self._standing(study)
        self._on_progress(
            Progress(
                trial=number,
                finished=finished,
                budget=self.loaded.spec.budget.trials,
                phase=text,
                elapsed_s=self._clock() - self._started,
                best=best,
            )
        )


def default_trial(study: optuna.Study) -> FrozenTrial | None:
    """The finished baseline trial (the vLLM defaults), newest first if it was retried."""
    for trial in reversed(study.get_trials(deepcopy=False, states=FINISHED)):
        if TrialRecord.from_trial(trial).baseline:
            return trial
    return None
