"""The streaming client against a real local aiohttp SSE server (real HTTP, vLLM chunk format)."""

from __future__ import annotations

import asyncio
import json
import math
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from autotune.errors import InvalidMeasurementError, LoadError
from autotune.load.client import run_requests, run_requests_async
from autotune.load.engines import Engine
from autotune.load.probe import Prober
from autotune.load.records import RunResult
from autotune.load.selfcheck import check_run
from autotune.load.workload import RequestSpec
from autotune.spec import MeasurementSpec, SloSection, WorkloadSpec

METRICS = """# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0"} 0.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0"} 0.125
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0"} 0.0
"""


def _chunk(text: str, *, chat: bool, finish: str | None = None) -> bytes:
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
    if chat:
        choice["delta"] = {"content": text}
    else:
        choice["text"] = text
    body = {"id": "cmpl-1", "object": "x", "created": 1, "model": "m", "choices": [choice], "usage": None}
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


class SseServer:
    """A vLLM-like SSE server in a thread. The model name picks a behaviour:

    ``pace-<ms>``: one chunk per token every <ms>; ``http500``; ``error-event``: an error event mid-stream;
    ``lying-usage``: usage reports one token whatever was sent; ``slow-first``: first chunk after 300 ms;
    ``drop-reused``: a request on a reused connection is dropped unanswered (the keep-alive idle race);
    ``bursty``: like vLLM's API server when it lags: three tokens merged into one chunk, two such chunks
    written in one write, writes every 50 ms (usage counts every token).
    """

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.bodies: list[dict[str, Any]] = []
        self.seen: set[Any] = set()
        self.url = ""
        self._runner: web.AppRunner | None = None
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    async def _stream(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        model = body["model"]
        chat = request.path.endswith("/chat/completions")
        if model == "http500":
            return web.Response(status=500, text="engine dead")
        if model == "drop-reused":  # a kept-alive connection closed as the next request arrives
            transport = request.transport
            assert transport is not None
            if transport in self.seen:
                transport.abort()
                raise asyncio.CancelledError
            self.seen.add(transport)  # keeps the transport alive, so no id or hash is reused
        n = int(body["max_tokens"])
        pace = float(model.split("-")[1]) / 1000 if model.startswith("pace-") else 0.002
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if model == "slow-first":
            await asyncio.sleep(0.3)
        if chat:
            await resp.write(b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n')
        if model == "bursty":
            chunks = [" ".join(f"w{j}" for j in range(i, min(n, i + 3))) for i in range(0, n, 3)]
            for k in range(0, len(chunks), 2):
                await asyncio.sleep(0.05)
                last = len(chunks) - 1
                pair = [_chunk(c, chat=chat, finish="length" if k + j == last else None)
                        for j, c in enumerate(chunks[k : k + 2])]  # fmt: skip
                await resp.write(b"".join(pair))
            n = 0
        for i in range(n):
            if i:
                await asyncio.sleep(pace)
            if model == "error-event" and i == 2:
                await resp.write(b'data: {"error":{"message":"boom","code":500}}\n\n')
                break
            await resp.write(_chunk(f" w{i}", chat=chat, finish="length" if i == n - 1 else None))
        tokens = 1 if model == "lying-usage" else int(body["max_tokens"])
        usage = {"prompt_tokens": 7, "completion_tokens": tokens, "total_tokens": 7 + tokens}
        final = {"id": "cmpl-1", "choices": [], "usage": usage}
        await resp.write(b"data: " + json.dumps(final, separators=(",", ":")).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=METRICS)

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", self._stream)
        app.router.add_post("/v1/chat/completions", self._stream)
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"

    def __enter__(self) -> SseServer:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(5)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._runner is not None
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        self.loop.close()


@pytest.fixture(scope="module")
def server() -> Iterator[SseServer]:
    with SseServer() as srv:
        yield srv


@pytest.fixture(params=["aiohttp", "raw"])
def engine(request: pytest.FixtureRequest) -> Engine:
    """Every client behaviour is checked with both engines."""
    value: Engine = request.param
    return value


def reqs(n: int, out: int = 5) -> list[RequestSpec]:
    return [RequestSpec(prompt="a b c", input_len=3, output_len=out) for _ in range(n)]


def test_streams_are_timed_and_counted(server: SseServer, engine: Engine) -> None:
    """Each chunk is timestamped; TTFT/E2EL/ITL follow the server's pacing; usage gives token counts."""
    result = run_requests(
        server.url, "pace-20", "completions", reqs(4, out=6), [0.0, 0.0, 0.05, 0.1], engine=engine
    )
    assert result.valid, result.problems
    assert len(result.records) == 4
    for r in result.records:
        assert r.success, r.error
        assert r.chunks == 6
        assert r.output_tokens == 6
        assert r.prompt_tokens == 7
        assert r.status == 200
        assert r.ttft is not None and 0 <= r.ttft < 0.1
        assert all(0.01 < g < 0.1 for g in r.itls)
        assert r.e2el is not None and r.e2el >= 5 * 0.015
    sends = [r.send_time - result.start for r in result.records]
    assert sends[2] == pytest.approx(0.05, abs=0.02)
    assert sends[3] == pytest.approx(0.1, abs=0.02)
    assert result.duration > 0.1
    assert not result.stopped_early


def test_request_bodies_are_vllm_streaming_requests(server: SseServer, engine: Engine) -> None:
    """Bodies carry max_tokens=output_len, ignore_eos, temperature, stream + include_usage, no seed."""
    server.bodies.clear()
    run_requests(
        server.url,
        "pace-1",
        "completions",
        reqs(1, out=3),
        [0.0],
        ignore_eos=True,
        temperature=0.5,
        engine=engine,
    )
    run_requests(server.url + "/v1", "pace-1", "chat", reqs(1, out=4), [0.0], ignore_eos=False, engine=engine)
    comp, chat = server.bodies
    assert comp["prompt"] == "a b c"
    assert comp["max_tokens"] == 3
    assert comp["ignore_eos"] is True
    assert comp["temperature"] == 0.5
    assert comp["stream"] is True
    assert comp["stream_options"] == {"include_usage": True}
    assert "seed" not in comp
    assert chat["messages"] == [{"role": "user", "content": "a b c"}]
    assert chat["max_completion_tokens"] == 4


def test_chat_counts_role_chunk_like_vllm_bench(server: SseServer, engine: Engine) -> None:
    """Chat's role chunk counts as a content chunk (vLLM bench: any event with choices) and passes checks."""
    result = run_requests(server.url, "pace-1", "chat", reqs(3, out=4), [0.0] * 3, engine=engine)
    assert result.valid, result.problems
    assert all(r.chunks == 5 and r.output_tokens == 4 for r in result.records)


def test_failures_are_recorded_not_raised(server: SseServer, engine: Engine) -> None:
    """HTTP errors, error events and connection failures become failed records with their cause."""
    r500 = run_requests(server.url, "http500", "completions", reqs(1), [0.0], engine=engine).records[0]
    assert (r500.success, r500.status) == (False, 500)
    assert "engine dead" in r500.error
    rerr = run_requests(server.url, "error-event", "completions", reqs(1), [0.0], engine=engine).records[0]
    assert not rerr.success
    assert "boom" in rerr.error
    down = run_requests("http://127.0.0.1:9", "m", "completions", reqs(1), [0.0], engine=engine).records[0]
    assert not down.success
    assert down.status is None


def test_request_timeout(server: SseServer, engine: Engine) -> None:
    """A request slower than request_timeout fails with a timeout error."""
    rec = run_requests(
        server.url, "slow-first", "completions", reqs(1), [0.0], request_timeout=0.1, engine=engine
    ).records[0]
    assert not rec.success
    assert "timed out" in rec.error


def test_max_concurrency_limits_streams_in_flight(server: SseServer, engine: Engine) -> None:
    """With max_concurrency=2 no more than two requests are in flight at once."""
    result = run_requests(
        server.url, "pace-10", "completions", reqs(6, out=4), [0.0] * 6, max_concurrency=2, engine=engine
    )
    events = sorted([(r.send_time, 1) for r in result.records] + [(r.end_time, -1) for r in result.records])
    level = peak = 0
    for _, step in events:
        level += step
        peak = max(peak, level)
    assert peak <= 2
    assert all(r.success for r in result.records)


def test_stop_check_cancels_the_run(server: SseServer, engine: Engine) -> None:
    """A stop check's reason ends the run early: nothing more is sent and the reason is kept."""
    calls: list[int] = []

    def stop(progress: Any) -> str | None:
        calls.append(progress.sent)
        return "clearly failed" if progress.finished else None

    arrivals = [0.05 * i for i in range(100)]
    result = run_requests(
        server.url, "pace-1", "completions", reqs(100, out=2), arrivals, stop=stop, engine=engine
    )
    assert result.stopped_early
    assert result.stop_reason == "clearly failed"
    assert len(result.records) < 100
    assert result.duration < 2.0


def test_self_check_flags_more_chunks_than_tokens(server: SseServer, engine: Engine) -> None:
    """More content chunks than usage.completion_tokens (+ slack) means the stream was mis-parsed: invalid."""
    result = run_requests(server.url, "lying-usage", "completions", reqs(3), [0.0] * 3, engine=engine)
    assert not result.valid
    assert "more content chunks than usage.completion_tokens" in result.problems[0]
    with pytest.raises(InvalidMeasurementError):
        result.raise_if_invalid()


def test_bursty_server_read_by_a_punctual_client_is_valid(server: SseServer, engine: Engine) -> None:
    """A server that merges tokens into chunks and writes several events at once (vLLM's API server when
    it lags) is measured, not rejected: fewer chunks than tokens and zero gaps are recorded as facts
    (chunks_per_token, server_bursts) while the client's own loop lag stays low."""
    result = run_requests(
        server.url, "bursty", "completions", reqs(8, out=90), [0.01 * i for i in range(8)], engine=engine
    )
    assert result.valid, result.problems
    assert all(r.success and r.output_tokens == 90 and r.chunks == 30 for r in result.records)
    assert result.chunks_per_token == pytest.approx(1 / 3)
    assert result.server_bursts >= 0.4  # one gap in two is inside a write
    itls = sorted(g for r in result.records for g in r.itls)
    assert itls[len(itls) // 2] == 0.0  # ITL p50 collapses, as vllm bench would measure it too
    assert result.loop_lag_p99_s < 0.01


def test_blocked_client_loop_is_flagged(server: SseServer, engine: Engine) -> None:
    """A client whose event loop is blocked (time.sleep in a callback on the loop) is flagged as having
    fallen behind, by its loop lag, although its chunk counts and CPU look fine."""
    import time

    def stop(progress: Any) -> str | None:
        time.sleep(0.03)  # the stop check runs on the client's event loop every ~0.1 s
        return None

    result = run_requests(
        server.url, "pace-20", "completions", reqs(4, out=140), [0.0] * 4, stop=stop, engine=engine
    )
    assert all(r.success for r in result.records)
    assert result.lag_samples >= 200
    assert result.loop_lag_max_s >= 0.025
    assert not result.valid
    assert any("event-loop lag" in p and "fell behind" in p for p in result.problems), result.problems


def test_self_check_judges_the_client_not_the_servers_bursts() -> None:
    """High client CPU and a late event loop are flagged; an ITL p50 far below TPOT (chunks read in
    bursts) with a punctual loop is a fact of the server (server_bursts), not a problem."""
    from autotune.load.records import RequestRecord

    # 20 requests of 11 tokens over 1 s each, read in two bursts: gaps are ~0 except one.
    records = tuple(
        RequestRecord(
            index=i,
            send_time=0.0,
            chunk_times=tuple([0.1] * 5 + [1.1] * 6),
            output_tokens=11,
            prompt_tokens=1,
            input_len=1,
            output_len=11,
            success=True,
            end_time=1.1,
        )
        for i in range(20)
    )
    punctual = RunResult(
        records=records, start=0.0, end=2.0, planned=20, cpu_s=0.1, loop_lag_p99_s=0.001, lag_samples=200
    )
    assert check_run(punctual) == ()
    assert punctual.server_bursts == pytest.approx(0.9)
    assert punctual.chunks_per_token == 1.0
    busy = RunResult(records=records, start=0.0, end=2.0, planned=20, cpu_s=1.9)
    assert [p for p in check_run(busy) if "client CPU" in p]
    late = RunResult(records=records, start=0.0, end=2.0, planned=20, loop_lag_p99_s=0.05, lag_samples=200)
    assert [p for p in check_run(late) if "event-loop lag p99 50.0 ms" in p]
    short = RunResult(records=records, start=0.0, end=2.0, planned=20, loop_lag_p99_s=0.05, lag_samples=10)
    assert check_run(short) == ()  # too few samples to judge


def test_sync_wrapper_refuses_a_running_loop(server: SseServer) -> None:
    """run_requests inside a running event loop raises LoadError; run_requests_async works there."""

    async def inner() -> RunResult:
        with pytest.raises(LoadError, match="running event loop"):
            run_requests(server.url, "pace-1", "completions", reqs(1), [0.0])
        return await run_requests_async(server.url, "pace-1", "completions", reqs(1), [0.0])

    assert asyncio.run(inner()).records[0].success


def test_make_probe_runs_a_probe_with_server_metrics(server: SseServer, tmp_path: Path) -> None:
    """make_probe builds prompts, sends at the rate, scrapes /metrics and summarises the probe."""
    wl = WorkloadSpec.model_validate({"dataset": {"input_len": 4, "output_len": 3}})
    slo = SloSection(terms=("ttft:p50<=1s",))
    meas = MeasurementSpec(min_requests=10, saturation_requests=10, probe_duration=0.2)
    probe = Prober(
        server.url, "pace-1", wl, slo, meas, base_dir=tmp_path, metrics_url=server.url, sample_interval=0.05
    )
    out = probe(math.inf)
    assert out.requests == 10
    assert out.metrics.completed == 10
    assert out.capacity > 0
    assert out.server is not None
    assert out.server.kv_usage_peak == 0.125
    assert out.server.preemptions == 0.0
    slow = probe(50.0)  # 10 requests at 50 req/s: an arrival window of ~0.2 s
    assert slow.metrics.completed == 10
    assert 0.05 < slow.arrival_window_s < 1.0


def test_make_probe_saves_probes_and_checks_liveness(server: SseServer, tmp_path: Path) -> None:
    """save_dir gets one JSON per probe; a liveness diagnosis raises ServerFailedError."""
    from autotune.outcome import ServerFailedError

    wl = WorkloadSpec.model_validate({"dataset": {"input_len": 4, "output_len": 3}})
    slo = SloSection(terms=("ttft:p50<=1s",))
    meas = MeasurementSpec(min_requests=10, saturation_requests=10)
    from autotune.outcome import Cause, Diagnosis

    verdicts: list[Diagnosis | None] = [None, None, None]  # alive() runs before, during and after a probe
    dead = Diagnosis(cause=Cause.CRASHED_UNDER_LOAD, summary="engine died")

    probe = Prober(
        server.url,
        "pace-1",
        wl,
        slo,
        meas,
        base_dir=tmp_path,
        save_dir=tmp_path / "probes",
        alive=lambda: verdicts.pop(0) if verdicts else dead,
        engine="raw",
    )
    probe(math.inf)
    saved = json.loads((tmp_path / "probes" / "probe-1.json").read_text())
    assert saved["completed"] == 10
    assert len(saved["requests"]) == 10
    assert "mean_ttft_ms" in saved
    with pytest.raises(ServerFailedError):
        probe(math.inf)


def test_workers_split_the_schedule_and_merge_records(server: SseServer) -> None:
    """workers=2 runs two processes on one clock; records come back merged, complete and in order."""
    arrivals = [0.01 * i for i in range(20)]
    result = run_requests(server.url, "pace-5", "completions", reqs(20, out=4), arrivals, workers=2)
    assert [r.index for r in result.records] == list(range(20))
    assert all(r.success and r.chunks == 4 for r in result.records)
    assert result.cpu_cores == 2.0
    assert result.lag_samples > 0 and result.valid, result.problems
    offsets = [r.send_time - result.start for r in result.records]
    assert offsets == pytest.approx(arrivals, abs=0.03)


def test_workers_need_a_splittable_stop_check(server: SseServer) -> None:
    """With workers > 1 an arbitrary stop callable is refused (only EarlyStop can be split)."""
    with pytest.raises(LoadError, match="EarlyStop"):
        run_requests(server.url, "pace-1", "completions", reqs(2), [0.0, 0.0], workers=2, stop=lambda p: None)


def test_stop_check_sees_first_chunks_of_in_flight_requests(server: SseServer, engine: Engine) -> None:
    """Progress.in_flight reports the first-chunk time of streams still running (for TTFT early stop)."""
    seen: list[float | None] = []

    def stop(progress: Any) -> str | None:
        seen.extend(f.first_chunk_time for f in progress.in_flight)
        return None

    run_requests(server.url, "pace-50", "completions", reqs(2, out=8), [0.0, 0.0], stop=stop, engine=engine)
    assert any(t is not None for t in seen)


def test_server_closing_kept_alive_connections_fails_no_request(server: SseServer, engine: Engine) -> None:
    """A server that drops idle keep-alive connections (idle-timeout race) costs no failed requests."""
    arrivals = [0.006 * i for i in range(30)]
    result = run_requests(
        server.url, "drop-keepalive", "completions", reqs(30, out=2), arrivals, engine=engine
    )
    assert [r.error for r in result.records if not r.success] == []


def test_workers_stop_together_on_early_stop(server: SseServer) -> None:
    """With workers=2 an EarlyStop fires per share and stops every worker."""
    from autotune.load.slo import EarlyStop

    stop = EarlyStop(SloSection(terms=("ttft:p90<=100ms",)), planned=40)
    arrivals = [0.05 * i for i in range(40)]
    result = run_requests(
        server.url, "slow-first", "completions", reqs(40, out=2), arrivals, workers=2, stop=stop, engine="raw"
    )
    assert result.stopped_early
    assert result.stop_reason is not None
    assert "ttft:p90" in result.stop_reason
    assert len(result.records) < 40
