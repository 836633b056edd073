"""Command line of the simulated server: ``vllm serve`` flags, ``--config`` files and ``--sim-*`` options.

Parsing follows vLLM's ``FlexibleArgumentParser``: ``--some_flag`` equals ``--some-flag``; ``--config
FILE.yaml`` turns keys into flags (``key: true`` -> ``--key``, ``key: false`` -> ``--no-key`` only for
dashed keys, lists expand, dicts become JSON) and the command line wins over the file. Flags this twin
does not model are accepted and reported in :attr:`ServeFlags.ignored`. Range checks that vLLM does with
pydantic happen at startup (:mod:`autotune.sim.startup`), not here.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field, replace
from pathlib import Path

import yaml

from autotune.catalog import GIB, GPUS, GpuProfile, gpu_profile
from autotune.errors import AutotuneError, SpecError
from autotune.memory import KV_CACHE_DTYPES

PROG = "vllm serve"


class FlagError(AutotuneError):
    """A command-line error argparse-style: ``str()`` is the ``error:`` message; exit status 2."""

    exit_code = 2

    def __init__(self, message: str, usage: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.usage = usage

    def render(self) -> str:
        """The two lines argparse would print: usage, then ``prog: error: message``."""
        return f"{self.usage.rstrip()}\n{PROG}: error: {self.message}\n"


@dataclass(frozen=True)
class ServeFlags:
    """Every option of one simulated ``vllm serve`` launch (defaults as vLLM's)."""

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
    max_model_len: int | None = None
    tensor_parallel_size: int = 1
    dtype: str = "auto"
    hardware: GpuProfile = field(default_factory=lambda: GPUS["H100-80GB"])
    speedup: float = 1.0
    start_delay: float | None = None
    seed: int | None = None
    hang_at_start: bool = False
    die_after_requests: int | None = None
    ignore_sigterm: bool = False
    orphan_child: bool = False
    slow_start: float = 0.0
    ignored: tuple[str, ...] = ()
    """Unknown flags that were accepted and ignored (one WARNING each in the log)."""

    @property
    def name(self) -> str:
        """The model name the API reports."""
        return self.served_model_name or self.model

    def resolved_max_num_batched_tokens(self, max_model_len: int) -> int:
        """vLLM's default: 2048 with chunked prefill, else max(max_model_len, 2048)."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return 2048 if self.enable_chunked_prefill else max(max_model_len, 2048)


def _kv_dtype(value: str) -> str:
    if value not in KV_CACHE_DTYPES:
        raise argparse.ArgumentTypeError(
            f"Invalid kv_cache_dtype: '{value}'. Valid values are: {list(KV_CACHE_DTYPES)}"
        )
    return value


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise FlagError(message, self.format_usage())


def _build_parser() -> _Parser:
    p = _Parser(prog=PROG, add_help=False, allow_abbrev=False)
    p.add_argument("model_tag", nargs="?", default=None)
    p.add_argument("--model", default=None)
    p.add_argument("--served-model-name", nargs="+", default=None)
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--kv-cache-dtype", type=_kv_dtype, default="auto")
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--sim-hardware", default=None)
    p.add_argument("--sim-memory-gib", type=float, default=None)
    p.add_argument("--sim-bandwidth-gbs", type=float, default=None)
    p.add_argument("--sim-tflops", type=float, default=None)
    p.add_argument("--sim-speedup", type=float, default=1.0)
    p.add_argument("--sim-start-delay", type=float, default=None)
    p.add_argument("--sim-seed", type=int, default=None)
    p.add_argument("--sim-hang-at-start", action="store_true")
    p.add_argument("--sim-die-after-requests", type=int, default=None)
    p.add_argument("--sim-ignore-sigterm", action="store_true")
    p.add_argument("--sim-orphan-child", action="store_true")
    p.add_argument("--sim-slow-start", type=float, default=0.0)
    return p


def _normalise(argv: list[str]) -> list[str]:
    out = []
    for arg in argv:
        if arg.startswith("--") and not arg.startswith("---"):
            key, eq, value = arg[2:].partition("=")
            arg = "--" + key.replace("_", "-") + eq + value
        out.append(arg)
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
    """Usage of the simulated ``vllm serve`` (vLLM's flags it models, then its own ``--sim-*`` options)."""
    usage = _build_parser().format_usage()
    return (
        usage
        + "\nThe simulated vLLM server (autotune.sim): accepts `vllm serve`'s command line; flags it does"
        + "\nnot model are accepted and ignored with a warning. Its assumptions: autotune/sim/__init__.py.\n"
    )


def parse_flags(argv: list[str]) -> ServeFlags:
    """Parse a simulated ``vllm serve`` command line; FlagError (exit 2) on argparse-level errors."""
    argv = _normalise(argv)
    argv, config = _split_config(argv)
    if config is not None:  # like vLLM: file flags go after the model tag, before the command line's
        from_file = _normalise(_config_args(config))
        head = argv[:1] if argv and not argv[0].startswith("-") else []
        argv = head + from_file + argv[len(head) :]
    parser = _build_parser()
    ns, unknown = parser.parse_known_args(argv)
    model = ns.model or ns.model_tag
    if model is None:
        raise FlagError("the following arguments are required: model_tag", parser.format_usage())
    try:
        hardware = _hardware(ns)
    except SpecError as exc:
        raise FlagError(f"argument --sim-hardware: {exc.message}", parser.format_usage()) from exc
    if ns.sim_speedup <= 0:
        raise FlagError(f"argument --sim-speedup: must be > 0, got {ns.sim_speedup}")
    return ServeFlags(
        model=model,
        served_model_name=ns.served_model_name[0] if ns.served_model_name else None,
        host=ns.host,
        port=ns.port,
        gpu_memory_utilization=ns.gpu_memory_utilization,
        block_size=ns.block_size,
        max_num_seqs=ns.max_num_seqs,
        max_num_batched_tokens=ns.max_num_batched_tokens,
        kv_cache_dtype=ns.kv_cache_dtype,
        enable_chunked_prefill=ns.enable_chunked_prefill,
        max_model_len=ns.max_model_len,
        tensor_parallel_size=ns.tensor_parallel_size,
        dtype=ns.dtype,
        hardware=hardware,
        speedup=ns.sim_speedup,
        start_delay=ns.sim_start_delay,
        seed=ns.sim_seed,
        hang_at_start=ns.sim_hang_at_start,
        die_after_requests=ns.sim_die_after_requests,
        ignore_sigterm=ns.sim_ignore_sigterm,
        orphan_child=ns.sim_orphan_child,
        slow_start=ns.sim_slow_start,
        ignored=tuple(a for a in unknown if a.startswith("-")),
    )
