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
launches are left) queues it again (:func:`autotune.study.defaults_trial.ensure_baseline`), so the defaults
are always measured eventually. A trial dropped before launch (budget spent elsewhere, the same config running
elsewhere) is FAIL with ``discarded`` and never retried. A trial left RUNNING by a tuner that died on this
host is failed at the next start (its worker process is gone) and its orphaned server killed; on other hosts
Optuna's heartbeat fails it after the grace period. Failing a RUNNING trial is an atomic state change in the
storage, so exactly one tuner re-queues it.

Faults of the tuner or its environment that may pass (:attr:`~autotune.errors.AutotuneError.transient`:
a port taken, a GPU held by another process, a probe the client could not measure, storage briefly
unreachable) are retried with a doubling pause, ``faults.retries`` times in a row, before the study
stops. Other errors stop it at once. :class:`~autotune.errors.Interrupted` (SIGTERM, SIGINT, SIGHUP) gives
the trial back and re-raises.

This module keeps the loop that asks, screens, runs and tells (and opens the study); its parts have
modules of their own: what to do between trials (:mod:`autotune.study.budget`), a launch slot claimed across
tuners (:mod:`autotune.study.slots`), an outcome told into storage or a trial given back
(:mod:`autotune.study.tell`), the defaults' trial (:mod:`autotune.study.defaults_trial`), the surrogate's turn
(:mod:`autotune.study.proposals`), the events (:mod:`autotune.study.announcer`), the finalists' reruns
(:mod:`autotune.study.rerun_stage`), recovery (:mod:`autotune.study.recovery`).
"""

from __future__ import annotations

import functools
import hashlib
import time
import warnings
from collections.abc import Callable, Mapping
from typing import Protocol

import optuna
import sqlalchemy.exc
from optuna.trial import FrozenTrial, TrialState

from autotune.errors import AutotuneError, Interrupted, StorageUnavailableError, StudyError
from autotune.events import Event, Kind
from autotune.flags import FlagValue
from autotune.inputs.loader import LoadedStudy
from autotune.inputs.space import SearchSpace
from autotune.inputs.spec import SamplerSpec
from autotune.interrupts import acknowledge, shielded
from autotune.outcome import Cause, TrialOutcome
from autotune.predict.feasibility import Decision
from autotune.predict.surrogate.propose import Proposer
from autotune.store import optuna_private
from autotune.store.record import TrialRecord, named_constraints
from autotune.store.storage import (
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
from autotune.study.announcer import Announcer
from autotune.study.budget import Next, next_step, rejected_cap
from autotune.study.defaults_trial import (
    baseline_elsewhere,
    complete_baseline,
    enqueue_baseline,
    ensure_baseline,
    fixed_params,
)
from autotune.study.finalists import gain, ledger, pending, pick, verdict
from autotune.study.finalists import reruns as reruns_of
from autotune.study.proposals import Proposals
from autotune.study.recovery import experimental_ok, heartbeat, recover, requeue_stale, worker_id
from autotune.study.rerun_stage import Confirms, RerunStage, flags_text
from autotune.study.slots import SLOT_POLL_S, claim_slot, running_elsewhere
from autotune.study.standing import FINISHED, Standing, is_launch
from autotune.study.tell import constraint_keys, discard, give_back, tell
from autotune.units import format_figure

RECOVER_EVERY_S = 15.0
"""While waiting, how often a worker looks for trials whose tuner died."""
MAX_FAULT_PAUSE_S = 600.0
STORAGE_ERRORS = (sqlalchemy.exc.OperationalError, sqlalchemy.exc.InterfaceError, OSError)
"""What a storage that does not answer raises (a database restarting, a lost connection)."""

Phase = Callable[[str], None]
EventFn = Callable[[Event], None]


class Trials(Confirms, Protocol):
    """What the study loop asks of a study's trials (:class:`autotune.study.trial.TrialRunner`): a screen and
    a launch, and measuring a finalist again (:class:`autotune.study.rerun_stage.Confirms`)."""

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
    storage file is refused before it is opened (:func:`autotune.store.storage.open_storage`).
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
    """The study's storage as :func:`autotune.store.storage.inspect_storage` sees it (read-only); a
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


def default_trial(study: optuna.Study) -> FrozenTrial | None:
    """The finished baseline trial (the vLLM defaults), newest first if it was retried."""
    for trial in reversed(study.get_trials(deepcopy=False, states=FINISHED)):
        if TrialRecord.from_trial(trial).baseline:
            return trial
    return None


# ----------------------------------------------------------------------------------------------
# The loop: ask → screen → claim a slot → launch → tell
# ----------------------------------------------------------------------------------------------


def ask(study: optuna.Study, loaded: LoadedStudy) -> optuna.Trial:
    """A new trial from the study (a queued config first), under the storage's queue lock; a storage that
    does not answer is a :class:`StorageUnavailableError` (transient), a damaged or full one its error."""
    try:
        with warnings.catch_warnings():  # we beat the heartbeat ourselves (heartbeat)
            warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used")
            with queue_lock(loaded.storage_url):
                return study.ask()
    except Exception as exc:
        failure = storage_failure(exc, loaded.storage_url, loaded.workdir)
        if failure is not None:
            raise failure from exc
        if isinstance(exc, STORAGE_ERRORS):
            raise StorageUnavailableError(f"the study's storage did not answer: {_first_line(exc)}") from exc
        raise


def measured_before(
    study: optuna.Study, space: SearchSpace, flags: Mapping[str, FlagValue]
) -> Decision | None:
    """A config already measured, or failed at start, is not launched again: its outcome, the earlier
    trial's values or cause (None: not launched before)."""
    key = space.launch_key(flags)
    for done in study.get_trials(deepcopy=False, states=FINISHED):
        seen = TrialRecord.from_trial(done)
        if seen.baseline or space.launch_key(seen.flags) != key or not is_launch(done):
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
    return None


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
        self.study = study
        """The study, opened with :func:`open_study` (``create=True``) by the caller."""
        self.space = loaded.search_space
        self._trials = trials
        self._on_stale = on_stale
        self._clock = clock
        self._sleep = sleep
        self._started = clock()
        self._worker = worker_id()
        self._keys = constraint_keys(loaded)
        self._named = named_constraints(study.get_trials(deepcopy=False))
        """The study was made with Optuna 5's named constraints: its new trials keep them."""
        self._announcer = Announcer(loaded, study, self._worker, on_event, clock=clock, started=self._started)
        self._emit = self._announcer.emit
        self._proposals = Proposals(proposer, self._announcer) if proposer is not None else None
        """Proposes each launch from the calibrated surrogate until it hands over (None: the sampler)."""
        self._recovered_at = clock()
        self._stopped = False
        self.reruns = RerunStage(self._announcer, trials)
        """The finalists' reruns once the search is done (and ``verify``'s round)."""

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

    def verify(self) -> optuna.Study:
        """Measure every finalist and the defaults in one more round now, whatever the budget (``autotune
        verify``); returns the study."""
        with storage_errors(self.loaded.storage_url, self.loaded.workdir):
            return self.reruns.verify()

    def _loop(self) -> optuna.Study:
        budget = self.loaded.spec.budget
        self._emit(Kind.STARTED, f"tuner {self._worker} started")
        self._recover()
        in_a_row = 0
        while True:
            if self._clock() - self._recovered_at >= RECOVER_EVERY_S:
                self._recover()  # another worker of this host may have died: give its trial back
            standing = Standing.of(self.study, self.loaded)
            spent = budget.wall_time is not None and self._clock() - self._started >= budget.wall_time
            step: Callable[[], None] = self._one_trial
            match next_step(standing, budget, wall_spent=spent):
                case Next.FINALISTS:
                    # Finalists are chosen once no trial runs anywhere (a running one could still join them).
                    rerun = None if standing.running or spent else self.reruns.next(first=True)
                    if rerun is None:
                        self._finish(standing)
                        return self.study
                    step = functools.partial(self.reruns.confirm, *rerun)
                case Next.WALL_TIME:
                    self._emit(Kind.FINISHED, "wall-time budget spent", standing=standing)
                    return self.study
                case Next.REJECTED:
                    message = rejected_cap(standing, budget)
                    self._emit(Kind.STOPPED, message, standing=standing)
                    raise StudyError(message)
                case Next.WAIT:
                    self._wait_for_slot()
                    continue
            try:
                with storage_errors(self.loaded.storage_url, self.loaded.workdir):
                    step()
            except AutotuneError as exc:
                retried = self._retry(exc, in_a_row)
                if retried is None:
                    raise
                in_a_row = retried
            else:
                in_a_row = 0

    def _retry(self, exc: AutotuneError, in_a_row: int) -> int | None:
        """After ``exc``, the ``in_a_row``-th fault in a row: pause, and return the faults in a row now; or
        None when the study stops (a fault that does not pass, or ``faults.retries`` spent)."""
        faults = self.loaded.spec.faults
        if not exc.transient or in_a_row >= faults.retries:
            why = f" after {in_a_row} retries" if exc.transient else ""
            self._emit(Kind.STOPPED, f"stopped{why}: {exc}", data={"error": str(exc)})
            return None
        pause = min(faults.pause * 2**in_a_row, MAX_FAULT_PAUSE_S)
        in_a_row += 1
        self._emit(
            Kind.RETRY,
            f"retry {in_a_row} of {faults.retries} in {format_figure(pause, 's')} after: {exc}",
            data={"error": str(exc), "pause_s": pause, "retry": in_a_row},
        )
        self._sleep(pause)
        return in_a_row

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

    def _wait_for_slot(self) -> None:
        """Every slot is held by a running trial: wait a while for one to end."""
        self._sleep(SLOT_POLL_S)
        if self._clock() - self._recovered_at >= RECOVER_EVERY_S:
            self._recover()

    def _recover(self) -> None:
        """Give back the trials of dead tuners (:func:`autotune.study.recovery.recover`) and queue the
        defaults again if the study has lost them (:func:`autotune.study.defaults_trial.ensure_baseline`); say
        so."""
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

    def _one_trial(self) -> None:
        trial: optuna.Trial | None = None
        try:
            handed_over = self._proposals.queue_next() if self._proposals is not None else None
            # A signal while the storage makes the trial is held until the trial exists, then it is given
            # back (cut short, it left a RUNNING trial with no worker that stalled the next run a minute).
            with shielded():
                trial = ask(self.study, self.loaded)
                for key, value in (handed_over.to_attrs() if handed_over else {}).items():
                    trial.set_user_attr(key, value)
            with heartbeat(self.study, trial):
                self._run(trial)
        except Interrupted as sig:
            if trial is None:
                raise
            number = trial.number
            acknowledge()
            give_back(self.study, trial, f"interrupted by {sig.name}", retries=None)
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
            retries = self.loaded.spec.faults.retries
            give_back(self.study, trial, f"{type(exc).__name__}: {exc}", retries=retries)
            self._emit(
                Kind.FAULT, f"trial {number} given back: {exc}", trial=number, data={"error": str(exc)}
            )
            raise

    def _run(self, trial: optuna.Trial) -> None:
        number = trial.number
        baseline = bool(TrialRecord.from_attrs(trial.user_attrs).baseline)
        # vLLM's defaults: the values queued (the space's declared defaults, or a retried trial's) now,
        # the others once the server has reported them (autotune/study/defaults.py).
        fixed = fixed_params(self.study, trial) if baseline else None
        flags = self.space.suggest(trial, names=fixed)
        for key, value in TrialRecord(worker=self._worker, flags=flags).to_attrs().items():
            trial.set_user_attr(key, value)
        elsewhere = self._elsewhere(trial, flags, baseline=baseline)
        if elsewhere is not None:
            discard(self.study, trial, elsewhere)
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
            discard(self.study, trial, refused)
            return
        shown = "vLLM's defaults (no tuned flag)" if baseline else flags_text(flags)
        data = {"flags": dict(flags), "baseline": baseline}
        self._emit(Kind.TRIAL, f"launching {shown}", trial=number, standing=standing, data=data)
        phase("starting")
        outcome = self._trials.launch(number, flags, decision, phase, baseline=baseline)
        if baseline:
            outcome = complete_baseline(self.study, self.space, trial, flags, outcome, phase)
        self._tell(trial, outcome)

    def _claim_slot(self, number: int, standing: Standing) -> str | None:
        """Wait until trial ``number`` may launch within the budget (None), saying once that it waits; or
        why it must not (:func:`autotune.study.slots.claim_slot`)."""

        def waiting(ahead: int) -> None:
            self._emit(
                Kind.PHASE,
                f"waiting for a budget slot: {ahead} earlier trials are running elsewhere",
                trial=number,
                standing=standing,
            )

        budget = self.loaded.spec.budget.launches
        return claim_slot(self.study, number, budget, waiting=waiting, wait=self._wait_for_slot)

    def _elsewhere(
        self, trial: optuna.Trial, flags: Mapping[str, FlagValue], *, baseline: bool
    ) -> str | None:
        """Why another trial launches ``trial``'s config in its place (None: ``trial`` launches it): the
        defaults measured or launched by another trial, or the same config running elsewhere."""
        if baseline:
            other = baseline_elsewhere(self.study.get_trials(deepcopy=False), trial.number)
            return None if other is None else f"vLLM's defaults are measured in trial {other}"
        same = running_elsewhere(self.study, self.space, trial.number, flags)
        return None if same is None else f"the same config is running in trial {same}"

    def _screen(self, flags: Mapping[str, FlagValue]) -> Decision:
        """A config already measured, or failed at start, is not launched again (:func:`measured_before`);
        then the trial's own screening (known constraints, repeats, the memory model)."""
        before = measured_before(self.study, self.space, flags)
        return before if before is not None else self._trials.screen(flags)

    def _tell(self, trial: optuna.Trial, outcome: TrialOutcome) -> None:
        tell(self.study, trial, outcome, self._keys, self.loaded, named=self._named)
        self._announcer.trial_done(trial.number, outcome)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"
