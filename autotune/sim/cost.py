"""Step time of the simulated engine: a roofline over one batch, plus what the host adds per step.

``step time = max(FLOPs / (peak x 0.65), bytes / (bandwidth x eff)) + overhead``, where

* FLOPs = 2 x active params x tokens + attention (4 x layers x q_dim x token-context pairs) + LM head for
  sampled tokens, split over TP ranks;
* bytes = weights read once per step (MoE: the expected fraction of experts touched) at 85 % of peak
  bandwidth, plus every scheduled sequence's KV context at a paged-attention efficiency that grows with
  block size (16 is ~10 % slower than 64); fp8 KV halves those bytes and pays a 15 % dequant cost;
* overhead = 1.5 ms per step + 15 us per sequence (sampling, detokenising, what async scheduling cannot
  hide) + for TP > 1 two all-reduces per layer (latency + activation bytes over the interconnect)
  + without async scheduling, the scheduler's own time (1 ms + 10 us per sequence) in series with the
  GPU + kernel-launch time where no CUDA graph covers the step: 30 us per layer eager (``--enforce-eager``,
  ``-O0``, or a decode batch larger than the largest captured size), 8 us per layer for a decode batch
  under piecewise graphs only (``-O1``). Steps that carry prefill tokens keep the base overhead (their
  launch time hides behind compute).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from autotune.hardware.catalog import GpuProfile, ModelArch
from autotune.hardware.memory import (
    active_params_per_token,
    dtype_bytes,
    is_fp8,
    kv_bytes_per_token,
    param_count,
)

COMPUTE_EFFICIENCY = 0.65
WEIGHT_BANDWIDTH_EFFICIENCY = 0.85
STEP_OVERHEAD_S = 1.5e-3
PER_SEQ_OVERHEAD_S = 15e-6
FP8_DEQUANT_FACTOR = 1.15
ALLREDUCE_LATENCY_S = 12e-6
SYNC_SCHEDULING_S = 1.0e-3
"""Scheduler time per step that async scheduling overlaps with the GPU (and that adds up without it)."""
SYNC_PER_SEQ_S = 10e-6
EAGER_LAUNCH_S_PER_LAYER = 30e-6
"""Kernel launches of one layer without a CUDA graph."""
PIECEWISE_LAUNCH_S_PER_LAYER = 8e-6
"""Launches left per layer under piecewise CUDA graphs (attention runs outside the graph)."""


ATTENTION_CURVE = (0.85, 0.18)
"""Paged attention's bandwidth efficiency ``a x (1 - b x min(1, 16 / block_size))`` as ``(a, b)``."""


def attention_efficiency(block_size: int, curve: tuple[float, float] = ATTENTION_CURVE) -> float:
    """Fraction of peak bandwidth paged attention reaches: 16 -> 0.70, 32 -> 0.77, 64 -> 0.81 (on
    :data:`ATTENTION_CURVE`; ``curve`` gives another ``(a, b)``)."""
    a, b = curve
    return a * (1.0 - b * min(1.0, 16.0 / block_size))


@dataclass(frozen=True)
class Physics:
    """What the simulated GPU really does: the cost model's constants and the memory terms the startup
    adds to :func:`autotune.hardware.memory.plan_memory`'s (the defaults: this module's constants and the
    memory model's own terms). A benchmark's hidden truth sets others; the tuner's models never see them."""

    compute_efficiency: float = COMPUTE_EFFICIENCY
    weight_bandwidth_efficiency: float = WEIGHT_BANDWIDTH_EFFICIENCY
    attention: tuple[float, float] = ATTENTION_CURVE
    """Paged attention's curve, as :data:`ATTENTION_CURVE`."""
    step_overhead_s: float = STEP_OVERHEAD_S
    per_seq_overhead_s: float = PER_SEQ_OVERHEAD_S
    activation_scale: float = 1.0
    """True activation peak / :func:`autotune.hardware.memory.activation_peak_bytes`."""
    cuda_graph_scale: float = 1.0
    """True CUDA-graph memory / :func:`autotune.hardware.memory.cuda_graph_bytes`."""
    extra_non_torch_bytes: int = 0
    """Non-torch memory beyond :func:`autotune.hardware.memory.non_torch_bytes` (inside the budget: less
    KV)."""
    extra_reserve_bytes: int = 0
    """Memory used after the profile beyond :data:`autotune.sim.startup.HIDDEN_RESERVE_BYTES`."""


@dataclass(frozen=True)
class Scales:
    """Multipliers on the cost model's free constants (1.0: the constants above). A calibration
    (:mod:`autotune.predict.surrogate`) fits them to what a GPU measured; the simulator runs with none."""

    compute: float = 1.0
    """On :data:`COMPUTE_EFFICIENCY` (prefill speed)."""
    weights: float = 1.0
    """On :data:`WEIGHT_BANDWIDTH_EFFICIENCY` (the decode step's floor)."""
    attention: float = 1.0
    """On :func:`attention_efficiency` (KV reads per context token)."""
    step_overhead: float = 1.0
    """On :data:`STEP_OVERHEAD_S` (host time per step)."""
    per_seq_overhead: float = 1.0
    """On :data:`PER_SEQ_OVERHEAD_S` (host time per sequence of a step)."""

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The scales' names, in order."""
        return tuple(f.name for f in fields(cls))


@dataclass(frozen=True)
class Execution:
    """How steps run on the host: async scheduling and CUDA-graph coverage."""

    async_scheduling: bool = True
    cudagraph: str = "full"
    """``none`` (eager), ``piecewise`` or ``full`` (vLLM's FULL_AND_PIECEWISE, FULL, FULL_DECODE_ONLY)."""
    max_graph_tokens: int | None = None
    """The largest captured batch (tokens); ``None``: every batch is covered."""


class CostModel:
    """Step duration of one batch on one GPU model (see the module docstring for the formula), on the
    GPU's ``physics`` (default: this module's constants) with the calibration's ``scales`` on top."""

    def __init__(
        self,
        arch: ModelArch,
        gpu: GpuProfile,
        *,
        kv_cache_dtype: str = "auto",
        dtype: str = "auto",
        tensor_parallel_size: int = 1,
        block_size: int = 16,
        execution: Execution | None = None,
        scales: Scales | None = None,
        physics: Physics | None = None,
    ) -> None:
        tp = tensor_parallel_size
        k = scales or Scales()
        physics = physics or Physics()
        wbytes = dtype_bytes(arch.torch_dtype if dtype == "auto" else dtype)
        self._compute_rate = gpu.tflops * 1e12 * physics.compute_efficiency * k.compute * tp
        self._flops_per_token = 2.0 * active_params_per_token(arch)
        self._attn_flops = 4.0 * arch.num_layers * arch.num_heads * arch.head_dim
        self._head_flops = 2.0 * arch.hidden_size * arch.vocab_size
        bw = gpu.bandwidth_gbs * 1e9
        weight_bw = bw * physics.weight_bandwidth_efficiency * k.weights
        embed = arch.vocab_size * arch.hidden_size
        expert_params = (
            arch.num_layers * 3 * arch.hidden_size * arch.intermediate_size * arch.num_experts
            if arch.num_experts > 1
            else 0
        )
        dense_read = param_count(arch) - embed * (0 if arch.tie_word_embeddings else 1)
        dense_read -= expert_params
        self._dense_weight_time = dense_read * wbytes / tp / weight_bw
        self._expert_weight_time = expert_params * wbytes / tp / weight_bw
        self._expert_miss = 1.0 - arch.experts_per_token / arch.num_experts
        per_token = kv_bytes_per_token(arch, kv_cache_dtype, dtype, tp)
        dequant = FP8_DEQUANT_FACTOR if is_fp8(kv_cache_dtype) else 1.0
        attention = attention_efficiency(block_size, physics.attention)
        self._kv_time_per_token = per_token * dequant / (bw * attention * k.attention)
        if tp > 1:
            link = gpu.interconnect_gbs * 1e9
            self._comm_fixed = 2 * arch.num_layers * ALLREDUCE_LATENCY_S
            self._comm_per_token = 2 * arch.num_layers * arch.hidden_size * 2 * 2 * (tp - 1) / tp / link
        else:
            self._comm_fixed = 0.0
            self._comm_per_token = 0.0
        ex = execution or Execution()
        self._step_overhead = physics.step_overhead_s * k.step_overhead
        self._per_seq_overhead = physics.per_seq_overhead_s * k.per_seq_overhead
        self._sync = not ex.async_scheduling
        self._eager_s = EAGER_LAUNCH_S_PER_LAYER * arch.num_layers
        self._piecewise_s = PIECEWISE_LAUNCH_S_PER_LAYER * arch.num_layers
        self._graph = ex.cudagraph
        self._max_graph = ex.max_graph_tokens

    def forward_time(self, tokens: float, context_tokens: float, attn_pairs: float, sampled: float) -> float:
        """The roofline of one forward pass (no host overhead); see :meth:`step_time` for the arguments."""
        if tokens == 0:
            return 0.0
        flops = self._flops_per_token * tokens + self._attn_flops * attn_pairs + self._head_flops * sampled
        compute = flops / self._compute_rate
        weights = self._dense_weight_time
        if self._expert_weight_time:
            weights += self._expert_weight_time * (1.0 - self._expert_miss**tokens)
        memory = weights + self._kv_time_per_token * context_tokens
        comm = self._comm_fixed + self._comm_per_token * tokens if self._comm_fixed else 0.0
        return (compute if compute > memory else memory) + comm

    def launch_time(self, tokens: float, *, prefill: bool) -> float:
        """Kernel-launch time the CUDA graphs do not hide for a batch of ``tokens``."""
        graph = self._graph
        if graph == "none":
            return self._eager_s
        if prefill:
            return 0.0
        if self._max_graph is not None and tokens > self._max_graph:
            return self._eager_s
        return self._piecewise_s if graph == "piecewise" else 0.0

    def step_time(
        self,
        tokens: float,
        seqs: float,
        context_tokens: float,
        attn_pairs: float,
        sampled: float,
        *,
        prefill: bool = True,
    ) -> float:
        """Seconds for one step computing ``tokens`` new tokens of ``seqs`` sequences.

        ``context_tokens``: KV tokens read (each sequence's context after the step); ``attn_pairs``:
        sum over sequences of new tokens x average context; ``sampled``: sequences sampling a token;
        ``prefill``: whether the batch carries prefill tokens (else it is a pure decode batch).
        """
        if tokens == 0:
            return 0.0
        overhead = self._step_overhead + self._per_seq_overhead * seqs
        if self._sync:
            overhead += SYNC_SCHEDULING_S + SYNC_PER_SEQ_S * seqs
        if self._graph != "full" or not (prefill or self._max_graph is None or tokens <= self._max_graph):
            overhead += self.launch_time(tokens, prefill=prefill)
        return self.forward_time(tokens, context_tokens, attn_pairs, sampled) + overhead
