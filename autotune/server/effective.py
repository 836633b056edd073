"""The effective values of a running server's flags, as it reports them: start-up log and ``/metrics``.

What vLLM itself says (docs/vllm.md, "What a running server says about its effective config", with the
source of each line):

* ``Initializing a V1 LLM engine (vX) with config: ...`` (``VllmConfig.__str__``): the resolved
  ``tensor_parallel_size``, ``data_parallel_size``, ``enforce_eager``, ``kv_cache_dtype``,
  ``enable_prefix_caching``, ``enable_chunked_prefill``, ``max_seq_len`` and, inside
  ``compilation_config``, ``cudagraph_mode`` and ``max_cudagraph_capture_size``; ``speculative_config=None``
  when speculative decoding is off.
* ``Chunked prefill is enabled with max_num_batched_tokens=N.`` (``SchedulerConfig``, INFO).
* ``Defaulting max_num_seqs to N ...`` / ``Defaulting max_num_batched_tokens to N ...`` (``EngineArgs``,
  DEBUG only: seen with ``VLLM_LOGGING_LEVEL=DEBUG``).
* ``vllm:cache_config_info``: every ``CacheConfig`` field as a label (``block_size``, ``cache_dtype``,
  ``enable_prefix_caching``, ``gpu_memory_utilization``, ...). vLLM 0.34 writes
  ``gpu_memory_utilization="None"`` when the flag is unset; the value it uses is then 1.0 with the
  extensible KV cache (``enable_extensible_kv_cache="True"``) and 0.92 without
  (``CacheConfig.resolved_gpu_memory_utilization``).
* ``non-default args: {...}``: what the command line gave (not the defaults).

The simulated server adds ``autotune.sim effective config: {...}`` with every value it runs with.
Values found later in this list win over earlier ones: the simulator's line, then the metrics, then the
DEBUG lines, then the engine line. Nothing here raises: a line it cannot read is skipped.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

SIM_LINE = "autotune.sim effective config: "
ENGINE_LINE = re.compile(r"Initializing a V1 LLM engine \(v(?P<version>[^)]*)\) with config: (?P<config>.*)$")
CHUNKED = re.compile(r"Chunked prefill is enabled with max_num_batched_tokens=(\d+)\.")
DEFAULTING = re.compile(r"Defaulting (max_num_seqs|max_num_batched_tokens) to (\d+)")
_ENGINE_KEYS = {
    "tensor_parallel_size": "tensor_parallel_size",
    "data_parallel_size": "data_parallel_size",
    "pipeline_parallel_size": "pipeline_parallel_size",
    "enforce_eager": "enforce_eager",
    "kv_cache_dtype": "kv_cache_dtype",
    "enable_prefix_caching": "enable_prefix_caching",
    "enable_chunked_prefill": "enable_chunked_prefill",
    "max_seq_len": "max_model_len",
}
_CUDAGRAPH_MODE = re.compile(r"'cudagraph_mode': <CUDAGraphMode\.([A-Z_]+)")
_CAPTURE_MAX = re.compile(r"'max_cudagraph_capture_size': (\d+)")
_INFO = re.compile(r"^vllm:cache_config_info\{(?P<labels>.*)\}\s", re.MULTILINE)
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')
_CACHE_LABELS = {
    "block_size": "block_size",
    "cache_dtype": "kv_cache_dtype",
    "enable_prefix_caching": "enable_prefix_caching",
    "gpu_memory_utilization": "gpu_memory_utilization",
    "kv_cache_memory_bytes": "kv_cache_memory_bytes",
    "prefix_match_unit": "prefix_match_unit",
}
_SIM_KEYS = {
    "block_size", "max_num_seqs", "max_num_batched_tokens", "gpu_memory_utilization", "kv_cache_dtype",
    "enable_prefix_caching", "enable_chunked_prefill", "long_prefill_token_threshold",
    "tensor_parallel_size", "data_parallel_size", "async_scheduling", "enforce_eager",
    "optimization_level", "cudagraph_mode", "max_cudagraph_capture_size", "max_model_len",
}  # fmt: skip
EXTENSIBLE_UTILIZATION = 1.0
DEFAULT_UTILIZATION = 0.92
"""vLLM 0.34's ``gpu_memory_utilization`` when unset: with and without the extensible KV cache."""


@dataclass(frozen=True)
class Effective:
    """The effective flags a server reported, by snake-case flag name, and where each came from."""

    values: Mapping[str, Any] = field(default_factory=dict)
    """``speculative_config`` is ``None`` when the server runs without speculative decoding, else a
    mapping with ``method`` and ``num_speculative_tokens``."""
    sources: Mapping[str, str] = field(default_factory=dict)
    version: str | None = None
    """The version in the engine line, when logged."""

    def as_record(self) -> dict[str, Any]:
        """The values with a ``_source`` mapping (what ``TrialRecord.reported_defaults`` stores)."""
        return {**self.values, "_source": dict(self.sources)}

    def get(self, name: str) -> tuple[bool, Any]:
        """``(True, value)`` when ``name`` (a flag, or ``json_flag.key``) was reported, else
        ``(False, None)``; a key of a JSON flag reported as off is ``(True, None)``."""
        flag, dot, key = name.partition(".")
        if not dot:
            return (name in self.values, self.values.get(name))
        if flag not in self.values:
            return False, None
        whole = self.values[flag]
        if whole is None:
            return True, None
        if isinstance(whole, Mapping) and key in whole:
            return True, whole[key]
        return False, None


def literal(text: str) -> Any:
    """A label or log value as Python: ``True``/``False``/``None``, a number, else the text."""
    text = text.strip()
    if text in ("True", "False"):
        return text == "True"
    if text == "None":
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def cache_config_labels(metrics_text: str) -> dict[str, str] | None:
    """The labels of ``vllm:cache_config_info`` for engine 0 (or the only series), or ``None``."""
    found = None
    for match in _INFO.finditer(metrics_text):
        labels = {k: v.replace('\\"', '"').replace("\\\\", "\\") for k, v in _LABEL.findall(match["labels"])}
        if found is None or labels.get("engine") in ("0", ""):
            found = labels
    return found


def _from_sim(line: str) -> dict[str, Any]:
    try:
        config = ast.literal_eval(line.split(SIM_LINE, 1)[1].strip())
    except (ValueError, SyntaxError, IndexError):
        return {}
    if not isinstance(config, dict):
        return {}
    out = {k: v for k, v in config.items() if k in _SIM_KEYS}
    method = config.get("speculative_method")
    out["speculative_config"] = (
        None
        if method is None
        else {"method": method, "num_speculative_tokens": config.get("num_speculative_tokens")}
    )
    return out


def _from_engine(config: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, name in _ENGINE_KEYS.items():
        match = re.search(rf"(?:^|, ){key}=([^,]+)", config)
        if match:
            out[name] = literal(match.group(1))
    if out.get("kv_cache_dtype") is not None:
        out["kv_cache_dtype"] = str(out["kv_cache_dtype"])
    if re.search(r"(?:^|, )speculative_config=None(?:,|$)", config):
        out["speculative_config"] = None
    mode = _CUDAGRAPH_MODE.search(config)
    if mode:
        out["cudagraph_mode"] = mode.group(1)
    largest = _CAPTURE_MAX.search(config)
    if largest:
        out["max_cudagraph_capture_size"] = int(largest.group(1))
    return out


def _from_labels(labels: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for label, name in _CACHE_LABELS.items():
        if label in labels:
            out[name] = literal(labels[label])
    if "kv_cache_dtype" in out:
        out["kv_cache_dtype"] = str(out["kv_cache_dtype"])
    if "gpu_memory_utilization" in out and out["gpu_memory_utilization"] is None:
        extensible = literal(labels.get("enable_extensible_kv_cache", "None"))
        out["gpu_memory_utilization"] = EXTENSIBLE_UTILIZATION if extensible else DEFAULT_UTILIZATION
    for key in ("kv_cache_memory_bytes", "prefix_match_unit"):
        if out.get(key) is None:
            out.pop(key, None)
    return out


def read_effective(log_text: str, metrics_text: str | None = None) -> Effective:
    """What ``log_text`` (a server's start-up log) and ``metrics_text`` (its ``/metrics``) say about the
    values it runs with."""
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    version = None

    def take(found: Mapping[str, Any], source: str) -> None:
        for name, value in found.items():
            values[name] = value
            sources[name] = source

    engine: dict[str, Any] = {}
    debug: dict[str, Any] = {}
    chunked: dict[str, Any] = {}
    sim: dict[str, Any] = {}
    for line in log_text.splitlines():
        if SIM_LINE in line:
            sim = _from_sim(line)
            continue
        match = ENGINE_LINE.search(line)
        if match:
            version = match["version"]
            engine = _from_engine(match["config"])
            continue
        match = CHUNKED.search(line)
        if match:
            chunked = {"max_num_batched_tokens": int(match.group(1))}
            continue
        match = DEFAULTING.search(line)
        if match:
            debug[match.group(1)] = int(match.group(2))
    take(sim, "autotune.sim effective config line")
    labels = cache_config_labels(metrics_text) if metrics_text else None
    if labels is not None:
        take({k: v for k, v in _from_labels(labels).items() if k not in sim}, "vllm:cache_config_info")
    take({k: v for k, v in chunked.items() if k not in sim}, "'Chunked prefill is enabled with' log line")
    take({k: v for k, v in debug.items() if k not in sim}, "'Defaulting ... to' DEBUG log line")
    take({k: v for k, v in engine.items() if k not in sim}, "engine config log line")
    return Effective(values, sources, version)
