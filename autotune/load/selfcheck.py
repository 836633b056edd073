"""The load client's self-check: is a run's timing the server's, or the client's own lateness?

A chunk's time is when the client read it, so a client that reads late reports the server as slow. The
client cannot see when a chunk reached its socket, so it watches itself while it runs
(:class:`Witness`) and judges the run afterwards (:func:`check_run`):

* **chunks read late**: the raw engine reads with ``recvmsg`` and times each chunk when its read's newest
  bytes reached the socket (the kernel's receive time): a chunk read alone is timed exactly, however late
  the client read it. What stays uncertain is how much earlier the older chunks of a read that brought
  several arrived, and the engine bounds that itself (:mod:`autotune.load._rawhttp`): they arrived after
  the connection's last read that drained it and after the pool's last sweep of every socket, so each
  carries that much allowance (:attr:`RequestRecord.chunk_late`), however the loop was delayed. The
  aiohttp engine reads without the kernel's times: a monitor task wakes every
  :data:`READ_TIMED_LAG_INTERVAL_S` and records how late it woke, and each of its chunks is charged the
  stall of the wake-ups around its read (an estimate from a timer, not a bound: a socket can wait longer
  than a timer). Each statistic the caller judges (a study's SLO terms and latency objectives; TTFT p95,
  ITL p99 and TPOT p99 for the bare client) and each of :data:`REPORTED` is then bounded from what the
  allowances permit (:func:`lateness_shifts`): a judged one whose truth may lie more than
  :data:`MAX_SHIFT` from the reported value voids the run, another one is a warning. So the verdict weighs
  lateness by the chunks it delayed and by what they can do to the numbers that decide, and judges runs
  of any length;
* **starved by the scheduler**: the kernel's per-thread ``schedstat`` gives the time the client's thread
  was runnable but not running (a neighbour on its core, a low priority, a CPU quota, VM steal); a share
  of the run above :data:`MAX_RUNQUEUE_SHARE`, or a mean wait per wake-up above
  :data:`MAX_RUNQUEUE_WAIT_S`, voids a run whose chunks were timed at their read (aiohttp): chunks timed
  by the kernel are exact however long the client waited to run;
* **sent late**: requests sent later than their arrival times by more than :data:`MAX_SEND_DELAY_S` (or
  a quarter of the mean gap between arrivals) on average, or a schedule stretched by more than
  :data:`MAX_SEND_STRETCH`: the offered load was not the one asked for (a starved or busy client
  dispatches late);
* **busy**: client CPU above :data:`MAX_CPU_FRACTION` of the cores it may really use (its CPU affinity and
  its own cgroup's CPU quota, :mod:`autotune.load.cpus`; at most one per worker process). Where every
  chunk's lateness is bounded by the engine (the raw engine), a busy client shows in that bound and in
  its sends, so CPU is a warning (:attr:`RunResult.warnings`); with the aiohttp engine it voids the run;
* **mis-parsed**: more content chunks than ``usage.completion_tokens`` + :data:`CHUNK_SLACK`.

The garbage collector is frozen and disabled while a run measures (:class:`Witness`): a full collection
stalls every stream at once. What the server does is recorded, not judged: vLLM merges the tokens of
several engine steps into one chunk when its API server lags (fewer chunks than tokens) and writes several
events in one network read (zero gaps).
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import dataclasses
import gc
import math
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from autotune.inputs.slo_terms import MetricKey
from autotune.load.cpus import available_cores
from autotune.load.metrics import Dist, request_values
from autotune.load.records import ClientFigures, RequestRecord, RunResult

#: Client CPU above this fraction of the cores it may use means the client, not the server, was measured.
MAX_CPU_FRACTION = 0.7
#: Seconds between two wake-ups of the event-loop lag monitor (with the raw engine, whose chunks carry
#: their own bound, the monitor's figures are only reported).
LAG_INTERVAL_S = 0.01
#: ... with the aiohttp engine, whose every chunk is timed at its read: a denser monitor, every stall
#: charged (a task waiting its turn after its data arrived shows as lateness of a few hundred µs).
READ_TIMED_LAG_INTERVAL_S = 0.002
#: A chunk that may be later than this counts as late in the figures (``late_chunks``); with the raw
#: engine's monitor, a stall shorter than this is not reported (an idle uvloop monitor wakes at most 0.9 ms
#: late on this project's machines: its timers' 1 ms resolution).
LATE_FLOOR_S = 0.001
#: A judged statistic whose truth may lie further than this from the reported value voids a run.
MAX_SHIFT = 0.05
#: The statistics every run bounds and records, judged or not (the ones a report shows; TPOT is robust to
#: late middles).
REPORTED: tuple[MetricKey, ...] = (
    MetricKey("ttft", "p95"),
    MetricKey("itl", "p99"),
    MetricKey("tpot", "p99"),
)
#: What a run judges when its caller names nothing (the bare client, the benchmarks): every reported one.
#: A probe judges what its study does (:func:`judged_statistics`).
JUDGED = REPORTED
#: Runnable-but-waiting time above this share of the run means a neighbour or a quota starved the client.
MAX_RUNQUEUE_SHARE = 0.05
#: A mean wait per wake-up above this (seconds) means each chunk was read that much late.
MAX_RUNQUEUE_WAIT_S = 0.0005
#: A run's mean send delay (send time - planned arrival) above this, or a quarter of the mean gap between
#: arrivals, whichever is more, means it did not offer the load it was asked to.
MAX_SEND_DELAY_S = 0.005
#: ... as does a schedule whose sends span this much longer than planned.
MAX_SEND_STRETCH = 0.05
#: Runs shorter than this are not judged on CPU or scheduler waits (start-up costs and a few wake-ups
#: dominate a short run; its late chunks are still judged).
MIN_CPU_JUDGED_S = 1.0
#: Extra content chunks allowed beyond ``usage.completion_tokens`` (chat's role chunk, an empty last chunk).
CHUNK_SLACK = 2
#: The stop reason of a worker stopped because another worker stopped the run.
STOPPED_BY_OTHER = "another worker stopped the run"


def _schedstat() -> tuple[int, int] | None:
    """(ns runnable but waiting, wake-ups) of the calling thread from the kernel, or None."""
    try:
        fields = Path(f"/proc/self/task/{threading.get_native_id()}/schedstat").read_text().split()
        return int(fields[1]), int(fields[2])
    except (OSError, ValueError, IndexError):
        return None


class Witness:
    """Watches the client's own thread and event loop during a run: CPU, run-queue waits, loop lag, GC.

    ``start`` (in the loop's thread) freezes and disables the garbage collector; ``stop`` restores it and
    returns what was seen. :meth:`watch_lag` is the lag monitor task. ``kernel_times``: the engine times
    chunks by the kernel (raw); otherwise the monitor is denser and charges every stall.
    """

    def __init__(self, kernel_times: bool = True) -> None:
        self.interval = LAG_INTERVAL_S if kernel_times else READ_TIMED_LAG_INTERVAL_S
        self.floor = LATE_FLOOR_S if kernel_times else 0.0
        self.lags: list[tuple[float, float]] = []
        """(wake-up time, lateness) of every wake-up of the lag monitor."""
        self._cpu0 = 0.0
        self._sched0: tuple[int, int] | None = None
        self._gc_was_enabled = True
        self._gc_held = False
        """``start`` disabled the collector and ``release`` has not given it back yet."""
        self._gc_runs = 0
        self._gc_pause = 0.0
        self._gc_started = 0.0

    def _on_gc(self, phase: str, _info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        else:
            self._gc_runs += 1
            self._gc_pause += time.perf_counter() - self._gc_started

    def start(self) -> None:
        """Take the starting readings; freeze the heap and disable the collector for the run."""
        gc.collect()
        self._gc_was_enabled = gc.isenabled()
        self._gc_held = True
        gc.freeze()
        gc.disable()
        gc.callbacks.append(self._on_gc)
        self._cpu0 = time.thread_time()
        self._sched0 = _schedstat()

    def release(self) -> None:
        """Give the collector back as ``start`` found it (``stop`` does; a run that ends by an exception
        calls it in its cleanup: a collector left off stays off for the process). Safe to call again."""
        if not self._gc_held:
            return
        self._gc_held = False
        with contextlib.suppress(ValueError):
            gc.callbacks.remove(self._on_gc)
        gc.unfreeze()
        if self._gc_was_enabled:
            gc.enable()

    def stop(
        self, wall_s: float, records: Sequence[RequestRecord], planned: dict[int, float] | None = None
    ) -> tuple[ClientFigures, tuple[RequestRecord, ...]]:
        """The run's figures, and ``records`` (this process's) with each chunk's lateness attached.

        ``planned`` maps a request's index to when it was to be sent (perf_counter), for requests paced
        by their arrival time alone."""
        cpu = time.thread_time() - self._cpu0
        sched = _schedstat()
        self.release()
        wait_s, slices = 0.0, 0
        if sched is not None and self._sched0 is not None:
            wait_s = (sched[0] - self._sched0[0]) / 1e9
            slices = sched[1] - self._sched0[1]
        times = [t for t, _ in self.lags]
        lags = [lag for _, lag in self.lags]
        marked = tuple(_with_lateness(r, times, lags, self.floor, self.interval) for r in records)
        late = [x for r in marked for x in r.chunk_late]
        timed = [r for r in marked if r.success and r.chunk_times]
        delay, gap, stretch = send_delays(marked, planned or {})
        figures = ClientFigures(
            wall_s=wall_s,
            cpu_s=cpu,
            cores=min(1.0, available_cores()),
            runqueue_wait_s=wait_s,
            wakeups=slices,
            lag_samples=len(lags),
            lag_p99_s=_p99(lags),
            lag_max_s=max(lags, default=0.0),
            chunks=sum(r.chunks for r in marked),
            late_chunks=sum(1 for x in late if x > LATE_FLOOR_S),
            late_threshold_s=LATE_FLOOR_S,
            chunk_lag_p99_s=_p99(late),
            send_wait_max_s=max((r.send_wait for r in marked), default=0.0),
            read_wait_p99_s=_p99([w for r in marked for w in r.chunk_waits]),
            kernel_timed=bool(timed) and all(len(r.chunk_waits) == len(r.chunk_times) for r in timed),
            send_delay_mean_s=delay,
            send_gap_s=gap,
            send_stretch=stretch,
            gc_collections=self._gc_runs,
            gc_pause_s=self._gc_pause,
        )
        return figures, marked

    async def watch_lag(self) -> None:
        """Record how late (seconds) each periodic wake-up of this event loop was, until cancelled.

        Without the kernel's times, a wake-up also measures one turn of the loop's ready queue (a yield
        and back): a task woken by arriving data waits that long before it reads the data."""
        interval = self.interval
        turn = self.floor == 0.0
        perf = time.perf_counter
        due = perf() + interval
        append = self.lags.append
        while True:
            await asyncio.sleep(interval)
            now = perf()
            lag = now - due if now > due else 0.0
            if turn:
                await asyncio.sleep(0)
                lag += perf() - now
            append((now, lag))
            due = now + interval


def _with_lateness(
    record: RequestRecord,
    times: list[float],
    lags: list[float],
    floor: float = LATE_FLOOR_S,
    interval: float = LAG_INTERVAL_S,
) -> RequestRecord:
    """``record`` with how much earlier each chunk may have arrived than its time says (empty: none).

    A record the raw engine timed (its ``chunk_waits``) carries its own bound (``chunk_late``) and is
    returned as it is. Without the kernel's times (aiohttp) every chunk may be as late as a loop stall:
    the lateness of the monitor's first wake-up after the read, or the last before it, when above
    ``floor``.
    """
    t = record.chunk_times
    if not t or len(record.chunk_waits) == len(t):
        return record

    def stall(read: float) -> float:
        # The monitor's wake-ups on either side of the read: after a stall the loop runs its due timers
        # first and its reads next (libuv's order), so the wake-up that saw the stall may come just before.
        k = bisect.bisect_left(times, read)
        lag = lags[k] if k < len(lags) else 0.0
        if k > 0 and read - times[k - 1] <= interval:
            lag = max(lag, lags[k - 1])
        return lag if lag > floor else 0.0

    late = [stall(at) for at in t]
    if not any(late):
        return dataclasses.replace(record, chunk_late=()) if record.chunk_late else record
    return dataclasses.replace(record, chunk_late=tuple(late))


def judged_statistics(keys: Sequence[MetricKey]) -> tuple[MetricKey, ...]:
    """The distinct statistics of ``keys`` (SLO terms, objectives: anything with a metric and a
    statistic), in order, as plain keys: what a run is voided over."""
    return tuple(dict.fromkeys(MetricKey(k.metric, k.statistic) for k in keys))


def lateness_shifts(
    records: Sequence[RequestRecord], keys: Sequence[MetricKey] = REPORTED
) -> tuple[tuple[str, float], ...]:
    """For each statistic of ``keys``, how far the truth may lie from the reported value (relative), given
    when chunks may have been read late.

    A chunk read at ``t`` with lateness ``L`` arrived somewhere in ``[t - L, t]``. So a gap may truly have
    been up to its later chunk's lateness shorter or its earlier chunk's lateness longer; a TTFT (and an
    E2EL) up to its first (last) chunk's lateness and its request's write (``send_wait``) shorter; a TPOT
    moves with its first and last chunks. The statistic is computed with every uncertain value at the low
    end of its range and at the high end; the larger distance from the reported value, relative to the
    truth's lower bound, is the shift.
    """
    done = [r for r in records if r.success and r.chunk_times]
    ranges: dict[str, tuple[list[float], list[float], list[float]]] = {}
    out = []
    for key in keys:
        if key.metric not in ranges:
            ranges[key.metric] = _ranges(done, key.metric)
        values, lows, highs = ranges[key.metric]
        if values == lows == highs:
            out.append((key.key, 0.0))
            continue
        reported, low, high = (Dist.of(v).get(key.statistic) for v in (values, lows, highs))
        shift = max(reported - low, high - reported) / low if low > 0 else (0.0 if high <= 0 else math.inf)
        out.append((key.key, shift))
    return tuple(out)


def _ranges(records: Sequence[RequestRecord], metric: str) -> tuple[list[float], list[float], list[float]]:
    """Each reported value of ``metric`` with the range the truth may lie in (lateness of its chunks)."""
    values: list[float] = []
    lows: list[float] = []
    highs: list[float] = []
    for r in records:
        late = r.chunk_late or (0.0,) * len(r.chunk_times)
        t = r.chunk_times
        if metric == "itl":
            for k in range(1, len(t)):
                gap = t[k] - t[k - 1]
                values.append(gap)
                lows.append(max(0.0, gap - late[k]))
                highs.append(gap + late[k - 1])
        elif metric in ("ttft", "e2el"):
            value, chunk = (t[0], late[0]) if metric == "ttft" else (t[-1], late[-1])
            value -= r.send_time
            values.append(value)
            lows.append(max(0.0, value - chunk - r.send_wait))
            highs.append(value)
        elif r.tokens > 1:
            tpot = request_values(r)["tpot"]
            n = r.tokens - 1
            values.append(tpot)
            lows.append(max(0.0, tpot - late[-1] / n))
            highs.append(tpot + late[0] / n)
    return values, lows, highs


def _p99(values: list[float]) -> float:
    """Nearest-rank 99th percentile (0.0 for no values)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


def check_run(result: RunResult, judged: Sequence[MetricKey] = JUDGED) -> tuple[str, ...]:
    """Why ``result``'s numbers would describe the client rather than the server (empty: trust them), when
    the ``judged`` statistics are what its caller reads."""
    return _problems(bounded(result, judged))


def check_warnings(result: RunResult, judged: Sequence[MetricKey] = JUDGED) -> tuple[str, ...]:
    """What is worth knowing about ``result``'s client but does not void it (a busy client whose every
    chunk's lateness is bounded: :func:`cpu_warnings`; a statistic outside ``judged`` that lateness may
    move: :func:`lateness_warnings`)."""
    return _warnings(bounded(result, judged))


def bounded(result: RunResult, judged: Sequence[MetricKey] = JUDGED) -> RunResult:
    """``result`` with its lateness bounds filled in (:attr:`ClientFigures.shifts`, for ``judged`` and
    :data:`REPORTED`) and the statistics that void it named (:attr:`ClientFigures.judged`)."""
    keys = judged_statistics([*judged, *REPORTED])
    client = dataclasses.replace(
        result.client,
        shifts=lateness_shifts(result.records, keys),
        judged=tuple(k.key for k in judged_statistics(judged)),
    )
    return dataclasses.replace(result, client=client)


def _problems(result: RunResult) -> tuple[str, ...]:
    return (
        *client_problems(result.client, result.duration),
        *lateness_problems(result),
        *count_problems(result),
    )


def _warnings(result: RunResult) -> tuple[str, ...]:
    return (*cpu_warnings(result.client, result.duration), *lateness_warnings(result))


def _busy(figures: ClientFigures, duration: float) -> tuple[str, ...]:
    """Client CPU above :data:`MAX_CPU_FRACTION` of the cores it could use (runs of a second and more)."""
    wall = max(duration, 1e-9)
    cores = max(figures.cores, 1e-9)
    if duration >= MIN_CPU_JUDGED_S and figures.cpu_s > MAX_CPU_FRACTION * cores * wall:
        return (
            f"client CPU {figures.cpu_s / wall / cores:.0%} of {cores:g} core(s) over {wall:.1f} s "
            f"(limit {MAX_CPU_FRACTION:.0%}): the client may have fallen behind",
        )
    return ()


def cpu_problems(figures: ClientFigures, duration: float) -> tuple[str, ...]:
    """A busy client (:func:`_busy`) voids a run whose chunks are timed at their read (aiohttp): nothing
    else bounds how late it read them."""
    return () if figures.kernel_timed else _busy(figures, duration)


def cpu_warnings(figures: ClientFigures, duration: float) -> tuple[str, ...]:
    """A busy client (:func:`_busy`) whose chunks the raw engine timed and bounded is a warning: its
    lateness is in each chunk's allowance (so in the error bound), its late sends in the send check."""
    if not figures.kernel_timed:
        return ()
    return tuple(f"{p}; a warning: every chunk's lateness is bounded" for p in _busy(figures, duration))


def client_problems(figures: ClientFigures, duration: float) -> tuple[str, ...]:
    """The client's own witnesses judged: CPU (aiohttp), scheduler waits (aiohttp), sends."""
    problems = list(cpu_problems(figures, duration))
    wall = max(duration, 1e-9)
    share = figures.runqueue_wait_s / wall
    per_wakeup = figures.runqueue_wait_s / figures.wakeups if figures.wakeups else 0.0
    judged = duration >= MIN_CPU_JUDGED_S  # a short run's share and mean rest on a few wake-ups
    exact = figures.kernel_timed  # chunks bounded by the engine do not move when the client waits to run
    if judged and not exact and (share > MAX_RUNQUEUE_SHARE or per_wakeup > MAX_RUNQUEUE_WAIT_S):
        problems.append(
            f"client starved: its thread waited {figures.runqueue_wait_s * 1e3:.0f} ms to run "
            f"({share:.1%} of {wall:.1f} s, {per_wakeup * 1e3:.2f} ms per wake-up; limits "
            f"{MAX_RUNQUEUE_SHARE:.0%}, {MAX_RUNQUEUE_WAIT_S * 1e3:g} ms): another process or a CPU "
            "quota took its core"
        )
    limit = max(MAX_SEND_DELAY_S, figures.send_gap_s / 4)
    if figures.send_delay_mean_s > limit or figures.send_stretch > MAX_SEND_STRETCH:
        problems.append(
            f"client sent late: on average {figures.send_delay_mean_s * 1e3:.1f} ms after the planned "
            f"arrivals (limit {limit * 1e3:.1f} ms), the schedule stretched by {figures.send_stretch:.1%} "
            f"(limit {MAX_SEND_STRETCH:.0%}): the offered load was not the one asked for"
        )
    return tuple(problems)


def send_delays(records: Sequence[RequestRecord], planned: dict[int, float]) -> tuple[float, float, float]:
    """(mean delay of a send, mean gap between planned sends, how much longer the sends spanned than
    planned) over ``records`` whose planned time is known (``planned``: index → perf_counter time; requests
    held back by a concurrency limit are not judged: their time is the limit's).

    A send's delay runs from when it could have gone at the earliest: its planned time, or the send before
    it when that was later. Requests planned at one instant (a burst) are written one after another, and
    only the client's own slowness between them counts, not the queue the burst makes by itself."""
    timed = sorted((planned[r.index], r.send_time) for r in records if r.index in planned)
    if len(timed) < 2:
        return 0.0, 0.0, 0.0
    delays = []
    previous = -math.inf
    for plan, sent in timed:
        delays.append(max(0.0, sent - max(plan, previous)))
        previous = max(previous, sent)
    mean = math.fsum(delays) / len(delays)
    timed = [(sent, plan) for plan, sent in timed]
    plans = sorted(plan for _, plan in timed)
    sends = sorted(sent for sent, _ in timed)
    span = plans[-1] - plans[0]
    stretch = (sends[-1] - sends[0]) / span - 1.0 if span > 0 else 0.0
    return mean, span / (len(timed) - 1), max(0.0, stretch)


def lateness_problems(result: RunResult) -> tuple[str, ...]:
    """A judged statistic (:attr:`ClientFigures.judged`) whose truth chunks read late may move by more than
    :data:`MAX_SHIFT`."""
    return _lateness(result.client, judged=True)


def lateness_warnings(result: RunResult) -> tuple[str, ...]:
    """A statistic recorded but not judged whose bound exceeds :data:`MAX_SHIFT`: a warning, since nothing
    the caller decides reads it (a study whose SLO terms and objectives leave it out)."""
    return _lateness(result.client, judged=False)


def _lateness(figures: ClientFigures, judged: bool) -> tuple[str, ...]:
    """The statistics (judged ones, or the others) whose bound exceeds :data:`MAX_SHIFT`, in one line."""
    moved = [(k, v) for k, v in figures.shifts if v > MAX_SHIFT and (k in figures.judged) == judged]
    if not moved:
        return ()
    if judged:
        tail = ": the client read chunks late or sent late (it fell behind)"
    else:
        tail = "; a warning: no SLO term or objective judges " + ("it" if len(moved) == 1 else "them")
    shown = ", ".join(f"{key} by {shift:,.1%}" for key, shift in moved)
    return (f"{_late_reads(figures)}, so the truth may differ: {shown} (limit {MAX_SHIFT:.0%}){tail}",)


def _late_reads(figures: ClientFigures) -> str:
    """What the client's reads were like: how many chunks may be late, its loop's lag, its writes."""
    sends = (
        f"; a request's write took up to {figures.send_wait_max_s * 1e3:.1f} ms"
        if figures.send_wait_max_s > LATE_FLOOR_S
        else ""
    )
    return (
        f"{figures.late_chunks:,} of {figures.chunks:,} chunks were read more than {LATE_FLOOR_S * 1e3:g} ms "
        f"late (event-loop lag p99 {figures.lag_p99_s * 1e3:.1f} ms, max {figures.lag_max_s * 1e3:.1f} ms"
        f"{sends})"
    )


def count_problems(result: RunResult) -> tuple[str, ...]:
    """More content chunks than ``usage.completion_tokens`` in over 1 % of requests: mis-parsed."""
    counted = [r for r in result.records if r.success and r.output_tokens is not None]
    bad = [r for r in counted if r.chunks > r.tokens + CHUNK_SLACK]
    if counted and len(bad) > max(0, math.floor(0.01 * len(counted))):
        r = bad[0]
        return (
            f"{len(bad)} of {len(counted)} requests have more content chunks than usage.completion_tokens "
            f"(e.g. request {r.index}: {r.chunks} chunks, {r.tokens} tokens): the stream was mis-parsed",
        )
    return ()


def with_problems(result: RunResult, judged: Sequence[MetricKey] = JUDGED) -> RunResult:
    """``result`` with its lateness bounds (:func:`bounded`) and its self-check's problems and warnings
    filled in: only the ``judged`` statistics' bounds void it, the others' are warnings."""
    result = bounded(result, judged)
    return dataclasses.replace(result, problems=_problems(result), warnings=_warnings(result))
