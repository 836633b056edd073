"""``/metrics`` of the simulated server: vLLM 0.34's metric names, one series per data-parallel engine.

Gauges (running, waiting, KV usage) and counters (preemptions, prompt/generation tokens, prefix-cache
queries and hits, speculative-decoding drafts) come from each :class:`~autotune.sim.engine.Engine`; the
per-request histograms and ``request_success_total`` from that engine's :class:`EngineStats`. Labels are
``engine="<rank>",model_name="<name>"``, as vLLM labels them. The ``vllm:spec_decode_*`` counters appear
only with speculative decoding, as in vLLM. ``autotune_sim:*`` are the simulator's own.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from autotune.sim.engine import Engine

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
TOKEN_COUNT_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0)
PREEMPTION_BUCKETS = (1.0, 2.0, 3.0, 4.0, 5.0, 10.0, 20.0)
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")


class Histogram:
    """A Prometheus histogram with fixed buckets."""

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.total = 0.0
        self.n = 0

    def observe(self, value: float) -> None:
        """Record one observation."""
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.n += 1

    def render(self, name: str, labels: str) -> list[str]:
        """Prometheus sample lines of this histogram."""
        lines = []
        cumulative = 0
        for bound, count in zip(self.buckets, self.counts, strict=False):
            cumulative += count
            lines.append(f'{name}_bucket{{{labels},le="{bound}"}} {float(cumulative)}')
        lines.append(f'{name}_bucket{{{labels},le="+Inf"}} {float(self.n)}')
        lines.append(f"{name}_count{{{labels}}} {float(self.n)}")
        lines.append(f"{name}_sum{{{labels}}} {self.total}")
        return lines


class EngineStats:
    """Per-request observations of one engine (vLLM's per-request histograms and success counter)."""

    def __init__(self) -> None:
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.queue = Histogram(E2E_BUCKETS)
        self.iteration = Histogram(tuple(float(b) for b in ITERATION_BUCKETS))
        self.prompt = Histogram(TOKEN_COUNT_BUCKETS)
        self.generation = Histogram(TOKEN_COUNT_BUCKETS)
        self.max_tokens = Histogram(TOKEN_COUNT_BUCKETS)
        self.tpot = Histogram(ITL_BUCKETS)
        self.inference = Histogram(E2E_BUCKETS)
        self.prefill = Histogram(E2E_BUCKETS)
        self.decode = Histogram(E2E_BUCKETS)
        self.preemptions = Histogram(PREEMPTION_BUCKETS)
        self.success: dict[str, int] = dict.fromkeys(FINISH_REASONS, 0)


_HISTOGRAMS = (
    ("ttft", "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds."),
    ("itl", "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds."),
    ("e2e", "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds."),
    ("queue", "vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request."),
    ("iteration", "vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step."),
    ("prompt", "vllm:request_prompt_tokens", "Number of prefill tokens processed."),
    ("generation", "vllm:request_generation_tokens", "Number of generation tokens processed."),
    ("max_tokens", "vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter."),
    ("tpot", "vllm:request_time_per_output_token_seconds",
     "Histogram of time_per_output_token_seconds per request."),
    ("inference", "vllm:request_inference_time_seconds",
     "Histogram of time spent in RUNNING phase for request."),
    ("prefill", "vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request."),
    ("decode", "vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request."),
    ("preemptions", "vllm:request_num_preemptions",
     "Histogram of the number of times a request was preempted."),
)  # fmt: skip


_ENGINE_COUNTERS = (
    (
        "vllm:prefix_cache_queries_total",
        "Prefix cache queries, in terms of number of queried tokens.",
        "prefix_queries",
    ),
    (
        "vllm:prefix_cache_hits_total",
        "Prefix cache hits, in terms of number of cached tokens.",
        "prefix_hits",
    ),
    ("vllm:num_preemptions_total", "Cumulative number of preemption from the engine.", "num_preemptions"),
    ("vllm:prompt_tokens_total", "Number of prefill tokens processed.", "prompt_tokens"),
    ("vllm:prompt_tokens_cached_total", "Number of cached prompt tokens (local + external).", "prefix_hits"),
    ("vllm:generation_tokens_total", "Number of generation tokens processed.", "generation_tokens"),
)
"""(name, help, :class:`~autotune.sim.engine.Engine` attribute) of the per-engine counters, in order."""


def _family(name: str, kind: str, help_text: str, samples: list[str]) -> list[str]:
    """One metric family: its HELP and TYPE lines, then its samples."""
    return [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", *samples]


def _per_engine(name: str, labels: Sequence[str], values: Sequence[float]) -> list[str]:
    """One sample of ``name`` per engine (``labels[i]`` with ``values[i]``)."""
    return [f"{name}{{{lab}}} {float(v)}" for lab, v in zip(labels, values, strict=True)]


def render(
    model_name: str,
    engines: Sequence[Engine],
    stats: Sequence[EngineStats],
    cache_labels: Sequence[str],
    *,
    lag_s: float,
    merged_tokens: int,
) -> str:
    """The Prometheus text of the whole server."""
    labels = [f'engine="{i}",model_name="{model_name}"' for i in range(len(engines))]
    out = _scheduler_gauges(labels, engines) + _engine_counters(labels, engines)
    out += _family(
        "vllm:request_success_total",
        "counter",
        "Count of successfully processed requests.",
        [
            f'vllm:request_success_total{{{lab},finished_reason="{reason}"}} {float(n)}'
            for lab, s in zip(labels, stats, strict=True)
            for reason, n in s.success.items()
        ],
    )
    if engines and engines[0].config.num_speculative_tokens:
        out += _spec_decode(labels, engines)
    for attr, name, help_text in _HISTOGRAMS:
        samples = [line for lab, s in zip(labels, stats, strict=True)
                   for line in getattr(s, attr).render(name, lab)]  # fmt: skip
        out += _family(name, "histogram", help_text, samples)
    out += _simulator_families(labels[0], lag_s, merged_tokens)
    out += _family("vllm:cache_config_info", "gauge", "Information of the LLMEngine CacheConfig",
                   [f"vllm:cache_config_info{{{info}}} 1.0" for info in cache_labels])  # fmt: skip
    return "\n".join(out) + "\n"


def _scheduler_gauges(labels: list[str], engines: Sequence[Engine]) -> list[str]:
    """Running and waiting requests (also by reason) and KV-cache usage of each engine."""
    out: list[str] = []
    out += _family("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.",
                   _per_engine("vllm:num_requests_running", labels,
                               [len(e.running) for e in engines]))  # fmt: skip
    out += _family("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.",
                   _per_engine("vllm:num_requests_waiting", labels,
                               [len(e.waiting) for e in engines]))  # fmt: skip
    out += _family(
        "vllm:num_requests_waiting_by_reason", "gauge",
        "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling "
        "capacity; 'deferred' = deferred by transient constraints (LoRA budget, KV transfer, blocked "
        "status). Sum of all reasons equals vllm:num_requests_waiting.",
        [line for lab, e in zip(labels, engines, strict=True) for line in (
            f'vllm:num_requests_waiting_by_reason{{{lab},reason="capacity"}} {float(len(e.waiting))}',
            f'vllm:num_requests_waiting_by_reason{{{lab},reason="deferred"}} 0.0')],
    )  # fmt: skip
    out += _family("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.",
                   _per_engine("vllm:kv_cache_usage_perc", labels,
                               [e.kv_usage for e in engines]))  # fmt: skip
    return out


def _engine_counters(labels: list[str], engines: Sequence[Engine]) -> list[str]:
    """The per-engine counters of :data:`_ENGINE_COUNTERS` (prefix cache, preemptions, tokens)."""
    out: list[str] = []
    for name, help_text, attr in _ENGINE_COUNTERS:
        out += _family(name, "counter", help_text,
                       _per_engine(name, labels, [getattr(e, attr) for e in engines]))  # fmt: skip
    return out


def _simulator_families(label: str, lag_s: float, merged_tokens: int) -> list[str]:
    """The simulator's own counters (``autotune_sim:*``), labelled as the first engine."""
    out = _family(
        "autotune_sim:lag_seconds_total",
        "counter",
        "Wall seconds the simulated engine ran behind its schedule (a host too slow for the load makes "
        "every latency longer).",
        [f"autotune_sim:lag_seconds_total{{{label}}} {lag_s}"],
    )
    out += _family(
        "autotune_sim:merged_tokens_total",
        "counter",
        "Tokens sent inside another token's chunk because the writer was late (as vLLM's output "
        "collector merges them).",
        [f"autotune_sim:merged_tokens_total{{{label}}} {float(merged_tokens)}"],
    )
    return out


def _spec_decode(labels: list[str], engines: Sequence[Engine]) -> list[str]:
    """The speculative-decoding counters of each engine (drafts, draft and accepted tokens, per position)."""
    out: list[str] = []
    for name, help_text, attr in (
        ("vllm:spec_decode_num_drafts_total", "Number of spec decoding drafts.", "num_drafts"),
        ("vllm:spec_decode_num_draft_tokens_total", "Number of draft tokens.", "num_draft_tokens"),
        ("vllm:spec_decode_num_accepted_tokens_total", "Number of accepted tokens.", "num_accepted_tokens"),
    ):
        samples = [
            f"{name}{{{lab}}} {float(getattr(e.spec, attr))}" for lab, e in zip(labels, engines, strict=True)
        ]
        out += _family(name, "counter", help_text, samples)
    per_pos = [
        f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{lab},position="{pos}"}} {float(n)}'
        for lab, e in zip(labels, engines, strict=True)
        for pos, n in enumerate(e.spec.accepted_per_pos or [])
    ]
    out += _family("vllm:spec_decode_num_accepted_tokens_per_pos_total", "counter",
                   "Accepted tokens per draft position.", per_pos)  # fmt: skip
    return out
