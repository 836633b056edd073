"""One trial end to end: known constraints → launch → ready → SLO-constrained throughput → outcome.

Every way a trial can end is an outcome with a cause (docs/architecture.md): configs that break a known
vLLM rule are rejected without a launch (``invalid_config``); start failures are classified from the
server log (``oom``, ``kv_too_small``, ``invalid_config``, ``start_timeout``, ``start_failed``); a server
that dies or turns unhealthy while measured is ``crashed_under_load``; one that runs but meets no SLO at
any probed rate is ``slo_unreachable``; one the load client could not measure at any rate is
``unmeasurable`` (the defaults' first measurement excepted: without it there is no comparison, so that
stops the study, saying what to do; a finalist's rerun the client cannot measure is an ``unmeasurable``
round, neither met nor missed). The tuner's own faults (port taken, teardown failed) raise and stop the
study instead of becoming data. The server is always torn down before returning.
"""

from __future__ import annotations

import dataclasses
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import optuna

from autotune.errors import InvalidMeasurementError, StudyError
from autotune.flags import FlagValue
from autotune.hardware.gpu import DeviceGuard, NoDevice, open_devices
from autotune.inputs.loader import Access, LoadedStudy
from autotune.inputs.spec import MeasurementSpec, WorkloadSpec
from autotune.load.calibrate import PromptCalibration, calibrate_or_explain
from autotune.load.probe import Prober
from autotune.load.ratesearch import RateSearchResult, Start, find_slo_throughput
from autotune.outcome import Cause, ServerFailedError, TrialOutcome
from autotune.predict.feasibility import Decision, PreLaunchCheck, memory_model_for
from autotune.predict.flagcheck import version_note
from autotune.predict.surrogate.propose import proposer_for
from autotune.server.effective import read_effective
from autotune.server.endpoint import Endpoint
from autotune.server.launcher import ServerProcess, kill_orphans
from autotune.store.record import TrialRecord
from autotune.study.judge import judge, note_preemptions, with_diagnosis
from autotune.study.loop import EventFn, StudyRunner, close_study, open_study
from autotune.study.reference import (
    AtReference,
    ReferenceLoad,
    check_reference,
    read_reference,
    reads_at_reference,
)

Phase = Callable[[str], None]

#: What to do when the client cannot measure vLLM's defaults at any rate.
CLIENT_ADVICE = (
    "the load client could not measure vLLM's defaults at any rate: give it more cores (with "
    "measurement.client_workers: auto, the default, it grows to every core its affinity and CPU quota allow, "
    "one process each, beside the server's), or run the tuner on another host than the server"
)


@dataclass(frozen=True)
class Again:
    """A finalist's rerun: measured again, its search starting where the trial's put the boundary (``start``;
    None when it had none). A round the client cannot measure is ``unmeasurable``, never a lower bound."""

    start: Start | None


@dataclass(frozen=True)
class Run:
    """One launch of a config: its trial, where its files go, and how it is measured."""

    number: int
    folder: Path
    """The server's log and the probes (``probes/``)."""
    measurement: MeasurementSpec
    workload: WorkloadSpec
    again: Again | None
    """A finalist's rerun (None: a launch of the search, or a re-measurement from an export)."""
    baseline: bool
    """vLLM's defaults: none of the tuned flags is passed."""

    @property
    def log_path(self) -> Path:
        return self.folder / "server.log"


def free_port(host: str) -> int:
    """A port that is free on ``host`` right now (the OS picks it)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _reported(log_path: Path, metrics: str | None) -> dict[str, object]:
    """What the server's log (and ``/metrics``) say about the values it runs with."""
    try:
        text = log_path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        text = ""
    return read_effective(text, metrics).as_record()


class TrialRunner:
    """Runs trials of one study: builds argv, owns each server's lifetime, measures, and judges."""

    def __init__(
        self,
        loaded: LoadedStudy,
        *,
        prelaunch: PreLaunchCheck | None = None,
        device: DeviceGuard | None = None,
        access: Access | None = None,
        reference: ReferenceLoad | None = None,
    ) -> None:
        self.loaded = loaded
        self.reference = reference
        """Where the study's latency objectives are read: one probe at its reference load after each
        launch's search (None: at each config's SLO boundary)."""
        self.access = access or Access()
        """The API key and extra headers (never written anywhere)."""
        self.space = loaded.search_space
        self.prelaunch = prelaunch
        """Repeat and memory-feasibility checks before each launch (autotune/predict/feasibility.py)."""
        self.device = device or DeviceGuard(NoDevice())
        """Device hygiene: clean before launch, peak memory per trial (autotune/hardware/gpu.py)."""
        self._calibration: PromptCalibration | None = None
        """Prompt-length calibration, made at the first server that is ready."""
        self._client_workers = 1
        """``client_workers: auto``: the worker processes the client had grown to by the last search (the
        next one starts there: a machine that could not keep up with one config's load rarely can with
        the next's)."""
        self._version_told = False

    def screen(self, flags: Mapping[str, FlagValue]) -> Decision:
        """Before a launch: a config that breaks a known constraint is rejected as ``invalid_config``; then
        the repeat and memory-feasibility checks (:class:`~autotune.predict.feasibility.PreLaunchCheck`)."""
        violations = self.space.violations(flags)
        if violations:
            return Decision(
                TrialOutcome(
                    cause=Cause.INVALID_CONFIG,
                    summary="rejected before launch: " + "; ".join(str(v) for v in violations),
                    attrs=TrialRecord(
                        launched=False, violations=tuple(str(v) for v in violations)
                    ).to_attrs(),
                )
            )
        return self.prelaunch(flags) if self.prelaunch is not None else Decision(None)

    def __call__(self, number: int, flags: Mapping[str, FlagValue], phase: Phase) -> TrialOutcome:
        """Screen, then (when the config may run) launch trial ``number`` with ``flags``."""
        decision = self.screen(flags)
        if decision.outcome is not None:
            return decision.outcome
        return self.launch(number, flags, decision, phase)

    def launch(
        self,
        number: int,
        flags: Mapping[str, FlagValue],
        decision: Decision,
        phase: Phase,
        *,
        baseline: bool = False,
    ) -> TrialOutcome:
        """Launch the server with ``flags``, measure its SLO-constrained throughput, tear it down; the
        outcome says how it ended. Raises on the tuner's own faults (the server is torn down first).

        ``baseline``: vLLM's defaults: none of the tuned flags is passed, and the outcome's record holds
        the values the server reported (``reported_defaults``)."""
        spec = self.loaded.spec
        run = Run(number, self.loaded.trial_dir(number), spec.measurement, spec.workload, None, baseline)
        return self._run(run, flags, decision, phase)

    def confirm(
        self,
        number: int,
        flags: Mapping[str, FlagValue],
        phase: Phase,
        *,
        seed: int,
        start: Start | None,
        baseline: bool = False,
    ) -> TrialOutcome:
        """Launch trial ``number``'s config again and measure it on the workload stream of ``seed`` (a
        finalists' round), its search starting at ``start`` (the trial's boundary), with probes
        ``finalists.probe_scale`` times longer, in ``<workdir>/confirmations/<number>-<seed>``."""
        spec = self.loaded.spec
        measurement = spec.measurement.scaled(spec.finalists.probe_scale)
        workload = spec.workload.model_copy(update={"seed": seed})
        run = Run(number, self.loaded.rerun_dir(number, seed), measurement, workload, Again(start), baseline)
        return self._run(run, flags, Decision(None), phase)

    def measure(
        self,
        number: int,
        flags: Mapping[str, FlagValue],
        folder: Path,
        phase: Phase,
        *,
        seed: int,
        baseline: bool = False,
    ) -> TrialOutcome:
        """Launch trial ``number``'s config once more outside the study (``autotune verify --record``): a
        whole rate search on the workload stream of ``seed``, its server log and probes in ``folder``."""
        spec = self.loaded.spec
        workload = spec.workload.model_copy(update={"seed": seed})
        return self._run(
            Run(number, folder, spec.measurement, workload, None, baseline), flags, Decision(None), phase
        )

    def _run(
        self, run: Run, flags: Mapping[str, FlagValue], decision: Decision, phase: Phase
    ) -> TrialOutcome:
        server = self.loaded.spec.server
        run.folder.mkdir(parents=True, exist_ok=True)
        port = server.port or free_port(server.host)
        argv = self.loaded.server_argv(flags, host=server.host, port=port, baseline=run.baseline)
        env = self.loaded.server_env(flags, baseline=run.baseline)
        record = TrialRecord(
            launched=True, argv=tuple(argv), log=str(run.log_path), memory_prediction=decision.prediction
        )
        self.device.wait_clean()
        defaults = " with vLLM's defaults (no tuned flag)" if run.baseline else ""
        phase(f"starting server on port {port}{defaults}")
        with self.device.peak() as memory:
            outcome = self._launch(run, argv, env, port, record, phase)
        if memory.peak_gib is None:
            return outcome
        peak = TrialRecord(
            gpu=self.device.device.name() or None,
            gpu_driver=self.device.device.driver() or None,
            peak_device_memory_gib=memory.peak_gib,
            baseline_device_memory_gib=memory.baseline_gib,
        )
        return TrialOutcome(
            outcome.cause,
            outcome.summary,
            outcome.values,
            outcome.constraints,
            {**outcome.attrs, **peak.to_attrs()},
        )

    def _launch(
        self,
        run: Run,
        argv: list[str],
        env: Mapping[str, str | None],
        port: int,
        record: TrialRecord,
        phase: Phase,
    ) -> TrialOutcome:
        server = self.loaded.spec.server
        baseline, log_path = run.baseline, run.log_path
        with ServerProcess(
            argv,
            env={**env, **self.access.server_env()},
            log_path=log_path,
            host=server.host,
            port=port,
            model=server.model,
            stop_timeout=server.stop_timeout,
            headers=self.access.request_headers(),
        ) as proc:
            try:
                ready = proc.wait_ready(server.start_timeout)
            except ServerFailedError as exc:
                diagnosis = exc.diagnosis
                record = with_diagnosis(record, diagnosis)
                if baseline:  # what the log said before the failure (the engine line, often)
                    record = record.replace(reported_defaults=_reported(log_path, None))
                return TrialOutcome(cause=diagnosis.cause, summary=diagnosis.summary, attrs=record.to_attrs())
            record = record.replace(
                start_s=round(ready.seconds, 3),
                capacity=ready.capacity.as_dict() if ready.capacity is not None else None,
                server_version=ready.version,
            )
            warning = version_note(self.space, ready.version)
            if warning is not None and not self._version_told:
                self._version_told = True
                phase(f"warning: {warning}")
            if baseline:
                with Endpoint(proc.base_url, headers=self.access.request_headers()) as endpoint:
                    response = endpoint.get("/metrics")
                metrics = response.text if response is not None and response.status_code == 200 else None
                record = record.replace(reported_defaults=_reported(log_path, metrics))
            capacity = f", KV cache {ready.capacity.kv_tokens:,} tokens" if ready.capacity else ""
            phase(f"ready in {ready.seconds:.1f}s{capacity}")
            calibration = self._calibrate(proc.base_url, phase)
            record = record.replace(prompt_calibration=calibration)
            try:
                result, at = self._measure(proc, run, phase)
            except InvalidMeasurementError as exc:
                if baseline and run.again is None:  # without the defaults' figure there is nothing to compare
                    raise InvalidMeasurementError(f"{exc}; {CLIENT_ADVICE}") from exc
                phase("stopping the server")
                # A finalist's rerun too: a round the client cannot measure counts neither as met nor as
                # missed (finalists.Rerun.unmeasured), and the stage goes on.
                what = "rerun" if run.again is not None else "config"
                summary = f"the client could not measure this {what} at any rate: {exc}"
                return TrialOutcome(cause=Cause.UNMEASURABLE, summary=summary, attrs=record.to_attrs())
            crash = proc.check_alive()
            phase("stopping the server")
        return note_preemptions(judge(result, crash, record, self.loaded.spec.objectives, at))

    def _calibrate(self, base_url: str, phase: Phase) -> dict[str, object] | None:
        """Calibrate prompt lengths against the first ready server; later trials reuse the result (same
        tokenizer). A failure is recorded and retried at the next trial; this one measures uncalibrated."""
        if self._calibration is not None:
            return self._calibration.as_dict()
        spec = self.loaded.spec
        self._calibration, record = calibrate_or_explain(
            base_url,
            spec.server.model,
            spec.workload,
            self.loaded.tokenizer_path,
            self.access.request_headers(),
        )
        if record is not None and record.get("error"):
            phase(f"prompt lengths not calibrated: {record['error']}")
        return record

    def _measure(
        self, proc: ServerProcess, run: Run, phase: Phase
    ) -> tuple[RateSearchResult, AtReference | None]:
        """The config's rate search, then (for a launch, not a rerun) its probe at the study's reference
        load (:func:`autotune.study.reference.read_reference`); a server that dies under that probe is the
        search's crash."""
        spec = self.loaded.spec
        probe = Prober(
            proc.base_url,
            spec.server.model,
            run.workload,
            spec.slo,
            run.measurement,
            base_dir=self.loaded.base_dir,
            alive=proc.check_alive,
            save_dir=run.folder / "probes",
            calibration=self._calibration,
            headers=self.access.request_headers(),
            judged=spec.latency_objectives,
            workers_from=self._client_workers,
        )
        try:
            again = run.again
            result = find_slo_throughput(
                probe,
                spec.slo,
                run.measurement,
                on_progress=phase,
                start=again.start if again is not None else None,
                rerun=again is not None,
            )
            if again is not None or self.reference is None or result.crash is not None:
                return result, None
            try:
                at = read_reference(
                    self.reference, probe, result, run.number, baseline=run.baseline, phase=phase
                )
                return result, at
            except ServerFailedError as exc:  # the server died under the reference probe
                phase(str(exc))
                return dataclasses.replace(result, crash=exc.diagnosis), None
        finally:
            self._client_workers = probe.workers


def run_study(
    loaded: LoadedStudy,
    *,
    on_event: EventFn,
    gpus: Sequence[int | str] = (0,),
    label: str = "",
    access: Access | None = None,
) -> optuna.Study:
    """Run (or resume) the study of ``loaded`` to its budget, launching one server per trial.

    ``gpus`` are the devices the servers use (NVML indices or UUIDs), watched for hygiene and peak memory;
    ``label`` names this worker among several on one study (its GPU set); ``access`` holds the API key
    and extra headers (:func:`autotune.inputs.loader.resolve_access`).
    """
    return _runner(loaded, on_event=on_event, gpus=gpus, label=label, access=access, create=True).run()


def verify_study(
    loaded: LoadedStudy,
    *,
    on_event: EventFn,
    gpus: Sequence[int | str] = (0,),
    label: str = "",
    access: Access | None = None,
) -> optuna.Study:
    """Measure the study's finalists and vLLM's defaults once more (:mod:`autotune.study.finalists`)."""
    return _runner(loaded, on_event=on_event, gpus=gpus, label=label, access=access, create=False).verify()


def _runner(
    loaded: LoadedStudy,
    *,
    on_event: EventFn,
    gpus: Sequence[int | str],
    label: str,
    access: Access | None,
    create: bool,
) -> StudyRunner:
    device = open_devices(list(gpus))
    study = open_study(loaded, create=create, label=label)
    at_reference = reads_at_reference(study)
    if create and at_reference:  # tune: its new trials must read latency where the earlier ones did
        try:
            check_reference(study, loaded)
        except StudyError:
            close_study(study)
            raise
    memory = memory_model_for(loaded, device)
    runner = TrialRunner(
        loaded,
        prelaunch=PreLaunchCheck(memory, lambda: study.get_trials(deepcopy=False)),
        device=DeviceGuard(device),
        access=access,
        reference=ReferenceLoad(study, loaded) if at_reference else None,
    )

    def on_stale(trial: optuna.trial.FrozenTrial) -> None:
        directory = loaded.trial_dir(trial.number)
        if directory.is_dir():
            kill_orphans(directory)

    proposer = proposer_for(loaded, memory)
    return StudyRunner(loaded, study, runner, on_event=on_event, on_stale=on_stale, proposer=proposer)
