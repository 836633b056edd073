"""The trial record: everything autotune stores on a trial, and the only place that knows the storage keys.

Optuna keeps a trial's facts as user attributes (JSON values under string keys). :class:`TrialRecord` is
their typed form: the tuner builds one and stores :meth:`TrialRecord.to_attrs`; readers (the feasibility
check, export, reports, status) use :meth:`TrialRecord.from_trial`. Nested facts that only a human or a
report reads (probes, capacity, server deltas, memory predictions) stay JSON mappings.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from optuna.trial import FrozenTrial

from autotune.outcome import Cause
from autotune.spec import FlagValue

Json = Mapping[str, Any]


@dataclass(frozen=True)
class TrialRecord:
    """What one trial did and why it ended as it did (every field optional: set what is known)."""

    flags: Mapping[str, FlagValue] = field(default_factory=dict)
    """The tuned flags as the server got them (floats without binary noise)."""
    outcome: str | None = None
    """``complete`` or ``pruned`` once the trial ended."""
    cause: Cause | None = None
    summary: str = ""
    baseline: bool | None = None
    """True on the trial of vLLM's defaults (the baseline every gain is measured against)."""
    worker: str | None = None
    """The tuner process that ran it (``host:pid:create_time``)."""
    launched: bool | None = None
    violations: tuple[str, ...] = ()
    """Known constraints the config broke (rejected before launch)."""
    repeat_of: int | None = None
    """The trial whose identical config already failed to start (not launched again)."""
    beyond: int | None = None
    """The trial that failed to start for memory and that this config asks at least as much memory as
    (not launched: :mod:`autotune.boundary`)."""
    memory_prediction: Json | None = None
    argv: tuple[str, ...] = ()
    log: str | None = None
    start_s: float | None = None
    capacity: Json | None = None
    server_version: str | None = None
    prompt_calibration: Json | None = None
    probes: tuple[Json, ...] = ()
    probe_seconds: float | None = None
    server_delta: Json | None = None
    operating_point: Json | None = None
    """The operating point's metrics (``vllm bench serve`` keys) and its ``request_rate``."""
    preemptions: float | None = None
    preemption_storm: bool | None = None
    log_lines: tuple[str, ...] = ()
    diagnosis: Json | None = None
    """Numbers read from the failure's log lines (GiB where the key ends in ``_gib``)."""
    peak_device_memory_gib: float | None = None
    baseline_device_memory_gib: float | None = None
    failed_because: str | None = None
    """Why the tuner gave the trial up (it died, it was interrupted, a fault): the trial is retried."""
    retry_of: int | None = None
    """The trial whose config this one tries again (that trial was given up by the tuner)."""
    discarded: str | None = None
    """Why the tuner dropped this trial before it launched anything (never retried, never data)."""

    def replace(self, **changes: Any) -> TrialRecord:
        """A copy with ``changes``."""
        return dataclasses.replace(self, **changes)

    def to_attrs(self) -> dict[str, Any]:
        """The fields that are set, as JSON-serialisable user attributes (``None`` and empty values are left
        out, so a partial record never overwrites what another part of the tuner stored)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None or (isinstance(value, str | tuple | Mapping) and not value):
                continue
            out[f.name] = _jsonable(value.value if isinstance(value, Cause) else value)
        return out

    @classmethod
    def from_attrs(cls, attrs: Mapping[str, Any]) -> TrialRecord:
        """The record stored as ``attrs`` (keys it does not know are ignored)."""
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name not in attrs or attrs[f.name] is None:
                continue
            value = attrs[f.name]
            if f.name == "cause":
                value = _cause(value)
            elif f.name in _TUPLES:
                value = tuple(value) if isinstance(value, list | tuple) else ()
            elif f.name == "flags":
                value = dict(value) if isinstance(value, Mapping) else {}
            values[f.name] = value
        return cls(**values)

    @classmethod
    def from_trial(cls, trial: FrozenTrial) -> TrialRecord:
        """The record of a stored trial; ``flags`` fall back to the trial's params."""
        record = cls.from_attrs(trial.user_attrs)
        if not record.flags:
            record = record.replace(flags=dict(trial.params))
        return record

    @property
    def slo_throughput(self) -> float | None:
        """SLO-constrained output throughput (tok/s) at the operating point, if it was measured."""
        point = self.operating_point
        value = point.get("output_throughput") if isinstance(point, Mapping) else None
        return float(value) if isinstance(value, int | float) else None


_TUPLES = frozenset({"violations", "argv", "probes", "log_lines"})


def _cause(value: object) -> Cause | None:
    try:
        return Cause(str(value))
    except ValueError:
        return None


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def outcome_attrs(cause: Cause | None, summary: str) -> dict[str, Any]:
    """The attributes that close a trial: its outcome, cause (``None`` for a measured trial) and summary."""
    return {
        "outcome": "complete" if cause is None else "pruned",
        "cause": cause.value if cause is not None else None,
        "summary": summary,
    }
