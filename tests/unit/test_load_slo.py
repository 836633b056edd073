"""SLO evaluation (pass / fail / insufficient) and the early-stop rule."""

from __future__ import annotations

import pytest

from autotune.inputs.slo_terms import parse_term
from autotune.inputs.spec import SloSection
from autotune.load.metrics import summarize
from autotune.load.records import Finished, InFlight, Progress, RequestRecord, Stopped
from autotune.load.slo import EarlyStop, evaluate, samples_needed


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


def test_early_stop_when_twice_the_tail_fraction_of_the_judged_exceed() -> None:
    """p95 over 100 judged requests: 5 violators are allowed, and the probe stops only once more than
    twice that exceed (it clearly failed); the reason names the term."""
    stop = EarlyStop(SloSection(terms=("e2el:p95<=500ms",)), range(100))
    finished = [rec(i, 0.1, 1.0) for i in range(10)]
    assert stop(progress(finished, [])) is None
    finished.append(rec(10, 0.1, 1.0))
    reason = stop(progress(finished, []))
    assert isinstance(reason, Stopped)
    assert reason.term == "e2el:p95" and "e2el:p95" in reason


def test_early_stop_counts_only_the_judged_requests() -> None:
    """Warm-up and drain requests (indices outside the judged range) never count, finished or in flight."""
    stop = EarlyStop(SloSection(terms=("ttft:p95<=200ms",)), range(100, 200))
    outside = [rec(i, 1.0, 2.0) for i in range(50)]
    flying = [InFlight(send_time=0.0, first_chunk_time=None, index=200 + i) for i in range(50)]
    assert stop(progress(outside, flying, now=5.0)) is None
    judged = [InFlight(send_time=0.0, first_chunk_time=None, index=100 + i) for i in range(11)]
    assert stop(progress(outside, flying + judged, now=5.0)) is not None


def test_early_stop_counts_in_flight_requests_past_ttft_limit() -> None:
    """In-flight judged requests with no first chunk after the TTFT limit count as violators."""
    stop = EarlyStop(SloSection(terms=("ttft:p95<=200ms",)), range(100))
    waiting = [InFlight(send_time=0.0, first_chunk_time=None, index=i) for i in range(11)]
    assert stop(progress([], waiting, now=0.1)) is None
    assert stop(progress([], waiting, now=0.3)) is not None
    started = [InFlight(send_time=0.0, first_chunk_time=0.05, index=i) for i in range(11)]
    fresh = EarlyStop(SloSection(terms=("ttft:p95<=200ms",)), range(100))
    assert fresh(progress([], started, now=5.0)) is None


def test_early_stop_on_error_budget_and_max_terms() -> None:
    """A failed request beyond the error budget, or one request beyond a max term, stops the probe."""
    budget = EarlyStop(SloSection(terms=("ttft:mean<=1s",)), range(100))
    stopped = budget(progress([rec(0, 0, 0, success=False)], []))
    assert isinstance(stopped, Stopped) and stopped.term == "error budget"
    maxed = EarlyStop(SloSection(terms=("tpot:max<=50ms",)), range(100))
    assert maxed(progress([rec(0, 0.1, 0.5)], [])) is None  # tpot 40 ms
    assert maxed(progress([rec(0, 0.1, 0.5), rec(1, 0.1, 1.1)], [])) is not None  # tpot 100 ms


def test_early_stop_consumes_finished_records_incrementally() -> None:
    """Records already seen are not counted twice across calls."""
    stop = EarlyStop(SloSection(terms=("e2el:p95<=500ms",)), range(100))
    finished = [rec(i, 0.1, 1.0) for i in range(10)]
    for _ in range(10):
        assert stop(progress(finished, [])) is None


def test_the_check_finishes_a_run_once_every_judged_request_is_done() -> None:
    """With ``finish`` the run ends cleanly (Finished, not an early stop) when the last judged request has
    finished, whatever the drain requests still do; without it, or with early stops off, as asked."""
    judged = range(5, 10)
    done = EarlyStop(SloSection(terms=("ttft:p95<=1s",)), judged, finish=True)
    assert done(progress([rec(i, 0.1, 1.0) for i in range(9)], [])) is None
    reason = done(progress([rec(i, 0.1, 1.0) for i in range(10)], []))
    assert isinstance(reason, Finished)
    quiet = EarlyStop(SloSection(terms=("ttft:p95<=1s",)), judged)
    assert quiet(progress([rec(i, 0.1, 1.0) for i in range(10)], [])) is None
    late = [rec(i, 5.0, 6.0) for i in range(10)]
    off = EarlyStop(SloSection(terms=("ttft:p95<=1s",)), judged, finish=True, early=False)
    assert isinstance(off(progress(late, [])), Finished)


def test_a_share_of_the_requests_judges_its_own_judged_ones() -> None:
    """for_share keeps the judged requests of the share: its own early stop and its own finish."""
    stop = EarlyStop(SloSection(terms=("ttft:p95<=1s",)), range(10, 20), finish=True)
    share = stop.for_share(list(range(0, 30, 2)))  # 10, 12, ..., 18 are its judged ones
    assert share(progress([rec(i, 0.1, 1.0) for i in range(10, 19, 2)], [])) is not None
    assert isinstance(share(progress([rec(i, 0.1, 1.0) for i in range(10, 19, 2)], [])), Finished)


def test_a_share_stops_only_when_the_whole_probe_must_fail() -> None:
    """With 4 client processes, a share that got every slow request of a probe whose p95 holds does not
    stop it: each share judges against the whole probe's allowance and error budget, which its own
    violators exceeding still makes certain; beyond twice that allowance it stops."""
    slo = SloSection(terms=("ttft:p95<=1s",), error_budget=0.02)
    whole = EarlyStop(slo, range(400))  # p95: 20 of 400 may exceed; it stops beyond 40
    share = whole.for_share(list(range(0, 400, 4)))  # 100 judged requests of its own
    slow = [rec(i, 2.0, 3.0) for i in range(0, 160, 4)]  # 40 slow ones, all in this share
    assert whole(progress(slow, [])) is None
    assert share(progress(slow, [])) is None
    more = EarlyStop(slo, range(400)).for_share(list(range(0, 400, 4)))
    assert "41 of 400" in str(more(progress([*slow, rec(160, 2.0, 3.0)], [])))
    failed = [rec(i, 0.0, 0.0, success=False) for i in range(0, 32, 4)]  # 8 of 400 = the budget
    assert EarlyStop(slo, range(400)).for_share(list(range(0, 400, 4)))(progress(failed, [])) is None
    over = [*failed, rec(32, 0.0, 0.0, success=False)]
    assert "error budget" in str(
        EarlyStop(slo, range(400)).for_share(list(range(0, 400, 4)))(progress(over, []))
    )


def test_one_share_of_every_request_is_the_whole_check() -> None:
    """One worker: its share is the whole probe, and it stops and finishes as the whole check does."""
    slo = SloSection(terms=("ttft:p90<=1s",))
    whole = EarlyStop(slo, range(5, 45), finish=True)
    share = whole.for_share(list(range(50)))
    slow = [rec(i, 2.0, 3.0) for i in range(5, 14)]  # 9 > 2 × 4 allowed
    assert str(share(progress(slow, []))) == str(whole(progress(slow, [])))
    done = [rec(i, 0.1, 0.2) for i in range(5, 45)]
    fresh_whole, fresh_share = EarlyStop(slo, range(5, 45), finish=True), whole.for_share(list(range(50)))
    assert isinstance(fresh_share(progress(done, [])), Finished)
    assert isinstance(fresh_whole(progress(done, [])), Finished)
