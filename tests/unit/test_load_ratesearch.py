"""Rate search logic against a deterministic fake server curve, and over-saturation detection."""

from __future__ import annotations

import math

import pytest

from autotune.load.metrics import Dist, ProbeMetrics
from autotune.load.probe import ProbeOutcome, oversaturation, probe_requests
from autotune.load.ratesearch import find_slo_throughput
from autotune.load.records import RequestRecord
from autotune.spec import MeasurementSpec, SloSection

SLO = SloSection(terms=("ttft:p95<=500ms",))
MEAS = MeasurementSpec(probe_duration=20.0, min_requests=100, max_probes=8, rate_tolerance=0.1)


def metrics(n: int, ttft_p95: float, duration: float) -> ProbeMetrics:
    d = Dist(
        n=n,
        mean=ttft_p95 / 2,
        std=0.0,
        p50=ttft_p95 / 2,
        p90=ttft_p95,
        p95=ttft_p95,
        p99=ttft_p95,
        max=ttft_p95,
    )
    zero = Dist(n=n, mean=0.01, std=0.0, p50=0.01, p90=0.01, p95=0.01, p99=0.01, max=0.01)
    return ProbeMetrics(
        duration_s=duration,
        completed=n,
        failed=0,
        total_input_tokens=n * 100,
        total_output_tokens=n * 50,
        request_throughput=n / duration,
        output_throughput=n * 50 / duration,
        total_token_throughput=n * 150 / duration,
        goodput=n / duration,
        ttft=d,
        tpot=zero,
        itl=zero,
        e2el=zero,
    )


class FakeServer:
    """Capacity 10 req/s; TTFT p95 = 0.1 s + 0.2 s/(10 - rate) (M/M/1-like), 2 s at saturation."""

    capacity = 10.0

    def __init__(self) -> None:
        self.rates: list[float] = []

    def ttft(self, rate: float) -> float:
        return 2.0 if rate >= self.capacity else 0.1 + 0.2 / (self.capacity - rate)

    def __call__(self, rate: float) -> ProbeOutcome:
        self.rates.append(rate)
        n = probe_requests(rate, SLO, MEAS)
        duration = n / self.capacity if math.isinf(rate) else n / rate
        return ProbeOutcome(
            rate=rate,
            metrics=metrics(n, self.ttft(rate), duration),
            requests=n,
            duration_s=duration,
            arrival_window_s=0.0 if math.isinf(rate) else duration,
            capacity=self.capacity if math.isinf(rate) else min(rate, self.capacity),
        )


def test_probe_request_count() -> None:
    """A probe sends max(min_requests, rate × duration, percentile need); saturation uses its own count."""
    assert probe_requests(1.0, SLO, MEAS) == 100
    assert probe_requests(10.0, SLO, MEAS) == 200
    assert probe_requests(math.inf, SLO, MEAS) == 200
    p99 = SloSection(terms=("ttft:p99<=1s",))
    assert probe_requests(1.0, p99, MEAS) == 500  # 5 tail samples beyond p99


def test_bisection_converges_to_the_highest_passing_rate() -> None:
    """Saturation, then 0.7 × R_max, then bisection until passing >= 0.9 × failing."""
    fake = FakeServer()
    progress: list[str] = []
    res = find_slo_throughput(fake, SLO, MEAS, progress.append)
    # TTFT p95 <= 0.5 s ⇔ rate <= 9.5: the answer must lie in [0.9 × failing, 9.5].
    assert not res.slo_unreachable
    assert res.rate is not None
    assert 8.5 <= res.rate <= 9.5
    assert math.isinf(fake.rates[0])
    assert fake.rates[1] == pytest.approx(7.0)
    failing = min([p.rate for p in res.probes if not p.passed and not math.isinf(p.rate)] + [res.r_max])
    assert res.rate >= 0.9 * failing
    assert len(res.probes) <= MEAS.max_probes
    assert len(progress) == len(res.probes)
    assert res.metrics is not None
    assert res.slo_throughput == res.metrics.output_throughput
    assert res.probe_seconds == pytest.approx(sum(p.duration_s for p in res.probes))
    assert res.r_max == 10.0


def test_saturation_probe_that_passes_is_the_answer() -> None:
    """When even rate=inf meets the SLO, one probe suffices."""

    class Easy(FakeServer):
        def ttft(self, rate: float) -> float:
            return 0.1

    res = find_slo_throughput(Easy(), SLO, MEAS)
    assert res.rate == math.inf
    assert len(res.probes) == 1


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


def test_early_stopped_and_oversaturated_probes_fail() -> None:
    """A probe stopped early or flagged over-saturated fails even if its metrics look fine."""

    class Flaky(FakeServer):
        def __call__(self, rate: float) -> ProbeOutcome:
            out = super().__call__(rate)
            if 6.0 < rate < 9.0:
                return ProbeOutcome(**{**out.__dict__, "oversaturated": "queue grew"})
            if rate >= 9.0 and not math.isinf(rate):
                return ProbeOutcome(**{**out.__dict__, "early_stopped": True, "stop_reason": "x"})
            return out

    res = find_slo_throughput(Flaky(), SLO, MEAS)
    assert res.rate is not None and res.rate <= 6.0
    assert any("over-saturated" in p.why for p in res.probes)


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
    """A ServerFailedError from the probe stops the search; the result carries the diagnosis."""
    from autotune.outcome import Cause, Diagnosis, ServerFailedError

    fake = FakeServer()

    def probe(rate: float) -> ProbeOutcome:
        if len(fake.rates) == 3:
            raise ServerFailedError(Diagnosis(cause=Cause.CRASHED_UNDER_LOAD, summary="engine died"))
        return fake(rate)

    res = find_slo_throughput(probe, SLO, MEAS)
    assert res.crash is not None
    assert len(res.probes) == 3
    assert res.rate == 7.0  # 7.0 passed, then the top (10.0) failed, before the death
    assert "engine died" in res.reason


def test_result_summaries_for_the_trial() -> None:
    """best/best_rate/best_violations/lowest_violations/reason and probe as_dict are JSON-ready."""
    import json

    res = find_slo_throughput(FakeServer(), SLO, MEAS)
    assert res.operating is not None and res.operating.outcome.metrics is res.metrics
    assert res.best_violations[0] <= 0
    assert "operating point" in res.reason
    json.dumps([p.as_dict() for p in res.probes])
    assert res.probes[0].as_dict()["saturation"] is True

    class Hopeless(FakeServer):
        def ttft(self, rate: float) -> float:
            return 0.6 if rate < 5 else 1.0

    bad = find_slo_throughput(Hopeless(), SLO, MEAS)
    assert bad.operating is None
    assert bad.lowest_violations[0] == pytest.approx(0.2)  # the closest probe: 600 ms vs 500 ms
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
        def __call__(self, rate: float) -> ProbeOutcome:
            outcome = super().__call__(rate)
            if math.isinf(rate):  # the burst's drain tail halves its measured throughput
                return ProbeOutcome(
                    rate=rate,
                    metrics=outcome.metrics,
                    requests=outcome.requests,
                    duration_s=outcome.duration_s,
                    arrival_window_s=0.0,
                    capacity=self.capacity / 2,
                )
            return outcome

    server = Underestimated()
    result = find_slo_throughput(server, SLO, MEAS)
    assert result.rate is not None
    assert max(server.rates[1:]) > server.capacity / 2, "the search never looked above the burst estimate"
    # TTFT p95 <= 0.5 s holds up to rate 9.5: the answer is within the tolerance of it.
    assert 0.9 * 9.5 * 0.9 <= result.rate <= 9.5
    failing = [r for r in server.rates[1:] if server.ttft(r) > 0.5]
    assert failing, "the top of the bracket must be confirmed by a failing finite-rate probe"


def test_a_probe_failing_its_self_check_is_repeated_then_stops_the_search() -> None:
    """An invalid run (busy client) is repeated after a pause, as often as the spec says; if it stays
    invalid the error propagates, never data."""
    from autotune.errors import InvalidMeasurementError

    server = FakeServer()
    calls = {"n": 0}
    pauses: list[float] = []

    def flaky(rate: float) -> ProbeOutcome:
        calls["n"] += 1
        if calls["n"] == 2:
            raise InvalidMeasurementError("measurement invalid: client CPU 95%")
        return server(rate)

    result = find_slo_throughput(flaky, SLO, MEAS, sleep=pauses.append)
    assert result.rate is not None
    assert len(result.probes) == len(server.rates)
    assert pauses == [MEAS.invalid_pause]

    def broken(rate: float) -> ProbeOutcome:
        calls["n"] += 1
        raise InvalidMeasurementError("measurement invalid: client CPU 95%")

    calls["n"] = 0
    pauses.clear()
    three = MEAS.model_copy(update={"invalid_retries": 3, "invalid_pause": 1.5})
    with pytest.raises(InvalidMeasurementError):
        find_slo_throughput(broken, SLO, three, sleep=pauses.append)
    assert calls["n"] == 4 and pauses == [1.5, 1.5, 1.5]
