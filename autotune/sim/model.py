"""In-process simulation in virtual time: the server's scheduler and cost model without HTTP or sleeping.

:func:`simulate` starts the simulated engine with vLLM flags on a GPU profile (the same startup checks
as the server, so it can fail the same ways), replays a workload (prompt length, output length,
arrival time per request, optionally its prompt's token ids or a shared prefix) and returns per-request
TTFT / TPOT / E2EL, the pooled ITLs and throughput, with the definitions of ``vllm bench serve``.
Requests arriving while a step runs join at the next step, as in the server. With data parallelism each
engine runs its own steps on its own clock and every arrival is routed by vLLM's load balancer
(:mod:`autotune.sim.router`). A request longer than max_model_len is rejected (counted as failed).

Prefix caching needs token ids: a request with ``prompt_token_ids`` or a ``prefix_group`` takes part
(requests of one group share their first ``prefix_len`` tokens; the rest of each prompt is its own);
one with neither queries the cache but never hits. ITLs are pooled per emission: a step that emits
several tokens of a request (speculative decoding) is one gap, as a streaming client sees one chunk.

A request may come ``after`` another (a later turn of a conversation): it arrives ``think`` seconds after
that one finished, not at its own arrival time; if that one never finished (rejected, or never
scheduled), neither does it.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace

from autotune.hardware.catalog import GpuProfile, ModelArch, gpu_profile, load_model_arch
from autotune.sim.cost import CostModel, Physics
from autotune.sim.engine import Engine, EngineConfig, Request, StepResult
from autotune.sim.flags import ServeFlags
from autotune.sim.router import LeastLoaded
from autotune.sim.startup import StartFailure, StartupPlan, plan_startup
from autotune.sim.tokens import OutputIds


@dataclass(frozen=True)
class WorkloadRequest:
    """One request of a workload: token counts and arrival time in seconds from the start.

    For the prefix cache, give either the prompt's ``prompt_token_ids`` (``prompt_len`` of them) or a
    ``prefix_group`` whose first ``prefix_len`` tokens every request of the group shares.
    """

    prompt_len: int
    output_len: int
    arrival: float = 0.0
    prompt_token_ids: tuple[int, ...] | None = None
    prefix_group: int | None = None
    prefix_len: int = 0
    after: int | None = None
    """The workload position of the request this one follows: it arrives ``think`` seconds after that one
    finished (its own ``arrival`` is then ignored)."""
    think: float = 0.0

    def __post_init__(self) -> None:
        if self.prompt_token_ids is not None and len(self.prompt_token_ids) != self.prompt_len:
            raise ValueError(
                f"WorkloadRequest: {len(self.prompt_token_ids)} prompt_token_ids for prompt_len "
                f"{self.prompt_len}"
            )
        if not 0 <= self.prefix_len <= max(self.prompt_len, 0):
            raise ValueError(f"WorkloadRequest: prefix_len {self.prefix_len} outside [0, prompt_len]")
        if self.prefix_len and self.prefix_group is None:
            raise ValueError("WorkloadRequest: prefix_len needs a prefix_group")
        if not (math.isfinite(self.think) and self.think >= 0):
            raise ValueError(f"WorkloadRequest: think {self.think} must be a finite number >= 0")

    def token_ids(self, index: int) -> Sequence[int] | None:
        """The prompt's token ids (``index``: the request's position, which makes its own tokens its
        own); None when the request takes no part in prefix caching."""
        if self.prompt_token_ids is not None:
            return self.prompt_token_ids
        if self.prefix_group is None:
            return None
        shared = [2 * ((self.prefix_group << 32) | i) for i in range(self.prefix_len)]
        own = [2 * ((index << 32) | i) + 1 for i in range(self.prompt_len - self.prefix_len)]
        return shared + own


def synthetic_workload(
    num_requests: int,
    *,
    input_len: tuple[int, int] = (128, 512),
    output_len: tuple[int, int] = (32, 128),
    rate: float = math.inf,
    seed: int = 0,
    prefix_len: int = 0,
) -> list[WorkloadRequest]:
    """Uniform input/output lengths (inclusive ranges) with Poisson arrivals (``inf``: all at 0).

    ``prefix_len`` > 0 puts a shared prefix (group 0) of that many tokens before every prompt (the
    prompt is then ``prefix_len`` + the drawn input length, as ``vllm bench serve``'s random dataset).
    """
    rng = random.Random(seed)
    t = 0.0
    out = []
    for _ in range(num_requests):
        if math.isfinite(rate):
            t += rng.expovariate(rate)
        prompt, output = rng.randint(*input_len), rng.randint(*output_len)
        if prefix_len:
            out.append(WorkloadRequest(prefix_len + prompt, output, t, prefix_group=0, prefix_len=prefix_len))
        else:
            out.append(WorkloadRequest(prompt, output, t))
    return out


@dataclass(frozen=True)
class RequestMetrics:
    """Latencies of one completed request in seconds (``tpot`` is 0 for one-token outputs)."""

    prompt_len: int
    output_len: int
    ttft: float
    tpot: float
    e2el: float
    preemptions: int
    index: int = -1
    """The request's position in the workload."""
    arrival: float = 0.0
    """When it arrived (seconds, the workload's clock)."""
    itls: tuple[float, ...] = ()
    """Its gaps between emissions (seconds), as a streaming client sees them."""


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), ``q`` in [0, 100]; NaN when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass(frozen=True)
class SimResult:
    """Outcome of :func:`simulate`: a startup failure, or the measured run."""

    startup: StartupPlan
    requests: tuple[RequestMetrics, ...] = ()
    itl: tuple[float, ...] = ()
    failed: int = 0
    rejected: tuple[int, ...] = ()
    """The workload positions of the failed requests (too long for max_model_len, or never scheduled)."""
    duration: float = 0.0
    num_preemptions: int = 0
    peak_running: int = 0
    peak_kv_usage: float = 0.0
    prefix_cache_queries: int = 0
    """Prompt tokens looked up in the prefix cache (vllm:prefix_cache_queries_total)."""
    prefix_cache_hits: int = 0
    """Of those, tokens found cached (vllm:prefix_cache_hits_total)."""
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0

    @property
    def ok(self) -> bool:
        """Whether the engine started."""
        return self.startup.ok

    @property
    def failure(self) -> StartFailure | None:
        """The startup failure, if any."""
        return self.startup.failure

    @property
    def kv_tokens(self) -> int:
        """KV-cache capacity in tokens (0 when the start failed before it was known)."""
        return self.startup.memory.kv_tokens if self.startup.memory else 0

    @property
    def output_tokens(self) -> int:
        """Output tokens of completed requests."""
        return sum(r.output_len for r in self.requests)

    @property
    def output_throughput(self) -> float:
        """Output tokens per second over the run."""
        return self.output_tokens / self.duration if self.duration > 0 else 0.0

    @property
    def request_throughput(self) -> float:
        """Completed requests per second over the run."""
        return len(self.requests) / self.duration if self.duration > 0 else 0.0

    def summary(self) -> dict[str, float]:
        """``vllm bench serve``-style result keys (latencies in ms, throughputs per second)."""
        out: dict[str, float] = {
            "duration": self.duration,
            "completed": float(len(self.requests)),
            "failed": float(self.failed),
            "total_input_tokens": float(sum(r.prompt_len for r in self.requests)),
            "total_output_tokens": float(self.output_tokens),
            "request_throughput": self.request_throughput,
            "output_throughput": self.output_throughput,
        }
        for metric in ("ttft", "tpot", "itl", "e2el"):
            values = list(self.itl) if metric == "itl" else [getattr(r, metric) for r in self.requests]
            if metric == "tpot":
                values = [r.tpot for r in self.requests if r.output_len > 1]
            out[f"mean_{metric}_ms"] = 1000 * sum(values) / len(values) if values else math.nan
            out[f"median_{metric}_ms"] = 1000 * percentile(values, 50)
            out[f"p99_{metric}_ms"] = 1000 * percentile(values, 99)
        return out

    def stat(self, metric: str, q: float) -> float:
        """Percentile ``q`` of ``ttft``, ``tpot``, ``e2el`` (per request) or ``itl`` (pooled), seconds."""
        if metric == "itl":
            return percentile(self.itl, q)
        values = [getattr(r, metric) for r in self.requests]
        if metric == "tpot":
            values = [v for r, v in zip(self.requests, values, strict=True) if r.output_len > 1]
        return percentile(values, q)


def _flags_from(model: str, flags: ServeFlags | Mapping[str, object], gpu: GpuProfile) -> ServeFlags:
    if isinstance(flags, ServeFlags):
        return replace(flags, hardware=gpu)
    known = {f.name for f in fields(ServeFlags)}
    kwargs: dict[str, object] = {}
    for key, value in flags.items():
        name = key.lstrip("-").replace("-", "_")
        name = name.removeprefix("sim_")
        if name not in known:
            raise ValueError(f"simulate: unknown flag {key!r}")
        kwargs[name] = value
    return replace(ServeFlags(model=model), hardware=gpu, **kwargs)  # type: ignore[arg-type]


def build_engines(
    flags: ServeFlags, arch: ModelArch, plan: StartupPlan, seed: int = 0, *, physics: Physics | None = None
) -> list[Engine]:
    """The engines of a started server, one per data-parallel rank (``plan.ok`` must hold), timing steps
    on the GPU's ``physics`` (default: the cost model's constants)."""
    assert plan.memory is not None and plan.config is not None
    cfg = plan.config
    execution = cfg.execution

    def cost(model: ModelArch, tp: int) -> CostModel:
        return CostModel(
            model,
            flags.hardware,
            kv_cache_dtype=cfg.kv_cache_dtype,
            dtype=flags.dtype,
            tensor_parallel_size=tp,
            block_size=cfg.block_size,
            execution=execution,
            physics=physics,
        )

    spec = cfg.speculative
    draft = cost(spec.draft, spec.draft_tensor_parallel_size) if spec and spec.draft else None
    config = EngineConfig(
        max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        block_size=cfg.block_size,
        num_blocks=plan.memory.num_blocks,
        enable_chunked_prefill=cfg.enable_chunked_prefill,
        enable_prefix_caching=cfg.enable_prefix_caching,
        long_prefill_token_threshold=cfg.long_prefill_token_threshold,
        long_prefill_token_threshold_adaptive=cfg.long_prefill_token_threshold_adaptive,
        num_speculative_tokens=spec.num_speculative_tokens if spec else 0,
        acceptance_rate=cfg.acceptance_rate,
    )
    target = cost(arch, cfg.tensor_parallel_size)
    outputs = OutputIds(arch.vocab_size)
    return [
        Engine(config, target, draft_cost=draft, output_ids=outputs, seed=seed * 1_000_003 + rank)
        for rank in range(cfg.data_parallel_size)
    ]


def build_engine(flags: ServeFlags, arch: ModelArch, plan: StartupPlan) -> Engine:
    """The engine of a started server without data parallelism (the first rank's otherwise)."""
    return build_engines(flags, arch, plan)[0]


def simulate(
    flags: ServeFlags | Mapping[str, object],
    hardware: str | GpuProfile,
    model: str | ModelArch,
    workload: Sequence[WorkloadRequest],
    rate: float | None = None,
    *,
    seed: int = 0,
    physics: Physics | None = None,
) -> SimResult:
    """Start the engine with ``flags`` (vLLM names, dashes or underscores) and replay ``workload``.

    With ``rate`` the workload's arrival times are replaced by Poisson arrivals at ``rate`` req/s
    (``inf``: all at once), drawn from ``seed``; ``seed`` also drives the startup's OOM randomness. A
    request ``after`` another arrives ``think`` seconds after that one finished. ``physics``: what the
    simulated GPU really does (:class:`autotune.sim.cost.Physics`; default: the models' own constants).
    """
    arch = model if isinstance(model, ModelArch) else load_model_arch(model)
    gpu = hardware if isinstance(hardware, GpuProfile) else gpu_profile(hardware)
    serve = _flags_from(arch.name, flags, gpu)
    rng = random.Random(seed)
    plan = plan_startup(serve, arch, rng, physics=physics)
    if not plan.ok:
        return SimResult(plan)
    engines = build_engines(serve, arch, plan, seed, physics=physics)
    arrivals = [w.arrival for w in workload]
    if rate is not None:
        t = 0.0
        for i in range(len(arrivals)):
            if math.isfinite(rate):
                t += rng.expovariate(rate)
            arrivals[i] = t
    turns = _Turns(workload, plan.max_model_len)
    order = sorted((i for i, w in enumerate(workload) if w.after is None), key=arrivals.__getitem__)
    pending: list[tuple[float, int, Request]] = []
    for i in order:
        req = turns.request(i, arrivals[i])
        if req is not None:
            pending.append((req.arrival, i, req))
    run = _Run(engines, pending[0][0] if pending else 0.0, turns)
    stuck = run.replay(pending)
    rejected = [*turns.rejected, *stuck, *turns.never_arrived()]
    failed = len(rejected)
    spec = [e.spec for e in engines]
    return SimResult(
        startup=plan,
        requests=tuple(run.done),
        itl=tuple(run.itl),
        failed=failed,
        rejected=tuple(rejected),
        duration=run.last - run.start,
        num_preemptions=sum(e.num_preemptions for e in engines),
        peak_running=run.peak_running,
        peak_kv_usage=run.peak_kv,
        prefix_cache_queries=sum(e.prefix_queries for e in engines),
        prefix_cache_hits=sum(e.prefix_hits for e in engines),
        spec_num_drafts=sum(s.num_drafts for s in spec),
        spec_num_draft_tokens=sum(s.num_draft_tokens for s in spec),
        spec_num_accepted_tokens=sum(s.num_accepted_tokens for s in spec),
    )


class _Turns:
    """The workload's requests as the engine gets them: which one comes after which, and those rejected
    (longer than max_model_len, or after one that never finished)."""

    def __init__(self, workload: Sequence[WorkloadRequest], max_model_len: int) -> None:
        self.workload = workload
        self.max_model_len = max_model_len
        self.next: dict[int, int] = {}
        for i, w in enumerate(workload):
            if w.after is None:
                continue
            if not 0 <= w.after < len(workload) or w.after == i or w.after in self.next:
                raise ValueError(f"WorkloadRequest {i}: after {w.after} is not another request's position")
            self.next[w.after] = i
        self.rejected: list[int] = []
        self.arrived: set[int] = set()

    def request(self, i: int, arrival: float) -> Request | None:
        """Request ``i`` arriving at ``arrival``, or ``None`` when it is rejected (with what follows it)."""
        w = self.workload[i]
        self.arrived.add(i)
        if w.prompt_len + w.output_len > self.max_model_len or w.prompt_len < 1:
            self.rejected.append(i)
            return None
        return Request(i, w.prompt_len, w.output_len, arrival, w.token_ids(i))

    def after(self, i: int, end: float) -> Request | None:
        """The request that arrives because request ``i`` finished at ``end``, if any."""
        j = self.next.get(i)
        if j is None:
            return None
        return self.request(j, end + self.workload[j].think)

    def never_arrived(self) -> list[int]:
        """Positions of the requests that never arrived: they came after one that never finished."""
        return [j for j in self.next.values() if j not in self.arrived]


class _Run:
    """One replay in virtual time over the engines (each with its own clock) and the router."""

    def __init__(self, engines: list[Engine], start: float, turns: _Turns | None = None) -> None:
        self.engines = engines
        self.turns = turns
        self.pending: list[tuple[float, int, Request]] = []
        self.clocks = [start] * len(engines)
        """When each engine can start its next step."""
        self.start = start
        self.last = start
        self.router = LeastLoaded()
        self.done: list[RequestMetrics] = []
        self.itl: list[float] = []
        self.gaps: dict[int, list[float]] = {}
        self.peak_running = 0
        self.peak_kv = 0.0

    def _next_engine(self, stuck: set[int]) -> tuple[int, float]:
        if len(self.engines) == 1:
            return (0, self.clocks[0]) if not stuck and self.engines[0].has_work() else (-1, math.inf)
        best, best_t = -1, math.inf
        for i, engine in enumerate(self.engines):
            if i not in stuck and engine.has_work() and self.clocks[i] < best_t:
                best, best_t = i, self.clocks[i]
        return best, best_t

    def replay(self, pending: list[tuple[float, int, Request]]) -> list[int]:
        """Run ``pending`` ((arrival, position, request), sorted) to completion, and the requests that
        arrive after one of them finished; the positions of the requests that never ran."""
        engines, clocks = self.engines, self.clocks
        stuck: set[int] = set()
        self.pending = heap = pending
        while True:
            index, at = self._next_engine(stuck)
            arrival = heap[0][0] if heap else math.inf
            if index < 0 and arrival == math.inf:
                break
            if arrival <= at:  # route the arrival first: it joins the engine's next step
                req = heapq.heappop(heap)[2]
                index = self.router.choose(engines)
                if not engines[index].has_work():
                    clocks[index] = max(clocks[index], req.arrival)
                stuck.discard(index)
                engines[index].add(req)
                continue
            engine = engines[index]
            result = engine.step()
            if result.scheduled_tokens == 0:  # nothing fits until something else arrives
                if arrival == math.inf:
                    stuck.add(index)
                else:
                    clocks[index] = max(clocks[index], arrival)
                continue
            self._record(engine, result, clocks[index] + result.duration)
            clocks[index] += result.duration
        return [r.rid for i in sorted(stuck) for r in (*engines[i].waiting, *engines[i].running)]

    def _record(self, engine: Engine, result: StepResult, now: float) -> None:
        engines = self.engines
        running = len(engine.running) if len(engines) == 1 else sum(len(e.running) for e in engines)
        running += len(result.finished)
        if running > self.peak_running:
            self.peak_running = running
        kv = engine.kv_usage
        if kv > self.peak_kv:
            self.peak_kv = kv
        if now > self.last:
            self.last = now
        itl, gaps = self.itl, self.gaps
        for req in result.emitted:
            if req.first_token_time < 0:
                req.first_token_time = now
            else:
                gap = now - req.last_token_time
                itl.append(gap)
                gaps.setdefault(req.rid, []).append(gap)
            req.last_token_time = now
        for req in result.finished:
            if self.turns is not None:
                follower = self.turns.after(req.rid, now)
                if follower is not None:
                    heapq.heappush(self.pending, (follower.arrival, follower.rid, follower))
            ttft = req.first_token_time - req.arrival
            e2el = now - req.arrival
            n = req.output_len
            tpot = (e2el - ttft) / (n - 1) if n > 1 else 0.0
            self.done.append(
                RequestMetrics(
                    req.prompt_len,
                    n,
                    ttft,
                    tpot,
                    e2el,
                    req.num_preemptions,
                    req.rid,
                    req.arrival,
                    tuple(self.gaps.pop(req.rid, ())),
                )
            )
