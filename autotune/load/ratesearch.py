"""SLO-constrained throughput: the highest arrival rate that meets every SLO term, in few probe-seconds.

1. A saturation probe (rate = inf, ``saturation_requests`` requests) gives an upper bound ``R_max`` (its
   achieved request throughput; for the ``concurrency`` arrival process, its mean concurrency). If it meets
   every SLO term, that is the operating point.
2. Otherwise bisection between the best passing and the lowest failing rate, starting at
   ``first_guess × R_max``, until ``passing >= (1 - rate_tolerance) × failing`` or ``max_probes``.
   ``R_max`` is only a burst's estimate (its drain tail lowers its average): while no finite rate has
   failed, a pass is followed by a probe at the bracket's top, and a pass there raises the top by
   ``ABOVE_BURST``; the first failure confirms the top and bisection takes over.
3. A probe fails when its verdict is not ``pass``, when it was stopped early (clearly failed), or when it
   over-saturated the server (outstanding requests grew without bound, or the server's waiting queue did).
   No passing rate → ``slo_unreachable``.

The probes themselves are :class:`~autotune.load.probe.Prober`'s (or the dry run's, on the simulator).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from autotune.errors import InvalidMeasurementError
from autotune.load.metrics import ProbeMetrics
from autotune.load.probe import Probe, ProbeOutcome
from autotune.load.slo import SloVerdict, evaluate
from autotune.outcome import Diagnosis, ServerFailedError
from autotune.spec import MeasurementSpec, SloSection

#: The first bisection guess as a fraction of the saturation throughput.
FIRST_GUESS = 0.7
#: When every probe up to the burst estimate passed, the unconfirmed top of the bracket grows by this.
ABOVE_BURST = 1.5


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

    def as_dict(self) -> dict[str, Any]:
        """A JSON-serialisable summary of the probe (for trial user attributes)."""
        m = self.outcome.metrics
        return {
            "rate": None if math.isinf(self.rate) else round(self.rate, 6),
            "saturation": math.isinf(self.rate),
            "requests": self.requests,
            "completed": m.completed,
            "failed": m.failed,
            "duration_s": round(self.duration_s, 3),
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
        }


@dataclass(frozen=True)
class RateSearchResult:
    """Every probe of a rate search; the operating point is the passing probe of the highest rate."""

    probes: tuple[ProbeReport, ...]
    crash: Diagnosis | None = None
    """The liveness check's diagnosis when the server died during the search (the search stopped)."""

    @property
    def operating(self) -> ProbeReport | None:
        """The passing probe of the highest rate, or ``None`` (no rate met the SLO)."""
        return max((p for p in self.probes if p.passed), key=lambda p: p.rate, default=None)

    @property
    def slo_unreachable(self) -> bool:
        """No probed rate met every SLO term."""
        return self.operating is None

    @property
    def rate(self) -> float | None:
        """The best passing rate (inf when the saturation probe passed), or ``None``."""
        point = self.operating
        return point.rate if point is not None else None

    @property
    def metrics(self) -> ProbeMetrics | None:
        """The operating point's metrics, or ``None``."""
        point = self.operating
        return point.outcome.metrics if point is not None else None

    @property
    def verdict(self) -> SloVerdict | None:
        """The operating point's SLO verdict, or ``None``."""
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

    @property
    def best_violations(self) -> tuple[float, ...]:
        """The operating point's constraint values (term violations, then failed fraction - budget)."""
        return self.verdict.constraints if self.verdict is not None else ()

    @property
    def lowest_violations(self) -> tuple[float, ...]:
        """Constraints of the probe that came closest to passing (smallest worst violation)."""
        closest = self.closest
        return closest.verdict.constraints if closest is not None else ()

    @property
    def reason(self) -> str:
        """One line: the operating point, or why no rate met the SLO."""
        if self.crash is not None:
            return f"server died during probe {len(self.probes) + 1}: {self.crash.summary}"
        closest = self.closest
        if closest is None:
            return "no probe ran"
        if closest.passed:
            return f"operating point at {fmt_rate(closest.rate)} req/s"
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
    def slo_throughput(self) -> float | None:
        """Output tokens/s at the operating point (the SLO-constrained throughput), or ``None``."""
        return self.metrics.output_throughput if self.metrics is not None else None


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
    """A rate for progress text: ``inf`` or three significant digits."""
    return "inf" if math.isinf(rate) else f"{rate:.3g}"


def find_slo_throughput(
    probe: Probe,
    slo: SloSection,
    measurement: MeasurementSpec,
    on_progress: Callable[[str], None] | None = None,
    *,
    first_guess: float = FIRST_GUESS,
    sleep: Callable[[float], None] = time.sleep,
) -> RateSearchResult:
    """Search the highest rate meeting ``slo`` with as few probe-seconds as possible (module docstring).

    A :class:`~autotune.outcome.ServerFailedError` from ``probe`` ends the search: the result carries its
    diagnosis in ``crash`` (and the best rate passed before, if any). Other exceptions (invalid
    measurement) propagate.
    """
    reports: list[ProbeReport] = []
    try:
        return _search(probe, slo, measurement, on_progress, first_guess, reports, sleep)
    except ServerFailedError as exc:
        if on_progress is not None:
            on_progress(str(exc))
        return RateSearchResult(tuple(reports), crash=exc.diagnosis)


def _valid_probe(
    probe: Probe,
    rate: float,
    measurement: MeasurementSpec,
    on_progress: Callable[[str], None] | None,
    sleep: Callable[[float], None],
) -> ProbeOutcome:
    """Run a probe, repeating it (after ``measurement.invalid_pause``) when its run failed the client's
    self-check: a busy client, not the server. After ``measurement.invalid_retries`` repeats the
    :class:`InvalidMeasurementError` propagates: the trial is given back, never recorded as data."""
    for attempt in range(measurement.invalid_retries + 1):
        try:
            return probe(rate)
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


def _search(
    probe: Probe,
    slo: SloSection,
    measurement: MeasurementSpec,
    on_progress: Callable[[str], None] | None,
    first_guess: float,
    reports: list[ProbeReport],
    sleep: Callable[[float], None],
) -> RateSearchResult:
    def run(rate: float) -> ProbeReport:
        report = judge(_valid_probe(probe, rate, measurement, on_progress, sleep), slo, measurement)
        reports.append(report)
        if on_progress is not None:
            status = "pass" if report.passed else "fail"
            on_progress(
                f"probe {len(reports)} at rate {fmt_rate(rate)}: {status} "
                f"({report.requests} requests, {report.duration_s:.1f} s) - {report.why}"
            )
        return report

    sat = run(math.inf)
    r_max = sat.outcome.capacity
    if sat.passed or not r_max > 0 or math.isinf(r_max):
        return RateSearchResult(tuple(reports))
    best: ProbeReport | None = None
    lo = 0.0
    hi = r_max
    # A burst's throughput only estimates capacity: until a finite-rate probe fails, the top of the
    # bracket is unconfirmed, and a pass close to it sends the search above it.
    confirmed = False
    rate = first_guess * r_max
    tolerance = measurement.rate_tolerance
    while len(reports) < measurement.max_probes:
        report = run(rate)
        if report.passed:
            best, lo = report, rate
        else:
            hi, confirmed = rate, True
        if not confirmed:  # passed below an unconfirmed top: probe the top, then raise it
            if rate >= hi:
                hi *= ABOVE_BURST
            rate = hi
            continue
        if best is not None and lo >= (1.0 - tolerance) * hi:
            break
        rate = (lo + hi) / 2
    return RateSearchResult(tuple(reports))
