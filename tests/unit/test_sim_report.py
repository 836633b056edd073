"""Effective-config reporting: vLLM's non-default args and engine-config lines, cache_config_info labels."""

from __future__ import annotations

import ast
import random
import re

from autotune.hardware.catalog import MODELS
from autotune.sim.flags import parse_flags
from autotune.sim.metrics import EngineStats, render
from autotune.sim.model import build_engines
from autotune.sim.report import cache_config_labels
from autotune.sim.startup import StartupPlan, plan_startup

MODEL = "Llama-3.1-8B"


def _plan(*argv: str) -> StartupPlan:
    flags = parse_flags([MODEL, "--sim-hardware", "RTX-4090-24GB", "--max-model-len", "2048", *argv])
    plan = plan_startup(flags, MODELS[MODEL], random.Random(0))
    assert plan.ok, plan.error
    return plan


def _line(plan: StartupPlan, prefix: str) -> str:
    return next(e.text for e in plan.events if e.text.startswith(prefix))


def test_non_default_args_line_is_vllms_dict_in_parser_order() -> None:
    """The log has vLLM's ``non-default args: {...}`` line: given vLLM arguments in vLLM's parser order
    (model_tag, port, model, ...), the api key redacted, no --sim-* option."""
    flags = parse_flags([MODEL, "--port", "8123", "--max-num-seqs", "64", "--api-key", "secret",
                         "--sim-speedup", "5", "--disable-log-stats"])  # fmt: skip
    plan = plan_startup(flags, MODELS[MODEL], random.Random(0))
    line = _line(plan, "non-default args: ")
    args = ast.literal_eval(line.removeprefix("non-default args: "))
    assert list(args) == ["model_tag", "port", "api_key", "model", "max_num_seqs", "disable_log_stats"]
    assert args == {"model_tag": MODEL, "port": 8123, "api_key": "***", "model": MODEL, "max_num_seqs": 64,
                    "disable_log_stats": True}  # fmt: skip


def test_engine_config_line_carries_resolved_values_for_unset_flags() -> None:
    """With no flag given, vLLM's engine-config line reports what the simulator uses: prefix caching and
    chunked prefill on, bfloat16, TP/DP 1, FULL_AND_PIECEWISE graphs up to 512; a given flag changes it."""
    line = _line(_plan(), "Initializing a V1 LLM engine (v0.34.0) with config: ")
    for fragment in ("model='Llama-3.1-8B', speculative_config=None,", "dtype=torch.bfloat16,",
                     "max_seq_len=2048,", "tensor_parallel_size=1,", "data_parallel_size=1,",
                     "enforce_eager=False,", "kv_cache_dtype=auto,", "enable_prefix_caching=True,",
                     "enable_chunked_prefill=True,", "'mode': <CompilationMode.VLLM_COMPILE: 3>",
                     "'cudagraph_mode': <CUDAGraphMode.FULL_AND_PIECEWISE: (2, 1)>",
                     "'max_cudagraph_capture_size': 512"):  # fmt: skip
        assert fragment in line, fragment
    line = _line(_plan("--no-enable-prefix-caching", "--enforce-eager", "--kv-cache-dtype", "fp8",
                       "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'),
                 "Initializing a V1 LLM engine")  # fmt: skip
    spec = "speculative_config=SpeculativeConfig(method='ngram', model=None, num_spec_tokens=3),"
    graphs = ("'cudagraph_mode': <CUDAGraphMode.NONE: 0>", "'max_cudagraph_capture_size': 0")
    for fragment in (
        "enable_prefix_caching=False,",
        "enforce_eager=True,",
        "kv_cache_dtype=fp8,",
        spec,
        *graphs,
    ):
        assert fragment in line, fragment


def test_effective_config_line_has_the_values_vllm_does_not_log() -> None:
    """The simulator's own line gives block size, max_num_seqs, max_num_batched_tokens and memory
    utilization as used (here all unset), as a Python dict."""
    line = _line(_plan(), "autotune.sim effective config: ")
    config = ast.literal_eval(line.removeprefix("autotune.sim effective config: "))
    expected = {
        "block_size": 16,
        "max_num_seqs": 256,
        "max_num_batched_tokens": 2048,
        "gpu_memory_utilization": 0.9,
        "enable_prefix_caching": True,
        "async_scheduling": True,
    }
    assert {k: config[k] for k in expected} == expected


def test_cache_config_info_has_vllms_labels_with_resolved_values_for_unset_flags() -> None:
    """vllm:cache_config_info has one series per engine whose labels are vLLM 0.34's CacheConfig fields,
    sorted, with the values used: block_size 16 and prefix caching on although neither flag was given;
    num_gpu_blocks is the sum over the DP engines, kv_cache_size_tokens one engine's (as vLLM's front end)."""
    plan = _plan("-dp", "2")
    flags = parse_flags([MODEL, "--sim-hardware", "RTX-4090-24GB", "--max-model-len", "2048", "-dp", "2"])
    engines = build_engines(flags, MODELS[MODEL], plan)
    assert plan.memory is not None and plan.config is not None
    labels = [cache_config_labels(plan.config, plan.memory, i) for i in range(2)]
    text = render(MODEL, engines, [EngineStats(), EngineStats()], labels, lag_s=0.0, merged_tokens=0)
    series = re.findall(r"^vllm:cache_config_info\{(.*)\} 1\.0$", text, re.MULTILINE)
    assert len(series) == 2
    info = dict(re.findall(r'(\w+)="([^"]*)"', series[1]))
    names = list(info)
    assert names == sorted(names) and info["engine"] == "1"
    assert info["block_size"] == "16" and info["user_specified_block_size"] == "False"
    assert info["enable_prefix_caching"] == "True" and info["cache_dtype"] == "auto"
    assert info["gpu_memory_utilization"] == "0.9"
    assert info["num_gpu_blocks"] == str(2 * plan.memory.num_blocks)  # summed over the DP engines
    assert info["kv_cache_size_tokens"] == str(plan.memory.kv_tokens)
    assert {"prefix_caching_hash_algo", "kv_cache_max_concurrency", "mamba_cache_mode",
            "_block_size_resolved", "enable_extensible_kv_cache"} <= set(info)  # fmt: skip
