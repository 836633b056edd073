"""One trial end to end: known constraints → launch → ready → SLO-constrained throughput → outcome.

Every way a trial can end is an outcome with a cause (DESIGN.md): configs that break a known vLLM rule
are rejected without a launch (``invalid_config``); start failures are classified from the server log
(``oom``, ``kv_too_small``, ``invalid_config``, ``start_timeout``, ``start_failed``); a server that dies or
turns unhealthy while measured is ``crashed_under_load``; one that runs but meets no SLO at any probed
rate is ``slo_unreachable``. The tuner's own faults (port taken, teardown failed, invalid measurement)
raise and stop the study instead of becoming data. The server is always torn down before returning.
"""

from __future__ import annotations

import math
import socket
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import optuna

from autotune.feasibility import PreLaunchCheck, memory_model_for, note_preemptions
from autotune.gpu import DeviceGuard, NoDevice, open_device
from autotune.load.calibrate import PromptCalibration, calibrate_or_explain
from autotune.load.metrics import ProbeMetrics
from autotune.load.ratesearch import RateSearchResult, find_slo_throughput, make_probe
from autotune.load.slo import parse_term
from autotune.outcome import Cause, TrialOutcome
from autotune.server.classify import Diagnosis
from autotune.server.launcher import ServerProcess, ServerStartError, kill_orphans
from autotune.space import SearchSpace
from autotune.spec import FlagValue, LoadedStudy, Objective
from autotune.study import ProgressFn, StudyRunner, open_study

Phase = Callable[[str], None]


def free_port(host: str) -> int:
    """A port that is free on ``host`` right now (the OS picks it)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def objective_value(objective: Objective, point: ProbeMetrics) -> float:
    """An objective's value at the operating point: tok/s or req/s, latencies in milliseconds."""
    if objective.metric == "slo_throughput":
        return point.output_throughput
    if objective.metric == "request_throughput":
        return point.request_throughput
    if objective.metric == "goodput":
        return point.goodput
    term = parse_term(f"{objective.metric}<=1")
    return point.dist(term.metric).get(term.statistic) * 1000.0


def _diagnosis_attrs(diagnosis: Diagnosis) -> dict[str, Any]:
    return {"log_lines": list(diagnosis.lines), "diagnosis": dict(diagnosis.extras)}


class TrialRunner:
    """Runs trials of one study: builds argv, owns each server's lifetime, measures, and judges."""

    def __init__(
        self,
        loaded: LoadedStudy,
        *,
        prelaunch: PreLaunchCheck | None = None,
        device: DeviceGuard | None = None,
    ) -> None:
        self.loaded = loaded
        self.space = SearchSpace(loaded.space, loaded.spec.server.args)
        self.prelaunch = prelaunch
        """Repeat and memory-feasibility checks before each launch (autotune/feasibility.py)."""
        self.device = device or DeviceGuard(NoDevice())
        """Device hygiene: clean before launch, peak memory per trial (autotune/gpu.py)."""
        self._calibration: PromptCalibration | None = None
        """Prompt-length calibration, made at the first server that is ready."""

    def __call__(self, number: int, flags: Mapping[str, FlagValue], phase: Phase) -> TrialOutcome:
        """Run trial ``number`` with ``flags``; ``phase`` receives progress text."""
        violations = self.space.violations(flags)
        if violations:
            return TrialOutcome(
                cause=Cause.INVALID_CONFIG,
                summary="rejected before launch: " + "; ".join(str(v) for v in violations),
                attrs={"launched": False, "violations": [str(v) for v in violations]},
            )
        decision = self.prelaunch(flags) if self.prelaunch is not None else None
        if decision is not None and decision.outcome is not None:
            return decision.outcome
        server = self.loaded.spec.server
        trial_dir = self.loaded.trial_dir(number)
        trial_dir.mkdir(parents=True, exist_ok=True)
        port = server.port or free_port(server.host)
        argv = [*server.command, "--host", server.host, "--port", str(port), *self.space.argv(flags)]
        log_path = trial_dir / "server.log"
        attrs: dict[str, Any] = {"launched": True, "argv": argv, "log": str(log_path)}
        if decision is not None:
            attrs.update(decision.attrs)
        self.device.wait_clean()
        phase(f"starting server on port {port}")
        with (
            self.device.peak(attrs),  # writes peak_device_memory_gib into attrs after teardown
            ServerProcess(
                argv, env=server.env, log_path=log_path, host=server.host, port=port, model=server.model
            ) as proc,
        ):
            try:
                ready = proc.wait_ready(server.start_timeout)
            except ServerStartError as exc:
                diagnosis = exc.diagnosis
                attrs.update(_diagnosis_attrs(diagnosis))
                return TrialOutcome(cause=diagnosis.cause, summary=diagnosis.summary, attrs=attrs)
            attrs["start_s"] = round(ready.seconds, 3)
            if ready.capacity is not None:
                attrs["capacity"] = ready.capacity.as_dict()
            if ready.version:
                attrs["server_version"] = ready.version
            capacity = f", KV cache {ready.capacity.kv_tokens:,} tokens" if ready.capacity else ""
            phase(f"ready in {ready.seconds:.1f}s{capacity}")
            calibration = self._calibrate(proc.base_url, phase)
            if calibration is not None:
                attrs["prompt_calibration"] = calibration
            result = self._measure(proc, proc.base_url, trial_dir, phase)
            crash = proc.check_alive()
        return note_preemptions(self._judge(result, crash, attrs))

    def _calibrate(self, base_url: str, phase: Phase) -> dict[str, Any] | None:
        """Calibrate prompt lengths against the first ready server; later trials reuse the result (same
        tokenizer). A failure is recorded and retried at the next trial; this one measures uncalibrated."""
        if self._calibration is not None:
            return self._calibration.as_dict()
        spec = self.loaded.spec
        self._calibration, record = calibrate_or_explain(
            base_url, spec.server.model, spec.workload, self.loaded.tokenizer_path
        )
        if record is not None and record.get("error"):
            phase(f"prompt lengths not calibrated: {record['error']}")
        return record

    def _measure(self, proc: ServerProcess, base_url: str, trial_dir: Path, phase: Phase) -> RateSearchResult:
        spec = self.loaded.spec
        probe = make_probe(
            base_url=base_url,
            model=spec.server.model,
            workload=spec.workload,
            measurement=spec.measurement,
            slo=spec.slo,
            base_dir=self.loaded.base_dir,
            alive=proc.check_alive,
            save_dir=trial_dir / "probes",
            calibration=self._calibration,
        )
        return find_slo_throughput(probe, spec.slo, spec.measurement, on_progress=phase)

    def _judge(
        self, result: RateSearchResult, crash: Diagnosis | None, attrs: dict[str, Any]
    ) -> TrialOutcome:
        spec = self.loaded.spec
        attrs["probes"] = [p.as_dict() for p in result.probes]
        attrs["probe_seconds"] = round(result.probe_seconds, 3)
        if result.server_delta is not None:
            attrs["server_delta"] = result.server_delta
        if crash is not None or result.crash is not None:
            diagnosis = crash or result.crash
            assert diagnosis is not None
            attrs.update(_diagnosis_attrs(diagnosis))
            return TrialOutcome(
                cause=Cause.CRASHED_UNDER_LOAD,
                summary=diagnosis.summary,
                attrs=attrs,
            )
        if result.best is None:
            return TrialOutcome(
                cause=Cause.SLO_UNREACHABLE,
                summary=result.reason,
                constraints=result.lowest_violations,
                attrs=attrs,
            )
        point = result.best
        rate = result.best_rate
        finite = rate is not None and math.isfinite(rate)
        attrs["operating_point"] = {"request_rate": rate if finite else None, **point.as_dict()}
        values = tuple(objective_value(o, point) for o in spec.objectives)
        summary = ", ".join(f"{o.metric}={v:.4g}" for o, v in zip(spec.objectives, values, strict=True))
        where = f"{rate:.2f} req/s" if finite else "saturation (every request at once)"
        return TrialOutcome(
            cause=None,
            summary=f"{summary} at {where}",
            values=values,
            constraints=result.best_violations,
            attrs=attrs,
        )


def run_study(loaded: LoadedStudy, *, on_progress: ProgressFn, gpu: int | str = 0) -> optuna.Study:
    """Run (or resume) the study of ``loaded`` to its budget, launching one server per trial.

    ``gpu`` is the device the servers use (an NVML index or UUID), watched for hygiene and peak memory.
    """
    device = open_device(index=gpu)
    study = open_study(loaded, create=True)
    runner = TrialRunner(
        loaded,
        prelaunch=PreLaunchCheck(memory_model_for(loaded, device), lambda: study.get_trials(deepcopy=False)),
        device=DeviceGuard(device),
    )

    def on_stale(trial: optuna.trial.FrozenTrial) -> None:
        directory = loaded.trial_dir(trial.number)
        if directory.is_dir():
            kill_orphans(directory)

    return StudyRunner(loaded, study, runner, on_progress=on_progress, on_stale=on_stale).run()
