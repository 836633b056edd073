"""Tests of the memory model (autotune/hardware/memory.py) and the catalog it reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autotune.errors import SpecError
from autotune.hardware.catalog import GIB, GPUS, MODELS, load_model_arch
from autotune.hardware.memory import (
    cuda_graph_sizes,
    kv_bytes_per_token,
    param_count,
    plan_memory,
    weight_bytes,
)


def test_llama70b_kv_bytes_per_token_worked_example() -> None:
    """Llama-3.1-70B in fp16 takes 327,680 KV bytes per token, so 128k tokens take 40 GiB."""
    arch = MODELS["Llama-3.1-70B"]
    per_token = kv_bytes_per_token(arch)
    assert per_token == 327_680
    assert per_token * 128 * 1024 / GIB == pytest.approx(40.0)


def test_fp8_halves_kv_bytes_and_tp_splits_them() -> None:
    """fp8 KV takes one byte per element (half of fp16) and TP divides the KV heads per GPU."""
    arch = MODELS["Llama-3.1-8B"]
    assert kv_bytes_per_token(arch, "fp8") * 2 == kv_bytes_per_token(arch, "auto") == 131_072
    assert kv_bytes_per_token(arch, "auto", tensor_parallel_size=2) == 65_536
    assert kv_bytes_per_token(MODELS["Qwen2.5-7B"], tensor_parallel_size=8) == 2 * 28 * 128 * 2


@pytest.mark.parametrize(
    ("name", "billions"),
    [("Llama-3.1-8B", 8.03), ("Llama-3.1-70B", 70.55), ("Mixtral-8x7B", 46.70), ("Mistral-7B", 7.25)],
)
def test_param_counts_match_the_published_sizes(name: str, billions: float) -> None:
    """Parameter counts from the architecture match the models' published sizes (MoE: all experts)."""
    assert param_count(MODELS[name]) / 1e9 == pytest.approx(billions, rel=0.01)


def test_weights_are_split_by_tensor_parallelism() -> None:
    """Weight memory per GPU is the bf16 size divided by the TP size."""
    arch = MODELS["Llama-3.1-70B"]
    assert weight_bytes(arch, tensor_parallel_size=4) == weight_bytes(arch) // 4
    assert weight_bytes(arch) / GIB == pytest.approx(131.4, rel=0.01)


def test_kv_capacity_grows_with_utilisation_and_doubles_with_fp8() -> None:
    """More utilisation leaves more KV memory; fp8 doubles the tokens that fit in it."""
    arch, gpu = MODELS["Llama-3.1-8B"], GPUS["RTX-4090-24GB"]
    low = plan_memory(arch, gpu, gpu_memory_utilization=0.8, max_model_len=2048)
    high = plan_memory(arch, gpu, gpu_memory_utilization=0.9, max_model_len=2048)
    fp8 = plan_memory(arch, gpu, gpu_memory_utilization=0.9, kv_cache_dtype="fp8", max_model_len=2048)
    assert low.kv_tokens < high.kv_tokens
    assert fp8.kv_tokens / high.kv_tokens == pytest.approx(2.0, rel=0.01)
    assert high.max_concurrency == pytest.approx(high.num_blocks / (2048 / 16))


def test_bigger_batches_cost_kv_memory() -> None:
    """Larger max_num_seqs (graphs, sampler) and max_num_batched_tokens (activations) shrink the KV cache."""
    arch, gpu = MODELS["Llama-3.1-8B"], GPUS["RTX-4090-24GB"]
    base = plan_memory(arch, gpu, max_num_seqs=64, max_num_batched_tokens=2048).kv_cache_bytes
    assert plan_memory(arch, gpu, max_num_seqs=512, max_num_batched_tokens=2048).kv_cache_bytes < base
    assert plan_memory(arch, gpu, max_num_seqs=64, max_num_batched_tokens=8192).kv_cache_bytes < base


def test_cuda_graph_sizes_stop_at_twice_max_num_seqs_or_512() -> None:
    """Captured sizes are 1, 2, 4 and multiples of 8 up to min(2 x max_num_seqs, 512)."""
    assert cuda_graph_sizes(4) == [1, 2, 4, 8]
    assert max(cuda_graph_sizes(1024)) == 512
    assert len(cuda_graph_sizes(256)) == 67


def test_load_model_arch_reads_a_config_json_directory(tmp_path: Path) -> None:
    """A directory with a Hugging Face config.json gives its architecture; head_dim is derived."""
    config = {
        "architectures": ["LlamaForCausalLM"],
        "num_hidden_layers": 2,
        "hidden_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 256,
        "vocab_size": 2048,
        "max_position_embeddings": 4096,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    arch = load_model_arch(str(tmp_path))
    assert (arch.num_layers, arch.head_dim, arch.num_kv_heads) == (2, 32, 2)
    assert kv_bytes_per_token(arch) == 2 * 2 * 2 * 32 * 2


def test_catalog_names_match_hub_style_ids() -> None:
    """Catalog names match case-insensitively, behind an organisation and with an -Instruct suffix."""
    assert load_model_arch("meta-llama/Llama-3.1-8B-Instruct") is MODELS["Llama-3.1-8B"]
    assert load_model_arch("mistralai/Mistral-7B-Instruct-v0.3") is MODELS["Mistral-7B"]
    assert load_model_arch("qwen2.5-72b") is MODELS["Qwen2.5-72B"]


def test_unknown_model_is_a_spec_error() -> None:
    """A name that is neither in the catalog nor a directory is rejected with the known names."""
    with pytest.raises(SpecError, match=r"Llama-3\.1-8B"):
        load_model_arch("no-such-model")
