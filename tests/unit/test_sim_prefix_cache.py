"""Prefix caching in the simulated engine: block hashes, the LRU block pool, hits per block and TTFT."""

from __future__ import annotations

import math

from autotune.hardware.catalog import GPUS, MODELS
from autotune.sim.engine import CostModel, Engine, EngineConfig, Request
from autotune.sim.model import WorkloadRequest, simulate, synthetic_workload
from autotune.sim.prefix_cache import BlockPool, chain_hashes

HW, MODEL = "H100-80GB", "Llama-3.1-8B"


def _engine(num_blocks: int = 100, *, block_size: int = 16, caching: bool = True) -> Engine:
    cost = CostModel(MODELS[MODEL], GPUS[HW])
    config = EngineConfig(8, 512, block_size, num_blocks, enable_prefix_caching=caching)
    return Engine(config, cost)


def _run(engine: Engine, req: Request) -> list[int]:
    """Run ``req`` alone to completion; the tokens scheduled per step."""
    engine.add(req)
    tokens = []
    while engine.has_work():
        tokens.append(engine.step().scheduled_tokens)
    return tokens


def test_block_hashes_chain_so_a_block_names_its_whole_prefix() -> None:
    """Only full blocks are hashed, and equal blocks after different prefixes hash differently."""
    a = chain_hashes([1, 2, 3, 4, 5, 6, 7], 2)
    b = chain_hashes([9, 9, 3, 4, 5, 6], 2)
    assert len(a) == 3 and len(b) == 3
    assert a[1] != b[1] and a[2] != b[2]  # blocks [3, 4] and [5, 6] follow different prefixes
    assert chain_hashes([1, 2, 3, 4], 2) == a[:2]


def test_free_blocks_keep_their_prefix_until_reallocated_least_recently_freed_first() -> None:
    """A freed block stays a cache hit until allocation reaches it; allocation takes the least recently
    freed block first, and a request's tail block is freed (so evicted) before its head."""
    pool = BlockPool(4, caching=True)
    blocks = pool.allocate(2)
    pool.cache(blocks[0], 111)
    pool.cache(blocks[1], 222)
    pool.release(blocks)  # tail first: blocks[1] joins the free queue before blocks[0]
    assert pool.free == 4 and pool.lookup([111, 222], 2) == blocks
    pool.allocate(2)  # the two never-used blocks
    assert pool.lookup([111, 222], 2) == blocks
    pool.allocate(1)  # evicts blocks[1] (the tail), keeps the head
    assert pool.lookup([111, 222], 2) == [blocks[0]]
    hit = pool.lookup([111], 1)
    assert pool.evictable(hit) == 1
    pool.touch(hit)
    assert pool.free == 0 and pool.evictable(hit) == 0


def test_a_repeated_prompt_is_served_from_cache_except_its_last_block() -> None:
    """The second run of a 100-token prompt finds 6 full blocks cached (96 tokens) and prefills only the
    last 4 tokens; queries and hits count tokens, as vllm:prefix_cache_queries/hits do."""
    engine = _engine()
    ids = list(range(1000, 1100))
    assert _run(engine, Request(0, 100, 2, token_ids=ids)) == [100, 1]
    assert _run(engine, Request(1, 100, 2, token_ids=ids)) == [4, 1]
    assert (engine.prefix_queries, engine.prefix_hits) == (200, 96)


def test_a_fully_cached_prompt_still_computes_its_last_token() -> None:
    """A prompt of exactly 4 blocks hits at most 3 of them (tokens - 1): the last block is recomputed
    to get the logits, as in vLLM."""
    engine = _engine()
    ids = list(range(64))
    _run(engine, Request(0, 64, 1, token_ids=ids))
    assert _run(engine, Request(1, 64, 1, token_ids=ids)) == [16]
    assert engine.prefix_hits == 48


def test_hits_come_in_whole_blocks_so_block_size_sets_the_granularity() -> None:
    """Two requests that share a 60-token prefix: 3 blocks of 16 (48 tokens) hit, 1 block of 32 (32
    tokens), none of 64 (the shared part does not fill a block)."""
    hits = {}
    for block_size in (16, 32, 64):
        workload = [
            WorkloadRequest(100, 2, 0.0, prefix_group=7, prefix_len=100),
            WorkloadRequest(100, 2, 5.0, prefix_group=7, prefix_len=60),
        ]
        result = simulate({"max_model_len": 4096, "block_size": block_size}, HW, MODEL, workload)
        assert result.prefix_cache_queries == 200
        hits[block_size] = result.prefix_cache_hits
    assert hits == {16: 48, 32: 32, 64: 0}


def test_shared_prefix_lowers_ttft_only_with_prefix_caching() -> None:
    """Requests with a shared 1,024-token system prompt get a much lower TTFT with prefix caching on
    (vLLM's default) than with --no-enable-prefix-caching, which neither queries nor hits."""
    workload = synthetic_workload(120, input_len=(64, 128), output_len=(16, 32), rate=4.0, seed=3,
                                  prefix_len=1024)  # fmt: skip
    on = simulate({"max_model_len": 4096}, HW, MODEL, workload)
    off = simulate({"max_model_len": 4096, "enable_prefix_caching": False}, HW, MODEL, workload)
    assert on.stat("ttft", 50) < 0.5 * off.stat("ttft", 50)
    assert on.prefix_cache_hits > 0.8 * 120 * 1024 and on.prefix_cache_queries >= on.prefix_cache_hits
    assert off.prefix_cache_queries == off.prefix_cache_hits == 0


def test_requests_without_token_ids_query_but_never_hit() -> None:
    """A workload of plain lengths takes part in lookups (queries count) but has nothing to share."""
    workload = synthetic_workload(20, seed=1)
    result = simulate({"max_model_len": 2048}, "RTX-4090-24GB", MODEL, workload, rate=math.inf)
    assert result.prefix_cache_queries == sum(w.prompt_len for w in workload)
    assert result.prefix_cache_hits == 0


def test_a_preempted_request_recomputes_only_what_was_evicted() -> None:
    """A request preempted to make room finds its head blocks still cached when it is re-admitted (they
    were freed tail first and not yet reallocated), so it recomputes less than its whole context; hits
    of a re-admission do not count in vllm:prefix_cache_hits (only first admissions do, as in vLLM)."""
    engine = _engine(num_blocks=12, caching=True)
    old = Request(0, 80, 60, token_ids=list(range(80)))
    new = Request(1, 80, 60, token_ids=list(range(500, 580)))
    engine.add(old)
    engine.add(new)
    readmitted_hits = []
    while engine.has_work():
        was_preempted = new in engine.waiting and new.num_preemptions > 0
        engine.step()
        if was_preempted and new in engine.running:
            readmitted_hits.append(new.num_cached_blocks)
    assert new.num_preemptions >= 1 and old.finished and new.finished
    assert readmitted_hits and readmitted_hits[0] >= 2
    assert engine.prefix_hits == 0
    assert engine.free_blocks == 12


def test_simulate_accepts_explicit_prompt_token_ids() -> None:
    """WorkloadRequest.prompt_token_ids make two requests with the same ids share their blocks."""
    ids = tuple(range(200))
    workload = [WorkloadRequest(200, 4, 0.0, prompt_token_ids=ids), WorkloadRequest(200, 4, 2.0, ids)]
    result = simulate({"max_model_len": 2048}, HW, MODEL, workload)
    assert result.prefix_cache_hits == 192 and len(result.requests) == 2
