"""Paged KV blocks with vLLM v1's automatic prefix cache (the block pool of ``vllm/v1/core``).

* A sequence's tokens are hashed block by block, each block's hash chaining its parent's (``hash((parent,
  tokens of the block))``), so a block hash names the whole prefix up to and including that block. Only
  full blocks are hashed and cached.
* A block whose last user frees it keeps its contents and its hash: it joins the free queue (least
  recently freed first; a request's blocks are freed tail first, so its last blocks are evicted first)
  and stays a cache hit until it is reallocated. Allocation takes the head of the free queue and evicts
  whatever it held.
* A lookup returns the longest run of cached blocks that starts the sequence; blocks in use by another
  request are shared (reference counted), free ones are taken off the free queue.

With caching disabled the pool is the same queue of anonymous blocks: nothing is hashed or looked up.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

ROOT_HASH = 0x5BD1E995
"""The parent hash of a sequence's first block."""


def chain_hashes(tokens: Sequence[int], block_size: int, parent: int = ROOT_HASH) -> list[int]:
    """Hashes of the full blocks of ``tokens``, each chained to the one before (vLLM's block hashes)."""
    out: list[int] = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash((parent, tuple(tokens[start : start + block_size])))
        out.append(parent)
    return out


class BlockHashes:
    """The block hashes of one request, extended lazily as its tokens become known.

    ``token_at(position)`` gives the token id at a position of the sequence (prompt, then outputs).
    """

    __slots__ = ("_block_size", "_token_at", "hashes")

    def __init__(
        self, prompt: Sequence[int], block_size: int, token_at: Callable[[int], int] | None = None
    ) -> None:
        self._block_size = block_size
        self._token_at = token_at
        self.hashes = chain_hashes(prompt, block_size)

    def upto(self, num_tokens: int) -> list[int]:
        """The hashes of every full block among the first ``num_tokens`` tokens."""
        hashes, bs = self.hashes, self._block_size
        token_at = self._token_at
        while token_at is not None and (len(hashes) + 1) * bs <= num_tokens:
            start = len(hashes) * bs
            parent = hashes[-1] if hashes else ROOT_HASH
            hashes.append(hash((parent, tuple(token_at(p) for p in range(start, start + bs)))))
        return hashes


class BlockPool:
    """KV blocks ``0 .. num_blocks - 1``: reference counts, the free queue and the hash -> block map."""

    __slots__ = ("_cached", "_free", "_hash", "_ref", "caching", "num_blocks")

    def __init__(self, num_blocks: int, *, caching: bool = False) -> None:
        self.num_blocks = num_blocks
        self.caching = caching
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._ref = [0] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks
        self._cached: dict[int, int] = {}

    @property
    def free(self) -> int:
        """Blocks that can be allocated (free, whether or not they still hold a cached prefix)."""
        return len(self._free)

    @property
    def cached_blocks(self) -> int:
        """Blocks that hold a cached prefix (in use or free)."""
        return len(self._cached)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks from the head of the free queue (the caller checked :attr:`free`)."""
        free, ref, block_hash, cached = self._free, self._ref, self._hash, self._cached
        out = []
        for _ in range(n):
            bid = free.popitem(last=False)[0]
            h = block_hash[bid]
            if h is not None:  # evict the prefix it held
                del cached[h]
                block_hash[bid] = None
            ref[bid] = 1
            out.append(bid)
        return out

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each block, tail first; blocks nobody uses join the free queue."""
        free, ref = self._free, self._ref
        for bid in reversed(blocks):
            left = ref[bid] - 1
            ref[bid] = left
            if left == 0:
                free[bid] = None

    def lookup(self, hashes: Sequence[int], max_blocks: int) -> list[int]:
        """The cached blocks of the longest prefix of ``hashes`` (at most ``max_blocks``), untouched."""
        cached = self._cached
        out = []
        for h in hashes[:max_blocks]:
            bid = cached.get(h)
            if bid is None:
                break
            out.append(bid)
        return out

    def evictable(self, blocks: Sequence[int]) -> int:
        """How many of ``blocks`` are in the free queue (taking them uses free capacity)."""
        ref = self._ref
        return sum(1 for bid in blocks if ref[bid] == 0)

    def touch(self, blocks: Sequence[int]) -> None:
        """Take a reference to cache-hit blocks (free ones leave the free queue)."""
        free, ref = self._free, self._ref
        for bid in blocks:
            if ref[bid] == 0:
                del free[bid]
            ref[bid] += 1

    def cache(self, bid: int, block_hash: int) -> None:
        """Record that block ``bid`` holds the full block named ``block_hash`` (first holder wins)."""
        if block_hash not in self._cached and self._hash[bid] is None:
            self._cached[block_hash] = bid
            self._hash[bid] = block_hash
