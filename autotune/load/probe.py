"""One probe: the requests of the k-th probe at a rate, sent to the server, measured and saved.

:class:`ProbeSchedule` says what a probe sends (its request count, its seeded prompts and arrival times);
:class:`Prober` sends it through the streaming client, scrapes the server's ``/metrics`` around it,
judges over-saturation, and returns a :class:`ProbeOutcome`. The rate search
(:mod:`autotune.load.ratesearch`) calls a prober once per rate; the dry run (:mod:`autotune.predict.dryrun`)
replays the same schedule on the simulator.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import httpx

from autotune.inputs.slo_terms import MetricKey
from autotune.inputs.spec import MeasurementSpec, SloSection, WorkloadSpec
from autotune.load import evidence, prom
from autotune.load.calibrate import PromptCalibration
from autotune.load.client import load_job, run_requests
from autotune.load.conversation import (
    build_conversations,
    flatten,
    mean_think,
    mean_turns,
    ttft_by_turn,
)
from autotune.load.cpus import available_cores
from autotune.load.engines import Engine
from autotune.load.metrics import ProbeMetrics, summarize
from autotune.load.prefixes import ideal_hit_rate
from autotune.load.records import Preparation, RequestRecord, RunResult, new_run_id
from autotune.load.request import RequestSpec
from autotune.load.selfcheck import judged_statistics
from autotune.load.slo import EarlyStop, samples_needed
from autotune.load.workload import (
    PromptFormat,
    build_requests,
    trace_rate,
    trace_timestamps,
    unit_arrivals,
)
from autotune.outcome import Diagnosis, ServerFailedError


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
    records: tuple[RequestRecord, ...] = ()
    """The judged requests, in the order they were sent (what ``metrics`` summarises)."""
    warmup_s: float = 0.0
    """How long the warm-up requests before the judged ones were sent for."""
    stop_term: str | None = None
    """What an early stop judged: an SLO term's key, or ``error budget``."""
    ttft_by_turn: Mapping[str, Mapping[str, float]] | None = None
    """Multi-turn chat: the judged requests' TTFT by turn (:func:`.conversation.ttft_by_turn`)."""
    ideal_hit_rate: float | None = None
    """Shared prefixes or multi-turn chat: the share of the judged requests' prompt tokens a prefix cache
    keeping everything could serve (:func:`~autotune.load.prefixes.ideal_hit_rate`); the server's own
    figure is ``server.prefix_cache_hit_rate``."""
    trace_speed: float | None = None
    """A trace's arrivals: how many times faster than recorded this probe replayed them."""

    @property
    def tokens_per_request(self) -> float | None:
        """Mean output tokens of the judged requests that completed (``None`` when none did)."""
        done = [r.tokens for r in self.records if r.success]
        return math.fsum(done) / len(done) if done else None


class Probe(Protocol):
    """Runs one probe at ``rate`` after ``warmup_s`` seconds of warm-up load, judging at least
    ``window_s`` seconds of requests (raises :class:`~autotune.outcome.ServerFailedError` when the server
    died)."""

    def __call__(self, rate: float, warmup_s: float = 0.0, window_s: float = 0.0) -> ProbeOutcome: ...


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
    for the same probe of every trial."""
    return workload_seed * 1000 + number


STREAM = 0
"""The probe number whose seed draws the study's request stream (lengths and arrival pattern)."""
WARM = -1
"""The probe number whose seed draws the warm-up requests' stream."""
DRAIN_MIN_S = 5.0
"""Drain requests continue the stream for at least this long after the judged ones (stopped as soon as
every judged request has finished)."""


@dataclass(frozen=True)
class ProbePlan:
    """What one probe sends: warm-up requests, the judged requests, then drain requests, with their send
    offsets (seconds from the start). Only the judged ones are measured."""

    rate: float
    requests: tuple[RequestSpec, ...]
    arrivals: tuple[float, ...]
    judged: range
    """Indices (into ``requests``) of the judged requests."""
    compression: float = 1.0
    """How much faster than the stream's own pace (one request per second on average over the whole
    stream) the judged window is sent, divided by ``rate``: 1 where the window is as dense as the stream,
    above 1 where the stream's first requests are sparser than its average (a trace's calm start)."""

    @property
    def window_s(self) -> float:
        """When the last judged request is sent, counted from the first."""
        first, last = self.judged.start, self.judged.stop - 1
        return self.arrivals[last] - self.arrivals[first] if last > first else 0.0


@dataclass(frozen=True)
class Traffic:
    """What a probe's traffic was beyond its metrics: TTFT by turn, the prefix-cache hit rate a cache
    keeping everything would reach, the speed of a trace's replay (each ``None`` where it does not apply)."""

    ttft_by_turn: Mapping[str, Mapping[str, float]] | None = None
    ideal_hit_rate: float | None = None
    trace_speed: float | None = None

    def as_dict(
        self, plan: ProbePlan, records: Sequence[RequestRecord], server: prom.ServerDelta | None
    ) -> dict[str, Any]:
        """The keys a saved probe gains (none for a single-turn workload without shared prefixes nor a
        trace): each saved request's turn (beside its other per-request arrays), TTFT by turn, the ideal
        and the server's hit rate, the trace's speed."""
        out: dict[str, Any] = {}
        if self.ttft_by_turn is not None:
            out["turns"] = [plan.requests[r.index].turn for r in records]
            out["ttft_by_turn"] = self.ttft_by_turn
        if self.ideal_hit_rate is not None:
            out["prefix_hit_rate_ideal"] = self.ideal_hit_rate
            out["prefix_hit_rate_server"] = server.prefix_cache_hit_rate if server is not None else None
        if self.trace_speed is not None:
            out["trace_speed"] = self.trace_speed
        return out


class ProbeSchedule:
    """What each probe of a workload sends: request count, prompts and arrival times (deterministic).

    Common random numbers: for a synthetic or trace dataset every finite-rate probe of every trial of a
    study sends the same judged requests (the first ``count(rate)`` of one stream drawn from the workload
    seed: the same lengths in the same order) with the same arrival pattern, compressed or stretched to
    its rate (exactly ``rate`` requests per second over the judged window). Two configs probed at one rate
    get the same load, and the difference between their figures is the configs', not the draw's. Only
    the prompts' tokens differ from probe to probe (their seed is the probe's number), so a server's
    prefix cache never serves one probe from another. A dataset of text prompts (ShareGPT, JSONL) cannot
    vary its tokens: there each probe number draws its own requests (the same for that number in every
    trial). Before the judged requests come warm-up requests from a stream of their own, for
    ``warmup_s`` seconds at the same rate, so the judged ones meet a server already in its steady state;
    after them the stream goes on (drain requests) until the judged ones have finished.
    """

    def __init__(
        self,
        workload: WorkloadSpec,
        slo: SloSection,
        measurement: MeasurementSpec,
        base_dir: Path,
        *,
        prompt_format: PromptFormat | None = None,
        calibration: PromptCalibration | None = None,
        prompts: bool = True,
    ) -> None:
        self.workload = workload
        self.slo = slo
        self.measurement = measurement
        self.base_dir = base_dir
        self.prompt_format: PromptFormat = prompt_format or workload.prompt_format
        self.calibration = calibration
        self.prompts = prompts
        process = workload.arrival.process
        self._trace = trace_timestamps(workload.dataset, base_dir) if process == "trace" else None
        self.common = workload.dataset.kind in ("synthetic", "trace")
        """Whether every probe draws its lengths and arrivals from the study's one stream."""
        self.trace_rate = trace_rate(self._trace) if self._trace is not None else None
        """The trace's own mean rate as recorded (requests/s), when the arrivals replay a trace."""
        self.conversations = workload.conversation is not None
        """Whether the workload is multi-turn chat (a probe's unit is a conversation)."""
        self.shared = self.conversations or workload.dataset.prefix is not None
        """Whether requests share prefixes a cache can serve (groups, or a conversation's history)."""

    def count(self, rate: float) -> int:
        """How many judged requests a probe at ``rate`` sends."""
        return probe_requests(rate, self.slo, self.measurement)

    def requests(
        self, n: int, seed: int, shapes_seed: int | None = None, prefix_seed: int | None = None
    ) -> list[RequestSpec]:
        """``n`` requests drawn with ``seed`` (their lengths with ``shapes_seed``, their groups' system
        prompts with ``prefix_seed``, when given)."""
        return build_requests(
            self.workload,
            n,
            seed,
            self.base_dir,
            prompt_format=self.prompt_format,
            calibration=self.calibration,
            shapes_seed=shapes_seed,
            prompts=self.prompts,
            prefix_seed=prefix_seed,
        )

    def _stream(
        self, number: int, n: int, content: int, prefix: int
    ) -> tuple[list[RequestSpec], list[float]]:
        """``n`` requests of the stream ``number`` (STREAM, WARM) with tokens from ``content`` (system
        prompts from ``prefix``), and their send offsets at one request per second."""
        shapes = probe_seed(self.workload.seed, number) if self.common else content
        requests = self.requests(n, content, shapes if self.common else None, prefix)
        arrivals = unit_arrivals(self.workload.arrival, n, shapes, trace=self._trace)
        return requests, arrivals

    def plan(self, number: int, rate: float, warmup_s: float = 0.0, window_s: float = 0.0) -> ProbePlan:
        """The ``number``-th probe (from 1) at ``rate``, after ``warmup_s`` seconds of warm-up requests,
        judging ``count(rate)`` requests, or ``window_s`` seconds of them when that is more.

        At ``rate = inf`` (the saturation probe) every request is sent at once, with no warm-up or drain.
        For the ``concurrency`` process ``rate`` is the number of streams, every request is queued at 0,
        and the warm-up and drain requests are one stream's worth each."""
        n = self.count(rate)
        content = probe_seed(self.workload.seed, number)
        if math.isfinite(rate) and self.workload.arrival.process != "concurrency":
            n = max(n, math.ceil(rate * window_s))
        if math.isinf(rate) and not self.conversations:
            requests, _ = self._stream(STREAM, n, content, content)
            return ProbePlan(rate, tuple(requests), (0.0,) * n, range(n))
        if self.conversations:
            return self._plan_conversations(number, rate, n, warmup_s)
        concurrency = self.workload.arrival.process == "concurrency"
        if concurrency:
            streams = max(1, round(rate))
            n_warm = streams if warmup_s > 0 else 0
            n_drain = streams
        else:
            n_warm = math.ceil(rate * warmup_s)
            n_drain = math.ceil(rate * max(DRAIN_MIN_S, 3 * warmup_s))
        judged, unit = self._stream(STREAM, n + n_drain, content, content)
        warm, warm_unit = self._stream(WARM, n_warm + 1, -content, content)
        # Scaled so that the judged window offers exactly ``rate`` requests per second.
        span = unit[n - 1] if n > 1 else 0.0
        scale = (n - 1) / rate / span if span > 0 else 1.0 / rate
        start = warm_unit[n_warm] * scale if n_warm else 0.0
        arrivals = [t * scale for t in warm_unit[:n_warm]] + [start + t * scale for t in unit]
        requests = warm[:n_warm] + judged
        compression = span / (n - 1) if n > 1 and span > 0 else 1.0
        return ProbePlan(rate, tuple(requests), tuple(arrivals), range(n_warm, n_warm + n), compression)

    def traffic(self, plan: ProbePlan, judged: Sequence[RequestRecord]) -> Traffic:
        """The probe's traffic figures from its plan and its judged records."""
        by_turn = ttft_by_turn(judged, plan.requests) if self.conversations else None
        ideal = ideal_hit_rate(plan.requests, plan.judged) if self.shared else None
        speed = None
        if self.trace_rate is not None and math.isfinite(plan.rate):
            # the judged window's own stretch of the trace, played at ``rate``: its recorded rate is the
            # trace's mean rate over the compression
            speed = round(plan.rate / self.trace_rate * plan.compression, 4)
        return Traffic(by_turn, ideal, speed)

    def _conversations(self, number: int, n: int, content: int, prefix: int) -> list[list[RequestSpec]]:
        """``n`` conversations of the stream ``number`` (STREAM, WARM) with messages from ``content`` and
        system prompts from ``prefix``."""
        return build_conversations(
            self.workload,
            n,
            content,
            stream_seed=probe_seed(self.workload.seed, number),
            prefix_seed=prefix,
            prompt_format=self.prompt_format,
            calibration=self.calibration,
            prompts=self.prompts,
        )

    def _plan_conversations(self, number: int, rate: float, n: int, warmup_s: float) -> ProbePlan:
        """A multi-turn probe: conversations start at ``rate / mean turns`` per second, so the judged
        window offers ``rate`` requests per second on average. The judged requests are every turn of the
        fewest conversations of the stream that hold ``n`` turns; before them, warm-up conversations for
        one conversation's lifetime (``warmup_s`` per turn and the think times between turns); after them
        drain conversations, until every judged turn has finished. At ``rate = inf`` (the saturation
        probe) ``n`` conversations start at once and every turn of them is judged: as many conversations
        in flight as a single-turn saturation probe has requests."""
        content = probe_seed(self.workload.seed, number)
        spec = self.workload.conversation
        assert spec is not None
        turns = mean_turns(self.workload)
        if math.isinf(rate):
            requests = flatten(self._conversations(STREAM, n, content, content))
            return ProbePlan(rate, tuple(requests), (0.0,) * len(requests), range(len(requests)))
        count = 0
        judged: list[list[RequestSpec]] = []
        while count < n:  # the stream's first conversations, drawn in growing batches
            extra = max(8, math.ceil((n - count) / turns))
            more = self._conversations(STREAM, len(judged) + extra, content, content)
            judged, count = [], 0
            for conversation in more:
                judged.append(conversation)
                count += len(conversation)
                if count >= n:
                    break
        k = len(judged)
        per_s = rate / turns
        life = warmup_s * turns + mean_think(spec.think_time) * (turns - 1)
        n_warm = math.ceil(per_s * life) if warmup_s > 0 else 0
        n_drain = math.ceil(per_s * max(DRAIN_MIN_S, 3 * life))
        stream = self._conversations(STREAM, k + n_drain, content, content)
        warm = self._conversations(WARM, n_warm + 1, -content, content)[:n_warm]
        unit = unit_arrivals(self.workload.arrival, k + n_drain, probe_seed(self.workload.seed, STREAM))
        warm_unit = unit_arrivals(self.workload.arrival, n_warm + 1, probe_seed(self.workload.seed, WARM))
        span = unit[k - 1] if k > 1 else 0.0
        scale = (k - 1) / per_s / span if span > 0 else 1.0 / per_s
        start = warm_unit[n_warm] * scale if n_warm else 0.0
        starts = [t * scale for t in warm_unit[:n_warm]] + [start + t * scale for t in unit]
        conversations = warm + stream
        requests = flatten(conversations)
        arrivals = [t for t, c in zip(starts, conversations, strict=True) for _ in c]
        first = sum(len(c) for c in warm)
        return ProbePlan(rate, tuple(requests), tuple(arrivals), range(first, first + count))


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
    ``workers`` and ``engine`` default to the measurement's ``client_workers`` and ``client``; with
    ``client_workers: auto`` the client starts with one worker process and adds one after each run it
    could not keep up with (voided by its self-check, or a CPU warning), up to the cores it may use, and
    says so in that run's problems or warnings (``workers_from``: where it starts, what an earlier search
    of the study grew to).
    ``calibration`` (of the server's tokenizer) makes synthetic text prompts exact in length. The client's
    self-check voids a probe only over the statistics it judges: the SLO terms' and ``judged`` (a study's
    latency objectives); the error bounds of the others are recorded in the probe file and warned of.
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
        judged: Sequence[MetricKey] = (),
        workers_from: int = 1,
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
        auto = measurement.client_workers == "auto" and workers is None
        self.max_workers = max(1, math.floor(available_cores())) if auto else 0
        """``client_workers: auto``: the most worker processes the client may grow to (its cores); 0 for a
        fixed count."""
        fixed = workers or (0 if auto else int(measurement.client_workers))
        self.workers: int = fixed or max(1, min(workers_from, self.max_workers))
        self.engine: Engine = engine or measurement.client
        self.headers = dict(headers or {})
        self.id_prefix = id_prefix if id_prefix is not None else new_run_id()
        self.judged = judged_statistics([*slo.terms, *judged])
        """The statistics whose error bound voids a probe: the SLO terms' and ``judged`` (a study's
        latency objectives); the client's other bounds are recorded and warned of."""
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

    def _send(self, plan: ProbePlan, number: int, stop: EarlyStop | None) -> RunResult:
        rate = plan.rate
        limit = self.measurement.max_concurrency
        if self.concurrency and not math.isinf(rate):
            limit = max(1, round(rate))
        seed = probe_seed(self.workload.seed, number)
        warmup = (
            self.schedule.requests(self.measurement.warmup_requests, CONNECTION_WARMUP - seed)
            if self.measurement.warmup_requests
            else []
        )
        job = load_job(
            self.base_url,
            self.model,
            self.workload.endpoint,
            plan.requests,
            plan.arrivals,
            ignore_eos=self.workload.ignore_eos,
            temperature=self.workload.temperature,
            request_timeout=self.measurement.request_timeout,
            max_concurrency=limit,
            engine=self.engine,
            headers=self.headers,
            id_prefix=f"{self.id_prefix}p{number}-",
            prepare=Preparation(self._connections(rate, len(plan.judged)), tuple(warmup)),
            judged=self.judged,
        )
        return run_requests(job, stop=stop, workers=self.workers)

    def _grow(self, run: RunResult) -> RunResult:
        """After a run the client could not keep up with (voided, or its CPU over the limit): one more
        worker process for the next run, up to :attr:`max_workers`; ``run`` says so (its problems when
        voided, else its warnings)."""
        if self.workers >= self.max_workers:
            return run
        self.workers += 1
        said = f"the client now runs {self.workers} worker processes (of {self.max_workers} cores it may use)"
        if run.problems:
            return dataclasses.replace(run, problems=(*run.problems, said))
        return dataclasses.replace(run, warnings=(*run.warnings, said))

    def _check_alive(self) -> None:
        diagnosis = self.alive() if self.alive is not None else None
        if diagnosis is not None:
            raise ServerFailedError(diagnosis)

    def _send_scraped(
        self, plan: ProbePlan, number: int, stop: EarlyStop | None
    ) -> tuple[RunResult, prom.ServerDelta | None]:
        """Send the probe; with a metrics URL, the server's counters before and after it and its gauges'
        peaks during it."""
        if not self.scrape_url:
            return self._send(plan, number, stop), None
        with httpx.Client(timeout=5.0, headers=self.headers) as client:
            before = prom.scrape(client, self.scrape_url)
            with prom.GaugeSampler(
                self.scrape_url, interval=self.sample_interval, headers=self.headers
            ) as sampler:
                run = self._send(plan, number, stop)
            self._check_alive()
            after = prom.scrape(client, self.scrape_url)
        return run, prom.delta(before, after, sampler.peaks)

    def _oversaturated(
        self,
        run: RunResult,
        plan: ProbePlan,
        judged: Sequence[RequestRecord],
        server: prom.ServerDelta | None,
        rate: float,
    ) -> str | None:
        """Why the probe's queue grew without bound, or None: the server's own waiting queue is the better
        witness, outstanding requests the fallback (arrival-rate probes that ran their course only)."""
        if self.concurrency or run.stopped_early or not judged:
            return None
        start = run.start + plan.arrivals[plan.judged.start]
        queue = _queue_series(server, start, plan.window_s)
        if queue is not None:
            return _queue_growth(queue)
        return oversaturation(judged, start, plan.window_s, rate)

    def __call__(self, rate: float, warmup_s: float = 0.0, window_s: float = 0.0) -> ProbeOutcome:
        """Run the next probe at ``rate``, after ``warmup_s`` seconds of warm-up requests, judging at
        least ``window_s`` seconds of requests."""
        self._check_alive()
        number = self.count + 1
        plan = self.schedule.plan(number, rate, warmup_s, window_s)
        drained = len(plan.requests) > plan.judged.stop
        # The saturation probe is never stopped early: its throughput is the search's upper bound.
        stop = None
        if not math.isinf(rate) and (self.early_stop or drained):
            stop = EarlyStop(self.slo, plan.judged, finish=drained, early=self.early_stop)
        run, server = self._send_scraped(plan, number, stop)
        self._check_alive()
        judged = judged_records(run.records, plan.judged)
        metrics = summarize(judged, judged_span(judged), self.slo)
        ratio = _prompt_ratio(judged)
        traffic = self.schedule.traffic(plan, judged)
        extra = {
            "prompt_tokens_per_intended": ratio,
            "prompt_calibration": self._calibration_record,
            "judged": [plan.judged.start, plan.judged.stop],
            "warmup_s": round(warmup_s, 3),
            **traffic.as_dict(plan, run.records, server),
        }
        n = len(plan.judged)
        if not run.valid and not refused_by_the_server(judged):
            self._attempts += 1
            run = self._grow(run)
            if self.save_dir is not None:
                name = f"probe-{number}.invalid-{self._attempts}.json"
                _save_probe(self.save_dir / name, rate, n, run, metrics, None, extra, self.model)
            run.raise_if_invalid()
        if any(w.startswith("client CPU") for w in run.warnings):
            run = self._grow(run)
        self.count = number
        self._attempts = 0
        self._in_flight = (rate, metrics.max_concurrency_seen)
        over = self._oversaturated(run, plan, judged, server, rate)
        if self.save_dir is not None:
            _save_probe(
                self.save_dir / f"probe-{number}.json", rate, n, run, metrics, over, extra, self.model
            )
        return ProbeOutcome(
            rate=rate,
            metrics=metrics,
            requests=n,
            duration_s=run.duration,
            arrival_window_s=plan.window_s,
            capacity=_capacity(run, self.concurrency),
            early_stopped=run.stopped_early,
            stop_reason=run.stop_reason,
            oversaturated=over,
            server=server,
            prompt_tokens_per_intended=ratio,
            error_sample=next((r.error for r in judged if not r.success), None),
            records=tuple(judged),
            warmup_s=warmup_s,
            stop_term=getattr(run.stop_reason, "term", None),
            ttft_by_turn=traffic.ttft_by_turn,
            ideal_hit_rate=traffic.ideal_hit_rate,
            trace_speed=traffic.trace_speed,
        )


CONNECTION_WARMUP = -(10**9)
"""Seed offset of the unrecorded requests that warm a probe's connections (apart from every stream)."""


def judged_records(records: Sequence[RequestRecord], judged: range) -> list[RequestRecord]:
    """The records of the judged requests, in the order they were sent."""
    return sorted((r for r in records if r.index in judged), key=lambda r: r.index)


def judged_span(records: Sequence[RequestRecord]) -> float:
    """Seconds from the first judged request's send to the last one's end (0.0 without records)."""
    if not records:
        return 0.0
    return max(r.end_time for r in records) - min(r.send_time for r in records)


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
    seconds, summary percentiles in ms), plus request ids, absolute first-token times, the client's
    self-check and autotune's facts; and its per-chunk evidence beside it (:mod:`autotune.load.evidence`).

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
        "warnings": list(run.warnings),
        "client": run.client.as_dict(),
        "server_bursts": round(run.server_bursts, 4),
        "chunks_per_token": None if run.chunks_per_token is None else round(run.chunks_per_token, 4),
        "first_token_times": evidence.first_token_times(run),
        "evidence": evidence.evidence_path(path).name,
    }
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, separators=(",", ":")) + "\n", encoding="utf-8")
    except OSError as exc:
        raise evidence.write_failed("probe results", path, exc) from exc
    evidence.write_evidence(evidence.evidence_path(path), run)


def refused_by_the_server(records: Sequence[RequestRecord]) -> bool:
    """Whether the server answered every one of ``records`` with an HTTP error status: what such a run
    measured is the server's refusal, which no lateness or starvation of the client can make or move, so
    the self-check's verdict on the client's timing does not void it (the run reports the refusal)."""
    return bool(records) and all(not r.success and r.status is not None and r.status >= 400 for r in records)


def _prompt_ratio(records: Sequence[RequestRecord]) -> float | None:
    """Prompt tokens the server counted (usage) over the tokens intended, over the run's requests.

    1.0 means the prompts had the intended lengths: token-id prompts and calibrated text prompts do;
    uncalibrated text and file prompts (whose intended length is their word count) read off.
    """
    counted = [(r.prompt_tokens, r.input_len) for r in records if r.prompt_tokens is not None and r.input_len]
    if not counted:
        return None
    return round(sum(c for c, _ in counted) / sum(i for _, i in counted), 4)
