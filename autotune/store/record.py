"""The trial record: everything autotune stores on a trial, and the only place that knows the storage keys.

Optuna keeps a trial's facts as user attributes (JSON values under string keys). :class:`TrialRecord` is
their typed form: the tuner builds one and stores :meth:`TrialRecord.to_attrs`; readers (the feasibility
check, export, reports, status) use :meth:`TrialRecord.from_trial`. Nested facts that only a human or a
report reads (probes, capacity, server deltas, memory predictions) stay JSON mappings.

optuna-dashboard shows at most :data:`DASHBOARD_ATTR_LIMIT` characters of an attribute's JSON, so the
attributes stored on a trial are kept within it (:func:`stored_attrs`: ``probes`` keeps each probe's
rate, verdict and throughput, other values are rounded or shortened) and, when anything was shortened,
the whole record is written to ``<workdir>/trials/<n>/record.json`` (:data:`RECORD_FILE`):
:func:`full_record` reads it back. Constraints are stored where both Optuna and optuna-dashboard read them
(:func:`set_constraints`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial

from autotune.errors import StudyError
from autotune.flags import FlagValue
from autotune.outcome import Cause
from autotune.store import optuna_private

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
    """True on the trial of vLLM's defaults (the baseline every gain is measured against): it launches
    with none of the tuned flags."""
    reported_defaults: Json | None = None
    """On the defaults' trial: the effective value of each tuned flag as the server reported it (start-up
    log, ``vllm:cache_config_info``; :mod:`autotune.server.effective`), and ``_source`` naming where each
    came from. A flag the server did not report is missing."""
    default_warnings: tuple[str, ...] = ()
    """On the defaults' trial: where the space's declared defaults, or its values, differ from what the
    server reported, one sentence each."""
    worker: str | None = None
    """The tuner process that ran it (``host:pid:create_time``)."""
    launched: bool | None = None
    violations: tuple[str, ...] = ()
    """Known constraints the config broke (rejected before launch)."""
    repeat_of: int | None = None
    """The trial whose identical config already failed to start (not launched again)."""
    beyond: int | None = None
    """The trial that failed to start for memory and that this config asks at least as much memory as
    (not launched: :mod:`autotune.predict.boundary`)."""
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
    """The metrics of the highest passing probe (``vllm bench serve`` keys) and its ``request_rate``."""
    estimate: Json | None = None
    """The SLO boundary estimated from every probe (:meth:`autotune.load.ratesearch.Estimate.as_dict`):
    the rate, the SLO-constrained throughput and their intervals, the binding term."""
    reference: Json | None = None
    """The probe at the study's reference load, where the latency objectives are read (one load for every
    config, :mod:`autotune.study.reference`): ``request_rate``, its ``source``, whether it ``passed`` the
    SLOs and ``why``, and its metrics (``vllm bench serve`` keys)."""
    curve: Json | None = None
    """Each finite-rate probe that ran its course: its rate and the value of each SLO term in seconds, and
    the saturation probe's completed requests per second, ``{"terms": [key, ...], "points": [[rate,
    value, ...], ...], "capacity": x}`` (what the surrogate calibrates to:
    :mod:`autotune.predict.surrogate`)."""
    surrogate: Json | None = None
    """On a trial the surrogate proposed: what it predicted (``slo_rate`` in requests per second with
    ``lo``/``hi``, ``slo_throughput``) and how many measured trials it was calibrated on."""
    preemptions: float | None = None
    preemption_storm: bool | None = None
    log_lines: tuple[str, ...] = ()
    diagnosis: Json | None = None
    """Numbers read from the failure's log lines (GiB where the key ends in ``_gib``)."""
    gpu: str | None = None
    """The device the trial ran on, as NVML names it (``2 x NVIDIA H100 80GB HBM3`` for a set); None
    without one."""
    gpu_driver: str | None = None
    """The GPU driver's version as NVML reported it at the trial."""
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
        """SLO-constrained output throughput (tok/s) at the estimated boundary, if it was measured (records
        from before the estimate: the highest passing probe's measured throughput)."""
        est = self.estimate
        value = est.get("slo_throughput") if isinstance(est, Mapping) else None
        if value is None:
            point = self.operating_point
            value = point.get("output_throughput") if isinstance(point, Mapping) else None
        return float(value) if isinstance(value, int | float) else None

    @property
    def slo_throughput_interval(self) -> tuple[float, float] | None:
        """The interval of the SLO-constrained throughput (tok/s; the upper end inf when unbounded), or
        ``None`` when none was estimated."""
        est = self.estimate
        if not isinstance(est, Mapping):
            return None
        lo, hi = est.get("slo_throughput_lo"), est.get("slo_throughput_hi")
        if not isinstance(lo, int | float):
            return None
        return float(lo), float(hi) if isinstance(hi, int | float) else math.inf


_TUPLES = frozenset({"violations", "argv", "probes", "log_lines", "default_warnings"})


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


# ----------------------------------------------------------------------------------------------
# Within optuna-dashboard's limits; the whole record in the trial's folder
# ----------------------------------------------------------------------------------------------

DASHBOARD_ATTR_LIMIT = 1024
"""optuna-dashboard cuts an attribute's JSON (``json.dumps``, default separators) at this many characters:
``MAX_ATTR_LENGTH`` in ``optuna_dashboard/_serializer.py`` (strings and numbers are shown whole)."""

RECORD_FILE = "record.json"
"""The whole record of a trial whose stored attributes were shortened, in ``<workdir>/trials/<n>/``."""

DETAIL_KEY = "detail"
"""The user attribute that names :data:`RECORD_FILE` (relative to the study's workdir) when it was written."""

_PROBE_KEYS = ("rate", "status", "completed", "failed", "output_throughput")
"""What each probe keeps on the trial (the same keys as the whole probe, so readers of either work)."""


def _size(value: Any) -> int:
    return len(json.dumps(value, default=str))


def _fits(value: Any) -> bool:
    return (
        isinstance(value, str | int | float | bool) or value is None or _size(value) <= DASHBOARD_ATTR_LIMIT
    )


def _round(value: Any, digits: int = 4) -> Any:
    """Floats to ``digits`` significant digits, recursively (ints, strings and booleans unchanged)."""
    if isinstance(value, float) and math.isfinite(value) and value:
        return round(value, max(0, digits - 1 - math.floor(math.log10(abs(value)))))
    if isinstance(value, Mapping):
        return {k: _round(v, digits) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_round(v, digits) for v in value]
    return value


def _shorten(key: str, value: Any) -> Any:
    """``value`` within the dashboard's limit: a compact form first, then as much of it as fits (a list
    keeps its last items, a mapping its first keys)."""
    if key == "probes" and isinstance(value, list | tuple):
        value = [{k: p.get(k) for k in _PROBE_KEYS if k in p} if isinstance(p, Mapping) else p for p in value]
    value = _round(value)
    if _fits(value):
        return value
    if isinstance(value, list):
        kept = list(value)
        while kept and not _fits(kept):
            kept.pop(0)
        return kept
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for k, v in value.items():
            if not _fits({**out, k: v}):
                break
            out[k] = v
        return out
    return value


def stored_attrs(attrs: Mapping[str, Any]) -> tuple[dict[str, Any], bool]:
    """The attributes to store on a trial, each within :data:`DASHBOARD_ATTR_LIMIT`, and whether any was
    shortened (then the whole record belongs in the trial's folder: :func:`save_record`)."""
    out: dict[str, Any] = {}
    shortened = False
    for key, value in attrs.items():
        if _fits(value):
            out[key] = value
        else:
            out[key] = _shorten(key, value)
            shortened = True
    return out, shortened


def save_record(trial_dir: Path, workdir: Path, attrs: Mapping[str, Any]) -> dict[str, Any]:
    """Write the whole record ``attrs`` to ``trial_dir/record.json`` (atomically); returns the attribute
    that names it (relative to ``workdir``). Raises :class:`StudyError` when it cannot be written."""
    path = trial_dir / RECORD_FILE
    try:
        trial_dir.mkdir(parents=True, exist_ok=True)
        temp = path.with_suffix(".tmp")
        temp.write_text(json.dumps(dict(attrs), indent=1, default=str) + "\n", encoding="utf-8")
        os.replace(temp, path)
    except OSError as exc:
        raise StudyError(f"cannot write the trial record {str(path)!r}: {exc.strerror or exc}") from exc
    try:
        shown = str(path.relative_to(workdir))
    except ValueError:
        shown = str(path)
    return {DETAIL_KEY: shown}


def full_record(trial: FrozenTrial, trial_dir: Path) -> TrialRecord:
    """The record of a stored trial with every detail: ``trial_dir/record.json`` over the trial's
    attributes when it was written (and can be read here), else :meth:`TrialRecord.from_trial`."""
    record = TrialRecord.from_trial(trial)
    if DETAIL_KEY not in trial.user_attrs:
        return record
    try:
        whole = json.loads((trial_dir / RECORD_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return record  # another host's folder, or gone: the attributes are what is known
    if not isinstance(whole, dict):
        return record
    full = TrialRecord.from_attrs({**trial.user_attrs, **whole})
    return full if full.flags else full.replace(flags=dict(trial.params))


# ----------------------------------------------------------------------------------------------
# Constraints
# ----------------------------------------------------------------------------------------------

CONSTRAINTS_KEY = "constraints"
"""The trial system attribute optuna-dashboard reads constraints from: a list of floats
(``optuna_dashboard/_serializer.py``, ``serialize_frozen_trial``). Optuna 5 reads it too, as constraints
named ``"0"``, ``"1"``, ... (``optuna/study/_constrained_optimization.py``)."""

_NAMED_PREFIX = CONSTRAINTS_KEY + ":"
"""Optuna 5's named constraints (``trial.set_constraint``): what studies made before this was stored."""


def named_constraints(trials: Sequence[FrozenTrial]) -> bool:
    """Whether a study's trials carry Optuna 5's named constraints (a study made by an earlier autotune):
    its new trials must too, since GPSampler requires the same constraint keys on every trial."""
    return any(key.startswith(_NAMED_PREFIX) for t in trials for key in t.system_attrs)


def set_constraints(
    trial: optuna.Trial, names: Sequence[str], values: Sequence[float], *, named: bool
) -> None:
    """Store a trial's constraints (<= 0 is feasible): as the list optuna-dashboard shows and Optuna reads
    (``named`` false), or, in a study that already has them, as Optuna 5's named constraints.

    Writing both would give Optuna every constraint twice (GPSampler would model each twice)."""
    if named:
        for name, value in zip(names, values, strict=True):
            trial.set_constraint(name, float(value))
        return
    # Optuna 5 has no public writer of the list form (as Optuna's own constraints_func path did).
    optuna_private.set_system_attr(trial, CONSTRAINTS_KEY, [float(v) for v in values])
