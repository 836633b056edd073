"""Built-in model architectures and GPU profiles (values, not behaviour).

The architectures are the real ones from each model's Hugging Face ``config.json``; the GPU profiles carry
what the memory model and the simulated server need: usable device memory as ``nvidia-smi`` reports it,
HBM/GDDR bandwidth, dense FP16/BF16 tensor throughput (FP32 accumulate, no sparsity) and the bandwidth of
the link used for tensor-parallel all-reduce. :func:`load_model_arch` also reads any ``config.json``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotune.errors import SpecError

GIB = 1024**3


@dataclass(frozen=True)
class ModelArch:
    """A decoder-only transformer as the memory and cost models see it."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    num_experts: int = 1
    """Experts per MoE layer (1 for a dense model); weights count all of them."""
    experts_per_token: int = 1
    """Experts each token is routed to (top-k); FLOPs count only these."""
    tie_word_embeddings: bool = False
    torch_dtype: str = "bfloat16"
    architecture: str = "LlamaForCausalLM"
    kv_lora_rank: int = 0
    """MLA (DeepSeek-V2/V3 style): width of the compressed latent KV; 0 for ordinary attention."""
    qk_rope_head_dim: int = 0
    """MLA: the decoupled RoPE key width stored next to the latent (one per token and layer)."""
    sliding_window: int = 0
    """Window of the sliding-window attention layers in tokens; 0 when there are none."""
    num_sliding_layers: int = 0
    """How many of ``num_layers`` attend only to the last ``sliding_window`` tokens."""

    @property
    def is_mla(self) -> bool:
        """Whether the KV cache stores MLA's compressed latent instead of per-head keys and values."""
        return self.kv_lora_rank > 0


@dataclass(frozen=True)
class GpuProfile:
    """One accelerator: memory in bytes, bandwidths in GB/s (1e9 B/s), dense FP16 TFLOP/s."""

    name: str
    memory_bytes: int
    bandwidth_gbs: float
    tflops: float
    interconnect_gbs: float = 32.0

    @property
    def memory_gib(self) -> float:
        """Device memory in GiB."""
        return self.memory_bytes / GIB


MODELS: dict[str, ModelArch] = {
    m.name: m
    for m in (
        ModelArch("Llama-3.1-8B", 32, 4096, 32, 8, 128, 14336, 128256, 131072),
        ModelArch("Llama-3.1-70B", 80, 8192, 64, 8, 128, 28672, 128256, 131072),
        ModelArch(  # a small draft model for speculative decoding with Llama-3.1
            "Llama-3.2-1B", 16, 2048, 32, 8, 64, 8192, 128256, 131072, tie_word_embeddings=True,
        ),
        ModelArch(
            "Qwen2.5-7B", 28, 3584, 28, 4, 128, 18944, 152064, 32768,
            architecture="Qwen2ForCausalLM",
        ),
        ModelArch(
            "Qwen2.5-72B", 80, 8192, 64, 8, 128, 29568, 152064, 32768,
            architecture="Qwen2ForCausalLM",
        ),
        ModelArch(
            "Mistral-7B", 32, 4096, 32, 8, 128, 14336, 32768, 32768,
            architecture="MistralForCausalLM",
        ),
        ModelArch(
            "Mixtral-8x7B", 32, 4096, 32, 8, 128, 14336, 32000, 32768,
            num_experts=8, experts_per_token=2, architecture="MixtralForCausalLM",
        ),
        ModelArch(
            "DeepSeek-V2-Lite", 27, 2048, 16, 16, 192, 1408, 102400, 163840,
            num_experts=64, experts_per_token=6, architecture="DeepseekV2ForCausalLM",
            kv_lora_rank=512, qk_rope_head_dim=64,
        ),
    )
}  # fmt: skip

_MIB = 1024**2
GPUS: dict[str, GpuProfile] = {
    g.name: g
    for g in (
        GpuProfile("H100-80GB", 81559 * _MIB, 3350.0, 989.0, 450.0),
        GpuProfile("H200-141GB", 143771 * _MIB, 4800.0, 989.0, 450.0),
        GpuProfile("A100-80GB", 81920 * _MIB, 2039.0, 312.0, 300.0),
        GpuProfile("L40S-48GB", 46068 * _MIB, 864.0, 181.0, 32.0),
        GpuProfile("RTX-4090-24GB", 24564 * _MIB, 1008.0, 165.0, 32.0),
    )
}


def gpu_profile(name: str) -> GpuProfile:
    """Return the built-in profile ``name`` (case-insensitive); SpecError lists the known ones."""
    for key, profile in GPUS.items():
        if key.lower() == name.lower():
            return profile
    raise SpecError("hardware", f"unknown GPU profile {name!r}; known: {', '.join(GPUS)}")


def _sliding_layers(cfg: dict[str, Any], layers: int) -> tuple[int, int]:
    """(window, number of sliding-window layers) from the config's several spellings."""
    window = int(cfg.get("sliding_window") or 0)
    if window <= 0 or cfg.get("use_sliding_window") is False:
        return 0, 0
    types = cfg.get("layer_types")
    if isinstance(types, list) and types:
        return window, sum(1 for t in types if str(t) == "sliding_attention")
    pattern = cfg.get("sliding_window_pattern")
    if isinstance(pattern, int) and pattern > 1:  # Gemma: every pattern-th layer is global
        return window, layers - layers // pattern
    if window >= int(cfg.get("max_position_embeddings") or 0) > 0:
        return 0, 0  # a window as long as the context is no window
    return window, layers


def _arch_from_config(name: str, cfg: dict[str, Any]) -> ModelArch:
    text = cfg.get("text_config")
    if isinstance(text, dict):  # multimodal wrappers keep the language model here
        cfg = {**cfg, **text}
    try:
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        archs = cfg.get("architectures") or ["LlamaForCausalLM"]
        layers = int(cfg["num_hidden_layers"])
        window, sliding = _sliding_layers(cfg, layers)
        return ModelArch(
            name=name,
            num_layers=layers,
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            intermediate_size=int(
                cfg.get("moe_intermediate_size") or cfg.get("intermediate_size") or 4 * hidden
            ),
            vocab_size=int(cfg["vocab_size"]),
            max_position_embeddings=int(cfg.get("max_position_embeddings") or 2048),
            num_experts=int(
                cfg.get("num_local_experts") or cfg.get("num_experts") or cfg.get("n_routed_experts") or 1
            ),
            experts_per_token=int(cfg.get("num_experts_per_tok") or 1),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"),
            architecture=str(archs[0]),
            kv_lora_rank=int(cfg.get("kv_lora_rank") or 0),
            qk_rope_head_dim=int(cfg.get("qk_rope_head_dim") or 0),
            sliding_window=window,
            num_sliding_layers=sliding,
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise SpecError("model", f"config.json of {name!r} lacks or mangles {exc}") from exc


def load_model_arch(model: str) -> ModelArch:
    """Return the architecture of a catalog name or of a directory's (or file's) config.json.

    Catalog names match case-insensitively, also behind an organisation (``meta-llama/Llama-3.1-8B``)
    and with an ``-Instruct`` suffix (``Qwen2.5-7B-Instruct``).
    """
    base = model.rstrip("/").rsplit("/", 1)[-1].lower()
    is_dir = Path(model).is_dir()
    for key, arch in MODELS.items():
        if not is_dir and (base == key.lower() or base.startswith(key.lower() + "-instruct")):
            return arch
    path = Path(model)
    config = path / "config.json" if path.is_dir() else path
    if config.name.endswith(".json") and config.is_file():
        try:
            data = json.loads(config.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise SpecError("model", f"cannot read {config}: {exc}") from exc
        if not isinstance(data, dict):
            raise SpecError("model", f"{config} is not a JSON object")
        return _arch_from_config(model, data)
    raise SpecError(
        "model",
        f"{model!r} is neither a directory with a config.json nor a catalog model ({', '.join(MODELS)})",
    )
