"""SLO-constrained throughput: where the first SLO term reaches its limit, estimated with an interval.

1. A saturation probe (rate = inf, ``saturation_requests`` requests at once) gives a first estimate of
   capacity ``R_max`` (its achieved request rate; for the ``concurrency`` process, its mean concurrency).
   If even it meets every SLO term, that is the operating point.
2. Then probes at finite rates, each after a warm-up (the p90 end-to-end latency of the previous probe,
   at least :data:`WARMUP_MIN_S`, at most ``probe_duration``: a request's lifetime, so that the
   server holds as many requests as it will in its steady state), judging a window of
   ``probe_duration`` or :data:`WINDOW_LIFETIMES` lifetimes, whichever is longer, on their steady
   state only (:class:`~autotune.load.probe.ProbeSchedule`). Every probe's value of every term is a point
   on that term's latency-against-rate curve; :mod:`autotune.load.crossing` estimates where each curve
   reaches its limit, with an interval. The first probe goes to ``first_guess × R_max``; while every
   probe passed (or failed), the next one goes where the points extrapolate to the limit, at most 30 %
   up (or 50 % down); once a term's crossing is bracketed, the next probe goes just past the estimate
   (half the precision), on the other side from the last probe, which closes the bracket around it.
3. The search stops when the bracket around the estimate is no wider than ``measurement.precision`` on
   each side (however wide the sampling noise: the bracket is what comparisons between configs on the
   same stream are left with), or after ``max_probes``. A probe fails when its verdict is not ``pass``,
   when it was stopped early (clearly failed), or when it over-saturated the server (outstanding requests
   grew without bound, or the server's waiting queue did). No passing rate → ``slo_unreachable``.

The SLO-constrained throughput is the estimated rate times the mean output tokens of the judged requests:
the output tokens per second the server sustains at that rate in its steady state (the probes' own
``output_throughput`` divides by a duration that includes a ramp-up and a drain, and reads low).
The probes themselves are :class:`~autotune.load.probe.Prober`'s (or the dry run's, on the simulator).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from autotune.errors import InvalidMeasurementError
from autotune.inputs.slo_terms import SloTerm
from autotune.inputs.spec import MeasurementSpec, SloSection
from autotune.load.crossing import Crossing, Point, cross, interpolate, point
from autotune.load.metrics import ProbeMetrics, percentile
from autotune.load.probe import Probe, ProbeOutcome
from autotune.load.slo import SloVerdict, evaluate
from autotune.outcome import Diagnosis, ServerFailedError
from autotune.units import format_figure

#: The first finite probe's rate as a fraction of the saturation probe's throughput.
FIRST_GUESS = 0.8
#: Steps while the crossing is not bracketed: at most this factor up, and down.
MAX_STEP_UP = 1.3
MAX_STEP_DOWN = 0.5
#: Warm-up before a probe's judged requests: at least this long, at most probe_duration.
WARMUP_MIN_S = 1.0
#: A probe's judged window spans at least this many request lifetimes (p90 end-to-end latency of the
#: previous probe), and at most MAX_WINDOWS × probe_duration: a window of about one lifetime sees the
#: server's steady state barely once and reads its tail latencies low (benchmarks/precision.py).
WINDOW_LIFETIMES = 4.0
MAX_WINDOWS = 5.0
#: Below this relative distance another probe would repeat one already run (the same stream, the same
#: answer).
SAME_RATE = 0.005
#: After a probe the client could not measure validly, the next one goes this much lower (before any probe
#: passed).
UNMEASURED_STEP = 0.7


@dataclass(frozen=True)
class ProbeReport:
    """One probe as the search judged it."""

    rate: float
    requests: int
    duration_s: float
    passed: bool
    why: str
    early_stopped: bool
    outcome: ProbeOutcome
    verdict: SloVerdict

    @property
    def finite(self) -> bool:
        return math.isfinite(self.rate)

    def as_dict(self) -> dict[str, Any]:
        """A JSON-serialisable summary of the probe (for trial user attributes); multi-turn chat adds the
        p95 TTFT by turn, shared prefixes the ideal hit rate, a trace the replay's speed."""
        m = self.outcome.metrics
        return {
            "rate": None if math.isinf(self.rate) else round(self.rate, 6),
            "saturation": math.isinf(self.rate),
            "requests": self.requests,
            "completed": m.completed,
            "failed": m.failed,
            "duration_s": round(self.duration_s, 3),
            "warmup_s": round(self.outcome.warmup_s, 3),
            "passed": self.passed,
            "status": self.verdict.status,
            "why": self.why,
            "early_stopped": self.early_stopped,
            "oversaturated": self.outcome.oversaturated,
            "capacity": round(self.outcome.capacity, 6),
            "output_throughput": round(m.output_throughput, 3),
            "request_throughput": round(m.request_throughput, 6),
            "terms": {
                t.term.key: {"value_ms": round(t.value_s * 1e3, 3), "violation": round(t.violation, 4)}
                for t in self.verdict.terms
            },
            "server": self.outcome.server.as_dict() if self.outcome.server else None,
            "prompt_tokens_per_intended": self.outcome.prompt_tokens_per_intended,
            **self._traffic(),
        }

    def _traffic(self) -> dict[str, Any]:
        o = self.outcome
        out: dict[str, Any] = {}
        if o.ttft_by_turn is not None:
            out["ttft_p95_by_turn_ms"] = {k: v["p95_ms"] for k, v in o.ttft_by_turn.items()}
        if o.ideal_hit_rate is not None:
            out["prefix_hit_rate_ideal"] = o.ideal_hit_rate
        if o.trace_speed is not None:
            out["trace_speed"] = o.trace_speed
        return out


@dataclass(frozen=True)
class Estimate:
    """The SLO boundary of a search: the rate where the first term reaches its limit, with an interval."""

    kind: Literal["crossed", "above", "saturation"]
    """``crossed``: estimated between probes; ``above``: every finite probe passed (``rate`` is the
    highest, a lower bound); ``saturation``: every request at once met the SLOs."""
    rate: float
    lo: float
    hi: float
    binding: str
    """The term that reaches its limit first (``error budget`` for failures)."""
    crossings: tuple[Crossing, ...] = ()
    tokens_per_request: float = 0.0
    """Mean output tokens of a judged request (the same stream at every rate)."""
    slo_throughput: float = 0.0
    """Output tok/s at ``rate`` in the steady state (measured directly at saturation)."""
    pace: tuple[float, float] = (0.0, 0.0)
    """The warm-up and judged window (seconds) the search's next probe would have used."""
    client_limit: str = ""
    """Why the search stopped short of its precision: the client could not measure a probe at some rate
    validly (its self-check's reason, after ``measurement.invalid_retries`` repeats). An ``above`` estimate
    is then a lower bound set by the client, not by the server."""

    @property
    def half_width(self) -> float:
        """Half the interval over the estimate (inf when unbounded above)."""
        return (self.hi - self.lo) / 2 / self.rate if self.rate > 0 and math.isfinite(self.hi) else math.inf

    @property
    def throughput_interval(self) -> tuple[float, float]:
        """The interval of the SLO-constrained throughput (tok/s)."""
        if self.kind == "saturation":
            return (self.slo_throughput, self.slo_throughput)
        return (self.lo * self.tokens_per_request, self.hi * self.tokens_per_request)

    @property
    def binding_crossing(self) -> Crossing | None:
        return next((c for c in self.crossings if c.key == self.binding), None)

    def as_dict(self) -> dict[str, Any]:
        """JSON-serialisable: what a trial stores (``estimate``)."""
        lo, hi = self.throughput_interval
        crossing = self.binding_crossing
        return {
            "kind": self.kind,
            "rate": _finite(self.rate),
            "rate_lo": _finite(self.lo),
            "rate_hi": _finite(self.hi),
            "binding": self.binding,
            "tokens_per_request": round(self.tokens_per_request, 4),
            "slo_throughput": round(self.slo_throughput, 3),
            "slo_throughput_lo": _finite(lo),
            "slo_throughput_hi": _finite(hi),
            "half_width": _finite(self.half_width),
            "noise": round(crossing.noise, 5) if crossing else None,
            "batch_rates": [round(r, 6) for r in crossing.batch_rates] if crossing else [],
            "bracket": [_finite(r) for r in self.bracket],
            "pace": [round(x, 3) for x in self.pace],
            **({"client_limit": self.client_limit} if self.client_limit else {}),
        }

    @property
    def bracket(self) -> tuple[float, float]:
        """The probed rates around the estimate (the binding term's passing and failing ones)."""
        crossing = self.binding_crossing
        if crossing is None or crossing.kind != "crossed":
            return (self.lo, self.hi)
        return (crossing.below_rate, crossing.above_rate)


def _finite(x: float) -> float | None:
    return round(x, 6) if math.isfinite(x) else None


@dataclass(frozen=True)
class Start:
    """Where a search of a config found its boundary, to start another search of it there."""

    rate: float
    pace: tuple[float, float]
    """Warm-up and judged window (seconds) for the first probe."""


@dataclass(frozen=True)
class RateSearchResult:
    """Every probe of a rate search and the boundary estimated from them."""

    probes: tuple[ProbeReport, ...]
    crash: Diagnosis | None = None
    """The liveness check's diagnosis when the server died during the search (the search stopped)."""
    estimate: Estimate | None = None
    """The SLO boundary; ``None`` when no rate met the SLO."""

    def curve(self) -> dict[str, Any]:
        """Each finite-rate probe that ran its course (not stopped early) with every SLO term measured: its
        rate and each term's value in seconds; and the saturation probe's completed requests per second
        (``TrialRecord.curve``)."""
        terms: list[str] = []
        points: list[list[float]] = []
        capacity = next((p.outcome.capacity for p in self.probes if not p.finite), 0.0)
        for p in self.probes:
            if not p.finite or p.early_stopped or not p.verdict.terms:
                continue
            keys = [t.term.key for t in p.verdict.terms]
            values = [t.value_s for t in p.verdict.terms]
            if not all(math.isfinite(v) and v > 0 for v in values):
                continue
            terms = terms or keys
            if keys == terms:
                points.append([round(p.rate, 6), *(round(v, 6) for v in values)])
        out: dict[str, Any] = {"terms": terms, "points": points}
        if capacity > 0 and math.isfinite(capacity):
            out["capacity"] = round(capacity, 6)
        return out

    @property
    def operating(self) -> ProbeReport | None:
        """The passing probe closest below the estimate (the highest passing one), or ``None``."""
        est = self.estimate
        if est is None:
            return None
        passing = [p for p in self.probes if p.passed and p.rate <= est.rate * (1 + 1e-9)]
        return max(passing, key=lambda p: p.rate, default=None)

    @property
    def slo_unreachable(self) -> bool:
        """No probed rate met every SLO term."""
        return self.estimate is None

    @property
    def rate(self) -> float | None:
        """The estimated boundary (inf when the saturation probe passed), or ``None``."""
        return self.estimate.rate if self.estimate is not None else None

    @property
    def metrics(self) -> ProbeMetrics | None:
        """The operating probe's metrics, or ``None``."""
        point = self.operating
        return point.outcome.metrics if point is not None else None

    @property
    def verdict(self) -> SloVerdict | None:
        """The operating probe's SLO verdict, or ``None``."""
        point = self.operating
        return point.verdict if point is not None else None

    @property
    def r_max(self) -> float:
        """The saturation probe's capacity estimate (0.0 without probes)."""
        return self.probes[0].outcome.capacity if self.probes else 0.0

    @property
    def closest(self) -> ProbeReport | None:
        """The probe to show: the operating point, else the one closest to passing (smallest worst
        violation), ``None`` without probes."""
        if self.operating is not None:
            return self.operating
        return min(self.probes, key=lambda p: max(p.verdict.constraints), default=None)

    def value_at(self, metric: str, statistic: str) -> float | None:
        """A latency statistic (seconds) at the estimated rate, interpolated between the finite probes
        around it (the saturation probe's own when it passed); ``None`` without an estimate."""
        est = self.estimate
        if est is None:
            return None
        if est.kind == "saturation":
            return self.probes[0].outcome.metrics.value(metric, statistic)
        points = [
            (p.rate, p.outcome.metrics.value(metric, statistic))
            for p in self.probes
            if p.finite and not p.early_stopped and p.outcome.metrics.completed
        ]
        return interpolate(points, est.rate)

    @property
    def constraints(self) -> tuple[float, ...]:
        """Each term's relative violation at the estimated rate (0 for the binding one), then the failed
        fraction over the error budget at the operating probe; without an estimate, those of the probe
        that came closest to passing."""
        est = self.estimate
        point = self.operating
        if est is None or point is None:
            closest = self.closest
            return closest.verdict.constraints if closest is not None else ()
        values = []
        for result in point.verdict.terms:
            term = result.term
            value = self.value_at(term.metric, term.statistic)
            v = result.value_s if value is None else value
            values.append(min((v - term.limit_s) / term.limit_s, 0.0))
        return (*values, point.verdict.failed_fraction - point.verdict.error_budget)

    @property
    def reason(self) -> str:
        """One line: the operating point, or why no rate met the SLO."""
        if self.crash is not None:
            return f"server died during probe {len(self.probes) + 1}: {self.crash.summary}"
        est = self.estimate
        if est is not None:
            return describe(est)
        closest = self.closest
        if closest is None:
            return "no probe ran"
        return (
            f"no probed rate met the SLO ({len(self.probes)} probes, "
            f"closest at {fmt_rate(closest.rate)} req/s: {closest.why})"
        )

    @property
    def server_delta(self) -> dict[str, float | None] | None:
        """Server /metrics facts at the operating point (else the last probe), JSON-serialisable."""
        chosen = self.operating or (self.probes[-1] if self.probes else None)
        if chosen is None or chosen.outcome.server is None:
            return None
        return chosen.outcome.server.as_dict()

    @property
    def probe_seconds(self) -> float:
        """Total seconds spent probing."""
        return math.fsum(p.duration_s for p in self.probes)

    @property
    def sustained_rate(self) -> float | None:
        """The highest rate at which the SLOs hold (req/s): the estimated boundary, or the requests per
        second completed when every request at once met them; ``None`` without an estimate."""
        est = self.estimate
        if est is None:
            return None
        if est.kind == "saturation":
            return self.probes[0].outcome.metrics.request_throughput
        return est.rate

    @property
    def slo_throughput(self) -> float | None:
        """Output tokens/s at the estimated boundary (the SLO-constrained throughput), or ``None``."""
        return self.estimate.slo_throughput if self.estimate is not None else None


def describe(est: Estimate) -> str:
    """The estimate in words: ``operating point at 17.3 req/s (16.9-17.8, tpot:p95 binds)``."""
    if est.kind == "saturation":
        return "operating point at saturation (every request at once met the SLOs)"
    if est.kind == "above" and est.client_limit:
        return f"at least {fmt_rate(est.rate)} req/s, a lower bound: {est.client_limit}"
    if est.kind == "above":
        return f"every probed rate met the SLOs: at least {fmt_rate(est.rate)} req/s (not bounded above)"
    limit = f"; stopped short: {est.client_limit}" if est.client_limit else ""
    return (
        f"operating point at {fmt_rate(est.rate)} req/s ({fmt_rate(est.lo)}-{fmt_rate(est.hi)}, "
        f"{est.binding} binds{limit})"
    )


def judge(outcome: ProbeOutcome, slo: SloSection, measurement: MeasurementSpec) -> ProbeReport:
    """A probe judged: its SLO verdict, and failed when stopped early or over-saturated."""
    verdict = evaluate(slo, outcome.metrics, min_tail_samples=measurement.min_tail_samples)
    why: list[str] = []
    if outcome.early_stopped:
        why.append(f"stopped early: {outcome.stop_reason}")
    if outcome.oversaturated:
        why.append(f"over-saturated: {outcome.oversaturated}")
    if verdict.status != "pass":
        why.append(f"{verdict.status}: " + "; ".join(verdict.reasons))
    passed = not why
    return ProbeReport(
        rate=outcome.rate,
        requests=outcome.requests,
        duration_s=outcome.duration_s,
        passed=passed,
        why="; ".join(why) if why else "meets every SLO term",
        early_stopped=outcome.early_stopped,
        outcome=outcome,
        verdict=verdict,
    )


def fmt_rate(rate: float) -> str:
    """A rate for progress text as people read it: ``inf``, ``87.4``, ``1,990`` (never ``1.99e+03``)."""
    return format_figure(rate)


def estimate(
    reports: Sequence[ProbeReport], slo: SloSection, pace: tuple[float, float] = (0.0, 0.0)
) -> Estimate | None:
    """The boundary from the finite-rate probes of a search (``None`` when none passed); ``pace`` is the
    warm-up and window a next probe would use (kept on the estimate for a later search to start from)."""
    finite = [p for p in reports if p.finite]
    if not any(p.passed for p in finite):
        return None
    crossings: list[Crossing] = []
    for term in slo.terms:
        points = [_term_point(p, term) for p in finite]
        crossing = cross([q for q in points if q is not None], term)
        if crossing is not None:
            crossings.append(crossing)
    crossings.extend(_bounds(finite))
    if not crossings:
        return None
    binding = min(crossings, key=lambda c: (c.rate if c.kind != "above" else math.inf, c.rate))
    kind: Literal["crossed", "above"] = "crossed" if binding.kind == "crossed" else "above"
    if binding.kind == "below":  # no passing probe below this term's lowest failure: keep the best pass
        best = max((p for p in finite if p.passed), key=lambda p: p.rate)
        top = max(binding.rate, best.rate)
        return _estimate("above", best.rate, best.rate, top, binding.key, crossings, finite, pace)
    lo = min(c.lo for c in crossings)
    hi = min(c.hi for c in crossings)
    return _estimate(kind, binding.rate, min(lo, binding.rate), hi, binding.key, crossings, finite, pace)


def _estimate(
    kind: Literal["crossed", "above"],
    rate: float,
    lo: float,
    hi: float,
    binding: str,
    crossings: Sequence[Crossing],
    finite: Sequence[ProbeReport],
    pace: tuple[float, float],
) -> Estimate:
    tokens = [t for t in (p.outcome.tokens_per_request for p in finite if p.passed) if t is not None]
    per_request = statistics.fmean(tokens) if tokens else 0.0
    return Estimate(kind, rate, lo, hi, binding, tuple(crossings), per_request, rate * per_request, pace)


def _term_point(report: ProbeReport, term: SloTerm) -> Point | None:
    """A probe's point for ``term``: its value when judged on enough samples; censored (over, by an unknown
    amount) when this term stopped the probe early; none when another reason did, or it over-saturated."""
    outcome = report.outcome
    if report.early_stopped:
        return point(report.rate, None) if outcome.stop_term == term.key else None
    if outcome.oversaturated:
        return None
    result = next((t for t in report.verdict.terms if t.term == term), None)
    if result is None or not result.sufficient:
        return None
    return point(report.rate, result.value_s, outcome.records, term)


def _bounds(finite: Sequence[ProbeReport]) -> list[Crossing]:
    """The bounds that have no curve: below the lowest rate whose failures exceeded the error budget, and
    below the lowest that over-saturated the server (or was stopped for failures). A failure with a passing
    probe above it bounds nothing (a transient error at a low rate, as pooling treats a curve's inversion)."""
    out = []
    for key, failed in (
        ("error budget", [p.rate for p in finite if _over_budget(p)]),
        ("over-saturation", [p.rate for p in finite if p.outcome.oversaturated and not p.early_stopped]),
    ):
        failed = [r for r in failed if not any(p.passed and p.rate > r for p in finite)]
        if not failed:
            continue
        top = min(failed)
        below = [p.rate for p in finite if p.passed and p.rate < top]
        if below:
            out.append(Crossing(key, "crossed", max(below), max(below), top, 0.0, (), max(below), top))
        else:
            out.append(Crossing(key, "below", top, 0.0, top))
    return out


def _over_budget(p: ProbeReport) -> bool:
    if p.early_stopped:
        return p.outcome.stop_term == "error budget"
    return p.verdict.failed_fraction > p.verdict.error_budget


def find_slo_throughput(
    probe: Probe,
    slo: SloSection,
    measurement: MeasurementSpec,
    on_progress: Callable[[str], None] | None = None,
    *,
    first_guess: float = FIRST_GUESS,
    sleep: Callable[[float], None] = time.sleep,
    start: Start | None = None,
    rerun: bool = False,
) -> RateSearchResult:
    """Estimate the SLO boundary with as few probe-seconds as its precision needs (module docstring).

    With ``start`` (where an earlier search of the same config put the boundary, and its pace) the
    saturation probe and the search for a bracket are skipped: the first probe goes just below it.

    A :class:`~autotune.outcome.ServerFailedError` from ``probe`` ends the search: the result carries its
    diagnosis in ``crash`` (and the estimate from the probes before, if any). A probe the client cannot
    measure validly after its repeats (:class:`~autotune.errors.InvalidMeasurementError`) caps the search
    below its rate: the estimate from what was measured stands, with its ``client_limit`` (a lower bound
    where every probe below passed). The error propagates when nothing could be measured (the saturation
    probe, or no finite probe that met the SLOs) and from a finalist's ``rerun`` (one side of a paired
    comparison: a lower bound there would bias the gain). Other exceptions propagate.
    """
    reports: list[ProbeReport] = []
    try:
        return _search(probe, slo, measurement, on_progress, first_guess, reports, sleep, start, rerun)
    except ServerFailedError as exc:
        if on_progress is not None:
            on_progress(str(exc))
        return RateSearchResult(
            tuple(reports), crash=exc.diagnosis, estimate=estimate(reports, slo, (0.0, 0.0))
        )


def valid_probe(
    probe: Probe,
    rate: float,
    measurement: MeasurementSpec,
    *,
    warmup_s: float = 0.0,
    window_s: float = 0.0,
    on_progress: Callable[[str], None] | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> ProbeOutcome:
    """Run a probe, repeating it (after ``measurement.invalid_pause``) when its run failed the client's
    self-check: a busy client, not the server. After ``measurement.invalid_retries`` repeats the
    :class:`InvalidMeasurementError` propagates: the trial is given back, never recorded as data."""
    for attempt in range(measurement.invalid_retries + 1):
        try:
            return probe(rate, warmup_s, window_s)
        except InvalidMeasurementError as exc:
            if attempt == measurement.invalid_retries:
                raise
            if on_progress is not None:
                on_progress(
                    f"probe at rate {fmt_rate(rate)} repeated in {measurement.invalid_pause:g} s "
                    f"({attempt + 1} of {measurement.invalid_retries}): {exc}"
                )
            sleep(measurement.invalid_pause)
    raise AssertionError("unreachable")


def probe_at(
    probe: Probe,
    rate: float,
    slo: SloSection,
    measurement: MeasurementSpec,
    *,
    pace: tuple[float, float] = (0.0, 0.0),
    on_progress: Callable[[str], None] | None = None,
    sleep: Callable[[float], None] = time.sleep,
    label: str = "probe",
) -> ProbeReport:
    """One probe at ``rate`` (repeated as :func:`valid_probe` says), judged against the SLOs, with
    ``pace``'s warm-up and judged window (seconds; 0: the probe's own); ``on_progress`` hears its verdict
    under ``label``."""
    outcome = valid_probe(
        probe, rate, measurement, warmup_s=pace[0], window_s=pace[1], on_progress=on_progress, sleep=sleep
    )
    report = judge(outcome, slo, measurement)
    if on_progress is not None:
        status = "pass" if report.passed else "fail"
        on_progress(
            f"{label} at rate {fmt_rate(rate)}: {status} ({report.requests} requests, "
            f"{report.duration_s:.1f} s) - {report.why}"
        )
    return report


def _pace(outcome: ProbeOutcome, measurement: MeasurementSpec, quantile: float) -> tuple[float, float]:
    """The next probe's warm-up and judged window from this probe's request lifetimes (a quantile of
    its end-to-end latencies): the warm-up one lifetime (within [:data:`WARMUP_MIN_S`,
    ``probe_duration``]), the window at least :data:`WINDOW_LIFETIMES` lifetimes (within
    [``probe_duration``, :data:`MAX_WINDOWS` × ``probe_duration``])."""
    e2el = [r.e2el for r in outcome.records if r.e2el is not None]
    duration = measurement.probe_duration
    life = percentile(e2el, quantile) if e2el else duration
    warmup = min(max(life, WARMUP_MIN_S), max(duration, WARMUP_MIN_S))
    return warmup, _window_within(WINDOW_LIFETIMES * life, duration)


def _window_within(window: float, duration: float) -> float:
    """A judged window within [``duration``, :data:`MAX_WINDOWS` × ``duration``] (``probe_duration``)."""
    return min(max(window, duration), MAX_WINDOWS * duration)


def _paced_again(pace: tuple[float, float], measurement: MeasurementSpec) -> tuple[float, float]:
    """The first probe's warm-up and window when a search starts from an earlier one's ``pace``: its window
    within [``probe_duration``, :data:`MAX_WINDOWS` × ``probe_duration``] of this search's measurement, so
    a finalist's rerun with longer probes (``finalists.probe_scale``) lengthens its first probe too (0:
    the probe's own, kept)."""
    warmup, window = pace
    return warmup, window if window <= 0 else _window_within(window, measurement.probe_duration)


def _search(
    probe: Probe,
    slo: SloSection,
    measurement: MeasurementSpec,
    on_progress: Callable[[str], None] | None,
    first_guess: float,
    reports: list[ProbeReport],
    sleep: Callable[[float], None],
    start: Start | None,
    rerun: bool,
) -> RateSearchResult:
    def run(rate: float, warmup_s: float, window_s: float) -> ProbeReport:
        pace, label = (warmup_s, window_s), f"probe {len(reports) + 1}"
        report = probe_at(
            probe, rate, slo, measurement, pace=pace, on_progress=on_progress, sleep=sleep, label=label
        )
        reports.append(report)
        return report

    if start is not None:  # measured again: straight to just below the known boundary
        rate = start.rate * (1 - measurement.precision / 2)
        warmup, window = _paced_again(start.pace, measurement)
    else:
        sat = run(math.inf, 0.0, 0.0)
        r_max = sat.outcome.capacity
        if sat.passed:
            m = sat.outcome.metrics
            at_once = Estimate("saturation", math.inf, math.inf, math.inf, "", (), 0.0, m.output_throughput)
            return RateSearchResult(tuple(reports), estimate=at_once)
        if not r_max > 0 or math.isinf(r_max):
            return RateSearchResult(tuple(reports))
        warmup, window = _pace(sat.outcome, measurement, 50)
        rate = first_guess * r_max
    est: Estimate | None = None
    ceiling = math.inf  # the lowest rate at which the client could not measure a probe validly
    unmeasured: InvalidMeasurementError | None = None
    voided = 0  # probes the client could not measure: they count towards max_probes
    while len(reports) + voided < measurement.max_probes:
        try:
            report = run(rate, warmup, window)
        except InvalidMeasurementError as exc:
            # The client cannot measure here (after its repeats): what it measured below stands, and the
            # search goes on below this rate only (a lower rate loads the client less). A finalist's rerun
            # is one side of a paired comparison: a lower bound there would bias the gain, so the whole
            # round is unmeasured (neither met nor missed).
            if rerun:
                raise
            ceiling, unmeasured, voided = rate, exc, voided + 1
            if on_progress is not None:
                on_progress(f"probe at rate {fmt_rate(rate)} could not be measured: the search stays below")
            if est is not None:
                break
            rate *= UNMEASURED_STEP
            continue
        warmup, window = _pace(report.outcome, measurement, 90)
        est = estimate(reports, slo, (warmup, window))
        nxt = _next_rate(est, reports, measurement)
        if nxt is None or nxt >= ceiling * (1 - SAME_RATE):
            break
        rate = nxt
    if unmeasured is None:
        return RateSearchResult(tuple(reports), estimate=est)
    if est is None:  # nothing below the rates it could not measure met the SLOs: no figure at all
        raise unmeasured
    why = f"the client could not measure a probe at {fmt_rate(ceiling)} req/s validly ({unmeasured})"
    return RateSearchResult(tuple(reports), estimate=dataclasses.replace(est, client_limit=why))


def _next_rate(
    est: Estimate | None, reports: Sequence[ProbeReport], measurement: MeasurementSpec
) -> float | None:
    """Where the next probe goes, or ``None`` when the estimate is as precise as this search can make it."""
    finite = [p for p in reports if p.finite]
    if est is None:  # every finite probe failed: step down towards the limit
        lowest = min(finite, key=lambda p: p.rate)
        return lowest.rate * _step(lowest, down=True)
    if est.kind == "above":  # every probe passed, or a term failed only above an untested gap
        failing = [p.rate for p in finite if not p.passed and p.rate > est.rate]
        highest = max((p for p in finite if p.passed), key=lambda p: p.rate)
        nxt = highest.rate * _step(highest, down=False)
        return min(nxt, math.sqrt(highest.rate * min(failing))) if failing else nxt
    lower, upper = est.bracket  # the binding term's probes around the estimate (what is stored)
    # The bracket is narrowed to the precision even where the sampling noise is wider: every trial of a
    # study meets the same requests, so what the noise moves it moves alike in every config, while the
    # bracket is each config's own uncertainty in every comparison (docs/measurement.md).
    if (upper - lower) / 2 / est.rate <= measurement.precision:
        return None
    # Interpolating a convex curve lands on one side again and again: aim just past the estimate, on the
    # other side from the last probe, so the next probe closes the bracket from that side.
    side = 1.0 if finite[-1].passed else -1.0
    nxt = est.rate * (1.0 + side * measurement.precision / 2)
    return min(max(nxt, lower * (1 + SAME_RATE)), upper * (1 - SAME_RATE))


def _step(report: ProbeReport, *, down: bool) -> float:
    """The factor from ``report``'s rate to where its values extrapolate to the limits (elasticity 1:
    latency in proportion to rate), within :data:`MAX_STEP_UP` / :data:`MAX_STEP_DOWN`."""
    if report.early_stopped or not report.verdict.terms:
        return 0.7 if down else MAX_STEP_UP
    ratios = [t.term.limit_s / t.value_s for t in report.verdict.terms if t.value_s > 0]
    factor = min(ratios) if ratios else (0.7 if down else MAX_STEP_UP)
    if down:
        return min(max(factor, MAX_STEP_DOWN), 0.95)
    return min(max(factor, 1.05), MAX_STEP_UP)
