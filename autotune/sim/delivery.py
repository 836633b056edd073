"""The simulated server's engine side: each data-parallel engine stepped in wall time, its tokens delivered.

:class:`EngineLoops` admits requests (to the engine vLLM's load balancer picks, :mod:`autotune.sim.router`),
runs one loop per engine that sleeps until each step's end (``step time / --sim-speedup``), and hands
the step's tokens to the requests' :class:`Stream`: a streaming response gets its token chunks written
by the loop itself (pre-formatted byte templates around the changing text), other handlers are woken.
A writer more than :data:`MERGE_LATE_S` late holds a stream's tokens back and merges them into one chunk
when it catches up (as vLLM's ``RequestOutputCollector``). The per-request histograms of ``/metrics``
(:class:`~autotune.sim.metrics.EngineStats`) are observed here.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from autotune.sim.engine import Engine, Request, StepResult
from autotune.sim.flags import ServeFlags
from autotune.sim.metrics import EngineStats
from autotune.sim.router import LeastLoaded
from autotune.sim.tokens import OUTPUT_WORDS, output_text

MAX_DEBT_S = 0.005
"""How far (wall seconds) the engine loop may run behind its schedule and still catch up."""
MERGE_LATE_S = 0.002
"""A step delivered this late (wall seconds) or later is held back and merged into the next chunk."""
MAX_HOLD_S = 0.01
"""A late writer still writes held-back tokens (merged) at least this often (wall seconds)."""


class Stream:
    """Per-request delivery state between the engine loop and the HTTP handler."""

    __slots__ = (
        "arrival",
        "delivered",
        "done",
        "engine",
        "error",
        "first",
        "last",
        "max_tokens",
        "mid",
        "pending",
        "pre",
        "response_id",
        "scheduled",
        "sent",
        "transport",
        "waiter",
    )

    def __init__(self, arrival: float, max_tokens: int, engine: int = 0, response_id: str = "") -> None:
        self.waiter: asyncio.Future[None] | None = None
        self.transport: asyncio.Transport | None = None
        """Set once the response is streaming: the engine loop then writes token chunks itself."""
        self.pre = b""
        self.mid = b""
        self.pending: list[bytes] = []
        """Framed chunks the engine loop holds for one write (``--sim-events-per-write``)."""
        self.error = False
        self.sent = 0
        self.delivered = 0
        """Tokens whose step has ended in wall time (the engine's counters run one step ahead)."""
        self.done = False
        self.arrival = arrival
        self.first = -1.0
        self.last = -1.0
        self.scheduled = -1.0
        """When the engine first scheduled the request (its queueing ended)."""
        self.max_tokens = max_tokens
        self.engine = engine
        """The data-parallel engine the request runs on."""
        self.response_id = response_id
        """The id after ``cmpl-``/``chatcmpl-`` (an incoming X-Request-Id, else a generated one)."""


def wake(stream: Stream) -> None:
    """Write what the engine loop held back for ``stream`` and wake its handler."""
    if stream.pending:  # what the engine loop held for one write goes before the handler's last write
        transport = stream.transport
        if transport is not None and not transport.is_closing():
            transport.write(b"".join(stream.pending))
        stream.pending.clear()
    waiter = stream.waiter
    if waiter is not None and not waiter.done():
        waiter.set_result(None)


def finish_reason(req: Request, state: Stream) -> str:
    """``length`` when the request produced its max_tokens, else ``stop``."""
    return "length" if req.output_len >= state.max_tokens else "stop"


def request_id(rid: int) -> str:
    """16 hex digits that look random but follow from the request number (vLLM 0.32: ``cmpl-<16 hex>``)."""
    return f"{(rid + 1) * 0x9E3779B97F4A7C15 % (1 << 64):016x}"


class EngineLoops:
    """The engines of one server (one per data-parallel rank): admission, the wall-time step loops, token
    delivery to the streams and the per-request statistics.

    ``on_die`` is called after a step once ``--sim-die-after-requests`` requests were admitted; it sets
    :attr:`dead`, which stops the loops.
    """

    def __init__(self, flags: ServeFlags, engines: Sequence[Engine], on_die: Callable[[], None]) -> None:
        self.flags = flags
        self.engines = list(engines)
        self.stats = [EngineStats() for _ in self.engines]
        self.router = LeastLoaded()
        self.dead = False
        self._on_die = on_die
        self._wakes = [asyncio.Event() for _ in self.engines]
        self._next_id = 0
        self._admitted = 0
        self._die_pending = False
        self._loop = asyncio.get_running_loop()
        self.lag_s = 0.0
        """Wall seconds the engine loops fell behind their schedule beyond MAX_DEBT_S (host CPU too slow)."""
        self.merged = 0
        """Tokens that were merged into another token's chunk because the writer was late."""
        self._behind: set[Stream] = set()
        """Streams with tokens held back by a late writer (flushed, merged, when it is on time again)."""
        self._held_since = 0.0

    def submit(
        self, ids: list[int], output_len: int, max_tokens: int, given_id: object
    ) -> tuple[Request, Stream]:
        """Admit a request (prompt ``ids``) to the engine the router picks; its response id is
        ``given_id`` (X-Request-Id or the body's ``request_id``) when not None."""
        rid = self._next_id
        self._next_id += 1
        req = Request(rid, len(ids), output_len, token_ids=ids)
        index = self.router.choose(self.engines)
        response_id = str(given_id) if given_id is not None else request_id(rid)
        state = Stream(self._loop.time(), max_tokens, index, response_id)
        req.tag = state
        self._admitted += 1
        limit = self.flags.die_after_requests
        if limit is not None and self._admitted >= limit:
            self._die_pending = True
        self.engines[index].add(req)
        self._wakes[index].set()
        return req, state

    def abort(self, req: Request) -> None:
        """The client went away: drop the request from its engine."""
        state = req.tag
        index = state.engine if isinstance(state, Stream) else 0
        self.engines[index].abort(req)
        if not req.finished:
            self.stats[index].success["abort"] += 1

    def fail_streams(self) -> None:
        """Mark every running or waiting request's stream failed and wake its handler."""
        for engine in self.engines:
            for req in [*engine.running, *engine.waiting]:
                state = req.tag
                if isinstance(state, Stream):
                    state.error = True
                    wake(state)

    async def run(self, index: int = 0) -> None:
        """Step engine ``index`` in wall time until stopped or dead."""
        loop = self._loop
        engine = self.engines[index]
        wake_up = self._wakes[index]
        speedup = self.flags.speedup
        target = loop.time()
        while not self.dead:
            result = engine.step() if engine.has_work() else None
            if result is None or result.scheduled_tokens == 0:
                wake_up.clear()
                await wake_up.wait()
                target = loop.time()
                continue
            now = loop.time()
            self._started(result, self.stats[index], now)
            # Steps follow a schedule (end of previous step + duration / speedup), so the time spent
            # delivering tokens does not stretch simulated time; a loop more than MAX_DEBT_S late
            # gives up catching up and counts the difference as lag.
            if target < now - MAX_DEBT_S:
                self.lag_s += now - MAX_DEBT_S - target
                target = now - MAX_DEBT_S
            target += result.duration / speedup
            delay = target - loop.time()
            await asyncio.sleep(delay if delay > 0 else 0)
            if self.dead:
                return
            self._deliver(result, self.stats[index], target)
            if self._die_pending:
                self._on_die()

    @staticmethod
    def _started(result: StepResult, stats: EngineStats, now: float) -> None:
        """A step was scheduled at ``now``: its first-scheduled requests' queue times, its token count."""
        for req in result.started:
            state = req.tag
            assert isinstance(state, Stream)
            state.scheduled = now
            stats.queue.observe(max(0.0, now - state.arrival))
        stats.iteration.observe(result.scheduled_tokens)

    def _deliver(self, result: StepResult, stats: EngineStats, target: float) -> None:
        """The step scheduled to end at ``target`` ended: write (or hold back) its tokens, wake the
        handlers that write themselves, observe the finished requests."""
        now = self._loop.time()
        late = now - target > MERGE_LATE_S
        behind = self._behind
        words = OUTPUT_WORDS
        nwords = len(words)
        for req in result.emitted:
            state = req.tag
            assert isinstance(state, Stream)
            if state.first < 0:
                state.first = now
                stats.ttft.observe(now - state.arrival)
            else:
                stats.itl.observe(now - state.last)
            state.last = now
            step = req.step_tokens
            state.delivered += step
            finished = state.delivered >= req.output_len
            state.done = finished
            transport = state.transport
            if transport is not None and not finished and not transport.is_closing():
                if late:  # hold the tokens back: merged into this stream's next chunk
                    if not behind:
                        self._held_since = now
                    behind.add(state)
                    continue
                i = state.sent
                n = state.delivered
                if n - i == 1:
                    data = state.pre + words[i % nwords] + state.mid
                else:
                    self.merged += max(0, n - i - step)
                    data = state.pre + output_text(i, n) + state.mid
                self._write(state, transport, b"%x\r\n%b\r\n" % (len(data), data))
                state.sent = n
            else:
                wake(state)
        if behind and (not late or now - self._held_since >= MAX_HOLD_S):
            self._flush_behind()
        for req in result.finished:
            state = req.tag
            assert isinstance(state, Stream)
            self._observe_finished(req, state, now)

    def _flush_behind(self) -> None:
        """Write each held-back stream's pending tokens as one merged chunk."""
        for state in self._behind:
            transport = state.transport
            i = state.sent
            n = state.delivered
            if state.done or state.error or transport is None or transport.is_closing() or n <= i:
                continue  # a finished stream's handler writes the rest itself
            self.merged += n - i - 1
            data = state.pre + output_text(i, n) + state.mid
            self._write(state, transport, b"%x\r\n%b\r\n" % (len(data), data))
            state.sent = n
        self._behind.clear()

    def _write(self, state: Stream, transport: asyncio.Transport, frame: bytes) -> None:
        """Write a stream's framed chunk, or hold it until ``--sim-events-per-write`` are gathered."""
        per_write = self.flags.events_per_write
        if per_write <= 1:
            transport.write(frame)
            return
        state.pending.append(frame)
        if len(state.pending) >= per_write:
            transport.write(b"".join(state.pending))
            state.pending.clear()

    def _observe_finished(self, req: Request, state: Stream, now: float) -> None:
        """Per-request histograms and the success counter at the end of a request."""
        stats = self.stats[state.engine]
        stats.e2e.observe(now - state.arrival)
        stats.success[finish_reason(req, state)] += 1
        if req.output_len > 1 and state.first >= 0:
            stats.tpot.observe((now - state.first) / (req.output_len - 1))
        scheduled = state.scheduled if state.scheduled >= 0 else state.arrival
        stats.inference.observe(max(0.0, now - scheduled))
        stats.prefill.observe(max(0.0, (state.first if state.first >= 0 else now) - scheduled))
        stats.decode.observe(max(0.0, now - state.first) if state.first >= 0 else 0.0)
        stats.prompt.observe(req.prompt_len)
        stats.generation.observe(req.output_len)
        stats.max_tokens.observe(state.max_tokens)
        stats.preemptions.observe(req.num_preemptions)
