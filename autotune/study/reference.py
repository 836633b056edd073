"""The reference load: one load, shared by every config of a study, at which its latency objectives are read.

Read at each config's own SLO boundary, a latency objective is the SLO's limit wherever that term binds
(every config reads 300 ms against a 300-ms limit), so the Pareto front it makes is an artefact of where
latency is read. Compared at one load, latency says what a config costs a user at the traffic the
deployment serves. The load is ``workload.expected_rate`` when the spec gives it, else
``measurement.reference_fraction`` of the SLO rate of vLLM's defaults: their trial runs first and stores
the load in the study (``reference_load``); a config measured while the defaults still run elsewhere waits
for it (not for a tuner that died: its trial is abandoned), and when the defaults could not be measured
the first config measured sets it. After its rate search, each trial runs one probe at that load
(:func:`read_reference`); a finalist's rerun does not.

A study begun before this existed read latency at each boundary: it keeps doing so (``latency_at``), so
its trials stay comparable.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import optuna
from optuna.trial import TrialState

from autotune.errors import InvalidMeasurementError, StudyError
from autotune.inputs.loader import LoadedStudy
from autotune.load.probe import Probe
from autotune.load.ratesearch import ProbeReport, RateSearchResult, fmt_rate, probe_at
from autotune.store.record import TrialRecord
from autotune.store.storage import recovery_lock
from autotune.study.recovery import abandoned, experimental_ok

REFERENCE_ATTR = "reference_load"
"""The study's user attribute that holds the reference load once it is known (:meth:`Reference.as_dict`)."""

LATENCY_AT_ATTR = "latency_at"
"""The study's user attribute that says where its latency objectives are read: ``reference_load``, or
``boundary`` for a study begun before the reference load existed."""

EXPECTED = "workload.expected_rate"
"""The source of a reference load the spec gave."""

POLL_S = 2.0
"""How often a trial that waits for the defaults to set the load looks again."""

WAIT_S = 1800.0
"""How long a trial waits for the defaults' trial running elsewhere, at most, before it sets the load."""


@dataclass(frozen=True)
class Reference:
    """The reference load: its ``rate`` (the arrival process's unit) and where it came from."""

    rate: float
    source: str

    def as_dict(self) -> dict[str, Any]:
        return {"rate": self.rate, "source": self.source}

    @classmethod
    def from_dict(cls, value: object) -> Reference | None:
        if not isinstance(value, Mapping):
            return None
        rate, source = value.get("rate"), value.get("source")
        if isinstance(rate, int | float) and rate > 0 and isinstance(source, str):
            return cls(float(rate), source)
        return None


def reads_at_reference(study: optuna.Study) -> bool:
    """Whether the study reads its latency objectives at the reference load (a study begun before it
    existed, with trials and no mark, reads them at each boundary). An unmarked study without a finished
    trial is marked now."""
    mark = study.user_attrs.get(LATENCY_AT_ATTR)
    if mark is None:
        finished = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED))
        mark = "boundary" if finished else REFERENCE_ATTR
        study.set_user_attr(LATENCY_AT_ATTR, mark)
    return bool(mark == REFERENCE_ATTR)


def stored_reference(study: optuna.Study) -> Reference | None:
    """The reference load the study holds, if it was set."""
    return Reference.from_dict(study.user_attrs.get(REFERENCE_ATTR))


def check_reference(study: optuna.Study, loaded: LoadedStudy) -> None:
    """Refuse to go on measuring a study whose latency was read at another load than the spec now asks
    (``workload.expected_rate`` added, removed or changed since): its trials would not compare."""
    stored = stored_reference(study)
    if stored is None:
        return
    expected = loaded.spec.workload.expected_rate
    by_spec = stored.source == EXPECTED
    if (expected is None and not by_spec) or (expected is not None and by_spec and expected == stored.rate):
        return
    now = f"workload.expected_rate {expected:g}" if expected is not None else "no workload.expected_rate"
    raise StudyError(
        f"study {loaded.spec.study.name!r} read its latency objectives at {stored.rate:g} req/s "
        f"({stored.source}); the spec now gives {now}: its trials would not compare. Restore it, or use a "
        "new study name (best and the report read the spec's expected_rate for replicas at any time)"
    )


class ReferenceLoad:
    """Settles the reference load of one study (:meth:`settle`), the same for every worker."""

    def __init__(
        self,
        study: optuna.Study,
        loaded: LoadedStudy,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        wait_s: float = WAIT_S,
    ) -> None:
        self.study = study
        self.loaded = loaded
        self._clock = clock
        self._sleep = sleep
        self._wait_s = wait_s

    def settle(
        self, number: int, *, baseline: bool, sustained: float, phase: Callable[[str], None]
    ) -> Reference:
        """The reference load for trial ``number``, which sustains ``sustained`` within the SLOs: the
        spec's expected traffic, else the study's stored load; the defaults' trial (``baseline``) sets it.
        Another trial waits while the defaults run elsewhere (up to :data:`WAIT_S`), then sets it itself."""
        spec = self.loaded.spec
        if spec.workload.expected_rate is not None:
            mine = Reference(spec.workload.expected_rate, EXPECTED)
            if stored_reference(self.study) is None:
                self.study.set_user_attr(REFERENCE_ATTR, mine.as_dict())
            return mine
        deadline = self._clock() + self._wait_s
        told = False
        while (stored := stored_reference(self.study)) is None and not baseline:
            running = self._defaults_running(number)
            if running is None or self._clock() >= deadline:
                break
            if not told:
                phase(f"waiting for vLLM's defaults (trial {running}) to set the reference load")
                told = True
            self._sleep(POLL_S)
        if stored is not None:
            return stored
        fraction = f"{spec.measurement.reference_fraction:g}"
        source = (
            f"{fraction} x the SLO rate of vLLM's defaults in trial {number}"
            if baseline
            else f"{fraction} x the SLO rate of trial {number} (vLLM's defaults were not measured)"
        )
        mine = Reference(spec.measurement.reference_fraction * sustained, source)
        with recovery_lock(self.loaded.storage_url):  # one writer: the first to get here sets it
            stored = stored_reference(self.study)
            if stored is None:
                self.study.set_user_attr(REFERENCE_ATTR, mine.as_dict())
        return stored or mine

    def _defaults_running(self, number: int) -> int | None:
        """The defaults' trial running in another worker that lives, if any: one a dead tuner left is not
        waited for (on this host by its process; elsewhere once Optuna's heartbeat fails it, checked here)."""
        with experimental_ok():
            optuna.storages.fail_stale_trials(self.study)
        now = datetime.datetime.now()
        for trial in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            if (
                trial.number != number
                and TrialRecord.from_trial(trial).baseline
                and not abandoned(trial, now)
            ):
                return trial.number
        return None


@dataclass(frozen=True)
class AtReference:
    """A trial's probe at the reference load."""

    reference: Reference
    report: ProbeReport

    def latency_ms(self, metric: str, statistic: str) -> float | None:
        """A latency statistic of the probe (milliseconds), ``None`` when it completed no request."""
        metrics = self.report.outcome.metrics
        return metrics.value(metric, statistic) * 1000.0 if metrics.completed else None

    def as_record(self) -> dict[str, Any]:
        """What the trial stores (``TrialRecord.reference``)."""
        return {
            "request_rate": round(self.reference.rate, 6),
            "source": self.reference.source,
            "passed": self.report.passed,
            "why": self.report.why,
            "early_stopped": self.report.early_stopped,
            **self.report.outcome.metrics.as_dict(),
        }


def read_reference(
    reference: ReferenceLoad,
    probe: Probe,
    result: RateSearchResult,
    number: int,
    *,
    baseline: bool,
    phase: Callable[[str], None],
) -> AtReference | None:
    """Probe the config at the study's reference load after its rate search (``result``); ``None`` when
    the study has no latency objective, the search found no rate that meets the SLOs, or the client could
    not measure the probe (then the latency objectives are read at the boundary, and ``phase`` says so).
    A :class:`~autotune.outcome.ServerFailedError` (the server died under the probe) propagates."""
    spec = reference.loaded.spec
    sustained = result.sustained_rate
    if not spec.latency_objectives or sustained is None or result.estimate is None:
        return None
    ref = reference.settle(number, baseline=baseline, sustained=sustained, phase=phase)
    phase(f"latency objectives at the reference load, {fmt_rate(ref.rate)} req/s ({ref.source})")
    try:
        report = probe_at(
            probe,
            ref.rate,
            spec.slo,
            spec.measurement,
            pace=result.estimate.pace,
            on_progress=phase,
            label="reference probe",
        )
    except InvalidMeasurementError as exc:
        phase(f"the reference probe could not be measured ({exc}): latency objectives read at the boundary")
        return None
    return AtReference(ref, report)
