"""Measure a running server alone (no launch): one probe at a fixed rate, or the SLO-constrained throughput.

``autotune bench SPEC --url URL`` checks a deployed config with the spec's workload, SLO and measurement
settings: the same probes, metrics (``vllm bench serve`` definitions) and rate search as a trial, pointed
at a server someone else started. Before measuring, ``/health`` must answer 200 and ``/v1/models`` must list
the model; between probes ``/health`` must still answer 200, else the bench stops and says why
(:attr:`BenchResult.stopped`). This module returns values; the CLI prints them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from autotune.errors import LoadError, ServerError, SpecError
from autotune.inputs.loader import Access, LoadedStudy
from autotune.inputs.slo_terms import MetricKey
from autotune.load.calibrate import calibrate_or_explain
from autotune.load.conversation import turn_summary
from autotune.load.metrics import ProbeMetrics
from autotune.load.probe import Probe, ProbeOutcome, Prober
from autotune.load.ratesearch import (
    ProbeReport,
    RateSearchResult,
    find_slo_throughput,
    fmt_rate,
    judge,
    valid_probe,
)
from autotune.load.selfcheck import MAX_SHIFT, lateness_shifts
from autotune.load.workload import trace_rate, trace_timestamps
from autotune.outcome import Diagnosis, ServerFailedError
from autotune.server.classify import classify_runtime_failure
from autotune.server.endpoint import Endpoint

#: The latency table's columns and rows.
SHOWN_STATISTICS = ("mean", "p50", "p90", "p95", "p99")
SHOWN_METRICS = ("ttft", "tpot", "itl", "e2el")
#: Seconds ``/health`` and ``/v1/models`` may take to answer.
HEALTH_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class BenchResult:
    """What a bench measured: the probes (a rate search, or one probe at a fixed rate), and why it stopped
    early, if it did."""

    url: str
    model: str
    fixed_rate: float | None
    """The rate of the single probe (``--rate``), or ``None`` when the rate search ran."""
    search: RateSearchResult
    """Every probe and the operating point (the passing probe of the highest rate)."""
    stopped: str | None = None
    """Why the bench stopped before it was done (the server stopped answering ``/health`` with 200)."""
    calibration: dict[str, Any] | None = None
    """How synthetic text prompts were calibrated (or why they could not be); ``None``: not needed."""

    @property
    def probes(self) -> tuple[ProbeReport, ...]:
        """Every probe made."""
        return self.search.probes

    @property
    def rate(self) -> float | None:
        """The best passing rate (inf when every request at once passed), or ``None``."""
        return self.search.rate

    @property
    def metrics(self) -> ProbeMetrics | None:
        """The operating point's metrics, or ``None`` when no probe passed."""
        return self.search.metrics

    @property
    def slo_throughput(self) -> float | None:
        """Output tokens/s at the operating point (the SLO-constrained throughput), or ``None``."""
        return self.search.slo_throughput

    @property
    def reason(self) -> str:
        """One line: the operating point, or why no probed rate met the SLO."""
        if self.fixed_rate is None or not self.probes:
            return self.search.reason if self.probes else "no probe finished"
        probe = self.probes[0]
        rate = fmt_rate(self.fixed_rate)
        if probe.passed:
            return f"rate {rate} req/s meets the SLO"
        return f"rate {rate} req/s does not meet the SLO: {probe.why}"


def parse_url(url: str) -> str:
    """The server's base URL (``http[s]://HOST[:PORT]``, no trailing ``/`` or ``/v1``) from ``--url``.

    Raises :class:`SpecError` naming ``--url`` and the value when it is not an http(s) URL with a host.
    """
    hint = "expected a server base URL such as http://127.0.0.1:8000"
    try:
        parsed = httpx.URL(url.strip())
    except (httpx.InvalidURL, TypeError) as exc:
        raise SpecError("--url", f"invalid URL {url!r}: {exc}; {hint}") from exc
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise SpecError("--url", f"invalid URL {url!r}: {hint}")
    if parsed.query or parsed.fragment:
        raise SpecError("--url", f"invalid URL {url!r}: no query or fragment; {hint}")
    path = parsed.path.rstrip("/").removesuffix("/v1").rstrip("/")
    return str(parsed.copy_with(path=path or "/")).rstrip("/")


def parse_rate(text: str) -> float:
    """A ``--rate`` value: requests/s > 0, or ``inf`` (every request at once). Raises :class:`SpecError`."""
    try:
        rate = float(text)
    except ValueError:
        rate = math.nan
    if math.isnan(rate) or rate <= 0:
        raise SpecError("--rate", f"invalid rate {text!r}: use requests per second > 0, inf, or trace")
    return rate


TRACE_RATE = "trace"
"""``--rate trace``: one probe at the trace's own rate as recorded, times ``dataset.time_scale``."""


def trace_replay_rate(loaded: LoadedStudy) -> float:
    """The rate ``--rate trace`` replays the study's trace at: its mean rate as recorded (requests over its
    span) times ``workload.dataset.time_scale`` (default 1). Raises :class:`SpecError` naming ``--rate``
    when the workload does not replay a trace's arrivals, or the trace has no span."""
    workload = loaded.spec.workload
    if workload.arrival.process != "trace":
        raise SpecError(
            "--rate",
            f"'trace' replays a trace's arrivals: needs workload.arrival.process 'trace', got "
            f"{workload.arrival.process!r}",
        )
    try:
        recorded = trace_rate(trace_timestamps(workload.dataset, loaded.base_dir))
    except LoadError as exc:
        raise SpecError("workload.dataset.path", str(exc)) from exc
    if recorded is None:
        raise SpecError(
            "--rate", f"the trace {workload.dataset.path!r} has no span (one timestamp): give a rate"
        )
    return recorded * (workload.dataset.time_scale or 1.0)


def check_server(url: str, model: str, *, metrics: bool = True, access: Access | None = None) -> None:
    """Fail fast when nothing usable answers at ``url``.

    Raises :class:`ServerError` (exit 1) when ``/health`` cannot be reached or does not answer 200, or
    (with ``metrics``) ``/metrics`` does not answer 200; :class:`SpecError` naming ``--model`` when
    ``/v1/models`` does not list ``model``, and naming the key or header when the server refuses them.
    """
    access = access or Access()
    with Endpoint(url, timeout=HEALTH_TIMEOUT_S, headers=access.request_headers()) as endpoint:
        health = endpoint.get("/health")
        if health is None:
            raise ServerError(
                f"cannot reach the server at {url} ({endpoint.last_error}): start it, or check --url "
                "(host and port of a running `vllm serve`)"
            )
        if health.status_code != 200:
            raise ServerError(
                f"{url}/health answered {health.status_code}, not 200: the server is not ready; "
                "wait for it or check its log"
            )
        served = endpoint.models()
        if endpoint.refused is not None:
            raise refused_error(endpoint.refused, access)
        if served is None:
            raise ServerError(
                f"{url}/v1/models did not list the served models: is this an OpenAI-compatible "
                "server? check --url"
            )
        if metrics:
            status = endpoint.metrics_status()
            if status != 200:
                raise ServerError(
                    f"{url}/metrics answered {status or 'nothing'}, not 200: pass --no-metrics to measure "
                    "without the server's Prometheus metrics"
                )
    if model not in served:
        raise SpecError(
            "--model",
            f"model {model!r} is not served at {url} (it serves: {', '.join(served) or 'nothing'}); "
            "pass --model NAME or fix server.model in the spec",
        )


def refused_error(words: str, access: Access) -> SpecError:
    """The server refused the request's credentials: one line naming what to fix."""
    if access.api_key:
        field = "server.api_key_env"
    elif access.headers:
        field = "workload.headers"
    else:
        return SpecError(
            "server.api_key_env", f"the server wants an API key ({words}): name the variable that holds it"
        )
    return SpecError(field, f"the server refused it ({words})")


def health_check(url: str, headers: Mapping[str, str] | None = None) -> Callable[[], Diagnosis | None]:
    """The liveness check run before and after each probe: ``None`` while ``/health`` answers 200."""

    def alive() -> Diagnosis | None:
        with Endpoint(url, timeout=HEALTH_TIMEOUT_S, headers=headers) as endpoint:
            status = endpoint.health()
        if status == 200:
            return None
        return classify_runtime_failure("", None, status)

    return alive


def prepare_save_dir(path: Path) -> Path:
    """Create ``--save-result``'s folder now, so a bad path fails before any probe.

    Raises :class:`SpecError` naming ``--save-result`` when it is a file or cannot be created.
    """
    if path.exists() and not path.is_dir():
        raise SpecError("--save-result", f"{str(path)!r} exists and is not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SpecError("--save-result", f"cannot create {str(path)!r}: {exc.strerror or exc}") from exc
    return path


def run_bench(
    loaded: LoadedStudy,
    url: str,
    *,
    model: str | None = None,
    rate: float | None = None,
    save_dir: Path | None = None,
    scrape_metrics: bool = True,
    on_progress: Callable[[str], None] | None = None,
    access: Access | None = None,
) -> BenchResult:
    """Measure the server at ``url`` with ``loaded``'s workload, SLO and measurement settings.

    ``access`` holds the API key and extra headers; an ``https`` URL is measured with the aiohttp engine
    (the raw engine speaks plain http).

    ``rate`` runs one probe at that rate (not stopped early, so every request is measured; repeated as a
    study repeats it when the client's self-check voids it, ``measurement.invalid_retries``); ``None`` runs
    the SLO-constrained throughput search. ``model`` overrides ``server.model``; ``save_dir`` receives
    ``probe-<k>.json`` per probe (``vllm bench serve --save-result`` keys); ``scrape_metrics=False`` skips
    ``/metrics``. Raises :class:`SpecError` for bad input, :class:`ServerError` when the server cannot be
    reached before the first probe; a server that stops answering ``/health`` with 200 between probes ends
    the bench with :attr:`BenchResult.stopped` set.
    """
    base = parse_url(url)
    served = model if model is not None else loaded.spec.server.model
    if save_dir is not None:
        prepare_save_dir(save_dir)
    access = access or Access()
    headers = access.request_headers()
    check_server(base, served, metrics=scrape_metrics, access=access)
    spec = loaded.spec
    calibration, record = calibrate_or_explain(base, served, spec.workload, loaded.tokenizer_path, headers)
    if record is not None and record.get("error") and on_progress is not None:
        on_progress(f"prompt lengths not calibrated: {record['error']}")
    probe = Prober(
        base,
        served,
        spec.workload,
        spec.slo,
        spec.measurement,
        base_dir=loaded.base_dir,
        metrics_url=None if scrape_metrics else "",
        early_stop=rate is None,
        alive=health_check(base, headers),
        save_dir=save_dir,
        calibration=calibration,
        headers=headers,
        engine="aiohttp" if base.startswith("https://") else None,
    )
    result = _measure(loaded, base, served, probe, rate, on_progress)
    refused = _refused_requests(result)
    if refused is not None:
        raise refused_error(refused, access)
    return dataclasses.replace(result, calibration=record)


def _refused_requests(result: BenchResult) -> str | None:
    """The server's words when every request of the first probe was refused (HTTP 401/403)."""
    first = result.probes[0].outcome if result.probes else None
    sample = first.error_sample if first is not None else None
    if first is None or first.metrics.completed or sample is None:
        return None
    return sample if sample.startswith(("HTTP 401", "HTTP 403")) else None


def failed_everything(result: BenchResult) -> str | None:
    """Why a bench measured nothing: every request of every probe failed (the first error), else None."""
    if not result.probes or any(p.outcome.metrics.completed for p in result.probes):
        return None
    sample = next((p.outcome.error_sample for p in result.probes if p.outcome.error_sample), "")
    return f"every request failed; the first error: {sample}"


def _measure(
    loaded: LoadedStudy,
    base: str,
    served: str,
    probe: Probe,
    rate: float | None,
    on_progress: Callable[[str], None] | None,
) -> BenchResult:
    spec = loaded.spec
    if rate is None:
        search = find_slo_throughput(probe, spec.slo, spec.measurement, on_progress=on_progress)
    else:
        try:
            outcome = valid_probe(probe, rate, spec.measurement, on_progress=on_progress)
            report = judge(outcome, spec.slo, spec.measurement)
        except ServerFailedError as exc:
            search = RateSearchResult((), crash=exc.diagnosis)
        else:
            if on_progress is not None:
                status = "pass" if report.passed else "fail"
                on_progress(
                    f"probe at rate {fmt_rate(rate)}: {status} ({report.requests} requests) - {report.why}"
                )
            search = RateSearchResult((report,))
    stopped = _stopped(base, search.crash) if search.crash is not None else None
    return BenchResult(base, served, rate, search, stopped)


def _stopped(url: str, diagnosis: Diagnosis) -> str:
    return f"the server at {url} stopped answering /health with 200 ({diagnosis.summary}); check its log"


def render_report(result: BenchResult) -> str:
    """The readable report of `autotune bench`: latencies, throughput, each probe, the operating point."""
    lines: list[str] = []
    shown = result.search.closest
    if shown is not None:
        m = shown.outcome.metrics
        rate = fmt_rate(shown.rate)
        if result.fixed_rate is not None:
            label = "the probe (meets the SLO)" if shown.passed else "the probe (does not meet the SLO)"
        else:
            label = "operating point" if shown.passed else "closest probe (does not meet the SLO)"
        lines.append(f"{label}: rate {rate} req/s, {m.completed} completed, {m.failed} failed")
        lines.append(f"{'metric (ms)':<12}" + "".join(f"{s:>10}" for s in SHOWN_STATISTICS))
        for name in SHOWN_METRICS:
            dist = m.dist(name)
            cells = "".join(f"{dist.get(s) * 1e3:>10.2f}" for s in SHOWN_STATISTICS)
            lines.append(f"{name.upper():<12}{cells}")
        uncertain = unvouched(shown.outcome)
        if uncertain:
            lines.append(uncertain)
        lines.append(
            f"throughput: {m.request_throughput:.3f} req/s, output {m.output_throughput:.1f} tok/s, "
            f"total {m.total_token_throughput:.1f} tok/s; goodput {m.goodput:.3f} req/s; "
            f"failed {m.failed} of {m.completed + m.failed}"
        )
        server = shown.outcome.server
        if server is not None:
            facts = {k: v for k, v in server.as_dict().items() if v is not None}
            if facts:
                lines.append("server /metrics: " + ", ".join(f"{k} {v:g}" for k, v in facts.items()))
        traffic = _traffic_line(shown.outcome)
        if traffic:
            lines.append(traffic)
        lines.append("")
    lines.append("probes:")
    for i, p in enumerate(result.probes, 1):
        rate = fmt_rate(p.rate)
        m = p.outcome.metrics
        lines.append(
            f"  {i}. rate {rate:>6} req/s  {'pass' if p.passed else 'FAIL'}  {p.requests} requests, "
            f"{m.failed} failed, {p.duration_s:.1f} s, {m.output_throughput:.1f} tok/s - {p.why}"
        )
    if not result.probes:
        lines.append("  (none finished)")
    lines.append("")
    lines.append(_conclusion(result))
    prompts = _prompt_line(result)
    if prompts:
        lines.append(prompts)
    return "\n".join(lines)


def unvouched(outcome: ProbeOutcome) -> str:
    """The shown statistics the client's own error bound cannot vouch for within
    :data:`~autotune.load.selfcheck.MAX_SHIFT` (the SLO terms' void a probe; these are only shown)."""
    keys = [MetricKey(m, s) for m in SHOWN_METRICS for s in SHOWN_STATISTICS]
    over = [(k, v) for k, v in lateness_shifts(outcome.records, keys) if v > MAX_SHIFT]
    if not over:
        return ""
    shown = ", ".join(f"{k} ±{v:,.0%}" for k, v in over)
    return (
        f"not vouched for (the client read some chunks together; the truth may differ by more than "
        f"{MAX_SHIFT:.0%}, no SLO term reads them): {shown}"
    )


def _traffic_line(outcome: ProbeOutcome) -> str:
    """The traffic's own facts, where it has them: TTFT of first against later turns, the prefix cache's
    hit rate against the ideal, a trace's replay speed."""
    parts = []
    turns = turn_summary(outcome.ttft_by_turn)
    if turns:
        parts.append(turns)
    if outcome.ideal_hit_rate is not None:
        hit = outcome.server.prefix_cache_hit_rate if outcome.server is not None else None
        served = f"{hit:.1%}" if hit is not None else "not reported"
        parts.append(f"prefix cache served {served} of prompt tokens (ideal {outcome.ideal_hit_rate:.1%})")
    if outcome.trace_speed is not None:
        parts.append(f"trace replayed at {outcome.trace_speed:.2f}x its recorded speed")
    return "traffic: " + "; ".join(parts) if parts else ""


def _conclusion(result: BenchResult) -> str:
    """The last line: the SLO-constrained throughput of a rate search; for one probe at a fixed rate its
    output throughput and verdict (one probe is not a search, so it is not called SLO-constrained)."""
    if result.fixed_rate is None:
        if result.slo_throughput is not None:
            return f"SLO-constrained throughput: {result.slo_throughput:.1f} tok/s ({result.reason})"
        return f"SLO-constrained throughput: none ({result.reason})"
    rate = fmt_rate(result.fixed_rate)
    if not result.probes:
        return f"output throughput at {rate} req/s: none (no probe finished)"
    probe = result.probes[0]
    verdict = "meets the SLO" if probe.passed else f"does not meet the SLO: {probe.why}"
    return (
        f"output throughput at {rate} req/s: {probe.outcome.metrics.output_throughput:.1f} tok/s, {verdict} "
        "(one probe at a fixed rate, not a rate search: drop --rate for the SLO-constrained throughput)"
    )


def _prompt_line(result: BenchResult) -> str | None:
    """How the prompts were sized, and the prompt tokens the server counted against those intended."""
    ratios = [p.outcome.prompt_tokens_per_intended for p in result.probes]
    counted = [r for r in ratios if r is not None]
    achieved = (
        f"; the server counted {min(counted):.3f}-{max(counted):.3f} of the intended prompt tokens"
        if counted
        else ""
    )
    cal = result.calibration
    if cal is None:
        return f"prompts: as given{achieved}" if achieved else None
    if cal.get("source") is None:
        return f"prompts: NOT calibrated ({cal.get('error')}){achieved}"
    return (
        f"prompts: calibrated by {cal['source']} ({cal['words']} words, {cal['added_tokens']} tokens added "
        f"per prompt){achieved}"
    )
