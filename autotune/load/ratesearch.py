"""SLO-constrained throughput: the highest arrival rate that meets every SLO term, in few probe-seconds.

1. A saturation probe (rate = inf, ``saturation_requests`` requests) gives an upper bound ``R_max`` (its
   achieved request throughput; for the ``concurrency`` arrival process, its mean concurrency). If it meets
   every SLO term, that is the operating point.
2. Otherwise bisection between the best passing and the lowest failing rate, starting at
   ``first_guess × R_max``, until ``passing >= (1 - rate_tolerance) × failing`` or ``max_probes``.
   ``R_max`` is only a burst's estimate (its drain tail lowers its average): while no finite rate has
   failed, a pass is followed by a probe at the bracket's top, and a pass there raises the top by
   ``ABOVE_BURST``; the first failure confirms the top and bisection takes over.
3. A probe fails when its verdict is not ``pass``, when it was stopped early (clearly failed), or when it
   over-saturated the server (outstanding requests grew without bound, or the server's waiting queue did).
   No passing rate → ``slo_unreachable``.

:func:`make_probe` builds the probe callable from a base URL, model and workload; the caller wraps it with
its own liveness check.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from autotune.errors import InvalidMeasurementError, LoadError
from autotune.load import prom
from autotune.load.calibrate import PromptCalibration
from autotune.load.client import RequestRecord, RunResult, run_requests
from autotune.load.metrics import ProbeMetrics, summarize
from autotune.load.slo import EarlyStop, SloVerdict, evaluate, samples_needed
from autotune.load.workload import PromptFormat, arrival_times, build_requests, trace_timestamps
from autotune.spec import MeasurementSpec, SloSection, WorkloadSpec

if TYPE_CHECKING:
    from autotune.load.client import Engine
    from autotune.server.classify import Diagnosis

#: The first bisection guess as a fraction of the saturation throughput.
FIRST_GUESS = 0.7
#: How often a probe whose run failed its self-check is repeated before the study stops.
INVALID_RETRIES = 2
#: When every probe up to the burst estimate passed, the unconfirmed top of the bracket grows by this.
ABOVE_BURST = 1.5


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


Probe = Callable[[float], ProbeOutcome]


class ServerDiedError(LoadError):
    """Raised by a probe when the server's liveness check reports it dead; ends the rate search."""

    def __init__(self, diagnosis: Diagnosis) -> None:
        self.diagnosis = diagnosis
        super().__init__(f"the server died during a probe: {diagnosis.summary}")


@dataclass(frozen=True)
class ProbeReport:
    """One probe as the search judged it."""

    rate: float
    requests: int
    duration_s: float
    passed: bool
    why: str
    early_stopped: bool
    outcome: ProbeOutcome
    verdict: SloVerdict

    def as_dict(self) -> dict[str, Any]:
        """A JSON-serialisable summary of the probe (for trial user attributes)."""
        m = self.outcome.metrics
        return {
            "rate": None if math.isinf(self.rate) else round(self.rate, 6),
            "saturation": math.isinf(self.rate),
            "requests": self.requests,
            "completed": m.completed,
            "failed": m.failed,
            "duration_s": round(self.duration_s, 3),
            "passed": self.passed,
            "status": self.verdict.status,
            "why": self.why,
            "early_stopped": self.early_stopped,
            "oversaturated": self.outcome.oversaturated,
            "capacity": round(self.outcome.capacity, 6),
            "output_throughput": round(m.output_throughput, 3),
            "request_throughput": round(m.request_throughput, 6),
            "terms": {
                t.term.key: {"value_ms": round(t.value_s * 1e3, 3), "violation": round(t.violation, 4)}
                for t in self.verdict.terms
            },
            "server": self.outcome.server.as_dict() if self.outcome.server else None,
            "prompt_tokens_per_intended": self.outcome.prompt_tokens_per_intended,
        }


@dataclass(frozen=True)
class RateSearchResult:
    """The operating point (best passing probe) or ``slo_unreachable``, and every probe made."""

    slo_unreachable: bool
    rate: float | None
    """The best passing rate (inf when the saturation probe passed), or ``None``."""
    metrics: ProbeMetrics | None
    """The best passing probe's metrics: the operating point."""
    verdict: SloVerdict | None
    probes: tuple[ProbeReport, ...]
    r_max: float
    """The saturation probe's capacity estimate."""
    crash: Diagnosis | None = None
    """The liveness check's diagnosis when the server died during the search (the search stopped)."""

    @property
    def best(self) -> ProbeMetrics | None:
        """Alias of :attr:`metrics`: the operating point."""
        return self.metrics

    @property
    def best_rate(self) -> float | None:
        """Alias of :attr:`rate`."""
        return self.rate

    @property
    def best_violations(self) -> tuple[float, ...]:
        """The operating point's constraint values (term violations, then failed fraction - budget)."""
        return self.verdict.constraints if self.verdict is not None else ()

    @property
    def lowest_violations(self) -> tuple[float, ...]:
        """Constraints of the probe that came closest to passing (smallest worst violation)."""
        if not self.probes:
            return ()
        closest = min(self.probes, key=lambda p: max(p.verdict.constraints))
        return closest.verdict.constraints

    @property
    def reason(self) -> str:
        """One line: the operating point, or why no rate met the SLO."""
        if self.crash is not None:
            return f"server died during probe {len(self.probes) + 1}: {self.crash.summary}"
        if self.rate is not None:
            return f"operating point at {fmt_rate(self.rate)} req/s"
        if not self.probes:
            return "no probe ran"
        closest = min(self.probes, key=lambda p: max(p.verdict.constraints))
        return (
            f"no probed rate met the SLO ({len(self.probes)} probes, "
            f"closest at {fmt_rate(closest.rate)} req/s: {closest.why})"
        )

    @property
    def server_delta(self) -> dict[str, float | None] | None:
        """Server /metrics facts at the operating point (else the last probe), JSON-serialisable."""
        chosen = [p for p in self.probes if p.passed and p.rate == self.rate] or list(self.probes[-1:])
        if not chosen or chosen[0].outcome.server is None:
            return None
        return chosen[0].outcome.server.as_dict()

    @property
    def probe_seconds(self) -> float:
        """Total seconds spent probing."""
        return math.fsum(p.duration_s for p in self.probes)

    @property
    def slo_throughput(self) -> float | None:
        """Output tokens/s at the operating point (the SLO-constrained throughput), or ``None``."""
        return self.metrics.output_throughput if self.metrics is not None else None


def probe_requests(rate: float, slo: SloSection, measurement: MeasurementSpec) -> int:
    """A probe's request count: ``max(min_requests, rate × probe_duration, what the percentiles need)``.

    At ``rate = inf`` it is ``saturation_requests`` (still at least what the percentiles need).
    """
    need = max(samples_needed(t, measurement.min_tail_samples) for t in slo.terms)
    if math.isinf(rate):
        return max(measurement.saturation_requests, need)
    return max(measurement.min_requests, math.ceil(rate * measurement.probe_duration), need)


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


def judge(outcome: ProbeOutcome, slo: SloSection, measurement: MeasurementSpec) -> ProbeReport:
    """A probe judged: its SLO verdict, and failed when stopped early or over-saturated."""
    verdict = evaluate(slo, outcome.metrics, min_tail_samples=measurement.min_tail_samples)
    why: list[str] = []
    if outcome.early_stopped:
        why.append(f"stopped early: {outcome.stop_reason}")
    if outcome.oversaturated:
        why.append(f"over-saturated: {outcome.oversaturated}")
    if verdict.status != "pass":
        why.append(f"{verdict.status}: " + "; ".join(verdict.reasons))
    passed = not why
    return ProbeReport(
        rate=outcome.rate,
        requests=outcome.requests,
        duration_s=outcome.duration_s,
        passed=passed,
        why="; ".join(why) if why else "meets every SLO term",
        early_stopped=outcome.early_stopped,
        outcome=outcome,
        verdict=verdict,
    )


def fmt_rate(rate: float) -> str:
    """A rate for progress text: ``inf`` or three significant digits."""
    return "inf" if math.isinf(rate) else f"{rate:.3g}"


def find_slo_throughput(
    probe: Probe,
    slo: SloSection,
    measurement: MeasurementSpec,
    on_progress: Callable[[str], None] | None = None,
    *,
    first_guess: float = FIRST_GUESS,
) -> RateSearchResult:
    """Search the highest rate meeting ``slo`` with as few probe-seconds as possible (module docstring).

    A :class:`ServerDiedError` from ``probe`` ends the search: the result carries its diagnosis in ``crash``
    (and the best rate passed before, if any). Other exceptions (invalid measurement) propagate.
    """
    reports: list[ProbeReport] = []
    try:
        return _search(probe, slo, measurement, on_progress, first_guess, reports)
    except ServerDiedError as exc:
        if on_progress is not None:
            on_progress(str(exc))
        return _result(reports, crash=exc.diagnosis)


def _result(reports: list[ProbeReport], crash: Diagnosis | None = None) -> RateSearchResult:
    """The search's answer from its probes: the highest passing rate is the operating point."""
    best = max((r for r in reports if r.passed), key=lambda r: r.rate, default=None)
    return RateSearchResult(
        slo_unreachable=best is None,
        rate=best.rate if best else None,
        metrics=best.outcome.metrics if best else None,
        verdict=best.verdict if best else None,
        probes=tuple(reports),
        r_max=reports[0].outcome.capacity if reports else 0.0,
        crash=crash,
    )


def _valid_probe(probe: Probe, rate: float, on_progress: Callable[[str], None] | None) -> ProbeOutcome:
    """Run a probe, repeating it when its run failed the self-check (a busy client, not the server).

    After :data:`INVALID_RETRIES` repeats the :class:`InvalidMeasurementError` propagates: the study
    stops rather than record numbers that describe the client.
    """
    for attempt in range(INVALID_RETRIES + 1):
        try:
            return probe(rate)
        except InvalidMeasurementError as exc:
            if attempt == INVALID_RETRIES:
                raise
            if on_progress is not None:
                on_progress(f"probe at rate {fmt_rate(rate)} repeated: {exc}")
    raise AssertionError("unreachable")


def _search(
    probe: Probe,
    slo: SloSection,
    measurement: MeasurementSpec,
    on_progress: Callable[[str], None] | None,
    first_guess: float,
    reports: list[ProbeReport],
) -> RateSearchResult:
    def run(rate: float) -> ProbeReport:
        report = judge(_valid_probe(probe, rate, on_progress), slo, measurement)
        reports.append(report)
        if on_progress is not None:
            status = "pass" if report.passed else "fail"
            on_progress(
                f"probe {len(reports)} at rate {fmt_rate(rate)}: {status} "
                f"({report.requests} requests, {report.duration_s:.1f} s) - {report.why}"
            )
        return report

    sat = run(math.inf)
    r_max = sat.outcome.capacity
    if sat.passed or not r_max > 0 or math.isinf(r_max):
        return _result(reports)
    best: ProbeReport | None = None
    lo = 0.0
    hi = r_max
    # A burst's throughput only estimates capacity: until a finite-rate probe fails, the top of the
    # bracket is unconfirmed, and a pass close to it sends the search above it.
    confirmed = False
    rate = first_guess * r_max
    tolerance = measurement.rate_tolerance
    while len(reports) < measurement.max_probes:
        report = run(rate)
        if report.passed:
            best, lo = report, rate
        else:
            hi, confirmed = rate, True
        if not confirmed:  # passed below an unconfirmed top: probe the top, then raise it
            if rate >= hi:
                hi *= ABOVE_BURST
            rate = hi
            continue
        if best is not None and lo >= (1.0 - tolerance) * hi:
            break
        rate = (lo + hi) / 2
    return _result(reports)


# ----------------------------------------------------------------------------------------------
# The probe
# ----------------------------------------------------------------------------------------------


def _capacity(run: RunResult, concurrency: bool) -> float:
    done = [r for r in run.records if r.success]
    if not done or run.duration <= 0:
        return 0.0
    if concurrency:
        return math.fsum(r.end_time - r.send_time for r in done) / run.duration
    return len(done) / run.duration


def make_probe(
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
) -> Probe:
    """A probe callable: ``probe(rate)`` runs one probe at ``rate`` and returns its :class:`ProbeOutcome`.

    Each probe uses fresh prompts (seed = workload seed + probe number, so no probe hits another's prefix
    cache beyond the shared prefix), stops early when clearly failed, and, when ``metrics_url`` is given
    (the server's base URL), scrapes ``/metrics`` before and after and samples gauges during the probe.
    ``measurement.warmup_requests`` are sent once, before the first probe, and not recorded. For the
    ``concurrency`` arrival process ``rate`` is the number of concurrent streams. Raises
    :class:`~autotune.errors.InvalidMeasurementError` when a run fails its self-check, and
    :class:`~autotune.errors.LoadError` when ``/metrics`` cannot be scraped. By default ``/metrics`` is
    scraped from ``base_url``; pass ``metrics_url=""`` to skip it.

    ``alive`` (the server's liveness check: ``None`` when alive, else a diagnosis) runs before and after
    each probe; a diagnosis raises :class:`ServerDiedError`, which ends the search. ``save_dir`` receives
    ``probe-<k>.json`` per probe (``vllm bench serve`` keys plus per-request rows). ``workers`` and
    ``engine`` are passed to :func:`~autotune.load.client.run_requests`; by default they are the
    measurement's ``client_workers`` and ``client``. ``calibration`` (of the server's tokenizer,
    :func:`~autotune.load.calibrate.calibrate_workload`) makes synthetic text prompts exact in length.
    """
    prompt_format = prompt_format or workload.prompt_format
    workers = workers or measurement.client_workers
    engine = engine or measurement.client
    concurrency = workload.arrival.process == "concurrency"
    calibration_record = calibration.as_dict() if calibration is not None else None
    trace = trace_timestamps(workload.dataset, base_dir) if workload.arrival.process == "trace" else None
    count = [0]

    def send(rate: float, n: int, seed: int, stop: EarlyStop | None) -> tuple[RunResult, float]:
        requests = build_requests(
            workload, n, seed, base_dir, prompt_format=prompt_format, calibration=calibration
        )
        arrivals = arrival_times(workload.arrival, rate, n, seed, trace=trace)
        window = max(arrivals, default=0.0)
        limit = measurement.max_concurrency
        if concurrency and not math.isinf(rate):
            limit = max(1, round(rate))
        run = run_requests(
            base_url,
            model,
            workload.endpoint,
            requests,
            arrivals,
            ignore_eos=workload.ignore_eos,
            temperature=workload.temperature,
            request_timeout=measurement.request_timeout,
            max_concurrency=limit,
            stop=stop,
            workers=workers,
            engine=engine,
        )
        return run, window

    scrape_url = base_url if metrics_url is None else metrics_url

    def check_alive() -> None:
        diagnosis = alive() if alive is not None else None
        if diagnosis is not None:
            raise ServerDiedError(diagnosis)

    def probe(rate: float) -> ProbeOutcome:
        check_alive()
        if count[0] == 0 and measurement.warmup_requests:
            send(math.inf, measurement.warmup_requests, -1, None)
        count[0] += 1
        n = probe_requests(rate, slo, measurement)
        seed = workload.seed * 1000 + count[0]
        # The saturation probe is never stopped early: its throughput is the search's upper bound.
        stop = EarlyStop(slo, n) if early_stop and not math.isinf(rate) else None
        server = None
        if not scrape_url:
            run, window = send(rate, n, seed, stop)
        else:
            with httpx.Client(timeout=5.0) as client:
                before = prom.scrape(client, scrape_url)
                with prom.GaugeSampler(scrape_url, interval=sample_interval) as sampler:
                    run, window = send(rate, n, seed, stop)
                check_alive()
                after = prom.scrape(client, scrape_url)
            server = prom.delta(before, after, sampler.peaks)
        check_alive()
        run.raise_if_invalid()
        over = None
        if not concurrency and not run.stopped_early:
            # The server's own waiting queue is the better witness; outstanding requests are the fallback.
            queue = _queue_series(server, run.start, window)
            if queue is not None:
                over = _queue_growth(queue)
            else:
                over = oversaturation(run.records, run.start, window, rate)
        metrics = summarize(run.records, run.duration, slo)
        ratio = _prompt_ratio(run.records)
        if save_dir is not None:
            extra = {"prompt_tokens_per_intended": ratio, "prompt_calibration": calibration_record}
            _save_probe(save_dir / f"probe-{count[0]}.json", rate, n, run, metrics, over, extra)
        return ProbeOutcome(
            rate=rate,
            metrics=metrics,
            requests=n,
            duration_s=run.duration,
            arrival_window_s=window,
            capacity=_capacity(run, concurrency),
            early_stopped=run.stopped_early,
            stop_reason=run.stop_reason,
            oversaturated=over,
            server=server,
            prompt_tokens_per_intended=ratio,
        )

    return probe


def _save_probe(
    path: Path,
    rate: float,
    n: int,
    run: RunResult,
    metrics: ProbeMetrics,
    over: str | None,
    extra: dict[str, Any],
) -> None:
    rows = [
        {
            "index": r.index,
            "send_s": round(r.send_time - run.start, 6),
            "ttft_ms": None if r.ttft is None else round(r.ttft * 1e3, 3),
            "e2el_ms": None if r.e2el is None else round(r.e2el * 1e3, 3),
            "chunks": r.chunks,
            "output_tokens": r.output_tokens,
            "prompt_tokens": r.prompt_tokens,
            "input_len": r.input_len,
            "output_len": r.output_len,
            "status": r.status,
            "error": r.error or None,
        }
        for r in run.records
    ]
    data = {
        "rate": None if math.isinf(rate) else rate,
        "planned": n,
        "stopped_early": run.stopped_early,
        "stop_reason": run.stop_reason,
        "oversaturated": over,
        **extra,
        "client_cpu_s": round(run.cpu_s, 3),
        "client_loop_lag_p99_ms": round(run.loop_lag_p99_s * 1e3, 3),
        "server_bursts": round(run.server_bursts, 4),
        "chunks_per_token": None if run.chunks_per_token is None else round(run.chunks_per_token, 4),
        **metrics.to_bench_json(),
        "requests": rows,
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
