"""The rate search against a deterministic fake server curve: the boundary estimated within the precision,
one-sided evidence, censored probes, crashes and invalid runs; and over-saturation detection."""

from __future__ import annotations

import dataclasses
import math

import pytest

from autotune.inputs.spec import MeasurementSpec, SloSection
from autotune.load.metrics import summarize
from autotune.load.probe import ProbeOutcome, oversaturation, probe_requests
from autotune.load.ratesearch import find_slo_throughput, valid_probe
from autotune.load.records import RequestRecord

SLO = SloSection(terms=("ttft:p95<=500ms",))
MEAS = MeasurementSpec(probe_duration=20.0, min_requests=100, max_probes=8, precision=0.02)
GOLDEN = (math.sqrt(5) - 1) / 2


def outcome(rate: float, n: int, ttft_p95: float, duration: float, **extra: object) -> ProbeOutcome:
    """A probe whose judged requests (sent 1/rate apart) have TTFTs spread evenly up to ``ttft_p95`` at
    their 95th percentile (low-discrepancy, so every batch looks alike), 50 output tokens each."""
    records = []
    for i in range(n):
        u = (i * GOLDEN) % 1.0
        ttft = ttft_p95 * (0.5 + 0.5 * min(u / 0.95, 1.2))
        send = i / rate if math.isfinite(rate) else 0.0
        records.append(
            RequestRecord(
                index=i,
                send_time=send,
                chunk_times=(send + ttft, send + ttft + 0.5),
                output_tokens=50,
                prompt_tokens=100,
                input_len=100,
                output_len=50,
                success=True,
                end_time=send + ttft + 0.5,
            )
        )
    metrics = summarize(records, duration, SLO)
    return ProbeOutcome(
        rate=rate,
        metrics=metrics,
        requests=n,
        duration_s=duration,
        arrival_window_s=0.0 if math.isinf(rate) else duration,
        capacity=extra.pop("capacity", 10.0 if math.isinf(rate) else 0.0),  # type: ignore[arg-type]
        records=tuple(records),
        **extra,  # type: ignore[arg-type]
    )


class FakeServer:
    """Capacity 10 req/s; TTFT p95 = 0.1 s + 0.2 s/(10 - rate) (M/M/1-like), 2 s at saturation: the SLO
    (500 ms) holds up to 9.5 req/s."""

    capacity = 10.0

    def __init__(self) -> None:
        self.rates: list[float] = []
        self.warmups: list[float] = []

    def ttft(self, rate: float) -> float:
        return 2.0 if rate >= self.capacity else 0.1 + 0.2 / (self.capacity - rate)

    def __call__(self, rate: float, warmup_s: float = 0.0, window_s: float = 0.0) -> ProbeOutcome:
        self.rates.append(rate)
        self.warmups.append(warmup_s)
        n = probe_requests(rate, SLO, MEAS)
        duration = n / self.capacity if math.isinf(rate) else n / rate
        return outcome(rate, n, self.ttft(rate), duration)


def test_probe_request_count() -> None:
    """A probe sends max(min_requests, rate × duration, percentile need); saturation uses its own count."""
    assert probe_requests(1.0, SLO, MEAS) == 100
    assert probe_requests(10.0, SLO, MEAS) == 200
    assert probe_requests(math.inf, SLO, MEAS) == 200
    p99 = SloSection(terms=("ttft:p99<=1s",))
    assert probe_requests(1.0, p99, MEAS) == 500  # 5 tail samples beyond p99


def test_the_boundary_is_estimated_within_the_precision() -> None:
    """Saturation, then 0.8 × R_max, then probes at the estimate: the boundary (9.5 req/s) is found within
    the precision, inside the interval, in few probes; the figure is the rate times the tokens per
    request, not a probe's measured throughput."""
    fake = FakeServer()
    progress: list[str] = []
    res = find_slo_throughput(fake, SLO, MEAS, progress.append)
    est = res.estimate
    assert est is not None and est.kind == "crossed" and est.binding == "ttft:p95"
    assert est.rate == pytest.approx(9.5, rel=MEAS.precision)
    assert est.lo <= est.rate <= est.hi and est.half_width <= MEAS.precision
    assert math.isinf(fake.rates[0]) and fake.rates[1] == pytest.approx(8.0)
    assert len(res.probes) <= 6
    assert len(progress) == len(res.probes)
    assert res.slo_throughput == pytest.approx(est.rate * 50)
    assert est.throughput_interval == pytest.approx((est.lo * 50, est.hi * 50))
    assert res.probe_seconds == pytest.approx(sum(p.duration_s for p in res.probes))
    assert res.r_max == 10.0


def test_a_tighter_precision_takes_more_probes_and_lands_closer() -> None:
    """The search stops on the bracket around its estimate: asking for less spends fewer probes."""
    loose = find_slo_throughput(FakeServer(), SLO, MEAS.model_copy(update={"precision": 0.2}))
    tight = find_slo_throughput(FakeServer(), SLO, MEAS.model_copy(update={"precision": 0.005}))
    assert loose.estimate is not None and tight.estimate is not None
    assert len(loose.probes) < len(tight.probes)
    assert abs(tight.estimate.rate - 9.5) <= abs(loose.estimate.rate - 9.5) + 1e-9
    assert abs(tight.estimate.rate / 9.5 - 1) < 0.005


def test_each_probe_warms_up_for_the_last_ones_request_lifetime() -> None:
    """No warm-up before the saturation probe; each later probe warms up for the previous one's end-to-end
    latency (at least a second, at most probe_duration)."""
    fake = FakeServer()
    find_slo_throughput(fake, SLO, MEAS)
    assert fake.warmups[0] == 0.0
    assert all(MEAS.probe_duration >= w >= 1.0 for w in fake.warmups[1:])


def test_saturation_probe_that_passes_is_the_answer() -> None:
    """When even rate=inf meets the SLO, one probe suffices and its measured throughput is the figure."""

    class Easy(FakeServer):
        def ttft(self, rate: float) -> float:
            return 0.1

    res = find_slo_throughput(Easy(), SLO, MEAS)
    assert res.rate == math.inf
    assert len(res.probes) == 1
    assert res.estimate is not None and res.estimate.kind == "saturation"
    assert res.slo_throughput == res.probes[0].outcome.metrics.output_throughput


def test_unreachable_slo() -> None:
    """When no rate passes within max_probes the result is slo_unreachable with every probe listed."""

    class Hopeless(FakeServer):
        def ttft(self, rate: float) -> float:
            return 1.0

    res = find_slo_throughput(Hopeless(), SLO, MEAS)
    assert res.slo_unreachable
    assert res.rate is None
    assert res.metrics is None
    assert len(res.probes) == MEAS.max_probes
    assert all("ttft:p95" in p.why for p in res.probes)


def test_stopped_early_and_oversaturated_probes_bound_the_boundary() -> None:
    """A probe stopped early by a term is over for that term (value unknown); one that over-saturated the
    server bounds the boundary below its rate whatever its latencies: the estimate stays below both."""

    class Flaky(FakeServer):
        def __call__(self, rate: float, warmup_s: float = 0.0, window_s: float = 0.0) -> ProbeOutcome:
            out = super().__call__(rate, warmup_s, window_s)
            if 7.0 < rate < 9.0:
                return dataclasses.replace(out, oversaturated="queue grew")
            if rate >= 9.0 and not math.isinf(rate):
                return dataclasses.replace(out, early_stopped=True, stop_reason="x", stop_term="ttft:p95")
            return out

    res = find_slo_throughput(Flaky(), SLO, MEAS)
    assert res.rate is not None and res.rate <= 7.0
    assert any("over-saturated" in p.why for p in res.probes)
    assert res.estimate is not None and res.estimate.binding == "over-saturation"


def _records(rate: float, service: float, window: float, capacity: float) -> list[RequestRecord]:
    """A deterministic single-queue server: arrivals every 1/rate, FIFO service at `capacity` req/s."""
    out = []
    free = 0.0
    n = int(rate * window) + 1
    for i in range(n):
        send = i / rate
        begin = max(send, free)
        free = begin + 1 / capacity
        end = begin + service
        out.append(
            RequestRecord(
                index=i,
                send_time=send,
                chunk_times=(begin + 0.01, end),
                output_tokens=2,
                prompt_tokens=1,
                input_len=1,
                output_len=2,
                success=True,
                end_time=end,
            )
        )
    return out


def test_oversaturation_detects_growing_outstanding_requests() -> None:
    """Arrivals above capacity make outstanding requests grow: flagged; below capacity: not flagged."""
    assert oversaturation(_records(8.0, 0.5, 20.0, 10.0), 0.0, 20.0, 8.0) is None
    reason = oversaturation(_records(15.0, 0.5, 20.0, 10.0), 0.0, 20.0, 15.0)
    assert reason is not None
    assert "grew" in reason
    assert oversaturation(_records(15.0, 0.5, 20.0, 10.0), 0.0, 20.0, math.inf) is None


def test_server_death_ends_the_search_with_its_diagnosis() -> None:
    """A ServerFailedError from the probe stops the search; the result carries the diagnosis and what the
    probes before it showed."""
    from autotune.outcome import Cause, Diagnosis, ServerFailedError

    fake = FakeServer()

    def probe(rate: float, warmup_s: float = 0.0, window_s: float = 0.0) -> ProbeOutcome:
        if len(fake.rates) == 3:
            raise ServerFailedError(Diagnosis(cause=Cause.CRASHED_UNDER_LOAD, summary="engine died"))
        return fake(rate, warmup_s, window_s)

    res = find_slo_throughput(probe, SLO, MEAS)
    assert res.crash is not None
    assert len(res.probes) == 3
    assert res.estimate is not None and res.estimate.lo <= 9.5 <= res.estimate.hi
    assert "engine died" in res.reason


def test_result_summaries_for_the_trial() -> None:
    """Constraints at the estimate (the binding term at its limit), the reason, and the probes' and the
    estimate's dicts are JSON-ready; without a passing rate, the closest probe's violations."""
    import json

    res = find_slo_throughput(FakeServer(), SLO, MEAS)
    assert res.operating is not None and res.operating.outcome.metrics is res.metrics
    assert res.operating.rate <= res.estimate.rate  # type: ignore[union-attr]
    assert res.constraints[0] == pytest.approx(0.0, abs=1e-9)
    assert "operating point at" in res.reason and "ttft:p95 binds" in res.reason
    assert res.value_at("ttft", "p95") == pytest.approx(0.5, rel=1e-6)
    json.dumps([p.as_dict() for p in res.probes])
    json.dumps(res.estimate.as_dict())  # type: ignore[union-attr]
    assert res.probes[0].as_dict()["saturation"] is True

    class Hopeless(FakeServer):
        def ttft(self, rate: float) -> float:
            return 0.6 if rate < 5 else 1.0

    bad = find_slo_throughput(Hopeless(), SLO, MEAS)
    assert bad.operating is None and bad.estimate is None
    assert bad.constraints[0] == pytest.approx(0.2, rel=0.03)  # the closest probe: ~600 ms vs 500 ms
    assert "no probed rate met the SLO" in bad.reason


def test_queue_growth_from_the_servers_waiting_gauge() -> None:
    """A waiting queue that keeps growing is over-saturation; a bounded, noisy one is not."""
    from autotune.load.probe import _queue_growth

    growing = [(0.5 * i, float(3 * i)) for i in range(20)]
    assert _queue_growth(growing) is not None
    flat = [(0.5 * i, float(i % 3)) for i in range(20)]
    assert _queue_growth(flat) is None


def test_oversaturation_ignores_poisson_noise_near_capacity() -> None:
    """A modest rise of outstanding requests (within Poisson noise) is not called over-saturation."""
    records = _records(9.0, 3.0, 10.0, 100.0)  # stable: ~27 outstanding
    extra = [
        RequestRecord(
            index=1000 + i,
            send_time=9.0,
            chunk_times=(9.1, 12.0),
            output_tokens=2,
            prompt_tokens=1,
            input_len=1,
            output_len=2,
            success=True,
            end_time=12.0,
        )
        for i in range(10)
    ]
    assert oversaturation(records + extra, 0.0, 10.0, 9.0) is None


def test_search_looks_above_an_underestimated_burst_capacity() -> None:
    """When the burst underestimates capacity (every probe passes), the search probes above it."""

    class Underestimated(FakeServer):
        def __call__(self, rate: float, warmup_s: float = 0.0, window_s: float = 0.0) -> ProbeOutcome:
            out = super().__call__(rate, warmup_s, window_s)
            if math.isinf(rate):  # the burst's drain tail halves its measured throughput
                return dataclasses.replace(out, capacity=self.capacity / 2)
            return out

    server = Underestimated()
    result = find_slo_throughput(server, SLO, MEAS)
    assert result.rate is not None
    assert max(server.rates[1:]) > server.capacity / 2, "the search never looked above the burst estimate"
    assert result.rate == pytest.approx(9.5, rel=MEAS.precision)
    failing = [r for r in server.rates[1:] if server.ttft(r) > 0.5]
    assert failing, "the top of the bracket must be confirmed by a failing finite-rate probe"


def test_a_probe_failing_its_self_check_is_repeated_then_stops_the_search() -> None:
    """An invalid run (busy client) is repeated after a pause, as often as the spec says; if it stays
    invalid the error propagates, never data."""
    from autotune.errors import InvalidMeasurementError

    server = FakeServer()
    calls = {"n": 0}
    pauses: list[float] = []

    def flaky(rate: float, warmup_s: float = 0.0, window_s: float = 0.0) -> ProbeOutcome:
        calls["n"] += 1
        if calls["n"] == 2:
            raise InvalidMeasurementError("measurement invalid: client CPU 95%")
        return server(rate, warmup_s, window_s)

    result = find_slo_throughput(flaky, SLO, MEAS, sleep=pauses.append)
    assert result.rate is not None
    assert len(result.probes) == len(server.rates)
    assert pauses == [MEAS.invalid_pause]

    def broken(rate: float, warmup_s: float = 0.0, window_s: float = 0.0) -> ProbeOutcome:
        calls["n"] += 1
        raise InvalidMeasurementError("measurement invalid: client CPU 95%")

    calls["n"] = 0
    pauses.clear()
    three = MEAS.model_copy(update={"invalid_retries": 3, "invalid_pause": 1.5})
    with pytest.raises(InvalidMeasurementError):
        find_slo_throughput(broken, SLO, three, sleep=pauses.append)
    assert calls["n"] == 4 and pauses == [1.5, 1.5, 1.5]


def test_a_rate_the_client_cannot_measure_ends_the_search_with_what_it_measured_below() -> None:
    """A client that cannot measure validly at 7 req/s or more (its every repeat voided there) facing a
    server whose boundary is 9.5 req/s: the first finite probe (8 req/s) is voided, the search steps below
    it, measures 5.6 req/s passing, and stops at the next rate it cannot measure. The figure is a lower
    bound, says so and why, and no probe at or above a rate the client could not measure is tried twice.
    A rerun (``start``) and a client that can measure no finite rate at all still raise."""
    from autotune.errors import InvalidMeasurementError
    from autotune.load.ratesearch import UNMEASURED_STEP, Start, describe

    server = FakeServer()
    tried: list[float] = []
    said: list[str] = []

    def limited(rate: float, warmup_s: float = 0.0, window_s: float = 0.0) -> ProbeOutcome:
        tried.append(rate)
        if math.isfinite(rate) and rate >= 7.0:
            raise InvalidMeasurementError("measurement invalid: client sent late")
        return server(rate, warmup_s, window_s)

    result = find_slo_throughput(limited, SLO, MEAS, on_progress=said.append, sleep=lambda _: None)
    est = result.estimate
    assert est is not None and est.kind == "above"
    assert est.rate == pytest.approx(8.0 * UNMEASURED_STEP)
    assert all(p.rate < 7.0 for p in result.probes if p.finite)
    assert "could not measure a probe at" in est.client_limit and "client sent late" in est.client_limit
    assert est.as_dict()["client_limit"] == est.client_limit
    assert describe(est).startswith("at least 5.6 req/s, a lower bound: the client could not measure")
    assert any("could not be measured: the search stays below" in line for line in said), said
    voided = sorted({r for r in tried if math.isfinite(r) and r >= 7.0})
    assert len(voided) == 2 and voided[0] == pytest.approx(5.6 * 1.3), voided  # 8, then 5.6 stepped up

    # A finalist's rerun is one side of a paired comparison: no lower bound there, the error propagates,
    # whether the rerun starts at the trial's boundary or searches afresh (the trial had no crossing).
    for start in (Start(8.0, (1.0, 20.0)), None):
        with pytest.raises(InvalidMeasurementError, match="client sent late"):
            find_slo_throughput(limited, SLO, MEAS, sleep=lambda _: None, start=start, rerun=True)

    def blind(rate: float, warmup_s: float = 0.0, window_s: float = 0.0) -> ProbeOutcome:
        if math.isfinite(rate):
            raise InvalidMeasurementError("measurement invalid: client starved")
        return server(rate, warmup_s, window_s)

    with pytest.raises(InvalidMeasurementError, match="client starved"):
        find_slo_throughput(blind, SLO, MEAS, sleep=lambda _: None)


def test_a_bracket_the_client_cannot_narrow_keeps_its_interval_and_says_why() -> None:
    """Probes at 8 (pass) and 10.4 (fail) bracket the boundary; the client cannot measure between them
    (9 req/s and up): the search keeps the crossing it has, with its interval, and names the limit."""
    from autotune.errors import InvalidMeasurementError
    from autotune.load.ratesearch import describe

    server = FakeServer()

    def limited(rate: float, warmup_s: float = 0.0, window_s: float = 0.0) -> ProbeOutcome:
        if math.isfinite(rate) and 9.0 <= rate < 10.0:
            raise InvalidMeasurementError("measurement invalid: itl:p99 by 400%")
        return server(rate, warmup_s, window_s)

    result = find_slo_throughput(limited, SLO, MEAS, sleep=lambda _: None)
    est = result.estimate
    assert est is not None and est.kind == "crossed" and est.lo < 9.5 < est.hi
    assert est.client_limit and "stopped short: the client could not measure" in describe(est)


def test_one_probe_at_a_fixed_rate_is_repeated_as_a_search_repeats_it() -> None:
    """`bench --rate` takes the same path: an invalid run is repeated after the pause, saying why and
    which repeat it is; the repeat's outcome is the answer."""
    from autotune.errors import InvalidMeasurementError

    server = FakeServer()
    calls: list[float] = []
    said: list[str] = []
    pauses: list[float] = []

    def flaky(rate: float, warmup_s: float = 0.0, window_s: float = 0.0) -> ProbeOutcome:
        calls.append(rate)
        if len(calls) == 1:
            raise InvalidMeasurementError("measurement invalid: client sent late")
        return server(rate, warmup_s, window_s)

    got = valid_probe(flaky, 4.0, MEAS, on_progress=said.append, sleep=pauses.append)
    assert got.rate == 4.0 and calls == [4.0, 4.0] and pauses == [MEAS.invalid_pause]
    assert said == [
        f"probe at rate 4 repeated in {MEAS.invalid_pause:g} s (1 of {MEAS.invalid_retries}): "
        "measurement invalid: client sent late"
    ]


def test_a_transient_error_below_a_passing_rate_bounds_nothing() -> None:
    """One failed request at 8 req/s (error budget 0) with 9 and 10 req/s passing and 11 over the TTFT
    limit: the boundary is the TTFT crossing near 10, its interval is the right way round, and the search
    may stop on it (the 8 req/s failure is noise, as an inverted point of a curve is)."""
    from autotune.load.ratesearch import estimate, judge

    def failing(rate: float) -> ProbeOutcome:
        o = outcome(rate, int(rate * 20), 0.3, 20.0)
        records = list(o.records)
        records[0] = dataclasses.replace(records[0], success=False, chunk_times=(), error="HTTP 500")
        return dataclasses.replace(o, records=tuple(records), metrics=summarize(records, 20.0, SLO))

    reports = [
        judge(failing(8.0), SLO, MEAS),
        judge(outcome(9.0, 180, 0.3, 20.0), SLO, MEAS),
        judge(outcome(10.0, 200, 0.45, 20.0), SLO, MEAS),
        judge(outcome(11.0, 220, 0.7, 20.0), SLO, MEAS),
    ]
    assert not reports[0].passed
    est = estimate(reports, SLO)
    assert est is not None
    assert est.kind == "crossed" and est.binding == "ttft:p95"
    assert 10.0 < est.rate < 11.0
    assert est.lo <= est.rate <= est.hi
    assert est.bracket == (10.0, 11.0)


def test_a_rerun_with_longer_probes_lengthens_its_first_probe_too() -> None:
    """A rerun starts at the earlier search's boundary with its pace; with probes twice as long
    (finalists.probe_scale) its first probe's window is twice the probe duration, not the earlier
    search's; a window the request lifetimes set above it is kept."""
    from autotune.load.ratesearch import Start

    windows: list[float] = []
    server = FakeServer()

    def seen(rate: float, warmup_s: float = 0.0, window_s: float = 0.0) -> ProbeOutcome:
        windows.append(window_s)
        return server(rate, warmup_s, window_s)

    longer = MEAS.model_copy(update={"probe_duration": MEAS.probe_duration * 2})
    for m, pace, first in (
        (longer, (1.0, MEAS.probe_duration), longer.probe_duration),
        (longer, (1.0, 3 * longer.probe_duration), 3 * longer.probe_duration),
        (MEAS, (1.0, MEAS.probe_duration), MEAS.probe_duration),
    ):
        windows.clear()
        find_slo_throughput(seen, SLO, m, sleep=lambda _: None, start=Start(8.0, pace), rerun=True)
        assert windows[0] == pytest.approx(first)
