"""Failure-log classification: every failure text of docs/vllm.md maps to its cause and numbers."""

from __future__ import annotations

import pytest

from autotune.errors import PortInUseError
from autotune.outcome import Cause
from autotune.server.classify import (
    MAX_LINES,
    Diagnosis,
    classify_runtime_failure,
    classify_start_failure,
)

GENERIC_TAIL = """\
(EngineCore_DP0 pid=4242) ERROR 12-02 14:00:09 [core.py:708] EngineCore failed to start.
Traceback (most recent call last):
  File "/venv/bin/vllm", line 10, in <module>
RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}
"""


def _log(root_cause: str) -> str:
    """A start log with ``root_cause`` above vLLM's generic engine-failure lines."""
    return (
        "INFO 12-02 14:00:00 [api_server.py:1] vLLM API server version 0.34.0\n"
        "INFO 12-02 14:00:01 [model_runner.py:1] Starting to load model tiny-llama...\n"
        "(EngineCore_DP0 pid=4242) ERROR 12-02 14:00:09 [core.py:700] Traceback (most recent call last):\n"
        f"(EngineCore_DP0 pid=4242) ERROR 12-02 14:00:09 [core.py:700] {root_cause}\n" + GENERIC_TAIL
    )


# (case id, log fragment, expected cause, expected extras subset)
CASES: list[tuple[str, str, Cause, dict[str, float]]] = [
    (
        "cuda-oom-torch2",
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
        "capacity of 79.19 GiB of which 1.06 GiB is free. Including non-PyTorch memory, ...",
        Cause.OOM,
        {"tried_to_allocate_gib": 2.0, "total_gib": 79.19, "free_gib": 1.06},
    ),
    (
        "cuda-oom-torch1",
        "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 512.00 MiB (GPU 0; "
        "15.78 GiB total capacity; 14.56 GiB already allocated; 3.44 MiB free; ...)",
        Cause.OOM,
        {"tried_to_allocate_gib": 0.5, "total_gib": 15.78, "free_gib": 3.44 / 1024},
    ),
    (
        "cuda-error-graph-capture",
        "RuntimeError: CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported",
        Cause.OOM,
        {},
    ),
    (
        "no-cache-blocks-0.34",
        "ValueError: No available memory for the cache blocks. Try increasing "
        "`gpu_memory_utilization` when initializing the engine (this flag also controls CPU memory "
        "reservation on the CPU backend, despite its name).",
        Cause.KV_TOO_SMALL,
        {},
    ),
    (
        "no-cache-blocks-old",
        "ValueError: No available memory for the cache blocks. Try increasing "
        "`gpu_memory_utilization` when initializing the engine.",
        Cause.KV_TOO_SMALL,
        {},
    ),
    (
        "kv-needed-larger",
        "ValueError: To serve at least one request with the model's max seq len (4000000), (1.91 GiB "
        "KV cache is needed, which is larger than the available KV cache memory (1.0 GiB). Based on "
        "the available memory, the estimated maximum model length is 2097024. Try increasing "
        "`gpu_memory_utilization` or decreasing `max_model_len` when initializing the engine.",
        Cause.KV_TOO_SMALL,
        {
            "needed_gib": 1.91,
            "available_gib": 1.0,
            "max_seq_len": 4_000_000,
            "estimated_max_model_len": 2_097_024,
        },
    ),
    (
        "kv-needed-larger-old-typo",
        "ValueError: The model's max seq len (32768) is larger than the maximum number of tokens "
        "that can be stored in KV cache (2.50 GiB KV cache is needed, which is larger than the "
        "available KV cache memory (0.75 GiB). models's max seq len (32768) ...",
        Cause.KV_TOO_SMALL,
        {"needed_gib": 2.5, "available_gib": 0.75, "max_seq_len": 32768},
    ),
    (
        "cannot-auto-fit",
        "ValueError: Cannot auto-fit max_model_len: not enough GPU memory available to serve even "
        "a single token. Try increasing `gpu_memory_utilization`.",
        Cause.KV_TOO_SMALL,
        {},
    ),
    (
        "cpu-kv-allocation",
        "RuntimeError: Available memory on node 0 (21.94/23.54 GiB) on kv cache allocation is less "
        "than requested memory for kv (100.0 GiB). Try decreasing VLLM_CPU_KVCACHE_SPACE.",
        Cause.KV_TOO_SMALL,
        {"free_gib": 21.94, "total_gib": 23.54, "requested_gib": 100.0, "needed_gib": 100.0},
    ),
    (
        "gpu-free-less-than-utilization",
        "ValueError: Free memory on device cuda:0 (10.5/79.19 GiB) on startup is less than desired "
        "GPU memory utilization (0.9, 71.27 GiB). Decrease GPU memory utilization or reduce GPU "
        "memory used by other processes.",
        Cause.OOM,
        {
            "free_gib": 10.5,
            "total_gib": 79.19,
            "requested_utilization": 0.9,
            "requested_gib": 71.27,
        },
    ),
    (
        "cpu-free-less-than-utilization",
        "ValueError: Available memory on node 0 (20.9/23.54 GiB) on startup is less than desired "
        "CPU memory utilization (0.99, 23.3 GiB). Decrease memory utilization.",
        Cause.OOM,
        {"free_gib": 20.9, "total_gib": 23.54, "requested_utilization": 0.99, "requested_gib": 23.3},
    ),
    (
        "no-attention-backend",
        "ValueError: No valid attention backend found for cuda with head_size: 64, dtype: "
        "torch.bfloat16, kv_cache_dtype: fp8_e5m2, block_size: 48",
        Cause.INVALID_CONFIG,
        {},
    ),
    (
        "cpu-block-size",
        "ValueError: No common block size for 16 (CPU_ATTN: [MultipleOf(32)]).",
        Cause.INVALID_CONFIG,
        {},
    ),
    (
        "block-size-not-supported",
        "ValueError: block_size not supported by FLASHMLA",
        Cause.INVALID_CONFIG,
        {},
    ),
    (
        "kv-dtype-not-supported",
        "ValueError: kv_cache_dtype not supported by FLASH_ATTN",
        Cause.INVALID_CONFIG,
        {},
    ),
    (
        "cpu-fp8-kv-without-avx512",
        "(EngineCore pid=32447) ERROR 12-03 13:28:18 [core.py:1510] NotImplementedError: FP8 KV cache on "
        "CPU requires x86 with AVX-512 or AMX.",
        Cause.INVALID_CONFIG,
        {},
    ),
    (
        "invalid-kv-dtype",
        "ValueError: Invalid kv_cache_dtype: 'fp4'. Valid values are: ['auto', 'float16', 'fp8']",
        Cause.INVALID_CONFIG,
        {},
    ),
    (
        "scheduler-smaller-than-max-model-len",
        "pydantic_core._pydantic_core.ValidationError: 1 validation error for SchedulerConfig\n"
        "  Value error, max_num_batched_tokens (2048) is smaller than max_model_len (8192). This "
        "effectively limits the maximum sequence length to max_num_batched_tokens ...",
        Cause.INVALID_CONFIG,
        {},
    ),
    (
        "scheduler-seqs",
        "pydantic_core._pydantic_core.ValidationError: 1 validation error for SchedulerConfig\n"
        "  Value error, max_num_batched_tokens (128) must be greater than or equal to "
        "max_num_seqs (256).",
        Cause.INVALID_CONFIG,
        {},
    ),
    (
        "bound-greater-than-0",
        "pydantic_core._pydantic_core.ValidationError: 1 validation error for CacheConfig\n"
        "block_size\n  Input should be greater than 0 [type=greater_than, input_value=0]",
        Cause.INVALID_CONFIG,
        {},
    ),
    (
        "bound-less-than-1",
        "pydantic_core._pydantic_core.ValidationError: 1 validation error for CacheConfig\n"
        "gpu_memory_utilization\n  Input should be less than or equal to 1 [type=less_than_equal]",
        Cause.INVALID_CONFIG,
        {},
    ),
    (
        "max-model-len-too-big",
        "ValueError: User-specified max_model_len (100000) is greater than the derived "
        "max_model_len (max_position_embeddings=2048.0 or model_max_length=None in model's config).",
        Cause.INVALID_CONFIG,
        {"max_seq_len": 100000, "estimated_max_model_len": 2048},
    ),
]


@pytest.mark.parametrize(("fragment", "cause", "extras"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_start_failure_text_maps_to_cause(fragment: str, cause: Cause, extras: dict[str, float]) -> None:
    """Each failure text, even above the generic engine lines, gives its own cause and numbers."""
    diagnosis = classify_start_failure(_log(fragment), exit_code=1, timed_out=False)
    assert diagnosis.cause is cause
    for key, value in extras.items():
        assert diagnosis.extras[key] == pytest.approx(value), key
    assert diagnosis.extras["exit_code"] == 1
    assert any(fragment.splitlines()[0][:40] in line for line in diagnosis.lines)
    assert 0 < len(diagnosis.lines) <= MAX_LINES


def test_free_less_than_requested_says_device_may_be_held() -> None:
    """Free memory below the requested utilization is `oom`; the summary says the device may be held."""
    text = _log(
        "ValueError: Free memory on device cuda:0 (1.0/79.19 GiB) on startup is less than "
        "desired GPU memory utilization (0.9, 71.27 GiB)."
    )
    diagnosis = classify_start_failure(text, 1, timed_out=False)
    assert diagnosis.cause is Cause.OOM
    assert "something else may hold the device" in diagnosis.summary


def test_argparse_error_exit_2_is_invalid_config() -> None:
    """An argparse rejection (exit status 2, `error: argument`) is `invalid_config`."""
    text = (
        "usage: vllm serve [model_tag] [options]\n"
        "vllm serve: error: argument --kv-cache-dtype: invalid choice: 'fp4' "
        "(choose from auto, fp8, fp8_e4m3, fp8_e5m2)\n"
    )
    diagnosis = classify_start_failure(text, 2, timed_out=False)
    assert diagnosis.cause is Cause.INVALID_CONFIG
    assert any("error: argument --kv-cache-dtype" in line for line in diagnosis.lines)


def test_exit_2_with_usage_only_is_invalid_config() -> None:
    """Exit status 2 with any usage/error line is the argument parser: `invalid_config`."""
    text = "usage: vllm serve [options]\nvllm serve: error: unrecognized arguments: --bogus\n"
    assert classify_start_failure(text, 2, timed_out=False).cause is Cause.INVALID_CONFIG
    other = "usage: vllm serve [options]\nvllm serve: error: something new\n"
    assert classify_start_failure(other, 2, timed_out=False).cause is Cause.INVALID_CONFIG


def test_generic_engine_failure_alone_is_start_failed() -> None:
    """Only generic `EngineCore failed to start.` lines: `start_failed`, showing the first error too."""
    text = _log("RuntimeError: something nobody has seen before")
    diagnosis = classify_start_failure(text, 1, timed_out=False)
    assert diagnosis.cause is Cause.START_FAILED
    assert any("something nobody has seen before" in line for line in diagnosis.lines)
    assert any("EngineCore failed to start" in line for line in diagnosis.lines)


def test_specific_cause_wins_over_generic_even_when_generic_is_last() -> None:
    """The specific root cause wins over the generic lines printed after it."""
    text = _log("ValueError: No available memory for the cache blocks.") + GENERIC_TAIL * 3
    assert classify_start_failure(text, 1, timed_out=False).cause is Cause.KV_TOO_SMALL


def test_unrecognised_exit_is_start_failed_with_tail() -> None:
    """An exit with no known text is `start_failed`, with the last log lines kept."""
    text = "\n".join(f"line {i}" for i in range(100))
    diagnosis = classify_start_failure(text, 137, timed_out=False)
    assert diagnosis.cause is Cause.START_FAILED
    assert "137" in diagnosis.summary
    assert diagnosis.lines[-1] == "line 99"
    assert len(diagnosis.lines) <= MAX_LINES


def test_timeout_is_start_timeout_and_names_a_known_error() -> None:
    """A timeout is `start_timeout` whatever the log says; a recognised error is named in the summary."""
    plain = classify_start_failure("INFO loading weights\n", None, timed_out=True)
    assert plain.cause is Cause.START_TIMEOUT
    oom = classify_start_failure(_log("torch.OutOfMemoryError: CUDA out of memory."), None, True)
    assert oom.cause is Cause.START_TIMEOUT
    assert "out of memory" in oom.summary


def test_address_in_use_raises_port_in_use() -> None:
    """`Address already in use` is the environment's fault: PortInUseError, never a config cause."""
    text = "ERROR [api_server.py:1] OSError: [Errno 98] Address already in use\n" + GENERIC_TAIL
    with pytest.raises(PortInUseError, match="Address already in use"):
        classify_start_failure(text, 1, timed_out=False)


def test_ansi_colour_codes_do_not_hide_patterns() -> None:
    """Coloured log output is matched the same as plain text."""
    text = "\x1b[1;31mERROR\x1b[0m ValueError: No available memory for the cache blocks.\n"
    assert classify_start_failure(text, 1, timed_out=False).cause is Cause.KV_TOO_SMALL


def test_runtime_exit_zero_is_crashed_under_load() -> None:
    """A server that exited 0 after an engine death is `crashed_under_load`, with the death lines."""
    text = (
        "INFO Application startup complete.\n"
        "ERROR EngineCore encountered a fatal error.\n"
        "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue.\n"
        "INFO Shutting down\n"
    )
    diagnosis = classify_runtime_failure(text, 0, None)
    assert diagnosis.cause is Cause.CRASHED_UNDER_LOAD
    assert diagnosis.extras["exit_code"] == 0
    assert "exited with code 0" in diagnosis.summary
    assert any("EngineDeadError" in line for line in diagnosis.lines)


def test_runtime_unhealthy_and_oom_under_load() -> None:
    """/health 503 while alive is `crashed_under_load`; an OOM in the log is named in the summary."""
    text = "INFO ok\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.00 GiB.\n"
    diagnosis = classify_runtime_failure(text, None, 503)
    assert diagnosis.cause is Cause.CRASHED_UNDER_LOAD
    assert diagnosis.extras["health_status"] == 503
    assert "out of memory" in diagnosis.summary
    assert diagnosis.extras["tried_to_allocate_gib"] == pytest.approx(1.0)
    silent = classify_runtime_failure("", None, None)
    assert "did not answer" in silent.summary


def test_diagnosis_extras_are_read_only() -> None:
    """Diagnosis is frozen and its extras cannot be changed after the fact."""
    diagnosis = Diagnosis(Cause.OOM, "x", (), {"free_gib": 1.0})
    with pytest.raises(TypeError):
        diagnosis.extras["free_gib"] = 2.0  # type: ignore[index]
    assert Diagnosis(Cause.OOM, "x").extras == {}
