"""The SLO grammar: metric and statistic names, ``metric:statistic`` keys, ``metric:statistic<=limit`` terms.

A term such as ``ttft:p95<=500ms`` reads "the 95th percentile of TTFT over a probe's completed requests
must be at most 500 ms". Metrics and statistics are those of ``vllm bench serve`` (docs/vllm.md). This
module only parses; judging a probe against terms is :mod:`autotune.load.slo`'s job.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

METRICS: tuple[str, ...] = ("ttft", "tpot", "itl", "e2el")
STATISTICS: tuple[str, ...] = ("mean", "p50", "p90", "p95", "p99", "max")
_ALIASES = {"median": "p50"}
_KEY = re.compile(r"^\s*(?P<metric>[a-z][a-z0-9_]*)\s*:\s*(?P<stat>[a-z0-9.]+)\s*$")
_TERM = re.compile(
    r"^\s*(?P<key>[a-z][a-z0-9_]*\s*:\s*[a-z0-9.]+)\s*<=\s*(?P<value>\d+(?:\.\d*)?|\.\d+)\s*"
    r"(?P<unit>us|ms|s)?\s*$"
)
_UNIT = {"us": 1e-6, "ms": 1e-3, "s": 1.0}


@dataclass(frozen=True)
class MetricKey:
    """One statistic of one latency metric, e.g. ``ttft:p95``."""

    metric: str
    statistic: str

    @property
    def key(self) -> str:
        """The canonical text, e.g. ``ttft:p95`` (``median`` is spelt ``p50``)."""
        return f"{self.metric}:{self.statistic}"

    @property
    def quantile(self) -> float | None:
        """The quantile in (0, 1) for percentile statistics, else ``None`` (mean, max)."""
        if self.statistic.startswith("p"):
            return float(self.statistic[1:]) / 100.0
        return None


@dataclass(frozen=True)
class SloTerm(MetricKey):
    """One latency bound: ``statistic`` of ``metric`` must be ``<= limit_s`` seconds."""

    limit_s: float

    def __str__(self) -> str:
        return f"{self.key}<={self.limit_s * 1000:g}ms"


def parse_metric_key(text: str) -> MetricKey:
    """Parse ``metric:statistic`` (``ttft:p95``, ``e2el:median``). Raises ``ValueError`` naming the text."""
    match = _KEY.match(text)
    if not match:
        raise ValueError(f"invalid metric {text!r}: expected 'metric:statistic', e.g. 'ttft:p95'")
    metric = match.group("metric")
    stat = _ALIASES.get(match.group("stat"), match.group("stat"))
    if metric not in METRICS:
        raise ValueError(f"unknown SLO metric {metric!r} in {text!r}: use one of {', '.join(METRICS)}")
    if stat not in STATISTICS:
        raise ValueError(f"unknown SLO statistic {stat!r} in {text!r}: use one of {', '.join(STATISTICS)}")
    return MetricKey(metric, stat)


def parse_term(text: str) -> SloTerm:
    """Parse ``metric:statistic<=limit[unit]`` (unit ms by default). Raises ``ValueError`` naming the text."""
    match = _TERM.match(text)
    if not match:
        raise ValueError(
            f"invalid SLO term {text!r}: expected 'metric:statistic<=limit', e.g. 'ttft:p95<=500ms'"
        )
    try:
        key = parse_metric_key(match.group("key"))
    except ValueError as exc:
        raise ValueError(str(exc).replace(repr(match.group("key")), repr(text))) from exc
    limit = float(match.group("value")) * _UNIT[match.group("unit") or "ms"]
    if limit <= 0:
        raise ValueError(f"SLO limit must be > 0 in {text!r}")
    return SloTerm(metric=key.metric, statistic=key.statistic, limit_s=limit)
