"""The `autotune kv` table (autotune/predict/kvreport.py, cli.py) and the memory model's architecture
variants."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from autotune.cli import app
from autotune.errors import SpecError
from autotune.hardware.catalog import GIB, load_model_arch
from autotune.hardware.memory import kv_bytes_for_tokens, kv_bytes_per_token
from autotune.predict.kvreport import kv_report


def test_llama70b_table_shows_327680_bytes_and_40_gib_for_128k() -> None:
    """Llama-3.1-70B: exactly 327,680 KV bytes per token and 40 GiB for one 131,072-token sequence."""
    text = kv_report("Llama-3.1-70B", max_model_len=131072)
    assert "327,680 per GPU" in text
    assert "one 131,072-token sequence  40.00 GiB" in text


def test_table_with_a_gpu_shows_capacity_concurrency_and_where_it_stops_fitting() -> None:
    """With a GPU the table gives KV tokens, max concurrency, the longest max-model-len and a sweep."""
    text = kv_report("Llama-3.1-8B", gpu="RTX-4090-24GB", max_model_len=131072)
    assert "max concurrency" in text
    assert "fits max-model-len     NO" in text
    assert "min utilization" in text
    assert text.count("\n") > 15


def test_mla_models_store_the_latent_once_per_layer(tmp_path: Path) -> None:
    """DeepSeek MLA: KV per token = layers x (kv_lora_rank + qk_rope_head_dim) x bytes, not split by TP."""
    config = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "num_hidden_layers": 61,
        "hidden_size": 7168,
        "num_attention_heads": 128,
        "num_key_value_heads": 128,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "n_routed_experts": 256,
        "num_experts_per_tok": 8,
        "vocab_size": 129280,
        "max_position_embeddings": 163840,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    arch = load_model_arch(str(tmp_path))
    assert kv_bytes_per_token(arch) == 61 * 576 * 2 == 70_272
    assert kv_bytes_per_token(arch, tensor_parallel_size=8) == 70_272
    assert kv_bytes_per_token(arch, "fp8") == 35_136


def test_sliding_window_layers_keep_only_the_window(tmp_path: Path) -> None:
    """Sliding-window layers (layer_types) hold at most the window; full layers hold every token."""
    config = {
        "num_hidden_layers": 4,
        "hidden_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 1000,
        "max_position_embeddings": 32768,
        "sliding_window": 1024,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    arch = load_model_arch(str(tmp_path))
    per_layer = 2 * 2 * 64 * 2
    assert (arch.sliding_window, arch.num_sliding_layers) == (1024, 2)
    assert kv_bytes_for_tokens(arch, 8192) == per_layer * (2 * 8192 + 2 * 1024)
    assert kv_bytes_for_tokens(arch, 512) == 512 * kv_bytes_per_token(arch)


def test_fp8_halves_the_sequence_bytes() -> None:
    """fp8 KV cache halves the bytes of a sequence (40 GiB -> 20 GiB for Llama-3.1-70B at 128k)."""
    arch = load_model_arch("Llama-3.1-70B")
    assert kv_bytes_for_tokens(arch, 131072, "fp8") / GIB == pytest.approx(20.0)


@pytest.mark.parametrize(
    ("args", "option"),
    [
        (["--gpu", "TPU-9000"], "--gpu"),
        (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
        (["--kv-cache-dtype", "int3"], "--kv-cache-dtype"),
        (["--tensor-parallel-size", "3"], "--tensor-parallel-size"),
        (["--max-model-len", "0"], "--max-model-len"),
    ],
)
def test_cli_bad_input_is_one_line_naming_the_option_and_exit_2(args: list[str], option: str) -> None:
    """`autotune kv` with a bad option prints one error line naming the option and value, exit status 2."""
    result = CliRunner().invoke(app, ["kv", "Llama-3.1-8B", *args])
    assert result.exit_code == 2
    assert f"error: {option}:" in result.output
    assert args[1] in result.output


def test_cli_prints_the_table() -> None:
    """`autotune kv MODEL --gpu NAME` prints the table and exits 0."""
    result = CliRunner().invoke(app, ["kv", "Llama-3.1-70B", "--gpu", "H100-80GB", "-tp", "4"])
    assert result.exit_code == 0, result.output
    assert "81,920 per GPU" in result.output


def test_unknown_model_names_the_argument() -> None:
    """An unknown model is a SpecError naming MODEL."""
    with pytest.raises(SpecError, match=r"^MODEL: "):
        kv_report("no-such-model")


def test_verdict_names_the_real_reason_a_config_cannot_start() -> None:
    """Weights larger than the device are named as such, not reported as a too-small KV cache."""
    from autotune.predict.kvreport import kv_report

    text = kv_report("Llama-3.1-70B", gpu="H100-80GB", max_model_len=131072)
    assert "weights alone exceed the device" in text
    assert "KV cache too small" not in text


def test_longest_max_model_len_never_exceeds_the_models_own_limit() -> None:
    """Llama-3.1-70B at TP 4 with fp8 KV on an H100 holds ~938k tokens of KV cache, but the longest
    max-model-len is the model's 131,072 (max_position_embeddings), and the table says which binds."""
    roomy = kv_report("Llama-3.1-70B", gpu="H100-80GB", tensor_parallel_size=4, kv_cache_dtype="fp8")
    line = next(x for x in roomy.splitlines() if x.startswith("longest max-model-len"))
    assert "131,072 tokens (the model's limit binds" in line
    assert "938,528" in line  # the KV room is still stated
    tight = kv_report("Llama-3.1-8B", gpu="RTX-4090-24GB", max_model_len=131072)
    line = next(x for x in tight.splitlines() if x.startswith("longest max-model-len"))
    assert "(the KV cache binds; model limit 131,072)" in line
    assert int(line.split()[2].replace(",", "")) < 131072
