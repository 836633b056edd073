"""What a load run produced: one record per request, the run as a whole, and the state a stop check sees.

Times are ``time.perf_counter()`` seconds (CLOCK_MONOTONIC: shared by every process of a host, so the
records of several client processes merge on one clock).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

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
    request_id: str = ""
    """The ``X-Request-Id`` it was sent with (the server's logs and records name it so)."""
    chunk_waits: tuple[float, ...] = ()
    """Per chunk, how long its read's newest bytes had waited in the socket (the raw engine: the kernel's
    receive time; 0.0 where the kernel gave none and the chunk is timed at its read); its time is then
    their arrival. Empty when the engine cannot tell (aiohttp)."""
    send_wait: float = 0.0
    """How long the request's write took (the raw engine): it left between ``send_time`` and this much
    later, so a TTFT may be this much shorter (a client descheduled inside its write)."""
    chunk_late: tuple[float, ...] = ()
    """Per chunk, how much earlier it may truly have arrived than its time says (seconds), or empty when
    every chunk is exact: the raw engine's bound (:mod:`autotune.load._rawhttp`), or the monitor's
    estimate for the aiohttp engine (:mod:`autotune.load.selfcheck`)."""

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
class Preparation:
    """What a run does on its connection pool before its schedule starts (not measured)."""

    connections: int = 0
    """Connections to open ahead (a concurrency-mode probe opens one per stream)."""
    warmup: tuple[Any, ...] = ()
    """Requests (:class:`~autotune.load.workload.RequestSpec`) sent at most ``connections`` at once and not
    recorded, on the pool the run then uses."""

    def share(self, worker: int, workers: int) -> Preparation:
        """Worker ``worker``'s share when ``workers`` processes split a run."""
        connections = self.connections // workers + (1 if worker < self.connections % workers else 0)
        return Preparation(connections, self.warmup[worker::workers])


def new_run_id() -> str:
    """A short random prefix for the request ids of one run (``X-Request-Id: <prefix><index>``)."""
    return f"autotune-{secrets.token_hex(4)}-"


@dataclass(frozen=True)
class InFlight:
    """A request that has been sent and has not finished: its send time and first-chunk time, if any."""

    send_time: float
    first_chunk_time: float | None
    index: int = -1
    """The request's index (its name in the records)."""


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


class Stopped(str):
    """A stop check's reason for stopping a run early, naming what it judged (an SLO term's key, or
    ``error budget``)."""

    term: str

    def __new__(cls, text: str, term: str) -> Stopped:
        obj = super().__new__(cls, text)
        obj.term = term
        return obj

    def __reduce__(self) -> tuple[type[Stopped], tuple[str, str]]:  # keeps ``term`` across processes
        return (Stopped, (str(self), self.term))


class Finished(str):
    """A stop check's reason that ends a run cleanly: what it measures is done (the requests still in
    flight only kept the load up). Not an early stop; with several client processes, each keeps its load
    up until every one is done."""

    __slots__ = ()


@runtime_checkable
class ShareableStop(Protocol):
    """A stop check that can be split over client processes: each judges its share of the requests."""

    def __call__(self, progress: Progress) -> str | None:
        """Why to stop now, or ``None``."""
        ...

    def for_share(self, indices: Sequence[int]) -> ShareableStop:
        """A fresh check of the same kind for the share of the requests named ``indices``."""
        ...


@dataclass(frozen=True)
class ClientFigures:
    """What the client saw of itself during a run (summed or worst over worker processes): the witnesses
    of :mod:`autotune.load.selfcheck`."""

    wall_s: float = 0.0
    cpu_s: float = 0.0
    """CPU seconds of the event-loop thread(s)."""
    cores: float = 1.0
    """Cores the client could use: one per worker process, capped by CPU affinity and cgroup quota."""
    workers: int = 1
    runqueue_wait_s: float = 0.0
    """Seconds the loop thread(s) were runnable but not running (kernel ``schedstat``)."""
    wakeups: int = 0
    """Times the loop thread(s) were scheduled to run."""
    lag_samples: int = 0
    lag_p99_s: float = 0.0
    """p99 of how late the event loop's monitor woke (worst worker)."""
    lag_max_s: float = 0.0
    chunks: int = 0
    late_chunks: int = 0
    """Chunks whose time may be more than ``late_threshold_s`` later than their arrival."""
    late_threshold_s: float = 0.0
    chunk_lag_p99_s: float = 0.0
    """p99 over chunks of how much earlier they may have arrived than their time says."""
    send_wait_max_s: float = 0.0
    """The longest a request's write took (raw engine): a TTFT may be that much shorter than reported."""
    read_wait_p99_s: float = 0.0
    """p99 over chunks of how long they waited in the socket before the client read them (raw engine)."""
    kernel_timed: bool = False
    """Every chunk was timed by the raw engine: at the kernel's receive time, with its own bound on how
    much earlier it may have arrived (``RequestRecord.chunk_late``)."""
    send_delay_mean_s: float = 0.0
    """Mean of send time - planned arrival (requests paced by their arrival time only)."""
    send_gap_s: float = 0.0
    """Mean gap between planned arrivals."""
    send_stretch: float = 0.0
    """How much longer the sends spanned than the planned arrivals (0.1: 10 % longer)."""
    shifts: tuple[tuple[str, float], ...] = ()
    """How far the truth of each bounded statistic (those judged, and ``ttft:p95``, ``itl:p99``,
    ``tpot:p99`` always) may lie from the reported value, relatively, given the chunks read late: the
    measurement's own error bound."""
    judged: tuple[str, ...] = ()
    """The statistics whose bound voids the run (a study's SLO terms and objectives); the other bounds are
    warnings."""
    gc_collections: int = 0
    """Garbage collections during the run (the collector is disabled while measuring: 0 expected)."""
    gc_pause_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        """The figures, JSON-serialisable (seconds as ms, rounded)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "shifts":
                out["shifts"] = {k: round(v, 4) for k, v in value}
            elif f.name == "judged":
                out["judged"] = list(value)
            elif f.name.endswith("_s"):
                out[f.name[:-2] + "_ms"] = round(value * 1e3, 3)
            else:
                out[f.name] = round(value, 4) if isinstance(value, float) else value
        return out

    @classmethod
    def merged(cls, parts: Sequence[ClientFigures]) -> ClientFigures:
        """The figures of several worker processes as one client: sums, and the worst lateness."""
        return cls(
            wall_s=max((p.wall_s for p in parts), default=0.0),
            cpu_s=math.fsum(p.cpu_s for p in parts),
            cores=math.fsum(p.cores for p in parts),
            workers=len(parts),
            runqueue_wait_s=math.fsum(p.runqueue_wait_s for p in parts),
            wakeups=sum(p.wakeups for p in parts),
            lag_samples=min((p.lag_samples for p in parts), default=0),
            lag_p99_s=max((p.lag_p99_s for p in parts), default=0.0),
            lag_max_s=max((p.lag_max_s for p in parts), default=0.0),
            chunks=sum(p.chunks for p in parts),
            late_chunks=sum(p.late_chunks for p in parts),
            shifts=(),
            judged=(),
            late_threshold_s=min((p.late_threshold_s for p in parts), default=0.0),
            chunk_lag_p99_s=max((p.chunk_lag_p99_s for p in parts), default=0.0),
            send_wait_max_s=max((p.send_wait_max_s for p in parts), default=0.0),
            read_wait_p99_s=max((p.read_wait_p99_s for p in parts), default=0.0),
            kernel_timed=all(p.kernel_timed for p in parts) if parts else False,
            send_delay_mean_s=max((p.send_delay_mean_s for p in parts), default=0.0),
            send_gap_s=min((p.send_gap_s for p in parts), default=0.0) / max(1, len(parts)),
            send_stretch=max((p.send_stretch for p in parts), default=0.0),
            gc_collections=sum(p.gc_collections for p in parts),
            gc_pause_s=math.fsum(p.gc_pause_s for p in parts),
        )


@dataclass(frozen=True)
class RunResult:
    """The records of one run, its perf_counter window, whether it stopped early, and its self-check."""

    records: tuple[RequestRecord, ...]
    start: float
    end: float
    planned: int
    stopped_early: bool = False
    stop_reason: str | None = None
    client: ClientFigures = field(default_factory=ClientFigures)
    """The client's witnesses of itself (:mod:`autotune.load.selfcheck`)."""
    problems: tuple[str, ...] = ()
    """Why this run cannot be trusted as data (empty when it can)."""
    wall_start: float = 0.0
    """Unix time at ``start`` (to turn perf_counter times into absolute ones)."""
    warnings: tuple[str, ...] = ()
    """What the self-check noticed that does not void the run (a busy client whose chunks are bounded)."""

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
