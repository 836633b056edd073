"""Judging a probe against the SLO (terms and an error budget): verdicts, sample counts and early stop.

The terms themselves (``ttft:p95<=500ms``) are parsed by :mod:`autotune.inputs.slo_terms`.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Literal

from autotune.inputs.slo_terms import SloTerm
from autotune.inputs.spec import SloSection
from autotune.load.metrics import ProbeMetrics, request_values
from autotune.load.records import Finished, Progress, Stopped

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


CLEAR_MARGIN = 2.0
"""A pN term stops a probe early once this many times the requests it allows exceed its limit."""


class EarlyStop:
    """A :data:`~autotune.load.records.StopCheck` that says when a probe has clearly failed, or is done.

    Only the probe's judged requests count (``judged``: their indices; the warm-up and drain requests
    around them only keep the load steady). A pN term on ttft, tpot or e2el is clearly violated once more
    than ``(1 - N/100) × judged`` requests exceed its limit: finished ones by their value, and in-flight
    ones whose elapsed time already exceeds a TTFT limit (no first chunk yet) or an E2EL limit. A max term
    fails at the first such request, an ``itl:max`` term at the first finished gap above it. The error
    budget is clearly exceeded once more than ``error_budget × judged`` requests failed. Mean terms are
    never judged early. Each of these is certain, not likely: whatever the requests still to come do, the
    full probe fails (its pN then lies above the limit, or its failures exceed the budget). A pN term
    stops a probe only once :data:`CLEAR_MARGIN` times the allowed count is exceeded: a probe that fails
    by a little runs to its end, so its value is known (the rate search interpolates between values; a
    stopped probe only says "over"). The reason names the term (:class:`~autotune.load.records.Stopped`).

    With several client processes each judges its share of the judged requests (:meth:`for_share`)
    against the whole probe's allowances and error budget (counted on the whole probe's judged requests):
    a share's violators and failures are some of the whole probe's, so a share that exceeds the whole
    probe's allowance makes the whole probe fail, which a share's own allowance would not (a share that
    happens to get the slow requests would stop a probe that passes).

    ``early=False`` turns the early stop off. With ``finish``, the check ends the run cleanly
    (:class:`~autotune.load.records.Finished`) once every judged request has finished: what is still in
    flight is drain load, not measurement.
    Finished records are consumed incrementally, so each call costs time in the new records only.
    """

    def __init__(
        self,
        slo: SloSection,
        judged: Collection[int],
        *,
        finish: bool = False,
        early: bool = True,
        whole: int | None = None,
    ) -> None:
        """``whole``: how many judged requests the whole probe has, when ``judged`` is a share of them
        (default: ``judged`` is the whole probe's)."""
        self._slo = slo
        self._early = early
        self._judged = judged if isinstance(judged, range | frozenset) else frozenset(judged)
        self._planned = len(self._judged)
        """Judged requests of this check (a share's own): the run is done once they all finished."""
        self._whole = self._planned if whole is None else whole
        """Judged requests of the whole probe: the allowances and the error budget count on these."""
        self._finish = finish
        self._terms = [
            t for t in slo.terms if t.statistic != "mean" and (t.metric != "itl" or t.statistic == "max")
        ]
        self._allowed = [
            (1.0 - t.quantile) * self._whole if t.quantile is not None else 0.0 for t in self._terms
        ]
        self._counts = [0] * len(self._terms)
        self._failed = 0
        self._done = 0
        self._seen = 0

    def for_share(self, indices: Sequence[int]) -> EarlyStop:
        """A fresh check with the same SLO for the share of the requests named ``indices``: it finishes
        when the share's judged requests have, and stops early only when the whole probe must fail (the
        whole probe's allowances and error budget)."""
        judged = frozenset(i for i in indices if i in self._judged)
        return EarlyStop(self._slo, judged, finish=self._finish, early=self._early, whole=self._whole)

    def __call__(self, progress: Progress) -> str | None:
        """Consume new finished records and in-flight state; return why the probe failed, or None."""
        judged = self._judged
        new = progress.finished[self._seen :]
        self._seen += len(new)
        for rec in new:
            if rec.index not in judged:
                continue
            self._done += 1
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
        if not self._early:
            return self._finished()
        budget = self._slo.error_budget * self._whole
        if self._failed > budget:
            return Stopped(
                f"{self._failed} failed requests exceed the error budget "
                f"({self._slo.error_budget:.1%} of {self._whole})",
                "error budget",
            )
        now = progress.now
        flying = [f for f in progress.in_flight if f.index in judged]
        for k, term in enumerate(self._terms):
            count = self._counts[k]
            if term.metric == "ttft":
                count += sum(
                    1 for f in flying if f.first_chunk_time is None and now - f.send_time > term.limit_s
                )
            elif term.metric == "e2el":
                count += sum(1 for f in flying if now - f.send_time > term.limit_s)
            if count > CLEAR_MARGIN * self._allowed[k]:
                return Stopped(
                    f"{count} of {self._whole} judged requests already exceed {term} "
                    f"(at most {self._allowed[k]:.1f} may)",
                    term.key,
                )
        return self._finished()

    def _finished(self) -> Finished | None:
        if self._finish and self._done >= self._planned:
            return Finished(f"all {self._planned} judged requests finished")
        return None
