"""The effective configuration of a simulated launch: every flag resolved, and vLLM's config checks.

:func:`resolve` turns :class:`~autotune.sim.flags.ServeFlags` into the :class:`ResolvedConfig` the engine
runs with (the values the start-up log and ``vllm:cache_config_info`` report), or raises
:class:`ConfigError` carrying vLLM 0.34's text for the first check that fails, in vLLM's order: model
config (max_model_len), cache config bounds, parallel config (world size against the node's GPUs),
speculative config, scheduler config, then the whole-config checks (TP against attention heads,
``--optimization-level``, CUDA-graph sizes).

Resolution of what was not given: max_model_len = the model's; max_num_batched_tokens = 2048 with chunked
prefill, else max(max_model_len, 2048); prefix caching and async scheduling on (vLLM's defaults);
``-O2`` (compilation on, FULL_AND_PIECEWISE CUDA graphs); CUDA-graph capture sizes 1, 2, 4, then
multiples of 8 up to min(2 x max_num_seqs, 512) (:func:`autotune.hardware.memory.cuda_graph_sizes`). With
``--max-cudagraph-capture-size M`` the sizes are vLLM's grid: 1, 2, 4, multiples of 8 below 256, then
multiples of 16, up to min(M, max_num_batched_tokens), plus max_num_batched_tokens when it fits;
explicit ``--cudagraph-capture-sizes`` are deduplicated, sorted and cut at max_num_batched_tokens.
``--enforce-eager``, ``-O0`` or ``cudagraph_mode: NONE`` capture nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from autotune.errors import AutotuneError
from autotune.hardware.catalog import ModelArch
from autotune.hardware.memory import cuda_graph_sizes
from autotune.sim.cost import Execution
from autotune.sim.flags import ServeFlags
from autotune.sim.speculative import SpecConfigError, SpecDecode, parse_speculative_config

CUDAGRAPH_MODES = ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
COMPILATION_MODES = ("NONE", "STOCK_TORCH_COMPILE", "DYNAMO_TRACE_ONCE", "VLLM_COMPILE")
_DTYPES = {"half": "float16", "float16": "float16", "bfloat16": "bfloat16", "float": "float32",
           "float32": "float32"}  # fmt: skip


class ConfigError(AutotuneError):
    """A config check failed: vLLM raises ``error`` from pydantic model ``model`` (at field ``loc``),
    or as a plain exception when ``model`` is empty."""

    def __init__(self, error: str, model: str = "", loc: str = "") -> None:
        super().__init__(error)
        self.error = error
        self.model = model
        self.loc = loc


@dataclass(frozen=True)
class ResolvedConfig:
    """The values a simulated launch runs with."""

    max_model_len: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    gpu_memory_utilization: float
    kv_cache_dtype: str
    dtype: str
    """The weights' torch dtype name (``bfloat16``)."""
    enable_prefix_caching: bool
    enable_chunked_prefill: bool
    tensor_parallel_size: int
    data_parallel_size: int
    gpus: int
    """GPUs of the simulated node."""
    async_scheduling: bool
    enforce_eager: bool
    optimization_level: int
    compilation_mode: int
    """vLLM's CompilationMode: 0 (NONE) or 3 (VLLM_COMPILE)."""
    cudagraph_mode: str
    cudagraph_capture_sizes: tuple[int, ...]
    long_prefill_token_threshold: int
    long_prefill_token_threshold_adaptive: bool
    speculative: SpecDecode | None
    acceptance_rate: float
    user_specified_block_size: bool

    @property
    def max_cudagraph_capture_size(self) -> int:
        """The largest captured batch in tokens (0 when nothing is captured)."""
        return self.cudagraph_capture_sizes[-1] if self.cudagraph_capture_sizes else 0

    @property
    def execution(self) -> Execution:
        """How steps run on the host (for the cost model)."""
        mode = self.cudagraph_mode
        graph = "none" if mode == "NONE" or not self.cudagraph_capture_sizes else (
            "piecewise" if mode == "PIECEWISE" else "full")  # fmt: skip
        return Execution(self.async_scheduling, graph, self.max_cudagraph_capture_size or None)


def _bound(value: float, *, gt: float | None = None, ge: float | None = None,
           le: float | None = None) -> str | None:  # fmt: skip
    kind = type(value).__name__
    if gt is not None and not value > gt:
        return (
            f"Input should be greater than {gt:g} [type=greater_than, input_value={value}, input_type={kind}]"
        )
    if ge is not None and not value >= ge:
        return (f"Input should be greater than or equal to {ge:g} [type=greater_than_equal, "
                f"input_value={value}, input_type={kind}]")  # fmt: skip
    if le is not None and not value <= le:
        return (f"Input should be less than or equal to {le:g} [type=less_than_equal, "
                f"input_value={value}, input_type={kind}]")  # fmt: skip
    return None


def _value_error(text: str) -> str:
    return (
        f"Value error, {text} [type=value_error, input_value=ArgsKwargs((), {{...}}), input_type=ArgsKwargs]"
    )


def _vllm_grid(largest: int, max_num_batched_tokens: int) -> tuple[int, ...]:
    sizes = [s for s in (1, 2, 4) if s <= largest]
    sizes += list(range(8, min(largest + 1, 256), 8)) + list(range(256, largest + 1, 16))
    if max_num_batched_tokens <= largest:
        sizes.append(max_num_batched_tokens)
    return tuple(sorted(set(sizes)))


def _optimization_level(value: int | str) -> int:
    text = str(value)
    if text not in ("0", "1", "2", "3"):
        raise ConfigError(
            f"Input should be 0, 1, 2 or 3 [type=enum, input_value={value!r}, "
            f"input_type={type(value).__name__}]",
            "VllmConfig",
            "optimization_level",
        )
    return int(text)


def _compilation(flags: ServeFlags, level: int) -> tuple[int, str]:
    cc: dict[str, Any] = dict(flags.compilation_config or {})
    mode_value = cc.get("mode")
    if isinstance(mode_value, str) and mode_value.upper() in COMPILATION_MODES:
        mode = COMPILATION_MODES.index(mode_value.upper())
    elif isinstance(mode_value, int) and 0 <= mode_value <= 3:
        mode = mode_value
    else:
        mode = 3 if level > 0 else 0
    graph_value = cc.get("cudagraph_mode")
    if graph_value is None:
        graph = ("NONE", "PIECEWISE", "FULL_AND_PIECEWISE", "FULL_AND_PIECEWISE")[level]
    elif str(graph_value).upper() in CUDAGRAPH_MODES:
        graph = str(graph_value).upper()
    else:
        raise ConfigError(f"KeyError: {str(graph_value)!r}")
    if flags.enforce_eager:
        return 0, "NONE"
    return mode, graph


def _capture_sizes(flags: ServeFlags, graph: str, max_num_seqs: int, mnbt: int) -> tuple[int, ...]:
    if graph == "NONE":
        return ()
    cc = flags.compilation_config or {}
    explicit = flags.cudagraph_capture_sizes or cc.get("cudagraph_capture_sizes")
    largest = flags.max_cudagraph_capture_size or cc.get("max_cudagraph_capture_size")
    if explicit:
        sizes = tuple(sorted({int(s) for s in explicit if int(s) <= mnbt}))
        if largest is not None and sizes and int(largest) != sizes[-1]:
            raise ConfigError(
                _value_error(
                    f"customized max_cudagraph_capture_size(={largest}) should be consistent with the "
                    f"max value of cudagraph_capture_sizes(={sizes[-1]})"
                ),
                "VllmConfig",
            )
        return sizes
    if largest is not None:
        return _vllm_grid(min(int(largest), mnbt), mnbt)
    return tuple(cuda_graph_sizes(max_num_seqs))


def resolve(flags: ServeFlags, arch: ModelArch) -> ResolvedConfig:
    """The effective configuration of ``flags`` for ``arch``; :class:`ConfigError` when vLLM rejects it."""
    tp, dp = flags.tensor_parallel_size, flags.data_parallel_size
    mml = flags.derived_max_model_len(arch.max_position_embeddings)
    mnbt = flags.resolved_max_num_batched_tokens(mml)
    _model_checks(flags, arch)
    _bound_checks(flags)
    gpus = _node_gpus(flags)
    speculative = _speculative(flags, arch)
    _scheduler_checks(flags, mml, mnbt)
    _head_checks(arch, tp)
    level = _optimization_level(flags.optimization_level)
    mode, graph = _compilation(flags, level)
    sizes = _capture_sizes(flags, graph, flags.max_num_seqs, mnbt)
    weights_dtype = arch.torch_dtype if flags.dtype == "auto" else flags.dtype
    return ResolvedConfig(
        max_model_len=mml,
        block_size=flags.block_size,
        max_num_seqs=flags.max_num_seqs,
        max_num_batched_tokens=mnbt,
        gpu_memory_utilization=flags.gpu_memory_utilization,
        kv_cache_dtype=flags.kv_cache_dtype,
        dtype=_DTYPES.get(weights_dtype, weights_dtype),
        enable_prefix_caching=True if flags.enable_prefix_caching is None else flags.enable_prefix_caching,
        enable_chunked_prefill=flags.enable_chunked_prefill,
        tensor_parallel_size=tp,
        data_parallel_size=dp,
        gpus=gpus,
        async_scheduling=True if flags.async_scheduling is None else flags.async_scheduling,
        enforce_eager=flags.enforce_eager,
        optimization_level=level,
        compilation_mode=mode,
        cudagraph_mode=graph,
        cudagraph_capture_sizes=sizes,
        long_prefill_token_threshold=flags.long_prefill_token_threshold,
        long_prefill_token_threshold_adaptive=flags.long_prefill_token_threshold_adaptive,
        speculative=speculative,
        acceptance_rate=flags.acceptance_rate,
        user_specified_block_size=_user_specified_block_size(flags),
    )


def _model_checks(flags: ServeFlags, arch: ModelArch) -> None:
    """Model config: a given max_model_len above the model's max_position_embeddings is rejected."""
    if flags.max_model_len is not None and flags.max_model_len > arch.max_position_embeddings:
        raise ConfigError(
            f"ValueError: User-specified max_model_len ({flags.max_model_len}) is greater than the "
            f"derived max_model_len (max_position_embeddings={float(arch.max_position_embeddings)} "
            "or model_max_length=None in model's config.json). To allow overriding this maximum, "
            "set the env var VLLM_ALLOW_LONG_MAX_MODEL_LEN=1. VLLM_ALLOW_LONG_MAX_MODEL_LEN must be "
            "used with extreme caution. If the model uses relative position encoding (RoPE), "
            "positions exceeding derived_max_model_len lead to nan. If the model uses absolute "
            "position encoding, positions exceeding derived_max_model_len will cause a CUDA array "
            "out-of-bounds error."
        )


def _bound_checks(flags: ServeFlags) -> None:
    """Cache and parallel config field bounds (pydantic's texts), in vLLM's order."""
    checks = [
        ("CacheConfig", "gpu_memory_utilization", _bound(flags.gpu_memory_utilization, gt=0, le=1)),
        ("CacheConfig", "block_size", _bound(flags.block_size, gt=0)),
        ("ParallelConfig", "tensor_parallel_size", _bound(flags.tensor_parallel_size, ge=1)),
        ("ParallelConfig", "data_parallel_size", _bound(flags.data_parallel_size, ge=1)),
    ]
    for model, loc, message in checks:
        if message is not None:
            raise ConfigError(message, model, loc)


def _node_gpus(flags: ServeFlags) -> int:
    """GPUs of the simulated node (default TP x DP); a TP group larger than the node is rejected."""
    tp = flags.tensor_parallel_size
    gpus = flags.gpus if flags.gpus is not None else tp * flags.data_parallel_size
    if gpus < tp:
        raise ConfigError(
            _value_error(
                f"World size ({tp}) is larger than the number of available GPUs ({gpus}) in this node. "
                "If this is intentional and you are using:\n"
                "- ray, set '--distributed-executor-backend ray'.\n"
                "- multiprocessing, set '--nnodes' appropriately."
            ),
            "ParallelConfig",
        )
    return gpus


def _speculative(flags: ServeFlags, arch: ModelArch) -> SpecDecode | None:
    """The parsed ``--speculative-config`` (None without one); its errors as SpeculativeConfig's."""
    if flags.speculative_config is None:
        return None
    try:
        return parse_speculative_config(flags.speculative_config, arch, flags.tensor_parallel_size)
    except SpecConfigError as exc:
        raise ConfigError(exc.message, "SpeculativeConfig", exc.loc) from None


def _head_checks(arch: ModelArch, tp: int) -> None:
    """The whole-config check that tensor parallelism divides the attention heads."""
    if arch.num_heads % tp:
        raise ConfigError(
            _value_error(
                f"Total number of attention heads ({arch.num_heads}) must be divisible by tensor "
                f"parallel size ({tp})."
            ),
            "VllmConfig",
        )


def _user_specified_block_size(flags: ServeFlags) -> bool:
    """Whether the block size was given (on the command line, or differing from the default)."""
    return (
        any(dest == "block_size" for dest, _ in flags.cli_args)
        or flags.block_size != ServeFlags(model=flags.model).block_size
    )


def _scheduler_checks(flags: ServeFlags, mml: int, mnbt: int) -> None:
    for loc, message in (
        ("max_num_seqs", _bound(flags.max_num_seqs, ge=1)),
        ("max_num_batched_tokens", _bound(mnbt, ge=1)),
        ("long_prefill_token_threshold", _bound(flags.long_prefill_token_threshold, ge=0)),
    ):
        if message is not None:
            raise ConfigError(message, "SchedulerConfig", loc)
    error = None
    if not flags.enable_chunked_prefill and mnbt < mml:
        error = (
            f"max_num_batched_tokens ({mnbt}) is smaller than max_model_len ({mml}). This "
            "effectively limits the maximum sequence length to max_num_batched_tokens and makes "
            "vLLM reject longer sequences. Please increase max_num_batched_tokens or decrease "
            "max_model_len."
        )
    elif mnbt < flags.max_num_seqs:
        error = (
            f"max_num_batched_tokens ({mnbt}) must be greater than or equal to max_num_seqs "
            f"({flags.max_num_seqs})."
        )
    elif flags.long_prefill_token_threshold > mml:
        error = (
            f"long_prefill_token_threshold ({flags.long_prefill_token_threshold}) cannot be greater "
            f"than the max_model_len ({mml})."
        )
    if error is not None:
        raise ConfigError(_value_error(error), "SchedulerConfig")
