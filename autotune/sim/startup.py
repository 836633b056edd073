"""Startup of the simulated server: validation, memory accounting and the log it writes.

:func:`plan_startup` is pure (given a seeded RNG): it returns the log events with their times and either
the KV capacity (success) or the failure with vLLM's exact error text and exit status. Config checks
come first (:func:`autotune.sim.resolve.resolve`: model, cache, parallel, speculative, scheduler and
whole-config checks, each failing as vLLM's pydantic ``ValidationError`` or ``ValueError``); then the
engine start: a data-parallel rank without a GPU (``--sim-gpus`` < tensor x data parallel size: torch's
``invalid device ordinal`` in that rank's engine core), the attention backend (block size / KV dtype),
weight loading (OOM), the memory profile (no KV memory, KV too small for max_model_len) and CUDA-graph
capture (OOM close to the memory edge, seeded randomness).

The log reports the effective configuration (:mod:`autotune.sim.report`): vLLM's ``non-default args``
line, ``Using max model len``, the chunked-prefill line, vLLM's engine-config line and the simulator's
own ``autotune.sim effective config`` line; one capacity line per data-parallel engine.

Start delay (seconds, before ``--sim-speedup``): 2 + per-GPU weight GiB / 8 + 0.03 per captured CUDA
graph (none in eager mode) (+3 for TP > 1), e.g. ~6 s for Llama-3.1-8B. ``--sim-start-delay`` replaces
it and ``--sim-slow-start`` adds to it; both are wall-clock seconds and not divided by the speedup.
"""

from __future__ import annotations

import enum
import math
import random
from dataclasses import dataclass, replace

from autotune.hardware.catalog import GIB, ModelArch
from autotune.hardware.memory import (
    MIB,
    MemoryPlan,
    cuda_graph_sizes,
    dtype_bytes,
    is_fp8,
    kv_bytes_per_token,
    plan_memory,
    weight_bytes,
)
from autotune.sim.cost import Physics
from autotune.sim.flags import ServeFlags
from autotune.sim.report import VLLM_VERSION, effective_config, engine_config_line, non_default_args
from autotune.sim.resolve import ConfigError, ResolvedConfig, resolve
from autotune.sim.speculative import HEAD_DRAFTERS

HIDDEN_RESERVE_BYTES = int(0.25 * GIB)
"""Memory used after the profile that the KV budget does not see (allocator caches, workspaces)."""


class StartFailure(enum.StrEnum):
    """Why a simulated start failed (the tuner's cause names where they exist)."""

    INVALID_CONFIG = "invalid_config"
    OOM = "oom"
    KV_TOO_SMALL = "kv_too_small"


@dataclass(frozen=True)
class LogEvent:
    """One log record at ``at`` (fraction of the start delay): level ``""`` means raw text lines."""

    at: float
    level: str
    source: str
    text: str


@dataclass(frozen=True)
class StartupPlan:
    """What a launch does before serving: its log, its delay, and its outcome."""

    events: tuple[LogEvent, ...]
    delay_s: float
    """Wall seconds from launch to ready (or to the failure)."""
    max_model_len: int
    max_num_batched_tokens: int
    memory: MemoryPlan | None
    failure: StartFailure | None = None
    error: str = ""
    """The decisive error line (empty on success)."""
    exit_code: int = 0
    config: ResolvedConfig | None = None
    """The effective configuration (None when a config check failed)."""

    @property
    def ok(self) -> bool:
        """Whether the server becomes ready."""
        return self.failure is None


def format_bytes(n: float) -> str:
    """torch's style: ``224.00 MiB`` below 1 GiB, ``1.50 GiB`` above."""
    if n >= GIB:
        return f"{n / GIB:.2f} GiB"
    return f"{n / MIB:.2f} MiB"


_TRACE_HEAD = (
    "Traceback (most recent call last):\n"
    '  File "<frozen runpy>", line 198, in _run_module_as_main\n'
    '  File "/opt/vllm/vllm/entrypoints/openai/api_server.py", line 2014, in <module>\n'
    "    uvloop.run(run_server(args))\n"
    '  File "/opt/vllm/vllm/engine/arg_utils.py", line 1342, in create_engine_config\n'
    "    scheduler_config = SchedulerConfig(**kwargs)"
)


def _pydantic(model: str, field: str, message: str) -> str:
    loc = f"{field}\n" if field else ""
    return (
        f"{_TRACE_HEAD}\n"
        f"pydantic_core._pydantic_core.ValidationError: 1 validation error for {model}\n"
        f"{loc}  {message}\n"
        "    For further information visit https://errors.pydantic.dev/2.11/v/value_error"
    )


def _engine_failure(at: float, error: str, detail: str = "", rank: int = 0) -> list[LogEvent]:
    trace = (
        "Traceback (most recent call last):\n"
        '  File "/opt/vllm/vllm/v1/engine/core.py", line 699, in run_engine_core\n'
        "    engine_core = EngineCoreProc(*args, **kwargs)\n"
        '  File "/opt/vllm/vllm/v1/engine/core.py", line 498, in __init__\n'
        "    super().__init__(vllm_config, executor_class, log_stats,\n"
        f"{detail}{error}"
    )
    failed = f"{{'EngineCore_DP{rank}': 1}}" if rank else "{}"
    events = [LogEvent(at, "ERROR", "core.py:708", "EngineCore failed to start.")]
    events += [LogEvent(at, "ERROR", "core.py:708", line) for line in trace.splitlines()]
    events.append(
        LogEvent(
            at,
            "",
            "",
            f"Process EngineCore_DP{rank}:\n"
            "Traceback (most recent call last):\n"
            '  File "/opt/vllm/vllm/v1/engine/utils.py", line 933, in wait_for_engine_startup\n'
            '    raise RuntimeError("Engine core initialization failed. "\n'
            "RuntimeError: Engine core initialization failed. See root cause above. "
            f"Failed core proc(s): {failed}",
        )
    )
    return events


def start_delay(flags: ServeFlags, memory: MemoryPlan | None, graphs: int | None = None) -> float:
    """Wall seconds a successful start takes (see the module docstring); ``graphs`` captured sizes."""
    if flags.start_delay is not None:
        base = flags.start_delay
    else:
        weights = memory.weights_bytes / GIB if memory else 1.0
        if graphs is None:
            graphs = len(cuda_graph_sizes(flags.max_num_seqs))
        simulated = 2.0 + weights / 8.0 + 0.03 * graphs
        simulated += 3.0 if flags.tensor_parallel_size > 1 else 0.0
        base = simulated / flags.speedup
    return base + flags.slow_start


def _config_failure(exc: ConfigError) -> tuple[str, str]:
    """(decisive error line, log text) of a config check vLLM fails while building its config."""
    if not exc.model:
        return exc.error, f"{_TRACE_HEAD}\n{exc.error}"
    return exc.error, _pydantic(exc.model, exc.loc, exc.error)


def _auto_fit(mml: int, memory: MemoryPlan) -> tuple[int, MemoryPlan, str]:
    """``--max-model-len auto``: vLLM's auto-fit to the KV cache, and its log line."""
    kv = f"{round(memory.kv_cache_bytes / GIB, 2)} GiB GPU"
    if memory.fits_max_model_len:
        line = "Auto-fit max_model_len: full model context length "
        return mml, memory, f"{line}{mml} fits in available KV cache memory ({kv})"
    fitted = memory.estimated_max_model_len
    line = f"--max-model-len auto reduced max_model_len from {mml} to {fitted} "
    line += f"({kv} available for the KV cache)."
    if fitted < 8192:
        line += f" Requests longer than {fitted} tokens will be rejected. "
        line += "Increase `gpu_memory_utilization` or set --max-model-len explicitly."
    return fitted, replace(memory, max_model_len=fitted), line


def _draft_memory(cfg: ResolvedConfig, arch: ModelArch, dtype: str) -> tuple[int, int]:
    """(weight bytes, KV bytes per token) a speculative drafter adds on one GPU."""
    spec = cfg.speculative
    if spec is None or spec.draft is None:
        return 0, 0
    draft, tp = spec.draft, spec.draft_tensor_parallel_size
    weights = weight_bytes(draft, dtype, tp)
    if spec.method in HEAD_DRAFTERS or spec.method.endswith("_mtp"):  # shares the target's LM head
        weights -= draft.vocab_size * draft.hidden_size * dtype_bytes(
            arch.torch_dtype if dtype == "auto" else dtype) // tp  # fmt: skip
    return weights, kv_bytes_per_token(draft, cfg.kv_cache_dtype, dtype, tp)


@dataclass(frozen=True)
class _Failed:
    """A start check that failed: when (fraction of the start delay), why, and the lines it logs."""

    at: float
    failure: StartFailure
    error: str
    """The decisive error line."""
    events: tuple[LogEvent, ...]


def plan_startup(
    flags: ServeFlags, arch: ModelArch, rng: random.Random, *, physics: Physics | None = None
) -> StartupPlan:
    """Run vLLM's startup checks and memory accounting for ``flags``, on the GPU's ``physics`` (default:
    the memory model's own terms); never raises for bad flags."""
    physics = physics or Physics()
    mml = flags.derived_max_model_len(arch.max_position_embeddings)
    mnbt = flags.resolved_max_num_batched_tokens(mml)
    events = _launch_events(flags, arch)
    early = 0.04
    try:
        cfg = resolve(flags, arch)
    except ConfigError as exc:
        error, text = _config_failure(exc)
        invalid = _Failed(early, StartFailure.INVALID_CONFIG, error, (LogEvent(early, "", "", text),))
        return _failed_plan(flags, events, invalid, mml, mnbt)
    events += _config_events(flags, cfg, mml, mnbt)
    failed = _missing_gpu(cfg) or _attention_backend(flags, arch)
    if failed is not None:
        return _failed_plan(flags, events, failed, mml, mnbt, cfg=cfg)
    return _start_engine(flags, arch, cfg, rng, physics, events, mml, mnbt)


def _failed_plan(
    flags: ServeFlags,
    events: list[LogEvent],
    failed: _Failed,
    mml: int,
    mnbt: int,
    memory: MemoryPlan | None = None,
    cfg: ResolvedConfig | None = None,
) -> StartupPlan:
    """The plan of a start that fails: the log so far plus the failure's lines, exit status 1."""
    delay = start_delay(flags, memory) * failed.at
    return StartupPlan(
        (*events, *failed.events), delay, mml, mnbt, memory, failed.failure, failed.error, 1, cfg
    )


def _launch_events(flags: ServeFlags, arch: ModelArch) -> list[LogEvent]:
    """The first log lines of every launch: version, non-default args, ignored flags, architecture."""
    events: list[LogEvent] = [
        LogEvent(0.0, "INFO", "api_server.py:1896", f"vLLM API server version {VLLM_VERSION} (autotune.sim)"),
        LogEvent(0.0, "INFO", "startup.py:96", f"non-default args: {non_default_args(flags)}"),
    ]
    for flag in flags.ignored:
        events.append(
            LogEvent(0.0, "WARNING", "arg_utils.py:87", f"Flag {flag} is not simulated; ignoring it.")
        )
    events.append(LogEvent(0.01, "INFO", "model.py:761", f"Resolved architecture: {arch.architecture}"))
    return events


def _config_events(flags: ServeFlags, cfg: ResolvedConfig, mml: int, mnbt: int) -> list[LogEvent]:
    """The log lines of a config that passed its checks: max model len, chunked prefill, eager mode,
    vLLM's engine-config line and the simulator's effective-config line."""
    events = [LogEvent(0.02, "INFO", "model.py:2214", f"Using max model len {mml}")]
    if not cfg.enable_chunked_prefill:
        events.append(
            LogEvent(0.05, "WARNING", "arg_utils.py:3141",
                     "This model does not officially support disabling chunked prefill. Disabling this "
                     "manually may cause the engine to crash or produce incorrect outputs.")
        )  # fmt: skip
    else:
        events.append(
            LogEvent(0.05, "INFO", "scheduler.py:355",
                     f"Chunked prefill is enabled with max_num_batched_tokens={mnbt}.")
        )  # fmt: skip
    if cfg.enforce_eager:
        events.append(
            LogEvent(0.05, "WARNING", "vllm.py:1710",
                     "Enforce eager set, disabling torch.compile, CUDAGraphs, and JIT kernel warmup. This "
                     "is equivalent to setting -cc.mode=none -cc.cudagraph_mode=none and "
                     "--kernel_config.enable_jit_warmup=False")
        )  # fmt: skip
    events += [
        LogEvent(0.06, "INFO", "core.py:153", engine_config_line(flags, cfg)),
        LogEvent(0.06, "INFO", "sim.py:2", f"autotune.sim effective config: {effective_config(cfg)}"),
    ]
    return events


def _missing_gpu(cfg: ResolvedConfig) -> _Failed | None:
    """A data-parallel rank without a GPU of the node: torch's ``invalid device ordinal`` in its engine."""
    tp = cfg.tensor_parallel_size
    if tp * cfg.data_parallel_size <= cfg.gpus:
        return None
    error = (
        "torch.AcceleratorError: CUDA error: invalid device ordinal\n"
        "GPU device may be out of range, do you have enough GPUs?\n"
        "CUDA kernel errors might be asynchronously reported at some other API call, so the "
        "stacktrace below might be incorrect.\n"
        "For debugging consider passing CUDA_LAUNCH_BLOCKING=1\n"
        "Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions."
    )
    detail = '  File "/opt/vllm/vllm/v1/worker/gpu_worker.py", line 262, in init_device\n'
    events = _engine_failure(0.08, error, detail, rank=cfg.gpus // tp)
    return _Failed(0.08, StartFailure.INVALID_CONFIG, error.splitlines()[0], tuple(events))


def _attention_backend(flags: ServeFlags, arch: ModelArch) -> _Failed | None:
    """No attention backend for the block size / KV dtype (fp8_e5m2: FlashInfer only, 16/32/64)."""
    backend_ok = flags.block_size % 16 == 0
    if flags.kv_cache_dtype == "fp8_e5m2":  # only FlashInfer: 16/32/64
        backend_ok = flags.block_size in (16, 32, 64)
    if backend_ok:
        return None
    dtype_name = "torch.bfloat16" if flags.dtype in ("auto", "bfloat16") else f"torch.{flags.dtype}"
    error = (
        f"ValueError: No valid attention backend found for cuda with head_size: {arch.head_dim}, "
        f"dtype: {dtype_name}, kv_cache_dtype: {flags.kv_cache_dtype}, block_size: "
        f"{flags.block_size}, use_mla: False, has_sink: False, use_sparse: False. Reasons: "
        "{FLASH_ATTN: [block_size not supported], FLASHINFER: [block_size not supported], "
        "TRITON_ATTN: [block_size not supported]}."
    )
    return _Failed(0.1, StartFailure.INVALID_CONFIG, error, tuple(_engine_failure(0.1, error)))


def _start_engine(
    flags: ServeFlags,
    arch: ModelArch,
    cfg: ResolvedConfig,
    rng: random.Random,
    physics: Physics,
    events: list[LogEvent],
    mml: int,
    mnbt: int,
) -> StartupPlan:
    """Weight loading, the KV-cache profile and CUDA-graph capture of a config that passed its checks."""
    graphs = len(cfg.cudagraph_capture_sizes)
    memory = _plan_memory(flags, arch, cfg, physics, mml, mnbt)
    delay = start_delay(flags, memory, graphs)
    failed = _load_weights(flags, arch, memory, rng, events) or _kv_memory(memory, events)
    if failed is None and flags.max_model_len == -1:
        mml, memory, line = _auto_fit(mml, memory)
        events.append(LogEvent(0.71, "INFO" if memory.max_model_len >= 8192 else "WARNING",
                               "kv_cache_planning.py:1493", line))  # fmt: skip
        cfg = replace(cfg, max_model_len=mml)
    failed = failed or _max_model_len_fits(mml, memory)
    if failed is not None:
        return _failed_plan(flags, events, failed, mml, mnbt, memory, cfg)
    events += [
        LogEvent(0.72, "INFO", "kv_cache_utils.py:1087",
                 f"GPU KV cache size: {memory.kv_tokens:,} tokens, Maximum concurrency for "
                 f"{mml:,} tokens per request: {memory.max_concurrency:.2f}x")
        for _ in range(cfg.data_parallel_size)
    ]  # fmt: skip
    graphs_actual, failed = _capture_graphs(flags.hardware.memory_bytes, memory, physics, rng)
    if failed is not None:
        return _failed_plan(flags, events, failed, mml, mnbt, memory, cfg)
    events += _ready_events(flags, graphs, graphs_actual, delay)
    events.sort(key=lambda e: e.at)
    return StartupPlan(tuple(events), delay, mml, mnbt, memory, config=cfg)


def _plan_memory(
    flags: ServeFlags, arch: ModelArch, cfg: ResolvedConfig, physics: Physics, mml: int, mnbt: int
) -> MemoryPlan:
    """The memory profile of one GPU: weights (with a drafter's), activations, CUDA graphs, KV cache."""
    draft_weights, draft_kv = _draft_memory(cfg, arch, flags.dtype)
    return plan_memory(
        arch,
        flags.hardware,
        gpu_memory_utilization=flags.gpu_memory_utilization,
        max_num_batched_tokens=mnbt,
        max_num_seqs=flags.max_num_seqs,
        block_size=flags.block_size,
        kv_cache_dtype=flags.kv_cache_dtype,
        dtype=flags.dtype,
        tensor_parallel_size=flags.tensor_parallel_size,
        max_model_len=mml,
        num_cuda_graphs=len(cfg.cudagraph_capture_sizes),
        extra_weight_bytes=draft_weights,
        extra_kv_bytes_per_token=draft_kv,
        activation_scale=physics.activation_scale,
        cuda_graph_scale=physics.cuda_graph_scale,
        extra_non_torch_bytes=physics.extra_non_torch_bytes,
    )


def _load_weights(
    flags: ServeFlags, arch: ModelArch, memory: MemoryPlan, rng: random.Random, events: list[LogEvent]
) -> _Failed | None:
    """Weight loading: its log lines appended to ``events``, or the OOM when weights do not fit."""
    total = flags.hardware.memory_bytes
    events.append(LogEvent(0.1, "INFO", "gpu_model_runner.py:2602",
                           f"Starting to load model {flags.model}..."))  # fmt: skip
    if memory.weights_bytes + memory.non_torch_bytes > total:
        layer = memory.weights_bytes / arch.num_layers
        used = total - rng.uniform(0.05, 0.4) * layer
        oom = _engine_failure(0.4, _oom_text(layer, used, total))
        return _Failed(0.4, StartFailure.OOM, "torch.OutOfMemoryError: CUDA out of memory", tuple(oom))
    load_s = memory.weights_bytes / GIB / 8.0
    events.append(
        LogEvent(0.55, "INFO", "gpu_model_runner.py:2653",
                 f"Model loading took {memory.weights_bytes / GIB:.4f} GiB memory "
                 f"and {load_s:.6f} seconds")
    )  # fmt: skip
    return None


def _kv_memory(memory: MemoryPlan, events: list[LogEvent]) -> _Failed | None:
    """The profile's KV-cache memory: its log line appended to ``events``, or the failure when none is
    left."""
    if memory.kv_cache_bytes <= 0:
        error = (
            "ValueError: No available memory for the cache blocks. Try increasing "
            "`gpu_memory_utilization` when initializing the engine."
        )
        return _Failed(0.7, StartFailure.KV_TOO_SMALL, error, tuple(_engine_failure(0.7, error)))
    events.append(LogEvent(0.7, "INFO", "gpu_worker.py:298",
                           f"Available KV cache memory: {memory.kv_cache_bytes / GIB:.2f} GiB"))  # fmt: skip
    return None


def _max_model_len_fits(mml: int, memory: MemoryPlan) -> _Failed | None:
    """The failure when one request of ``mml`` tokens does not fit the KV cache."""
    if memory.fits_max_model_len:
        return None
    needed = mml * memory.kv_bytes_per_token / GIB
    error = (
        "ValueError: To serve at least one request with the model's max seq len "
        f"({mml}), ({needed:.2f} GiB KV cache is needed, which is larger than the available "
        f"KV cache memory ({memory.kv_cache_bytes / GIB:.2f} GiB). Based on the available memory, the "
        f"estimated maximum model length is {memory.estimated_max_model_len}. Try increasing "
        "`gpu_memory_utilization` or decreasing `max_model_len` when initializing the engine."
    )
    return _Failed(0.72, StartFailure.KV_TOO_SMALL, error, tuple(_engine_failure(0.72, error)))


def _capture_graphs(
    total: int, memory: MemoryPlan, physics: Physics, rng: random.Random
) -> tuple[float, _Failed | None]:
    """CUDA-graph capture on a device of ``total`` bytes: (graph bytes it really took, the OOM when the
    peak passes the device).

    The estimate subtracted from the KV budget is not exact, and allocator slack and workspaces appear
    only now; close to the device edge this pushes total use over it."""
    graphs_actual = memory.cuda_graph_bytes * math.exp(rng.gauss(0.0, 0.4))
    slack = HIDDEN_RESERVE_BYTES + physics.extra_reserve_bytes + rng.uniform(0.0, 0.6) * GIB
    peak = memory.budget_bytes - memory.cuda_graph_bytes + graphs_actual + slack
    if peak <= total:
        return graphs_actual, None
    request = max(2 * MIB, graphs_actual / 8)
    used = total - rng.uniform(0.2, 0.9) * request
    detail = '  File "/opt/vllm/vllm/v1/worker/gpu_model_runner.py", line 3512, in capture_model\n'
    oom = _engine_failure(0.95, _oom_text(request, used, total), detail=detail)
    return graphs_actual, _Failed(0.95, StartFailure.OOM, "torch.OutOfMemoryError: CUDA out of memory",
                                  tuple(oom))  # fmt: skip


def _ready_events(flags: ServeFlags, graphs: int, graphs_actual: float, delay: float) -> list[LogEvent]:
    """The last log lines of a successful start: graph capture, engine init time, the fp8 KV note."""
    events = []
    if graphs:
        events.append(
            LogEvent(0.95, "INFO", "gpu_model_runner.py:1217",
                     f"Graph capturing finished in {0.03 * graphs:.0f} secs, took "
                     f"{graphs_actual / GIB:.2f} GiB")
        )  # fmt: skip
    events.append(
        LogEvent(0.97, "INFO", "core.py:459",
                 f"init engine (profile, create kv cache, warmup model) took {delay:.2f} s")
    )  # fmt: skip
    if is_fp8(flags.kv_cache_dtype):
        events.append(LogEvent(0.1, "INFO", "cache.py:152",
                               "Using fp8 data type to store kv cache. It reduces the GPU memory "
                               "footprint and boosts the performance."))  # fmt: skip
    return events


def _oom_text(request: float, used: float, total: int) -> str:
    free = max(0.0, total - used)
    return (
        f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {format_bytes(request)}. "
        f"GPU 0 has a total capacity of {format_bytes(total)} of which {format_bytes(free)} is "
        f"free. Including non-PyTorch memory, this process has {format_bytes(used)} memory in "
        f"use. Of the allocated memory {format_bytes(used * 0.93)} is allocated by PyTorch, and "
        f"{format_bytes(used * 0.04)} is reserved by PyTorch but unallocated. If reserved but "
        "unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "
        "to avoid fragmentation.  See documentation for Memory Management  "
        "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
    )
