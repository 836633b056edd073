"""Startup of the simulated server: validation, memory accounting and the log it writes.

:func:`plan_startup` is pure (given a seeded RNG): it returns the log events with their times and either
the KV capacity (success) or the failure with vLLM's exact error text and exit status. Checks run in
vLLM's order: model config (max_model_len, TP), pydantic field bounds, scheduler config, attention
backend (block size / KV dtype), weight loading (OOM), memory profile (no KV memory, KV too small for
max_model_len), CUDA-graph capture (OOM close to the memory edge, seeded randomness).

Start delay (seconds, before ``--sim-speedup``): 2 + per-GPU weight GiB / 8 + 0.03 per CUDA graph
(+3 for TP > 1), e.g. ~6 s for Llama-3.1-8B. ``--sim-start-delay`` replaces it and ``--sim-slow-start``
adds to it; both are wall-clock seconds and not divided by the speedup.
"""

from __future__ import annotations

import enum
import math
import random
from dataclasses import dataclass

from autotune.catalog import GIB, ModelArch
from autotune.memory import MIB, MemoryPlan, cuda_graph_sizes, is_fp8, plan_memory
from autotune.sim.flags import ServeFlags

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


def _bound(
    value: float, *, gt: float | None = None, ge: float | None = None, le: float | None = None
) -> str | None:
    if gt is not None and not value > gt:
        return (
            f"Input should be greater than {gt:g} [type=greater_than, input_value={value}, "
            f"input_type={type(value).__name__}]"
        )
    if ge is not None and not value >= ge:
        return (
            f"Input should be greater than or equal to {ge:g} [type=greater_than_equal, "
            f"input_value={value}, input_type={type(value).__name__}]"
        )
    if le is not None and not value <= le:
        return (
            f"Input should be less than or equal to {le:g} [type=less_than_equal, "
            f"input_value={value}, input_type={type(value).__name__}]"
        )
    return None  # fmt: skip


def _engine_failure(at: float, error: str, detail: str = "") -> list[LogEvent]:
    trace = (
        "Traceback (most recent call last):\n"
        '  File "/opt/vllm/vllm/v1/engine/core.py", line 699, in run_engine_core\n'
        "    engine_core = EngineCoreProc(*args, **kwargs)\n"
        '  File "/opt/vllm/vllm/v1/engine/core.py", line 498, in __init__\n'
        "    super().__init__(vllm_config, executor_class, log_stats,\n"
        f"{detail}{error}"
    )
    events = [LogEvent(at, "ERROR", "core.py:708", "EngineCore failed to start.")]
    events += [LogEvent(at, "ERROR", "core.py:708", line) for line in trace.splitlines()]
    events.append(
        LogEvent(
            at,
            "",
            "",
            "Process EngineCore_DP0:\n"
            "Traceback (most recent call last):\n"
            '  File "/opt/vllm/vllm/v1/engine/utils.py", line 933, in wait_for_engine_startup\n'
            '    raise RuntimeError("Engine core initialization failed. "\n'
            "RuntimeError: Engine core initialization failed. See root cause above. "
            "Failed core proc(s): {}",
        )
    )
    return events


def start_delay(flags: ServeFlags, memory: MemoryPlan | None) -> float:
    """Wall seconds a successful start takes (see the module docstring)."""
    if flags.start_delay is not None:
        base = flags.start_delay
    else:
        weights = memory.weights_bytes / GIB if memory else 1.0
        graphs = len(cuda_graph_sizes(flags.max_num_seqs))
        simulated = 2.0 + weights / 8.0 + 0.03 * graphs
        simulated += 3.0 if flags.tensor_parallel_size > 1 else 0.0
        base = simulated / flags.speedup
    return base + flags.slow_start


def plan_startup(flags: ServeFlags, arch: ModelArch, rng: random.Random) -> StartupPlan:
    """Run vLLM's startup checks and memory accounting for ``flags``; never raises for bad flags."""
    gpu = flags.hardware
    tp = flags.tensor_parallel_size
    mml = flags.max_model_len or arch.max_position_embeddings
    mnbt = flags.resolved_max_num_batched_tokens(mml)
    events: list[LogEvent] = [
        LogEvent(0.0, "INFO", "api_server.py:1896", "vLLM API server version 0.34.0 (autotune.sim)"),
        LogEvent(0.0, "INFO", "utils.py:326", f"non-default args: {_non_default(flags)}"),
    ]
    for flag in flags.ignored:
        events.append(
            LogEvent(0.0, "WARNING", "arg_utils.py:87", f"Flag {flag} is not simulated; ignoring it.")
        )
    events.append(LogEvent(0.01, "INFO", "model.py:547", f"Resolved architecture: {arch.architecture}"))

    def fail(
        at: float,
        failure: StartFailure,
        error: str,
        extra: list[LogEvent],
        code: int = 1,
        memory: MemoryPlan | None = None,
    ) -> StartupPlan:
        delay = start_delay(flags, memory) * at
        return StartupPlan(tuple(events + extra), delay, mml, mnbt, memory, failure, error, code)  # fmt: skip

    early = 0.04
    if flags.max_model_len is not None and flags.max_model_len > arch.max_position_embeddings:
        error = (
            f"ValueError: User-specified max_model_len ({flags.max_model_len}) is greater than the "
            f"derived max_model_len (max_position_embeddings={float(arch.max_position_embeddings)} "
            "or model_max_length=None in model's config.json). To allow overriding this maximum, "
            "set the env var VLLM_ALLOW_LONG_MAX_MODEL_LEN=1. VLLM_ALLOW_LONG_MAX_MODEL_LEN must be "
            "used with extreme caution. If the model uses relative position encoding (RoPE), "
            "positions exceeding derived_max_model_len lead to nan. If the model uses absolute "
            "position encoding, positions exceeding derived_max_model_len will cause a CUDA array "
            "out-of-bounds error."
        )
        return fail(early, StartFailure.INVALID_CONFIG, error,
                    [LogEvent(early, "", "", f"{_TRACE_HEAD}\n{error}")])  # fmt: skip
    if tp < 1 or arch.num_heads % tp:
        error = (
            f"ValueError: Total number of attention heads ({arch.num_heads}) must be divisible "
            f"by tensor parallel size ({tp})."
        )
        return fail(early, StartFailure.INVALID_CONFIG, error,
                    [LogEvent(early, "", "", f"{_TRACE_HEAD}\n{error}")])  # fmt: skip
    bounds = [
        ("CacheConfig", "gpu_memory_utilization",
         _bound(flags.gpu_memory_utilization, gt=0, le=1)),
        ("CacheConfig", "block_size", _bound(flags.block_size, gt=0)),
        ("SchedulerConfig", "max_num_seqs", _bound(flags.max_num_seqs, ge=1)),
        ("SchedulerConfig", "max_num_batched_tokens", _bound(mnbt, ge=1)),
    ]  # fmt: skip
    for model, field, message in bounds:
        if message is not None:
            text = _pydantic(model, field, message)
            return fail(early, StartFailure.INVALID_CONFIG, message,
                        [LogEvent(early, "", "", text)])  # fmt: skip
    scheduler_error = None
    if not flags.enable_chunked_prefill and mnbt < mml:
        scheduler_error = (
            f"max_num_batched_tokens ({mnbt}) is smaller than max_model_len ({mml}). This "
            "effectively limits the maximum sequence length to max_num_batched_tokens and makes "
            "vLLM reject longer sequences. Please increase max_num_batched_tokens or decrease "
            "max_model_len."
        )
    elif mnbt < flags.max_num_seqs:
        scheduler_error = (
            f"max_num_batched_tokens ({mnbt}) must be greater than or equal to max_num_seqs "
            f"({flags.max_num_seqs})."
        )
    if scheduler_error is not None:
        message = (
            f"Value error, {scheduler_error} [type=value_error, "
            "input_value=ArgsKwargs((), {...}), input_type=ArgsKwargs]"
        )
        return fail(early, StartFailure.INVALID_CONFIG, scheduler_error,
                    [LogEvent(early, "", "", _pydantic("SchedulerConfig", "", message))])  # fmt: skip
    if not flags.enable_chunked_prefill:
        events.append(
            LogEvent(0.05, "WARNING", "scheduler.py:271",
                     "max_num_batched_tokens and chunked prefill are disabled; "
                     "the engine may crash on long prompts (chunked prefill is off).")
        )  # fmt: skip
    else:
        events.append(
            LogEvent(0.05, "INFO", "scheduler.py:262",
                     f"Chunked prefill is enabled with max_num_batched_tokens={mnbt}.")
        )  # fmt: skip
    dtype_name = "torch.bfloat16" if flags.dtype in ("auto", "bfloat16") else f"torch.{flags.dtype}"
    backend_ok = flags.block_size % 16 == 0
    if flags.kv_cache_dtype == "fp8_e5m2":  # only FlashInfer: 16/32/64
        backend_ok = flags.block_size in (16, 32, 64)
    if not backend_ok:
        error = (
            f"ValueError: No valid attention backend found for cuda with head_size: {arch.head_dim}, "
            f"dtype: {dtype_name}, kv_cache_dtype: {flags.kv_cache_dtype}, block_size: "
            f"{flags.block_size}, use_mla: False, has_sink: False, use_sparse: False. Reasons: "
            "{FLASH_ATTN: [block_size not supported], FLASHINFER: [block_size not supported], "
            "TRITON_ATTN: [block_size not supported]}."
        )
        return fail(0.1, StartFailure.INVALID_CONFIG, error, _engine_failure(0.1, error))

    memory = plan_memory(
        arch,
        gpu,
        gpu_memory_utilization=flags.gpu_memory_utilization,
        max_num_batched_tokens=mnbt,
        max_num_seqs=flags.max_num_seqs,
        block_size=flags.block_size,
        kv_cache_dtype=flags.kv_cache_dtype,
        dtype=flags.dtype,
        tensor_parallel_size=tp,
        max_model_len=mml,
    )
    events.append(LogEvent(0.1, "INFO", "gpu_model_runner.py:2602",
                           f"Starting to load model {flags.model}..."))  # fmt: skip
    if memory.weights_bytes + memory.non_torch_bytes > gpu.memory_bytes:
        layer = memory.weights_bytes / arch.num_layers
        used = gpu.memory_bytes - rng.uniform(0.05, 0.4) * layer
        return fail(0.4, StartFailure.OOM, "torch.OutOfMemoryError: CUDA out of memory",
                    _engine_failure(0.4, _oom_text(layer, used, gpu.memory_bytes)),
                    memory=memory)  # fmt: skip
    load_s = memory.weights_bytes / GIB / 8.0
    events.append(
        LogEvent(0.55, "INFO", "gpu_model_runner.py:2653",
                 f"Model loading took {memory.weights_bytes / GIB:.4f} GiB memory "
                 f"and {load_s:.6f} seconds")
    )  # fmt: skip
    if memory.kv_cache_bytes <= 0:
        error = (
            "ValueError: No available memory for the cache blocks. Try increasing "
            "`gpu_memory_utilization` when initializing the engine."
        )
        return fail(0.7, StartFailure.KV_TOO_SMALL, error, _engine_failure(0.7, error),
                    memory=memory)  # fmt: skip
    kv_gib = memory.kv_cache_bytes / GIB
    events.append(LogEvent(0.7, "INFO", "gpu_worker.py:298",
                           f"Available KV cache memory: {kv_gib:.2f} GiB"))  # fmt: skip
    if not memory.fits_max_model_len:
        needed = mml * memory.kv_bytes_per_token / GIB
        error = (
            "ValueError: To serve at least one request with the model's max seq len "
            f"({mml}), ({needed:.2f} GiB KV cache is needed, which is larger than the available "
            f"KV cache memory ({kv_gib:.2f} GiB). Based on the available memory, the estimated "
            f"maximum model length is {memory.estimated_max_model_len}. Try increasing "
            "`gpu_memory_utilization` or decreasing `max_model_len` when initializing the engine."
        )
        return fail(0.72, StartFailure.KV_TOO_SMALL, error, _engine_failure(0.72, error),
                    memory=memory)  # fmt: skip
    events.append(
        LogEvent(0.72, "INFO", "kv_cache_utils.py:1087",
                 f"GPU KV cache size: {memory.kv_tokens:,} tokens, Maximum concurrency for "
                 f"{mml:,} tokens per request: {memory.max_concurrency:.2f}x")
    )  # fmt: skip
    # CUDA-graph capture: the estimate subtracted above is not exact, and allocator slack and
    # workspaces appear only now; close to the device edge this pushes total use over it.
    graphs_actual = memory.cuda_graph_bytes * math.exp(rng.gauss(0.0, 0.4))
    slack = HIDDEN_RESERVE_BYTES + rng.uniform(0.0, 0.6) * GIB
    peak = memory.budget_bytes - memory.cuda_graph_bytes + graphs_actual + slack
    if peak > gpu.memory_bytes:
        request = max(2 * MIB, graphs_actual / 8)
        used = gpu.memory_bytes - rng.uniform(0.2, 0.9) * request
        return fail(0.95, StartFailure.OOM, "torch.OutOfMemoryError: CUDA out of memory",
                    _engine_failure(0.95, _oom_text(request, used, gpu.memory_bytes),
                                    detail="  File \"/opt/vllm/vllm/v1/worker/gpu_model_runner.py\","
                                    " line 3512, in capture_model\n"),
                    memory=memory)  # fmt: skip
    graphs = len(cuda_graph_sizes(flags.max_num_seqs))
    events += [
        LogEvent(0.95, "INFO", "gpu_model_runner.py:3480",
                 f"Graph capturing finished in {0.03 * graphs:.0f} secs, took "
                 f"{graphs_actual / GIB:.2f} GiB"),
        LogEvent(0.97, "INFO", "core.py:210",
                 "init engine (profile, create kv cache, warmup model) took "
                 f"{start_delay(flags, memory):.2f} seconds"),
    ]  # fmt: skip
    if is_fp8(flags.kv_cache_dtype):
        events.append(LogEvent(0.1, "INFO", "cache.py:152",
                               "Using fp8 data type to store kv cache. It reduces the GPU memory "
                               "footprint and boosts the performance."))  # fmt: skip
    events.sort(key=lambda e: e.at)
    return StartupPlan(tuple(events), start_delay(flags, memory), mml, mnbt, memory)


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


def _non_default(flags: ServeFlags) -> dict[str, object]:
    defaults = ServeFlags(model=flags.model)
    out: dict[str, object] = {"model_tag": flags.model}
    for name in (
        "host", "port", "gpu_memory_utilization", "block_size", "max_num_seqs",
        "max_num_batched_tokens", "kv_cache_dtype", "enable_chunked_prefill", "max_model_len",
        "tensor_parallel_size", "dtype", "served_model_name",
    ):  # fmt: skip
        value = getattr(flags, name)
        if value != getattr(defaults, name):
            out[name] = value
    return out
