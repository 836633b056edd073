"""What the report shows, read from the study: one row per trial, each probe's verdict as the rate-search
strip draws it, a trial's latency against load (its curve), the best-so-far curve, the per-request
latencies of a trial's operating point (its probe file), and the run's facts.

Everything comes from :class:`autotune.store.record.TrialRecord` (the stored keys), the trials' own timestamps
and ``<workdir>/trials/<n>/probes/probe-<k>.json``; which config is best and its gain are the export's
(:mod:`autotune.results.export`), not decided here.
"""

from __future__ import annotations

import datetime
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from autotune.events import Event
from autotune.flags import FlagValue
from autotune.inputs.loader import LoadedStudy
from autotune.store.record import TrialRecord, full_record
from autotune.study.standing import is_launch
from autotune.units import format_figure


def _num(value: object) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


@dataclass(frozen=True)
class TrialRow:
    """One trial as the report shows it."""

    number: int
    state: str
    """``complete``, ``pruned`` (launched, the server failed or missed the SLOs), ``rejected`` (never
    launched), ``given back`` (the tuner's own fault: retried), ``running`` or ``queued``."""
    cause: str | None
    launched: bool
    baseline: bool
    feasible: bool
    """Complete and within every SLO constraint."""
    flags: Mapping[str, FlagValue]
    values: tuple[float, ...] | None
    slo_throughput: float | None
    interval: tuple[float, float] | None
    rate: float | None
    rate_interval: tuple[float, float] | None
    binding: str | None
    latency: Mapping[str, float | None]
    """``ttft:p95``, ``tpot:p95``, ``e2el:p99`` (ms) at the study's reference load (at the operating point
    for a trial without a probe there)."""
    start: datetime.datetime | None
    end: datetime.datetime | None
    summary: str
    probes: tuple[Mapping[str, Any], ...] = ()
    operating_rate: float | None = None
    server_version: str | None = None
    repeat_of: int | None = None
    gpu: str | None = None
    """The device it ran on, as NVML names it."""
    reference_rate: float | None = None
    """The reference load (req/s) its latencies were read at; ``None``: read at the operating point."""
    curve: Mapping[str, Any] | None = None
    """Its rate search's curve (:attr:`autotune.store.record.TrialRecord.curve`): each SLO term's value
    (seconds) at each finite probed rate, and the saturation probe's capacity."""

    @property
    def seconds(self) -> float | None:
        """Wall time from the trial's start to its end."""
        if self.start is None or self.end is None:
            return None
        return (self.end - self.start).total_seconds()

    @property
    def outcome(self) -> str:
        """``complete`` or the cause (``oom``, ...) or the state."""
        if self.state == "complete":
            return "complete"
        return self.cause or self.state


_STATES = {
    TrialState.RUNNING: "running",
    TrialState.WAITING: "queued",
    TrialState.FAIL: "given back",
}


def trial_row(trial: FrozenTrial, trial_dir: Path | None = None) -> TrialRow:
    """The report's view of one stored trial: its whole record when ``trial_dir`` holds it (the stored
    attributes keep only a short form of each probe, within optuna-dashboard's limit)."""
    record = full_record(trial, trial_dir) if trial_dir is not None else TrialRecord.from_trial(trial)
    launched = is_launch(trial) if trial.state in (TrialState.COMPLETE, TrialState.PRUNED) else False
    if trial.state == TrialState.COMPLETE:
        state = "complete" if launched else "rejected"
    elif trial.state == TrialState.PRUNED:
        state = "pruned" if launched else "rejected"
    else:
        state = _STATES.get(trial.state, trial.state.name.lower())
    estimate = record.estimate if isinstance(record.estimate, Mapping) else {}
    point = record.operating_point if isinstance(record.operating_point, Mapping) else {}
    shared = record.reference if isinstance(record.reference, Mapping) else None
    read = shared or point
    rate_lo, rate_hi = _num(estimate.get("rate_lo")), _num(estimate.get("rate_hi"))
    feasible = trial.state == TrialState.COMPLETE and all(c <= 0 for c in (trial.constraints or {}).values())
    cause = record.cause.value if record.cause is not None else None
    if state == "complete" and not launched:
        cause = "repeat"
    return TrialRow(
        number=trial.number,
        state=state,
        cause=cause,
        launched=launched,
        baseline=bool(record.baseline),
        feasible=feasible,
        flags=dict(record.flags),
        values=tuple(trial.values) if trial.values else None,
        slo_throughput=record.slo_throughput if trial.state == TrialState.COMPLETE else None,
        interval=record.slo_throughput_interval if trial.state == TrialState.COMPLETE else None,
        rate=_num(estimate.get("rate")),
        rate_interval=(rate_lo, rate_hi if rate_hi is not None else math.inf)
        if rate_lo is not None
        else None,
        binding=estimate.get("binding") if isinstance(estimate.get("binding"), str) else None,
        latency={
            "ttft:p95": _num(read.get("p95_ttft_ms")),
            "tpot:p95": _num(read.get("p95_tpot_ms")),
            "e2el:p99": _num(read.get("p99_e2el_ms")),
        },
        reference_rate=_num(shared.get("request_rate")) if shared is not None else None,
        start=trial.datetime_start,
        end=trial.datetime_complete,
        summary=record.summary or record.failed_because or record.discarded or "",
        probes=tuple(p for p in record.probes if isinstance(p, Mapping)),
        operating_rate=_num(point.get("request_rate")),
        server_version=record.server_version,
        repeat_of=record.repeat_of if record.repeat_of is not None else record.beyond,
        gpu=record.gpu,
        curve=record.curve if isinstance(record.curve, Mapping) else None,
    )


def trial_rows(study: optuna.Study, loaded: LoadedStudy | None = None) -> list[TrialRow]:
    """Every trial of the study, by number (each with its whole record from ``loaded``'s trial folders)."""
    trials = sorted(study.get_trials(deepcopy=False), key=lambda t: t.number)
    return [trial_row(t, loaded.trial_dir(t.number) if loaded is not None else None) for t in trials]


@dataclass(frozen=True)
class ProbeMark:
    """One probe of a trial's rate search as the strip draws it: where it goes on the rate axis, its
    verdict and why.

    A probe stored by this autotune carries its verdict (``passed``, ``saturation``, ``why``,
    ``capacity``: :meth:`autotune.load.ratesearch.ProbeReport.as_dict`). Older records, and the short form
    kept on a trial when its whole record is not on this host, lack some of them: the verdict is then
    derived from what is stored (the SLO verdict's ``status``, early stop and over-saturation, the terms'
    violations) and :attr:`derived` says so."""

    index: int
    """Its place in the search (1 for the first probe)."""
    rate: float | None
    """Its arrival rate (req/s); ``None`` for the saturation probe (every request at once)."""
    capacity: float | None
    """The saturation probe's measured capacity (req/s), where it is drawn; ``None`` when not stored."""
    verdict: str
    """``pass`` (met every SLO term), ``fail``, or ``saturation`` (the saturation probe, whatever its
    verdict: :attr:`passed` says it)."""
    passed: bool
    why: str
    """Its verdict in words: the stored reason, or one built from what is stored."""
    derived: bool = False
    """The verdict was derived (the probe has no ``passed`` field)."""

    @property
    def saturation(self) -> bool:
        """Whether it is the saturation probe."""
        return self.rate is None


def probe_marks(row: TrialRow) -> tuple[ProbeMark, ...]:
    """Each probe of ``row`` as the strip draws it (see :class:`ProbeMark`)."""
    curve = row.curve or {}
    return tuple(
        _probe_mark(k, probe, _num(curve.get("capacity"))) for k, probe in enumerate(row.probes, start=1)
    )


def _probe_mark(index: int, probe: Mapping[str, Any], curve_capacity: float | None) -> ProbeMark:
    """One stored probe's mark; ``curve_capacity`` is the saturation probe's capacity as the trial's curve
    keeps it (for a probe that does not)."""
    rate = _num(probe.get("rate"))
    saturated = probe.get("saturation")
    saturation = bool(saturated) if isinstance(saturated, bool) else rate is None or not math.isfinite(rate)
    stored = probe.get("passed")
    passed = stored if isinstance(stored, bool) else _derived_pass(probe)
    why = probe.get("why")
    reason = why if isinstance(why, str) and why else _derived_why(probe, passed)
    capacity = None
    if saturation:
        capacity = _num(probe.get("capacity"))
        capacity = capacity if capacity is not None else _num(probe.get("request_throughput"))
        capacity = capacity if capacity is not None else curve_capacity
        capacity = capacity if capacity is not None and capacity > 0 and math.isfinite(capacity) else None
    return ProbeMark(
        index=index,
        rate=None if saturation else rate,
        capacity=capacity,
        verdict="saturation" if saturation else "pass" if passed else "fail",
        passed=passed,
        why=reason,
        derived=not isinstance(stored, bool),
    )


def _derived_pass(probe: Mapping[str, Any]) -> bool:
    """A probe's verdict from what is stored without ``passed``: its SLO verdict's ``status`` (``pass``),
    not stopped early and not over-saturated (as the rate search judged it); without a status, every
    stored term within its limit (violation <= 0)."""
    if probe.get("early_stopped") or probe.get("oversaturated"):
        return False
    status = probe.get("status")
    if isinstance(status, str):
        return status == "pass"
    terms = probe.get("terms")
    if isinstance(terms, Mapping) and terms:
        violations = [_num(t.get("violation")) if isinstance(t, Mapping) else None for t in terms.values()]
        return all(v is not None and v <= 0 for v in violations)
    return False


def _derived_why(probe: Mapping[str, Any], passed: bool) -> str:
    """A probe's verdict in words from what is stored (no ``why``): the status, each term's value and
    how far over its limit, how many requests completed and failed, the output throughput."""
    parts = [str(probe.get("status") or ("pass" if passed else "no verdict stored"))]
    if probe.get("early_stopped"):
        parts.append("stopped early")
    if probe.get("oversaturated"):
        parts.append(f"over-saturated: {probe.get('oversaturated')}")
    terms = probe.get("terms")
    if isinstance(terms, Mapping):
        for key, term in terms.items():
            value = _num(term.get("value_ms")) if isinstance(term, Mapping) else None
            violation = _num(term.get("violation")) if isinstance(term, Mapping) else None
            if value is not None:
                over = f" ({violation:+.0%})" if violation is not None and violation > 0 else ""
                parts.append(f"{key} = {format_figure(value, 'ms')}{over}")
    completed, failed = _num(probe.get("completed")), _num(probe.get("failed"))
    if completed is not None:
        parts.append(f"{completed:.0f} completed" + (f", {failed:.0f} failed" if failed else ""))
    throughput = _num(probe.get("output_throughput"))
    if throughput is not None:
        parts.append(format_figure(throughput, "tok/s"))
    return "; ".join(parts) + " (no reason stored with this probe)"


@dataclass(frozen=True)
class LoadCurve:
    """A trial's latency against load: each SLO term's value (ms) at each finite probed rate (req/s)."""

    trial: int
    terms: tuple[str, ...]
    """The SLO terms' keys (``ttft:p95``), in the spec's order."""
    points: tuple[tuple[float, tuple[float, ...]], ...]
    """(rate, each term's value in ms), by rate."""


def load_curve(row: TrialRow) -> LoadCurve | None:
    """``row``'s latency against load from its stored curve (the rate search's finite probes that ran
    their course), else from its probes' stored term values; ``None`` when neither holds a point."""
    curve = row.curve or {}
    terms, raw = curve.get("terms"), curve.get("points")
    points: list[tuple[float, tuple[float, ...]]] = []
    if isinstance(terms, list) and terms and isinstance(raw, list):
        for point in raw:
            values = [_num(v) for v in point] if isinstance(point, list) else []
            if len(values) == len(terms) + 1 and all(v is not None for v in values):
                rate, *rest = (float(v) for v in values if v is not None)
                points.append((rate, tuple(v * 1000 for v in rest)))
        keys = tuple(str(t) for t in terms)
    else:
        keys, points = _points_of_probes(row.probes)
    if not points:
        return None
    return LoadCurve(row.number, keys, tuple(sorted(points)))


def _points_of_probes(
    probes: Sequence[Mapping[str, Any]],
) -> tuple[tuple[str, ...], list[tuple[float, tuple[float, ...]]]]:
    """(terms, points) from the probes' own ``terms`` (``value_ms``): the finite probes not stopped early
    that measured the same terms as the first such probe (a record from before the curve was stored)."""
    keys: tuple[str, ...] = ()
    points: list[tuple[float, tuple[float, ...]]] = []
    for probe in probes:
        rate, terms = _num(probe.get("rate")), probe.get("terms")
        if rate is None or probe.get("early_stopped") or not isinstance(terms, Mapping) or not terms:
            continue
        values = [_num(t.get("value_ms")) if isinstance(t, Mapping) else None for t in terms.values()]
        found = tuple(v for v in values if v is not None and v > 0 and math.isfinite(v))
        if len(found) != len(terms):
            continue
        keys = keys or tuple(str(k) for k in terms)
        if tuple(str(k) for k in terms) == keys:
            points.append((rate, found))
    return keys, points


@dataclass(frozen=True)
class Progress:
    """The best feasible value of the first objective after each launch that ended, by launch count and by
    wall time since the study's first trial started."""

    by_launch: tuple[tuple[int, float, int], ...]
    """(launch count, best so far, the trial holding it) after each launch."""
    by_time: tuple[tuple[float, float, int], ...]
    """(hours since the start, best so far, the trial holding it) at each launch's end."""
    values: tuple[tuple[int, float, float, int], ...]
    """(launch count, hours, the launch's own value, trial) of each feasible launch."""
    hours: float
    """Wall time from the first trial's start to the last trial's end."""


def progress(rows: Sequence[TrialRow], maximize: bool) -> Progress:
    """The best-so-far curves of ``rows`` (see :class:`Progress`)."""
    starts = [r.start for r in rows if r.start is not None]
    ends = [r.end for r in rows if r.end is not None]
    origin = min(starts) if starts else None
    launched = sorted((r for r in rows if r.launched and r.end is not None), key=lambda r: (r.end, r.number))
    sign = 1.0 if maximize else -1.0
    best: tuple[float, int] | None = None
    by_launch, by_time, values = [], [], []
    for count, row in enumerate(launched, start=1):
        hours = ((row.end - origin).total_seconds() / 3600) if row.end and origin else 0.0
        if row.feasible and row.values:
            value = row.values[0]
            values.append((count, hours, value, row.number))
            if best is None or sign * value > sign * best[0]:
                best = (value, row.number)
        if best is not None:
            by_launch.append((count, best[0], best[1]))
            by_time.append((hours, best[0], best[1]))
    total = ((max(ends) - origin).total_seconds() / 3600) if ends and origin else 0.0
    return Progress(tuple(by_launch), tuple(by_time), tuple(values), total)


@dataclass(frozen=True)
class Latencies:
    """Per-request TTFT and TPOT (ms) of the judged requests of one probe (``vllm bench serve``'s
    definitions: TPOT = (E2EL - TTFT) / (output tokens - 1), for outputs of more than one token)."""

    trial: int
    path: Path
    rate: float | None
    ttft_ms: tuple[float, ...]
    tpot_ms: tuple[float, ...]


def operating_probe(loaded: LoadedStudy, row: TrialRow) -> Path | None:
    """The probe file of ``row``'s operating point (the highest passing probe, whose rate the operating
    point records); ``None`` when it is not on this host."""
    folder = loaded.trial_dir(row.number) / "probes"
    if row.operating_rate is None or not folder.is_dir():
        return None
    for index, probe in enumerate(row.probes, start=1):
        rate = _num(probe.get("rate"))
        if rate is not None and math.isclose(rate, row.operating_rate, rel_tol=1e-4):
            path = folder / f"probe-{index}.json"
            if path.is_file():
                return path
    return None


def read_latencies(trial: int, path: Path) -> Latencies | None:
    """The judged requests' TTFT and TPOT of a probe file; ``None`` when it cannot be read."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    ttfts, latencies = data.get("ttfts") or [], data.get("latencies") or []
    outputs, errors = data.get("output_lens") or [], data.get("errors") or []
    ids = data.get("request_ids") or []
    judged = data.get("judged") if isinstance(data.get("judged"), list) else None
    ttft_ms, tpot_ms = [], []
    for i, ttft in enumerate(ttfts):
        index = _request_index(ids[i] if i < len(ids) else None, i)
        if judged is not None and len(judged) == 2 and not judged[0] <= index < judged[1]:
            continue
        if (i < len(errors) and errors[i]) or i >= len(latencies) or i >= len(outputs):
            continue
        ttft_ms.append(float(ttft) * 1000)
        tokens = int(outputs[i] or 0)
        if tokens > 1:
            tpot_ms.append((float(latencies[i]) - float(ttft)) / (tokens - 1) * 1000)
    if not ttft_ms:
        return None
    return Latencies(trial, path, _num(data.get("rate")), tuple(ttft_ms), tuple(tpot_ms))


def _request_index(request_id: object, position: int) -> int:
    """The request's index in its probe's plan: the last part of its ``X-Request-Id``
    (``autotune-<run>-p<k>-<index>``), else its position in the file."""
    if isinstance(request_id, str):
        tail = request_id.rsplit("-", 1)[-1]
        if tail.isdigit():
            return int(tail)
    return position


def tuner_seconds(events: Sequence[Event]) -> float | None:
    """Wall time the tuners ran, from the event log: each tuner's first to last event, overlapping runs
    counted once (several workers, or a resume after a pause, are not added up twice); ``None`` without
    events."""
    spans: dict[str, list[float]] = {}
    for event in events:
        span = spans.setdefault(event.worker, [event.time, event.time])
        span[0], span[1] = min(span[0], event.time), max(span[1], event.time)
    total, end = 0.0, -math.inf
    for lo, hi in sorted(spans.values()):
        if hi <= end:
            continue
        total += hi - max(lo, end)
        end = hi
    return total if spans else None
