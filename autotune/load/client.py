"""The streaming load client: sends requests at their arrival times and timestamps every SSE chunk.

One aiohttp session (``TCPConnector(limit=0)``), uvloop when installed, one ``perf_counter()`` per network
read, and JSON parsed only where needed: a compact vLLM content chunk (``"choices":[{``) after the first
is counted without parsing; the first content chunk, the usage chunk, errors and anything unusual are
parsed (notes/loadgen.md). Chunks are counted the way ``vllm bench serve`` counts them: every event with a
non-empty ``choices`` list is a content chunk.

The self-check (:func:`check_run`) judges the client by its own witnesses: its CPU time and the lag of its
event loop (a monitor task that wakes every :data:`LAG_INTERVAL_S` and records how late it woke). What the
server does is recorded, not judged: vLLM merges the tokens of several engine steps into one chunk when its
API server lags (fewer chunks than ``usage.completion_tokens``: :attr:`RunResult.chunks_per_token`) and
writes several events in one network read (zero gaps: :attr:`RunResult.server_bursts`).

:func:`run_requests` is synchronous (it runs its own event loop) because the study loop is; use
:func:`run_requests_async` from async code. Every run checks itself (:attr:`RunResult.problems`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import math
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import aiohttp

from autotune.errors import InvalidMeasurementError, LoadError
from autotune.load._rawhttp import RawPool, RawResult
from autotune.load.workload import RequestSpec

Endpoint = Literal["completions", "chat"]
Engine = Literal["aiohttp", "raw"]
_T = TypeVar("_T")

_FAST = b'"choices":[{'
_DATA = b"data:"
_DONE = b"[DONE]"
_HEADERS = {"Content-Type": "application/json", "Accept": "text/event-stream"}

#: Client CPU above this fraction of one core over a run means the client, not the server, was measured.
MAX_CPU_FRACTION = 0.7
#: Seconds between two wake-ups of the event-loop lag monitor.
LAG_INTERVAL_S = 0.01
#: Event-loop lag p99 above this (seconds) means the client was late reading: it fell behind.
MAX_LOOP_LAG_P99_S = 0.01
#: Fewer lag samples than this (a run shorter than ~2 s) and the lag is recorded but not judged: with
#: fewer, the p99 is the single worst wake-up, and one garbage-collection pause would void a run.
MIN_LAG_SAMPLES = 200
#: Extra content chunks allowed beyond ``usage.completion_tokens`` (chat's role chunk, an empty last chunk).
CHUNK_SLACK = 2


@dataclass(frozen=True)
class RequestRecord:
    """What one request did, timed with ``time.perf_counter()`` (shared by all processes of a host).

    ``chunk_times`` are the arrival times of the content chunks (events with non-empty ``choices``).
    ``output_tokens``/``prompt_tokens`` come from the ``usage`` chunk (``None`` when the server sent none).
    """

    index: int
    send_time: float
    chunk_times: tuple[float, ...]
    output_tokens: int | None
    prompt_tokens: int | None
    input_len: int
    output_len: int
    success: bool
    error: str = ""
    status: int | None = None
    end_time: float = 0.0
    """When the request finished (stream closed, error or timeout)."""

    @property
    def chunks(self) -> int:
        """How many content chunks arrived."""
        return len(self.chunk_times)

    @property
    def ttft(self) -> float | None:
        """First content chunk − send (seconds); ``None`` without any chunk."""
        return self.chunk_times[0] - self.send_time if self.chunk_times else None

    @property
    def e2el(self) -> float | None:
        """Last content chunk − send (seconds); ``None`` without any chunk."""
        return self.chunk_times[-1] - self.send_time if self.chunk_times else None

    @property
    def itls(self) -> list[float]:
        """Every gap between consecutive content chunks (seconds)."""
        t = self.chunk_times
        return [b - a for a, b in itertools.pairwise(t)]

    @property
    def tokens(self) -> int:
        """Output tokens: ``usage.completion_tokens``, or the chunk count when the server sent no usage."""
        return self.output_tokens if self.output_tokens is not None else len(self.chunk_times)


@dataclass(frozen=True)
class InFlight:
    """A request that has been sent and has not finished: its send time and first-chunk time, if any."""

    send_time: float
    first_chunk_time: float | None


@dataclass(frozen=True)
class Progress:
    """A probe's state during a run, given to a :data:`StopCheck` about every 0.1 s."""

    now: float
    planned: int
    sent: int
    finished: Sequence[RequestRecord]
    """Finished requests so far, in finishing order (append-only across calls of one run)."""
    in_flight: Sequence[InFlight]


StopCheck = Callable[[Progress], str | None]
"""Returns a reason to stop the run now, or ``None`` to go on."""


@dataclass(frozen=True)
class RunResult:
    """The records of one run, its perf_counter window, whether it stopped early, and its self-check."""

    records: tuple[RequestRecord, ...]
    start: float
    end: float
    planned: int
    stopped_early: bool = False
    stop_reason: str | None = None
    cpu_s: float = 0.0
    """Client CPU seconds (the event-loop thread; summed over workers in multi-process mode)."""
    cpu_cores: float = 1.0
    """How many cores the client could use (workers in multi-process mode)."""
    problems: tuple[str, ...] = ()
    """Why this run cannot be trusted as data (empty when it can)."""
    loop_lag_p99_s: float = 0.0
    """p99 of how late the client's event loop woke up (seconds; the worst worker's in multi-process mode)."""
    loop_lag_max_s: float = 0.0
    """The latest wake-up of the client's event loop (seconds)."""
    lag_samples: int = 0
    """How many wake-ups the lag monitor measured (the fewest of any worker in multi-process mode)."""

    @property
    def server_bursts(self) -> float:
        """Share of chunk gaps (ITLs) of successful requests that are exactly 0: events that arrived in
        one network read. High while the loop was punctual, the server wrote in bursts (0.0 without gaps)."""
        gaps = zeros = 0
        for r in self.records:
            if r.success and len(r.chunk_times) > 1:
                t = r.chunk_times
                gaps += len(t) - 1
                zeros += sum(1 for a, b in itertools.pairwise(t) if b == a)
        return zeros / gaps if gaps else 0.0

    @property
    def chunks_per_token(self) -> float | None:
        """Content chunks per ``usage.completion_tokens`` over successful requests with usage; below 1 when
        the server merged several tokens into one chunk (``None`` without such requests)."""
        chunks = tokens = 0
        for r in self.records:
            if r.success and r.output_tokens is not None:
                chunks += r.chunks
                tokens += r.output_tokens
        return chunks / tokens if tokens else None

    @property
    def duration(self) -> float:
        """Seconds from the start of dispatch to the end of the last request."""
        return self.end - self.start

    @property
    def valid(self) -> bool:
        """True when the self-check found nothing wrong."""
        return not self.problems

    def raise_if_invalid(self) -> None:
        """Raise :class:`InvalidMeasurementError` naming every problem of an invalid run."""
        if self.problems:
            raise InvalidMeasurementError("measurement invalid: " + "; ".join(self.problems))


def request_body(
    model: str,
    endpoint: Endpoint,
    request: RequestSpec,
    *,
    ignore_eos: bool,
    temperature: float,
) -> dict[str, Any]:
    """The JSON body of one streaming request (no seed: bodies depend only on their inputs)."""
    body: dict[str, Any] = {"model": model}
    if endpoint == "completions":
        body["prompt"] = request.prompt
    else:
        if not isinstance(request.prompt, str):
            raise LoadError("the chat endpoint needs text prompts, got token ids")
        body["messages"] = [{"role": "user", "content": request.prompt}]
        body["max_completion_tokens"] = request.output_len
    body.update(
        max_tokens=request.output_len,
        temperature=temperature,
        ignore_eos=ignore_eos,
        stream=True,
        stream_options={"include_usage": True},
    )
    return body


def endpoint_url(base_url: str, endpoint: Endpoint) -> str:
    """``{base_url}/v1/completions`` or ``{base_url}/v1/chat/completions`` (base_url without /v1)."""
    base = base_url.rstrip("/")
    base = base.removesuffix("/v1")
    return f"{base}/v1/completions" if endpoint == "completions" else f"{base}/v1/chat/completions"


class _Stream:
    __slots__ = ("first", "send")

    def __init__(self, send: float) -> None:
        self.send = send
        self.first: float | None = None


def _parse_event(payload: bytes) -> dict[str, Any] | None:
    try:
        obj = json.loads(payload)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


async def _one(
    session: aiohttp.ClientSession,
    url: str,
    index: int,
    body: bytes,
    request: RequestSpec,
    timeout: aiohttp.ClientTimeout,
    sem: asyncio.Semaphore | None,
    active: dict[int, _Stream | RawResult],
    finished: list[RequestRecord],
) -> None:
    if sem is not None:
        await sem.acquire()
    perf = time.perf_counter
    times: list[float] = []
    append = times.append
    status: int | None = None
    error = ""
    usage_out: int | None = None
    usage_in: int | None = None
    st = perf()
    state = _Stream(st)
    active[index] = state
    try:
        async with session.post(url, data=body, headers=_HEADERS, timeout=timeout) as resp:
            status = resp.status
            if status != 200:
                error = f"HTTP {status}: {(await resp.text(errors='replace'))[:300]}"
            else:
                buf = b""
                fast = False
                async for data in resp.content.iter_any():
                    t = perf()
                    if buf:
                        data = buf + data
                    lines = data.split(b"\n")
                    buf = lines.pop()
                    for line in lines:
                        if fast and _FAST in line:
                            append(t)
                            continue
                        if not line.startswith(_DATA):
                            continue  # blank separators, comments, event: lines
                        payload = line[5:].strip()
                        if payload == _DONE:
                            continue
                        obj = _parse_event(payload)
                        if obj is None:
                            error = f"unparseable SSE event: {payload[:200]!r}"
                            continue
                        if obj.get("choices"):
                            append(t)
                            if not fast:
                                fast = True
                                state.first = t
                        usage = obj.get("usage")
                        if isinstance(usage, dict):
                            if isinstance(usage.get("completion_tokens"), int):
                                usage_out = usage["completion_tokens"]
                            if isinstance(usage.get("prompt_tokens"), int):
                                usage_in = usage["prompt_tokens"]
                        if "error" in obj:
                            error = f"error event: {str(obj['error'])[:300]}"
                if not times and not error:
                    error = "no content chunk received"
    except TimeoutError:
        error = f"timed out after {timeout.total} s"
    except (aiohttp.ClientError, OSError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    finally:
        if sem is not None:
            sem.release()
        active.pop(index, None)
    finished.append(
        RequestRecord(
            index=index,
            send_time=st,
            chunk_times=tuple(times),
            output_tokens=usage_out,
            prompt_tokens=usage_in,
            input_len=request.input_len,
            output_len=request.output_len,
            success=not error,
            error=error,
            status=status,
            end_time=perf(),
        )
    )


async def _one_raw(
    pool: RawPool,
    path: str,
    index: int,
    body: bytes,
    request: RequestSpec,
    timeout: float,
    sem: asyncio.Semaphore | None,
    active: dict[int, _Stream | RawResult],
    finished: list[RequestRecord],
) -> None:
    if sem is not None:
        await sem.acquire()
    st = time.perf_counter()
    res = RawResult(st)
    active[index] = res  # the protocol sets res.first at the first content chunk
    try:
        await pool.post(path, body, res, timeout)
    finally:
        if sem is not None:
            sem.release()
        active.pop(index, None)
    error = res.error
    if not error and res.status == 200 and not res.times:
        error = "no content chunk received"
    finished.append(
        RequestRecord(
            index=index,
            send_time=st,
            chunk_times=tuple(res.times),
            output_tokens=res.usage_tokens,
            prompt_tokens=res.prompt_tokens,
            input_len=request.input_len,
            output_len=request.output_len,
            success=not error,
            error=error,
            status=res.status,
            end_time=time.perf_counter(),
        )
    )


async def _watch_lag(samples: list[float], interval: float = LAG_INTERVAL_S) -> None:
    """Append how late (seconds) each periodic wake-up of this event loop was, until cancelled."""
    perf = time.perf_counter
    due = perf() + interval
    while True:
        await asyncio.sleep(interval)
        now = perf()
        samples.append(now - due if now > due else 0.0)
        due = now + interval


def _p99(values: list[float]) -> float:
    """Nearest-rank 99th percentile (0.0 for no values)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


async def run_requests_async(
    base_url: str,
    model: str,
    endpoint: Endpoint,
    requests: Sequence[RequestSpec],
    arrivals: Sequence[float],
    *,
    ignore_eos: bool = True,
    temperature: float = 0.0,
    request_timeout: float = 120.0,
    max_concurrency: int | None = None,
    stop: StopCheck | None = None,
    start_at: float | None = None,
    indices: Sequence[int] | None = None,
    engine: Engine = "aiohttp",
) -> RunResult:
    """Send ``requests[i]`` at ``start + arrivals[i]`` (perf_counter seconds) and record every stream.

    ``start_at`` fixes the start on the perf_counter clock (multi-process mode shares it across workers);
    by default the run starts now. ``indices`` renames the requests in the records (default 0..n-1).
    ``engine="raw"`` uses a minimal HTTP/1.1 client on a raw asyncio protocol (plain http only; about
    half the CPU per chunk of aiohttp) instead of aiohttp. ``stop`` is consulted about every 0.1 s; when
    it returns a reason the run cancels what is in flight, sends nothing more, and keeps only finished
    requests.
    """
    if len(requests) != len(arrivals):
        raise LoadError(f"{len(requests)} requests but {len(arrivals)} arrival times")
    names = list(indices) if indices is not None else list(range(len(requests)))
    url = endpoint_url(base_url, endpoint)
    bodies = [
        json.dumps(
            request_body(model, endpoint, r, ignore_eos=ignore_eos, temperature=temperature),
            separators=(",", ":"),
        ).encode()
        for r in requests
    ]
    order = sorted(range(len(requests)), key=lambda i: arrivals[i])
    timeout = aiohttp.ClientTimeout(total=request_timeout)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    active: dict[int, _Stream | RawResult] = {}
    finished: list[RequestRecord] = []
    tasks: set[asyncio.Task[None]] = set()
    reason: list[str] = []
    lags: list[float] = []
    cpu0 = time.thread_time()
    connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=None)
    pool = RawPool(url.split("/v1/", 1)[0]) if engine == "raw" else None
    path = "/v1/" + url.split("/v1/", 1)[1]
    async with aiohttp.ClientSession(connector=connector, auto_decompress=False) as session:
        start = time.perf_counter() if start_at is None else start_at
        sent = 0
        lag_task = asyncio.create_task(_watch_lag(lags))

        async def dispatch() -> None:
            nonlocal sent
            for i in order:
                delay = start + arrivals[i] - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                if reason:
                    return
                if pool is not None:
                    coro = _one_raw(
                        pool, path, names[i], bodies[i], requests[i], request_timeout, sem, active, finished
                    )
                else:
                    coro = _one(
                        session, url, names[i], bodies[i], requests[i], timeout, sem, active, finished
                    )
                task = asyncio.create_task(coro)
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                sent += 1

        async def monitor(dispatcher: asyncio.Task[None]) -> None:
            assert stop is not None
            while not (dispatcher.done() and not tasks):
                await asyncio.sleep(0.1)
                snapshot = Progress(
                    now=time.perf_counter(),
                    planned=len(requests),
                    sent=sent,
                    finished=finished,
                    in_flight=[InFlight(s.send, s.first) for s in active.values()],
                )
                why = stop(snapshot)
                if why:
                    reason.append(why)
                    dispatcher.cancel()
                    for t in list(tasks):
                        t.cancel()
                    return

        dispatcher = asyncio.create_task(dispatch())
        watcher = asyncio.create_task(monitor(dispatcher)) if stop is not None else None
        try:
            await asyncio.gather(dispatcher, return_exceptions=True)
            while tasks:
                await asyncio.gather(*list(tasks), return_exceptions=True)
        finally:
            lag_task.cancel()
            await asyncio.gather(lag_task, return_exceptions=True)
            if watcher is not None:
                watcher.cancel()
                await asyncio.gather(watcher, return_exceptions=True)
            for t in list(tasks):
                t.cancel()
            if pool is not None:
                pool.close()
        end = max((r.end_time for r in finished), default=time.perf_counter())
    cpu = time.thread_time() - cpu0
    records = tuple(sorted(finished, key=lambda r: r.index))
    result = RunResult(
        records=records,
        start=start,
        end=end,
        planned=len(requests),
        stopped_early=bool(reason),
        stop_reason=reason[0] if reason else None,
        cpu_s=cpu,
        loop_lag_p99_s=_p99(lags),
        loop_lag_max_s=max(lags, default=0.0),
        lag_samples=len(lags),
    )
    return _with_problems(result)


def check_run(result: RunResult) -> tuple[str, ...]:
    """The self-check of a run: why its numbers would describe the client rather than the server.

    - client CPU above :data:`MAX_CPU_FRACTION` of the cores it had over the run;
    - the client's event loop late: lag p99 above :data:`MAX_LOOP_LAG_P99_S` (judged from
      :data:`MIN_LAG_SAMPLES` samples on), so chunk timestamps were taken late (the client fell behind);
    - more content chunks than ``usage.completion_tokens`` + :data:`CHUNK_SLACK` in over 1% of completed
      requests (the client mis-parsed the stream).

    Facts of the server, not problems (:attr:`RunResult.server_bursts`, :attr:`RunResult.chunks_per_token`):
    fewer chunks than tokens (vLLM merges the tokens of several engine steps into one chunk when its API
    server lags) and zero gaps between chunks (several events in one read). ITL stays the gap between
    content chunks, as ``vllm bench serve`` measures it, so merged chunks show as longer gaps.
    """
    problems: list[str] = []
    wall = max(result.duration, 1e-9)
    if result.duration >= 1.0 and result.cpu_s > MAX_CPU_FRACTION * result.cpu_cores * wall:
        problems.append(
            f"client CPU {result.cpu_s / wall / result.cpu_cores:.0%} of {result.cpu_cores:g} core(s) "
            f"over {wall:.1f} s (limit {MAX_CPU_FRACTION:.0%}): the client may have fallen behind"
        )
    if result.lag_samples >= MIN_LAG_SAMPLES and result.loop_lag_p99_s > MAX_LOOP_LAG_P99_S:
        problems.append(
            f"client event-loop lag p99 {result.loop_lag_p99_s * 1e3:.1f} ms (max "
            f"{result.loop_lag_max_s * 1e3:.1f} ms, {result.lag_samples} samples; limit "
            f"{MAX_LOOP_LAG_P99_S * 1e3:g} ms): the client read chunks late (it fell behind)"
        )
    counted = [r for r in result.records if r.success and r.output_tokens is not None]
    bad = [r for r in counted if r.chunks > r.tokens + CHUNK_SLACK]
    if counted and len(bad) > max(0, math.floor(0.01 * len(counted))):
        r = bad[0]
        problems.append(
            f"{len(bad)} of {len(counted)} requests have more content chunks than usage.completion_tokens "
            f"(e.g. request {r.index}: {r.chunks} chunks, {r.tokens} tokens): the stream was mis-parsed"
        )
    return tuple(problems)


def _with_problems(result: RunResult) -> RunResult:
    problems = check_run(result)
    return dataclasses.replace(result, problems=problems) if problems else result


def run_sync(coro: Coroutine[Any, Any, _T]) -> _T:
    """Run ``coro`` on a fresh event loop (uvloop when installed) in this thread and return its result.

    Raises :class:`LoadError` when called from a thread whose event loop is already running.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        coro.close()
        raise LoadError("run_requests() was called inside a running event loop: use run_requests_async()")
    factory: Callable[[], asyncio.AbstractEventLoop] | None = None
    try:
        import uvloop

        factory = uvloop.new_event_loop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        factory = None
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(coro)


def run_requests(
    base_url: str,
    model: str,
    endpoint: Endpoint,
    requests: Sequence[RequestSpec],
    arrivals: Sequence[float],
    *,
    ignore_eos: bool = True,
    temperature: float = 0.0,
    request_timeout: float = 120.0,
    max_concurrency: int | None = None,
    stop: StopCheck | None = None,
    workers: int = 1,
    engine: Engine = "aiohttp",
) -> RunResult:
    """Synchronous :func:`run_requests_async`: runs its own (uvloop) event loop in the calling thread.

    ``workers > 1`` spreads the requests over that many processes (request ``i`` to worker
    ``i % workers``), each with its own event loop and its share of the arrival schedule and of
    ``max_concurrency``, all starting at one perf_counter instant; records are merged at the end. In that
    mode ``stop`` must be an :class:`~autotune.load.slo.EarlyStop` (or ``None``): each worker judges its
    share, and a stop in one worker stops all. Use it for about 1,000 streams and more.
    """
    if workers > 1:
        return _run_workers(
            _Job(
                base_url=base_url,
                model=model,
                endpoint=endpoint,
                requests=list(requests),
                arrivals=list(arrivals),
                indices=list(range(len(requests))),
                ignore_eos=ignore_eos,
                temperature=temperature,
                request_timeout=request_timeout,
                max_concurrency=max_concurrency,
                engine=engine,
            ),
            workers,
            stop,
        )
    return run_sync(
        run_requests_async(
            base_url,
            model,
            endpoint,
            requests,
            arrivals,
            ignore_eos=ignore_eos,
            temperature=temperature,
            request_timeout=request_timeout,
            max_concurrency=max_concurrency,
            stop=stop,
            engine=engine,
        )
    )


# ----------------------------------------------------------------------------------------------
# Multi-process mode
# ----------------------------------------------------------------------------------------------

#: Seconds a worker process may take to start (import, event loop) before the run is abandoned.
WORKER_START_TIMEOUT = 60.0


@dataclass(frozen=True)
class _Job:
    base_url: str
    model: str
    endpoint: Endpoint
    requests: list[RequestSpec]
    arrivals: list[float]
    indices: list[int]
    ignore_eos: bool
    temperature: float
    request_timeout: float
    max_concurrency: int | None
    engine: Engine

    def share(self, worker: int, workers: int) -> _Job:
        limit = self.max_concurrency
        if limit is not None:
            limit = max(1, limit // workers + (1 if worker < limit % workers else 0))
        picked = range(worker, len(self.requests), workers)
        return _Job(
            base_url=self.base_url,
            model=self.model,
            endpoint=self.endpoint,
            requests=[self.requests[i] for i in picked],
            arrivals=[self.arrivals[i] for i in picked],
            indices=[self.indices[i] for i in picked],
            ignore_eos=self.ignore_eos,
            temperature=self.temperature,
            request_timeout=self.request_timeout,
            max_concurrency=limit,
            engine=self.engine,
        )


class _SharedStop:
    """A worker's stop check: its own share's early stop, or any other worker having stopped."""

    def __init__(self, local: StopCheck | None, event: Any) -> None:
        self._local = local
        self._event = event

    def __call__(self, progress: Progress) -> str | None:
        if self._event.is_set():
            return "another worker stopped the run"
        why = self._local(progress) if self._local is not None else None
        if why:
            self._event.set()
        return why


def _worker_main(conn: Any, job: _Job, local_stop: StopCheck | None, event: Any) -> None:
    """Entry point of a worker process: handshake, wait for the shared start, run, send the result."""
    try:
        conn.send("ready")
        start_at = conn.recv()
        result = run_sync(
            run_requests_async(
                job.base_url,
                job.model,
                job.endpoint,
                job.requests,
                job.arrivals,
                ignore_eos=job.ignore_eos,
                temperature=job.temperature,
                request_timeout=job.request_timeout,
                max_concurrency=job.max_concurrency,
                stop=_SharedStop(local_stop, event),
                start_at=start_at,
                indices=job.indices,
                engine=job.engine,
            )
        )
        conn.send(result)
    except BaseException as exc:  # report every failure to the parent, which raises LoadError
        conn.send(f"{type(exc).__name__}: {exc}")
    finally:
        conn.close()


def _run_workers(job: _Job, workers: int, stop: StopCheck | None) -> RunResult:
    import multiprocessing

    from autotune.load.slo import EarlyStop

    if stop is not None and not isinstance(stop, EarlyStop):
        raise LoadError("with workers > 1 the stop check must be an EarlyStop (it is split per worker)")
    ctx = multiprocessing.get_context("spawn")
    event = ctx.Event()
    shares = [job.share(w, workers) for w in range(workers)]
    procs = []
    conns = []
    try:
        for share in shares:
            parent, child = ctx.Pipe()
            local = stop.for_share(len(share.requests)) if isinstance(stop, EarlyStop) else None
            proc = ctx.Process(target=_worker_main, args=(child, share, local, event), daemon=True)
            proc.start()
            child.close()
            procs.append(proc)
            conns.append(parent)
        for conn in conns:
            if not conn.poll(WORKER_START_TIMEOUT) or conn.recv() != "ready":
                raise LoadError(f"a load worker did not start within {WORKER_START_TIMEOUT:g} s")
        start_at = time.perf_counter() + 0.05
        for conn in conns:
            conn.send(start_at)
        results: list[RunResult] = []
        for conn in conns:
            got = conn.recv()
            if not isinstance(got, RunResult):
                raise LoadError(f"a load worker failed: {got}")
            results.append(got)
    except (EOFError, OSError) as exc:
        raise LoadError(f"a load worker died: {exc}") from exc
    finally:
        for conn in conns:
            conn.close()
        for proc in procs:
            proc.join(timeout=5.0)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5.0)
    return _merge(results, start_at, len(job.requests))


def _merge(results: list[RunResult], start: float, planned: int) -> RunResult:
    records = tuple(sorted((r for res in results for r in res.records), key=lambda r: r.index))
    reasons = [res.stop_reason for res in results if res.stop_reason]
    own = [r for r in reasons if r != "another worker stopped the run"]
    merged = RunResult(
        records=records,
        start=start,
        end=max(res.end for res in results),
        planned=planned,
        stopped_early=any(res.stopped_early for res in results),
        stop_reason=(own or reasons)[0] if reasons else None,
        cpu_s=math.fsum(res.cpu_s for res in results),
        cpu_cores=float(len(results)),
        loop_lag_p99_s=max(res.loop_lag_p99_s for res in results),
        loop_lag_max_s=max(res.loop_lag_max_s for res in results),
        lag_samples=min(res.lag_samples for res in results),
    )
    # CPU is judged per worker (each has one core); the rest on the merged records and the worst lag.
    problems = list(dict.fromkeys(p for res in results for p in res.problems if "client CPU" in p))
    problems += [p for p in check_run(merged) if "client CPU" not in p]
    return dataclasses.replace(merged, problems=tuple(problems)) if problems else merged


__all__ = [
    "Endpoint",
    "InFlight",
    "Progress",
    "RequestRecord",
    "RunResult",
    "StopCheck",
    "check_run",
    "endpoint_url",
    "request_body",
    "run_requests",
    "run_requests_async",
    "run_sync",
]
