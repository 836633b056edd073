"""The streaming load client: sends requests at their arrival times and records every SSE chunk's arrival.

One engine (:mod:`autotune.load.engines`: the raw HTTP/1.1 client, or aiohttp) on uvloop when installed,
one ``perf_counter()`` per network read, JSON parsed only where needed (:mod:`autotune.load.exchange`).
Every run checks itself (:mod:`autotune.load.selfcheck`: :attr:`RunResult.problems`). With ``workers > 1``
the schedule is shared by several processes (:mod:`autotune.load.workers`).

:func:`load_job` makes the :class:`~autotune.load.workers.Job` of a run, and :func:`run_requests` runs it:
it is synchronous (it runs its own event loop) because the study loop is; use :func:`run_requests_async`
from async code.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from autotune.errors import LoadError
from autotune.inputs.slo_terms import MetricKey
from autotune.load.aio import run_sync, start_task
from autotune.load.engines import Engine, Pool, open_pool
from autotune.load.exchange import Exchange
from autotune.load.records import (
    Endpoint,
    Finished,
    InFlight,
    Preparation,
    Progress,
    RequestRecord,
    RunResult,
    ShareableStop,
    StopCheck,
    new_run_id,
)
from autotune.load.request import RequestSpec
from autotune.load.selfcheck import JUDGED, Witness, with_problems
from autotune.load.workers import Job, run_workers

Message = tuple[str, str]
"""One message of a conversation so far: its role (``user``, ``assistant``) and its text."""


def request_body(
    model: str,
    endpoint: Endpoint,
    request: RequestSpec,
    *,
    ignore_eos: bool,
    temperature: float,
    history: Sequence[Message] = (),
) -> dict[str, Any]:
    """The JSON body of one streaming request (no seed: bodies depend only on their inputs).

    The chat endpoint sends the request's ``system`` prompt as a system message, then ``history`` (the
    conversation so far), then the prompt as the user's message; completions send them as one text, in
    that order, separated by spaces (token-id prompts: the system prompt's ids, then the prompt's)."""
    body: dict[str, Any] = {"model": model}
    system = request.system
    if endpoint == "completions":
        if isinstance(request.prompt, list):
            if history or isinstance(system, str):
                raise LoadError("a token-id prompt cannot follow a conversation or a text system prompt")
            body["prompt"] = [*system, *request.prompt] if system is not None else request.prompt
        elif system is not None or history:
            if isinstance(system, list):
                raise LoadError("a text prompt cannot follow a token-id system prompt")
            parts = [system] if system is not None else []
            parts += [text.strip() for _, text in history]
            body["prompt"] = " ".join([*parts, request.prompt])
        else:
            body["prompt"] = request.prompt
    else:
        if not isinstance(request.prompt, str) or isinstance(system, list):
            raise LoadError("the chat endpoint needs text prompts, got token ids")
        messages = [{"role": "system", "content": system}] if system is not None else []
        messages += [{"role": role, "content": text} for role, text in history]
        body["messages"] = [*messages, {"role": "user", "content": request.prompt}]
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
    then: Callable[[RequestRecord, Exchange], None] | None = None,
) -> None:
    if sem is not None:
        await sem.acquire()
    # The engine stamps ex.send again when the request is written; a request that a later turn follows
    # keeps its reply's text (``then`` sends it back).
    ex = Exchange(time.perf_counter(), keep_text=then is not None)
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
    if not error and ex.status is not None and ex.status != 200:  # an engine that ended without failing it
        error = f"HTTP {ex.status}"
    if not error and ex.status == 200 and not ex.times:
        error = "no content chunk received"
    record = RequestRecord(
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
        chunk_late=tuple(ex.early) if len(ex.early) == len(ex.times) and any(ex.early) else (),
        send_wait=max(0.0, ex.sent - ex.send) if ex.sent else 0.0,
    )
    finished.append(record)
    if then is not None:
        then(record, ex)


#: Seconds a run may spend opening connections and warming them before it starts.
PREPARE_TIMEOUT_S = 60.0


def load_job(
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
    indices: Sequence[int] | None = None,
    engine: Engine = "raw",
    headers: Mapping[str, str] | None = None,
    id_prefix: str | None = None,
    prepare: Preparation = NO_PREPARATION,
    judged: Sequence[MetricKey] = JUDGED,
) -> Job:
    """The :class:`~autotune.load.workers.Job` that sends ``requests[i]`` at ``arrivals[i]`` seconds after
    the start to ``base_url`` (:func:`run_requests` and :func:`run_requests_async` run it).

    ``indices`` renames the requests in the records (default 0..n-1); each is sent with
    ``X-Request-Id: <id_prefix><index>`` (default prefix: a new run id, so a job is run once: build
    another for another run) and ``headers``. ``engine="raw"``
    (the default, as in a study's ``measurement.client``) uses a minimal HTTP/1.1 client on a raw asyncio
    protocol (about half the CPU per chunk of aiohttp); ``"aiohttp"`` uses aiohttp. Before the start the
    run opens ``prepare.connections`` connections and sends ``prepare.warmup`` (unrecorded); only the
    ``judged`` statistics' error bounds void the run (the others are recorded, and warned of).
    """
    return Job(
        base_url=base_url,
        model=model,
        endpoint=endpoint,
        requests=list(requests),
        arrivals=list(arrivals),
        indices=list(indices) if indices is not None else list(range(len(requests))),
        ignore_eos=ignore_eos,
        temperature=temperature,
        request_timeout=request_timeout,
        max_concurrency=max_concurrency,
        engine=engine,
        headers=dict(headers or {}),
        id_prefix=id_prefix if id_prefix is not None else new_run_id(),
        prepare=prepare,
        judged=tuple(judged),
    )


async def run_requests_async(
    job: Job, *, stop: StopCheck | None = None, start_at: Callable[[], float] | None = None
) -> RunResult:
    """Run ``job`` (:func:`load_job`) on the running event loop, with the stop check ``stop`` and the start
    ``start_at`` returns (default: at once); :class:`LoadRun` says what a run does."""
    return await LoadRun(job, stop, start_at).run()


class LoadRun:
    """One run of a :class:`~autotune.load.workers.Job` on this event loop, and the state it keeps while it
    runs: the requests sent and finished, those in flight, the concurrency limit, the tasks, the stop
    reason, when each later turn was due, and the client's witness of itself.

    A run sends ``job.requests[i]`` at ``start + job.arrivals[i]`` (perf_counter seconds) and records
    every stream. Before the start the pool opens ``job.prepare.connections`` connections and sends
    ``job.prepare.warmup`` (unrecorded), so the run measures the server, not connection set-up.
    ``start_at`` is called then and returns the start on the perf_counter clock (multi-process mode shares
    one start); by default the run starts at once. ``stop`` is consulted about every 0.1 s; when it
    returns a reason the run cancels what is in flight, sends nothing more, and keeps only finished
    requests (a :class:`~autotune.load.records.Finished` reason ends it cleanly, otherwise it stopped
    early). The client watches itself while it runs (:mod:`autotune.load.selfcheck`); the garbage
    collector is off meanwhile; only the ``job.judged`` statistics' error bounds void the run (the others
    are recorded, and warned of).

    A request that ``follows`` another (a later turn of a conversation, named by its index in the records)
    is not sent at its arrival time: it is sent ``think`` seconds after that one ended, with the
    conversation so far (each earlier turn's prompt and the reply received to it) before its own prompt.
    If the turn it follows failed, it is recorded as failed without being sent (and so are the turns
    after it). With ``workers > 1`` a conversation stays on one worker.
    """

    def __init__(self, job: Job, stop: StopCheck | None, start_at: Callable[[], float] | None) -> None:
        if len(job.requests) != len(job.arrivals):
            raise LoadError(f"{len(job.requests)} requests but {len(job.arrivals)} arrival times")
        self.job = job
        self.stop = stop
        self.start_at = start_at
        self.requests = job.requests
        self.names = job.indices
        base, path = endpoint_url(job.base_url, job.endpoint).split("/v1/", 1)
        self.base, self.path = base, "/v1/" + path
        self.follower = _followers(job.requests, job.indices)
        self.order = sorted(
            (i for i, r in enumerate(job.requests) if r.follows is None), key=lambda i: job.arrivals[i]
        )
        self.sem = asyncio.Semaphore(job.max_concurrency) if job.max_concurrency else None
        self.bodies = [self.body(r) if r.follows is None else b"" for r in job.requests]
        """Each first turn's body, made before the clock starts (a later turn's waits for the reply)."""
        self.active: dict[int, Exchange] = {}
        self.finished: list[RequestRecord] = []
        self.tasks: set[asyncio.Task[None]] = set()
        self.reason: list[str] = []
        self.planned_turns: dict[int, float] = {}
        """When each later turn was to be sent: the end of the turn before it plus its think time."""
        self.sent = 0
        self.start = 0.0
        self.witness = Witness(kernel_times=job.engine == "raw")

    def body(self, r: RequestSpec, history: Sequence[Message] = ()) -> bytes:
        """The JSON body of ``r`` after ``history``."""
        job = self.job
        data = request_body(
            job.model,
            job.endpoint,
            r,
            ignore_eos=job.ignore_eos,
            temperature=job.temperature,
            history=history,
        )
        return json.dumps(data, separators=(",", ":")).encode()

    async def run(self) -> RunResult:
        """Prepare, send every request at its time (or until the stop check says), and judge the run."""
        job = self.job
        pool = open_pool(job.engine, self.base, job.headers)
        try:
            await _prepare(pool, self.path, job.id_prefix, job.prepare, self.body, job.request_timeout)
            self.witness.start()  # collects garbage, then freezes the collector: before the clock starts
            self.start = start = self.start_at() if self.start_at is not None else time.perf_counter()
            wall_start = time.time() - (time.perf_counter() - start)
            await self._send_all(pool)
            end = max((r.end_time for r in self.finished), default=time.perf_counter())
            # Requests paced by their arrival time alone (a concurrency limit holds others back on purpose).
            planned = {self.names[i]: start + job.arrivals[i] for i in self.order} | self.planned_turns
            paced = {} if self.sem is not None else planned
            figures, records = self.witness.stop(end - start, self.finished, paced)
        finally:
            self.witness.release()  # a run ended by an exception (an interrupt, a cancel) never reached stop
            await pool.close()
        result = RunResult(
            records=tuple(sorted(records, key=lambda r: r.index)),
            start=start,
            end=end,
            planned=len(self.requests),
            stopped_early=bool(self.reason) and not isinstance(self.reason[0], Finished),
            stop_reason=self.reason[0] if self.reason else None,
            client=figures,
            wall_start=wall_start,
        )
        return with_problems(result, job.judged)

    async def _send_all(self, pool: Pool) -> None:
        """Dispatch the schedule, watch the stop check, and wait for every request to end."""
        lag_task = start_task(self.witness.watch_lag)
        dispatcher = start_task(lambda: self._dispatch(pool))
        watcher = start_task(lambda: self._monitor(dispatcher)) if self.stop is not None else None
        try:
            await asyncio.gather(dispatcher, return_exceptions=True)
            while self.tasks:
                await asyncio.gather(*list(self.tasks), return_exceptions=True)
        finally:
            lag_task.cancel()
            await asyncio.gather(lag_task, return_exceptions=True)
            if watcher is not None:
                watcher.cancel()
                await asyncio.gather(watcher, return_exceptions=True)
            for t in list(self.tasks):
                t.cancel()

    def _track(self, task: asyncio.Task[None]) -> None:
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def _launch(self, pool: Pool, i: int, data: bytes, history: Sequence[Message]) -> None:
        """Send request ``i`` now (its body ``data``, after ``history``)."""
        job, name = self.job, self.names[i]
        then = self._chain(pool, i, history) if i in self.follower else None
        sem, active, finished = self.sem, self.active, self.finished
        self._track(
            start_task(
                lambda: _one(
                    pool,
                    self.path,
                    name,
                    f"{job.id_prefix}{name}",
                    data,
                    self.requests[i],
                    job.request_timeout,
                    sem,
                    active,
                    finished,
                    then,
                )
            )
        )
        self.sent += 1

    async def _later(self, pool: Pool, i: int, at: float, history: Sequence[Message]) -> None:
        """Send turn ``i`` at ``at`` (perf_counter), after the conversation so far."""
        delay = at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if not self.reason:
            self._launch(pool, i, self.body(self.requests[i], history), history)

    def _chain(
        self, pool: Pool, i: int, history: Sequence[Message]
    ) -> Callable[[RequestRecord, Exchange], None]:
        """What follows the end of request ``i`` (sent after ``history``): the next turn, sent with the
        reply received, or recorded as failed with every turn after it when this one failed."""
        j = self.follower[i]
        requests = self.requests

        def then(record: RequestRecord, ex: Exchange) -> None:
            if self.reason:
                return
            if not record.success:
                self._unsent(
                    j, record.end_time, f"not sent: turn {requests[i].turn} of its conversation failed"
                )
                return
            prompt = requests[i].prompt
            assert isinstance(prompt, str)  # conversations send text
            after = (*history, ("user", prompt), ("assistant", ex.reply()))
            at = record.end_time + requests[j].think
            self.planned_turns[self.names[j]] = at
            self._track(start_task(lambda: self._later(pool, j, at, after)))

        return then

    def _unsent(self, j: int | None, t: float, why: str) -> None:
        """Record turn ``j`` and every turn after it as failed at ``t`` without sending them."""
        while j is not None:
            r = self.requests[j]
            self.finished.append(
                RequestRecord(
                    index=self.names[j],
                    send_time=t,
                    chunk_times=(),
                    output_tokens=None,
                    prompt_tokens=None,
                    input_len=r.input_len,
                    output_len=r.output_len,
                    success=False,
                    error=why,
                    end_time=t,
                    request_id=f"{self.job.id_prefix}{self.names[j]}",
                )
            )
            j = self.follower.get(j)

    async def _dispatch(self, pool: Pool) -> None:
        """Send each first turn (and single request) at its arrival time."""
        for i in self.order:
            delay = self.start + self.job.arrivals[i] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if self.reason:
                return
            self._launch(pool, i, self.bodies[i], ())

    async def _monitor(self, dispatcher: asyncio.Task[None]) -> None:
        """Ask the stop check about every 0.1 s; on a reason, cancel the dispatch and what is in flight."""
        assert self.stop is not None
        while not (dispatcher.done() and not self.tasks):
            await asyncio.sleep(0.1)
            snapshot = Progress(
                now=time.perf_counter(),
                planned=len(self.requests),
                sent=self.sent,
                finished=self.finished,
                in_flight=[InFlight(s.send, s.first, i) for i, s in self.active.items()],
            )
            why = self.stop(snapshot)
            if why:
                self.reason.append(why)
                dispatcher.cancel()
                for t in list(self.tasks):
                    t.cancel()
                return


def _followers(requests: Sequence[RequestSpec], names: Sequence[int]) -> dict[int, int]:
    """Position of each request that a later turn follows → that turn's position. Raises
    :class:`LoadError` for a turn that follows a request not in the run, or one already followed."""
    position = {name: i for i, name in enumerate(names)}
    out: dict[int, int] = {}
    for i, r in enumerate(requests):
        if r.follows is None:
            continue
        before = position.get(r.follows)
        if before is None or before == i or before in out:
            raise LoadError(
                f"request {names[i]} follows request {r.follows}, which is not its own turn in this run"
            )
        out[before] = i
    return out


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

    def warm(k: int, r: RequestSpec) -> asyncio.Task[None]:
        return start_task(
            lambda: _one(pool, path, -1 - k, f"{prefix}warmup-{k}", body(r), r, timeout, sem, {}, None)
        )

    await asyncio.gather(*[warm(k, r) for k, r in enumerate(prepare.warmup)])


async def _run_job(job: Job, stop: StopCheck | None, start_at: Callable[[], float]) -> RunResult:
    """A worker process's run of its share (module level: the worker process imports it)."""
    return await LoadRun(job, stop, start_at).run()


def run_requests(job: Job, *, stop: StopCheck | None = None, workers: int = 1) -> RunResult:
    """Synchronous :func:`run_requests_async`: runs ``job`` (:func:`load_job`) on its own (uvloop) event
    loop in the calling thread.

    ``workers > 1`` spreads the requests over that many processes (:mod:`autotune.load.workers`), each
    with its share of ``job.prepare``; then ``stop`` must be splittable over them (an
    :class:`~autotune.load.slo.EarlyStop`, or ``None``).
    """
    if workers > 1:
        if stop is not None and not isinstance(stop, ShareableStop):
            raise LoadError("with workers > 1 the stop check must be an EarlyStop (it is split per worker)")
        return run_workers(job, workers, stop, _run_job)
    return run_sync(lambda: LoadRun(job, stop, None).run())
