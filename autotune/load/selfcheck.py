"""The load client's self-check: is a run's timing the server's, or the client's own lateness?

The client judges itself by its own witnesses: its CPU time and the lag of its event loop (a monitor task
that wakes every :data:`LAG_INTERVAL_S` and records how late it woke). What the server does is recorded,
not judged: vLLM merges the tokens of several engine steps into one chunk when its API server lags
(fewer chunks than ``usage.completion_tokens``: :attr:`~autotune.load.records.RunResult.chunks_per_token`)
and writes several events in one network read (zero gaps:
:attr:`~autotune.load.records.RunResult.server_bursts`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time

from autotune.load.records import RunResult

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
#: The stop reason of a worker stopped because another worker stopped the run.
STOPPED_BY_OTHER = "another worker stopped the run"


async def watch_lag(samples: list[float], interval: float = LAG_INTERVAL_S) -> None:
    """Append how late (seconds) each periodic wake-up of this event loop was, until cancelled."""
    perf = time.perf_counter
    due = perf() + interval
    while True:
        await asyncio.sleep(interval)
        now = perf()
        samples.append(now - due if now > due else 0.0)
        due = now + interval


def p99(values: list[float]) -> float:
    """Nearest-rank 99th percentile (0.0 for no values)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


def check_run(result: RunResult) -> tuple[str, ...]:
    """The self-check of a run: why its numbers would describe the client rather than the server.

    - client CPU above :data:`MAX_CPU_FRACTION` of the cores it had over the run;
    - the client's event loop late: lag p99 above :data:`MAX_LOOP_LAG_P99_S` (judged from
      :data:`MIN_LAG_SAMPLES` samples on), so chunk timestamps were taken late (the client fell behind);
    - more content chunks than ``usage.completion_tokens`` + :data:`CHUNK_SLACK` in over 1% of completed
      requests (the client mis-parsed the stream).

    Facts of the server, not problems (``server_bursts``, ``chunks_per_token``): fewer chunks than tokens
    (vLLM merges the tokens of several engine steps into one chunk when its API server lags) and zero gaps
    between chunks (several events in one read). ITL stays the gap between content chunks, as
    ``vllm bench serve`` measures it, so merged chunks show as longer gaps.
    """
    return (*cpu_problems(result), *timing_problems(result))


def cpu_problems(result: RunResult) -> tuple[str, ...]:
    """The CPU part of :func:`check_run` (judged per worker process in multi-process mode)."""
    wall = max(result.duration, 1e-9)
    if result.duration >= 1.0 and result.cpu_s > MAX_CPU_FRACTION * result.cpu_cores * wall:
        return (
            f"client CPU {result.cpu_s / wall / result.cpu_cores:.0%} of {result.cpu_cores:g} core(s) "
            f"over {wall:.1f} s (limit {MAX_CPU_FRACTION:.0%}): the client may have fallen behind",
        )
    return ()


def timing_problems(result: RunResult) -> tuple[str, ...]:
    """The loop-lag and chunk-count parts of :func:`check_run` (judged on the merged records)."""
    problems: list[str] = []
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


def with_problems(result: RunResult) -> RunResult:
    """``result`` with its self-check's problems filled in."""
    problems = check_run(result)
    return dataclasses.replace(result, problems=problems) if problems else result
