"""One probe: the requests of the k-th probe at a rate, sent to the server, measured and saved.

:class:`ProbeSchedule` says what a probe sends (its request count, its seeded prompts and arrival times);
:class:`Prober` sends it through the streaming client, scrapes the server's ``/metrics`` around it,
judges over-saturation, and returns a :class:`ProbeOutcome`. The rate search
(:mod:`autotune.load.ratesearch`) calls a prober once per rate; the dry run (:mod:`autotune.dryrun`) replays
the same schedule on the simulator.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from autotune.errors import LoadError
from autotune.load import prom
from autotune.load.calibrate import PromptCalibration
from autotune.load.client import run_requests
from autotune.load.engines import Engine
from autotune.load.metrics import ProbeMetrics, summarize
from autotune.load.records import Preparation, RequestRecord, RunResult, new_run_id
from autotune.load.slo import EarlyStop, samples_needed
from autotune.load.workload import (
    PromptFormat,
    RequestSpec,
    arrival_times,
    build_requests,
    trace_timestamps,
)
from autotune.outcome import Diagnosis, ServerFailedError
from autotune.spec import MeasurementSpec, SloSection, WorkloadSpec


@dataclass(frozen=True)
class ProbeOutcome:
    """One probe at one rate: its metrics, how it ran, and what the server reported."""

    rate: float
    """Offered request rate (req/s; inf = all at once), or concurrency for the ``concurrency`` process."""
    metrics: ProbeMetrics
    requests: int
    """Planned request count."""
    duration_s: float
    """Probe-seconds spent (dispatch start to last request end)."""
    arrival_window_s: float
    """When the last request was scheduled to be sent (seconds after the start)."""
    capacity: float
    """This probe's estimate of the highest sustainable rate: achieved req/s (or mean concurrency)."""
    early_stopped: bool = False
    stop_reason: str | None = None
    oversaturated: str | None = None
    """Why the probe over-saturated the server, or ``None``."""
    server: prom.ServerDelta | None = None
    prompt_tokens_per_intended: float | None = None
    """Prompt tokens the server counted (usage) over those intended (1.0: the prompts were exact)."""
    error_sample: str | None = None
    """The error of the probe's first failed request, if one failed."""


Probe = Callable[[float], ProbeOutcome]
"""Runs one probe at a rate (raises :class:`~autotune.outcome.ServerFailedError` when the server died)."""


def probe_requests(rate: float, slo: SloSection, measurement: MeasurementSpec) -> int:
    """A probe's request count: ``max(min_requests, rate × probe_duration, what the percentiles need)``.

    At ``rate = inf`` it is ``saturation_requests`` (still at least what the percentiles need).
    """
    need = max(samples_needed(t, measurement.min_tail_samples) for t in slo.terms)
    if math.isinf(rate):
        return max(measurement.saturation_requests, need)
    return max(measurement.min_requests, math.ceil(rate * measurement.probe_duration), need)


def probe_seed(workload_seed: int, number: int) -> int:
    """The seed of the ``number``-th probe (from 1): fresh prompts for every probe of a trial, the same
    for the same probe of every trial (so configs are compared on the same requests)."""
    return workload_seed * 1000 + number


class ProbeSchedule:
    """What each probe of a workload sends: request count, prompts and arrival times (deterministic)."""

    def __init__(
        self,
        workload: WorkloadSpec,
        slo: SloSection,
        measurement: MeasurementSpec,
        base_dir: Path,
        *,
        prompt_format: PromptFormat | None = None,
        calibration: PromptCalibration | None = None,
    ) -> None:
        self.workload = workload
        self.slo = slo
        self.measurement = measurement
        self.base_dir = base_dir
        self.prompt_format: PromptFormat = prompt_format or workload.prompt_format
        self.calibration = calibration
        process = workload.arrival.process
        self._trace = trace_timestamps(workload.dataset, base_dir) if process == "trace" else None

    def count(self, rate: float) -> int:
        """How many requests a probe at ``rate`` sends."""
        return probe_requests(rate, self.slo, self.measurement)

    def requests(self, n: int, seed: int) -> list[RequestSpec]:
        """``n`` requests drawn with ``seed``."""
        return build_requests(
            self.workload,
            n,
            seed,
            self.base_dir,
            prompt_format=self.prompt_format,
            calibration=self.calibration,
        )

    def arrivals(self, rate: float, n: int, seed: int) -> list[float]:
        """Send offsets of ``n`` requests at ``rate`` drawn with ``seed``."""
        return arrival_times(self.workload.arrival, rate, n, seed, trace=self._trace)

    def probe(self, number: int, rate: float) -> tuple[list[RequestSpec], list[float]]:
        """The requests and send offsets of the ``number``-th probe (from 1) at ``rate``."""
        n = self.count(rate)
        seed = probe_seed(self.workload.seed, number)
        return self.requests(n, seed), self.arrivals(rate, n, seed)


class Prober:
    """``prober(rate)`` runs the next probe at ``rate`` against a server and returns its outcome.

    Each probe uses fresh prompts (:func:`probe_seed`), stops early when clearly failed, and, unless
    ``metrics_url=""``, scrapes ``/metrics`` (from ``base_url`` by default) before and after and samples
    gauges during the probe. Before its schedule starts, a probe opens the connections it will need (one
    per stream in ``concurrency`` mode and at saturation) and sends ``measurement.warmup_requests`` on
    them, unrecorded: the probe measures the server, not connection set-up. For the ``concurrency``
    arrival process ``rate`` is the number of concurrent streams. Every request carries ``headers`` and an
    ``X-Request-Id`` (``<prefix>p<probe>-<index>``).

    Every probe is saved to ``save_dir`` (``probe-<k>.json``: ``vllm bench serve --save-result
    --save-detailed`` keys, request ids, absolute start times, the client's self-check), an invalid one
    too (``probe-<k>.invalid-<attempt>.json``) before :class:`~autotune.errors.InvalidMeasurementError`
    is raised; its repeat reuses the probe's number and seed. :class:`~autotune.errors.LoadError` when
    ``/metrics`` cannot be scraped.

    ``alive`` (the server's liveness check: ``None`` when alive, else a diagnosis) runs before and after
    each probe; a diagnosis raises :class:`~autotune.outcome.ServerFailedError`, which ends the search.
    ``workers`` and ``engine`` default to the measurement's ``client_workers`` and ``client``.
    ``calibration`` (of the server's tokenizer) makes synthetic text prompts exact in length.
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        workload: WorkloadSpec,
        slo: SloSection,
        measurement: MeasurementSpec,
        *,
        base_dir: Path,
        metrics_url: str | None = None,
        prompt_format: PromptFormat | None = None,
        early_stop: bool = True,
        sample_interval: float = 0.5,
        alive: Callable[[], Diagnosis | None] | None = None,
        save_dir: Path | None = None,
        workers: int | None = None,
        engine: Engine | None = None,
        calibration: PromptCalibration | None = None,
        headers: Mapping[str, str] | None = None,
        id_prefix: str | None = None,
    ) -> None:
        self.base_url = base_url
        self.model = model
        self.workload = workload
        self.slo = slo
        self.measurement = measurement
        self.schedule = ProbeSchedule(
            workload, slo, measurement, base_dir, prompt_format=prompt_format, calibration=calibration
        )
        self.scrape_url = base_url if metrics_url is None else metrics_url
        self.early_stop = early_stop
        self.sample_interval = sample_interval
        self.alive = alive
        self.save_dir = save_dir
        self.workers = workers or measurement.client_workers
        self.engine: Engine = engine or measurement.client
        self.headers = dict(headers or {})
        self.id_prefix = id_prefix if id_prefix is not None else new_run_id()
        self.concurrency = workload.arrival.process == "concurrency"
        self._calibration_record = calibration.as_dict() if calibration is not None else None
        self.count = 0
        """Probes run so far (an invalid attempt does not count: its repeat takes its number)."""
        self._attempts = 0
        self._in_flight: tuple[float, int] | None = None
        """(rate, most requests in flight) of the last probe: how many connections the next one needs."""

    def _connections(self, rate: float, n: int) -> int:
        """Connections a probe opens ahead: one per stream when all start at once (saturation, or the
        concurrency process), else the in-flight peak of the last probe scaled to this rate."""
        if math.isinf(rate):
            return n
        if self.concurrency:
            return min(n, max(1, round(rate)))
        if self._in_flight is None:
            return min(n, 8)
        last_rate, peak = self._in_flight
        scale = rate / last_rate if math.isfinite(last_rate) and last_rate > 0 else 1.0
        return min(n, max(8, math.ceil(peak * scale)))

    def _send(
        self, rate: float, n: int, seed: int, number: int, stop: EarlyStop | None
    ) -> tuple[RunResult, float]:
        requests = self.schedule.requests(n, seed)
        arrivals = self.schedule.arrivals(rate, n, seed)
        window = max(arrivals, default=0.0)
        limit = self.measurement.max_concurrency
        if self.concurrency and not math.isinf(rate):
            limit = max(1, round(rate))
        warmup = (
            self.schedule.requests(self.measurement.warmup_requests, -seed)
            if self.measurement.warmup_requests
            else []
        )
        run = run_requests(
            self.base_url,
            self.model,
            self.workload.endpoint,
            requests,
            arrivals,
            ignore_eos=self.workload.ignore_eos,
            temperature=self.workload.temperature,
            request_timeout=self.measurement.request_timeout,
            max_concurrency=limit,
            stop=stop,
            workers=self.workers,
            engine=self.engine,
            headers=self.headers,
            id_prefix=f"{self.id_prefix}p{number}-",
            prepare=Preparation(self._connections(rate, n), tuple(warmup)),
        )
        return run, window

    def _check_alive(self) -> None:
        diagnosis = self.alive() if self.alive is not None else None
        if diagnosis is not None:
            raise ServerFailedError(diagnosis)

    def __call__(self, rate: float) -> ProbeOutcome:
        """Run the next probe at ``rate``."""
        self._check_alive()
        number = self.count + 1
        n = self.schedule.count(rate)
        seed = probe_seed(self.workload.seed, number)
        # The saturation probe is never stopped early: its throughput is the search's upper bound.
        stop = EarlyStop(self.slo, n) if self.early_stop and not math.isinf(rate) else None
        server = None
        if not self.scrape_url:
            run, window = self._send(rate, n, seed, number, stop)
        else:
            with httpx.Client(timeout=5.0, headers=self.headers) as client:
                before = prom.scrape(client, self.scrape_url)
                with prom.GaugeSampler(
                    self.scrape_url, interval=self.sample_interval, headers=self.headers
                ) as sampler:
                    run, window = self._send(rate, n, seed, number, stop)
                self._check_alive()
                after = prom.scrape(client, self.scrape_url)
            server = prom.delta(before, after, sampler.peaks)
        self._check_alive()
        metrics = summarize(run.records, run.duration, self.slo)
        ratio = _prompt_ratio(run.records)
        extra = {"prompt_tokens_per_intended": ratio, "prompt_calibration": self._calibration_record}
        if not run.valid:
            self._attempts += 1
            if self.save_dir is not None:
                name = f"probe-{number}.invalid-{self._attempts}.json"
                _save_probe(self.save_dir / name, rate, n, run, metrics, None, extra, self.model)
            run.raise_if_invalid()
        self.count = number
        self._attempts = 0
        self._in_flight = (rate, metrics.max_concurrency_seen)
        over = None
        if not self.concurrency and not run.stopped_early:
            # The server's own waiting queue is the better witness; outstanding requests are the fallback.
            queue = _queue_series(server, run.start, window)
            if queue is not None:
                over = _queue_growth(queue)
            else:
                over = oversaturation(run.records, run.start, window, rate)
        if self.save_dir is not None:
            _save_probe(
                self.save_dir / f"probe-{number}.json", rate, n, run, metrics, over, extra, self.model
            )
        return ProbeOutcome(
            rate=rate,
            metrics=metrics,
            requests=n,
            duration_s=run.duration,
            arrival_window_s=window,
            capacity=_capacity(run, self.concurrency),
            early_stopped=run.stopped_early,
            stop_reason=run.stop_reason,
            oversaturated=over,
            server=server,
            prompt_tokens_per_intended=ratio,
            error_sample=next((r.error for r in run.records if not r.success), None),
        )


def _capacity(run: RunResult, concurrency: bool) -> float:
    done = [r for r in run.records if r.success]
    if not done or run.duration <= 0:
        return 0.0
    if concurrency:
        return math.fsum(r.end_time - r.send_time for r in done) / run.duration
    return len(done) / run.duration


def oversaturation(records: Sequence[RequestRecord], start: float, window: float, rate: float) -> str | None:
    """Why a probe at ``rate`` over-saturated the server (outstanding requests kept growing), or ``None``.

    Outstanding requests are counted at the middle and the end of the arrival window. Unbounded growth
    means an increase of more than 20% of what arrived in that half, and more than Poisson noise
    (``3 × sqrt(mid) + 3``), provided most early requests (p90 of E2EL of those sent in the first
    quarter) finished before the middle, so the count had reached its steady state by then.
    """
    if math.isinf(rate) or window < 2.0 or len(records) < 20:
        return None
    early = sorted(r.end_time - r.send_time for r in records if r.send_time - start <= window / 4)
    if not early or early[int(0.9 * (len(early) - 1))] > window / 2:
        return None

    def outstanding(t: float) -> int:
        return sum(1 for r in records if r.send_time <= t < r.end_time)

    mid, end = outstanding(start + window / 2), outstanding(start + window)
    grew = end - mid
    if grew > 0.2 * rate * (window / 2) and grew > 3 * math.sqrt(mid) + 3:
        return (
            f"outstanding requests grew from {mid} to {end} in the second half of the arrival window "
            f"({grew / (window / 2):.2f}/s at {rate:.2f} req/s offered)"
        )
    return None


def _queue_series(
    server: prom.ServerDelta | None, start: float, window: float
) -> list[tuple[float, float]] | None:
    if server is None:
        return None
    series = [(t, w) for t, w in server.waiting_series if start <= t <= start + window]
    return series if len(series) >= 4 else None


def _queue_growth(series: list[tuple[float, float]]) -> str | None:
    """Why the server's waiting queue grew without bound over the arrival window, or ``None``."""
    half = len(series) // 2
    first = sum(w for _, w in series[:half]) / half
    second = sum(w for _, w in series[half:]) / (len(series) - half)
    last = series[-1][1]
    if last >= 8 and second > 2 * first + 4 and last >= second:
        return f"the server's waiting queue kept growing (mean {first:.0f} → {second:.0f}, last {last:.0f})"
    return None


def _save_probe(
    path: Path,
    rate: float,
    n: int,
    run: RunResult,
    metrics: ProbeMetrics,
    over: str | None,
    extra: dict[str, Any],
    model: str,
) -> None:
    """Write one probe in ``vllm bench serve --save-result --save-detailed`` form (per-request arrays in
    seconds, summary percentiles in ms), plus request ids, the client's self-check and autotune's facts.

    ``start_times`` are absolute (Unix seconds); vLLM writes ``perf_counter()`` values, whose origin is
    arbitrary: ``start_times_perf_counter`` keeps those.
    """
    records = run.records
    offset = run.wall_start - run.start
    data = {
        "date": time.strftime("%Y%m%d-%H%M%S", time.localtime(run.wall_start)),
        "backend": "openai",
        "model_id": model,
        "num_prompts": n,
        "request_rate": "inf" if math.isinf(rate) else rate,
        "rate": None if math.isinf(rate) else rate,
        "planned": n,
        **metrics.to_bench_json(),
        "input_lens": [r.prompt_tokens if r.prompt_tokens is not None else r.input_len for r in records],
        "output_lens": [r.tokens if r.success else 0 for r in records],
        "ttfts": [r.ttft if r.ttft is not None else 0.0 for r in records],
        "itls": [r.itls for r in records],
        "latencies": [r.e2el if r.e2el is not None else 0.0 for r in records],
        "start_times": [round(r.send_time + offset, 6) for r in records],
        "start_times_perf_counter": [r.send_time for r in records],
        "errors": [r.error for r in records],
        "request_ids": [r.request_id for r in records],
        "intended_input_lens": [r.input_len for r in records],
        "intended_output_lens": [r.output_len for r in records],
        "statuses": [r.status for r in records],
        "stopped_early": run.stopped_early,
        "stop_reason": run.stop_reason,
        "oversaturated": over,
        **extra,
        "valid": run.valid,
        "problems": list(run.problems),
        "client": run.client.as_dict(),
        "server_bursts": round(run.server_bursts, 4),
        "chunks_per_token": None if run.chunks_per_token is None else round(run.chunks_per_token, 4),
    }
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, separators=(",", ":")) + "\n", encoding="utf-8")
    except OSError as exc:
        raise LoadError(f"cannot write probe results to {str(path)!r}: {exc}") from exc


def _prompt_ratio(records: Sequence[RequestRecord]) -> float | None:
    """Prompt tokens the server counted (usage) over the tokens intended, over the run's requests.

    1.0 means the prompts had the intended lengths: token-id prompts and calibrated text prompts do;
    uncalibrated text and file prompts (whose intended length is their word count) read off.
    """
    counted = [(r.prompt_tokens, r.input_len) for r in records if r.prompt_tokens is not None and r.input_len]
    if not counted:
        return None
    return round(sum(c for c, _ in counted) / sum(i for _, i in counted), 4)
