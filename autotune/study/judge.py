"""A measured trial's outcome from its rate search: its objectives at the SLO boundary, or the cause it
ended with (crashed under load, SLO unreachable), and a preemption storm noted in its summary."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from autotune.inputs.slo_terms import parse_metric_key
from autotune.inputs.spec import OBJECTIVE_METRICS, Objective, objective_unit
from autotune.load.ratesearch import RateSearchResult, fmt_rate
from autotune.outcome import Cause, Diagnosis, TrialOutcome
from autotune.store.record import TrialRecord
from autotune.study.reference import AtReference
from autotune.units import format_figure

PREEMPTION_STORM_RATIO = 0.1
"""Preemptions per completed request at the operating point from which it is called a storm."""


def objective_value(objective: Objective, result: RateSearchResult, at: AtReference | None = None) -> float:
    """An objective's value: throughputs at the estimated SLO boundary (tok/s or req/s); latencies in
    milliseconds at the reference load (``at``), else at the boundary (interpolated between the probes
    around it)."""
    est, point = result.estimate, result.metrics
    assert est is not None and point is not None
    if objective.metric == "slo_throughput":
        return est.slo_throughput
    if objective.metric == "request_throughput":
        return point.request_throughput if est.kind == "saturation" else est.rate
    if objective.metric == "goodput":
        return point.goodput
    key = parse_metric_key(objective.metric)
    shared = at.latency_ms(key.metric, key.statistic) if at is not None else None
    if shared is not None and math.isfinite(shared):
        return shared
    value = result.value_at(key.metric, key.statistic)
    return (point.dist(key.metric).get(key.statistic) if value is None else value) * 1000.0


def with_diagnosis(record: TrialRecord, diagnosis: Diagnosis) -> TrialRecord:
    """``record`` with the server log's lines and the numbers of ``diagnosis``."""
    return record.replace(log_lines=diagnosis.lines, diagnosis=dict(diagnosis.extras))


def judge(
    result: RateSearchResult,
    crash: Diagnosis | None,
    record: TrialRecord,
    objectives: Sequence[Objective],
    at: AtReference | None = None,
) -> TrialOutcome:
    """The outcome of a rate search (``result``) on a server that ran (``crash``: it died or turned
    unhealthy after the search), its probes, curve and operating point added to ``record``; latency
    objectives read from ``at``, the probe at the reference load, when there is one."""
    record = record.replace(
        probes=tuple(p.as_dict() for p in result.probes),
        curve=result.curve(),
        probe_seconds=round(result.probe_seconds, 3),
        server_delta=result.server_delta,
    )
    diagnosis = crash or result.crash
    if diagnosis is not None:
        record = with_diagnosis(record, diagnosis)
        return TrialOutcome(
            cause=Cause.CRASHED_UNDER_LOAD, summary=diagnosis.summary, attrs=record.to_attrs()
        )
    point = result.metrics
    if point is None or result.estimate is None:
        return TrialOutcome(
            cause=Cause.SLO_UNREACHABLE,
            summary=result.reason,
            constraints=result.constraints,
            attrs=record.to_attrs(),
        )
    operating = result.operating
    assert operating is not None
    rate = operating.rate
    finite = math.isfinite(rate)
    record = record.replace(
        operating_point={"request_rate": rate if finite else None, **point.as_dict()},
        estimate=result.estimate.as_dict(),
        reference=at.as_record() if at is not None else None,
    )
    values = tuple(objective_value(o, result, at) for o in objectives)
    summary = ", ".join(
        f"{o.metric}={format_figure(v, objective_unit(o.metric))}"
        for o, v in zip(objectives, values, strict=True)
    )
    if at is not None and len(values) > sum(o.metric in OBJECTIVE_METRICS for o in objectives):
        summary += f" at {fmt_rate(at.reference.rate)} req/s"
    return TrialOutcome(
        cause=None,
        summary=f"{summary}; {result.reason}",
        values=values,
        constraints=result.constraints,
        attrs=record.to_attrs(),
    )


def note_preemptions(outcome: TrialOutcome) -> TrialOutcome:
    """Record the preemptions at the operating point (``server_delta``) and flag a storm in the summary.

    A storm: at least :data:`PREEMPTION_STORM_RATIO` preemptions per completed request. It is a note, not a
    constraint: every trial must carry the same constraint keys (GPSampler requires it), and the cost of
    preemption (recomputed prefills) is already charged by the SLO terms and the throughput objective at
    the operating point. The note tells the user the KV cache is the binding limit of that config.
    """
    record = TrialRecord.from_attrs(outcome.attrs)
    delta = record.server_delta
    count = delta.get("preemptions") if isinstance(delta, Mapping) else None
    if not isinstance(count, int | float) or count <= 0:
        return outcome
    point = record.operating_point
    completed = point.get("completed") if isinstance(point, Mapping) else None
    if not isinstance(completed, int | float) and record.probes:
        completed = record.probes[-1].get("completed")
    per_request = count / completed if isinstance(completed, int | float) and completed > 0 else None
    storm = per_request is None or per_request >= PREEMPTION_STORM_RATIO
    attrs = {**outcome.attrs, **TrialRecord(preemptions=count, preemption_storm=storm).to_attrs()}
    summary = outcome.summary
    if storm:
        summary += f"; preemption storm: {count:.0f} preemptions (KV cache too small for this batch)"
    return TrialOutcome(outcome.cause, summary, outcome.values, outcome.constraints, attrs)
