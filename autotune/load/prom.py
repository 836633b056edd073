"""vLLM's Prometheus ``/metrics``: parse the text exposition, scrape, diff, and sample gauges during a probe.

Counters, gauges and histogram series (``_bucket``/``_sum``/``_count``) are all kept as samples keyed by
name and labels. Values are summed over label sets (several engines or ``finished_reason`` labels), except
the KV-cache usage gauge, whose maximum over engines is taken. Old and new names are both understood
(``vllm:gpu_cache_usage_perc`` before ``vllm:kv_cache_usage_perc``).
"""

from __future__ import annotations

import math
import re
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import httpx

from autotune.errors import LoadError

Labels = tuple[tuple[str, str], ...]

KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
PREEMPTIONS = "vllm:num_preemptions_total"
PROMPT_TOKENS = "vllm:prompt_tokens_total"
GENERATION_TOKENS = "vllm:generation_tokens_total"
PREFIX_QUERIES = ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total")
PREFIX_HITS = ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total")
"""Prompt tokens looked up in the prefix cache, and those found (the ``gpu_`` names: vLLM 0.7 to 0.9)."""

_GAUGES = (*KV_USAGE, WAITING, RUNNING)

_SAMPLE = re.compile(
    r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)(?:\s+\S+)?\s*$"
)
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


def _unescape(text: str) -> str:
    return re.sub(r"\\[\\\"n]", lambda m: _UNESCAPE[m.group(0)], text)


def _value(text: str) -> float:
    low = text.lower()
    if low in ("+inf", "inf"):
        return math.inf
    if low == "-inf":
        return -math.inf
    if low == "nan":
        return math.nan
    return float(text)


@dataclass(frozen=True)
class Snapshot:
    """One scrape: every sample by ``(name, sorted labels)``, the metric types, and when it was taken."""

    samples: Mapping[tuple[str, Labels], float]
    types: Mapping[str, str] = field(default_factory=dict)
    time: float = 0.0
    """``time.perf_counter()`` at the scrape."""

    def series(self, name: str) -> dict[Labels, float]:
        """Every label set of metric ``name`` and its value."""
        return {labels: v for (n, labels), v in self.samples.items() if n == name}

    def sum(self, *names: str) -> float | None:
        """Sum over label sets of the first of ``names`` present (old/new names), else ``None``."""
        for name in names:
            values = self.series(name)
            if values:
                return math.fsum(values.values())
        return None

    def max(self, *names: str) -> float | None:
        """Maximum over label sets of the first of ``names`` present, else ``None``."""
        for name in names:
            values = self.series(name)
            if values:
                return max(values.values())
        return None

    def has(self, name: str) -> bool:
        """Whether any sample of ``name`` is present."""
        return any(n == name for n, _ in self.samples)


def parse(text: str, now: float | None = None, names: Sequence[str] | None = None) -> Snapshot:
    """Parse Prometheus text exposition format. Raises :class:`LoadError` naming a malformed line.

    ``names`` keeps only samples whose line starts with one of them (much cheaper on vLLM's large pages:
    the gauge sampler runs in the load client's process and must not hold the GIL for long).
    """
    samples: dict[tuple[str, Labels], float] = {}
    types: dict[str, str] = {}
    prefixes = tuple(names) if names is not None else None
    for lineno, raw in enumerate(text.splitlines(), 1):
        if prefixes is not None and not raw.startswith(prefixes):
            continue
        line = raw.strip()
        if not line:
            continue
        if line.startswith("#"):
            parts = line.split(None, 3)
            if len(parts) >= 4 and parts[1] == "TYPE":
                types[parts[2]] = parts[3].strip()
            continue
        m = _SAMPLE.match(line)
        if m is None:
            raise LoadError(f"/metrics line {lineno} is not a Prometheus sample: {line[:120]!r}")
        labels: list[tuple[str, str]] = []
        if m.group("labels"):
            labels = [(k, _unescape(v)) for k, v in _LABEL.findall(m.group("labels"))]
        try:
            value = _value(m.group("value"))
        except ValueError as exc:
            raise LoadError(f"/metrics line {lineno}: bad value {m.group('value')!r}") from exc
        samples[(m.group("name"), tuple(sorted(labels)))] = value
    return Snapshot(samples=samples, types=types, time=time.perf_counter() if now is None else now)


def scrape(client: httpx.Client, base_url: str, names: Sequence[str] | None = None) -> Snapshot:
    """GET ``{base_url}/metrics`` and parse it (only ``names`` when given).

    Raises :class:`LoadError` when the server is unreachable or does not answer 200.
    """
    url = base_url.rstrip("/").removesuffix("/v1") + "/metrics"
    try:
        resp = client.get(url)
    except httpx.HTTPError as exc:
        raise LoadError(f"cannot scrape {url}: {exc}") from exc
    if resp.status_code != 200:
        raise LoadError(f"{url} answered HTTP {resp.status_code}")
    return parse(resp.text, names=names)


@dataclass(frozen=True)
class GaugePeaks:
    """Peaks and last values of the load gauges over a probe (from a :class:`GaugeSampler`)."""

    samples: int = 0
    kv_usage_peak: float | None = None
    waiting_peak: float | None = None
    running_peak: float | None = None
    waiting_series: tuple[tuple[float, float], ...] = ()
    """``(perf_counter time, waiting)`` for every sample: the queue's trend over the probe."""


@dataclass(frozen=True)
class ServerDelta:
    """What the server reports changed over a probe (``None`` where it exposes no such metric)."""

    preemptions: float | None
    prompt_tokens: float | None
    generation_tokens: float | None
    kv_usage_peak: float | None
    kv_usage_last: float | None
    waiting_peak: float | None
    waiting_last: float | None
    running_peak: float | None
    running_last: float | None
    waiting_series: tuple[tuple[float, float], ...] = ()
    prefix_cache_queries: float | None = None
    """Prompt tokens the server looked up in its prefix cache during the probe (warm-up and drain too)."""
    prefix_cache_hits: float | None = None
    """Of those, the tokens it found cached."""

    @property
    def prefix_cache_hit_rate(self) -> float | None:
        """Hits over queries of the prefix cache during the probe (``None`` without queries or metrics)."""
        if not self.prefix_cache_queries or self.prefix_cache_hits is None:
            return None
        return round(self.prefix_cache_hits / self.prefix_cache_queries, 4)

    def as_dict(self) -> dict[str, float | None]:
        """The scalar fields, for trial user attributes (the prefix cache's hit rate where it was queried)."""
        cache = {"prefix_cache_hit_rate": self.prefix_cache_hit_rate} if self.prefix_cache_queries else {}
        return {
            **cache,
            "preemptions": self.preemptions,
            "prompt_tokens": self.prompt_tokens,
            "generation_tokens": self.generation_tokens,
            "kv_usage_peak": self.kv_usage_peak,
            "kv_usage_last": self.kv_usage_last,
            "waiting_peak": self.waiting_peak,
            "waiting_last": self.waiting_last,
            "running_peak": self.running_peak,
            "running_last": self.running_last,
        }


def _diff(before: Snapshot, after: Snapshot, *names: str) -> float | None:
    a = after.sum(*names)
    if a is None:
        return None
    b = before.sum(*names)
    return a - (b or 0.0)


def _peak(*values: float | None) -> float | None:
    present = [v for v in values if v is not None]
    return max(present) if present else None


def delta(before: Snapshot, after: Snapshot, peaks: GaugePeaks | None = None) -> ServerDelta:
    """Counter deltas between two scrapes and gauge peaks (the two scrapes plus ``peaks`` when given)."""
    p = peaks or GaugePeaks()
    kv_last = after.max(*KV_USAGE)
    waiting_last = after.sum(WAITING)
    running_last = after.sum(RUNNING)
    return ServerDelta(
        preemptions=_diff(before, after, PREEMPTIONS),
        prompt_tokens=_diff(before, after, PROMPT_TOKENS),
        generation_tokens=_diff(before, after, GENERATION_TOKENS),
        kv_usage_peak=_peak(before.max(*KV_USAGE), kv_last, p.kv_usage_peak),
        kv_usage_last=kv_last,
        waiting_peak=_peak(before.sum(WAITING), waiting_last, p.waiting_peak),
        waiting_last=waiting_last,
        running_peak=_peak(before.sum(RUNNING), running_last, p.running_peak),
        running_last=running_last,
        waiting_series=p.waiting_series,
        prefix_cache_queries=_diff(before, after, *PREFIX_QUERIES),
        prefix_cache_hits=_diff(before, after, *PREFIX_HITS),
    )


class GaugeSampler:
    """Polls ``/metrics`` every ``interval`` seconds in a thread to catch gauge peaks during a probe.

    Use as a context manager; read :attr:`peaks` after it exits. Scrape errors are counted, not raised
    (the server's liveness is the caller's check). Uses its own ``httpx.Client`` (not thread-shared).
    """

    def __init__(
        self,
        base_url: str,
        interval: float = 0.5,
        timeout: float = 2.0,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self._base_url = base_url
        self._headers = dict(headers or {})
        self._interval = interval
        self._timeout = timeout
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._kv: float | None = None
        self._waiting: float | None = None
        self._running: float | None = None
        self._series: list[tuple[float, float]] = []
        self._samples = 0
        self.errors = 0

    def __enter__(self) -> GaugeSampler:
        self._thread = threading.Thread(target=self._loop, name="autotune-gauges", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self._timeout + self._interval + 1.0)

    def _loop(self) -> None:
        with httpx.Client(timeout=self._timeout, headers=self._headers) as client:
            while not self._stop.is_set():
                try:
                    snap = scrape(client, self._base_url, names=_GAUGES)
                except LoadError:
                    self.errors += 1
                else:
                    self._samples += 1
                    self._kv = _peak(self._kv, snap.max(*KV_USAGE))
                    waiting = snap.sum(WAITING)
                    self._waiting = _peak(self._waiting, waiting)
                    self._running = _peak(self._running, snap.sum(RUNNING))
                    if waiting is not None:
                        self._series.append((snap.time, waiting))
                self._stop.wait(self._interval)

    @property
    def peaks(self) -> GaugePeaks:
        """What was seen so far."""
        return GaugePeaks(
            samples=self._samples,
            kv_usage_peak=self._kv,
            waiting_peak=self._waiting,
            running_peak=self._running,
            waiting_series=tuple(self._series),
        )
