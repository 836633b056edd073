"""Probe metrics defined exactly as ``vllm bench serve`` defines them (docs/vllm.md).

Over completed (successful) requests: TTFT = first content chunk − send; E2EL = last content chunk − send;
TPOT per request = (E2EL − TTFT) / (output_tokens − 1) over requests with more than one output token;
ITL = every gap between content chunks, pooled over all requests. Percentiles use numpy's default
(linear interpolation between closest ranks); std is the population std (numpy's default, ddof=0).
Goodput counts completed requests meeting every per-request SLO limit (ttft, tpot, e2el) per second;
as in vLLM a 1-token request's TPOT is 0 for this purpose, and failed requests never count.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from autotune.inputs.spec import SloSection
from autotune.load.records import RequestRecord

PER_REQUEST_METRICS: tuple[str, ...] = ("ttft", "tpot", "e2el")


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0–100) by linear interpolation, like ``numpy.percentile``; 0.0 if empty."""
    if not values:
        return 0.0
    xs = sorted(values)
    return _pct_sorted(xs, q)


def _pct_sorted(xs: Sequence[float], q: float) -> float:
    h = (len(xs) - 1) * (q / 100.0)
    lo = math.floor(h)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (h - lo) * (xs[hi] - xs[lo])


@dataclass(frozen=True)
class Dist:
    """Summary of one latency metric in seconds (all 0.0 when there are no samples, like vLLM)."""

    n: int
    mean: float
    std: float
    p50: float
    p90: float
    p95: float
    p99: float
    max: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Dist:
        """Summarise ``values`` (seconds)."""
        if not values:
            return cls(0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
        xs = sorted(values)
        n = len(xs)
        mean = math.fsum(xs) / n
        std = math.sqrt(math.fsum((x - mean) ** 2 for x in xs) / n)
        return cls(
            n=n,
            mean=mean,
            std=std,
            p50=_pct_sorted(xs, 50),
            p90=_pct_sorted(xs, 90),
            p95=_pct_sorted(xs, 95),
            p99=_pct_sorted(xs, 99),
            max=xs[-1],
        )

    def get(self, statistic: str) -> float:
        """The value of a statistic name of :mod:`autotune.load.slo` (``mean``, ``p50`` … ``max``)."""
        if statistic in ("mean", "std", "p50", "p90", "p95", "p99", "max"):
            return float(getattr(self, statistic))
        if statistic.startswith("p"):
            raise KeyError(f"percentile {statistic!r} is not summarised (use p50, p90, p95, p99)")
        raise KeyError(f"unknown statistic {statistic!r}")


@dataclass(frozen=True)
class ProbeMetrics:
    """What one probe measured. Latencies in seconds, throughputs per second of ``duration_s``."""

    duration_s: float
    completed: int
    failed: int
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    goodput: float
    """Completed requests per second that met every per-request SLO limit (see module docstring)."""
    ttft: Dist
    tpot: Dist
    itl: Dist
    e2el: Dist
    max_concurrency_seen: int = 0
    """Most requests in flight at once during the probe."""

    def dist(self, metric: str) -> Dist:
        """The distribution of ``ttft``, ``tpot``, ``itl`` or ``e2el``."""
        if metric not in ("ttft", "tpot", "itl", "e2el"):
            raise KeyError(f"unknown metric {metric!r}")
        d: Dist = getattr(self, metric)
        return d

    def value(self, metric: str, statistic: str) -> float:
        """One statistic of one metric in seconds, e.g. ``value("ttft", "p95")``."""
        return self.dist(metric).get(statistic)

    @property
    def failed_fraction(self) -> float:
        """Failed / (completed + failed); 0.0 when nothing finished."""
        total = self.completed + self.failed
        return self.failed / total if total else 0.0

    def as_dict(self) -> dict[str, Any]:
        """A JSON-serialisable flat dict (the ``vllm bench serve`` keys, see :meth:`to_bench_json`)."""
        return self.to_bench_json()

    def to_bench_json(self) -> dict[str, Any]:
        """The keys of ``vllm bench serve --save-result`` (latencies in ms), plus p90/p95 and max."""
        out: dict[str, Any] = {
            "duration": self.duration_s,
            "completed": self.completed,
            "failed": self.failed,
            "total_input_tokens": self.total_input_tokens,
            "total_output_tokens": self.total_output_tokens,
            "request_throughput": self.request_throughput,
            "request_goodput": self.goodput,
            "output_throughput": self.output_throughput,
            "total_token_throughput": self.total_token_throughput,
            "max_concurrency_seen": self.max_concurrency_seen,
        }
        for name in ("ttft", "tpot", "itl", "e2el"):
            d = self.dist(name)
            out[f"mean_{name}_ms"] = d.mean * 1e3
            out[f"median_{name}_ms"] = d.p50 * 1e3
            out[f"std_{name}_ms"] = d.std * 1e3
            for p in ("p90", "p95", "p99"):
                out[f"{p}_{name}_ms"] = d.get(p) * 1e3
            out[f"max_{name}_ms"] = d.max * 1e3
        return out


def goodput_limits(slo: SloSection | None) -> dict[str, float]:
    """Per-request limits (seconds) used for goodput: for each of ttft, tpot, e2el, its strictest term."""
    limits: dict[str, float] = {}
    if slo is None:
        return limits
    for term in slo.terms:
        if term.metric in PER_REQUEST_METRICS:
            limits[term.metric] = min(limits.get(term.metric, math.inf), term.limit_s)
    return limits


def request_values(record: RequestRecord) -> dict[str, float]:
    """A completed request's ttft, tpot (0 for a 1-token output, as vLLM's goodput) and e2el in seconds."""
    ttft = record.ttft or 0.0
    e2el = record.e2el or 0.0
    tokens = record.tokens
    tpot = (e2el - ttft) / (tokens - 1) if tokens > 1 else 0.0
    return {"ttft": ttft, "tpot": tpot, "e2el": e2el}


def summarize(records: Sequence[RequestRecord], duration_s: float, slo: SloSection | None) -> ProbeMetrics:
    """Summarise a probe's records over ``duration_s`` seconds, exactly as ``vllm bench serve`` would.

    Input tokens use ``usage.prompt_tokens`` when the server reported it, else the intended length;
    output tokens use ``usage.completion_tokens``, else the content-chunk count.
    """
    done = [r for r in records if r.success]
    ttfts: list[float] = []
    tpots: list[float] = []
    itls: list[float] = []
    e2els: list[float] = []
    limits = goodput_limits(slo)
    good = 0
    total_in = 0
    total_out = 0
    for r in done:
        vals = request_values(r)
        total_in += r.prompt_tokens if r.prompt_tokens is not None else r.input_len
        total_out += r.tokens
        ttfts.append(vals["ttft"])
        e2els.append(vals["e2el"])
        if r.tokens > 1:
            tpots.append(vals["tpot"])
        itls.extend(r.itls)
        if all(vals[m] <= lim for m, lim in limits.items()):
            good += 1
    dur = duration_s if duration_s > 0 else math.inf
    return ProbeMetrics(
        duration_s=duration_s,
        completed=len(done),
        failed=len(records) - len(done),
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        request_throughput=len(done) / dur,
        output_throughput=total_out / dur,
        total_token_throughput=(total_in + total_out) / dur,
        goodput=good / dur,
        ttft=Dist.of(ttfts),
        tpot=Dist.of(tpots),
        itl=Dist.of(itls),
        e2el=Dist.of(e2els),
        max_concurrency_seen=_max_concurrency(records),
    )


def _max_concurrency(records: Sequence[RequestRecord]) -> int:
    events: list[tuple[float, int]] = []
    for r in records:
        events.append((r.send_time, 1))
        events.append((max(r.end_time, r.send_time), -1))
    events.sort(key=lambda e: (e[0], e[1]))
    cur = best = 0
    for _, step in events:
        cur += step
        best = max(best, cur)
    return best
