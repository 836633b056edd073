"""The streaming load client: sends requests at their arrival times and records every SSE chunk's arrival.

One engine (:mod:`autotune.load.engines`: the raw HTTP/1.1 client, or aiohttp) on uvloop when installed,
one ``perf_counter()`` per network read, JSON parsed only where needed (:mod:`autotune.load.exchange`).
Every run checks itself (:mod:`autotune.load.selfcheck`: :attr:`RunResult.problems`). With ``workers > 1``
the schedule is shared by several processes (:mod:`autotune.load.workers`).

:func:`run_requests` is synchronous (it runs its own event loop) because the study loop is; use
:func:`run_requests_async` from async code.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from autotune.errors import LoadError
from autotune.load.aio import run_sync
from autotune.load.engines import Engine, Pool, open_pool
from autotune.load.exchange import Exchange
from autotune.load.records import (
    Endpoint,
    InFlight,
    Preparation,
    Progress,
    RequestRecord,
    RunResult,
    ShareableStop,
    StopCheck,
    new_run_id,
)
from autotune.load.selfcheck import Witness, with_problems
from autotune.load.workers import Job, run_workers
from autotune.load.workload import RequestSpec


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


NO_PREPARATION = Preparation()


async def _one(
    pool: Pool,
    path: str,
    index: int,
    request_id: str,
    body: bytes,
    request: RequestSpec,
    timeout: float,
    sem: asyncio.Semaphore | None,
    active: dict[int, Exchange],
    finished: list[RequestRecord] | None,
) -> None:
    if sem is not None:
        await sem.acquire()
    ex = Exchange(time.perf_counter())  # the engine stamps ex.send again when the request is written
    active[index] = ex  # the engine sets ex.first at the first content chunk
    try:
        await pool.post(path, body, ex, timeout, {"X-Request-Id": request_id})
    finally:
        if sem is not None:
            sem.release()
        active.pop(index, None)
    if finished is None:
        return
    error = ex.error
    if not error and ex.status == 200 and not ex.times:
        error = "no content chunk received"
    finished.append(
        RequestRecord(
            index=index,
            send_time=ex.send,
            chunk_times=tuple(ex.times),
            output_tokens=ex.usage_tokens,
            prompt_tokens=ex.prompt_tokens,
            input_len=request.input_len,
            output_len=request.output_len,
            success=not error,
            error=error,
            status=ex.status,
            end_time=time.perf_counter(),
            request_id=request_id,
            chunk_waits=tuple(ex.waits) if len(ex.waits) == len(ex.times) else (),
        )
    )


#: Seconds a run may spend opening connections and warming them before it starts.
PREPARE_TIMEOUT_S = 60.0


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
    start_at: Callable[[], float] | None = None,
    indices: Sequence[int] | None = None,
    engine: Engine = "raw",
    headers: Mapping[str, str] | None = None,
    id_prefix: str | None = None,
    prepare: Preparation = NO_PREPARATION,
) -> RunResult:
    """Send ``requests[i]`` at ``start + arrivals[i]`` (perf_counter seconds) and record every stream.

    Before the start the pool opens ``prepare.connections`` connections and sends ``prepare.warmup``
    (unrecorded), so the run measures the server, not connection set-up. ``start_at`` is called then and
    returns the start on the perf_counter clock (multi-process mode shares one start); by default the run
    starts at once. ``indices`` renames the requests in the records (default 0..n-1); each is sent with
    ``X-Request-Id: <id_prefix><index>`` and ``headers``. ``engine="raw"`` (the default, as in a study's
    ``measurement.client``) uses a minimal HTTP/1.1 client on a raw asyncio protocol (about half the CPU
    per chunk of aiohttp); ``"aiohttp"`` uses aiohttp. ``stop`` is consulted about every 0.1 s; when it
    returns a reason the run cancels what is in flight, sends nothing more, and keeps only finished
    requests. The client watches itself while it runs (:mod:`autotune.load.selfcheck`); the garbage
    collector is off meanwhile.
    """
    if len(requests) != len(arrivals):
        raise LoadError(f"{len(requests)} requests but {len(arrivals)} arrival times")
    names = list(indices) if indices is not None else list(range(len(requests)))
    prefix = id_prefix if id_prefix is not None else new_run_id()
    url = endpoint_url(base_url, endpoint)
    base, path = url.split("/v1/", 1)
    path = "/v1/" + path

    def body(r: RequestSpec) -> bytes:
        data = request_body(model, endpoint, r, ignore_eos=ignore_eos, temperature=temperature)
        return json.dumps(data, separators=(",", ":")).encode()

    bodies = [body(r) for r in requests]
    order = sorted(range(len(requests)), key=lambda i: arrivals[i])
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    active: dict[int, Exchange] = {}
    finished: list[RequestRecord] = []
    tasks: set[asyncio.Task[None]] = set()
    reason: list[str] = []
    pool = open_pool(engine, base, headers)
    witness = Witness(kernel_times=engine == "raw")
    try:
        await _prepare(pool, path, prefix, prepare, body, request_timeout)
        witness.start()  # collects garbage, then freezes the collector: before the clock starts
        start = start_at() if start_at is not None else time.perf_counter()
        wall_start = time.time() - (time.perf_counter() - start)
        sent = 0
        lag_task = asyncio.create_task(witness.watch_lag())

        async def dispatch() -> None:
            nonlocal sent
            for i in order:
                delay = start + arrivals[i] - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                if reason:
                    return
                name = names[i]
                coro = _one(
                    pool,
                    path,
                    name,
                    f"{prefix}{name}",
                    bodies[i],
                    requests[i],
                    request_timeout,
                    sem,
                    active,
                    finished,
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
        end = max((r.end_time for r in finished), default=time.perf_counter())
        # Requests paced by their arrival time alone (a concurrency limit holds others back on purpose).
        planned = {} if sem is not None else {names[i]: start + arrivals[i] for i in range(len(requests))}
        figures, records = witness.stop(end - start, finished, planned)
    finally:
        await pool.close()
    result = RunResult(
        records=tuple(sorted(records, key=lambda r: r.index)),
        start=start,
        end=end,
        planned=len(requests),
        stopped_early=bool(reason),
        stop_reason=reason[0] if reason else None,
        client=figures,
        wall_start=wall_start,
    )
    return with_problems(result)


async def _prepare(
    pool: Pool,
    path: str,
    prefix: str,
    prepare: Preparation,
    body: Callable[[RequestSpec], bytes],
    timeout: float,
) -> None:
    """Open the run's connections and send its warm-up requests on them (unrecorded)."""
    if prepare.connections:
        await pool.preconnect(prepare.connections, PREPARE_TIMEOUT_S)
    if not prepare.warmup:
        return
    sem = asyncio.Semaphore(max(1, prepare.connections or len(prepare.warmup)))
    await asyncio.gather(
        *(
            _one(pool, path, -1 - k, f"{prefix}warmup-{k}", body(r), r, timeout, sem, {}, None)
            for k, r in enumerate(prepare.warmup)
        )
    )


async def _run_job(job: Job, stop: StopCheck | None, start_at: Callable[[], float]) -> RunResult:
    """A worker process's run of its share (module level: the worker process imports it)."""
    return await run_requests_async(
        job.base_url,
        job.model,
        job.endpoint,
        job.requests,
        job.arrivals,
        ignore_eos=job.ignore_eos,
        temperature=job.temperature,
        request_timeout=job.request_timeout,
        max_concurrency=job.max_concurrency,
        stop=stop,
        start_at=start_at,
        indices=job.indices,
        engine=job.engine,
        headers=job.headers,
        id_prefix=job.id_prefix,
        prepare=job.prepare,
    )


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
    engine: Engine = "raw",
    headers: Mapping[str, str] | None = None,
    id_prefix: str | None = None,
    prepare: Preparation = NO_PREPARATION,
) -> RunResult:
    """Synchronous :func:`run_requests_async`: runs its own (uvloop) event loop in the calling thread.

    ``workers > 1`` spreads the requests over that many processes (:mod:`autotune.load.workers`), each
    with its share of ``prepare``; then ``stop`` must be splittable over them (an
    :class:`~autotune.load.slo.EarlyStop`, or ``None``).
    """
    prefix = id_prefix if id_prefix is not None else new_run_id()
    if workers > 1:
        if stop is not None and not isinstance(stop, ShareableStop):
            raise LoadError("with workers > 1 the stop check must be an EarlyStop (it is split per worker)")
        job = Job(
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
            headers=dict(headers or {}),
            id_prefix=prefix,
            prepare=prepare,
        )
        return run_workers(job, workers, stop, _run_job)
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
            headers=headers,
            id_prefix=prefix,
            prepare=prepare,
        )
    )
