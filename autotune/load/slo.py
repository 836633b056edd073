"""Judging a probe against the SLO (terms and an error budget): verdicts, sample counts and early stop.

The terms themselves (``ttft:p95<=500ms``) are parsed by :mod:`autotune.slo_terms`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from autotune.load.metrics import ProbeMetrics, request_values
from autotune.load.records import Progress
from autotune.slo_terms import SloTerm
from autotune.spec import SloSection

# ----------------------------------------------------------------------------------------------
# Evaluation
# ----------------------------------------------------------------------------------------------

Status = Literal["pass", "fail", "insufficient"]


def samples_needed(term: SloTerm, min_tail_samples: int) -> int:
    """Fewest samples a term needs: ``ceil(k / (1 - N/100))`` for a pN term, 1 for mean and max."""
    q = term.quantile
    if q is None:
        return 1
    return math.ceil(min_tail_samples / (1.0 - q) - 1e-9)


@dataclass(frozen=True)
class TermResult:
    """One term judged on a probe: measured value, relative violation, and whether it could be judged."""

    term: SloTerm
    value_s: float
    violation: float
    """``(value - limit) / limit``: <= 0 when the term holds."""
    samples: int
    needed: int

    @property
    def passed(self) -> bool:
        """The value is within the limit (regardless of sample count)."""
        return self.value_s <= self.term.limit_s

    @property
    def sufficient(self) -> bool:
        """There were enough samples to judge the term."""
        return self.samples >= self.needed


@dataclass(frozen=True)
class SloVerdict:
    """A probe judged against the SLO: pass, fail or insufficient (too few samples), and why."""

    status: Status
    terms: tuple[TermResult, ...]
    failed_fraction: float
    error_budget: float
    reasons: tuple[str, ...]

    @property
    def passed(self) -> bool:
        """True only for a ``pass`` (``insufficient`` is not a pass)."""
        return self.status == "pass"

    @property
    def constraints(self) -> tuple[float, ...]:
        """Relative violations of each term, then ``failed_fraction - error_budget`` (all <= 0 = pass)."""
        return (*(t.violation for t in self.terms), self.failed_fraction - self.error_budget)


def evaluate(slo: SloSection, metrics: ProbeMetrics, *, min_tail_samples: int = 5) -> SloVerdict:
    """Judge ``metrics`` against ``slo``.

    ``fail`` when the failed fraction exceeds the error budget, when nothing completed, or when a term with
    enough samples is violated; else ``insufficient`` when some term has too few samples (a pN term needs
    ``min_tail_samples / (1 - N/100)``); else ``pass``.
    """
    results: list[TermResult] = []
    reasons: list[str] = []
    for term in slo.terms:
        dist = metrics.dist(term.metric)
        value = dist.get(term.statistic)
        results.append(
            TermResult(
                term=term,
                value_s=value,
                violation=(value - term.limit_s) / term.limit_s,
                samples=dist.n,
                needed=samples_needed(term, min_tail_samples),
            )
        )
    fail = False
    if metrics.failed_fraction > slo.error_budget:
        fail = True
        reasons.append(
            f"{metrics.failed} of {metrics.completed + metrics.failed} requests failed "
            f"({metrics.failed_fraction:.1%} > error budget {slo.error_budget:.1%})"
        )
    if metrics.completed == 0:
        fail = True
        reasons.append("no request completed")
    for r in results:
        if r.sufficient and not r.passed:
            fail = True
            reasons.append(
                f"{r.term.key} = {r.value_s * 1e3:.1f} ms > {r.term.limit_s * 1e3:g} ms (+{r.violation:.0%})"
            )
    if fail:
        status: Status = "fail"
    elif any(not r.sufficient for r in results):
        status = "insufficient"
        reasons.extend(
            f"{r.term.key}: {r.samples} samples, needs {r.needed}" for r in results if not r.sufficient
        )
    else:
        status = "pass"
    return SloVerdict(
        status=status,
        terms=tuple(results),
        failed_fraction=metrics.failed_fraction,
        error_budget=slo.error_budget,
        reasons=tuple(reasons),
    )


# ----------------------------------------------------------------------------------------------
# Early stop
# ----------------------------------------------------------------------------------------------


class EarlyStop:
    """A :data:`~autotune.load.records.StopCheck` that says when a probe has clearly failed.

    A pN term on ttft, tpot or e2el is clearly violated once more than ``(1 - N/100) × planned`` requests
    exceed its limit: finished ones by their value, and in-flight ones whose elapsed time already exceeds
    a TTFT limit (no first chunk yet) or an E2EL limit. A max term fails at the first such request, an
    ``itl:max`` term at the first finished gap above it. The error budget is clearly exceeded once more
    than ``error_budget × planned`` requests failed. Mean terms are never judged early.
    Finished records are consumed incrementally, so each call costs time in the new records only.
    """

    def __init__(self, slo: SloSection, planned: int) -> None:
        self._slo = slo
        self._planned = planned
        self._terms = [
            t for t in slo.terms if t.statistic != "mean" and (t.metric != "itl" or t.statistic == "max")
        ]
        self._allowed = [(1.0 - t.quantile) * planned if t.quantile is not None else 0.0 for t in self._terms]
        self._counts = [0] * len(self._terms)
        self._failed = 0
        self._seen = 0

    def for_share(self, planned: int) -> EarlyStop:
        """A fresh check with the same SLO for a share of ``planned`` requests (one worker's share)."""
        return EarlyStop(self._slo, planned)

    def __call__(self, progress: Progress) -> str | None:
        """Consume new finished records and in-flight state; return why the probe failed, or None."""
        new = progress.finished[self._seen :]
        self._seen += len(new)
        for rec in new:
            if not rec.success:
                self._failed += 1
                continue
            vals = request_values(rec)
            for k, term in enumerate(self._terms):
                if term.metric == "itl":
                    if any(g > term.limit_s for g in rec.itls):
                        self._counts[k] += 1
                elif term.metric == "tpot" and rec.tokens <= 1:
                    continue
                elif vals[term.metric] > term.limit_s:
                    self._counts[k] += 1
        budget = self._slo.error_budget * self._planned
        if self._failed > budget:
            return (
                f"{self._failed} failed requests exceed the error budget "
                f"({self._slo.error_budget:.1%} of {self._planned})"
            )
        now = progress.now
        for k, term in enumerate(self._terms):
            count = self._counts[k]
            if term.metric == "ttft":
                count += sum(
                    1
                    for f in progress.in_flight
                    if f.first_chunk_time is None and now - f.send_time > term.limit_s
                )
            elif term.metric == "e2el":
                count += sum(1 for f in progress.in_flight if now - f.send_time > term.limit_s)
            if count > self._allowed[k]:
                return (
                    f"{count} of {self._planned} planned requests already exceed {term} "
                    f"(at most {self._allowed[k]:.1f} may)"
                )
        return None
