"""Multi-process mode of the load client: a few worker processes share one arrival schedule.

Request ``i`` goes to worker ``i % workers``. Each worker is a spawned process with its own (uvloop)
event loop, its share of the schedule and of ``max_concurrency``, and its share of a splittable stop
check (:class:`~autotune.load.records.ShareableStop`); all start at one ``perf_counter()`` instant (the
clock is shared by every process of a host) and their records are merged at the end. A stop in one
worker stops them all. For about 1,000 streams and more, where one event loop would fall behind.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, replace
from typing import Any

from autotune.errors import LoadError
from autotune.load.aio import run_sync
from autotune.load.engines import Engine
from autotune.load.records import ClientFigures, Endpoint, Preparation, Progress, RunResult, ShareableStop
from autotune.load.selfcheck import STOPPED_BY_OTHER, available_cores, cpu_problems, with_problems
from autotune.load.workload import RequestSpec

#: Seconds a worker process may take to start (import, event loop) before the run is abandoned.
WORKER_START_TIMEOUT = 60.0
#: Seconds a run may spend opening connections and warming them before it starts.
PREPARE_TIMEOUT_S = 60.0


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

    def share(self, worker: int, workers: int) -> Job:
        """Worker ``worker``'s share: every ``workers``-th request from ``worker`` on."""
        limit = self.max_concurrency
        if limit is not None:
            limit = max(1, limit // workers + (1 if worker < limit % workers else 0))
        picked = range(worker, len(self.requests), workers)
        return replace(
            self,
            requests=[self.requests[i] for i in picked],
            arrivals=[self.arrivals[i] for i in picked],
            indices=[self.indices[i] for i in picked],
            max_concurrency=limit,
            prepare=self.prepare.share(worker, workers),
        )


RunJob = Callable[
    [Job, Callable[[Progress], str | None] | None, Callable[[], float]], Coroutine[Any, Any, RunResult]
]
"""Runs a job on this process's event loop: (job, stop check, wait for the shared start) → result."""


class _SharedStop:
    """A worker's stop check: its own share's early stop, or any other worker having stopped."""

    def __init__(self, local: ShareableStop | None, event: Any) -> None:
        self._local = local
        self._event = event

    def __call__(self, progress: Progress) -> str | None:
        if self._event.is_set():
            return STOPPED_BY_OTHER
        why = self._local(progress) if self._local is not None else None
        if why:
            self._event.set()
        return why


def _worker_main(conn: Any, job: Job, local_stop: ShareableStop | None, event: Any, run: RunJob) -> None:
    """Entry point of a worker process: handshake, wait for the shared start, run, send the result."""

    def start_at() -> float:
        """Connections open and warm: tell the parent, and wait for the shared start."""
        conn.send("ready")
        return float(conn.recv())

    try:
        conn.send(run_sync(run(job, _SharedStop(local_stop, event), start_at)))
    except BaseException as exc:  # report every failure to the parent, which raises LoadError
        conn.send(f"{type(exc).__name__}: {exc}")
    finally:
        conn.close()


def run_workers(job: Job, workers: int, stop: ShareableStop | None, run: RunJob) -> RunResult:
    """Run ``job`` over ``workers`` processes with ``run`` (a module-level coroutine function)."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    event = ctx.Event()
    shares = [job.share(w, workers) for w in range(workers)]
    procs = []
    conns = []
    try:
        for share in shares:
            parent, child = ctx.Pipe()
            local = stop.for_share(len(share.requests)) if stop is not None else None
            proc = ctx.Process(target=_worker_main, args=(child, share, local, event, run), daemon=True)
            proc.start()
            child.close()
            procs.append(proc)
            conns.append(parent)
        for conn in conns:
            if not conn.poll(WORKER_START_TIMEOUT + PREPARE_TIMEOUT_S) or conn.recv() != "ready":
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
    return merge(results, start_at, len(job.requests))


def merge(results: list[RunResult], start: float, planned: int) -> RunResult:
    """One run from the workers' runs: records merged in order; each worker's CPU judged against its one
    core, and the client as a whole (its CPU against the cores the processes may share, its waits, its
    late chunks) and the chunk counts judged on the merged figures."""
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
    merged = with_problems(merged)
    problems = [p for res in results for p in cpu_problems(res.client, res.duration)]
    problems = list(dict.fromkeys([*problems, *merged.problems]))
    return replace(merged, problems=tuple(problems))
