"""Prometheus text parsing and server deltas on realistic vLLM /metrics output."""

from __future__ import annotations

import math

import httpx
import pytest

from autotune.errors import LoadError
from autotune.load.prom import GaugePeaks, delta, parse, scrape

VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 7.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="tiny"} 2.0
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="tiny"} 1200.0
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="tiny"} 640.0
# HELP vllm:request_success_total Count of successfully processed requests.
# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="stop",model_name="tiny"} 4.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="tiny"} 6.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="tiny"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.005",model_name="tiny"} 3.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="tiny"} 10.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="tiny"} 10.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="tiny"} 0.123
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",num_gpu_blocks="2048",label_with_quote="a\\"b"} 1.0
# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 1.5e+04
process_start_time_seconds 1.7e+09 1700000000000
"""


def test_parse_counters_gauges_histograms_and_labels() -> None:
    """Samples keep labels (escapes undone), sums run over label sets, and +Inf buckets parse."""
    snap = parse(VLLM_METRICS)
    assert snap.sum("vllm:num_requests_waiting") == 7.0
    assert snap.sum("vllm:request_success_total") == 10.0
    buckets = snap.series("vllm:time_to_first_token_seconds_bucket")
    assert buckets[(("engine", "0"), ("le", "+Inf"), ("model_name", "tiny"))] == 10.0
    info = next(iter(snap.series("vllm:cache_config_info")))
    assert dict(info)["num_gpu_blocks"] == "2048"
    assert dict(info)["label_with_quote"] == 'a"b'
    assert snap.types["vllm:time_to_first_token_seconds"] == "histogram"
    assert snap.sum("process_start_time_seconds") == 1.7e9  # a trailing timestamp is ignored
    assert snap.sum("vllm:missing") is None


def test_parse_rejects_garbage_with_line_number() -> None:
    """A line that is not a sample raises LoadError naming the line."""
    with pytest.raises(LoadError, match="line 2"):
        parse("ok 1\n{{{ nonsense\n")


def test_delta_counters_and_gauge_peaks_including_old_kv_name() -> None:
    """delta diffs counters and takes gauge peaks from the scrapes and the sampler; old KV name works."""
    before = parse(VLLM_METRICS)
    after = parse(
        VLLM_METRICS.replace("} 2.0", "} 5.0")
        .replace("} 640.0", "} 1640.0")
        .replace("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
        .replace("} 0.25", "} 0.5")
        .replace("} 7.0", "} 1.0")
    )
    d = delta(before, after, GaugePeaks(samples=3, kv_usage_peak=0.9, waiting_peak=12.0))
    assert d.preemptions == 3.0
    assert d.generation_tokens == 1000.0
    assert d.prompt_tokens == 0.0
    assert d.kv_usage_last == 0.5
    assert d.kv_usage_peak == 0.9
    assert d.waiting_last == 1.0
    assert d.waiting_peak == 12.0
    assert d.running_peak == 3.0
    assert not any(isinstance(v, float) and math.isnan(v) for v in d.as_dict().values())


def test_scrape_over_http_and_errors() -> None:
    """scrape GETs /metrics (base URL with or without /v1) and wraps HTTP failures in LoadError."""

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/metrics":
            return httpx.Response(200, text=VLLM_METRICS)
        return httpx.Response(404)

    with httpx.Client(transport=httpx.MockTransport(handler)) as client:
        assert scrape(client, "http://x/v1").sum("vllm:num_requests_running") == 3.0

    failing = httpx.MockTransport(lambda r: httpx.Response(503))
    with httpx.Client(transport=failing) as client, pytest.raises(LoadError, match="503"):
        scrape(client, "http://x")


def test_parse_only_named_metrics() -> None:
    """names= keeps only the named metrics (the gauge sampler's cheap parse)."""
    snap = parse(VLLM_METRICS, names=("vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"))
    assert snap.sum("vllm:num_requests_waiting") == 7.0
    assert snap.max("vllm:kv_cache_usage_perc") == 0.25
    assert snap.sum("vllm:num_requests_running") is None
    assert not snap.has("vllm:time_to_first_token_seconds_bucket")
