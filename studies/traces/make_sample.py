"""Regenerate studies/traces/sample.jsonl: a small SYNTHETIC trace (not recorded from any service).

240 requests over about two minutes at 2 requests/s on average, arriving in waves (the rate swings between
0.5 and 3.5 requests/s over a 40-second period, a non-homogeneous Poisson process drawn by thinning), with
lognormal prompt lengths (about 900 tokens on average, 32 to 3,000, longer in the waves' peaks) and reply
lengths (about 160 tokens on average, 8 to 800). One JSON object per line: timestamp (seconds), input_len, output_len,
the shape autotune's `trace` dataset reads. Run: python studies/traces/make_sample.py
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path


def lognormal(rng: random.Random, mean: float, std: float, low: int, high: int) -> int:
    sigma2 = math.log1p((std / mean) ** 2)
    value = rng.lognormvariate(math.log(mean) - sigma2 / 2, math.sqrt(sigma2))
    return max(low, min(high, round(value)))


def main() -> None:
    rng = random.Random(20261204)
    peak, period = 3.5, 40.0
    t, rows = 0.0, []
    while len(rows) < 240:
        t += rng.expovariate(peak)
        rate = 2.0 + 1.5 * math.sin(2 * math.pi * t / period)
        if rng.random() * peak > rate:  # thinning: keep each candidate with probability rate / peak
            continue
        busy = rate / peak
        rows.append(
            {
                "timestamp": round(t, 3),
                "input_len": lognormal(rng, 500 + 600 * busy, 400, 32, 3000),
                "output_len": lognormal(rng, 160, 120, 8, 800),
            }
        )
    path = Path(__file__).with_name("sample.jsonl")
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


if __name__ == "__main__":
    main()
