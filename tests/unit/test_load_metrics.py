"""Probe metrics match `vllm bench serve` definitions on hand-computed streams."""

from __future__ import annotations

import numpy as np
import pytest

from autotune.inputs.spec import SloSection
from autotune.load.metrics import Dist, percentile, summarize
from autotune.load.records import RequestRecord


def rec(
    index: int,
    send: float,
    chunks: list[float],
    tokens: int | None = None,
    *,
    success: bool = True,
    prompt_tokens: int | None = 10,
) -> RequestRecord:
    return RequestRecord(
        index=index,
        send_time=send,
        chunk_times=tuple(chunks),
        output_tokens=tokens if tokens is not None else len(chunks),
        prompt_tokens=prompt_tokens,
        input_len=12,
        output_len=len(chunks),
        success=success,
        error="" if success else "boom",
        status=200 if success else 500,
        end_time=(chunks[-1] if chunks else send) + 0.001,
    )


def test_percentile_matches_numpy_linear_interpolation() -> None:
    """percentile() equals numpy.percentile's default (linear) method, including on tiny samples."""
    rng = np.random.default_rng(1)
    for n in (1, 2, 3, 7, 100):
        xs = list(rng.exponential(size=n))
        for q in (0, 50, 90, 95, 99, 100):
            assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)), rel=1e-12)
    assert percentile([], 50) == 0.0


def test_dist_of_matches_numpy_mean_std_and_max() -> None:
    """Dist.of gives numpy's mean, population std (ddof=0), percentiles and max."""
    xs = [0.3, 0.1, 0.2, 0.9, 0.5]
    d = Dist.of(xs)
    assert d.n == 5
    assert d.mean == pytest.approx(np.mean(xs))
    assert d.std == pytest.approx(np.std(xs))
    assert d.p99 == pytest.approx(np.percentile(xs, 99))
    assert d.max == 0.9
    assert Dist.of([]).p95 == 0.0


def test_summarize_hand_computed_streams() -> None:
    """TTFT, E2EL, TPOT, pooled ITL, token totals and throughputs follow vLLM's definitions."""
    records = [
        # TTFT 0.1, chunks at 0.1, 0.3, 0.6 → ITL 0.2, 0.3; E2EL 0.6; TPOT (0.6-0.1)/(3-1)=0.25
        rec(0, 0.0, [0.1, 0.3, 0.6]),
        # TTFT 0.2, one token: no TPOT, no ITL; E2EL 0.2
        rec(1, 1.0, [1.2]),
        # usage says 5 tokens over 2 chunks: TPOT uses tokens: (0.5-0.1)/4 = 0.1; ITL 0.4
        rec(2, 2.0, [2.1, 2.5], tokens=5, prompt_tokens=None),
        rec(3, 3.0, [], tokens=0, success=False),
    ]
    m = summarize(records, duration_s=4.0, slo=None)
    assert m.completed == 3
    assert m.failed == 1
    assert m.ttft.n == 3
    assert m.ttft.mean == pytest.approx((0.1 + 0.2 + 0.1) / 3)
    assert m.e2el.max == pytest.approx(0.6)
    assert m.tpot.n == 2
    assert m.tpot.mean == pytest.approx((0.25 + 0.1) / 2)
    assert m.itl.p50 == pytest.approx(0.3)  # pooled gaps 0.2, 0.3, 0.4
    assert m.itl.n == 3
    assert m.total_output_tokens == 3 + 1 + 5
    assert m.total_input_tokens == 10 + 10 + 12  # usage.prompt_tokens, else the intended length
    assert m.request_throughput == pytest.approx(3 / 4.0)
    assert m.output_throughput == pytest.approx(9 / 4.0)
    assert m.total_token_throughput == pytest.approx((9 + 32) / 4.0)
    assert m.goodput == pytest.approx(m.request_throughput)  # no SLO: every completed request is good
    assert m.failed_fraction == pytest.approx(0.25)


def test_goodput_counts_requests_meeting_every_per_request_limit() -> None:
    """Goodput counts completed requests within the strictest ttft/tpot/e2el limits; 1-token TPOT is 0."""
    records = [
        rec(0, 0.0, [0.1, 0.3, 0.6]),  # ttft 0.1, tpot 0.25 → fails tpot<=200ms
        rec(1, 1.0, [1.2]),  # ttft 0.2, tpot 0 → good
        rec(2, 2.0, [2.05, 2.15]),  # ttft 0.05, tpot 0.1 → good
        rec(3, 3.0, [3.3, 3.4]),  # ttft 0.3 → fails ttft<=250ms (the stricter of two ttft terms)
    ]
    slo = SloSection(terms=("ttft:p95<=500ms", "ttft:p50<=250ms", "tpot:p95<=200ms", "itl:p99<=1ms"))
    m = summarize(records, duration_s=2.0, slo=slo)
    assert m.goodput == pytest.approx(2 / 2.0)


def test_to_bench_json_has_vllm_keys_in_ms() -> None:
    """to_bench_json has every `vllm bench serve --save-result` key, latencies in milliseconds."""
    m = summarize([rec(0, 0.0, [0.1, 0.3, 0.6])], duration_s=1.0, slo=None)
    out = m.to_bench_json()
    keys = [
        "duration",
        "completed",
        "failed",
        "total_input_tokens",
        "total_output_tokens",
        "request_throughput",
        "request_goodput",
        "output_throughput",
        "total_token_throughput",
    ]
    for name in ("ttft", "tpot", "itl", "e2el"):
        keys += [f"{s}_{name}_ms" for s in ("mean", "median", "std", "p90", "p95", "p99")]
    assert set(keys) <= set(out)
    assert out["mean_ttft_ms"] == pytest.approx(100.0)
    assert out["median_itl_ms"] == pytest.approx(250.0)
    assert out["p99_e2el_ms"] == pytest.approx(600.0)


def test_max_concurrency_seen_counts_overlapping_requests() -> None:
    """max_concurrency_seen is the most requests in flight at once."""
    records = [rec(0, 0.0, [1.0]), rec(1, 0.5, [1.5]), rec(2, 2.0, [2.5])]
    assert summarize(records, 3.0, None).max_concurrency_seen == 2
