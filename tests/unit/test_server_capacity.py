"""Capacity-line parsing: the 0.34 one-line form, the older two-line form, and memory figures."""

from __future__ import annotations

import json

import pytest

from autotune.server.capacity import Capacity, parse_capacity


def test_one_line_form_0_34() -> None:
    """vLLM 0.34 logs tokens and concurrency on one line (device word GPU or CPU)."""
    text = (
        "INFO 12-02 [gpu_worker.py:1] Available KV cache memory: 61.37 GiB\n"
        "INFO 12-02 [kv_cache_utils.py:1] GPU KV cache size: 1,196,643 tokens, "
        "Maximum concurrency for 8,192 tokens per request: 146.07x\n"
    )
    assert parse_capacity(text) == Capacity(
        kv_tokens=1_196_643,
        tokens_per_request=8192,
        max_concurrency=146.07,
        available_kv_cache_gib=61.37,
    )


def test_two_line_form_older_cpu() -> None:
    """Older releases log the two facts on two lines; numbers may lack thousands separators."""
    text = (
        "INFO [model_runner.py:1] Model loading took 0.0012 GiB memory and 0.35 seconds\n"
        "INFO [kv_cache_utils.py:1] CPU KV cache size: 2097152 tokens\n"
        "INFO [kv_cache_utils.py:1] Maximum concurrency for 2048 tokens per request: 1024.00x\n"
    )
    capacity = parse_capacity(text)
    assert capacity is not None
    assert capacity.kv_tokens == 2_097_152
    assert capacity.tokens_per_request == 2048
    assert capacity.max_concurrency == pytest.approx(1024.0)
    assert capacity.model_loading_gib == pytest.approx(0.0012)
    assert capacity.available_kv_cache_gib is None


def test_no_kv_cache_size_line_gives_none() -> None:
    """A log without the KV cache size line parses to None, even with other memory lines."""
    assert parse_capacity("INFO starting\nINFO Application startup complete.\n") is None
    assert parse_capacity("Model loading took 1.5 GiB memory and 2.0 seconds\n") is None


def test_as_dict_is_json_ready() -> None:
    """as_dict() gives plain JSON-serialisable values, None where not logged."""
    capacity = parse_capacity("CPU KV cache size: 4,194,304 tokens\n")
    assert capacity is not None
    assert json.loads(json.dumps(capacity.as_dict())) == {
        "kv_tokens": 4_194_304,
        "tokens_per_request": None,
        "max_concurrency": None,
        "available_kv_cache_gib": None,
        "model_loading_gib": None,
    }


def test_last_report_wins() -> None:
    """When the line appears more than once, the last one is used."""
    text = (
        "GPU KV cache size: 100 tokens, Maximum concurrency for 10 tokens per request: 10.00x\n"
        "GPU KV cache size: 200 tokens, Maximum concurrency for 10 tokens per request: 20.00x\n"
    )
    capacity = parse_capacity(text)
    assert capacity is not None
    assert capacity.kv_tokens == 200
    assert capacity.max_concurrency == pytest.approx(20.0)
