"""The simulated engine: a vLLM-v1-style continuous-batching scheduler and a roofline step-time model.

One implementation serves both the HTTP server (which sleeps until each step's end) and the in-process
:func:`autotune.sim.model.simulate` (which only advances a virtual clock).

Scheduler (per step, like vLLM v1's ``Scheduler.schedule``):
* a token budget of ``max_num_batched_tokens``; running requests first, in admission order: a decoding
  request takes one token, a partly prefilled one the rest of its prompt (capped by the budget);
* KV memory is paged in blocks of ``block_size`` tokens (the last block of a sequence is partly
  empty); when a running request needs a block and none is free, the NEWEST running request is
  preempted (recompute: its blocks are freed and it re-enters the front of the waiting queue and later
  recomputes prompt + generated tokens);
* if nothing was preempted this step, waiting requests are admitted in FCFS order while fewer than
  ``max_num_seqs`` run, budget is left and their blocks fit. With chunked prefill a prompt may be split
  across steps; without it a prompt that does not fit the remaining budget waits for a later step;
* a request whose KV has caught up with its tokens samples one token at the end of the step (its first
  token when the prefill completes); it finishes when it has its output length.

Step time (roofline): ``max(FLOPs / (peak x 0.65), bytes / (bandwidth x eff)) + overhead`` where
* FLOPs = 2 x active params x tokens + attention (4 x layers x q_dim x token-context pairs) +
  LM head for sampled tokens, split over TP ranks;
* bytes = weights read once per step (MoE: the expected fraction of experts touched) at 85 % of peak
  bandwidth, plus every scheduled sequence's KV context at a paged-attention efficiency that grows with
  block size (16 is ~10 % slower than 64); fp8 KV halves those bytes and pays a 15 % dequant cost;
* overhead = 1.5 ms per step + 15 us per sequence (scheduling, sampling, detokenising) + for TP > 1
  two all-reduces per layer (latency + activation bytes over the interconnect).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from autotune.catalog import GpuProfile, ModelArch
from autotune.memory import (
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


def attention_efficiency(block_size: int) -> float:
    """Fraction of peak bandwidth paged attention reaches: 16 -> 0.70, 32 -> 0.77, 64 -> 0.81."""
    return 0.85 * (1.0 - 0.18 * min(1.0, 16.0 / block_size))


class CostModel:
    """Step duration of one batch on one GPU model (see the module docstring for the formula)."""

    def __init__(
        self,
        arch: ModelArch,
        gpu: GpuProfile,
        *,
        kv_cache_dtype: str = "auto",
        dtype: str = "auto",
        tensor_parallel_size: int = 1,
        block_size: int = 16,
    ) -> None:
        tp = tensor_parallel_size
        wbytes = dtype_bytes(arch.torch_dtype if dtype == "auto" else dtype)
        self._compute_rate = gpu.tflops * 1e12 * COMPUTE_EFFICIENCY * tp
        self._flops_per_token = 2.0 * active_params_per_token(arch)
        self._attn_flops = 4.0 * arch.num_layers * arch.num_heads * arch.head_dim
        self._head_flops = 2.0 * arch.hidden_size * arch.vocab_size
        bw = gpu.bandwidth_gbs * 1e9
        embed = arch.vocab_size * arch.hidden_size
        expert_params = (
            arch.num_layers * 3 * arch.hidden_size * arch.intermediate_size * arch.num_experts
            if arch.num_experts > 1
            else 0
        )
        dense_read = param_count(arch) - embed * (0 if arch.tie_word_embeddings else 1)
        dense_read -= expert_params
        self._dense_weight_time = dense_read * wbytes / tp / (bw * WEIGHT_BANDWIDTH_EFFICIENCY)
        self._expert_weight_time = expert_params * wbytes / tp / (bw * WEIGHT_BANDWIDTH_EFFICIENCY)
        self._expert_miss = 1.0 - arch.experts_per_token / arch.num_experts
        per_token = kv_bytes_per_token(arch, kv_cache_dtype, dtype, tp)
        dequant = FP8_DEQUANT_FACTOR if is_fp8(kv_cache_dtype) else 1.0
        self._kv_time_per_token = per_token * dequant / (bw * attention_efficiency(block_size))
        if tp > 1:
            link = gpu.interconnect_gbs * 1e9
            self._comm_fixed = 2 * arch.num_layers * ALLREDUCE_LATENCY_S
            self._comm_per_token = 2 * arch.num_layers * arch.hidden_size * 2 * 2 * (tp - 1) / tp / link
        else:
            self._comm_fixed = 0.0
            self._comm_per_token = 0.0

    def step_time(
        self, tokens: int, seqs: int, context_tokens: int, attn_pairs: float, sampled: int
    ) -> float:
        """Seconds for one step computing ``tokens`` new tokens of ``seqs`` sequences.

        ``context_tokens``: KV tokens read (each sequence's context after the step); ``attn_pairs``:
        sum over sequences of new tokens x average context; ``sampled``: sequences sampling a token.
        """
        if tokens == 0:
            return 0.0
        flops = self._flops_per_token * tokens + self._attn_flops * attn_pairs + self._head_flops * sampled
        compute = flops / self._compute_rate
        weights = self._dense_weight_time
        if self._expert_weight_time:
            weights += self._expert_weight_time * (1.0 - self._expert_miss**tokens)
        memory = weights + self._kv_time_per_token * context_tokens
        overhead = STEP_OVERHEAD_S + PER_SEQ_OVERHEAD_S * seqs
        if self._comm_fixed:
            overhead += self._comm_fixed + self._comm_per_token * tokens
        return (compute if compute > memory else memory) + overhead


class Request:
    """One request inside the engine. Lengths in tokens; times are set by the driver, not the engine."""

    __slots__ = (
        "arrival",
        "blocks",
        "first_token_time",
        "last_token_time",
        "num_computed",
        "num_output",
        "num_preemptions",
        "output_len",
        "prompt_len",
        "rid",
        "tag",
    )

    def __init__(self, rid: int, prompt_len: int, output_len: int, arrival: float = 0.0) -> None:
        self.rid = rid
        self.prompt_len = prompt_len
        self.output_len = max(1, output_len)
        self.arrival = arrival
        self.num_computed = 0
        self.num_output = 0
        self.blocks = 0
        self.num_preemptions = 0
        self.first_token_time = -1.0
        self.last_token_time = -1.0
        self.tag: object = None

    @property
    def finished(self) -> bool:
        """Whether the request has all its output tokens."""
        return self.num_output >= self.output_len


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """The scheduler's limits (from the serve flags and the KV capacity)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    num_blocks: int
    enable_chunked_prefill: bool = True


@dataclass(frozen=True, slots=True)
class StepResult:
    """One executed step: its duration and the requests that got a token / finished in it."""

    duration: float
    emitted: list[Request]
    finished: list[Request]
    scheduled_tokens: int
    preempted: int
    started: list[Request]
    """Requests scheduled for the first time in this step (their queueing ended)."""


class Engine:
    """Continuous-batching scheduler with paged KV blocks and recompute preemption."""

    def __init__(self, config: EngineConfig, cost: CostModel) -> None:
        self.config = config
        self.cost = cost
        self.running: list[Request] = []
        self.waiting: deque[Request] = deque()
        self.free_blocks = config.num_blocks
        self.num_preemptions = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0

    @property
    def kv_usage(self) -> float:
        """Fraction of KV blocks in use (vllm:kv_cache_usage_perc)."""
        total = self.config.num_blocks
        return (total - self.free_blocks) / total if total else 0.0

    def has_work(self) -> bool:
        """Whether a step would schedule anything."""
        return bool(self.running or self.waiting)

    def add(self, request: Request) -> None:
        """Queue a request (FCFS)."""
        self.waiting.append(request)

    def abort(self, request: Request) -> None:
        """Drop a request wherever it is and free its blocks."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.free_blocks += request.blocks
        request.blocks = 0

    def _preempt(self, victim: Request) -> None:
        self.free_blocks += victim.blocks
        victim.blocks = 0
        victim.num_computed = 0
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim)

    def step(self) -> StepResult:
        """Schedule one batch, advance every scheduled request, and return what happened."""
        cfg = self.config
        bs = cfg.block_size
        budget = cfg.max_num_batched_tokens
        chunked = cfg.enable_chunked_prefill
        running = self.running
        scheduled: list[tuple[Request, int]] = []
        preempted = 0
        started: list[Request] = []
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            n = req.prompt_len + req.num_output - req.num_computed
            if n > budget:
                if not chunked:
                    i += 1
                    continue
                n = budget
            need = -(-(req.num_computed + n) // bs) - req.blocks
            while need > self.free_blocks:
                victim = running.pop()
                self._preempt(victim)
                preempted += 1
                if victim is req:
                    break
            else:
                req.blocks += need
                self.free_blocks -= need
                budget -= n
                scheduled.append((req, n))
                i += 1
                continue
            break
        if not preempted:
            waiting = self.waiting
            max_seqs = cfg.max_num_seqs
            while waiting and len(running) < max_seqs and budget > 0:
                req = waiting[0]
                n = req.prompt_len + req.num_output
                if n > budget:
                    if not chunked:
                        break
                    n = budget
                need = -(-n // bs)
                if need > self.free_blocks:
                    break
                waiting.popleft()
                if req.num_preemptions == 0:
                    started.append(req)
                running.append(req)
                req.blocks = need
                self.free_blocks -= need
                budget -= n
                scheduled.append((req, n))
        tokens = 0
        context = 0
        pairs = 0.0
        emitted: list[Request] = []
        finished: list[Request] = []
        for req, n in scheduled:
            before = req.num_computed
            after = before + n
            req.num_computed = after
            tokens += n
            context += after
            pairs += n * (before + 0.5 * n)
            if after == req.prompt_len + req.num_output:
                if req.num_output == 0:
                    self.prompt_tokens += req.prompt_len
                req.num_output += 1
                emitted.append(req)
                if req.num_output >= req.output_len:
                    finished.append(req)
        self.generation_tokens += len(emitted)
        if finished:
            for req in finished:
                self.free_blocks += req.blocks
                req.blocks = 0
            done = {id(r) for r in finished}
            self.running = [r for r in running if id(r) not in done]
        duration = self.cost.step_time(tokens, len(scheduled), context, pairs, len(emitted))
        return StepResult(duration, emitted, finished, tokens, preempted, started)


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks a sequence of ``tokens`` occupies (the last one partly empty)."""
    return math.ceil(tokens / block_size)
