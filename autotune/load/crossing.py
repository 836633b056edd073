"""Where an SLO term's latency-against-rate curve reaches its limit, estimated from every probe of a search.

Each probe at a finite rate gives, for each SLO term, one point of that term's curve: the statistic
(``ttft:p95`` …) over the probe's judged requests. Latency grows with the offered rate, so the points are
first made monotone (pooled where noise inverted them). The term's crossing lies between the highest
rate whose value is within the limit and the next rate above it whose value is not; it is placed by
interpolating the logarithm of the value linearly in the logarithm of the rate between those two points.

The interval around it has two parts:

* **Sampling noise.** Each point's judged requests are cut into :data:`BATCHES` consecutive batches (by
  the order they were sent); each batch's statistic at the two points, interpolated to the crossing, is
  moved to the limit along the curve's slope (read over at least :data:`SLOPE_SPAN` of log rate: two
  probes a few percent apart differ mostly by noise), which gives that batch's crossing. The spread of
  those batch crossings, over the square root of their number, times
  :data:`NOISE_INFLATION` (consecutive batches of a queue are correlated, so their spread alone reads too
  small: ``benchmarks/precision.py`` measured the factor), is the noise of the crossing's logarithm.
  The interval is ``NOISE_Z`` times that on each side (Student's t for four batches, not the normal's 1.96:
  the deviation itself is an estimate from four values).
* **Interpolation.** Between two points the curve is not a straight line (a queue's latency has a pole at
  capacity, and the interpolation can land anywhere between): the interval always holds the whole
  bracket, so a wide bracket gives a wide interval until a probe lands near the crossing.

Every probe of a study sends the same stream of requests (:class:`~autotune.load.probe.ProbeSchedule`),
so the batches of two probes, and of two trials, hold the same requests: the batch crossings of two
configs can be compared pairwise (:func:`paired_noise`), which cancels the luck they share: the queue's
excursions that make consecutive batches of one probe move together are the stream's, shared by both
configs, so a paired difference reads its batches' spread as it is, without :data:`NOISE_INFLATION`.

A probe stopped early (clearly failed) has no value: it only says that the crossing lies below its rate;
a crossing bracketed by one is placed mid-bracket, its noise read from the batches of the point below it
(:func:`_censored_above`).
A term judged on too few samples gives no point. The error budget has no curve: the highest rate below
the lowest one whose failures exceeded it bounds the crossing, with the bracket as its interval.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from autotune.inputs.slo_terms import SloTerm
from autotune.load.metrics import percentile, request_values
from autotune.load.records import RequestRecord

BATCHES = 4
"""How many consecutive batches a probe's judged requests are cut into to measure sampling noise."""
NOISE_INFLATION = 1.7
"""Batch spread under-reads the noise of a whole probe near saturation (consecutive batches share a
queue's excursions): the measured ratio of the true spread to the batch estimate was 1.6 to 1.8
(``benchmarks/precision.py``)."""
SLOPE_SPAN = 0.2
"""The least span of log rate (about 22 %) over which the curve's slope is read for the noise."""
SLOPE_PRIOR = 1.0
"""The curve's log-log slope assumed where the probes cannot read one (latency in proportion to rate, as
the search assumes when it places probes): a crossing under an early-stopped probe whose finite points
span less than :data:`SLOPE_SPAN`."""
_T_975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145)
"""The 97.5 % quantile of Student's t for 1, 2, ... degrees of freedom (any table of the t distribution)."""


def t_975(df: int) -> float:
    """The 97.5 % quantile of Student's t with ``df`` degrees of freedom (from 1): the table's, then the
    normal's 1.96 corrected by the first two terms of its Cornish-Fisher expansion in ``1 / df``
    (``(z³ + z) / 4`` and ``(5z⁵ + 16z³ + 3z) / 96``; within 0.1 % of the table from 15 on)."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be at least 1, got {df}")
    if df <= len(_T_975):
        return _T_975[df - 1]
    z = 1.959964
    return z + (z**3 + z) / 4 / df + (5 * z**5 + 16 * z**3 + 3 * z) / 96 / df**2


NOISE_Z = t_975(BATCHES - 1)
"""The interval is this many standard deviations on each side: Student's t at 97.5 % with ``BATCHES - 1``
degrees of freedom (3.182), since the deviation is estimated from the batches (the normal's 1.96 held the
precision benchmark's reference in 77 % of runs; docs/measurement.md)."""

Kind = Literal["crossed", "above", "below"]


@dataclass(frozen=True)
class Point:
    """One probe's value of one term: the statistic in seconds over its judged requests, and per batch."""

    rate: float
    value: float | None
    """``None`` when the probe was stopped early (its value is above the limit, by how much is unknown)."""
    batches: tuple[float, ...] = ()
    """The statistic over each batch of the judged requests (empty when it could not be computed)."""
    weight: int = 1
    """Judged requests behind the value (pooling weight)."""

    @property
    def censored(self) -> bool:
        return self.value is None


@dataclass(frozen=True)
class Crossing:
    """Where one term reaches its limit: ``crossed`` (with an interval), or only bounded from one side."""

    key: str
    kind: Kind
    rate: float
    """The estimate when crossed; the highest rate within the limit (``above``: the crossing lies above
    every rate probed) or the lowest rate over it (``below``)."""
    lo: float
    hi: float
    noise: float = 0.0
    """The standard deviation of the crossing's logarithm from sampling noise (0 when not crossed)."""
    batch_rates: tuple[float, ...] = ()
    """The crossing from each batch alone (for paired comparisons; empty when not crossed)."""
    below_rate: float = 0.0
    """The probed rate within the limit next below the crossing (0 when none)."""
    above_rate: float = math.inf
    """The probed rate over the limit next above it (inf when none)."""

    @property
    def half_width(self) -> float:
        """Half the interval's width over the estimate."""
        return (self.hi - self.lo) / 2 / self.rate if self.rate > 0 else math.inf


def term_values(records: Sequence[RequestRecord], term: SloTerm) -> list[float]:
    """The per-request (or, for ITL, per-gap) values a term's statistic is taken over, in seconds."""
    done = [r for r in records if r.success]
    if term.metric == "itl":
        return [g for r in done for g in r.itls]
    if term.metric == "tpot":
        return [request_values(r)["tpot"] for r in done if r.tokens > 1]
    return [request_values(r)[term.metric] for r in done]


def statistic(values: Sequence[float], term: SloTerm) -> float | None:
    """The term's statistic of ``values`` (``None`` when there are none)."""
    if not values:
        return None
    if term.statistic == "mean":
        return math.fsum(values) / len(values)
    if term.statistic == "max":
        return max(values)
    q = term.quantile
    assert q is not None
    return percentile(values, q * 100)


def point(
    rate: float, value: float | None, records: Sequence[RequestRecord] = (), term: SloTerm | None = None
) -> Point:
    """A probe's point: ``value`` (the term's statistic over its judged requests; ``None`` when stopped
    early), with the statistic of each batch of ``records`` (the judged requests in send order) for
    ``term`` when both are given."""
    batches: list[float] = []
    if value is not None and term is not None and len(records) >= BATCHES:
        size = len(records) / BATCHES
        for b in range(BATCHES):
            part = records[round(b * size) : round((b + 1) * size)]
            v = statistic(term_values(part, term), term)
            if v is None or v <= 0:
                batches = []
                break
            batches.append(v)
    return Point(rate, value, tuple(batches), max(len(records), 1))


def cross(points: Sequence[Point], term: SloTerm) -> Crossing | None:
    """Where ``term`` reaches its limit, from ``points`` (one per probe); ``None`` without points."""
    if not points:
        return None
    limit = term.limit_s
    ordered = _monotone(sorted(points, key=lambda p: p.rate))
    within = [p for p in ordered if p.value is not None and p.value <= limit]
    lower = within[-1] if within else None
    upper = next((p for p in ordered if (lower is None or p.rate > lower.rate) and _over(p, limit)), None)
    if upper is None:
        assert lower is not None
        return Crossing(term.key, "above", lower.rate, lower.rate, math.inf)
    if lower is None:
        return Crossing(term.key, "below", upper.rate, 0.0, upper.rate)
    if upper.value is None:  # the point above was stopped early: placed mid-bracket
        return _censored_above(ordered, lower, upper, term)
    low, high = lower.value, upper.value
    assert low is not None
    x1, x2 = math.log(lower.rate), math.log(upper.rate)
    y1, y2 = math.log(max(low, 1e-12)), math.log(high)
    target = math.log(limit)
    nominal = x1 + (target - y1) / (y2 - y1) * (x2 - x1)  # y1 <= target < y2: pooled, then bracketed
    # Each batch's value at the crossing (interpolated between the same two probes), moved to the limit
    # along the curve's slope (the delta method). That slope is taken over at least SLOPE_SPAN of log
    # rate: between two probes a few percent apart, the difference of their values is mostly noise.
    slope = _slope(ordered, ordered.index(lower), ordered.index(upper))
    f = (nominal - x1) / (x2 - x1)
    batch = [
        math.exp(nominal - ((1 - f) * math.log(a) + f * math.log(b) - target) / slope)
        for a, b in zip(lower.batches, upper.batches, strict=False)
    ]
    rate = math.exp(nominal)
    noise = _noise(batch)
    lo = min(rate * math.exp(-NOISE_Z * noise), lower.rate)
    hi = max(rate * math.exp(NOISE_Z * noise), upper.rate)
    return Crossing(term.key, "crossed", rate, lo, hi, noise, tuple(batch), lower.rate, upper.rate)


def _censored_above(ordered: Sequence[Point], lower: Point, upper: Point, term: SloTerm) -> Crossing:
    """The crossing when the probe above it was stopped early: mid-bracket (how far over its value was
    is unknown), its noise from the batches of the point below, each moved to the limit along a slope:
    the secant of the finite points below where they span :data:`SLOPE_SPAN` of log rate, else
    :data:`SLOPE_PRIOR`; and at least the bracket's (from the value below to the limit across the
    bracket: the curve rises at least that much). Each batch's crossing is then kept within that batch's
    own bracket (a flat curve below would otherwise move it past probes where the batch passed or
    failed). Without batches below, the noise is 0 and the interval the bracket."""
    rate = math.sqrt(lower.rate * upper.rate)
    assert lower.value is not None
    x1, x2, y1 = math.log(lower.rate), math.log(upper.rate), math.log(max(lower.value, 1e-12))
    finite = [p for p in ordered if p.value is not None and p.rate <= lower.rate]
    below = SLOPE_PRIOR
    if len(finite) >= 2 and x1 - math.log(finite[0].rate) >= SLOPE_SPAN:
        below = _slope(finite, len(finite) - 2, len(finite) - 1)
    slope = max((math.log(term.limit_s) - y1) / (x2 - x1), below)
    batch: tuple[float, ...] = ()
    if slope > 0 and len(lower.batches) == BATCHES:
        logs = [math.log(v) for v in lower.batches]
        centre = statistics.fmean(logs)
        batch = tuple(
            _within_own_bracket(rate * math.exp(-(v - centre) / slope), i, finite, term.limit_s, upper.rate)
            for i, v in enumerate(logs)
        )
    noise = _noise(batch)
    lo = min(rate * math.exp(-NOISE_Z * noise), lower.rate)
    hi = max(rate * math.exp(NOISE_Z * noise), upper.rate)
    return Crossing(term.key, "crossed", rate, lo, hi, noise, batch, lower.rate, upper.rate)


def _within_own_bracket(rate: float, i: int, finite: Sequence[Point], limit: float, top: float) -> float:
    """Batch ``i``'s crossing ``rate`` kept within that batch's own bracket: above the highest probe where
    its value was within the limit, below the lowest where it was over (and below ``top``, the probe
    stopped early); left as it is where the batch's own values cross more than once (noise)."""
    lo, hi = 0.0, top
    for p in finite:
        if len(p.batches) != BATCHES:
            continue
        if p.batches[i] <= limit:
            lo = max(lo, p.rate)
        else:
            hi = min(hi, p.rate)
    return min(max(rate, lo), hi) if lo < hi else rate


def paired_noise(a: Crossing, b: Crossing) -> float | None:
    """The standard deviation of ``log(a.rate / b.rate)`` from the batches both crossings share (the same
    requests, when both were measured on one stream); ``None`` when either has no batches."""
    if len(a.batch_rates) != BATCHES or len(b.batch_rates) != BATCHES:
        return None
    return batch_spread(a.batch_rates, b.batch_rates)


def batch_spread(a: Sequence[float], b: Sequence[float]) -> float:
    """The standard deviation of the mean of two configs' paired batch differences (the log ratios of
    their batch rates ``a`` and ``b``, batch by batch), with no
    :data:`NOISE_INFLATION` (module docstring): on the in-process simulator, over 40 paired rounds of each
    of three scenarios, the interval's deviation (this with each side's bracket) was 0.87-0.93 times the
    rounds' own spread at the median, and 118 of 120 single rounds' intervals held the reference gain (119
    with the inflation, at 1.25-1.6 times the width; ``python -m benchmarks.racing --calibrate 8 --seeds
    5``)."""
    diffs = [math.log(x / y) for x, y in zip(a, b, strict=True)]
    return statistics.stdev(diffs) / math.sqrt(len(diffs))


def interpolate(points: Sequence[tuple[float, float]], rate: float) -> float | None:
    """A curve's value at ``rate`` from ``(rate, value)`` points: log-log interpolation between the two
    points around it, else the nearest point's value; ``None`` without points."""
    ordered = sorted((r, v) for r, v in points if r > 0 and math.isfinite(r))
    if not ordered:
        return None
    below = [p for p in ordered if p[0] <= rate]
    above = [p for p in ordered if p[0] > rate]
    if not below:
        return above[0][1]
    if not above:
        return below[-1][1]
    (r1, v1), (r2, v2) = below[-1], above[0]
    f = (math.log(rate) - math.log(r1)) / (math.log(r2) - math.log(r1))
    if v1 > 0 and v2 > 0:
        return math.exp(math.log(v1) + f * (math.log(v2) - math.log(v1)))
    return v1 + f * (v2 - v1)


def _over(p: Point, limit: float) -> bool:
    return p.value is None or p.value > limit


def _slope(ordered: Sequence[Point], i: int, j: int) -> float:
    """The curve's slope in log-log around the bracket ``ordered[i]``-``ordered[j]``: the secant between
    finite points, widened one point at a time (on the side whose next point is nearer) until it spans
    :data:`SLOPE_SPAN` of log rate or no point is left. It is positive: the upper point is over the limit,
    the lower one within it, and pooling made the values monotone."""

    def log_rate(k: int) -> float:
        return math.log(ordered[k].rate)

    def finite(k: int, step: int) -> int | None:
        k += step
        while 0 <= k < len(ordered) and ordered[k].value is None:
            k += step
        return k if 0 <= k < len(ordered) else None

    while log_rate(j) - log_rate(i) < SLOPE_SPAN:
        down, up = finite(i, -1), finite(j, 1)
        if down is None and up is None:
            break
        if up is None or (down is not None and log_rate(i) - log_rate(down) <= log_rate(up) - log_rate(j)):
            assert down is not None
            i = down
        else:
            j = up
    vi, vj = ordered[i].value, ordered[j].value
    assert vi is not None and vj is not None
    return (math.log(vj) - math.log(max(vi, 1e-12))) / (log_rate(j) - log_rate(i))


def _noise(batch_rates: Sequence[float]) -> float:
    if len(batch_rates) < 2:
        return 0.0
    logs = [math.log(r) for r in batch_rates]
    return NOISE_INFLATION * statistics.stdev(logs) / math.sqrt(len(logs))


def _monotone(points: list[Point]) -> list[Point]:
    """Pool adjacent points whose values fall as the rate rises (pool-adjacent-violators on the log values,
    weighted by judged requests; a censored point counts as infinitely high)."""
    blocks: list[list[Point]] = []
    for p in points:
        blocks.append([p])
        while len(blocks) > 1 and _level(blocks[-2]) > _level(blocks[-1]):
            last = blocks.pop()
            blocks[-1].extend(last)
    out: list[Point] = []
    for block in blocks:
        if len(block) == 1:
            out.append(block[0])
            continue
        level = _level(block)
        value = None if math.isinf(level) else math.exp(level)
        out.extend(Point(p.rate, value, p.batches, p.weight) for p in block)
    return out


def _level(block: Sequence[Point]) -> float:
    if any(p.value is None for p in block):
        return math.inf
    total = sum(p.weight for p in block)
    return math.fsum(p.weight * math.log(max(p.value or 0.0, 1e-12)) for p in block) / total
