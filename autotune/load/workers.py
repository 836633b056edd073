"""Multi-process mode of the load client: a few worker processes share one arrival schedule.

Request ``i`` goes to worker ``i % workers`` (a conversation's turns go with its first turn, the
conversations dealt out in turn). Each worker is a spawned process with its own (uvloop)
event loop, its share of the schedule and of ``max_concurrency``, and its share of a splittable stop
check (:class:`~autotune.load.records.ShareableStop`); all start at one ``perf_counter()`` instant (the
clock is shared by every process of a host) and their records are merged at the end. A stop in one
worker stops them all; a share whose judged requests are done keeps up its drain until every share is done.
For about 1,000 streams and more, where one event loop would fall behind.
"""

from __future__ import annotations

import contextlib
import math
import signal
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

from autotune.errors import LoadError
from autotune.inputs.slo_terms import MetricKey
from autotune.interrupts import shielded
from autotune.load.aio import run_sync
from autotune.load.cpus import available_cores
from autotune.load.engines import Engine
from autotune.load.records import (
    ClientFigures,
    Endpoint,
    Finished,
    Preparation,
    Progress,
    RunResult,
    ShareableStop,
)
from autotune.load.request import RequestSpec
from autotune.load.selfcheck import JUDGED, STOPPED_BY_OTHER, cpu_problems, cpu_warnings, with_problems

#: Seconds a worker process may take to start (import, event loop) before the run is abandoned.
WORKER_START_TIMEOUT = 60.0
#: Seconds a run may spend opening connections and warming them before it starts.
PREPARE_TIMEOUT_S = 60.0
#: Seconds the workers of a run that ended get to stop on their own, before they are terminated.
WORKER_STOP_TIMEOUT = 5.0
#: Seconds a worker gets, beyond the longest its run can take (:func:`run_limit`), to send its records.
RESULT_SLACK_S = 30.0


@dataclass(frozen=True)
class Job:
    """Everything one run needs, picklable for a worker process."""

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
    headers: dict[str, str]
    id_prefix: str
    prepare: Preparation
    judged: tuple[MetricKey, ...] = JUDGED
    """The statistics whose error bound voids the run (the others are warnings)."""

    def share(self, worker: int, workers: int) -> Job:
        """Worker ``worker``'s share: every ``workers``-th request from ``worker`` on; a later turn of a
        conversation goes where its first turn goes (the first turns are dealt out in turn)."""
        limit = self.max_concurrency
        if limit is not None:
            limit = max(1, limit // workers + (1 if worker < limit % workers else 0))
        picked = [i for i, w in enumerate(self._workers(workers)) if w == worker]
        return replace(
            self,
            requests=[self.requests[i] for i in picked],
            arrivals=[self.arrivals[i] for i in picked],
            indices=[self.indices[i] for i in picked],
            max_concurrency=limit,
            prepare=self.prepare.share(worker, workers),
        )

    def _workers(self, workers: int) -> list[int]:
        """The worker of each request: first turns (and single requests) in turn, later turns with the turn
        they follow."""
        position = {name: i for i, name in enumerate(self.indices)}
        out: list[int] = []
        dealt = 0
        for r in self.requests:
            before = position.get(r.follows) if r.follows is not None else None
            if before is not None and before < len(out):
                out.append(out[before])
            else:
                out.append(dealt % workers)
                dealt += 1
        return out


RunJob = Callable[
    [Job, Callable[[Progress], str | None] | None, Callable[[], float]], Coroutine[Any, Any, RunResult]
]
"""Runs a job on this process's event loop: (job, stop check, wait for the shared start) → result."""


class _SharedStop:
    """A worker's stop check: its own share's early stop, or any other worker having stopped. A share
    whose judged requests are done keeps sending its drain until every share's are (each share sets its
    own event of ``done`` then): stopped alone, it would lower the load that the other shares' last judged
    requests are measured under.

    Only events cross the processes, no shared ``Value``: a ``Value`` lives on multiprocessing's heap,
    whose allocation and free are not atomic, and an interrupt raised in either (a signal, or its
    redelivery while the value's finalizer frees it) left that heap inconsistent for every later run of
    the process ("pop from empty list")."""

    def __init__(self, local: ShareableStop | None, event: Any, done: Sequence[Any], share: int) -> None:
        self._local = local
        self._event = event
        self._done = tuple(done)
        self._share = share

    def __call__(self, progress: Progress) -> str | None:
        if self._event.is_set():
            return STOPPED_BY_OTHER
        why = self._local(progress) if self._local is not None else None
        if why is None:
            return None
        if not isinstance(why, Finished):
            self._event.set()
            return why
        self._done[self._share].set()
        return why if all(done.is_set() for done in self._done) else None


def run_limit(job: Job) -> float:
    """The most seconds after the shared start that ``job`` can take however slow the server, each
    request being cut at ``request_timeout`` once it has a concurrency slot: the last first turn's arrival,
    plus one timeout for each turn of the longest conversation (with a concurrency limit, for each round of
    ``ceil(requests / limit)`` slots taken in turn) and the think times of the longest conversation."""
    if not job.requests:
        return 0.0
    position = {name: i for i, name in enumerate(job.indices)}
    think: list[float] = []
    for r in job.requests:  # a later turn follows one before it in the run (LoadError otherwise)
        before = position.get(r.follows) if r.follows is not None else None
        think.append(r.think + (think[before] if before is not None and before < len(think) else 0.0))
    first = [job.arrivals[i] for i, r in enumerate(job.requests) if r.follows is None]
    turns = max(r.turn for r in job.requests)
    rounds = math.ceil(len(job.requests) / job.max_concurrency) if job.max_concurrency else turns
    return max(first, default=0.0) + rounds * job.request_timeout + max(think)


def _worker_main(conn: Any, job: Job, stop: _SharedStop, run: RunJob) -> None:
    """Entry point of a worker process: handshake, wait for the shared start, run, send the result.

    A parent that stopped waiting (a signal stopped the study: it closed its ends of the pipes and tells
    the workers to stop) is not an error to print: the worker just ends. SIGINT stays blocked in a worker
    all its life (it is started with SIGINT blocked: :func:`_workers_started`): a Ctrl-C at a terminal
    reaches the whole process group, and the parent stops its workers itself."""

    def start_at() -> float:
        """Connections open and warm: tell the parent, and wait for the shared start."""
        conn.send("ready")
        return float(conn.recv())

    result: object
    try:
        result = run_sync(lambda: run(job, stop, start_at))
    except BaseException as exc:  # report every failure to the parent, which raises LoadError
        result = f"{type(exc).__name__}: {exc}"
    try:
        with contextlib.suppress(OSError):  # the parent is gone or stopped listening: nobody to tell
            conn.send(result)
    finally:
        conn.close()


@contextlib.contextmanager
def _workers_started() -> Iterator[None]:
    """Starting worker processes: a signal is held until the block ends (a worker started is always
    recorded, so it is always stopped), and SIGINT is blocked in this thread meanwhile, so that the
    workers, which inherit the mask, never get a KeyboardInterrupt (a signal that arrives meanwhile is
    delivered to this process when the block ends)."""
    with shielded():
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            yield
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def _await_ready(conn: Any) -> None:
    """Wait for a worker's ``ready``; a worker that failed before it sent why instead (LoadError)."""
    if not conn.poll(WORKER_START_TIMEOUT + PREPARE_TIMEOUT_S):
        raise LoadError(f"a load worker did not start within {WORKER_START_TIMEOUT + PREPARE_TIMEOUT_S:g} s")
    got = conn.recv()
    if got != "ready":
        raise LoadError(f"a load worker failed: {got}")


def run_workers(job: Job, workers: int, stop: ShareableStop | None, run: RunJob) -> RunResult:
    """Run ``job`` over ``workers`` processes with ``run`` (a module-level coroutine function)."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    event = ctx.Event()
    done = [ctx.Event() for _ in range(workers)]
    shares = [job.share(w, workers) for w in range(workers)]
    procs: list[Any] = []
    conns: list[Any] = []
    try:
        for w, share in enumerate(shares):
            local = stop.for_share(share.indices) if stop is not None else None
            shared = _SharedStop(local, event, done, w)
            with _workers_started():
                parent, child = ctx.Pipe()
                conns.append(parent)
                proc = ctx.Process(target=_worker_main, args=(child, share, shared, run), daemon=True)
                proc.start()
                procs.append(proc)
                child.close()
        for conn in conns:
            _await_ready(conn)
        start_at = time.perf_counter() + 0.05
        for conn in conns:
            conn.send(start_at)
        limit = max(run_limit(share) for share in shares) + RESULT_SLACK_S
        results: list[RunResult] = []
        for conn in conns:
            if not conn.poll(max(0.0, start_at + limit - time.perf_counter())):
                raise LoadError(
                    f"a load worker sent no result within {limit:.0f} s of the run's start (the longest its "
                    f"requests can take, each cut at {job.request_timeout:g} s, plus {RESULT_SLACK_S:g} s): "
                    "it is stuck; the run is abandoned"
                )
            got = conn.recv()
            if not isinstance(got, RunResult):
                raise LoadError(f"a load worker failed: {got}")
            results.append(got)
    except (EOFError, OSError) as exc:
        raise LoadError(f"a load worker died: {exc}") from exc
    finally:
        with shielded():  # a repeated interrupt must not leave a worker sending load behind
            _stop_workers(procs, conns, event)
    return merge(results, start_at, len(job.requests), job.judged)


def _stop_workers(procs: list[Any], conns: list[Any], event: Any) -> None:
    """End a run's workers: those still running are told to stop (the shared stop) and their pipes are
    closed; any still alive after :data:`WORKER_STOP_TIMEOUT` is terminated. The shared objects (``event``,
    the done shares' events) stay alive until every worker is gone: a worker still starting would fail to
    find them, and print why."""
    event.set()
    for conn in conns:
        conn.close()
    deadline = time.monotonic() + WORKER_STOP_TIMEOUT
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout=WORKER_STOP_TIMEOUT)


def merge(
    results: list[RunResult], start: float, planned: int, judged: Sequence[MetricKey] = JUDGED
) -> RunResult:
    """One run from the workers' runs: records merged in order; each worker's CPU judged against its one
    core (a warning where its chunks are bounded), and the client as a whole (its CPU against the cores
    the processes may share, its waits, its late chunks) and the chunk counts judged on the merged
    figures."""
    records = tuple(sorted((r for res in results for r in res.records), key=lambda r: r.index))
    reasons = [res.stop_reason for res in results if res.stop_reason]
    own = [r for r in reasons if r != STOPPED_BY_OTHER]
    figures = ClientFigures.merged([res.client for res in results])
    figures = replace(figures, cores=min(float(len(results)), available_cores()))
    merged = RunResult(
        records=records,
        start=start,
        end=max(res.end for res in results),
        planned=planned,
        stopped_early=any(res.stopped_early for res in results),
        stop_reason=(own or reasons)[0] if reasons else None,
        client=figures,
        wall_start=min(res.wall_start for res in results),
    )
    merged = with_problems(merged, judged)
    problems = [p for res in results for p in cpu_problems(res.client, res.duration)]
    problems = list(dict.fromkeys([*problems, *merged.problems]))
    warnings = [w for res in results for w in cpu_warnings(res.client, res.duration)]
    warnings = list(dict.fromkeys([*warnings, *merged.warnings]))
    return replace(merged, problems=tuple(problems), warnings=tuple(warnings))
