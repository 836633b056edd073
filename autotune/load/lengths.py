"""Token-length distributions: one seeded draw, and a distribution's mean (clipped as the draws are)."""

from __future__ import annotations

import functools
import math
import random

from autotune.inputs.spec import LengthDist


def sample_length(dist: LengthDist, rng: random.Random) -> int:
    """Draw one length from ``dist``, clipped to ``[low or 1, high or unbounded]``.

    ``normal`` and ``lognormal`` take ``mean``/``std`` as the mean and standard deviation of the lengths
    themselves (for lognormal the underlying normal's parameters are derived from them).
    """
    if dist.dist == "fixed":
        assert dist.value is not None
        return dist.value
    if dist.dist == "uniform":
        assert dist.low is not None and dist.high is not None
        return rng.randint(dist.low, dist.high)
    assert dist.mean is not None and dist.std is not None
    if dist.dist == "normal":
        value = rng.gauss(dist.mean, dist.std)
    else:
        sigma2 = math.log1p((dist.std / dist.mean) ** 2)
        value = rng.lognormvariate(math.log(dist.mean) - sigma2 / 2, math.sqrt(sigma2))
    return clip_length(round(value), dist)


@functools.cache
def expected_length(dist: LengthDist) -> float:
    """The mean of ``dist`` after clipping: exact for ``fixed`` and ``uniform``, else over a fixed seeded
    sample of 20,000 draws (the same value every time)."""
    if dist.dist == "fixed":
        assert dist.value is not None
        return float(dist.value)
    if dist.dist == "uniform":
        assert dist.low is not None and dist.high is not None
        return (dist.low + dist.high) / 2
    rng = random.Random("expected-length")
    return math.fsum(sample_length(dist, rng) for _ in range(20_000)) / 20_000


def clip_length(value: int, dist: LengthDist) -> int:
    """``value`` clipped to ``[low or 1, high or unbounded]`` of ``dist``."""
    low = dist.low if dist.low is not None else 1
    value = max(low, value)
    if dist.high is not None:
        value = min(dist.high, value)
    return value
