"""Command line of the simulated server: ``vllm serve`` flags, ``--config`` files and ``--sim-*`` options.

Parsing follows vLLM 0.34's ``FlexibleArgumentParser``: ``--some_flag`` equals ``--some-flag``; ``-O3``,
``-O=3`` and ``-O 3`` mean ``--optimization-level 3``; ``--json-flag.key value`` builds a JSON flag key by
key; ``--config FILE.yaml`` turns keys into flags (``key: true`` -> ``--key``, ``key: false`` ->
``--no-key`` only for dashed keys, lists expand, dicts become JSON) and the command line wins over the
file; unique prefixes of a flag are accepted (argparse's abbreviations). Every option of vLLM 0.34's
``vllm serve`` is accepted (:mod:`autotune.sim.vllm_options`); those this twin does not model are reported
in :attr:`ServeFlags.ignored`. Anything else is vLLM's own error, from its top-level ``vllm`` parser,
exit status 2::

    usage: vllm [-h] [-v]
                {chat,complete,serve,launch,bench,collect-env,download-kernels,preload,run-batch,snapshot}
                ...
    vllm: error: unrecognized arguments: --bogus 1

A bad value of a known flag is the ``vllm serve`` parser's error (``vllm serve: error: argument ...``).
Range checks that vLLM does with pydantic happen at startup (:mod:`autotune.sim.startup`), not here.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from autotune.errors import AutotuneError, SpecError
from autotune.hardware.catalog import GIB, GPUS, GpuProfile, gpu_profile
from autotune.hardware.memory import KV_CACHE_DTYPES
from autotune.sim.vllm_options import DEST_ORDER, OPTIONS

PROG = "vllm serve"
SERVE_USAGE = "usage: vllm serve [model_tag] [options]"
TOP_USAGE = (
    "usage: vllm [-h] [-v]\n"
    "            {chat,complete,serve,launch,bench,collect-env,download-kernels,preload,run-batch,snapshot}\n"
    "            ..."
)
"""The usage line of vLLM 0.34's top-level ``vllm`` parser, which reports unrecognized arguments."""

DEFAULT_ACCEPTANCE_RATE = 0.7
"""``--sim-acceptance-rate``: probability that one draft token is accepted, given its predecessors were."""


class FlagError(AutotuneError):
    """A command-line error argparse-style: ``str()`` is the ``error:`` message; exit status 2."""

    exit_code = 2

    def __init__(self, message: str, usage: str = SERVE_USAGE, prog: str = PROG) -> None:
        super().__init__(message)
        self.message = message
        self.usage = usage
        self.prog = prog

    def render(self) -> str:
        """The two lines argparse would print: usage, then ``prog: error: message``."""
        return f"{self.usage.rstrip()}\n{self.prog}: error: {self.message}\n"


@dataclass(frozen=True)
class ServeFlags:
    """Every option of one simulated ``vllm serve`` launch.

    ``None`` means "not given": the startup resolves it as vLLM would (:mod:`autotune.sim.resolve`).
    The defaults of the scheduler and cache flags are the simulator's (pre-0.34 vLLM's, see the
    package docstring); the start-up log reports the values used.
    """

    model: str
    served_model_name: str | None = None
    host: str = "0.0.0.0"
    port: int = 8000
    gpu_memory_utilization: float = 0.9
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    kv_cache_dtype: str = "auto"
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool | None = None
    """None: vLLM's default (on for a generative decoder-only model)."""
    max_model_len: int | None = None
    """None: the model's; -1 (``--max-model-len auto``): the model's, reduced to what the KV cache holds."""
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    dtype: str = "auto"
    speculative_config: Mapping[str, Any] | None = None
    """``--speculative-config`` as parsed JSON (vLLM's keys)."""
    async_scheduling: bool | None = None
    """None: vLLM's default (on)."""
    enforce_eager: bool = False
    optimization_level: int | str = 2
    """``-O``: 0 (no compilation, no CUDA graphs), 1 (piecewise graphs), 2 and 3 (full and piecewise)."""
    compilation_config: Mapping[str, Any] | None = None
    cudagraph_capture_sizes: tuple[int, ...] | None = None
    max_cudagraph_capture_size: int | None = None
    long_prefill_token_threshold: int = 0
    long_prefill_token_threshold_adaptive: bool = False
    api_key: tuple[str, ...] = ()
    """``--api-key`` values (the server falls back to ``VLLM_API_KEY``)."""
    enable_request_id_headers: bool = False
    hardware: GpuProfile = field(default_factory=lambda: GPUS["H100-80GB"])
    gpus: int | None = None
    """``--sim-gpus``: GPUs of the simulated node (None: exactly tensor x data parallel size)."""
    acceptance_rate: float = DEFAULT_ACCEPTANCE_RATE
    speedup: float = 1.0
    events_per_write: int = 1
    """``--sim-events-per-write``: token chunks a stream's writer gathers into one network write (as vLLM's
    API server under load writes several SSE events at once); 1: each chunk written when its step ends."""
    start_delay: float | None = None
    seed: int | None = None
    hang_at_start: bool = False
    die_after_requests: int | None = None
    ignore_sigterm: bool = False
    orphan_child: bool = False
    slow_start: float = 0.0
    ignored: tuple[str, ...] = ()
    """vLLM flags that were given but have no modelled effect (one WARNING each in the log)."""
    cli_args: tuple[tuple[str, Any], ...] = ()
    """The command line's non-default vLLM arguments (dest, value) in vLLM's order, for the log line;
    empty for flags built in code (the log line is then derived from the fields)."""

    @property
    def name(self) -> str:
        """The model name the API reports."""
        return self.served_model_name or self.model

    def derived_max_model_len(self, model_max: int) -> int:
        """max_model_len before any auto-fit: the given one, else the model's ``model_max``."""
        given = self.max_model_len
        return model_max if given is None or given == -1 else given

    def resolved_max_num_batched_tokens(self, max_model_len: int) -> int:
        """The simulator's default: 2048 with chunked prefill, else max(max_model_len, 2048)."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return 2048 if self.enable_chunked_prefill else max(max_model_len, 2048)


def human_readable_int(value: str) -> int:
    """vLLM's integers with suffixes: ``1k`` = 1,000, ``1K`` = 1,024, ``25.6k`` = 25,600."""
    value = value.strip()
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT])", value)
    if match:
        number, suffix = match.groups()
        if suffix.islower():
            return int(float(number) * 10 ** (3 * "kmgt".index(suffix) + 3))
        try:
            return int(number) << (10 * "KMGT".index(suffix) + 10)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"Decimals are not allowed with binary suffixes like {suffix}. Did you mean to use "
                f"{number}{suffix.lower()} instead?"
            ) from None
    return int(value)


def human_readable_int_or_auto(value: str) -> int:
    """:func:`human_readable_int`, or -1 for ``auto`` / ``-1`` (fit max_model_len to the KV cache)."""
    value = value.strip()
    return -1 if value == "-1" or value.lower() == "auto" else human_readable_int(value)


def _kv_dtype(value: str) -> str:
    if value not in KV_CACHE_DTYPES:
        raise argparse.ArgumentTypeError(
            f"Invalid kv_cache_dtype: '{value}'. Valid values are: {list(KV_CACHE_DTYPES)}"
        )
    return value


def _json_loads(value: str) -> Any:
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        raise argparse.ArgumentTypeError(
            f"Value {value} cannot be converted to <function loads at 0x7f3a2c1e5300>."
        ) from None


COMPILATION_CONFIG_FIELDS = frozenset(
    (  # noqa: SIM905 - a word list
        "mode debug_dump_path cache_dir compile_cache_save_format backend custom_ops ir_enable_torch_wrap "
        "splitting_ops compile_mm_encoder cudagraph_mm_encoder encoder_cudagraph_token_budgets "
        "encoder_cudagraph_max_token_budget encoder_cudagraph_max_vision_items_per_batch "
        "encoder_cudagraph_max_frames_per_batch cudagraph_decoder_replay "
        "decoder_replay_cudagraph_capture_sizes decoder_replay_trim_threshold compile_sizes "
        "compile_ranges_endpoints inductor_compile_config inductor_passes cudagraph_mode "
        "use_breakable_cudagraph cudagraph_num_of_warmups cudagraph_capture_sizes "
        "prefill_cudagraph_capture_token_sizes max_prefill_cudagraph_capture_tokens "
        "decode_cudagraph_capture_request_sizes max_decode_cudagraph_capture_requests "
        "max_decode_cudagraph_capture_tokens cudagraph_copy_inputs cudagraph_specialize_lora "
        "use_inductor_graph_partition pass_config max_cudagraph_capture_size dynamic_shapes_config "
        "fast_moe_cold_start"
    ).split()
)
"""The keys vLLM 0.34.0's ``CompilationConfig`` accepts."""
_COMPILATION_MODES = ("NONE", "STOCK_TORCH_COMPILE", "DYNAMO_TRACE_ONCE", "VLLM_COMPILE")


def _compilation_error(loc: str, message: str, kind: str) -> argparse.ArgumentTypeError:
    return argparse.ArgumentTypeError(
        f"1 validation error for CompilationConfig\n{loc}{message}\n"
        f"    For further information visit https://errors.pydantic.dev/2.11/v/{kind}"
    )


def _compilation_config(value: str) -> dict[str, Any]:
    """``--compilation-config`` JSON, checked as vLLM's CompilationConfig parses it (argparse errors)."""
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as exc:
        raise _compilation_error(
            "", f"  Invalid JSON: {exc.msg.lower()} at line {exc.lineno} column {exc.colno} "
            f"[type=json_invalid, input_value={value!r}, input_type=str]", "json_invalid",
        ) from None  # fmt: skip
    if not isinstance(parsed, dict):
        raise _compilation_error(
            "", "  Input should be a dictionary or an instance of CompilationConfig [type=dataclass_type, "
            f"input_value={parsed!r}, input_type={type(parsed).__name__}]", "dataclass_type",
        )  # fmt: skip
    for key, item in parsed.items():
        if key not in COMPILATION_CONFIG_FIELDS:
            raise _compilation_error(
                f"{key}\n", f"  Unexpected keyword argument [type=unexpected_keyword_argument, "
                f"input_value={item!r}, input_type={type(item).__name__}]", "unexpected_keyword_argument",
            )  # fmt: skip
    mode = parsed.get("mode")
    if mode is not None and mode not in (0, 1, 2, 3) and str(mode).upper() not in _COMPILATION_MODES:
        raise _compilation_error(
            "mode\n", f"  Input should be 0, 1, 2 or 3 [type=enum, input_value={mode!r}, "
            f"input_type={type(mode).__name__}]", "enum",
        )  # fmt: skip
    return parsed


class _Switch(argparse.Action):
    """vLLM's ``EnableDisableAction``: True unless spelled as one of ``negative``."""

    def __init__(self, option_strings: Sequence[str], dest: str, negative: Sequence[str] = (),
                 **kwargs: Any) -> None:  # fmt: skip
        super().__init__(option_strings, dest, nargs=0, **kwargs)
        self.negative = frozenset(negative)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,  # noqa: ARG002
                 values: object, option_string: str | None = None) -> None:  # noqa: ARG002  # fmt: skip
        setattr(namespace, self.dest, option_string not in self.negative)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise FlagError(message, SERVE_USAGE)


_MODELLED: dict[str, dict[str, Any]] = {
    "model": {"default": None},
    "served_model_name": {"nargs": "+", "default": None},
    "host": {"default": None},
    "port": {"type": int, "default": 8000},
    "gpu_memory_utilization": {"type": float, "default": None},
    "block_size": {"type": int, "default": None},
    "max_num_seqs": {"type": int, "default": None},
    "max_num_batched_tokens": {"type": human_readable_int, "default": None},
    "kv_cache_dtype": {"type": _kv_dtype, "default": "auto"},
    "enable_chunked_prefill": {"default": None},
    "enable_prefix_caching": {"default": None},
    "max_model_len": {"type": human_readable_int_or_auto, "default": None},
    "tensor_parallel_size": {"type": int, "default": 1},
    "data_parallel_size": {"type": int, "default": 1},
    "dtype": {"default": "auto", "choices": ["auto", "bfloat16", "float", "float16", "float32", "half"]},
    "speculative_config": {"type": _json_loads, "default": None},
    "async_scheduling": {"default": None},
    "enforce_eager": {"default": False},
    "optimization_level": {"default": 2},
    "compilation_config": {"type": _compilation_config, "default": None},
    "cudagraph_capture_sizes": {"type": int, "nargs": "+", "default": None},
    "max_cudagraph_capture_size": {"type": int, "default": None},
    "long_prefill_token_threshold": {"type": int, "default": 0},
    "long_prefill_token_threshold_adaptive": {"default": False},
    "api_key": {"nargs": "+", "default": None},
    "enable_request_id_headers": {"default": False},
}
"""The vLLM flags the simulator models: argparse settings (defaults are vLLM 0.34's parser defaults)."""


def _build_parser() -> _Parser:
    p = _Parser(prog=PROG, usage="vllm serve [model_tag] [options]", add_help=False)
    p.add_argument("model_tag", nargs="?", default=None)
    for option in OPTIONS:
        settings = _MODELLED.get(option.dest)
        if option.arity == "0":
            p.add_argument(*option.spellings, dest=option.dest, action=_Switch, negative=option.negative,
                           default=settings["default"] if settings else argparse.SUPPRESS)  # fmt: skip
        elif settings is not None:
            p.add_argument(*option.spellings, dest=option.dest, **settings)
        else:
            nargs = None if option.arity == "1" else option.arity
            p.add_argument(*option.spellings, dest=option.dest, nargs=nargs, default=argparse.SUPPRESS)
    p.add_argument("--sim-hardware", default=None)
    p.add_argument("--sim-memory-gib", type=float, default=None)
    p.add_argument("--sim-bandwidth-gbs", type=float, default=None)
    p.add_argument("--sim-tflops", type=float, default=None)
    p.add_argument("--sim-gpus", type=int, default=None)
    p.add_argument("--sim-acceptance-rate", type=float, default=DEFAULT_ACCEPTANCE_RATE)
    p.add_argument("--sim-speedup", type=float, default=1.0)
    p.add_argument("--sim-events-per-write", type=int, default=1)
    p.add_argument("--sim-start-delay", type=float, default=None)
    p.add_argument("--sim-seed", type=int, default=None)
    p.add_argument("--sim-hang-at-start", action="store_true")
    p.add_argument("--sim-die-after-requests", type=int, default=None)
    p.add_argument("--sim-ignore-sigterm", action="store_true")
    p.add_argument("--sim-orphan-child", action="store_true")
    p.add_argument("--sim-slow-start", type=float, default=0.0)
    return p


_DOTTED_KEY = re.compile(r"(?<=--)[^.]*")


def _normalise(argv: list[str]) -> list[str]:
    """FlexibleArgumentParser's rewriting: dashes for underscores, ``-O``, dotted JSON keys."""
    out: list[str] = []
    for i, arg in enumerate(argv):
        if arg.startswith("--") and not arg.startswith("---"):
            key, eq, value = arg.partition("=")
            out.append(_DOTTED_KEY.sub(lambda m: m.group(0).replace("_", "-"), key, count=1) + eq + value)
        elif arg.startswith("-O") and arg != "-O":
            out += ["--optimization-level", arg[3:] if arg[2] == "=" else arg[2:]]
        elif arg == "-O" and i + 1 < len(argv) and argv[i + 1] in {"0", "1", "2", "3"}:
            out.append("--optimization-level")
        else:
            out.append(arg)
    return _merge_dotted(out)


def _merge_dotted(argv: list[str]) -> list[str]:
    """``--speculative-config.method ngram`` -> ``--speculative-config '{"method": "ngram"}'``."""
    merged: dict[str, dict[str, Any]] = {}
    out: list[str] = []
    skip = False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
            continue
        key = arg.split("=", 1)[0]
        if not (arg.startswith("-") and "." in key):
            out.append(arg)
            continue
        if "=" in arg:
            value_text = arg.split("=", 1)[1]
        elif i + 1 < len(argv):
            value_text, skip = argv[i + 1], True
        else:
            out.append(arg)
            continue
        name, *path = key.split(".")
        try:
            value: Any = json.loads(value_text)
        except json.JSONDecodeError:
            value = value_text
        node = merged.setdefault(name, {})
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
    for name, value in merged.items():
        out += [name, json.dumps(value)]
    return out


def _config_args(path: str) -> list[str]:
    if not path.endswith((".yaml", ".yml")):
        raise FlagError(f"argument --config: config file must be a .yaml or .yml file, got {path}")
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise FlagError(f"argument --config: cannot read {path}: {exc}") from exc
    if data is None:
        return []
    if not isinstance(data, dict):
        raise FlagError(f"argument --config: {path} must hold a mapping of flags")
    args: list[str] = []
    for key, value in data.items():
        flag = f"--{key}"
        if value is True:
            args.append(flag)
        elif value is False:
            if "-" in str(key):  # vLLM only negates dashed keys; underscored ones are ignored
                args.append(f"--no-{key}")
        elif isinstance(value, list):
            args += [flag, *(str(v) for v in value)]
        elif isinstance(value, dict):
            args += [flag, json.dumps(value)]
        else:
            args += [flag, str(value)]
    return args


def _split_config(argv: list[str]) -> tuple[list[str], str | None]:
    rest: list[str] = []
    config = None
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--config":
            if i + 1 >= len(argv):
                raise FlagError("argument --config: expected one argument")
            config = argv[i + 1]
            i += 2
            continue
        if arg.startswith("--config="):
            config = arg.split("=", 1)[1]
        else:
            rest.append(arg)
        i += 1
    return rest, config


def _hardware(ns: argparse.Namespace) -> GpuProfile:
    base = gpu_profile(ns.sim_hardware) if ns.sim_hardware else GPUS["H100-80GB"]
    given = {"memory-gib": ns.sim_memory_gib, "bandwidth-gbs": ns.sim_bandwidth_gbs, "tflops": ns.sim_tflops}
    for key, value in given.items():
        if value is not None and value <= 0:
            raise FlagError(f"argument --sim-{key}: must be > 0, got {value}")
    if all(value is None for value in given.values()):
        return base
    return replace(
        base,
        name=f"{base.name}(custom)",
        memory_bytes=base.memory_bytes if ns.sim_memory_gib is None else int(ns.sim_memory_gib * GIB),
        bandwidth_gbs=base.bandwidth_gbs if ns.sim_bandwidth_gbs is None else float(ns.sim_bandwidth_gbs),
        tflops=base.tflops if ns.sim_tflops is None else float(ns.sim_tflops),
    )


def help_text() -> str:
    """Usage of the simulated ``vllm serve`` and where its assumptions are listed."""
    return (
        SERVE_USAGE
        + "\n\nThe simulated vLLM server (autotune.sim): accepts vLLM 0.34's `vllm serve` command line"
        + "\n(e.g. --max-num-seqs, --block-size, --enable-prefix-caching, --speculative-config, -tp, -dp);"
        + "\nflags it does not model are accepted and ignored with a warning. Its own options:"
        + "\n  --sim-hardware --sim-memory-gib --sim-bandwidth-gbs --sim-tflops --sim-gpus"
        + "\n  --sim-acceptance-rate --sim-speedup --sim-events-per-write --sim-start-delay --sim-seed"
        + "\n  --sim-hang-at-start"
        + "\n  --sim-die-after-requests --sim-ignore-sigterm --sim-orphan-child --sim-slow-start"
        + "\nIts assumptions: autotune/sim/__init__.py.\n"
    )


def _sim_checks(ns: argparse.Namespace) -> None:
    if ns.sim_speedup <= 0:
        raise FlagError(f"argument --sim-speedup: must be > 0, got {ns.sim_speedup}")
    if ns.sim_events_per_write < 1:
        raise FlagError(f"argument --sim-events-per-write: must be >= 1, got {ns.sim_events_per_write}")
    if ns.sim_gpus is not None and ns.sim_gpus < 1:
        raise FlagError(f"argument --sim-gpus: must be >= 1, got {ns.sim_gpus}")
    if not 0.0 <= ns.sim_acceptance_rate <= 1.0:
        raise FlagError(f"argument --sim-acceptance-rate: must be in [0, 1], got {ns.sim_acceptance_rate}")


def _non_default(ns: argparse.Namespace, model: str) -> tuple[tuple[str, Any], ...]:
    """vLLM's ``non-default args``: every vLLM argument that differs from its parser default."""
    values = {"model_tag": ns.model_tag, **{k: v for k, v in vars(ns).items() if k in DEST_ORDER}}
    values["model"] = model  # vLLM copies the positional model into --model
    out = []
    for dest, value in values.items():
        settings = _MODELLED.get(dest)
        default = settings["default"] if settings else None
        if value is None or (settings is not None and value == default):
            continue
        out.append((dest, value))
    out.sort(key=lambda item: DEST_ORDER[item[0]])
    return tuple(out)


def _given_unmodelled(argv: list[str], ns: argparse.Namespace) -> tuple[str, ...]:
    """The spellings of the vLLM flags in ``argv`` that the simulator accepts without modelling."""
    unmodelled = {o.dest for o in OPTIONS if o.dest not in _MODELLED and o.dest != "config"}
    given = [d for d in vars(ns) if d in unmodelled]
    spelling = {s: o.dest for o in OPTIONS for s in o.spellings}
    out = []
    for dest in given:
        shown = next((a.split("=", 1)[0] for a in argv if spelling.get(a.split("=", 1)[0]) == dest), None)
        out.append(shown or "--" + dest.replace("_", "-"))
    return tuple(out)


def parse_flags(argv: list[str], *, ignore_unknown: bool = False) -> ServeFlags:
    """Parse a simulated ``vllm serve`` command line; FlagError (exit 2) on argparse-level errors.
    ``ignore_unknown``: flags the simulator does not know are left out (a real server's command line
    read for what the simulator models) instead of refused."""
    argv = _normalise(argv)
    argv, config = _split_config(argv)
    if config is not None:  # like vLLM: file flags go after the model tag, before the command line's
        from_file = _normalise(_config_args(config))
        head = argv[:1] if argv and not argv[0].startswith("-") else []
        argv = head + from_file + argv[len(head) :]
    parser = _build_parser()
    ns, unknown = parser.parse_known_args(argv)
    if unknown and not ignore_unknown:
        raise FlagError(f"unrecognized arguments: {' '.join(unknown)}", TOP_USAGE, "vllm")
    model = ns.model or ns.model_tag
    if model is None:
        raise FlagError("the following arguments are required: model_tag")
    try:
        hardware = _hardware(ns)
    except SpecError as exc:
        raise FlagError(f"argument --sim-hardware: {exc.message}") from exc
    _sim_checks(ns)
    defaults = ServeFlags(model=model)

    def given(name: str, fallback: Any) -> Any:
        value = getattr(ns, name)
        return fallback if value is None else value

    return ServeFlags(
        model=model,
        served_model_name=ns.served_model_name[0] if ns.served_model_name else None,
        host=given("host", defaults.host),
        port=ns.port,
        gpu_memory_utilization=given("gpu_memory_utilization", defaults.gpu_memory_utilization),
        block_size=given("block_size", defaults.block_size),
        max_num_seqs=given("max_num_seqs", defaults.max_num_seqs),
        max_num_batched_tokens=ns.max_num_batched_tokens,
        kv_cache_dtype=ns.kv_cache_dtype,
        enable_chunked_prefill=given("enable_chunked_prefill", defaults.enable_chunked_prefill),
        enable_prefix_caching=ns.enable_prefix_caching,
        max_model_len=ns.max_model_len,
        tensor_parallel_size=ns.tensor_parallel_size,
        data_parallel_size=ns.data_parallel_size,
        dtype=ns.dtype,
        speculative_config=ns.speculative_config,
        async_scheduling=ns.async_scheduling,
        enforce_eager=ns.enforce_eager,
        optimization_level=ns.optimization_level,
        compilation_config=ns.compilation_config,
        cudagraph_capture_sizes=tuple(ns.cudagraph_capture_sizes) if ns.cudagraph_capture_sizes else None,
        max_cudagraph_capture_size=ns.max_cudagraph_capture_size,
        long_prefill_token_threshold=ns.long_prefill_token_threshold,
        long_prefill_token_threshold_adaptive=ns.long_prefill_token_threshold_adaptive,
        api_key=tuple(ns.api_key or ()),
        enable_request_id_headers=ns.enable_request_id_headers,
        hardware=hardware,
        gpus=ns.sim_gpus,
        acceptance_rate=ns.sim_acceptance_rate,
        speedup=ns.sim_speedup,
        events_per_write=ns.sim_events_per_write,
        start_delay=ns.sim_start_delay,
        seed=ns.sim_seed,
        hang_at_start=ns.sim_hang_at_start,
        die_after_requests=ns.sim_die_after_requests,
        ignore_sigterm=ns.sim_ignore_sigterm,
        orphan_child=ns.sim_orphan_child,
        slow_start=ns.sim_slow_start,
        ignored=_given_unmodelled(argv, ns),
        cli_args=_non_default(ns, model),
    )
