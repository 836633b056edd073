"""What a load run produced: one record per request, the run as a whole, and the state a stop check sees.

Times are ``time.perf_counter()`` seconds (CLOCK_MONOTONIC: shared by every process of a host, so the
records of several client processes merge on one clock).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

from autotune.errors import InvalidMeasurementError

Endpoint = Literal["completions", "chat"]
"""The OpenAI-compatible endpoint a workload streams from."""


@dataclass(frozen=True)
class RequestRecord:
    """What one request did.

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


@runtime_checkable
class ShareableStop(Protocol):
    """A stop check that can be split over client processes: each judges its share of the requests."""

    def __call__(self, progress: Progress) -> str | None:
        """Why to stop now, or ``None``."""
        ...

    def for_share(self, planned: int) -> ShareableStop:
        """A fresh check of the same kind for a share of ``planned`` requests."""
        ...


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
