"""KV-cache and weight memory model: pure functions of an architecture, a GPU and the serve flags.

Shared by the simulated server (which derives its startup outcome from it) and by the tuner's
feasibility checks. The accounting follows vLLM's startup profile, per GPU of a tensor-parallel group:

    KV cache = gpu_memory_utilization x device memory
               - weights - activation peak - CUDA-graph memory - non-torch memory

* weights: every parameter (all experts of an MoE, the embedding, an untied LM head) x dtype bytes / TP;
* activation peak: the profile forward pass over ``max_num_batched_tokens`` tokens plus the sampler's
  fp32 logits (and their softmax/sort copies) for ``max_num_seqs`` sequences;
* CUDA graphs: one graph per captured batch size (1, 2, 4, then multiples of 8 up to
  ``min(2 x max_num_seqs, 512)``), each holding per-layer buffers;
* non-torch: CUDA context, cuBLAS workspaces, NCCL buffers when TP > 1;
* KV bytes per token = 2 (K and V) x layers x KV heads x head_dim x element bytes (fp8 = 1 byte).

The figures are estimates calibrated to what vLLM logs on real GPUs (within roughly 10-20 %), not a
replacement for a launch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from autotune.hardware.catalog import GIB, GpuProfile, ModelArch

MIB = 1024**2

KV_CACHE_DTYPES: tuple[str, ...] = ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")
"""The ``--kv-cache-dtype`` values the simulated server and the memory model accept."""

_DTYPE_BYTES = {
    "auto": 2,
    "half": 2,
    "float16": 2,
    "bfloat16": 2,
    "float": 4,
    "float32": 4,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
}


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a vLLM dtype name (``auto``, ``bfloat16``, ``fp8``, ...)."""
    try:
        return _DTYPE_BYTES[dtype.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(_DTYPE_BYTES)}") from None


def is_fp8(kv_cache_dtype: str) -> bool:
    """Whether a ``--kv-cache-dtype`` stores one byte per element."""
    return kv_cache_dtype.lower().startswith("fp8")


def _layer_params(arch: ModelArch, experts: int) -> int:
    q = arch.num_heads * arch.head_dim
    kv = arch.num_kv_heads * arch.head_dim
    attention = arch.hidden_size * (q + 2 * kv) + q * arch.hidden_size
    mlp = 3 * arch.hidden_size * arch.intermediate_size * experts
    router = arch.hidden_size * arch.num_experts if arch.num_experts > 1 else 0
    return attention + mlp + router + 2 * arch.hidden_size


def param_count(arch: ModelArch) -> int:
    """All parameters: every layer with all its experts, the embedding and an untied LM head."""
    embed = arch.vocab_size * arch.hidden_size
    head = 0 if arch.tie_word_embeddings else embed
    return arch.num_layers * _layer_params(arch, arch.num_experts) + embed + head + arch.hidden_size


def active_params_per_token(arch: ModelArch) -> int:
    """Matmul parameters one token passes through (top-k experts only; no embedding or LM head)."""
    return arch.num_layers * _layer_params(arch, arch.experts_per_token)


def weight_bytes(arch: ModelArch, dtype: str = "auto", tensor_parallel_size: int = 1) -> int:
    """Weight memory per GPU: all parameters x dtype bytes / TP."""
    name = arch.torch_dtype if dtype == "auto" else dtype
    return param_count(arch) * dtype_bytes(name) // tensor_parallel_size


def kv_bytes_per_token(
    arch: ModelArch, kv_cache_dtype: str = "auto", dtype: str = "auto", tensor_parallel_size: int = 1
) -> int:
    """KV-cache bytes one token occupies on one GPU: 2 x layers x KV heads/TP x head_dim x bytes.

    ``kv_cache_dtype="auto"`` uses the model dtype; fp8 variants take one byte. KV heads are split
    across TP ranks and replicated when there are fewer heads than ranks. MLA models (DeepSeek
    ``kv_lora_rank``) store ``layers x (kv_lora_rank + qk_rope_head_dim) x bytes`` on every rank.
    Every layer counts, sliding-window ones too (see :func:`kv_bytes_for_tokens` for a sequence).
    """
    return arch.num_layers * _kv_bytes_per_layer(arch, kv_cache_dtype, dtype, tensor_parallel_size)


def _kv_bytes_per_layer(arch: ModelArch, kv_cache_dtype: str, dtype: str, tensor_parallel_size: int) -> int:
    if kv_cache_dtype == "auto":
        element = dtype_bytes(arch.torch_dtype if dtype == "auto" else dtype)
    else:
        element = dtype_bytes(kv_cache_dtype)
    if arch.is_mla:  # one latent + RoPE key per token and layer, replicated on every TP rank
        return (arch.kv_lora_rank + arch.qk_rope_head_dim) * element
    heads = max(1, math.ceil(arch.num_kv_heads / tensor_parallel_size))
    return 2 * heads * arch.head_dim * element


def kv_bytes_for_tokens(
    arch: ModelArch,
    tokens: int,
    kv_cache_dtype: str = "auto",
    dtype: str = "auto",
    tensor_parallel_size: int = 1,
) -> int:
    """KV bytes one sequence of ``tokens`` tokens needs on one GPU.

    Full-attention layers keep every token; sliding-window layers keep at most ``sliding_window``
    (vLLM's hybrid KV-cache manager). Without sliding layers this is ``tokens x kv_bytes_per_token``.
    """
    per_layer = _kv_bytes_per_layer(arch, kv_cache_dtype, dtype, tensor_parallel_size)
    sliding = arch.num_sliding_layers if arch.sliding_window > 0 else 0
    full = arch.num_layers - sliding
    return per_layer * (full * tokens + sliding * min(tokens, arch.sliding_window))


_SAMPLER_COPIES = 7
"""fp32-sized [max_num_seqs, vocab] tensors alive at the sampler's peak (logits, probs, logprobs,
sorted values and int64 indices for top-k/top-p)."""


def activation_peak_bytes(
    arch: ModelArch, max_num_batched_tokens: int, max_num_seqs: int, tensor_parallel_size: int = 1
) -> int:
    """Peak activation memory of the startup profile run (grows with max_num_batched_tokens)."""
    inter = arch.intermediate_size * arch.experts_per_token // tensor_parallel_size
    per_token = (2 * inter + 4 * arch.hidden_size) * 2 * 4  # bf16, ~4 live copies (compiled graph)
    logits = max_num_seqs * arch.vocab_size * 4 * _SAMPLER_COPIES
    return max_num_batched_tokens * per_token + logits + 64 * MIB


def cuda_graph_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes vLLM captures a CUDA graph for: 1, 2, 4, 8, 16, ... up to min(2 x seqs, 512)."""
    largest = min(2 * max_num_seqs, 512)
    return [s for s in (1, 2, 4) if s <= largest] + list(range(8, largest + 1, 8))


def cuda_graph_bytes(
    arch: ModelArch, max_num_seqs: int, tensor_parallel_size: int = 1, num_graphs: int | None = None
) -> int:
    """Memory the CUDA graphs keep (grows with the number of captured sizes and with layers).

    ``num_graphs`` overrides the default count (``len(cuda_graph_sizes(max_num_seqs))``): explicit
    capture sizes, or 0 when nothing is captured (eager mode).
    """
    graphs = len(cuda_graph_sizes(max_num_seqs)) if num_graphs is None else num_graphs
    if graphs == 0:
        return 0
    per_graph = arch.num_layers * MIB // 5
    return 16 * MIB + graphs * per_graph // max(1, int(math.sqrt(tensor_parallel_size)))


def non_torch_bytes(tensor_parallel_size: int = 1) -> int:
    """CUDA context, cuBLAS workspaces and (TP > 1) NCCL buffers."""
    return int(0.6 * GIB) + (int(0.25 * GIB) if tensor_parallel_size > 1 else 0)


@dataclass(frozen=True)
class MemoryPlan:
    """Per-GPU memory accounting of one configuration (all sizes in bytes)."""

    device_bytes: int
    budget_bytes: int
    """gpu_memory_utilization x device memory."""
    weights_bytes: int
    activation_bytes: int
    cuda_graph_bytes: int
    non_torch_bytes: int
    kv_cache_bytes: int
    """What is left for the KV cache; zero or negative when nothing is."""
    kv_bytes_per_token: int
    block_size: int
    num_blocks: int
    max_model_len: int

    @property
    def kv_tokens(self) -> int:
        """KV-cache capacity in tokens (``GPU KV cache size``)."""
        return self.num_blocks * self.block_size

    @property
    def max_concurrency(self) -> float:
        """How many max_model_len requests fit at once (``Maximum concurrency``)."""
        blocks_per_request = math.ceil(self.max_model_len / self.block_size)
        return self.num_blocks / blocks_per_request

    @property
    def fits_max_model_len(self) -> bool:
        """Whether one request of max_model_len tokens fits in the KV cache."""
        return self.kv_tokens >= self.max_model_len

    @property
    def estimated_max_model_len(self) -> int:
        """The longest request the KV cache holds (vLLM's ``estimated maximum model length``)."""
        return self.kv_tokens


def plan_memory(
    arch: ModelArch,
    gpu: GpuProfile,
    *,
    gpu_memory_utilization: float = 0.9,
    max_num_batched_tokens: int = 2048,
    max_num_seqs: int = 256,
    block_size: int = 16,
    kv_cache_dtype: str = "auto",
    dtype: str = "auto",
    tensor_parallel_size: int = 1,
    max_model_len: int | None = None,
    num_cuda_graphs: int | None = None,
    extra_weight_bytes: int = 0,
    extra_kv_bytes_per_token: int = 0,
    activation_scale: float = 1.0,
    cuda_graph_scale: float = 1.0,
    extra_non_torch_bytes: int = 0,
) -> MemoryPlan:
    """Account one GPU's memory for these flags and derive the KV-cache capacity.

    ``num_cuda_graphs`` overrides the number of captured CUDA graphs (see :func:`cuda_graph_bytes`);
    ``extra_weight_bytes`` and ``extra_kv_bytes_per_token`` add a speculative-decoding draft model's
    weights and KV cache (per GPU), which share the budget and the block table with the target's.
    ``activation_scale``, ``cuda_graph_scale`` and ``extra_non_torch_bytes`` set what a GPU really takes
    against the model's terms (the simulator's hidden truth, :class:`autotune.sim.cost.Physics`).

    Example: Llama-3.1-70B (fp16 KV) takes 327,680 bytes per token, so 128k tokens take 40 GiB.
    """
    tp = tensor_parallel_size
    budget = int(gpu_memory_utilization * gpu.memory_bytes)
    weights = weight_bytes(arch, dtype, tp) + extra_weight_bytes
    activation = round(
        activation_peak_bytes(arch, max_num_batched_tokens, max_num_seqs, tp) * activation_scale
    )
    graphs = round(cuda_graph_bytes(arch, max_num_seqs, tp, num_cuda_graphs) * cuda_graph_scale)
    other = non_torch_bytes(tp) + extra_non_torch_bytes
    kv = budget - weights - activation - graphs - other
    per_token = kv_bytes_per_token(arch, kv_cache_dtype, dtype, tp) + extra_kv_bytes_per_token
    blocks = max(0, kv) // (per_token * block_size)
    return MemoryPlan(
        device_bytes=gpu.memory_bytes,
        budget_bytes=budget,
        weights_bytes=weights,
        activation_bytes=activation,
        cuda_graph_bytes=graphs,
        non_torch_bytes=other,
        kv_cache_bytes=kv,
        kv_bytes_per_token=per_token,
        block_size=block_size,
        num_blocks=blocks,
        max_model_len=max_model_len or arch.max_position_embeddings,
    )


POST_PROFILE_RESERVE_BYTES: tuple[int, int] = (int(0.25 * GIB), int(0.85 * GIB))
"""Range of memory used after the startup profile that the KV budget does not see (allocator caches,
workspaces, CUDA-graph capture slack): the start can fail close to the device edge because of it."""

GRAPH_ESTIMATE_SIGMA = 0.4
"""Spread (log scale, one sigma) of the real CUDA-graph memory around :func:`cuda_graph_bytes`."""


def edge_start_probability(plan: MemoryPlan, *, steps: int = 200) -> float:
    """Probability that CUDA-graph capture still fits on the device, given the KV cache was allocated.

    The budget is filled by the profile; what the profile did not see (the real graph memory, a lognormal
    ``GRAPH_ESTIMATE_SIGMA`` around the estimate, plus a reserve uniform in
    ``POST_PROFILE_RESERVE_BYTES``) must fit in ``device - budget + graph estimate``. Close to 1 far from
    the device edge, 0 when even the smallest reserve does not fit.
    """
    low, high = POST_PROFILE_RESERVE_BYTES
    room = plan.device_bytes - plan.budget_bytes + plan.cuda_graph_bytes
    graphs = max(1, plan.cuda_graph_bytes)
    total = 0.0
    for i in range(steps):
        left = room - (low + (high - low) * (i + 0.5) / steps)
        if left <= 0:
            continue
        z = math.log(left / graphs) / GRAPH_ESTIMATE_SIGMA
        total += 0.5 * math.erfc(-z / math.sqrt(2))
    return total / steps


EDGE_LEARN_WIDTH = GIB
"""After out-of-memory starts and no start with more spare memory: how far above the failures' spare the
start chance climbs back to the prior's."""
EDGE_PROVEN = 0.99
"""Start chance of a config with at least the spare memory of one that started."""


@dataclass(frozen=True)
class DeviceEdge:
    """The device edge as launches showed it. Past the budget (``gpu_memory_utilization`` x device) a start
    needs the real CUDA-graph memory and a reserve; the budget already holds the graph estimate, so what
    the estimate misses is one amount of this model on this device, and a start fits when the spare
    memory ``device - budget`` covers it. A launch out of memory at start says the amount is above its
    spare; a launch that started says it is at most its spare."""

    failed_spare: int | None = None
    """Largest spare memory of a launch that ran out of memory at start (bytes)."""
    started_spare: int | None = None
    """Smallest spare memory of a launch that started."""

    @classmethod
    def of(cls, starts: Sequence[tuple[MemoryPlan, bool]]) -> DeviceEdge:
        """The edge shown by (plan, started) launches."""
        failed = [p.device_bytes - p.budget_bytes for p, ok in starts if not ok]
        started = [p.device_bytes - p.budget_bytes for p, ok in starts if ok]
        return cls(max(failed) if failed else None, min(started) if started else None)

    def start_probability(self, plan: MemoryPlan) -> float:
        """:func:`edge_start_probability` corrected by the edge: zero at or below a failure's spare memory,
        rising linearly up to the smallest spare that started (or :data:`EDGE_LEARN_WIDTH` above), never
        above the prior there; at least :data:`EDGE_PROVEN` with as much spare as a start had. Contradicting
        launches (a failure with more spare than a start: noise at the edge) leave the prior."""
        prior = edge_start_probability(plan)
        spare = plan.device_bytes - plan.budget_bytes
        low, high = self.failed_spare, self.started_spare
        if high is not None and spare >= high and (low is None or low < high):
            return max(prior, EDGE_PROVEN)
        if low is None or (high is not None and high <= low):
            return prior
        top = high if high is not None else low + EDGE_LEARN_WIDTH
        learned = min(1.0, max(0.0, (spare - low) / (top - low)))
        return min(prior, learned)
