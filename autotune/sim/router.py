"""Data-parallel request routing: vLLM 0.34's least-loaded choice among the engines.

vLLM's client (``DPLBAsyncMPClient.get_core_engine_for_request``) scores each engine as
``waiting + running``, plus ``waiting x 6 x max(0, KV usage - 0.5)`` (a queue on a KV-bound engine drains
slowly), takes the lowest score, and starts its scan one engine later on every request so that ties
rotate (round-robin when the engines look equally loaded). vLLM reads the counts from its coordinator's
snapshots (every 100 ms) and its own in-flight counts; the simulator reads the engines' exact counts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class Loaded(Protocol):
    """What routing reads of an engine."""

    @property
    def kv_usage(self) -> float:
        """Fraction of KV blocks in use."""
        ...

    def load(self) -> tuple[int, int]:
        """(waiting, running) requests."""
        ...


class LeastLoaded:
    """Chooses an engine for each new request (see the module docstring)."""

    def __init__(self) -> None:
        self._start = 0

    def choose(self, engines: Sequence[Loaded]) -> int:
        """The index of the engine the next request goes to."""
        n = len(engines)
        if n == 1:
            return 0
        best, best_score = 0, float("inf")
        for i in range(n):
            index = (self._start + i) % n
            engine = engines[index]
            waiting, running = engine.load()
            score = float(waiting + running)
            if waiting:
                score += waiting * 6.0 * max(0.0, engine.kv_usage - 0.5)
            if score < best_score:
                best, best_score = index, score
        self._start = (self._start + 1) % n
        return best
