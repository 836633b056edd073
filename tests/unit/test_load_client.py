"""The streaming client against a real local aiohttp SSE server (real HTTP, vLLM chunk format)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import multiprocessing
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest

from autotune.errors import InvalidMeasurementError, LoadError
from autotune.inputs.slo_terms import MetricKey
from autotune.inputs.spec import MeasurementSpec, SloSection, WorkloadSpec
from autotune.load.client import load_job, run_requests, run_requests_async
from autotune.load.engines import Engine
from autotune.load.metrics import percentile
from autotune.load.probe import Prober
from autotune.load.records import ClientFigures, Finished, Preparation, Progress, RequestRecord, RunResult
from autotune.load.request import RequestSpec
from autotune.load.selfcheck import (
    LAG_INTERVAL_S,
    MAX_SHIFT,
    STOPPED_BY_OTHER,
    check_run,
    count_problems,
    lateness_shifts,
    send_delays,
    with_problems,
)
from autotune.load.workers import Job, _SharedStop, merge

from .sse_server import PREFILL_S, SseServer

# A live run on a loaded machine reads chunks late and sends late: its self-check may (rightly) void it, and
# its timings are the machine's. So a live test asserts what holds however loaded the machine is (counts,
# ids, and what the server's own stamps and pacing bound), and the verdicts are tested on recorded times.

#: uvloop's timers count whole milliseconds: a request may go out up to this much before its arrival time.
TIMER_S = 0.002
#: The raw engine puts the kernel's receive times (CLOCK_REALTIME) on the client's clock by an offset taken
#: once: a chunk's time may be off the server's clock by this much.
CLOCK_S = 0.0005


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
    """Each chunk is timestamped, on the server's pacing; usage gives token counts; each request goes at its
    arrival time. Only what holds however late a loaded machine reads and sends is asserted (the verdict on
    a late read: test_a_paced_stream_read_late_is_judged_by_what_its_lateness_can_move): no chunk is timed
    before the server could write it (it sleeps 20 ms after its stamp of the chunk before), with the raw
    engine none later than its allowance says (the server stamps after its write: never before the chunk
    arrived), and no request goes before its time."""
    server.seen()  # clears what the server saw
    arrivals = [0.0, 0.0, 0.05, 0.1]
    result = run_requests(
        load_job(
            server.url,
            "pace-20",
            "completions",
            reqs(4, out=6),
            arrivals,
            engine=engine,
            prepare=Preparation(connections=4),
            id_prefix="timed-",
        )
    )
    writes = server.seen()["writes"]
    assert [r.request_id for r in result.records] == [f"timed-{i}" for i in range(4)]
    assert not result.stopped_early
    for r, arrival in zip(result.records, arrivals, strict=True):
        assert r.success, r.error
        assert (r.chunks, r.output_tokens, r.prompt_tokens, r.status) == (6, 6, 7, 200)
        assert r.send_time - result.start >= arrival - TIMER_S
        written, t = writes[r.request_id], r.chunk_times
        assert len(written) == 6
        assert all(t[k] >= written[k - 1] + 0.02 - CLOCK_S for k in range(1, 6)), (t, written)
        assert len(r.itls) == 5 and r.ttft is not None and r.e2el is not None
        if engine == "raw":  # its send stamp is taken before the write: after it, the prefill and the pace
            assert r.ttft >= PREFILL_S - CLOCK_S and r.e2el >= PREFILL_S + 5 * 0.02 - CLOCK_S
            late = r.chunk_late or (0.0,) * 6
            assert all(t[k] - late[k] <= written[k] + CLOCK_S for k in range(6)), (t, late, written)
    # the last request went at 0.1 s at the earliest, then its prefill and five paces
    assert result.duration >= 0.1 + PREFILL_S + 5 * 0.02 - TIMER_S


def _stream(
    index: int, send: float, times: list[float], late: dict[int, float] | None = None
) -> RequestRecord:
    """A completions stream of one chunk per token at ``times``, each chunk in ``late`` read that much later
    and charged it (its allowance), as the self-check records them."""
    late = late or {}
    at = tuple(x + late.get(k, 0.0) for k, x in enumerate(times))
    charged = tuple(late.get(k, 0.0) for k in range(len(times))) if late else ()
    return RequestRecord(
        index,
        send,
        at,
        len(at),
        7,
        3,
        len(at),
        True,
        end_time=at[-1],
        request_id=f"r{index}",
        chunk_late=charged,
    )


def test_a_paced_stream_read_late_is_judged_by_what_its_lateness_can_move() -> None:
    """The verdicts on test_streams_are_timed_and_counted's run, on recorded times (four streams of six
    chunks 20 ms apart after a 30 ms prefill). Read and sent on time: TTFT, ITL and E2EL are the server's,
    and the run is valid. Two of its 24 chunks read 1.26 ms late (as aiohttp read them on a busy CI
    machine): ITL p99 may be 6.3 % off, over the 5 % limit: invalid. Two chunks read together 20 ms late
    (a gap of 0; the raw engine charges the older one since the connection's last read): invalid. Every
    request sent 20 ms late (the two of one instant go together: 15 ms on average, over a quarter of the
    33 ms mean gap): invalid."""
    arrivals = [0.0, 0.0, 0.05, 0.1]
    start = 100.0
    planned = {i: start + a for i, a in enumerate(arrivals)}

    def paced(index: int, late: dict[int, float] | None = None, sent_late: float = 0.0) -> RequestRecord:
        send = planned[index] + sent_late
        return _stream(index, send, [send + PREFILL_S + 0.02 * k for k in range(6)], late)

    def judged(records: tuple[RequestRecord, ...], late_chunks: int = 0) -> RunResult:
        delay, gap, stretch = send_delays(records, planned)
        figures = ClientFigures(
            chunks=24, late_chunks=late_chunks, send_delay_mean_s=delay, send_gap_s=gap, send_stretch=stretch
        )
        return with_problems(RunResult(records, start, max(r.end_time for r in records), 4, client=figures))

    on_time = judged(tuple(paced(i) for i in range(4)))
    r = on_time.records[0]
    assert r.ttft == pytest.approx(PREFILL_S) and r.e2el == pytest.approx(PREFILL_S + 0.1)
    assert r.itls == pytest.approx([0.02] * 5)
    assert on_time.valid, on_time.problems
    assert dict(on_time.client.shifts) == {"ttft:p95": 0.0, "itl:p99": 0.0, "tpot:p99": 0.0}
    assert on_time.client.send_delay_mean_s == 0.0 and on_time.client.send_gap_s == pytest.approx(0.1 / 3)

    ci = judged((paced(0, {2: 0.00126}), paced(1), paced(2, {4: 0.00126}), paced(3)), late_chunks=2)
    assert dict(ci.client.shifts)["itl:p99"] == pytest.approx(0.063)
    assert [p for p in ci.problems if p.startswith("2 of 24 chunks were read more than 1 ms late")]
    assert [p for p in ci.problems if "itl:p99 by 6.3% (limit 5%)" in p], ci.problems

    send = planned[0]
    together = [send + PREFILL_S + 0.02 * k for k in range(6)]
    together[3] = together[4]  # chunk 3 came 20 ms before chunk 4 and was read with it
    pair = _stream(0, send, together)
    pair = dataclasses.replace(pair, chunk_late=(0.0, 0.0, 0.0, 0.04, 0.0, 0.0))  # since the read of chunk 2
    coalesced = judged((pair, *(paced(i) for i in range(1, 4))), late_chunks=1)
    assert 0.0 in pair.itls
    assert [p for p in coalesced.problems if "itl:p99 by" in p], coalesced.problems

    behind = judged(tuple(paced(i, sent_late=0.02) for i in range(4)))
    assert [p for p in behind.problems if p.startswith("client sent late")], behind.problems


def test_only_the_statistics_a_study_judges_void_a_run() -> None:
    """Chunks 1-2, 3-4 and 5-6 of each stream read together, the older of each pair allowed 15 ms: ITL p99
    may be far off, TTFT and TPOT (the first and last chunks are exact) are not. A study whose SLO terms are
    ``ttft:p95`` and ``tpot:p95`` gets a valid run that records every bound and warns of ITL's; one that
    judges ``itl:p99`` (an SLO term or an objective) gets the run voided over it."""
    arrivals = [0.0, 0.05, 0.1, 0.15]
    records = []
    for i, send in enumerate(arrivals):
        times = [send + PREFILL_S + 0.02 * k for k in range(8)]
        late = {}
        for k in (2, 4, 6):  # chunk k-1 read with chunk k: timed at k, allowance since the last read
            times[k - 1] = times[k]
            late[k - 1] = 0.015
        charged = tuple(late.get(k, 0.0) for k in range(8))
        records.append(dataclasses.replace(_stream(i, send, times), chunk_late=charged))
    run = RunResult(tuple(records), 0.0, 1.0, 4, client=ClientFigures(chunks=32, late_chunks=16))
    study = (MetricKey("ttft", "p95"), MetricKey("tpot", "p95"))
    trusted = with_problems(run, study)
    shifts = dict(trusted.client.shifts)
    assert trusted.valid, trusted.problems
    assert set(shifts) == {"ttft:p95", "tpot:p95", "itl:p99", "tpot:p99"}
    assert shifts["itl:p99"] > MAX_SHIFT and shifts["ttft:p95"] <= MAX_SHIFT >= shifts["tpot:p95"]
    assert trusted.client.judged == ("ttft:p95", "tpot:p95")
    assert trusted.client.as_dict()["judged"] == ["ttft:p95", "tpot:p95"]
    (warning,) = trusted.warnings
    assert "itl:p99 by" in warning and "no SLO term or objective judges it" in warning, warning
    voided = with_problems(run, (*study, MetricKey("itl", "p99")))
    assert [p for p in voided.problems if "itl:p99 by" in p and "fell behind" in p], voided.problems
    assert voided.warnings == ()
    # The bare client (no study) judges every statistic it reports, as before.
    assert not with_problems(run).valid


def test_every_statistic_of_the_slo_grammar_is_bounded() -> None:
    """Mean, max and E2EL are bounded as the percentiles are: a last chunk that may have come 10 ms early
    moves E2EL's low end by 10 ms (and the request's write time too), never its high end."""
    send = 0.0
    records = tuple(
        dataclasses.replace(_stream(i, send, [0.1, 0.2, 0.3]), chunk_late=(0.0, 0.0, 0.01), send_wait=0.002)
        for i in range(4)
    )
    keys = [MetricKey("e2el", "mean"), MetricKey("e2el", "max"), MetricKey("ttft", "p50")]
    shifts = dict(lateness_shifts(records, keys))
    assert shifts["e2el:mean"] == pytest.approx(0.012 / 0.288)
    assert shifts["e2el:max"] == pytest.approx(0.012 / 0.288)
    assert shifts["ttft:p50"] == pytest.approx(0.002 / 0.098)


def test_request_bodies_are_vllm_streaming_requests(server: SseServer, engine: Engine) -> None:
    """Bodies carry max_tokens=output_len, ignore_eos, temperature, stream + include_usage, no seed."""
    server.seen()  # clears what the server saw
    run_requests(
        load_job(
            server.url,
            "pace-1",
            "completions",
            reqs(1, out=3),
            [0.0],
            ignore_eos=True,
            temperature=0.5,
            engine=engine,
        )
    )
    run_requests(
        load_job(server.url + "/v1", "pace-1", "chat", reqs(1, out=4), [0.0], ignore_eos=False, engine=engine)
    )
    comp, chat = server.seen()["bodies"]
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
    """Chat's role chunk counts as a content chunk (vLLM bench: any event with choices) and passes the
    self-check's parse check (five chunks for four tokens is within its slack, not a mis-parsed stream).
    How punctually the client read is no part of it: a loaded machine may void the run for that."""
    result = run_requests(load_job(server.url, "pace-20", "chat", reqs(3, out=4), [0.0] * 3, engine=engine))
    assert all(r.success and r.chunks == 5 and r.output_tokens == 4 for r in result.records)
    assert count_problems(result) == ()
    assert not [p for p in result.problems if "more content chunks than usage" in p], result.problems


def test_failures_are_recorded_not_raised(server: SseServer, engine: Engine) -> None:
    """HTTP errors, error events and connection failures become failed records with their cause."""
    r500 = run_requests(
        load_job(server.url, "http500", "completions", reqs(1), [0.0], engine=engine)
    ).records[0]
    assert (r500.success, r500.status) == (False, 500)
    assert "engine dead" in r500.error
    rerr = run_requests(
        load_job(server.url, "error-event", "completions", reqs(1), [0.0], engine=engine)
    ).records[0]
    assert not rerr.success
    assert "boom" in rerr.error
    down = run_requests(
        load_job("http://127.0.0.1:9", "m", "completions", reqs(1), [0.0], engine=engine)
    ).records[0]
    assert not down.success
    assert down.status is None


@pytest.fixture
def close_delimited_503() -> Iterator[str]:
    """A server that answers every request ``503`` with a close-delimited body (``Connection: close``,
    neither Content-Length nor chunking): the close ends the body."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:  # the listener was closed: the test is over
                return
            with conn:
                data = b""
                while b"\r\n\r\n" not in data and (got := conn.recv(65536)):
                    data += got
                head, _, body = data.partition(b"\r\n\r\n")
                lengths = [
                    line for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")
                ]
                size = int(lengths[0].split(b":", 1)[1]) if lengths else 0
                while len(body) < size and (got := conn.recv(65536)):
                    body += got
                conn.sendall(
                    b"HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\n\r\nserver overloaded"
                )

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        listener.close()
        thread.join(timeout=5.0)


def test_an_error_whose_body_ends_at_the_close_is_a_failure(close_delimited_503: str, engine: Engine) -> None:
    """A 503 whose body is delimited by the connection's close fails with its status and body text, not
    a success with no chunks (TTFT and E2EL 0)."""
    rec = run_requests(
        load_job(close_delimited_503, "m", "completions", reqs(1), [0.0], engine=engine)
    ).records[0]
    assert (rec.success, rec.status) == (False, 503)
    assert rec.error.startswith("HTTP 503") and "server overloaded" in rec.error


def test_a_status_other_than_200_is_never_a_success() -> None:
    """Whatever an engine left in the exchange, a response whose status is not 200 and that carries no
    error is recorded failed, as ``HTTP <status>`` (the client's backstop)."""
    from autotune.load.client import _one
    from autotune.load.exchange import Exchange

    class Quiet:
        """A pool whose responses end without an error: status 503, one content chunk."""

        async def preconnect(self, count: int, timeout: float) -> int:
            return 0

        async def post(
            self, path: str, body: bytes, ex: Exchange, timeout: float, headers: Any = None
        ) -> None:
            ex.status = 503
            ex.times.append(time.perf_counter())
            ex.done = True

        async def close(self) -> None:
            return None

    finished: list[RequestRecord] = []
    asyncio.run(_one(Quiet(), "/v1/completions", 0, "r0", b"{}", reqs(1)[0], 1.0, None, {}, finished))
    assert [(r.success, r.status, r.error) for r in finished] == [(False, 503, "HTTP 503")]


def test_request_timeout(server: SseServer, engine: Engine) -> None:
    """A request slower than request_timeout fails with a timeout error."""
    rec = run_requests(
        load_job(server.url, "slow-first", "completions", reqs(1), [0.0], request_timeout=0.1, engine=engine)
    ).records[0]
    assert not rec.success
    assert "timed out" in rec.error


def test_max_concurrency_limits_streams_in_flight(server: SseServer, engine: Engine) -> None:
    """With max_concurrency=2 no more than two requests are in flight at once."""
    result = run_requests(
        load_job(
            server.url, "pace-10", "completions", reqs(6, out=4), [0.0] * 6, max_concurrency=2, engine=engine
        )
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
        load_job(server.url, "pace-1", "completions", reqs(100, out=2), arrivals, engine=engine), stop=stop
    )
    assert result.stopped_early
    assert result.stop_reason == "clearly failed"
    assert len(result.records) <= calls[-1] < 100  # nothing was sent after the check said stop


def test_self_check_flags_more_chunks_than_tokens(server: SseServer, engine: Engine) -> None:
    """More content chunks than usage.completion_tokens (+ slack) means the stream was mis-parsed: invalid."""
    result = run_requests(
        load_job(server.url, "lying-usage", "completions", reqs(3), [0.0] * 3, engine=engine)
    )
    assert not result.valid
    assert any("more content chunks than usage.completion_tokens" in p for p in result.problems)
    with pytest.raises(InvalidMeasurementError):
        result.raise_if_invalid()


def test_bursty_server_writes_are_read_as_written(server: SseServer, engine: Engine) -> None:
    """The bursty model live: like vLLM's API server when it lags, three tokens merged into one chunk and two
    chunks written in one write. Whatever the load, the counts are the server's (one chunk per three tokens)
    and the two chunks of one write come in one read (a small loopback write is never split over reads; a
    late client only merges more writes): at least half the gaps are 0 (server_bursts) and ITL p50
    collapses, as vllm bench would measure it too. The verdict on a punctual read of such a server:
    test_bursty_server_read_by_a_punctual_client_is_valid."""
    result = run_requests(
        load_job(
            server.url, "bursty", "completions", reqs(8, out=90), [0.01 * i for i in range(8)], engine=engine
        )
    )
    assert all(r.success and r.output_tokens == 90 and r.chunks == 30 for r in result.records)
    assert result.chunks_per_token == pytest.approx(1 / 3)
    for r in result.records:
        t = r.chunk_times
        assert all(t[k] == t[k + 1] for k in range(0, 30, 2)), (r.index, t)
    assert result.server_bursts >= 15 / 29  # one gap in two is inside a write
    itls = sorted(g for r in result.records for g in r.itls)
    assert itls[len(itls) // 2] == 0.0
    if engine == "raw":
        # A write read alone came in one TCP segment (the kernel's counters say so): both its chunks reached
        # the socket at its time, so the older one carries no allowance. Only a read that took two writes
        # (a client stalled 50 ms) bounds it; before segments were counted, every older chunk carried one.
        older = [r.chunk_late[k] if r.chunk_late else 0.0 for r in result.records for k in range(0, 30, 2)]
        assert sum(1 for late in older if late == 0.0) >= len(older) / 2, older


def test_bursty_server_read_by_a_punctual_client_is_valid() -> None:
    """A server that merges tokens into chunks and writes several events at once (vLLM's API server when
    it lags) is measured, not rejected: fewer chunks than tokens and zero gaps are recorded as facts
    (chunks_per_token, server_bursts) while the client was punctual. Recorded as the raw engine times a
    punctual read of the bursty model: 8 streams of 90 tokens in 30 chunks, two chunks a write every 50 ms,
    each write read alone (timed by the kernel, exact)."""

    def stream(i: int) -> RequestRecord:
        send = 0.01 * i
        times = tuple(send + PREFILL_S + 0.05 * (1 + k // 2) for k in range(30))
        return RequestRecord(i, send, times, 90, 7, 3, 90, True, end_time=times[-1], chunk_waits=(0.0,) * 30)

    records = tuple(stream(i) for i in range(8))
    client = ClientFigures(chunks=240, kernel_timed=True)
    result = with_problems(RunResult(records, 0.0, records[-1].end_time, 8, client=client))
    assert result.valid, result.problems
    assert result.chunks_per_token == pytest.approx(1 / 3)
    assert result.server_bursts == pytest.approx(15 / 29)
    itls = sorted(g for r in result.records for g in r.itls)
    assert itls[len(itls) // 2] == 0.0  # ITL p50 collapses, as vllm bench would measure it too
    assert percentile(itls, 99) == pytest.approx(0.05)


def test_a_blocked_client_loop_is_never_measured_as_the_server(server: SseServer, engine: Engine) -> None:
    """A client whose event loop is blocked (time.sleep in a callback on the loop, 30 ms every 0.1 s) reads
    chunks late. The aiohttp engine times chunks at their read: the run is invalid. The raw engine times them
    by the kernel: valid or not (a loaded machine may void it), each chunk's allowance covers how late it
    was timed (the server's stamp, taken after its write, is never before the chunk arrived), and each gap
    plus the allowance before it is at least the server's 20 ms pace (it sleeps that long between writes),
    so a valid run's ITL p99 is within 5 % of at least that pace: never wrong but valid. How much more than
    20 ms the server took is its own (a loaded machine's) and not asserted."""
    server.seen()  # clears what the server saw

    def stop(progress: Any) -> str | None:
        time.sleep(0.03)  # the stop check runs on the client's event loop every ~0.1 s
        return None

    result = run_requests(
        load_job(server.url, "pace-20", "completions", reqs(4, out=60), [0.0] * 4, engine=engine), stop=stop
    )
    writes = server.seen()["writes"]
    assert all(r.success and r.chunks == 60 for r in result.records)
    # the lag monitor's wake-up was due at most its interval (10 ms raw, 2 ms aiohttp) into a 30 ms stall
    assert result.client.lag_max_s >= 0.03 - LAG_INTERVAL_S - 1e-6
    if engine == "aiohttp":
        assert not result.valid
        assert any("late" in p and "fell behind" in p for p in result.problems), result.problems
        return
    for r in result.records:
        written, t = writes[r.request_id], r.chunk_times
        late = r.chunk_late or (0.0,) * r.chunks
        assert all(t[k] - late[k] <= written[k] + CLOCK_S for k in range(r.chunks)), r.index
        assert all(t[k] - t[k - 1] + late[k - 1] >= 0.02 - CLOCK_S for k in range(1, r.chunks)), r.index
    if result.valid:
        itl_p99 = percentile([g for r in result.records for g in r.itls], 99)
        assert itl_p99 >= (0.02 - CLOCK_S) / (1 + MAX_SHIFT), (itl_p99, result.client.shifts)


def test_coalesced_reads_carry_an_allowance_that_covers_their_true_lateness(server: SseServer) -> None:
    """Coalesced reads forced for real: the client's loop is busy 8 ms at a time (a callback that sleeps,
    every ~0.1 s) while each stream's chunks leave every 2 ms, so several chunks of a stream come in one
    read, and all but the newest are timed later than they arrived. Each chunk's allowance covers its true
    lateness (its time minus the server's write; 0.5 ms for loopback), and each judged statistic's stated
    bound covers its true error (1 ms for the server's stamps). A loop-lag monitor that wakes every 10 ms
    sees at most the part of an 8 ms stall after its due time: it was no bound here (the allowance it
    gave failed this test in 5 runs of 5)."""
    server.seen()  # clears what the server saw

    def stop(progress: Any) -> str | None:
        time.sleep(0.008)  # the stop check runs on the client's event loop every ~0.1 s
        return None

    result = run_requests(
        load_job(server.url, "pace-2", "completions", reqs(6, out=300), [0.0] * 6, engine="raw"), stop=stop
    )
    writes = server.seen()["writes"]
    assert all(r.success for r in result.records)
    coalesced = 0
    for r in result.records:
        truth = writes[r.request_id]
        assert len(truth) == r.chunks
        allowed = r.chunk_late or (0.0,) * r.chunks
        for k, (at, early) in enumerate(zip(r.chunk_times, allowed, strict=True)):
            late = at - truth[k]
            coalesced += late > 0.002
            assert late <= early + 0.0005, (r.index, k, late, early)
    assert coalesced >= 20, coalesced  # the stalls did make chunks late
    true = [
        dataclasses.replace(r, chunk_times=tuple(writes[r.request_id]), send_time=r.send_time)
        for r in result.records
    ]
    from autotune.load.metrics import summarize

    reported, exact = summarize(result.records, 1.0, None), summarize(true, 1.0, None)
    shifts = dict(result.client.shifts)
    for key, rep, tru in (
        ("ttft:p95", reported.ttft.p95, exact.ttft.p95),
        ("itl:p99", reported.itl.p99, exact.itl.p99),
        ("tpot:p99", reported.tpot.p99, exact.tpot.p99),
    ):
        # 1 ms for the server's own stamp, taken after its write returned (on a busy machine, late)
        assert abs(rep - tru) <= shifts[key] * tru + 0.001, (key, rep, tru, shifts[key])


def test_a_read_times_its_newest_chunk_exactly_and_bounds_the_others() -> None:
    """The exchange gives every chunk of a read the read's allowance, except the newest when nothing else
    came after it in the read: then its bytes were the read's newest, and its kernel time is exact. A
    usage event, a [DONE], a partial line, or a read that was not whole (a full buffer, a frame cut)
    leaves the newest bounded too."""
    from autotune.load.exchange import Exchange

    def event(text: str) -> bytes:
        return b'data: {"choices":[{"index":0,"text":"' + text.encode() + b'"}]}\n\n'

    ex = Exchange(0.0)
    ex.feed(event("a"), 1.0, 0.001, 0.5)  # one chunk alone: exact, timed at its arrival
    ex.feed(event("b") + event("c") + event("d"), 2.0, 0.002, 0.7)  # three in one read
    ex.feed(event("e") + b'data: {"choices":[],"usage":{"completion_tokens":5}}\n\n', 3.0, 0.0, 0.4)
    ex.feed(event("f") + b"data: [DONE]\n\n", 4.0, 0.0, 0.3)
    ex.feed(event("g") + b'data: {"choi', 5.0, 0.0, 0.2)  # a later event had begun to arrive
    ex.feed(b'ces":[{"index":0,"text":"h"}]}\n\n' + event("i"), 6.0, 0.0, 0.1, whole=False)
    assert ex.times == [0.999, 1.998, 1.998, 1.998, 3.0, 4.0, 5.0, 6.0, 6.0]
    assert ex.early == [0.0, 0.7, 0.7, 0.0, 0.4, 0.3, 0.2, 0.1, 0.1]
    assert ex.waits == [0.001, 0.002, 0.002, 0.002, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert ex.usage_tokens == 5
    plain = Exchange(0.0)  # an engine without the kernel's times (aiohttp): times only
    plain.feed(event("a") + event("b"), 1.0)
    assert plain.times == [1.0, 1.0] and plain.waits == [] and plain.early == []


def test_a_last_event_without_its_newline_is_timed_at_its_own_read() -> None:
    """A final event that lacked its trailing newline is decoded when the body ends, at the time of the
    read that brought it: with the kernel's times (raw) and without them (aiohttp), never at the previous
    chunk's time (a false gap of 0)."""
    from autotune.load.exchange import Exchange

    def event(text: str) -> bytes:
        return b'data: {"choices":[{"index":0,"text":"' + text.encode() + b'"}]}\n\n'

    last = b'data: {"choices":[{"index":0,"text":"z"}]}'
    plain = Exchange(0.0)
    plain.feed(event("a"), 1.0)
    plain.feed(last, 2.0)
    plain.flush(3.0)
    assert plain.times == [1.0, 2.0] and plain.waits == [] and plain.early == []
    timed = Exchange(0.0)
    timed.feed(event("a"), 1.0, 0.001, 0.0)
    timed.feed(last, 2.0, 0.002, 0.3)
    timed.flush(3.0)
    assert timed.times == [0.999, 1.998] and timed.waits == [0.001, 0.002] and timed.early == [0.0, 0.3]


def _records(n: int = 20) -> tuple[RequestRecord, ...]:
    """20 requests of 11 tokens over 1 s each, read in two bursts: gaps are ~0 except one."""
    return tuple(
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
        for i in range(n)
    )


def test_self_check_judges_the_client_not_the_servers_bursts() -> None:
    """High client CPU, a starved thread and chunks read late are flagged; an ITL p50 far below TPOT
    (chunks read in bursts) with a punctual client is a fact of the server (server_bursts), not a problem."""
    records = _records()
    punctual = RunResult(records=records, start=0.0, end=2.0, planned=20, client=ClientFigures(cpu_s=0.1))
    assert check_run(punctual) == ()
    assert punctual.server_bursts == pytest.approx(0.9)
    assert punctual.chunks_per_token == 1.0
    busy = RunResult(records=records, start=0.0, end=2.0, planned=20, client=ClientFigures(cpu_s=1.9))
    assert [p for p in check_run(busy) if "client CPU 95% of 1 core" in p]
    shared = ClientFigures(cpu_s=1.5, cores=1.0, workers=2)  # two workers that had one core between them
    shared_run = RunResult(records, 0.0, 2.0, 20, client=shared)
    assert [p for p in check_run(shared_run) if "client CPU 75% of 1 core" in p]
    starved = ClientFigures(runqueue_wait_s=0.3, wakeups=2000)
    assert [p for p in check_run(RunResult(records, 0.0, 2.0, 20, client=starved)) if "starved" in p]
    slow_wakeups = ClientFigures(runqueue_wait_s=0.05, wakeups=50)  # 2.5 % of the run, 1 ms per wake-up
    assert [p for p in check_run(RunResult(records, 0.0, 2.0, 20, client=slow_wakeups)) if "starved" in p]
    # The first chunk of every request read 50 ms late: TTFT p95 would move by more than 5 %.
    late = tuple(dataclasses.replace(r, chunk_late=(0.05,) + (0.0,) * 10) for r in records)
    problems = check_run(RunResult(late, 0.0, 2.0, 20, client=ClientFigures(chunks=220, late_chunks=20)))
    assert [p for p in problems if "ttft:p95 by" in p and "fell behind" in p], problems
    # One chunk of one request read 3 ms late moves nothing by 5 %: still valid.
    one = (dataclasses.replace(records[0], chunk_late=(0.0,) * 10 + (0.003,)), *records[1:])
    assert check_run(RunResult(one, 0.0, 2.0, 20, client=ClientFigures())) == ()


def test_a_busy_client_whose_chunks_are_bounded_is_warned_not_voided() -> None:
    """Client CPU above the limit voids a run whose chunks are timed at their read (aiohttp), but only
    warns where the raw engine bounded every chunk's lateness (its lateness is in the error bound), for one
    process and for each worker of several."""
    from autotune.load.selfcheck import with_problems
    from autotune.load.workers import merge

    records = _records()
    bounded = with_problems(
        RunResult(records, 0.0, 2.0, 20, client=ClientFigures(cpu_s=1.9, kernel_timed=True))
    )
    assert bounded.valid, bounded.problems
    assert [w for w in bounded.warnings if "client CPU 95% of 1 core" in w and "a warning" in w]
    read_timed = with_problems(RunResult(records, 0.0, 2.0, 20, client=ClientFigures(cpu_s=1.9)))
    assert [p for p in read_timed.problems if "client CPU 95%" in p] and read_timed.warnings == ()
    halves = [
        RunResult(records[k::2], 0.0, 2.0, 10, client=ClientFigures(cpu_s=1.6, kernel_timed=True))
        for k in range(2)
    ]
    merged = merge(halves, 0.0, 20)
    assert merged.valid and merged.warnings and all("client CPU 80%" in w for w in merged.warnings)


def test_a_late_loop_is_charged_to_the_chunks_it_delayed() -> None:
    """The witness charges each chunk the lateness of the loop's next wake-up: one 70 ms stall over a
    burst of chunks makes those chunks late, however few lag samples the run has (a short or starved run
    is judged too)."""
    from autotune.load.selfcheck import Witness

    witness = Witness()
    witness.start()
    # The loop woke 1 ms late until 0.5 s, then 70 ms late once (a stall), then on time.
    witness.lags = [(0.01 * k, 0.001) for k in range(1, 50)] + [(0.58, 0.07), (0.59, 0.0), (0.6, 0.0)]
    stalled = RequestRecord(0, 0.0, (0.2, 0.3, 0.55, 0.56, 0.57), 5, 1, 1, 5, True, end_time=0.57)
    calm = tuple(
        RequestRecord(i, 0.0, tuple(0.02 * k for k in range(1, 20)), 19, 1, 1, 19, True, end_time=0.4)
        for i in range(1, 20)
    )
    figures, marked = witness.stop(0.6, (stalled, *calm))
    assert figures.lag_samples == 52
    assert figures.chunks == 5 + 19 * 19
    assert figures.late_chunks == 3  # the three chunks read during the stall
    assert marked[0].chunk_late == (0.0, 0.0, 0.07, 0.07, 0.07)
    assert all(r.chunk_late == () for r in marked[1:])  # 1 ms is within the timer's resolution
    assert figures.gc_collections == 0


def test_sync_wrapper_refuses_a_running_loop(server: SseServer) -> None:
    """run_requests inside a running event loop raises LoadError; run_requests_async works there."""

    async def inner() -> RunResult:
        with pytest.raises(LoadError, match="running event loop"):
            run_requests(load_job(server.url, "pace-1", "completions", reqs(1), [0.0]))
        return await run_requests_async(load_job(server.url, "pace-1", "completions", reqs(1), [0.0]))

    assert asyncio.run(inner()).records[0].success


class _Verdicts:
    """Stands in for the probe module's ``run_requests``: each probe really runs against the SSE server, and
    its run then carries the next of ``verdicts`` as its self-check's problems (none once they run out),
    whatever the client's own check said: on a loaded machine a chunk read 2 ms late voids a run, and the
    prober raises at once on an invalid one. The verdict logic is tested on recorded times above."""

    def __init__(self, *verdicts: tuple[str, ...]) -> None:
        self.verdicts = list(verdicts)
        self.runs: list[RunResult] = []
        """The runs as the prober got them."""
        self.sent: list[tuple[list[RequestSpec], list[float]]] = []
        """The requests and arrival times of each run."""

    def __call__(self, *args: Any, **kwargs: Any) -> RunResult:
        result = run_requests(*args, **kwargs)
        problems = self.verdicts.pop(0) if self.verdicts else ()
        result = dataclasses.replace(result, problems=problems, warnings=())
        self.runs.append(result)
        job = args[0]
        self.sent.append((list(job.requests), list(job.arrivals)))
        return result


@pytest.fixture
def verdicts(monkeypatch: pytest.MonkeyPatch) -> _Verdicts:
    """Probes run for real, judged valid (:class:`_Verdicts`)."""
    stand_in = _Verdicts()
    monkeypatch.setattr("autotune.load.probe.run_requests", stand_in)
    return stand_in


def test_make_probe_runs_a_probe_with_server_metrics(
    server: SseServer, tmp_path: Path, verdicts: _Verdicts
) -> None:
    """make_probe builds prompts, sends at the rate, scrapes /metrics and summarises the probe."""
    wl = WorkloadSpec.model_validate({"dataset": {"input_len": 4, "output_len": 3}})
    slo = SloSection(terms=("ttft:p50<=1s",))
    meas = MeasurementSpec(min_requests=10, saturation_requests=10, probe_duration=0.2)
    probe = Prober(
        server.url, "pace-50", wl, slo, meas, base_dir=tmp_path, metrics_url=server.url, sample_interval=0.05
    )
    out = probe(math.inf)
    requests, arrivals = verdicts.sent[0]
    assert len(requests) == 10 and all(r.output_len == 3 for r in requests)
    assert arrivals == [0.0] * 10  # all at once
    assert out.requests == 10
    assert out.metrics.completed == 10
    assert out.capacity > 0
    assert out.server is not None
    assert out.server.kv_usage_peak == 0.125
    assert out.server.preemptions == 0.0
    slow = probe(50.0)  # 10 requests at 50 req/s: an arrival window of ~0.2 s (then drain requests)
    _, arrivals = verdicts.sent[1]
    assert slow.metrics.completed == 10
    assert slow.arrival_window_s == pytest.approx(arrivals[9] - arrivals[0])
    assert 0.05 < slow.arrival_window_s < 1.0
    assert len(slow.records) == 10 and all(r.success for r in slow.records)


def test_make_probe_saves_probes_and_checks_liveness(
    server: SseServer, tmp_path: Path, verdicts: _Verdicts
) -> None:
    """save_dir gets one JSON per probe; a liveness diagnosis raises ServerFailedError."""
    from autotune.outcome import ServerFailedError

    wl = WorkloadSpec.model_validate({"dataset": {"input_len": 4, "output_len": 3}})
    slo = SloSection(terms=("ttft:p50<=1s",))
    meas = MeasurementSpec(min_requests=10, saturation_requests=10)
    from autotune.outcome import Cause, Diagnosis

    liveness: list[Diagnosis | None] = [None, None, None]  # alive() runs before, during and after a probe
    dead = Diagnosis(cause=Cause.CRASHED_UNDER_LOAD, summary="engine died")

    probe = Prober(
        server.url,
        "pace-50",
        wl,
        slo,
        meas,
        base_dir=tmp_path,
        save_dir=tmp_path / "probes",
        alive=lambda: liveness.pop(0) if liveness else dead,
        engine="raw",
        judged=(MetricKey("itl", "mean"), MetricKey("ttft", "p50")),  # a study's latency objectives
    )
    probe(math.inf)
    saved = json.loads((tmp_path / "probes" / "probe-1.json").read_text())
    # what the probe judged: its SLO term's statistic and the objectives', once each; every bound recorded
    assert saved["client"]["judged"] == ["ttft:p50", "itl:mean"]
    assert set(saved["client"]["shifts"]) == {"ttft:p50", "itl:mean", "ttft:p95", "itl:p99", "tpot:p99"}
    assert saved["completed"] == 10
    assert "mean_ttft_ms" in saved
    # vllm bench serve --save-detailed's per-request arrays, with request ids and absolute start times
    for key in ("ttfts", "itls", "latencies", "start_times", "input_lens", "output_lens", "errors"):
        assert len(saved[key]) == 10, key
    assert all(isinstance(gaps, list) and len(gaps) == 2 for gaps in saved["itls"])
    assert len(set(saved["request_ids"])) == 10 and all("p1-" in i for i in saved["request_ids"])
    assert abs(saved["start_times"][0] - time.time()) < 60  # Unix time, not perf_counter
    # the run's self-check as the run carried it: its verdict and the client's figures
    assert saved["valid"] is True and saved["problems"] == [] and "late_chunks" in saved["client"]
    assert saved["client"] == json.loads(json.dumps(verdicts.runs[0].client.as_dict()))
    with pytest.raises(ServerFailedError):
        probe(math.inf)


def test_make_probe_saves_an_invalid_run_and_repeats_it_under_its_number(
    server: SseServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run the self-check voids is saved as ``probe-<k>.invalid-<attempt>.json`` and raises
    InvalidMeasurementError; it does not count, and its repeat reuses the probe's number and seed."""
    stand_in = _Verdicts(("client read late (the test's verdict)",))
    monkeypatch.setattr("autotune.load.probe.run_requests", stand_in)
    wl = WorkloadSpec.model_validate({"dataset": {"input_len": 4, "output_len": 3}})
    slo = SloSection(terms=("ttft:p50<=1s",))
    meas = MeasurementSpec(min_requests=10, saturation_requests=10, client_workers=1)
    saved = tmp_path / "probes"
    probe = Prober(server.url, "pace-50", wl, slo, meas, base_dir=tmp_path, save_dir=saved, engine="raw")
    with pytest.raises(InvalidMeasurementError, match=r"client read late \(the test's verdict\)"):
        probe(math.inf)
    assert probe.count == 0 and not (saved / "probe-1.json").exists()
    invalid = json.loads((saved / "probe-1.invalid-1.json").read_text())
    assert invalid["valid"] is False and invalid["problems"] == ["client read late (the test's verdict)"]
    assert invalid["completed"] == 10
    out = probe(math.inf)
    assert probe.count == 1 and out.metrics.completed == 10
    repeat = json.loads((saved / "probe-1.json").read_text())
    assert repeat["valid"] is True
    assert repeat["request_ids"] == invalid["request_ids"] and all("p1-" in i for i in repeat["request_ids"])
    assert stand_in.sent[0][0] == stand_in.sent[1][0]  # the same prompts: the probe's seed


def test_a_client_that_falls_behind_adds_worker_processes_up_to_its_cores(
    server: SseServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``client_workers: auto`` a probe starts with one worker process; each run the
    self-check voids adds one for the repeat and the probes after it, and says so, up to the cores the
    client may use (3 here); the next trial's search starts where it got to; a fixed ``client_workers``
    never changes."""
    monkeypatch.setattr("autotune.load.probe.available_cores", lambda: 3.0)
    workers: list[int] = []

    def stand_in(*args: Any, **kwargs: Any) -> RunResult:
        workers.append(kwargs["workers"])
        result = run_requests(*args, **kwargs)
        return dataclasses.replace(result, problems=("client sent late (the test's verdict)",))

    monkeypatch.setattr("autotune.load.probe.run_requests", stand_in)
    wl = WorkloadSpec.model_validate({"dataset": {"input_len": 4, "output_len": 3}})
    slo = SloSection(terms=("ttft:p50<=1s",))
    meas = MeasurementSpec(min_requests=10, saturation_requests=10, client_workers="auto")
    probe = Prober(server.url, "pace-20", wl, slo, meas, base_dir=tmp_path, engine="raw")
    for grown, told in ((2, True), (3, True), (3, False)):  # at 3 workers it has no core left to add
        with pytest.raises(InvalidMeasurementError) as info:
            probe(math.inf)
        assert probe.workers == grown
        assert ("the client now runs" in str(info.value)) is told, str(info.value)
        if told:
            assert f"now runs {grown} worker processes (of 3 cores it may use)" in str(info.value)
    assert workers == [1, 2, 3]
    # A trial's search starts where the study's last one had grown to, within the cores.
    later = [Prober(server.url, "pace-20", wl, slo, meas, base_dir=tmp_path, workers_from=n) for n in (2, 9)]
    assert [p.workers for p in later] == [2, 3]
    fixed = Prober(server.url, "pace-20", wl, slo, meas.model_copy(update={"client_workers": 2}),
                   base_dir=tmp_path, engine="raw")  # fmt: skip
    with pytest.raises(InvalidMeasurementError):
        fixed(math.inf)
    assert fixed.workers == 2 and workers[-1] == 2


def test_a_busy_client_adds_a_worker_for_the_next_probe_and_says_so_in_the_probe_file(
    server: SseServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A valid run whose client was over its CPU limit (a warning: its chunks are bounded) counts, and the
    next probe runs with one more worker process; the saved probe says so among its warnings."""
    monkeypatch.setattr("autotune.load.probe.available_cores", lambda: 2.0)
    busy = "client CPU 95% of 1 core(s) over 1.0 s (limit 70%); a warning: every chunk's lateness is bounded"

    def stand_in(*args: Any, **kwargs: Any) -> RunResult:
        result = run_requests(*args, **kwargs)
        return dataclasses.replace(result, problems=(), warnings=(busy,))

    monkeypatch.setattr("autotune.load.probe.run_requests", stand_in)
    wl = WorkloadSpec.model_validate({"dataset": {"input_len": 4, "output_len": 3}})
    slo = SloSection(terms=("ttft:p50<=1s",))
    meas = MeasurementSpec(min_requests=10, saturation_requests=10, client_workers="auto")
    saved = tmp_path / "probes"
    probe = Prober(server.url, "pace-20", wl, slo, meas, base_dir=tmp_path, save_dir=saved, engine="raw")
    probe(math.inf)
    assert probe.count == 1 and probe.workers == 2
    warnings = json.loads((saved / "probe-1.json").read_text())["warnings"]
    assert warnings == [busy, "the client now runs 2 worker processes (of 2 cores it may use)"]


def test_a_run_the_server_refused_whole_reports_the_refusal_whatever_the_clients_timing(
    server: SseServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every request answered HTTP 500: the run measured the server's refusal, which no starvation of the
    client can make or move, so a self-check verdict against the client's timing does not void it; the
    probe counts and carries the server's error. A run that served its requests is still voided."""
    stand_in = _Verdicts(("client starved (the test's verdict)",), ("client starved (the test's verdict)",))
    monkeypatch.setattr("autotune.load.probe.run_requests", stand_in)
    wl = WorkloadSpec.model_validate({"dataset": {"input_len": 4, "output_len": 3}})
    slo = SloSection(terms=("ttft:p50<=1s",))
    meas = MeasurementSpec(min_requests=10, saturation_requests=10)
    refused = Prober(server.url, "http500", wl, slo, meas, base_dir=tmp_path, engine="raw")
    out = refused(math.inf)
    assert refused.count == 1 and out.metrics.completed == 0
    assert out.error_sample is not None and "engine dead" in out.error_sample
    served = Prober(server.url, "pace-50", wl, slo, meas, base_dir=tmp_path, engine="raw")
    with pytest.raises(InvalidMeasurementError, match=r"client starved \(the test's verdict\)"):
        served(math.inf)


def test_workers_split_the_schedule_and_merge_records(server: SseServer) -> None:
    """workers=2 runs two processes on one clock; records come back merged, complete and in order, each
    with its own request id, and none sent before its arrival time on the shared clock. (How late a loaded
    machine sent them is judged on recorded sends: test_workers_share_a_schedule_and_merge_on_one_clock.)"""
    arrivals = [0.01 * i for i in range(20)]
    result = run_requests(
        load_job(server.url, "pace-50", "completions", reqs(20, out=4), arrivals, id_prefix="split-"),
        workers=2,
    )
    assert [r.index for r in result.records] == list(range(20))
    assert [r.request_id for r in result.records] == [f"split-{i}" for i in range(20)]
    assert all(r.success and r.chunks == 4 and r.output_tokens == 4 for r in result.records)
    assert result.client.workers == 2 and result.planned == 20
    assert result.client.lag_samples > 0  # each worker's monitor ran
    offsets = [r.send_time - result.start for r in result.records]
    assert all(sent >= at - TIMER_S for sent, at in zip(offsets, arrivals, strict=True)), offsets


def test_workers_share_a_schedule_and_merge_on_one_clock() -> None:
    """Job.share deals the requests out in turn with their arrival times, and splits the concurrency limit
    and the connections to open; merge() puts the workers' records back in order on their one clock and
    judges the whole: sent on schedule, valid; one worker 10 ms behind its share's schedule, sent late."""
    arrivals = [0.01 * i for i in range(20)]
    job = Job(
        base_url="http://127.0.0.1:9",
        model="m",
        endpoint="completions",
        requests=reqs(20, out=4),
        arrivals=arrivals,
        indices=list(range(20)),
        ignore_eos=True,
        temperature=0.0,
        request_timeout=1.0,
        max_concurrency=5,
        engine="raw",
        headers={},
        id_prefix="w-",
        prepare=Preparation(connections=5),
    )
    shares = [job.share(w, 2) for w in range(2)]
    assert [s.indices for s in shares] == [list(range(0, 20, 2)), list(range(1, 20, 2))]
    assert [s.arrivals for s in shares] == [arrivals[0::2], arrivals[1::2]]
    assert [len(s.requests) for s in shares] == [10, 10]
    assert [s.max_concurrency for s in shares] == [3, 2]
    assert [s.prepare.connections for s in shares] == [3, 2]

    start = 50.0

    def worker(share: Job, behind: float) -> RunResult:
        """A worker's run of its share, each request sent ``behind`` seconds after its arrival time."""
        records = tuple(
            _stream(i, start + a + behind, [start + a + behind + PREFILL_S + 0.02 * k for k in range(4)])
            for i, a in zip(share.indices, share.arrivals, strict=True)
        )
        planned = {i: start + a for i, a in zip(share.indices, share.arrivals, strict=True)}
        delay, gap, stretch = send_delays(records, planned)
        figures = ClientFigures(
            lag_samples=25,
            chunks=40,
            kernel_timed=True,
            send_delay_mean_s=delay,
            send_gap_s=gap,
            send_stretch=stretch,
        )
        return with_problems(RunResult(records, start, max(r.end_time for r in records), 10, client=figures))

    merged = merge([worker(s, 0.0) for s in shares], start, 20)
    assert [r.index for r in merged.records] == list(range(20))
    assert [r.send_time - merged.start for r in merged.records] == pytest.approx(arrivals)
    assert (merged.client.workers, merged.client.lag_samples, merged.client.chunks) == (2, 25, 80)
    assert merged.client.send_gap_s == pytest.approx(0.01)  # the whole schedule's gap, not a share's
    assert merged.valid, merged.problems
    late = merge([worker(shares[0], 0.0), worker(shares[1], 0.01)], start, 20)
    assert [r.index for r in late.records] == list(range(20))
    assert [p for p in late.problems if p.startswith("client sent late")], late.problems


def test_workers_need_a_splittable_stop_check(server: SseServer) -> None:
    """With workers > 1 an arbitrary stop callable is refused (only EarlyStop can be split)."""
    with pytest.raises(LoadError, match="EarlyStop"):
        run_requests(
            load_job(server.url, "pace-1", "completions", reqs(2), [0.0, 0.0]), workers=2, stop=lambda p: None
        )


def test_a_worker_that_fails_before_it_is_ready_says_why() -> None:
    """A worker process that fails before its handshake (here: the raw engine refuses an https URL) is
    reported with its own error at once, not as a worker that did not start in time."""
    with pytest.raises(LoadError, match=r"a load worker failed: LoadError: the raw engine needs an http://"):
        run_requests(
            load_job("https://127.0.0.1:9", "m", "completions", reqs(2), [0.0, 0.0], engine="raw"), workers=2
        )


def test_stop_check_sees_first_chunks_of_in_flight_requests(server: SseServer, engine: Engine) -> None:
    """Progress.in_flight reports the first-chunk time of streams still running (for TTFT early stop)."""
    seen: list[float | None] = []

    def stop(progress: Any) -> str | None:
        seen.extend(f.first_chunk_time for f in progress.in_flight)
        return None

    run_requests(
        load_job(server.url, "pace-50", "completions", reqs(2, out=8), [0.0, 0.0], engine=engine), stop=stop
    )
    assert any(t is not None for t in seen)


def test_server_closing_kept_alive_connections_fails_no_request(server: SseServer, engine: Engine) -> None:
    """A server that drops idle keep-alive connections (idle-timeout race) costs no failed request: each
    engine retries once on a fresh connection."""
    arrivals = [0.02 * i for i in range(30)]  # each lasts ~35 ms: connections fall idle and are reused
    server.seen()
    result = run_requests(
        load_job(server.url, "drop-reused", "completions", reqs(30, out=2), arrivals, engine=engine)
    )
    dropped = len(server.seen()["bodies"]) - 30
    assert dropped > 0, "no request met a reused connection: the race was not exercised"
    assert [r.error for r in result.records if not r.success] == []


def test_workers_stop_together_on_early_stop(server: SseServer) -> None:
    """With workers=2 an EarlyStop fires per share and stops every worker."""
    from autotune.load.slo import EarlyStop

    stop = EarlyStop(SloSection(terms=("ttft:p90<=100ms",)), range(40))
    arrivals = [0.05 * i for i in range(40)]
    result = run_requests(
        load_job(server.url, "slow-first", "completions", reqs(40, out=2), arrivals, engine="raw"),
        workers=2,
        stop=stop,
    )
    assert result.stopped_early
    assert result.stop_reason is not None
    assert "ttft:p90" in result.stop_reason
    assert len(result.records) < 40


def _sent(index: int, at: float) -> RequestRecord:
    return RequestRecord(
        index=index,
        send_time=at,
        chunk_times=(at + 0.02,),
        output_tokens=1,
        prompt_tokens=1,
        input_len=1,
        output_len=1,
        success=True,
    )


def test_a_burst_written_one_request_after_another_is_not_sent_late() -> None:
    """80 requests planned at one instant, written 0.1 ms apart: the queue is the burst's own, not the
    client's; the same client 10 ms behind a paced schedule is late by 10 ms."""
    burst = [_sent(i, 1.0 + i * 1e-4) for i in range(80)]
    delay, gap, stretch = send_delays(burst, dict.fromkeys(range(80), 1.0))
    assert delay == pytest.approx(1e-4, rel=0.02) and gap == 0.0 and stretch == 0.0
    paced = [_sent(i, 1.0 + i * 0.05 + 0.01) for i in range(20)]
    delay, gap, _ = send_delays(paced, {i: 1.0 + i * 0.05 for i in range(20)})
    assert delay == pytest.approx(0.01) and gap == pytest.approx(0.05)


def test_a_done_share_keeps_its_drain_until_every_share_is_done() -> None:
    """Several client processes: a share whose judged requests are done does not stop (its drain keeps
    the load up for the other shares' last judged requests) until every share is done; then all finish.
    A share's early stop stops every share at once."""
    ctx = multiprocessing.get_context("spawn")
    verdicts: list[str | None] = [None, None]

    def local(share: int) -> Any:
        return lambda progress: verdicts[share]

    event, done = ctx.Event(), [ctx.Event(), ctx.Event()]
    first, second = (_SharedStop(local(w), event, done, w) for w in (0, 1))
    progress = cast(Progress, None)
    assert first(progress) is None and second(progress) is None
    verdicts[0] = Finished("judged requests done")
    assert first(progress) is None and first(progress) is None  # done, but the other share is not
    assert second(progress) is None
    verdicts[1] = Finished("judged requests done")
    assert second(progress) == "judged requests done" and first(progress) == "judged requests done"
    assert not event.is_set()

    event, done = ctx.Event(), [ctx.Event(), ctx.Event()]
    first, second = (_SharedStop(local(w), event, done, w) for w in (0, 1))
    verdicts[:] = [None, "ttft:p95 over its limit"]
    assert second(progress) == "ttft:p95 over its limit"
    assert first(progress) == STOPPED_BY_OTHER
