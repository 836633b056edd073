"""The simulated server's command line against vLLM 0.34's: unknown flags, spellings, partial prefills."""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Any

import pytest

from autotune.hardware.catalog import GPUS, MODELS
from autotune.sim.engine import CostModel, Engine, EngineConfig, Request
from autotune.sim.flags import FlagError, ServeFlags, parse_flags
from autotune.sim.startup import StartFailure, plan_startup

MODEL = "Llama-3.1-8B"


def _error(argv: list[str]) -> FlagError:
    with pytest.raises(FlagError) as info:
        parse_flags(argv)
    assert info.value.exit_code == 2
    return info.value


def _start_log(**kwargs: Any) -> tuple[StartFailure | None, str]:
    flags = replace(ServeFlags(model=MODEL, max_model_len=2048), **kwargs)
    plan = plan_startup(flags, MODELS[MODEL], random.Random(0))
    return plan.failure, "\n".join(e.text for e in plan.events)


def test_an_unknown_flag_is_vllms_unrecognized_arguments_error() -> None:
    """An unknown flag (with its value) is reported by vLLM's top-level parser, exit status 2, exactly as
    vLLM 0.34 prints it."""
    error = _error(["m", "--bogus", "1", "--max-num-seqs", "8"])
    assert error.render() == (
        "usage: vllm [-h] [-v]\n"
        "            {chat,complete,serve,launch,bench,collect-env,download-kernels,preload,run-batch,"
        "snapshot}\n"
        "            ...\n"
        "vllm: error: unrecognized arguments: --bogus 1\n"
    )


@pytest.mark.parametrize("flag", ["--max-num-partial-prefills", "--max-long-partial-prefills"])
def test_partial_prefill_flags_do_not_exist_in_vllm_034(flag: str) -> None:
    """vLLM 0.34 has no partial-prefill flags (they left with the V0 engine): they are unrecognized
    arguments, so the tuner sees an invalid config naming the flag."""
    assert _error(["m", flag, "2"]).message == f"unrecognized arguments: {flag} 2"


def test_a_bad_value_is_the_serve_parsers_error_and_prefixes_may_be_ambiguous() -> None:
    """A value argparse cannot convert, or an ambiguous abbreviation, is ``vllm serve``'s own error."""
    assert _error(["m", "-tp", "x"]).render() == (
        "usage: vllm serve [model_tag] [options]\n"
        "vllm serve: error: argument --tensor-parallel-size/-tp: invalid int value: 'x'\n"
    )
    assert (
        "ambiguous option: --max-num could match --max-num-batched-tokens"
        in _error(["m", "--max-num", "8"]).message
    )
    assert parse_flags(["m", "--max-num-seq", "8"]).max_num_seqs == 8  # a unique prefix is accepted


def test_switches_take_all_of_vllms_spellings() -> None:
    """--enable-x, --disable-x and --no-enable-x set vLLM's switches; unset ones stay None (vLLM's
    default is resolved at startup)."""
    assert parse_flags(["m"]).enable_prefix_caching is None
    assert parse_flags(["m", "--enable-prefix-caching"]).enable_prefix_caching is True
    assert parse_flags(["m", "--disable-prefix-caching"]).enable_prefix_caching is False
    assert parse_flags(["m", "--no-enable-prefix-caching"]).enable_prefix_caching is False
    assert parse_flags(["m", "--disable-chunked-prefill"]).enable_chunked_prefill is False
    assert parse_flags(["m", "--no-async-scheduling"]).async_scheduling is False
    assert parse_flags(["m", "--enforce-eager"]).enforce_eager is True


def test_optimization_level_spellings() -> None:
    """-O3, -O=1 and -O 0 mean --optimization-level; -O 7 is unrecognized; --optimization-level 5 passes
    argparse and fails VllmConfig's validation with vLLM's text."""
    assert parse_flags(["m", "-O3"]).optimization_level == "3"
    assert parse_flags(["m", "-O=1"]).optimization_level == "1"
    assert parse_flags(["m", "-O", "0"]).optimization_level == "0"
    assert _error(["m", "-O", "7"]).message == "unrecognized arguments: -O 7"
    failure, log = _start_log(optimization_level="5")
    assert failure is StartFailure.INVALID_CONFIG
    assert "1 validation error for VllmConfig\noptimization_level\n  Input should be 0, 1, 2 or 3 " \
        "[type=enum, input_value='5', input_type=str]" in log  # fmt: skip


def test_human_readable_integers() -> None:
    """--max-num-batched-tokens and --max-model-len take vLLM's suffixes: 8k = 8,000, 8K = 8,192."""
    flags = parse_flags(["m", "--max-num-batched-tokens", "8K", "--max-model-len", "4k"])
    assert (flags.max_num_batched_tokens, flags.max_model_len) == (8192, 4000)


def test_long_prefill_threshold_above_max_model_len_fails_with_vllms_text() -> None:
    """SchedulerConfig rejects a long-prefill threshold above max_model_len with vLLM 0.34's text."""
    failure, log = _start_log(long_prefill_token_threshold=5000)
    assert failure is StartFailure.INVALID_CONFIG
    assert "1 validation error for SchedulerConfig" in log
    assert "Value error, long_prefill_token_threshold (5000) cannot be greater than the max_model_len " \
        "(2048). [type=value_error" in log  # fmt: skip


def _engine(threshold: int, *, adaptive: bool = False, chunked: bool = True) -> Engine:
    config = EngineConfig(8, 1024, 16, 1000, chunked, long_prefill_token_threshold=threshold,
                          long_prefill_token_threshold_adaptive=adaptive)  # fmt: skip
    return Engine(config, CostModel(MODELS[MODEL], GPUS["H100-80GB"]))


def test_long_prefill_threshold_caps_a_prompts_chunk_only_when_others_wait() -> None:
    """With --long-prefill-token-threshold 256 a long prompt alone uses the whole budget; next to another
    request each prompt's chunk is capped at 256; the adaptive variant floors the cap at the budget's
    fair share (1024 / 2 = 512)."""
    alone = _engine(256)
    alone.add(Request(0, 2000, 2))
    assert alone.step().scheduled_tokens == 1024
    shared = _engine(256)
    shared.add(Request(0, 2000, 2))
    shared.add(Request(1, 2000, 2))
    assert shared.step().scheduled_tokens == 512
    adaptive = _engine(256, adaptive=True)
    adaptive.add(Request(0, 2000, 2))
    adaptive.add(Request(1, 2000, 2))
    assert adaptive.step().scheduled_tokens == 1024


def test_compilation_config_is_checked_as_vllm_parses_it() -> None:
    """-cc takes vLLM 0.34's CompilationConfig keys as JSON: an unknown key (the old ``level``) or a mode
    outside 0-3 is the argparse error vLLM prints (exit 2); the capture sizes it gives are used."""
    assert "CompilationConfig\nlevel\n  Unexpected keyword argument [type=unexpected_keyword_argument" in (
        _error(["m", "-cc", '{"level": 3}']).message
    )
    assert "mode\n  Input should be 0, 1, 2 or 3 [type=enum, input_value=7" in (
        _error(["m", "--compilation-config", '{"mode": 7}']).message
    )
    flags = replace(parse_flags([MODEL, "-cc", '{"cudagraph_capture_sizes": [1, 2, 4]}']), max_model_len=2048)
    plan = plan_startup(flags, MODELS[MODEL], random.Random(0))
    assert plan.config is not None and plan.config.cudagraph_capture_sizes == (1, 2, 4)


def test_max_model_len_auto_fits_the_kv_cache() -> None:
    """--max-model-len auto (or -1) starts from the model's context length and, where the KV cache cannot
    hold it, reduces max_model_len to what it holds, with vLLM's log line, instead of failing."""
    assert parse_flags(["m", "--max-model-len", "auto"]).max_model_len == -1
    flags = replace(parse_flags([MODEL, "--max-model-len", "-1"]), hardware=GPUS["RTX-4090-24GB"])
    plan = plan_startup(flags, MODELS[MODEL], random.Random(0))
    assert plan.ok and plan.memory is not None and plan.config is not None
    assert plan.max_model_len == plan.memory.kv_tokens == plan.config.max_model_len < 131072
    log = "\n".join(e.text for e in plan.events)
    assert f"--max-model-len auto reduced max_model_len from 131072 to {plan.max_model_len} (" in log
    assert f"Maximum concurrency for {plan.max_model_len:,} tokens per request: 1.00x" in log


def test_events_per_write_is_a_positive_count() -> None:
    """--sim-events-per-write K gathers K chunks a write (1 by default); below 1 is the parser's error."""
    assert parse_flags(["m"]).events_per_write == 1
    assert parse_flags(["m", "--sim-events-per-write", "8"]).events_per_write == 8
    assert (
        "--sim-events-per-write: must be >= 1, got 0" in _error(["m", "--sim-events-per-write", "0"]).message
    )
