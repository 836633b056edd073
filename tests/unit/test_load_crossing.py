"""The SLO boundary of one term from a search's probes: interpolation, monotone pooling, censored probes,
the interval's two parts (batch noise, interpolation), paired noise, and interpolating other metrics."""

from __future__ import annotations

import math
import statistics

import pytest

from autotune.inputs.slo_terms import parse_term
from autotune.load.crossing import (
    BATCHES,
    NOISE_INFLATION,
    SLOPE_SPAN,
    Point,
    cross,
    interpolate,
    paired_noise,
    point,
    statistic,
)
from autotune.load.records import RequestRecord

TTFT = parse_term("ttft:p95<=500ms")


def power(rate: float) -> float:
    """A curve that is a straight line in log-log: TTFT p95 = 0.5 s × (rate / 10)^3."""
    return 0.5 * (rate / 10.0) ** 3


def test_a_power_law_is_crossed_exactly_from_any_bracket() -> None:
    """Log-log interpolation is exact on a power law, however wide the bracket."""
    for lo, hi in ((6.0, 14.0), (9.0, 10.5), (2.0, 40.0)):
        c = cross([Point(lo, power(lo)), Point(hi, power(hi))], TTFT)
        assert c is not None and c.kind == "crossed"
        assert c.rate == pytest.approx(10.0, rel=1e-9)
    many = [Point(r, power(r)) for r in (5.0, 8.0, 9.0, 11.0, 13.0)]
    c = cross(many, TTFT)
    assert c is not None and c.rate == pytest.approx(10.0)


def test_one_sided_evidence_bounds_the_crossing() -> None:
    """Every point within the limit: the crossing lies above the highest (unbounded interval); every point
    over it: below the lowest."""
    above = cross([Point(5.0, 0.1), Point(8.0, 0.3)], TTFT)
    assert above is not None and above.kind == "above" and above.rate == 8.0 and math.isinf(above.hi)
    below = cross([Point(12.0, 0.9), Point(15.0, 2.0)], TTFT)
    assert below is not None and below.kind == "below" and below.rate == 12.0 and below.lo == 0.0
    assert cross([], TTFT) is None


def test_values_that_fall_as_the_rate_rises_are_pooled() -> None:
    """Noise inverted two points (0.52 s at 9, 0.48 s at 9.5): pooled into one level, the bracket is the
    first within-limit level and the next one over it, never a crossing inside the inversion."""
    points = [Point(8.0, 0.3), Point(9.0, 0.52), Point(9.5, 0.48), Point(11.0, 0.9)]
    c = cross(points, TTFT)
    assert c is not None and c.kind == "crossed"
    assert 9.5 < c.rate < 11.0  # the pooled level at 9 and 9.5 is 0.4997 s: within the limit


def test_a_probe_stopped_early_gives_only_the_bracket() -> None:
    """A censored point (stopped early: over by an unknown amount) above a passing one: the crossing is
    in between, the interval is the whole bracket."""
    c = cross([Point(8.0, 0.3), Point(12.0, None)], TTFT)
    assert c is not None and c.kind == "crossed"
    assert (c.lo, c.hi) == (8.0, 12.0)
    assert c.rate == pytest.approx(math.sqrt(8.0 * 12.0))


def test_a_crossing_under_a_probe_stopped_early_keeps_the_noise_of_the_point_below() -> None:
    """The sampling noise of a crossing bracketed by an early-stopped probe is read from the batches of
    the point below, moved to the limit along the steeper of the bracket's least slope and the secant
    below: never 0 (which made two reruns' gain look certain), and paired with another config's batches."""
    batches = (0.25, 0.3, 0.32, 0.35)
    points = [Point(4.0, 0.2), Point(8.0, 0.3, batches), Point(9.0, None)]
    c = cross(points, TTFT)
    assert c is not None and c.kind == "crossed"
    assert c.rate == pytest.approx(math.sqrt(8.0 * 9.0))
    slope = (math.log(0.5) - math.log(0.3)) / (math.log(9.0) - math.log(8.0))  # steeper than 4 -> 8
    sd = statistics.stdev([math.log(b) / slope for b in batches])
    assert c.noise == pytest.approx(NOISE_INFLATION * sd / 2)
    assert len(c.batch_rates) == 4 and statistics.geometric_mean(c.batch_rates) == pytest.approx(c.rate)
    assert c.lo <= c.rate * math.exp(-1.96 * c.noise) + 1e-9 and c.hi >= 9.0
    flat = cross([Point(7.9, 0.45, batches), Point(8.0, 0.49, batches), Point(9.0, None)], TTFT)
    assert flat is not None and flat.noise > 0  # the secant below is steeper than the bracket's here
    assert paired_noise(c, c) == 0.0
    spread = (0.3, 0.4, 0.45, 0.49)  # each batch within the limit at 6 and 8 req/s
    wide = cross([Point(6.0, 0.44, spread), Point(8.0, 0.45, spread), Point(9.0, None)], TTFT)
    assert wide is not None and wide.noise > 0
    assert all(8.0 <= r <= 9.0 for r in wide.batch_rates), "each batch stays within its own bracket"


def test_batch_spread_sets_the_noise_and_the_interval() -> None:
    """Each batch's statistic at the two points gives a batch crossing; their spread over sqrt(batches),
    times the inflation, is the noise of the crossing's logarithm, and the interval covers ±1.96 of it."""
    lo_batches = (0.30, 0.33, 0.36, 0.39)
    hi_batches = (0.60, 0.66, 0.72, 0.78)
    c = cross([Point(8.0, 0.345, lo_batches, 400), Point(10.0, 0.69, hi_batches, 500)], TTFT)
    assert c is not None and len(c.batch_rates) == BATCHES
    logs = [math.log(r) for r in c.batch_rates]
    mean = sum(logs) / len(logs)
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / (len(logs) - 1))
    assert c.noise == pytest.approx(NOISE_INFLATION * sd / 2)
    assert c.lo <= c.rate * math.exp(-1.96 * c.noise) + 1e-9
    assert c.hi >= c.rate * math.exp(1.96 * c.noise) - 1e-9
    assert min(c.batch_rates) < c.rate < max(c.batch_rates)


def test_the_noise_reads_the_slope_over_a_wide_span_not_between_two_close_probes() -> None:
    """Two probes 2 % apart around the crossing differ mostly by noise (here their secant has half the
    curve's slope): the slope that turns each batch's latency into a rate is read between points at least
    SLOPE_SPAN apart, so the noise is not doubled by a narrow bracket."""
    batches_lo = (0.44, 0.47, 0.50, 0.53)
    batches_hi = (0.455, 0.485, 0.515, 0.545)
    points = [
        Point(6.0, power(6.0)),
        Point(9.9, 0.49, batches_lo, 100),
        Point(10.1, 0.505, batches_hi, 100),
        Point(14.0, power(14.0)),
    ]
    c = cross(points, TTFT)
    assert c is not None and c.kind == "crossed" and 9.9 < c.rate < 10.1
    wide = math.log(power(14.0) / 0.49) / math.log(14.0 / 9.9)  # 9.9 to 14: the nearer widening
    assert math.log(14.0 / 9.9) >= SLOPE_SPAN
    f = math.log(c.rate / 9.9) / math.log(10.1 / 9.9)
    pairs = zip(batches_lo, batches_hi, strict=True)
    at_crossing = [(1 - f) * math.log(a) + f * math.log(b) for a, b in pairs]
    expected = [c.rate * math.exp(-(y - math.log(0.5)) / wide) for y in at_crossing]
    assert c.batch_rates == pytest.approx(expected)
    narrow = math.log(0.505 / 0.49) / math.log(10.1 / 9.9)
    assert narrow < wide / 1.8  # the secant of the two close probes would have read the noise doubled


def test_the_interval_always_holds_the_bracket() -> None:
    """A queue's pole makes any interpolation across a wide bracket a guess: the interval is at least the
    bracket (the crossing of a monotone curve lies in it), however small the noise."""
    pole = parse_term("ttft:p95<=500ms")
    c = cross([Point(17.5, 0.134), Point(21.0, 1.878)], pole)
    assert c is not None
    assert (c.lo, c.hi) == (17.5, 21.0)
    assert c.half_width > 0.05


def test_paired_noise_cancels_what_two_configs_share() -> None:
    """Two crossings whose batches move together (the same requests) differ with little noise, though
    each alone is noisy; without batches there is no paired figure."""
    base = cross(
        [Point(8.0, 0.35, (0.3, 0.33, 0.36, 0.39), 4), Point(10, 0.7, (0.6, 0.66, 0.72, 0.78), 4)], TTFT
    )
    twin = cross(
        [Point(8.8, 0.35, (0.3, 0.33, 0.36, 0.39), 4), Point(11, 0.7, (0.6, 0.66, 0.72, 0.78), 4)], TTFT
    )
    assert base is not None and twin is not None
    assert base.noise > 0.01
    paired = paired_noise(twin, base)
    assert paired is not None and paired < 1e-9
    plain = cross([Point(8.0, 0.35), Point(10.0, 0.7)], TTFT)
    assert plain is not None and paired_noise(plain, base) is None


def record(index: int, ttft: float) -> RequestRecord:
    return RequestRecord(
        index=index,
        send_time=float(index),
        chunk_times=(index + ttft, index + ttft + 0.01),
        output_tokens=2,
        prompt_tokens=1,
        input_len=1,
        output_len=2,
        success=True,
        end_time=index + ttft + 0.01,
    )


def test_a_point_carries_each_batchs_statistic() -> None:
    """The judged requests in send order are cut into consecutive batches, each summarised alone."""
    records = [record(i, 0.1 * (1 + i // 25)) for i in range(100)]  # TTFT steps up each quarter
    p = point(5.0, 0.4, records, TTFT)
    assert p.value == 0.4 and p.weight == 100
    assert p.batches == pytest.approx((0.1, 0.2, 0.3, 0.4))
    assert point(5.0, None).censored
    assert statistic([0.1, 0.2, 0.3], parse_term("ttft:mean<=1s")) == pytest.approx(0.2)
    assert statistic([0.1, 0.2, 0.3], parse_term("ttft:max<=1s")) == 0.3


def test_other_metrics_are_interpolated_at_the_boundary() -> None:
    """A statistic between two probes is interpolated log-log; outside them the nearest value holds."""
    points = [(8.0, 0.2), (10.0, 0.4)]
    assert interpolate(points, 9.0) == pytest.approx(0.2 * 2 ** (math.log(9 / 8) / math.log(10 / 8)))
    assert interpolate(points, 12.0) == 0.4
    assert interpolate(points, 5.0) == 0.2
    assert interpolate([], 5.0) is None
