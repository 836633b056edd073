"""The ``autotune kv`` table: KV bytes per token, weights, KV capacity, concurrency, fitting limits.

Pure: takes the architecture (catalog name or config.json directory) and an optional device profile and
returns the text; the CLI prints it. Bad input raises :class:`SpecError` naming the option and value.
"""

from __future__ import annotations

from autotune.errors import SpecError
from autotune.hardware.catalog import GIB, GPUS, GpuProfile, ModelArch, load_model_arch
from autotune.hardware.memory import (
    KV_CACHE_DTYPES,
    MemoryPlan,
    kv_bytes_for_tokens,
    kv_bytes_per_token,
    plan_memory,
    weight_bytes,
)

UTILIZATION_SWEEP = (0.80, 0.85, 0.90, 0.92, 0.95, 0.98)


def _gpu(name: str) -> GpuProfile:
    for key, profile in GPUS.items():
        if key.lower() == name.lower():
            return profile
    raise SpecError("--gpu", f"unknown GPU profile {name!r}: use one of {', '.join(GPUS)}")


def _check(arch: ModelArch, utilization: float, kv_dtype: str, tp: int, max_model_len: int | None) -> None:
    if not 0 < utilization <= 1:
        raise SpecError("--gpu-memory-utilization", f"must be in (0, 1], got {utilization}")
    if kv_dtype not in KV_CACHE_DTYPES:
        raise SpecError(
            "--kv-cache-dtype", f"unknown dtype {kv_dtype!r}: use one of {', '.join(KV_CACHE_DTYPES)}"
        )
    if tp < 1 or arch.num_heads % tp:
        raise SpecError(
            "--tensor-parallel-size",
            f"{tp} must be >= 1 and divide the {arch.num_heads} attention heads of {arch.name}",
        )
    if max_model_len is not None and max_model_len < 1:
        raise SpecError("--max-model-len", f"must be >= 1, got {max_model_len}")


def kv_report(
    model: str,
    *,
    gpu: str | GpuProfile | None = None,
    gpu_memory_utilization: float = 0.9,
    kv_cache_dtype: str = "auto",
    tensor_parallel_size: int = 1,
    max_model_len: int | None = None,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 2048,
) -> str:
    """The memory table of ``model`` (and, with ``gpu``, its KV capacity on that device)."""
    try:
        arch = load_model_arch(model)
    except SpecError as exc:
        raise SpecError("MODEL", exc.message) from exc
    tp = tensor_parallel_size
    _check(arch, gpu_memory_utilization, kv_cache_dtype, tp, max_model_len)
    profile = _gpu(gpu) if isinstance(gpu, str) else gpu
    mml = max_model_len or arch.max_position_embeddings
    lines = _table(_model_rows(arch, kv_cache_dtype, tp, mml))
    if profile is None:
        lines.append("(no GPU given or found: pass --gpu NAME for capacity; known: " + ", ".join(GPUS) + ")")
        return "\n".join(lines) + "\n"

    def plan_at(utilization: float) -> MemoryPlan:
        return plan_memory(
            arch,
            profile,
            gpu_memory_utilization=utilization,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            kv_cache_dtype=kv_cache_dtype,
            tensor_parallel_size=tp,
            max_model_len=mml,
        )

    sequence = kv_bytes_for_tokens(arch, mml, kv_cache_dtype, tensor_parallel_size=tp)
    lines += [
        "",
        *_table(
            _device_rows(plan_at(gpu_memory_utilization), gpu_memory_utilization, profile, arch, sequence)
        ),
    ]
    lines += ["", f"{'utilization':>11}  {'KV GiB':>8}  {'KV tokens':>12}  {'concurrency':>11}  fits"]
    for utilization in UTILIZATION_SWEEP:
        p = plan_at(utilization)
        lines.append(
            f"{utilization:>11.2f}  {max(0, p.kv_cache_bytes) / GIB:>8.2f}  {p.kv_tokens:>12,}  "
            f"{p.max_concurrency:>10.2f}x  {'yes' if p.fits_max_model_len else 'no'}"
        )
    return "\n".join(lines) + "\n"


def _model_rows(arch: ModelArch, kv_cache_dtype: str, tp: int, mml: int) -> list[tuple[str, str]]:
    """What the model alone says: its layout, KV bytes per token and per sequence, weights per GPU."""
    per_token = kv_bytes_per_token(arch, kv_cache_dtype, tensor_parallel_size=tp)
    sequence = kv_bytes_for_tokens(arch, mml, kv_cache_dtype, tensor_parallel_size=tp)
    if arch.is_mla:
        layout = f"MLA latent {arch.kv_lora_rank} + rope {arch.qk_rope_head_dim} per layer"
    else:
        layout = f"{arch.num_kv_heads} KV heads x {arch.head_dim} head_dim ({arch.num_heads} query heads)"
    rows = [
        ("model", f"{arch.name} ({arch.architecture})"),
        ("layers", f"{arch.num_layers}, {layout}"),
    ]
    if arch.num_sliding_layers:
        rows.append(
            ("sliding window", f"{arch.num_sliding_layers} layers keep the last {arch.sliding_window:,}")
        )
    return [
        *rows,
        ("kv-cache-dtype / TP", f"{kv_cache_dtype} / {tp}"),
        ("KV bytes per token", f"{per_token:,} per GPU"),
        (f"one {mml:,}-token sequence", f"{sequence / GIB:.2f} GiB of KV cache"),
        ("weights per GPU", f"{weight_bytes(arch, tensor_parallel_size=tp) / GIB:.2f} GiB"),
    ]


def _device_rows(
    chosen: MemoryPlan, utilization: float, profile: GpuProfile, arch: ModelArch, sequence: int
) -> list[tuple[str, str]]:
    """What the device gives at the chosen utilization: budget, overhead, KV cache, what fits."""
    mml = chosen.max_model_len
    overhead = chosen.activation_bytes + chosen.cuda_graph_bytes + chosen.non_torch_bytes
    minimum = (chosen.weights_bytes + overhead + sequence) / profile.memory_bytes
    return [
        ("device", f"{profile.name}, {profile.memory_gib:.2f} GiB"),
        ("budget", f"{chosen.budget_bytes / GIB:.2f} GiB (gpu-memory-utilization {utilization})"),
        (
            "overhead",
            f"{overhead / GIB:.2f} GiB (activations {chosen.activation_bytes / GIB:.2f}, CUDA graphs "
            f"{chosen.cuda_graph_bytes / GIB:.2f}, non-torch {chosen.non_torch_bytes / GIB:.2f})",
        ),
        ("KV cache", f"{max(0, chosen.kv_cache_bytes) / GIB:.2f} GiB = {chosen.kv_tokens:,} tokens"),
        ("max concurrency", f"{chosen.max_concurrency:.2f}x at {mml:,} tokens per request"),
        ("fits max-model-len", _verdict(chosen)),
        ("longest max-model-len", _longest(chosen, arch)),
        ("min utilization", f"{minimum:.3f} for one {mml:,}-token sequence" if minimum <= 1 else "none fits"),
    ]


def _longest(plan: MemoryPlan, arch: ModelArch) -> str:
    """The longest max-model-len that starts: the KV cache's capacity or the model's own limit
    (``max_position_embeddings``), whichever is smaller, saying which binds."""
    cache, model = max(0, plan.estimated_max_model_len), arch.max_position_embeddings
    if cache >= model:
        return f"{model:,} tokens (the model's limit binds; KV room {cache:,})"
    return f"{cache:,} tokens (the KV cache binds; model limit {model:,})"


def _verdict(plan: MemoryPlan) -> str:
    if plan.fits_max_model_len:
        return "yes"
    if plan.weights_bytes > plan.device_bytes:
        return "NO (start fails: the weights alone exceed the device; raise --tensor-parallel-size)"
    if plan.kv_cache_bytes <= 0:
        return "NO (start fails: no memory left for KV-cache blocks)"
    return "NO (start fails: KV cache too small for one max-model-len sequence)"


def _table(rows: list[tuple[str, str]]) -> list[str]:
    width = max(len(k) for k, _ in rows)
    return [f"{k:<{width}}  {v}" for k, v in rows]
