"""Startup of the simulated server: flag parsing, vLLM's checks and their exact error texts."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from autotune.hardware.catalog import GPUS, MODELS
from autotune.sim.flags import FlagError, ServeFlags, parse_flags
from autotune.sim.startup import StartFailure, StartupPlan, plan_startup

_4090 = GPUS["RTX-4090-24GB"]


def _plan(seed: int = 0, model: str = "Llama-3.1-8B", **kwargs: Any) -> StartupPlan:
    flags = replace(ServeFlags(model=model, hardware=_4090, max_model_len=2048), **kwargs)
    return plan_startup(flags, MODELS[model], random.Random(seed))


def _log(plan: StartupPlan) -> str:
    return "\n".join(e.text for e in plan.events)


def test_successful_start_logs_the_capacity_line_and_memory_facts() -> None:
    """A start that fits logs model memory, available KV memory and the one-line capacity fact."""
    plan = _plan()
    assert plan.ok and plan.memory is not None
    log = _log(plan)
    assert f"GPU KV cache size: {plan.memory.kv_tokens:,} tokens, Maximum concurrency for 2,048 tokens " \
        f"per request: {plan.memory.max_concurrency:.2f}x" in log  # fmt: skip
    assert "Model loading took 14.9575 GiB memory" in log
    assert "Available KV cache memory: " in log


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"max_num_batched_tokens": 128}, "max_num_batched_tokens (128) must be greater than or equal to "
         "max_num_seqs (256)."),
        ({"enable_chunked_prefill": False, "max_num_batched_tokens": 1024},
         "max_num_batched_tokens (1024) is smaller than max_model_len (2048). This effectively limits"),
        ({"gpu_memory_utilization": 1.5}, "Input should be less than or equal to 1"),
        ({"gpu_memory_utilization": 0.0}, "Input should be greater than 0"),
        ({"block_size": 24}, "ValueError: No valid attention backend found for cuda with head_size: 128"),
        ({"block_size": 128, "kv_cache_dtype": "fp8_e5m2"}, "No valid attention backend found"),
        ({"max_model_len": 200_000}, "User-specified max_model_len (200000) is greater than the derived"),
    ],
)  # fmt: skip
def test_invalid_configs_fail_with_vllms_text(kwargs: dict[str, Any], fragment: str) -> None:
    """Each invalid combination fails before loading, exit status 1, with vLLM's exact message."""
    plan = _plan(**kwargs)
    assert plan.failure is StartFailure.INVALID_CONFIG
    assert plan.exit_code == 1
    assert fragment in _log(plan)


def test_pydantic_errors_are_wrapped_like_vllm() -> None:
    """Scheduler validation errors read as one pydantic ValidationError for SchedulerConfig."""
    log = _log(_plan(max_num_batched_tokens=128))
    assert "pydantic_core._pydantic_core.ValidationError: 1 validation error for SchedulerConfig" in log


def test_no_memory_for_cache_blocks() -> None:
    """When weights and activations exceed the utilisation budget, vLLM's no-KV-memory error follows."""
    plan = _plan(gpu_memory_utilization=0.62)
    assert plan.failure is StartFailure.KV_TOO_SMALL
    log = _log(plan)
    assert "No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when " \
        "initializing the engine." in log  # fmt: skip
    assert "EngineCore failed to start." in log
    assert "RuntimeError: Engine core initialization failed. See root cause above." in log


def test_kv_too_small_for_max_model_len_reports_the_estimate() -> None:
    """A max_model_len the KV cache cannot hold fails with the GiB figures and the estimated length."""
    plan = _plan(max_model_len=131072, max_num_batched_tokens=2048)
    assert plan.failure is StartFailure.KV_TOO_SMALL and plan.memory is not None
    log = _log(plan)
    assert "(16.00 GiB KV cache is needed, which is larger than the available KV cache memory (" in log
    assert f"estimated maximum model length is {plan.memory.kv_tokens}." in log


def test_weights_larger_than_the_device_are_a_cuda_oom() -> None:
    """Llama-3.1-70B does not fit a 24 GiB card: torch.OutOfMemoryError while loading."""
    plan = _plan(model="Llama-3.1-70B")
    assert plan.failure is StartFailure.OOM
    assert "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate " in _log(plan)


def test_graph_capture_ooms_randomly_only_close_to_the_memory_edge() -> None:
    """At 0.98 utilisation some seeds OOM during CUDA-graph capture and some start; at 0.90 none OOM."""
    edge = [_plan(seed, gpu_memory_utilization=0.98).failure for seed in range(40)]
    assert 5 < edge.count(StartFailure.OOM) < 35
    assert all(_plan(seed, gpu_memory_utilization=0.90).ok for seed in range(40))


def test_start_delay_scales_with_model_size_and_speedup() -> None:
    """Bigger models start slower; --sim-speedup divides the size-based delay; overrides are wall seconds."""
    h100 = GPUS["H100-80GB"]
    small = plan_startup(ServeFlags(model="x", hardware=h100), MODELS["Llama-3.1-8B"], random.Random(0))
    big = plan_startup(
        ServeFlags(model="x", hardware=h100, tensor_parallel_size=2),
        MODELS["Llama-3.1-70B"],
        random.Random(0),
    )
    assert 3.0 < small.delay_s < 10.0 < big.delay_s
    fast = ServeFlags(model="x", hardware=h100, speedup=10.0)
    assert plan_startup(fast, MODELS["Llama-3.1-8B"], random.Random(0)).delay_s == pytest.approx(
        small.delay_s / 10
    )
    fixed = ServeFlags(model="x", hardware=h100, speedup=10.0, start_delay=1.0, slow_start=2.0)
    assert plan_startup(fixed, MODELS["Llama-3.1-8B"], random.Random(0)).delay_s == pytest.approx(3.0)


def test_parse_flags_reads_vllm_flags_sim_options_and_accepts_unmodelled_vllm_flags() -> None:
    """vllm serve flags (dashes or underscores), --sim-* options and vLLM flags the simulator does not
    model are all accepted; the unmodelled ones are listed in ``ignored``."""
    flags = parse_flags(
        ["--model", "Mistral-7B", "--max_num_seqs", "64", "--no-enable-chunked-prefill",
         "--disable-log-stats", "--served-model-name", "m", "--sim-hardware", "l40s-48gb",
         "--sim-tflops", "200"]
    )  # fmt: skip
    assert (flags.model, flags.max_num_seqs, flags.enable_chunked_prefill) == ("Mistral-7B", 64, False)
    assert flags.name == "m" and flags.ignored == ("--disable-log-stats",)
    assert flags.hardware.tflops == 200.0 and flags.hardware.memory_bytes == GPUS["L40S-48GB"].memory_bytes
    assert flags.resolved_max_num_batched_tokens(4096) == 4096
    assert parse_flags(["m"]).resolved_max_num_batched_tokens(4096) == 2048


def test_config_file_follows_vllm_semantics(tmp_path: Path) -> None:
    """--config keys become flags; false negates only dashed keys; the command line wins."""
    config = tmp_path / "serve.yaml"
    config.write_text("max-num-seqs: 32\nblock_size: 32\nenable-chunked-prefill: false\n")
    flags = parse_flags(["m", "--config", str(config), "--max-num-seqs", "48"])
    assert (flags.max_num_seqs, flags.block_size, flags.enable_chunked_prefill) == (48, 32, False)
    config.write_text("enable_chunked_prefill: false\nseed: 4\n")
    flags = parse_flags(["m", "--config", str(config)])
    assert flags.enable_chunked_prefill is True
    assert flags.model == "m" and flags.ignored == ("--seed",)


def test_custom_hardware_options_override_the_profile() -> None:
    """--sim-memory-gib/--sim-bandwidth-gbs/--sim-tflops replace a profile's figures; <= 0 is rejected."""
    flags = parse_flags(["m", "--sim-hardware", "A100-80GB", "--sim-memory-gib", "40"])
    assert flags.hardware.memory_gib == 40.0 and flags.hardware.tflops == 312.0
    with pytest.raises(FlagError, match="--sim-bandwidth-gbs: must be > 0"):
        parse_flags(["m", "--sim-bandwidth-gbs", "0"])
    with pytest.raises(FlagError, match="unknown GPU profile"):
        parse_flags(["m", "--sim-hardware", "TPU"])


def test_invalid_kv_cache_dtype_is_an_argparse_error() -> None:
    """A bad --kv-cache-dtype is rejected argparse-style (exit 2) with the valid values."""
    with pytest.raises(FlagError) as info:
        parse_flags(["m", "--kv-cache-dtype", "int3"])
    text = info.value.render()
    assert "vllm serve: error: argument --kv-cache-dtype: Invalid kv_cache_dtype: 'int3'. Valid values " \
        "are: ['auto', 'float16', 'bfloat16', 'fp8', 'fp8_e4m3', 'fp8_e5m2']" in text  # fmt: skip
    assert text.startswith("usage:")
