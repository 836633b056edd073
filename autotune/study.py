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
FAIL with ``failed_because`` and its config is queued again (``retry_of``), at most ``faults.retries``
times: the number of retries of a passing fault in a row, so a fault that passes before the study stops
never costs the config it hit. vLLM's defaults are the exception: the baseline is queued again however
often the tuner gave it up, and a tuner that finds no baseline measured, running or queued (while
launches are left) queues it again (:func:`ensure_baseline`), so the defaults are always measured
eventually. A trial dropped before launch (budget spent elsewhere, the same config running elsewhere) is
FAIL with ``discarded`` and never retried. A trial left RUNNING by a tuner that died on this host is failed
at the next start (its worker process is gone) and its orphaned server killed; on other hosts Optuna's
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
import functools
import hashlib
import math
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import optuna
import sqlalchemy.exc
from optuna.trial import FrozenTrial, TrialState

from autotune import optuna_private
from autotune.defaults import check_defaults
from autotune.errors import AutotuneError, Interrupted, StorageUnavailableError, StudyError
from autotune.events import Event, Kind
from autotune.feasibility import Decision
from autotune.finalists import (
    gain,
    ledger,
    pending,
    pick,
    verdict,
)
from autotune.finalists import reruns as reruns_of
from autotune.interrupts import acknowledge, shielded
from autotune.loader import LoadedStudy
from autotune.outcome import Cause, TrialOutcome
from autotune.record import (
    TrialRecord,
    named_constraints,
    outcome_attrs,
    save_record,
    set_constraints,
    stored_attrs,
)
from autotune.recovery import (
    experimental_ok,
    fail,
    given_up,
    gives_up,
    heartbeat,
    recover,
    requeue,
    requeue_stale,
    stored_trial,
    worker_id,
)
from autotune.rerun_stage import Confirms, RerunStage, flags_text
from autotune.server.effective import Effective
from autotune.spec import FlagValue, SamplerSpec
from autotune.standing import FINISHED, Standing, best_line, is_launch
from autotune.storage import (
    StorageFacts,
    close_storage,
    create_or_load_study,
    inspect_storage,
    open_storage,
    queue_lock,
    recovery_lock,
    redact_url,
    storage_errors,
    storage_failure,
)
from autotune.surrogate.propose import Proposer, track_record
from autotune.units import format_figure

SLOT_POLL_S = 2.0
"""How often a worker waiting for a budget slot looks again."""
RECOVER_EVERY_S = 15.0
"""While waiting, how often a worker looks for trials whose tuner died."""
MAX_FAULT_PAUSE_S = 600.0
STORAGE_ERRORS = (sqlalchemy.exc.OperationalError, sqlalchemy.exc.InterfaceError, OSError)
"""What a storage that does not answer raises (a database restarting, a lost connection)."""

Phase = Callable[[str], None]
EventFn = Callable[[Event], None]


class Trials(Confirms, Protocol):
    """What the study loop asks of a study's trials (:class:`autotune.trial.TrialRunner`): a screen and a
    launch, and measuring a finalist again (:class:`autotune.rerun_stage.Confirms`)."""

    def screen(self, flags: Mapping[str, FlagValue]) -> Decision:
        """Decide before a launch: an outcome when the config must not be launched (rejected)."""
        ...

    def launch(
        self,
        number: int,
        flags: Mapping[str, FlagValue],
        decision: Decision,
        phase: Phase,
        *,
        baseline: bool = False,
    ) -> TrialOutcome:
        """Launch the server with ``flags`` (``baseline``: with none of the tuned flags, its record holding
        what the server reported), measure, tear down; raise on the tuner's own faults."""
        ...


def sampler_seed(seed: int | None, *, history: int, identity: str) -> int | None:
    """The seed of a tuner's sampler: ``seed`` (``sampler.seed``) mixed with the number of trials already
    stored (``history``) and the tuner's ``identity`` (host, pid, start time and label: no two tuners
    share one), through SHA-256, as a 32-bit number. ``None`` stays unseeded.

    Each tuner on a study thus draws its own configs (two tuners seeded alike draw the same ones, and
    every draw of the second would be wasted as a repeat), and a resumed study continues the random
    stream instead of replaying the interrupted run's configs."""
    if seed is None:
        return None
    digest = hashlib.sha256(f"{seed}|{history}|{identity}".encode()).digest()
    return int.from_bytes(digest[:4], "big")


def make_sampler(spec: SamplerSpec, seed: int | None = None) -> optuna.samplers.BaseSampler:
    """Build the configured sampler (see the module docstring for why TPE is the default), seeded with
    ``seed`` when given, else with ``sampler.seed``."""
    if seed is not None:
        spec = spec.model_copy(update={"seed": seed})
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
    """Close the database connections of a study from :func:`open_study`."""
    close_storage(optuna_private.connections(study))


def open_study(loaded: LoadedStudy, *, create: bool, heartbeat: bool = True, label: str = "") -> optuna.Study:
    """Open the study in storage. With ``create`` make it when new (only the process that creates it
    stores its objectives and queues the vLLM defaults as the baseline trial) and check that a stored one
    matches the spec; without, a missing study is a :class:`StudyError`.

    A study is never made anew beside the trial folders of an earlier one (``<workdir>/trials``: their
    logs and probe files would be overwritten): when the folder holds trials, the storage must hold the
    study, or nothing is opened or written (a storage emptied, replaced or pointed elsewhere). A damaged
    storage file is refused before it is opened (:func:`autotune.storage.open_storage`).
    """
    spec = loaded.spec
    folders = trial_folders(loaded)  # first: trial folders exist only once the study does
    if folders or not create:  # read-only first: nothing is created for a study that is not there
        facts = inspect_study_storage(loaded, folders)
        if facts.trials is None and facts.readable and not create:
            shown = redact_url(loaded.storage_url)
            raise StudyError(f"no study named {spec.study.name!r} in {shown}: run `autotune tune` first")
    stale = functools.partial(requeue_stale, retries=spec.faults.retries)
    with storage_errors(loaded.storage_url):
        storage = open_storage(loaded.storage_url, heartbeat=heartbeat, on_stale=stale if heartbeat else None)
    try:
        with storage_errors(loaded.storage_url):
            return _open(loaded, storage, create=create, label=label, folders=folders)
    except BaseException:
        close_storage(storage)
        raise


def inspect_study_storage(loaded: LoadedStudy, folders: int | None = None) -> StorageFacts:
    """The study's storage as :func:`autotune.storage.inspect_storage` sees it (read-only); a
    :class:`StudyError` when the study's folder holds trial folders (``folders``, counted when None) but
    the storage holds no such study: a run would start a new study over their files."""
    facts = inspect_storage(loaded.storage_url, loaded.spec.study.name, loaded.storage_field)
    folders = trial_folders(loaded) if folders is None else folders
    if folders and facts.trials is None and facts.readable:
        raise StudyError(_not_the_study(loaded, folders))
    return facts


def trial_folders(loaded: LoadedStudy) -> int:
    """How many trial folders (``<workdir>/trials/<number>``) the study's folder holds."""
    try:
        return sum(1 for p in (loaded.workdir / "trials").iterdir() if p.name.isdigit() and p.is_dir())
    except OSError:  # no folder yet (or none readable: the storage decides)
        return 0


def _not_the_study(loaded: LoadedStudy, folders: int) -> str:
    shown = redact_url(loaded.storage_url)
    return (
        f"storage {shown} holds no study {loaded.spec.study.name!r}, but {str(loaded.workdir)!r} holds "
        f"{folders} trial folders of one: the storage was emptied, replaced, or is not the study's "
        f"({loaded.storage_field}); nothing was written: point it at the study's storage, or move the "
        "folder aside to start a new study"
    )


def _open(
    loaded: LoadedStudy, storage: optuna.storages.BaseStorage, *, create: bool, label: str, folders: int
) -> optuna.Study:
    spec = loaded.spec
    shown = redact_url(loaded.storage_url)
    name = spec.study.name
    objectives = [o.metric for o in spec.objectives]
    sampler = make_sampler(spec.sampler)
    created = False
    try:
        if create and not folders:
            study, created = create_or_load_study(
                storage, name, [o.direction for o in spec.objectives], sampler
            )
        else:
            study = optuna.load_study(study_name=name, storage=storage, sampler=sampler)
    except KeyError as exc:
        if folders:
            raise StudyError(_not_the_study(loaded, folders)) from exc
        raise StudyError(f"no study named {name!r} in {shown}: run `autotune tune` first") from exc
    except ValueError as exc:
        raise StudyError(f"study {name!r} in {shown} does not match the spec: {exc}") from exc
    if created:
        with experimental_ok():
            study.set_metric_names(objectives)
        study.set_user_attr("objectives", objectives)
        study.set_user_attr("slo", [str(t) for t in spec.slo.terms])
        study.set_user_attr("constraints", constraint_keys(loaded))  # the names of each trial's list
        study.set_user_attr("params", list(loaded.space.params))
        enqueue_baseline(study, loaded)
    else:
        stored = study.user_attrs.get("objectives")
        if stored is not None and stored != objectives:
            raise StudyError(
                f"study {name!r} was created with objectives {stored}, the spec now says {objectives}: "
                "use a new study name"
            )
        directions = [d.name.lower() for d in study.directions]
        wanted = [o.direction for o in spec.objectives]
        if create and directions != wanted:
            raise StudyError(
                f"study {name!r} was created with directions {directions}, the spec asks for {wanted}: "
                "use a new study name"
            )
    if not created:  # the creator keeps sampler.seed: one tuner on a new study is reproducible
        history = len(study.get_trials(deepcopy=False))
        identity = f"{worker_id()}|{label}"
        study.sampler = make_sampler(
            spec.sampler, sampler_seed(spec.sampler.seed, history=history, identity=identity)
        )
    return study


def enqueue_baseline(study: optuna.Study, loaded: LoadedStudy) -> None:
    """Queue the vLLM defaults as the baseline trial (once: the study's creator does it)."""
    study.enqueue_trial(
        dict(loaded.search_space.defaults()),
        user_attrs=TrialRecord(baseline=True).to_attrs(),
        skip_if_exists=True,
    )


# ----------------------------------------------------------------------------------------------
# The baseline: vLLM's defaults, queued again while none is measured, running or queued
# ----------------------------------------------------------------------------------------------


def ensure_baseline(study: optuna.Study, loaded: LoadedStudy) -> int | None:
    """Queue vLLM's defaults again when the study has none measured, running or queued, but launches
    left: its baseline trials were all given up (by a tuner of an earlier version, or dropped before their
    config was drawn), or its creator died before queueing it. Returns the number of the queued trial.

    A new study without trials is left alone (its creator queues the baseline: :func:`enqueue_baseline`).
    """
    trials = study.get_trials(deepcopy=False)
    baselines = [t for t in trials if TrialRecord.from_trial(t).baseline]
    if not trials or any(t.state != TrialState.FAIL for t in baselines):
        return None
    launches = sum(1 for t in trials if is_launch(t))
    running = sum(1 for t in trials if t.state == TrialState.RUNNING)
    if launches + running >= loaded.spec.budget.launches:
        return None
    last = baselines[-1] if baselines else None
    retried = last is not None and any(TrialRecord.from_trial(t).retry_of == last.number for t in trials)
    retry_of = None if last is None or retried or TrialRecord.from_trial(last).discarded else last.number
    study.enqueue_trial(
        dict(loaded.search_space.defaults()),
        user_attrs=TrialRecord(baseline=True, retry_of=retry_of).to_attrs(),
    )
    queued = [t for t in study.get_trials(deepcopy=False) if t.state == TrialState.WAITING]
    return queued[-1].number if queued else None


# ----------------------------------------------------------------------------------------------
# Recording outcomes
# ----------------------------------------------------------------------------------------------


def constraint_keys(loaded: LoadedStudy) -> list[str]:
    """Names of a trial's constraints, in order: each SLO term, then the error budget."""
    return [f"slo {term}" for term in loaded.spec.slo.terms] + ["error budget"]


def record(
    trial: optuna.Trial,
    outcome: TrialOutcome,
    keys: Sequence[str],
    loaded: LoadedStudy,
    *,
    named: bool = False,
) -> None:
    """Store an outcome's facts, cause, summary and constraints on the trial (before it is told): each
    attribute within optuna-dashboard's limit, the whole record in the trial's folder when one was
    shortened (:func:`autotune.record.stored_attrs`); constraints as :func:`autotune.record.set_constraints`
    writes them (``named``: the study already has Optuna 5's named constraints)."""
    attrs = {**outcome.attrs, **outcome_attrs(outcome.cause, outcome.summary)}
    stored, shortened = stored_attrs(attrs)
    if shortened:
        stored.update(save_record(loaded.trial_dir(trial.number), loaded.workdir, attrs))
    for key, value in stored.items():
        trial.set_user_attr(key, value)
    if outcome.constraints:
        if len(outcome.constraints) != len(keys):
            raise StudyError(f"trial {trial.number}: {len(outcome.constraints)} constraints for {list(keys)}")
        set_constraints(trial, keys, outcome.constraints, named=named)


def _fixed_params(study: optuna.Study, trial: optuna.Trial) -> list[str]:
    """The names of the params queued with ``trial``."""
    stored = stored_trial(study, trial)
    return list(optuna_private.queued_params(stored)) if stored is not None else []


def _with_fixed(study: optuna.Study, trial: optuna.Trial, values: Mapping[str, FlagValue]) -> optuna.Trial:
    """``trial`` with ``values`` added to its queued params, so that the next suggestions return them."""
    return optuna_private.fix_params(study, trial, stored_trial(study, trial), values)


def _effective(reported: Mapping[str, Any] | None) -> Effective:
    """The stored ``reported_defaults`` back as :class:`~autotune.server.effective.Effective`."""
    values = {k: v for k, v in (reported or {}).items() if k != "_source"}
    sources = (reported or {}).get("_source")
    return Effective(values, dict(sources) if isinstance(sources, Mapping) else {})


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
        proposer: Proposer | None = None,
    ) -> None:
        self.loaded = loaded
        self._proposer = proposer
        """Proposes each launch from the calibrated surrogate until it hands over (None: the sampler)."""
        self._said_handed_over = False
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
        self._named = named_constraints(study.get_trials(deepcopy=False))
        """The study was made with Optuna 5's named constraints: its new trials keep them."""
        self._best = best_line(study, loaded)
        self._recovered_at = clock()
        self._stopped = False
        self.reruns = RerunStage(
            loaded,
            study,
            trials,
            self._worker,
            self._emit,
            lambda number, after, confirmed, notify: self._new_best(
                number, after, confirmed=confirmed, notify=notify
            ),
        )
        """The finalists' reruns once the search is done (and ``verify``'s round)."""

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
                running=standing.running,
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
            with storage_errors(self.loaded.storage_url, self.loaded.workdir):
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
                rerun = None if standing.running or wall_spent else self.reruns.next(first=True)
                if rerun is None:
                    self._finish(standing)
                    return study
                step = functools.partial(self.reruns.confirm, *rerun)
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
                with storage_errors(self.loaded.storage_url, self.loaded.workdir):
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
                    f"retry {in_a_row} of {faults.retries} in {format_figure(pause, 's')} after: {exc}",
                    data={"error": str(exc), "pause_s": pause, "retry": in_a_row},
                )
                self._sleep(pause)
            else:
                in_a_row = 0

    def verify(self) -> optuna.Study:
        """Measure every finalist and the defaults in one more round now, whatever the budget (``autotune
        verify``); returns the study."""
        with storage_errors(self.loaded.storage_url, self.loaded.workdir):
            return self.reruns.verify()

    def _finish(self, standing: Standing) -> None:
        elsewhere = standing.running
        reruns = pending(ledger(self.study))[1] if self.loaded.spec.finalists.count else 0
        if elsewhere:
            text = f"finished here: the budget is spent, {elsewhere} trials still running elsewhere"
        elif reruns:
            text = f"finished here: {reruns} finalists are being measured again elsewhere"
        else:
            table = reruns_of(self.study)
            chosen = pick(self.study, self.loaded, table)
            base = default_trial(self.study)
            answer = verdict(chosen, gain(table, chosen.trial, base), base) if chosen else None
            text = f"study finished: {answer}" if answer else "study finished: no config met the SLOs"
        self._emit(
            Kind.FINISHED,
            text,
            standing=standing,
            data={"running_elsewhere": elsewhere, "reruns_elsewhere": reruns},
        )

    def _wait_for_slot(self) -> bool:
        """Every slot is held by a running trial: wait until one ends (True: a slot may be free now)."""
        self._sleep(SLOT_POLL_S)
        if self._clock() - self._recovered_at >= RECOVER_EVERY_S:
            self._recover()
        return False

    def _recover(self) -> None:
        """Give back the trials of dead tuners (:func:`recover`) and queue the defaults again if the
        study has lost them (:func:`ensure_baseline`); say so."""
        self._recovered_at = self._clock()
        with recovery_lock(self.loaded.storage_url):
            recovered = recover(self.study, self._on_stale, self.loaded.spec.faults.retries)
            baseline = ensure_baseline(self.study, self.loaded)
        if recovered:
            self._emit(Kind.REQUEUED, f"re-queued interrupted trials {recovered}")
        if baseline is not None:
            self._emit(
                Kind.REQUEUED,
                f"vLLM's defaults were never measured (given up before): queued again as trial {baseline}",
                trial=baseline,
            )

    def _ask(self) -> optuna.Trial:
        try:
            with warnings.catch_warnings():  # we beat the heartbeat ourselves (heartbeat)
                warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used")
                with queue_lock(self.loaded.storage_url):
                    return self.study.ask()
        except Exception as exc:
            failure = storage_failure(exc, self.loaded.storage_url, self.loaded.workdir)
            if failure is not None:
                raise failure from exc
            if isinstance(exc, STORAGE_ERRORS):
                raise StorageUnavailableError(
                    f"the study's storage did not answer: {_first_line(exc)}"
                ) from exc
            raise

    def _one_trial(self) -> None:
        trial: optuna.Trial | None = None
        try:
            handed_over = self._propose()
            # A signal while the storage makes the trial is held until the trial exists, then it is given
            # back (cut short, it left a RUNNING trial with no worker that stalled the next run a minute).
            with shielded():
                trial = self._ask()
                for key, value in (handed_over.to_attrs() if handed_over else {}).items():
                    trial.set_user_attr(key, value)
            with heartbeat(self.study, trial):
                self._run(trial)
        except Interrupted as sig:
            if trial is None:
                raise
            number = trial.number
            acknowledge()
            self._give_back(trial, f"interrupted by {sig.name}", retries=None)
            self._stopped = True
            self._emit(
                Kind.STOPPED,
                f"interrupted by {sig.name}: trial {number} given back, its config will run again",
                trial=number,
                data={"signal": sig.name},
            )
            raise
        except BaseException as exc:
            if trial is None:  # the storage did not make the trial: nothing to give back
                raise
            number = trial.number
            self._give_back(trial, f"{type(exc).__name__}: {exc}", retries=self.loaded.spec.faults.retries)
            self._emit(
                Kind.FAULT, f"trial {number} given back: {exc}", trial=number, data={"error": str(exc)}
            )
            raise

    def _propose(self) -> TrialRecord | None:
        """Queue the surrogate's proposal for the next ask, unless a config is queued already (the
        defaults, a retry) or the surrogate has handed over (said once). When its fit turns out off even
        from the prior it hands over now: the record returned says why, for the trial the sampler draws."""
        if self._proposer is None:
            return None
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

    def _give_back(self, trial: optuna.Trial, why: str, *, retries: int | None) -> None:
        """FAIL ``trial`` with ``why`` and queue its config again, at most ``retries`` times (None: no
        limit) (retry first: a death in between then leaves a RUNNING trial whose retry exists, never a
        lost one)."""
        with shielded(), contextlib.suppress(Exception):  # the storage may be what failed: a start recovers
            stored = stored_trial(self.study, trial)
            if stored is not None and stored.state == TrialState.RUNNING and not stored.params:
                fail(self.study, stored, TrialRecord(discarded=f"{why} before its config was drawn"))
            elif stored is not None and stored.state == TrialState.RUNNING:
                last = retries is not None and gives_up(self.study, stored, retries)
                requeue(self.study, stored, retries=retries)
                failed = given_up(why, retries) if last and retries is not None else why
                fail(self.study, stored, TrialRecord(failed_because=failed))

    def _discard(self, trial: optuna.Trial, why: str) -> None:
        stored = stored_trial(self.study, trial)
        if stored is not None:
            with shielded():
                fail(self.study, stored, TrialRecord(discarded=why))

    def _run(self, trial: optuna.Trial) -> None:
        number = trial.number
        baseline = bool(TrialRecord.from_attrs(trial.user_attrs).baseline)
        # vLLM's defaults: the values queued (the space's declared defaults, or a retried trial's) now,
        # the others once the server has reported them (autotune/defaults.py).
        fixed = _fixed_params(self.study, trial) if baseline else None
        flags = self.space.suggest(trial, names=fixed)
        for key, value in TrialRecord(worker=self._worker, flags=flags).to_attrs().items():
            trial.set_user_attr(key, value)
        if baseline:
            other = baseline_elsewhere(self.study.get_trials(deepcopy=False), number)
            if other is not None:
                self._discard(trial, f"vLLM's defaults are measured in trial {other}")
                return
        else:
            same = self._running_elsewhere(trial, flags)
            if same is not None:
                self._discard(trial, f"the same config is running in trial {same}")
                return
        standing = Standing.of(self.study, self.loaded)

        def phase(text: str) -> None:
            self._emit(Kind.PHASE, text, trial=number, standing=standing)

        # The defaults' trial is never screened: it is what vLLM does when given no flag.
        decision = Decision(None) if baseline else self._screen(flags)
        if decision.outcome is not None:
            self._tell(trial, decision.outcome)
            return
        refused = self._claim_slot(number, standing)
        if refused is not None:
            self._discard(trial, refused)
            return
        shown = "vLLM's defaults (no tuned flag)" if baseline else flags_text(flags)
        self._emit(
            Kind.TRIAL,
            f"launching {shown}",
            trial=number,
            standing=standing,
            data={"flags": dict(flags), "baseline": baseline},
        )
        phase("starting")
        if baseline:
            outcome = self._trials.launch(number, flags, decision, phase, baseline=True)
            outcome = self._complete_baseline(trial, flags, outcome, phase)
        else:
            outcome = self._trials.launch(number, flags, decision, phase)
        self._tell(trial, outcome)

    def _complete_baseline(
        self, trial: optuna.Trial, flags: Mapping[str, FlagValue], outcome: TrialOutcome, phase: Phase
    ) -> TrialOutcome:
        """After the defaults' launch: a value for each parameter it has none of yet, from what the server
        reported (:func:`autotune.defaults.check_defaults`), a warning for each mismatch, and the record's
        flags as the trial ran (a declared default the server contradicted: the reported value)."""
        record = TrialRecord.from_attrs(outcome.attrs)
        effective = _effective(record.reported_defaults)
        check = check_defaults(self.space, flags, effective)
        for warning in check.warnings:
            phase(f"warning: {warning}")
        if check.params:
            trial = _with_fixed(self.study, trial, dict(check.params))
            flags = {**flags, **self.space.suggest(trial, names=check.params)}
        ran = {**flags, **check.contradicted}
        full = {name: ran[name] for name in self.space.names if name in ran}
        trial.set_user_attr("flags", dict(full))
        extra = TrialRecord(default_warnings=check.warnings).to_attrs()
        return TrialOutcome(
            outcome.cause, outcome.summary, outcome.values, outcome.constraints, {**outcome.attrs, **extra}
        )

    def _screen(self, flags: Mapping[str, FlagValue]) -> Decision:
        """A config already measured, or failed at start, is not launched again; then the trial's own
        screening (known constraints, repeats, the memory model)."""
        key = self.space.launch_key(flags)
        for done in self.study.get_trials(deepcopy=False, states=FINISHED):
            seen = TrialRecord.from_trial(done)
            if seen.baseline or self.space.launch_key(seen.flags) != key or not is_launch(done):
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
        key = self.space.launch_key(flags)
        for other in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            if other.number == trial.number:
                continue
            seen = TrialRecord.from_trial(other)
            if seen.flags and not seen.baseline and self.space.launch_key(seen.flags) == key:
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
            record(trial, outcome, self._keys, self.loaded, named=self._named)
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
        # The search's best is unconfirmed (the luckiest first figure): it notifies only in a study without
        # finalists, and only from the tuner that measured it.
        mine = after.best is not None and after.best.startswith(f"trial {number}:")
        self._new_best(number, after, confirmed=False, notify=mine and self.loaded.spec.finalists.count == 0)

    def _new_best(self, number: int, after: Standing, *, confirmed: bool, notify: bool) -> None:
        """Say the best when it changed since this tuner last said it (``notify``: a notification is due,
        :func:`autotune.notify.notification_for`)."""
        if after.best is not None and after.best != self._best:
            self._best = after.best
            data = {"confirmed": confirmed, "notify": notify}
            self._emit(Kind.NEW_BEST, f"new best: {after.best}", trial=number, standing=after, data=data)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def baseline_elsewhere(trials: Sequence[FrozenTrial], number: int) -> int | None:
    """The other trial that measures vLLM's defaults in place of trial ``number`` (a baseline too), or
    None when ``number`` should launch them: one already launched (finished), or one running with a
    lower number and no retry queued (a retry means it is being given back). Two baselines can be queued
    at once by tuners that recover the same lost one together; the lowest running one launches."""
    retried = {TrialRecord.from_trial(t).retry_of for t in trials}
    for other in trials:
        if other.number == number or not TrialRecord.from_trial(other).baseline:
            continue
        if is_launch(other):
            return other.number
        if other.state == TrialState.RUNNING and other.number < number and other.number not in retried:
            return other.number
    return None


def default_trial(study: optuna.Study) -> FrozenTrial | None:
    """The finished baseline trial (the vLLM defaults), newest first if it was retried."""
    for trial in reversed(study.get_trials(deepcopy=False, states=FINISHED)):
        if TrialRecord.from_trial(trial).baseline:
            return trial
    return None
