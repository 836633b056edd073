"""Shared-prefix groups: the study's system prompts, their lengths, and which one each request uses.

A workload with ``dataset.prefix`` has ``groups`` system prompts. Their lengths are fixed for the study
(drawn once from the workload seed, or derived from a target ``hit_rate``); which group a request (or a
conversation) uses is drawn from the study's stream, so every trial sees the same groups in the same
order. Their tokens are not drawn here: :class:`~autotune.load.workload._PromptMaker` draws them per probe,
so a probe's requests share them (and hit one another in the prefix cache) while no probe is served from
another probe's cache.

The target hit rate is the share of prompt tokens a prefix cache could serve if it kept every prefix:
``sum(prefix) / sum(prompt)`` over requests whose group was used before in the probe (and, in a
conversation, the history a later turn repeats). :func:`ideal_hit_rate` computes it for a probe's judged
requests; the server's own counters (``vllm:prefix_cache_hits_total`` over ``..._queries_total``) say what
its cache really served (:class:`~autotune.load.prom.ServerDelta`).
"""

from __future__ import annotations

import bisect
import itertools
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from autotune.inputs.spec import WorkloadSpec
from autotune.load.lengths import sample_length
from autotune.load.request import RequestSpec


@dataclass(frozen=True)
class PrefixGroups:
    """The system prompts of a workload: each group's length in tokens and its relative weight."""

    lengths: tuple[int, ...]
    weights: tuple[float, ...]

    @classmethod
    def of(cls, workload: WorkloadSpec, mean_input: float) -> PrefixGroups | None:
        """The groups of ``workload`` (``None`` without ``dataset.prefix``); ``mean_input`` is the mean of
        ``dataset.input_len`` (what a ``hit_rate`` is a share against)."""
        spec = workload.dataset.prefix
        if spec is None:
            return None
        if spec.hit_rate is not None:
            length = max(1, round(spec.hit_rate / (1 - spec.hit_rate) * mean_input))
            lengths = (length,) * spec.groups
        else:
            assert spec.len is not None
            rng = random.Random(f"{workload.seed}:prefix-groups")
            lengths = tuple(sample_length(spec.len, rng) for _ in range(spec.groups))
        weights = spec.weights if spec.weights is not None else (1.0,) * spec.groups
        return cls(lengths, tuple(float(w) for w in weights))

    def draw(self, n: int, workload_seed: int, stream_seed: int) -> list[int]:
        """The groups of the first ``n`` requests (or conversations) of stream ``stream_seed``."""
        rng = random.Random(f"{workload_seed}:{stream_seed}:groups")
        if len(self.lengths) == 1:
            return [0] * n
        cumulative = list(itertools.accumulate(self.weights))
        total = cumulative[-1]
        last = len(cumulative) - 1
        return [min(last, bisect.bisect_right(cumulative, rng.random() * total)) for _ in range(n)]

    @property
    def mean_length(self) -> float:
        """The weighted mean length of a request's system prompt."""
        return math.fsum(w * n for w, n in zip(self.weights, self.lengths, strict=True)) / math.fsum(
            self.weights
        )


def ideal_hit_rate(requests: Sequence[RequestSpec], judged: range) -> float | None:
    """The share of the judged requests' prompt tokens a prefix cache keeping everything could serve.

    A request serves from cache its group's system prompt when an earlier request of the plan (warm-up
    ones included) used that group, and, as a later turn, its whole history (the previous turn's prompt
    and reply). ``None`` when the judged requests have no prompt tokens."""
    seen: set[int] = set()
    cached = total = 0
    for index, request in enumerate(requests):
        hit = 0
        if request.follows is not None:
            before = requests[request.follows]
            hit = before.input_len + before.output_len
        elif request.group is not None:
            if request.group in seen:
                hit = request.prefix_len
            seen.add(request.group)
        if index in judged:
            cached += min(hit, request.input_len)
            total += request.input_len
    return round(cached / total, 4) if total else None
