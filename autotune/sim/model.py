"""In-process simulation in virtual time: the server's scheduler and cost model without HTTP or sleeping.

:func:`simulate` starts the simulated engine with vLLM flags on a GPU profile (the same startup checks
as the server, so it can fail the same ways), replays a workload (prompt length, output length,
arrival time per request) and returns per-request TTFT / TPOT / E2EL, the pooled ITLs and throughput,
with the definitions of ``vllm bench serve``. Requests arriving while a step runs join at the next
step, as in the server. A request longer than max_model_len is rejected (counted as failed).
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace

from autotune.catalog import GpuProfile, ModelArch, gpu_profile, load_model_arch
from autotune.sim.engine import CostModel, Engine, EngineConfig, Request
from autotune.sim.flags import ServeFlags
from autotune.sim.startup import StartFailure, StartupPlan, plan_startup


@dataclass(frozen=True)
class WorkloadRequest:
    """One request of a workload: token counts and arrival time in seconds from the start."""

    prompt_len: int
    output_len: int
    arrival: float = 0.0


def synthetic_workload(
    num_requests: int,
    *,
    input_len: tuple[int, int] = (128, 512),
    output_len: tuple[int, int] = (32, 128),
    rate: float = math.inf,
    seed: int = 0,
) -> list[WorkloadRequest]:
    """Uniform input/output lengths (inclusive ranges) with Poisson arrivals (``inf``: all at 0)."""
    rng = random.Random(seed)
    t = 0.0
    out = []
    for _ in range(num_requests):
        if math.isfinite(rate):
            t += rng.expovariate(rate)
        out.append(WorkloadRequest(rng.randint(*input_len), rng.randint(*output_len), t))
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
    duration: float = 0.0
    num_preemptions: int = 0
    peak_running: int = 0
    peak_kv_usage: float = 0.0

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


def build_engine(flags: ServeFlags, arch: ModelArch, plan: StartupPlan) -> Engine:
    """The engine of a started server (``plan.ok`` must hold)."""
    assert plan.memory is not None
    cost = CostModel(
        arch,
        flags.hardware,
        kv_cache_dtype=flags.kv_cache_dtype,
        dtype=flags.dtype,
        tensor_parallel_size=flags.tensor_parallel_size,
        block_size=flags.block_size,
    )
    config = EngineConfig(
        max_num_seqs=flags.max_num_seqs,
        max_num_batched_tokens=plan.max_num_batched_tokens,
        block_size=flags.block_size,
        num_blocks=plan.memory.num_blocks,
        enable_chunked_prefill=flags.enable_chunked_prefill,
    )
    return Engine(config, cost)


def simulate(
    flags: ServeFlags | Mapping[str, object],
    hardware: str | GpuProfile,
    model: str | ModelArch,
    workload: Sequence[WorkloadRequest],
    rate: float | None = None,
    *,
    seed: int = 0,
) -> SimResult:
    """Start the engine with ``flags`` (vLLM names, dashes or underscores) and replay ``workload``.

    With ``rate`` the workload's arrival times are replaced by Poisson arrivals at ``rate`` req/s
    (``inf``: all at once), drawn from ``seed``; ``seed`` also drives the startup's OOM randomness.
    """
    arch = model if isinstance(model, ModelArch) else load_model_arch(model)
    gpu = hardware if isinstance(hardware, GpuProfile) else gpu_profile(hardware)
    serve = _flags_from(arch.name, flags, gpu)
    rng = random.Random(seed)
    plan = plan_startup(serve, arch, rng)
    if not plan.ok:
        return SimResult(plan)
    engine = build_engine(serve, arch, plan)
    arrivals = [w.arrival for w in workload]
    if rate is not None:
        t = 0.0
        for i in range(len(arrivals)):
            if math.isfinite(rate):
                t += rng.expovariate(rate)
            arrivals[i] = t
    order = sorted(range(len(workload)), key=arrivals.__getitem__)
    pending: list[Request] = []
    failed = 0
    for i in order:
        w = workload[i]
        if w.prompt_len + w.output_len > plan.max_model_len or w.prompt_len < 1:
            failed += 1
            continue
        pending.append(Request(i, w.prompt_len, w.output_len, arrivals[i]))
    done: list[RequestMetrics] = []
    itl: list[float] = []
    now = pending[0].arrival if pending else 0.0
    start = now
    nxt = 0
    peak_running = 0
    peak_kv = 0.0
    while nxt < len(pending) or engine.has_work():
        if not engine.has_work() and pending[nxt].arrival > now:
            now = pending[nxt].arrival
        while nxt < len(pending) and pending[nxt].arrival <= now:
            engine.add(pending[nxt])
            nxt += 1
        result = engine.step()
        if result.scheduled_tokens == 0:
            if nxt >= len(pending):  # nothing can ever be scheduled: give up on the rest
                failed += len(engine.waiting) + len(engine.running)
                break
            now = max(now, pending[nxt].arrival)
            continue
        peak_running = max(peak_running, len(engine.running) + len(result.finished))
        peak_kv = max(peak_kv, engine.kv_usage)
        now += result.duration
        for req in result.emitted:
            if req.first_token_time < 0:
                req.first_token_time = now
            else:
                itl.append(now - req.last_token_time)
            req.last_token_time = now
        for req in result.finished:
            ttft = req.first_token_time - req.arrival
            e2el = now - req.arrival
            n = req.output_len
            tpot = (e2el - ttft) / (n - 1) if n > 1 else 0.0
            done.append(RequestMetrics(req.prompt_len, n, ttft, tpot, e2el, req.num_preemptions))
    return SimResult(
        startup=plan,
        requests=tuple(done),
        itl=tuple(itl),
        failed=failed,
        duration=now - start,
        num_preemptions=engine.num_preemptions,
        peak_running=peak_running,
        peak_kv_usage=peak_kv,
    )
