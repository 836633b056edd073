"""SLO evaluation (pass / fail / insufficient) and the early-stop rule."""

from __future__ import annotations

import pytest

from autotune.load.metrics import summarize
from autotune.load.records import InFlight, Progress, RequestRecord
from autotune.load.slo import EarlyStop, evaluate, samples_needed
from autotune.slo_terms import parse_term
from autotune.spec import SloSection


def rec(index: int, ttft: float, e2el: float, tokens: int = 11, success: bool = True) -> RequestRecord:
    chunks = [ttft + (e2el - ttft) * k / (tokens - 1) for k in range(tokens)] if success else []
    return RequestRecord(
        index=index,
        send_time=0.0,
        chunk_times=tuple(chunks),
        output_tokens=tokens if success else None,
        prompt_tokens=5,
        input_len=5,
        output_len=tokens,
        success=success,
        error="" if success else "HTTP 500",
        end_time=e2el,
    )


def test_samples_needed_follows_min_tail_samples_over_tail_fraction() -> None:
    """A pN term needs ceil(k / (1 - N/100)) samples; mean and max need one."""
    assert samples_needed(parse_term("ttft:p95<=1s"), 5) == 100
    assert samples_needed(parse_term("ttft:p99<=1s"), 5) == 500
    assert samples_needed(parse_term("ttft:p50<=1s"), 5) == 10
    assert samples_needed(parse_term("ttft:p90<=1s"), 3) == 30
    assert samples_needed(parse_term("ttft:mean<=1s"), 5) == 1


def test_evaluate_pass_with_relative_violations() -> None:
    """All terms within limits and enough samples → pass; violation is (value - limit) / limit."""
    slo = SloSection(terms=("ttft:p90<=200ms", "e2el:max<=2s"))
    m = summarize([rec(i, 0.1, 1.0) for i in range(60)], 10.0, slo)
    v = evaluate(slo, m, min_tail_samples=5)
    assert v.status == "pass"
    assert v.passed
    assert v.terms[0].violation == pytest.approx((0.1 - 0.2) / 0.2)
    assert v.constraints[-1] == 0.0  # failed fraction - error budget


def test_evaluate_fail_names_the_term() -> None:
    """A violated term with enough samples → fail, with the term in the reasons."""
    slo = SloSection(terms=("ttft:p90<=200ms",))
    m = summarize([rec(i, 0.5, 1.0) for i in range(60)], 10.0, slo)
    v = evaluate(slo, m)
    assert v.status == "fail"
    assert "ttft:p90" in v.reasons[0]
    assert v.terms[0].violation == pytest.approx(1.5)


def test_evaluate_insufficient_when_too_few_samples_for_the_percentile() -> None:
    """p99 with 100 requests and min_tail_samples=5 (needs 500) → insufficient, not pass."""
    slo = SloSection(terms=("ttft:p99<=200ms",))
    m = summarize([rec(i, 0.1, 1.0) for i in range(100)], 10.0, slo)
    v = evaluate(slo, m, min_tail_samples=5)
    assert v.status == "insufficient"
    assert not v.passed
    assert "needs 500" in v.reasons[0]


def test_evaluate_error_budget() -> None:
    """Failed fraction above the error budget fails; within it, the probe can pass."""
    records = [rec(i, 0.1, 1.0) for i in range(98)] + [rec(98, 0, 0, success=False)] * 2
    strict = SloSection(terms=("ttft:p50<=1s",))
    assert evaluate(strict, summarize(records, 10.0, strict)).status == "fail"
    lenient = SloSection(terms=("ttft:p50<=1s",), error_budget=0.05)
    assert evaluate(lenient, summarize(records, 10.0, lenient)).status == "pass"


def test_evaluate_fails_when_nothing_completed() -> None:
    """No completed request at all is a fail, even with a full error budget."""
    slo = SloSection(terms=("ttft:p50<=1s",), error_budget=1.0)
    records = [rec(0, 0, 0, success=False)]
    assert evaluate(slo, summarize(records, 1.0, slo)).status == "fail"


def progress(finished: list[RequestRecord], in_flight: list[InFlight], now: float = 0.0) -> Progress:
    return Progress(
        now=now, planned=100, sent=len(finished) + len(in_flight), finished=finished, in_flight=in_flight
    )


def test_early_stop_when_more_than_tail_fraction_of_planned_exceed() -> None:
    """p95 over 100 planned: 5 violators are allowed, the 6th stops the probe."""
    stop = EarlyStop(SloSection(terms=("e2el:p95<=500ms",)), planned=100)
    finished = [rec(i, 0.1, 1.0) for i in range(5)]
    assert stop(progress(finished, [])) is None
    finished.append(rec(5, 0.1, 1.0))
    reason = stop(progress(finished, []))
    assert reason is not None
    assert "e2el:p95" in reason


def test_early_stop_counts_in_flight_requests_past_ttft_limit() -> None:
    """In-flight requests with no first chunk after the TTFT limit count as violators."""
    stop = EarlyStop(SloSection(terms=("ttft:p95<=200ms",)), planned=100)
    waiting = [InFlight(send_time=0.0, first_chunk_time=None) for _ in range(6)]
    assert stop(progress([], waiting, now=0.1)) is None
    assert stop(progress([], waiting, now=0.3)) is not None
    started = [InFlight(send_time=0.0, first_chunk_time=0.05) for _ in range(6)]
    fresh = EarlyStop(SloSection(terms=("ttft:p95<=200ms",)), planned=100)
    assert fresh(progress([], started, now=5.0)) is None


def test_early_stop_on_error_budget_and_max_terms() -> None:
    """A failed request beyond the error budget, or one request beyond a max term, stops the probe."""
    budget = EarlyStop(SloSection(terms=("ttft:mean<=1s",)), planned=100)
    assert budget(progress([rec(0, 0, 0, success=False)], [])) is not None
    maxed = EarlyStop(SloSection(terms=("tpot:max<=50ms",)), planned=100)
    assert maxed(progress([rec(0, 0.1, 0.5)], [])) is None  # tpot 40 ms
    assert maxed(progress([rec(0, 0.1, 0.5), rec(1, 0.1, 1.1)], [])) is not None  # tpot 100 ms


def test_early_stop_consumes_finished_records_incrementally() -> None:
    """Records already seen are not counted twice across calls."""
    stop = EarlyStop(SloSection(terms=("e2el:p95<=500ms",)), planned=100)
    finished = [rec(i, 0.1, 1.0) for i in range(5)]
    for _ in range(10):
        assert stop(progress(finished, [])) is None
