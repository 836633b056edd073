"""The simulated engine: a vLLM-v1-style continuous-batching scheduler over paged, prefix-cached KV blocks.

One implementation serves both the HTTP server (which sleeps until each step's end) and the in-process
:func:`autotune.sim.model.simulate` (which only advances a virtual clock). Step times come from
:mod:`autotune.sim.cost`; blocks and the prefix cache from :mod:`autotune.sim.prefix_cache`.

Scheduler (per step, like vLLM v1's ``Scheduler.schedule``):
* a token budget of ``max_num_batched_tokens``; running requests first, in admission order: a decoding
  request takes one token (plus its draft tokens with speculative decoding), a partly prefilled one the
  rest of its prompt (capped by the budget, and by ``long_prefill_token_threshold`` when it is > 0,
  chunked prefill is on and more than one request is running or waiting; ``--long-prefill-token-
  threshold-adaptive`` floors that cap at ``max_num_batched_tokens`` / those requests);
* KV memory is paged in blocks of ``block_size`` tokens (the last block of a sequence is partly
  empty); when a running request needs a block and none is free, the NEWEST running request is
  preempted (recompute: its blocks are freed and it re-enters the front of the waiting queue and later
  recomputes prompt + generated tokens, minus what the prefix cache still holds);
* if nothing was preempted this step, waiting requests are admitted in FCFS order while fewer than
  ``max_num_seqs`` run, budget is left and their blocks fit. With prefix caching a request admitted
  with nothing computed first takes the longest run of cached full blocks of its tokens (at most
  ``tokens - 1``: the last token is always computed) and computes only the rest. With chunked prefill
  a prompt may be split across steps; without it a prompt that does not fit the remaining budget waits;
* a request whose KV has caught up with its tokens samples at the end of the step (its first token when
  the prefill completes). With speculative decoding a decoding request verifies ``k`` draft tokens:
  the leading drafts are accepted with probability ``acceptance_rate`` each (a draft is accepted only if
  every draft before it was), so a step emits 1 + accepted tokens (expected ``(1 - P^(k+1)) / (1 - P)``);
  the KV of rejected drafts is rolled back. Drafts never go past the request's output length;
* full blocks of a request's known tokens (prompt and outputs) are entered in the prefix cache once
  their KV is computed.
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from autotune.sim.cost import CostModel, attention_efficiency
from autotune.sim.prefix_cache import BlockHashes, BlockPool
from autotune.sim.tokens import OutputIds

__all__ = [
    "CostModel",
    "Engine",
    "EngineConfig",
    "Request",
    "StepResult",
    "attention_efficiency",
    "blocks_for",
]


class Request:
    """One request inside the engine. Lengths in tokens; times are set by the driver, not the engine.

    ``token_ids`` (the prompt's ids) make the request's blocks hashable for the prefix cache; without
    them the request neither hits nor fills the cache.
    """

    __slots__ = (
        "arrival",
        "block_ids",
        "first_token_time",
        "hashes",
        "last_token_time",
        "num_cached_blocks",
        "num_computed",
        "num_output",
        "num_preemptions",
        "output_len",
        "prompt_len",
        "rid",
        "step_tokens",
        "tag",
        "token_ids",
    )

    def __init__(
        self,
        rid: int,
        prompt_len: int,
        output_len: int,
        arrival: float = 0.0,
        token_ids: Sequence[int] | None = None,
    ) -> None:
        self.rid = rid
        self.prompt_len = prompt_len
        self.output_len = max(1, output_len)
        self.arrival = arrival
        self.num_computed = 0
        self.num_output = 0
        self.block_ids: list[int] = []
        self.num_cached_blocks = 0
        self.num_preemptions = 0
        self.step_tokens = 0
        """Tokens emitted in the last step that emitted any (more than one with speculative decoding)."""
        self.first_token_time = -1.0
        self.last_token_time = -1.0
        self.tag: object = None
        self.token_ids = token_ids
        self.hashes: BlockHashes | None = None

    @property
    def blocks(self) -> int:
        """KV blocks the request holds."""
        return len(self.block_ids)

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
    enable_prefix_caching: bool = False
    long_prefill_token_threshold: int = 0
    long_prefill_token_threshold_adaptive: bool = False
    num_speculative_tokens: int = 0
    acceptance_rate: float = 0.0
    """Probability that a draft token is accepted given that the drafts before it were."""


@dataclass(frozen=True, slots=True)
class StepResult:
    """One executed step: its duration and the requests that got tokens / finished in it."""

    duration: float
    emitted: list[Request]
    """Requests that got tokens (``request.step_tokens`` of them) at the end of the step."""
    finished: list[Request]
    scheduled_tokens: int
    preempted: int
    started: list[Request]
    """Requests scheduled for the first time in this step (their queueing ended)."""


@dataclass
class SpecDecodeStats:
    """Speculative-decoding counters (vLLM's ``vllm:spec_decode_*`` metrics)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] | None = None


class Engine:
    """Continuous-batching scheduler with paged KV blocks, a prefix cache and recompute preemption.

    ``draft_cost`` is the forward time of one drafting pass (a draft model or an EAGLE/MTP head; None
    for n-gram drafting, which costs nothing on the GPU); ``output_ids`` gives output tokens' ids so
    that blocks holding generated text can be cached too.
    """

    def __init__(
        self,
        config: EngineConfig,
        cost: CostModel,
        *,
        draft_cost: CostModel | None = None,
        output_ids: OutputIds | None = None,
        seed: int = 0,
    ) -> None:
        self.config = config
        self.cost = cost
        self.draft_cost = draft_cost
        self.pool = BlockPool(config.num_blocks, caching=config.enable_prefix_caching)
        self.running: list[Request] = []
        self.waiting: deque[Request] = deque()
        self.num_preemptions = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.prefix_queries = 0
        """Tokens of requests that looked up the prefix cache (vllm:prefix_cache_queries)."""
        self.prefix_hits = 0
        """Tokens those requests found cached (vllm:prefix_cache_hits)."""
        k = config.num_speculative_tokens
        self.spec = SpecDecodeStats(accepted_per_pos=[0] * k)
        self._output_ids = output_ids
        self._rng = random.Random(seed)
        p = config.acceptance_rate
        self._log_p = math.log(p) if 0.0 < p < 1.0 else None

    @property
    def free_blocks(self) -> int:
        """KV blocks that can be allocated (free, cached or not)."""
        return self.pool.free

    @property
    def kv_usage(self) -> float:
        """Fraction of KV blocks in use (vllm:kv_cache_usage_perc)."""
        total = self.config.num_blocks
        return (total - self.pool.free) / total if total else 0.0

    def has_work(self) -> bool:
        """Whether a step would schedule anything."""
        return bool(self.running or self.waiting)

    def load(self) -> tuple[int, int]:
        """(waiting, running) requests, for data-parallel routing."""
        return len(self.waiting), len(self.running)

    def add(self, request: Request) -> None:
        """Queue a request (FCFS); a request with token ids gets its block hashes here."""
        if self.config.enable_prefix_caching and request.token_ids is not None and request.hashes is None:
            request.hashes = BlockHashes(request.token_ids, self.config.block_size, self._token_at(request))
        self.waiting.append(request)

    def _token_at(self, request: Request) -> Callable[[int], int] | None:
        prompt = request.token_ids
        assert prompt is not None
        outputs = self._output_ids
        if outputs is None:
            return None
        plen = request.prompt_len

        def token_at(position: int) -> int:
            return prompt[position] if position < plen else outputs[position - plen]

        return token_at

    def abort(self, request: Request) -> None:
        """Drop a request wherever it is and free its blocks."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.pool.release(request.block_ids)
        request.block_ids = []

    def _preempt(self, victim: Request) -> None:
        self.pool.release(victim.block_ids)
        victim.block_ids = []
        victim.num_computed = 0
        victim.num_cached_blocks = 0
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim)

    def _threshold(self) -> int:
        cfg = self.config
        eligible = len(self.running) + len(self.waiting)
        cap = cfg.long_prefill_token_threshold
        if not cap or not cfg.enable_chunked_prefill or eligible <= 1:
            return 0
        if cfg.long_prefill_token_threshold_adaptive:
            cap = max(cap, cfg.max_num_batched_tokens // eligible)
        return cap

    def _verify(self, drafts: int) -> int:
        """How many of ``drafts`` draft tokens the verification accepts (leading ones only); counted."""
        log_p = self._log_p
        if log_p is None:
            accepted = drafts if self.config.acceptance_rate >= 1.0 else 0
        else:
            u = 1.0 - self._rng.random()  # in (0, 1]
            accepted = min(drafts, int(math.log(u) / log_p))
        spec = self.spec
        spec.num_drafts += 1
        spec.num_draft_tokens += drafts
        spec.num_accepted_tokens += accepted
        per_pos = spec.accepted_per_pos
        assert per_pos is not None
        for pos in range(accepted):
            per_pos[pos] += 1
        return accepted

    def _schedule_running(self, budget: int, cap: int) -> tuple[list[tuple[Request, int, int]], int, int]:
        cfg = self.config
        bs = cfg.block_size
        chunked = cfg.enable_chunked_prefill
        k = cfg.num_speculative_tokens
        pool = self.pool
        running = self.running
        scheduled: list[tuple[Request, int, int]] = []
        preempted = 0
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            n = req.prompt_len + req.num_output - req.num_computed
            drafts = 0
            if k and n == 1 and req.num_output:
                drafts = min(k, req.output_len - req.num_output - 1)
                n += drafts
            if 0 < cap < n:
                n = cap
            if n > budget:
                if not chunked:
                    i += 1
                    continue
                n = budget
                drafts = min(drafts, n - 1)
            need = (req.num_computed + n + bs - 1) // bs - len(req.block_ids)
            if need > 0:
                self_preempted = False
                while need > pool.free:
                    victim = running.pop()
                    self._preempt(victim)
                    preempted += 1
                    if victim is req:
                        self_preempted = True
                        break
                if self_preempted:
                    break
                req.block_ids += pool.allocate(need)
            budget -= n
            scheduled.append((req, n, drafts))
            i += 1
        return scheduled, budget, preempted

    def _admit_waiting(
        self, budget: int, cap: int, scheduled: list[tuple[Request, int, int]]
    ) -> list[Request]:
        cfg = self.config
        bs = cfg.block_size
        chunked = cfg.enable_chunked_prefill
        pool = self.pool
        waiting = self.waiting
        running = self.running
        started: list[Request] = []
        while waiting and len(running) < cfg.max_num_seqs and budget > 0:
            req = waiting[0]
            total = req.prompt_len + req.num_output
            hits: list[int] = []
            if req.hashes is not None:
                hits = pool.lookup(req.hashes.upto(total), (total - 1) // bs)
            computed = len(hits) * bs
            n = total - computed
            if 0 < cap < n:
                n = cap
            if n > budget:
                if not chunked:
                    break
                n = budget
            need = -(-(computed + n) // bs) - len(hits)
            if need + (pool.evictable(hits) if hits else 0) > pool.free:
                break
            waiting.popleft()
            if hits:
                pool.touch(hits)
            req.block_ids = hits + pool.allocate(need)
            req.num_computed = computed
            req.num_cached_blocks = len(hits)
            if req.num_preemptions == 0:
                started.append(req)
                if pool.caching:
                    self.prefix_queries += total
                    self.prefix_hits += computed
            running.append(req)
            budget -= n
            scheduled.append((req, n, 0))
        return started

    def _cache_full_blocks(self, req: Request) -> None:
        hashes = req.hashes
        if hashes is None:
            return
        full = req.num_computed // self.config.block_size
        if full <= req.num_cached_blocks:
            return
        known = hashes.upto(full * self.config.block_size)
        pool = self.pool
        for b in range(req.num_cached_blocks, min(full, len(known))):
            pool.cache(req.block_ids[b], known[b])
        req.num_cached_blocks = min(full, len(known))

    def step(self) -> StepResult:
        """Schedule one batch, advance every scheduled request, and return what happened."""
        cfg = self.config
        cap = self._threshold() if cfg.long_prefill_token_threshold else 0
        scheduled, budget, preempted = self._schedule_running(cfg.max_num_batched_tokens, cap)
        if preempted or not self.waiting or budget <= 0 or len(self.running) >= cfg.max_num_seqs:
            started: list[Request] = []
        else:
            started = self._admit_waiting(budget, cap, scheduled)
        speculative = cfg.num_speculative_tokens > 0
        caching = self.pool.caching
        tokens = 0
        context = 0
        pairs = 0.0
        accepted_total = 0
        drafts_total = 0
        prefill = False
        draft_seqs = 0
        draft_context = 0
        emitted: list[Request] = []
        finished: list[Request] = []
        for req, n, drafts in scheduled:
            before = req.num_computed
            after = before + n
            tokens += n
            context += after
            pairs += n * (before + 0.5 * n)
            if n > 1 + drafts:
                prefill = True
            if drafts:  # a decode step verifying drafts
                accepted = self._verify(drafts)
                accepted_total += accepted
                drafts_total += drafts
                after = before + 1 + accepted
                req.num_output += 1 + accepted
                req.step_tokens = 1 + accepted
                emitted.append(req)
                if req.num_output >= req.output_len:
                    finished.append(req)
                else:
                    draft_seqs += 1
                    draft_context += after + 1
            elif after == req.prompt_len + req.num_output:
                if req.num_output == 0:
                    self.prompt_tokens += req.prompt_len
                    prefill = True
                req.num_output += 1
                req.step_tokens = 1
                emitted.append(req)
                if req.num_output >= req.output_len:
                    finished.append(req)
                elif speculative:
                    draft_seqs += 1
                    draft_context += after + 1
            req.num_computed = after
            if caching and req.hashes is not None:
                self._cache_full_blocks(req)
        generated = len(emitted) + accepted_total
        sampled = len(emitted) + drafts_total
        self.generation_tokens += generated
        if finished:
            for req in finished:
                self.pool.release(req.block_ids)
                req.block_ids = []
            done = {id(r) for r in finished}
            self.running = [r for r in self.running if id(r) not in done]
        duration = self.cost.step_time(tokens, len(scheduled), context, pairs, sampled, prefill=prefill)
        if draft_seqs and self.draft_cost is not None:
            one_pass = self.draft_cost.forward_time(
                draft_seqs, draft_context, float(draft_context), draft_seqs
            )
            duration += cfg.num_speculative_tokens * one_pass
        return StepResult(duration, emitted, finished, tokens, preempted, started)


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks a sequence of ``tokens`` occupies (the last one partly empty)."""
    return math.ceil(tokens / block_size)
