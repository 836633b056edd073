"""Search efficiency: how many launches until the study holds a config near the best one, and how many of
its launches fail, for this project's search against plain TPE, random search and vLLM's ``auto_tune.sh``.

Each scenario is a simulated model on a simulated GPU with ``max-model-len`` at the model's full context,
a workload and SLOs. Its space is a grid (gpu-memory-utilization 0.80-0.98 by 0.02, max-num-seqs 16-1024,
max-num-batched-tokens 1024-32768, KV cache dtype auto/fp8; chunked prefill stays on: off it can never hold
at full context), and every config of the grid is launched once, up front, on the in-process simulator
(:func:`autotune.sim.startup.plan_startup` for the start, :func:`autotune.sim.simulate` for the load). The
start is seeded by the config: a config gives the same outcome however often it is launched, as on a real
GPU where the same flags capture the same graphs. The load is the same for every config (common random
numbers, as a study measures its configs): one workload and one draw of Poisson arrivals, scaled to each
rate, so configs that schedule alike measure alike and a difference between two configs is theirs, not
the draw's. The grid's best SLO throughput is the scenario's optimum.

The truth (``--truth perturbed``, the default): each scenario's simulated GPU runs on constants the study
does not know (:class:`Truth`, written out in the scenario's definition): compute and weight-bandwidth
efficiencies, the paged-attention efficiency curve over block size and the per-step overheads of
:mod:`autotune.sim.cost`, and memory terms of :mod:`autotune.hardware.memory` (activation peak and CUDA-graph
memory scaled, non-torch memory added) and :mod:`autotune.sim.startup` (more memory used after the profile).
Only the simulated launches run on them (:func:`evaluate` passes :meth:`Truth.physics` to the simulator as its
``physics``); the study's memory model and pre-launch check see the library's own model, so what they predict
is as wrong as it would be on a real GPU and must be learned from the launches' reported KV memory. Each
hidden truth also has a crash-under-load region, as real GPUs do: what a full batch needs beyond vLLM's
profile (per batched token and per sequence, ``Truth.runtime_gib``) must fit past the budget, so a high
utilization with a large batch starts and then dies at the first large batch (:func:`crashes_under_load`,
applied to the measured table by :func:`with_crashes`). ``--truth model`` simulates the grid with the
library's own constants (the unperturbed benchmark, no crash under load).

SLO throughput of a config that starts: a burst of 200 requests (all at once) gives its capacity, which only
scales the rates tried: 0.95, 0.9, 0.8, ..., 0.2, 0.1, 0.05 and 0.02 of it in order until p95 TTFT, p95 TPOT
and failures meet the SLOs (a config with a large batch can have a capacity five times its SLO rate: a TPOT
limit holds only at small batches); if 0.95 meets them, 1.0, 1.1, 1.25, 1.5, 2, 3 and 5 times it until one
does not (:data:`ABOVE_CAPACITY`: Poisson arrivals can sustain more than a burst, whose drain and KV-bound
start hold its throughput down); then the rate is bisected between the passing rate and the failing one
until they are within 1 % (:data:`RATE_GRAIN`). Each run at a rate sends requests for at least
:data:`SPAN_S` seconds (at least 200 of them, at most :data:`MAX_REQUESTS`, more while a request's median
lifetime is over a quarter of the span) and is judged on its steady state: the percentiles over the
requests sent in the middle half of the span, none failed (a run whose median request outlives a quarter
of the span fails). The config's SLO throughput is the highest passing rate times the mean reply length. A
config that meets the SLOs at no rate is ``slo_unreachable``.

Searchers, 30 launches each (configs rejected before a launch do not spend one):

* ``autotune``: this project's study with the surrogate off (:class:`autotune.study.loop.StudyRunner`, SQLite
  storage, the default sampler of :func:`autotune.study.loop.make_sampler`, vLLM's defaults as trial 0, the
  space's constraints and
  impossible values, repeats, the crash boundary and the memory model with its learned device edge, as
  ``run_study`` wires them);
* ``surrogate``: the same study with the calibrated surrogate on (``sampler.surrogate``,
  :mod:`autotune.predict.surrogate`): each launch after the defaults is its proposal until it hands over. Each
  table entry carries what a trial records for it to calibrate to: the simulated rates (the saturation
  run's fractions, down to the passing one, and the bisection's) with their p95 TTFT and TPOT, and the
  passing rate;
* ``tpe``: Optuna's ``TPESampler(seed)`` with its own defaults, the same defaults first, no pre-launch
  checks but the space's constraints;
* ``random``: ``RandomSampler(seed)``, the same way;
* ``auto_tune``: vLLM's ``benchmarks/auto_tune/auto_tune.sh`` order: gpu-memory-utilization from 0.98 down
  (0.02 steps here, 0.01 there) until the largest max-num-seqs with the largest max-num-batched-tokens
  starts, then every max-num-seqs x max-num-batched-tokens pair at that utilization (fp8 KV never tried).

Reported per scenario and searcher, over seeds: launches to 95 % and 98 % of the optimum (best feasible
config so far), best after 15 and 30 launches (% of the optimum), and the share of launches from the 11th on
that failed (did not start: oom, kv_too_small, invalid_config, start_failed; or crashed under load), and
wrong rejects: configs the pre-launch check refused as predicted infeasible (the memory model's
``kv_too_small``/``oom``/``crashed_under_load``, or the crash boundary) that start and run in truth (and so
serve the load, whether or not they meet the SLOs), in all and after
launch 5 (rejected with at least 5 launches done), out of all predicted-infeasible rejects. Only
``autotune`` has a pre-launch check; repeats of a config that failed to start are not counted.

The table is what the searchers see, and its runs are short where rates are low (at 2-3 requests per
second a run holds its fewest, 200 requests, of which about 100 are judged: the p95 is the fifth worst),
so near the top it ranks configs partly by the draw of arrivals. A second table scores the searchers on
long runs (``--top N``, default :data:`TOP`; :func:`on_long_runs`): the table's best N configs,
:data:`SAMPLE` configs drawn from the rest of it, vLLM's defaults and every config a searcher would have
picked after some launch (its best by the table so far, as a study picks by what it measured) are
measured again as the table measured them but with at least :data:`LONG_REQUESTS` requests in every run
(about 1,500 judged), starting at the table's passing rate; the best of them is the reference. Reported
per searcher: launches until its pick is within 5 % and 2 % of the reference, the pick's share of it after
8, 20 and 30 launches (a pick can fall back: a config the table rates higher may be worse on long runs),
and the seeds whose pick after 8 launches is within 5 % and whose pick after 20 is within 2 %; beside
them, the first launch of a config within 2 % of the reference whether picked or not (where the pick
trails it, the search found the config and the table's draw ranked another above it; launches not
measured on long runs count as not within, so this is a lower bound on what the search found).
The comment line before the rows says where the table's best, its top N, the sample of the rest, the
searchers' picks and vLLM's defaults stand against the reference: a config of the sample or the picks at
the reference's level says the top N missed part of the plateau.

``--draws N`` measures the optimum's config, vLLM's defaults and the best config below 95 % of the optimum
again on N draws of the arrivals (:func:`across_draws`) and prints how far apart their figures lie: the
truth's own precision, against which the searchers' cells have to be read (``--searchers ""``: that
alone); with ``--top`` on, the long-run reference's config, the table's best and vLLM's defaults are
measured on long runs on N draws too, and each one's share of the reference's config on the same draw is
printed: how precisely the long runs compare configs.

Run: ``python -m benchmarks.search [--seeds 5] [--launches 30] [--only NAME] [--truth perturbed|model]
[--searchers surrogate,autotune,tpe,random,auto_tune] [--draws N] [--top N] [--cache DIR]`` (``--cache``
keeps each scenario's measured grid and long runs for the next run while the simulator's source and the
way this script measures are unchanged)
(results: benchmarks/RESULTS.md).
"""

from __future__ import annotations

import argparse
import ast
import functools
import hashlib
import inspect
import itertools
import math
import os
import pickle
import random
import statistics
import tempfile
import time
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import optuna
import yaml

from autotune.flags import FlagValue
from autotune.hardware.catalog import GIB, GPUS, MODELS
from autotune.inputs.loader import LoadedStudy, load_study
from autotune.outcome import Cause, TrialOutcome
from autotune.predict.feasibility import Decision, MemoryModel, PreLaunchCheck
from autotune.predict.surrogate.propose import proposer_for
from autotune.sim import cost as sim_cost
from autotune.sim import simulate, synthetic_workload
from autotune.sim import startup as sim_startup
from autotune.sim.flags import ServeFlags
from autotune.sim.model import WorkloadRequest, percentile
from autotune.sim.startup import plan_startup
from autotune.store.record import TrialRecord
from autotune.study.loop import StudyRunner, open_study
from autotune.study.standing import is_launch
from benchmarks import QUICK_HELP

REPO = Path(__file__).resolve().parents[1]

UTILS = tuple(round(0.80 + 0.02 * i, 2) for i in range(10))
SEQS = (16, 32, 64, 128, 256, 512, 1024)
BATCHED = (1024, 2048, 4096, 8192, 16384, 32768)
KV_DTYPES = ("auto", "fp8")


@dataclass(frozen=True)
class Grid:
    """The flag values a scenario's table crosses (every combination with batched tokens >= sequences)."""

    utils: tuple[float, ...] = UTILS
    seqs: tuple[int, ...] = SEQS
    batched: tuple[int, ...] = BATCHED
    kv_dtypes: tuple[str, ...] = KV_DTYPES


FULL = Grid()
QUICK = Grid(utils=(0.9, 0.98), seqs=(256, 1024), batched=(2048, 8192), kv_dtypes=("auto",))
"""``--quick``'s grid: 8 configs around the first scenario's defaults (1,024 sequences, 8,192 tokens)."""
QUICK_REQUESTS = 300
"""``--quick``'s workload: each run at most this many requests."""
RATE_FRACTIONS = (0.95, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1, 0.05, 0.02)
ABOVE_CAPACITY = (1.0, 1.1, 1.25, 1.5, 2.0, 3.0, 5.0)
"""Rungs above the burst capacity, tried in order when 0.95 of it meets the SLOs."""
FAILED_TO_START = {Cause.OOM, Cause.KV_TOO_SMALL, Cause.INVALID_CONFIG, Cause.START_FAILED}
FAILED = FAILED_TO_START | {Cause.CRASHED_UNDER_LOAD}
"""A failed launch: it did not start, or it crashed under load."""
REQUESTS = 200
"""Requests in the saturation run, and the fewest in a run at a rate."""
SPAN_S = 40.0
"""A run at a rate sends requests for at least this long (more while a request lives over a quarter of it)."""
MAX_REQUESTS = 6000
"""The most requests a run at a rate sends (the workload's length)."""
RATE_GRAIN = 0.01
"""The SLO rate is bisected until the failing rate above it is within 1 % of it."""
LOAD_SEED = 0
"""Seed of the arrivals every config is measured with (common random numbers)."""
LONG_REQUESTS = 3000
"""The fewest requests in a run of the long-run truth: about 1,500 judged, however low the rate."""
TOP = 30
"""The table's best configs measured again on long runs."""
SAMPLE = 30
"""Configs drawn from the rest of the table (those that pass at some rate) measured again on long runs."""


@dataclass(frozen=True)
class Truth:
    """What a scenario's simulated GPU really does, where it differs from the models the study knows
    (the defaults are the library's own constants: :mod:`autotune.sim.cost`,
    :mod:`autotune.hardware.memory`)."""

    compute_efficiency: float = sim_cost.COMPUTE_EFFICIENCY
    bandwidth_efficiency: float = sim_cost.WEIGHT_BANDWIDTH_EFFICIENCY
    """Of peak bandwidth, reading the weights."""
    attention: tuple[float, float] = sim_cost.ATTENTION_CURVE
    """Paged-attention bandwidth efficiency ``a x (1 - b x min(1, 16 / block_size))``."""
    step_overhead_s: float = sim_cost.STEP_OVERHEAD_S
    per_seq_overhead_s: float = sim_cost.PER_SEQ_OVERHEAD_S
    activation_factor: float = 1.0
    """True activation peak / the memory model's :func:`autotune.hardware.memory.activation_peak_bytes`."""
    cuda_graph_factor: float = 1.0
    """True CUDA-graph memory / :func:`autotune.hardware.memory.cuda_graph_bytes`."""
    extra_non_torch_gib: float = 0.0
    """Non-torch memory beyond :func:`autotune.hardware.memory.non_torch_bytes` (inside the budget: less
    KV)."""
    extra_reserve_gib: float = 0.0
    """Memory used after the profile beyond :data:`autotune.sim.startup.HIDDEN_RESERVE_BYTES` (the device
    edge at CUDA-graph capture comes sooner than the memory model's edge probability says)."""
    runtime_gib: tuple[float, float] = (0.0, 0.0)
    """What a full batch needs under load beyond vLLM's profile, in GiB per 1,024 batched tokens and per
    100 sequences (:func:`crashes_under_load`): past the budget, beside the post-profile reserve. (0, 0):
    nothing, no config crashes under load. The memory model knows neither term nor this form."""

    def attention_efficiency(self, block_size: int) -> float:
        """Paged attention's bandwidth efficiency at ``block_size`` on this truth."""
        return sim_cost.attention_efficiency(block_size, self.attention)

    def physics(self) -> sim_cost.Physics:
        """The truth as the simulator takes it (:func:`autotune.sim.simulate`'s and
        :func:`autotune.sim.startup.plan_startup`'s ``physics``)."""
        return sim_cost.Physics(
            compute_efficiency=self.compute_efficiency,
            weight_bandwidth_efficiency=self.bandwidth_efficiency,
            attention=self.attention,
            step_overhead_s=self.step_overhead_s,
            per_seq_overhead_s=self.per_seq_overhead_s,
            activation_scale=self.activation_factor,
            cuda_graph_scale=self.cuda_graph_factor,
            extra_non_torch_bytes=round(self.extra_non_torch_gib * GIB),
            extra_reserve_bytes=round(self.extra_reserve_gib * GIB),
        )

    def describe(self) -> str:
        """The truth against the model (model values in brackets)."""
        model = Truth()
        a, b = self.attention
        return (
            f"compute efficiency {self.compute_efficiency:.2f} ({model.compute_efficiency:.2f}), weight "
            f"bandwidth {self.bandwidth_efficiency:.2f} ({model.bandwidth_efficiency:.2f}), attention "
            f"{a:.2f} x (1 - {b:.2f} x min(1, 16/block)) = {self.attention_efficiency(16):.2f} at block 16 "
            f"({model.attention_efficiency(16):.2f}), step overhead {self.step_overhead_s * 1e3:.1f} ms + "
            f"{self.per_seq_overhead_s * 1e6:.0f} us/seq ({model.step_overhead_s * 1e3:.1f} ms + "
            f"{model.per_seq_overhead_s * 1e6:.0f} us); activation peak x{self.activation_factor:g}, "
            f"CUDA graphs x{self.cuda_graph_factor:g}, non-torch +{self.extra_non_torch_gib:g} GiB, "
            f"post-profile reserve +{self.extra_reserve_gib:g} GiB; under load a full batch needs "
            f"{self.runtime_gib[0]:g} GiB per 1,024 batched tokens + {self.runtime_gib[1]:g} GiB per 100 "
            f"sequences past the budget"
        )


@dataclass(frozen=True)
class Scenario:
    name: str
    model: str
    gpu: str
    input_len: tuple[int, int]
    output_len: tuple[int, int]
    ttft_s: float
    tpot_s: float
    truth: Truth = field(default_factory=Truth)
    """What the simulated GPU really does (``--truth perturbed``)."""

    @property
    def max_model_len(self) -> int:
        return MODELS[self.model].max_position_embeddings

    @property
    def defaults(self) -> dict[str, FlagValue]:
        """vLLM's defaults: 1024 sequences and 8192 batched tokens on GPUs of 70 GiB and more, else 256
        and 2048."""
        big = GPUS[self.gpu].memory_bytes >= 70 * GIB
        return {
            "gpu_memory_utilization": 0.9,
            "max_num_seqs": 1024 if big else 256,
            "max_num_batched_tokens": 8192 if big else 2048,
            "kv_cache_dtype": "auto",
        }


SCENARIOS = (
    # Truth: slower compute and weight reads, paged attention well below the model's curve, more host
    # overhead; activations at 0.4x (the model over-estimates them), CUDA graphs 1.5x, +0.3 GiB non-torch.
    Scenario(
        "8B on H100, KV plentiful", "Llama-3.1-8B", "H100-80GB", (384, 640), (96, 160), 0.5, 0.05,
        Truth(
            compute_efficiency=0.58, bandwidth_efficiency=0.80, attention=(0.80, 0.30),
            step_overhead_s=2.0e-3, per_seq_overhead_s=20e-6,
            activation_factor=0.4, cuda_graph_factor=1.5, extra_non_torch_gib=0.3, runtime_gib=(0.14, 0.15),
        ),
    ),
    # Truth: faster than the model (compute, weight reads, attention nearly flat over block size, less
    # host overhead); activations at 0.3x, CUDA graphs 1.5x, +0.4 GiB non-torch, +0.1 GiB after the
    # profile: on 24 GiB at 32k context the model's kv_too_small edge is pessimistic.
    Scenario(
        "7B on RTX 4090, KV scarce", "Qwen2.5-7B", "RTX-4090-24GB", (384, 640), (96, 160), 1.0, 0.06,
        Truth(
            compute_efficiency=0.70, bandwidth_efficiency=0.90, attention=(0.90, 0.12),
            step_overhead_s=1.2e-3, per_seq_overhead_s=12e-6,
            activation_factor=0.3, cuda_graph_factor=1.5, extra_non_torch_gib=0.4, extra_reserve_gib=0.1,
            runtime_gib=(0.04, 0.06),
        ),
    ),
    # Truth: slow prefill (compute 0.55), slightly slower weight and attention reads, 2.5 ms + 25 us per
    # step; activations at 1.5x (the model under-estimates them: optimistic), CUDA graphs 1.2x,
    # +0.5 GiB non-torch.
    Scenario(
        "8B on A100, long prompts", "Llama-3.1-8B", "A100-80GB", (3072, 5120), (128, 256), 2.0, 0.06,
        Truth(
            compute_efficiency=0.55, bandwidth_efficiency=0.82, attention=(0.78, 0.15),
            step_overhead_s=2.5e-3, per_seq_overhead_s=25e-6,
            activation_factor=1.5, cuda_graph_factor=1.2, extra_non_torch_gib=0.5, runtime_gib=(0.16, 0.10),
        ),
    ),
    # Truth: faster weight reads (the TPOT SLO's main term) but slow paged attention and 25 us per
    # sequence; activations at 0.5x, CUDA graphs 1.5x, +0.4 GiB non-torch, +0.2 GiB after the profile.
    Scenario(
        "7B on L40S, tight TPOT", "Mistral-7B", "L40S-48GB", (384, 640), (96, 160), 1.0, 0.025,
        Truth(
            compute_efficiency=0.70, bandwidth_efficiency=0.88, attention=(0.75, 0.25),
            step_overhead_s=1.2e-3, per_seq_overhead_s=25e-6,
            activation_factor=0.5, cuda_graph_factor=1.5, extra_non_torch_gib=0.4, extra_reserve_gib=0.2,
            runtime_gib=(0.08, 0.10),
        ),
    ),
    # Long prompts and long replies on 24 GiB: KV memory, preemption and the prefill chunk decide, so few
    # configs come near the best. Truth: slower compute and attention than the model, weight reads about
    # its own, more host overhead; activations at 0.6x, CUDA graphs 1.3x, +0.3 GiB non-torch, +0.15 GiB
    # after the profile.
    Scenario(
        "7B on RTX 4090, long requests", "Qwen2.5-7B", "RTX-4090-24GB", (2048, 4096), (384, 768), 1.5, 0.06,
        Truth(
            compute_efficiency=0.62, bandwidth_efficiency=0.86, attention=(0.85, 0.20),
            step_overhead_s=1.8e-3, per_seq_overhead_s=18e-6,
            activation_factor=0.6, cuda_graph_factor=1.3, extra_non_torch_gib=0.3, extra_reserve_gib=0.15,
            runtime_gib=(0.04, 0.06),
        ),
    ),
)  # fmt: skip


def space_yaml(scenario: Scenario, of: Grid = FULL) -> dict[str, Any]:
    d = scenario.defaults
    return {
        "name": "search-benchmark",
        "params": {
            "gpu_memory_utilization": {"type": "categorical", "choices": list(of.utils), "default": 0.9},
            "max_num_seqs": {"type": "categorical", "choices": list(of.seqs), "default": d["max_num_seqs"]},
            "max_num_batched_tokens": {
                "type": "categorical",
                "choices": list(of.batched),
                "default": d["max_num_batched_tokens"],
            },
            "kv_cache_dtype": {"type": "categorical", "choices": list(of.kv_dtypes), "default": "auto"},
        },
        "constraints": [{"expr": "max_num_batched_tokens >= max_num_seqs"}],
    }


FLAG_NAMES = ("gpu_memory_utilization", "max_num_seqs", "max_num_batched_tokens", "kv_cache_dtype")
"""The grid's flags, in the order of a config's :func:`key`."""


def key(flags: Mapping[str, FlagValue]) -> tuple[Any, ...]:
    return (
        float(flags["gpu_memory_utilization"]),
        int(flags["max_num_seqs"]),
        int(flags["max_num_batched_tokens"]),
        str(flags["kv_cache_dtype"]),
    )


@dataclass(frozen=True)
class Measured:
    cause: Cause | None
    value: float
    """Output tok/s at the SLO operating point: the passing rate times the mean reply length (0.0: none)."""
    summary: str
    capacity: Mapping[str, float] | None = None
    curve: Mapping[str, Any] | None = None
    """The simulated rates and their p95 TTFT and TPOT, as a trial records them (``TrialRecord.curve``)."""
    rate: float | None = None
    """The passing rate (requests per second)."""


def unit_arrivals(count: int, seed: int = LOAD_SEED) -> tuple[float, ...]:
    """Poisson arrival times at 1 request per second, the same for every config (one draw per ``seed``)."""
    rng = random.Random(seed)
    return tuple(itertools.accumulate(rng.expovariate(1.0) for _ in range(count)))


def at_rate(workload: Sequence[WorkloadRequest], unit: Sequence[float], rate: float) -> list[WorkloadRequest]:
    """``workload`` arriving at ``rate`` requests per second: the unit arrivals scaled (common random
    numbers: every config and rate sees the same draws)."""
    return [replace(w, arrival=t / rate) for w, t in zip(workload, unit, strict=True)]


def evaluate(
    scenario: Scenario,
    flags: Mapping[str, FlagValue],
    workload: list[WorkloadRequest],
    load_seed: int = LOAD_SEED,
    fewest: int = REQUESTS,
    start_rate: float | None = None,
    *,
    truth: Truth | None = None,
) -> Measured:
    """Launch ``flags`` on the simulator and find its SLO throughput (the module's docstring says how), on
    the draw of arrivals ``load_seed`` gives, each run at a rate sending at least ``fewest`` requests; with
    ``start_rate`` (requests per second) the rungs are scaled so that the first is at that rate. The
    simulated GPU runs on ``truth`` (``None``: the library's own model)."""
    arch, gpu = MODELS[scenario.model], GPUS[scenario.gpu]
    physics = None if truth is None else truth.physics()
    seed = zlib.crc32(repr(key(flags)).encode())
    serve = ServeFlags(
        model=scenario.model,
        hardware=gpu,
        max_model_len=scenario.max_model_len,
        **flags,  # type: ignore[arg-type]
    )
    plan = plan_startup(serve, arch, random.Random(seed), physics=physics)
    if not plan.ok:
        assert plan.failure is not None
        return Measured(Cause(plan.failure.value), 0.0, plan.error[:160])
    assert plan.memory is not None
    capacity = {
        "kv_tokens": float(plan.memory.kv_tokens),
        "available_kv_cache_gib": round(plan.memory.kv_cache_bytes / GIB, 3),
    }
    burst = simulate(serve, gpu, arch, workload[:REQUESTS], rate=math.inf, seed=seed, physics=physics)
    saturation = burst.request_throughput
    unit = unit_arrivals(len(workload), load_seed)
    points: list[list[float]] = []
    curve = {"terms": ["ttft:p95", "tpot:p95"], "points": points}  # filled as the runs go

    def run(fraction: float) -> bool:
        """Whether the SLOs hold in the steady state at ``fraction`` of the saturation rate (recorded on
        the curve)."""
        rate = fraction * saturation
        count = min(len(workload), max(fewest, math.ceil(rate * SPAN_S)))
        while True:
            arrivals = at_rate(workload[:count], unit[:count], rate)
            result = simulate(serve, gpu, arch, arrivals, seed=seed, physics=physics)
            if result.failed or not result.requests:
                return False
            span = unit[count - 1] / rate
            life = statistics.median(r.e2el for r in result.requests)
            whole_met = (
                result.stat("ttft", 95) <= scenario.ttft_s and result.stat("tpot", 95) <= scenario.tpot_s
            )
            if life <= span / 4 or count == len(workload) or not whole_met:
                break
            count = min(len(workload), math.ceil(count * 4.5 * life / span))  # too short for its lifetimes
        judged = [r for r in result.requests if span / 4 <= r.arrival <= 3 * span / 4]
        ttft = percentile([r.ttft for r in judged], 95)
        tpot = percentile([r.tpot for r in judged if r.output_len > 1], 95)
        points.append([round(rate, 6), round(ttft, 6), round(tpot, 6)])
        return life <= span / 4 and ttft <= scenario.ttft_s and tpot <= scenario.tpot_s

    scale = 1.0 if start_rate is None else start_rate / (RATE_FRACTIONS[0] * saturation)
    failing: float | None = None
    for fraction in (f * scale for f in RATE_FRACTIONS):
        if run(fraction):
            break
        failing = fraction
    else:
        return Measured(Cause.SLO_UNREACHABLE, 0.0, "no rate met the SLOs", capacity, curve)
    if failing is None:  # met at the ladder's top: Poisson arrivals may sustain more than a burst
        for above in (a * scale for a in ABOVE_CAPACITY):
            if not run(above):
                failing = above
                break
            fraction = above
    # Bisect the bracket down to the grain (none left when even the highest rung met the SLOs).
    while failing is not None and failing / fraction > 1.0 + RATE_GRAIN:
        middle = math.sqrt(fraction * failing)
        if run(middle):
            fraction = middle
        else:
            failing = middle
    summary = f"SLOs met at {fraction:.1%} of capacity" + (", the ladder's top" if failing is None else "")
    rate = fraction * saturation
    mean_output = statistics.fmean(w.output_len for w in workload)
    return Measured(None, rate * mean_output, summary, capacity, curve, rate)


def crashes_under_load(scenario: Scenario, flags: Mapping[str, FlagValue]) -> str | None:
    """Why ``flags`` crashes under load on the scenario's truth, or None: a full batch needs
    ``runtime_gib`` (per 1,024 batched tokens, per 100 sequences) beyond vLLM's profile, and it must fit
    in the memory past the budget, less the post-profile reserve (the start's own, without its random
    slack: a config that starts has that slack to spare)."""
    per_ktoken, per_100_seqs = scenario.truth.runtime_gib
    need = (
        per_ktoken * int(flags["max_num_batched_tokens"]) / 1024
        + per_100_seqs * int(flags["max_num_seqs"]) / 100
    ) * GIB
    device = GPUS[scenario.gpu].memory_bytes
    spare = (
        device * (1.0 - float(flags["gpu_memory_utilization"]))
        - sim_startup.HIDDEN_RESERVE_BYTES
        - scenario.truth.extra_reserve_gib * GIB
    )
    if need <= 0 or need <= spare:
        return None
    return (
        f"torch.OutOfMemoryError under load: a full batch needs {need / GIB:.2f} GiB past the profile, "
        f"{max(0.0, spare) / GIB:.2f} GiB free past the budget"
    )


def with_crashes(
    scenario: Scenario, table: Mapping[tuple[Any, ...], Measured]
) -> dict[tuple[Any, ...], Measured]:
    """``table`` with every config that started and crashes under load on the scenario's truth
    (:func:`crashes_under_load`) recorded as a crash: no figure, its KV capacity (it started), no probe
    (it died at the saturation run, the first and largest batch). Applied after the table is measured (or
    read from the cache): the crash is the truth's, not the simulator's."""
    out = dict(table)
    for k, measured in table.items():
        why = crashes_under_load(scenario, dict(zip(FLAG_NAMES, k, strict=True)))
        if why is not None and measured.cause not in FAILED_TO_START:
            curve = {"terms": ["ttft:p95", "tpot:p95"], "points": []}
            out[k] = Measured(Cause.CRASHED_UNDER_LOAD, 0.0, why, measured.capacity, curve)
    return out


@functools.cache
def source_of(*functions: Callable[..., Any]) -> bytes:
    """The source of ``functions``, read once per process: what is measured is the code that was
    imported, even if the file changes on disk while a run goes (``inspect.getsource`` reads the disk)."""
    return b"".join(inspect.getsource(function).encode() for function in functions)


@functools.cache
def simulator_source() -> bytes:
    """The simulator's and the memory model's code, read once per process: each module as ``ast`` reads
    it back without its imports and comments, so a module that moves (its imports renamed) or a comment
    that changes keeps the cache's tables."""
    package = REPO / "autotune"
    sources = [*sorted((package / "sim").glob("*.py")), package / "hardware" / "memory.py"]
    return b"".join(_code(source) for source in sources)


def _code(source: Path) -> bytes:
    tree = ast.parse(source.read_text())
    tree.body = [node for node in tree.body if not isinstance(node, ast.Import | ast.ImportFrom)]
    return ast.unparse(tree).encode()


def cache_name(
    scenario: Scenario, truth: Truth | None, workload: list[WorkloadRequest], of: Grid = FULL
) -> str:
    """What a table measured on ``truth`` depends on, hashed: the scenario, the truth, the workload, the
    simulator's source and the way this script measures (its constants and functions)."""
    measure = (
        RATE_FRACTIONS,
        ABOVE_CAPACITY,
        RATE_GRAIN,
        REQUESTS,
        SPAN_S,
        MAX_REQUESTS,
        LOAD_SEED,
        of.utils,
        of.seqs,
        of.batched,
        of.kv_dtypes,
    )
    digest = hashlib.sha256(repr((scenario, truth, workload, measure)).encode())
    digest.update(source_of(evaluate, unit_arrivals, at_rate, Truth.physics))  # how this script measures
    digest.update(simulator_source())
    return digest.hexdigest()[:16]


class _CacheUnpickler(pickle.Unpickler):
    """Reads this script's classes by their names here, whether the cache was written with the script run
    (module ``__main__``) or imported (``benchmarks/fluid_accuracy.py`` reads the grids)."""

    def find_class(self, module: str, name: str) -> Any:
        return super().find_class(__name__ if module == "__main__" else module, name)


def read_cache(path: Path | None) -> dict[tuple[Any, ...], Measured]:
    """What ``path`` holds (nothing without a path or a file)."""
    if path is None or not path.exists():
        return {}
    with path.open("rb") as file:
        loaded: dict[tuple[Any, ...], Measured] = _CacheUnpickler(file).load()
    return loaded


def write_cache(path: Path | None, measured: Mapping[tuple[Any, ...], Measured]) -> None:
    """Store ``measured`` at ``path`` whole or not at all (renamed into place: a run reading it beside
    another that writes it never sees half a file)."""
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
        partial.write_bytes(pickle.dumps(dict(measured)))
        partial.replace(path)


def cached_table(
    scenario: Scenario,
    truth: Truth | None,
    workload: list[WorkloadRequest],
    cache: Path | None,
    of: Grid = FULL,
) -> dict[tuple[Any, ...], Measured]:
    """The scenario's table (every config of ``of`` measured on ``truth``), from ``cache`` when it holds
    one of the same :func:`cache_name` (else measured and stored there)."""
    path = None if cache is None else cache / f"search-{cache_name(scenario, truth, workload, of)}.pickle"
    table = read_cache(path)
    if not table:
        table = {key(flags): evaluate(scenario, flags, workload, truth=truth) for flags in grid(of)}
        write_cache(path, table)
    return table


def long_runs(
    scenario: Scenario,
    truth: Truth | None,
    workload: list[WorkloadRequest],
    table: Mapping[tuple[Any, ...], Measured],
    configs: Iterable[tuple[Any, ...]],
    cache: Path | None,
) -> dict[tuple[Any, ...], Measured]:
    """``configs`` measured again as the table measured them but with runs of at least
    :data:`LONG_REQUESTS` requests, the rungs starting at the table's passing rate (a config that did not
    pass keeps the table's entry); from ``cache`` where measured before (with :func:`cache_name`'s
    inputs and this function unchanged), what is new stored there."""
    digest = hashlib.sha256(cache_name(scenario, truth, workload).encode())
    digest.update(repr(LONG_REQUESTS).encode() + source_of(long_runs))
    path = None if cache is None else cache / f"long-{digest.hexdigest()[:16]}.pickle"
    known = read_cache(path)
    missing = [k for k in dict.fromkeys(configs) if k not in known]
    for done, k in enumerate(missing, start=1):
        short = table[k]
        flags = dict(zip(FLAG_NAMES, k, strict=True))
        known[k] = (
            short
            if short.rate is None
            else evaluate(scenario, flags, workload, fewest=LONG_REQUESTS, start_rate=short.rate, truth=truth)
        )
        if done % 10 == 0 or done == len(missing):  # kept if interrupted
            write_cache(path, known)
    return known


def across_draws(
    scenario: Scenario,
    truth: Truth | None,
    flags: Mapping[str, FlagValue],
    workload: list[WorkloadRequest],
    draws: int,
    fewest: int = REQUESTS,
) -> list[float]:
    """``flags``'s figure on ``draws`` draws of the arrivals (:data:`LOAD_SEED` and the seeds after it),
    each run at a rate sending at least ``fewest`` requests: how far one grid's figure, measured on the
    first draw, is from what another draw would give."""
    return [
        evaluate(scenario, flags, workload, LOAD_SEED + draw, fewest, truth=truth).value
        for draw in range(draws)
    ]


def _step_below(k: tuple[Any, ...]) -> tuple[Any, ...]:
    """The config ``k`` one utilization step lower (the grid's step), everything else equal."""
    return (round(k[0] - 0.02, 2), *k[1:])


def grid(of: Grid = FULL) -> Iterator[dict[str, FlagValue]]:
    """Every config of ``of``."""
    for util, seqs, batched, kv in itertools.product(of.utils, of.seqs, of.batched, of.kv_dtypes):
        if batched >= seqs:
            yield dict(zip(FLAG_NAMES, (util, seqs, batched, kv), strict=True))


# ----------------------------------------------------------------------------------------------
# Searchers
# ----------------------------------------------------------------------------------------------


class TableTrials:
    """The study's trials launched from the scenario's table (trial.py's semantics for outcomes)."""

    def __init__(
        self,
        loaded: LoadedStudy,
        study: optuna.Study,
        table: Mapping[tuple[Any, ...], Measured],
        checks: bool,
        scenario: Scenario,
    ) -> None:
        self.space = loaded.search_space
        self.table = table
        fixed = {"max_model_len": scenario.max_model_len}
        model = MemoryModel(MODELS[scenario.model], GPUS[scenario.gpu], fixed) if checks else None
        self.memory = model
        self.prelaunch = PreLaunchCheck(model, lambda: study.get_trials(deepcopy=False)) if checks else None

    def screen(self, flags: Mapping[str, FlagValue]) -> Decision:
        violations = self.space.violations(flags)
        if violations:
            shown = tuple(str(v) for v in violations)
            attrs = TrialRecord(launched=False, violations=shown).to_attrs()
            return Decision(TrialOutcome(Cause.INVALID_CONFIG, "rejected: " + shown[0], attrs=attrs))
        return self.prelaunch(flags) if self.prelaunch is not None else Decision(None)

    def launch(
        self,
        number: int,
        flags: Mapping[str, FlagValue],
        decision: Decision,
        phase: Callable[[str], None],
        *,
        baseline: bool = False,
    ) -> TrialOutcome:
        del number, phase, baseline
        measured = self.table[key(flags)]
        estimate = None
        if measured.rate is not None:
            estimate = {"rate": measured.rate, "slo_throughput": measured.value}
        attrs = TrialRecord(
            launched=True,
            flags=dict(flags),
            capacity=measured.capacity,
            curve=measured.curve,
            estimate=estimate,
        ).to_attrs()
        if decision.prediction is not None:
            attrs["memory_prediction"] = dict(decision.prediction)
        if measured.cause is None:
            return TrialOutcome(None, measured.summary, values=(measured.value, 0.0), attrs=attrs)
        return TrialOutcome(measured.cause, measured.summary, attrs=attrs)

    def confirm(
        self,
        number: int,
        flags: Mapping[str, FlagValue],
        phase: Callable[[str], None],
        **_: object,
    ) -> TrialOutcome:
        """The table is the truth: measured again, a config gives the same figures."""
        return self.launch(number, flags, Decision(None), phase)


@dataclass(frozen=True)
class Run:
    """One searcher's study: its launches in order and what its pre-launch check refused."""

    launches: list[Measured]
    configs: tuple[tuple[Any, ...] | None, ...] = ()
    """Each launch's config (``None``: refused by vLLM before it could be one of the grid's)."""
    rejects: int = 0
    """Configs refused as predicted infeasible (memory model or crash boundary)."""
    wrong_rejects: tuple[int, ...] = ()
    """For each refused config that starts in truth: how many launches were done when it was refused."""


def run_study_searcher(
    scenario: Scenario,
    table: Mapping[tuple[Any, ...], Measured],
    searcher: str,
    seed: int,
    launches: int,
    of: Grid = FULL,
) -> Run:
    """The launches of one study, in order, and its wrong rejects."""
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        (base / "space.yaml").write_text(yaml.safe_dump(space_yaml(scenario, of)))
        low_in, high_in = scenario.input_len
        low_out, high_out = scenario.output_len
        spec = {
            "study": {"name": "search", "workdir": str(base)},
            "server": {
                "command": ["sim"],
                "model": scenario.model,
                "args": {"max-model-len": scenario.max_model_len},
            },
            "search_space": "space.yaml",
            "workload": {  # the lengths the table's runs send (the surrogate reads them from here)
                "dataset": {
                    "kind": "synthetic",
                    "input_len": {"dist": "uniform", "low": low_in, "high": high_in},
                    "output_len": {"dist": "uniform", "low": low_out, "high": high_out},
                },
            },
            "slo": {"terms": [f"ttft:p95<={scenario.ttft_s}s", f"tpot:p95<={scenario.tpot_s}s"]},
            "objectives": [
                {"metric": "slo_throughput", "direction": "maximize"},
                {"metric": "ttft:p95", "direction": "minimize"},
            ],
            "budget": {"launches": launches},
            "finalists": {"count": 0},  # measured again from the same table: nothing to learn
            "sampler": {
                "name": "random" if searcher == "random" else "tpe",
                "seed": seed,
                "surrogate": searcher == "surrogate",
            },
        }
        (base / "spec.yaml").write_text(yaml.safe_dump(spec))
        loaded = load_study(base / "spec.yaml")
        study = open_study(loaded, create=True, heartbeat=False)
        if searcher == "tpe":
            study.sampler = optuna.samplers.TPESampler(seed=seed)
        elif searcher == "random":
            study.sampler = optuna.samplers.RandomSampler(seed=seed)
        checks = searcher in ("autotune", "surrogate")
        trials = TableTrials(loaded, study, table, checks, scenario)
        proposer = proposer_for(loaded, trials.memory)
        StudyRunner(
            loaded, study, trials, on_event=lambda _: None, on_stale=lambda _: None, proposer=proposer
        ).run()
        done = sorted(study.get_trials(deepcopy=False), key=lambda t: t.number)
        runs: list[Measured] = []
        configs: list[tuple[Any, ...]] = []
        rejects, wrong = 0, []
        for t in done:
            record = TrialRecord.from_trial(t)
            if is_launch(t):
                configs.append(key(record.flags))
                runs.append(table[configs[-1]])
            elif record.cause is Cause.PREDICTED_INFEASIBLE:
                rejects += 1
                if table[key(record.flags)].cause not in FAILED:
                    wrong.append(len(runs))
        return Run(runs, tuple(configs), rejects, tuple(wrong))


def run_auto_tune(table: Mapping[tuple[Any, ...], Measured], launches: int, of: Grid = FULL) -> Run:
    """vLLM's auto_tune.sh order (see the module docstring)."""
    tried: list[tuple[Any, ...] | None] = []
    chosen = None
    for util in sorted(of.utils, reverse=True):
        if util < 0.9 or len(tried) >= launches:
            break
        largest = (util, of.seqs[-1], of.batched[-1], "auto")
        tried.append(largest)
        if table[largest].cause not in FAILED:
            chosen = util
            break
    if chosen is not None:
        for seqs, batched in itertools.product(of.seqs, of.batched):
            # vLLM refuses max_num_batched_tokens < max_num_seqs at start: not one of the grid's configs
            tried.append((chosen, seqs, batched, "auto") if batched >= seqs else None)
    tried = tried[:launches]
    refused = Measured(Cause.INVALID_CONFIG, 0.0, "max_num_batched_tokens < max_num_seqs")
    return Run([refused if k is None else table[k] for k in tried], tuple(tried))


# ----------------------------------------------------------------------------------------------
# Figures
# ----------------------------------------------------------------------------------------------


def figures(run: Run, optimum: float, launches: int) -> dict[str, float | None]:
    runs = run.launches
    best = 0.0
    to95 = to98 = None
    at: dict[int, float] = {}
    for i, m in enumerate(runs, start=1):
        best = max(best, m.value)
        if to95 is None and best >= 0.95 * optimum:
            to95 = i
        if to98 is None and best >= 0.98 * optimum:
            to98 = i
        at[i] = best
    late = runs[10:]
    failed = sum(1 for m in late if m.cause in FAILED)
    last = at.get(len(runs), 0.0)
    return {
        "to95": to95,
        "to98": to98,
        "best15": at.get(15, last) / optimum,
        "best30": at.get(launches, last) / optimum,
        "failed_late": failed / len(late) if late else 0.0,
        "failed_late_n": failed,
        "late_n": len(late),
        "rejects": run.rejects,
        "wrong": len(run.wrong_rejects),
        "wrong_after5": sum(1 for done in run.wrong_rejects if done >= 5),
    }


def picks(run: Run) -> list[tuple[Any, ...] | None]:
    """After each launch, the config the study would pick: the best by the table so far (``None`` while
    no launch has met the SLOs)."""
    chosen: list[tuple[Any, ...] | None] = []
    best, current = 0.0, None
    for config, measured in zip(run.configs, run.launches, strict=True):
        if measured.value > best:  # a tie keeps the first
            best, current = measured.value, config
        chosen.append(current)
    return chosen


def long_figures(
    run: Run, long: Mapping[tuple[Any, ...], Measured], reference: float, launches: int
) -> dict[str, float | None]:
    """The picks of :func:`picks` scored on the long runs, as shares of ``reference``: launches until the
    pick is within 5 % and 2 % of it, the first launch of a config within 2 % of it whether picked or not
    (of the launches measured on long runs: a lower bound on what the search found), and the pick after
    8, 20 and ``launches`` launches."""
    scores = [0.0 if k is None else long[k].value / reference for k in picks(run)]
    last = scores[-1] if scores else 0.0
    launched = [long[k].value / reference if k is not None and k in long else 0.0 for k in run.configs]
    return {
        "to95": next((i for i, v in enumerate(scores, start=1) if v >= 0.95), None),
        "to98": next((i for i, v in enumerate(scores, start=1) if v >= 0.98), None),
        "found98": next((i for i, v in enumerate(launched, start=1) if v >= 0.98), None),
        "at8": scores[7] if len(scores) >= 8 else last,
        "at20": scores[19] if len(scores) >= 20 else last,
        "at30": scores[launches - 1] if len(scores) >= launches else last,
    }


def _spread(values: Sequence[float | None], fmt: Callable[[float], str]) -> str:
    got = [v for v in values if v is not None]
    missing = len(values) - len(got)
    if not got:
        return "never"
    text = f"{fmt(statistics.median(got))} ({fmt(min(got))}–{fmt(max(got))})"
    return text + (f", {missing} never" if missing else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--launches", type=int, default=30)
    parser.add_argument("--only", help="run only scenarios whose name contains this")
    parser.add_argument("--searchers", default="surrogate,autotune,tpe,random,auto_tune")
    parser.add_argument(
        "--truth",
        choices=("perturbed", "model"),
        default="perturbed",
        help="simulate the grid on each scenario's hidden truth (default) or on the library's own model",
    )
    parser.add_argument(
        "--draws",
        type=int,
        default=1,
        help="measure the optimum's config, vLLM's defaults and the best config below 95 %% of the optimum "
        "on this many draws of the arrivals and print how far apart their figures lie (1: not)",
    )
    parser.add_argument(
        "--cache",
        help="a folder for each scenario's measured grid (reused while the scenario, its truth and the "
        "simulator's source are unchanged)",
    )
    parser.add_argument(
        "--top",
        type=int,
        default=TOP,
        help="measure the table's best N configs, vLLM's defaults and every searcher's picks again on long "
        "runs and print a second table scored on them (0: not)",
    )
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_HELP}: 8 configs, 1 seed, 6 launches")
    args = parser.parse_args()
    of = FULL
    if args.quick:
        of, args.only, args.seeds, args.launches, args.top = QUICK, SCENARIOS[0].name, 1, 6, 0
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    searchers = args.searchers.split(",")
    print(
        "| scenario | searcher | launches to 95 % | launches to 98 % | best @15 | best @30 "
        "| failed launches from #11 | seeds at 95 % by 15 / 98 % by 30 "
        "| wrong rejects: all / after launch 5 (of rejects) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    long_rows: list[str] = []
    for scenario in SCENARIOS:
        if args.only and args.only not in scenario.name:
            continue
        started = time.perf_counter()
        workload = synthetic_workload(
            QUICK_REQUESTS if args.quick else MAX_REQUESTS,
            input_len=scenario.input_len,
            output_len=scenario.output_len,
            seed=0,
        )
        truth = scenario.truth if args.truth == "perturbed" else None
        table = cached_table(scenario, truth, workload, Path(args.cache) if args.cache else None, of)
        if truth is not None:
            table = with_crashes(scenario, table)
        optimum = max(m.value for m in table.values())
        default = table[key(scenario.defaults)]
        failing = sum(1 for m in table.values() if m.cause in FAILED_TO_START)
        crashing = [k for k, m in table.items() if m.cause is Cause.CRASHED_UNDER_LOAD]
        # "Near the top": a crash one utilization step above a config within 5 % of the optimum.
        near = {k for k, m in table.items() if m.value >= 0.95 * optimum}
        beside = sum(1 for k in crashing if any(_step_below(k) == n for n in near))
        # The memory model as the study first sees it (no launches yet): what it refuses that starts.
        fixed = {"max_model_len": scenario.max_model_len}
        prior = MemoryModel(MODELS[scenario.model], GPUS[scenario.gpu], fixed)
        refused = [key(flags) for flags in grid(of) if not prior.predict(flags).feasible]
        refused_start = sum(1 for k in refused if table[k].cause not in FAILED_TO_START)
        near5, near2 = (
            sum(1 for m in table.values() if m.value >= share * optimum) for share in (0.95, 0.98)
        )
        edge = max(of.utils)
        at_edge = [m for k, m in table.items() if k[0] == edge]
        edge_starts = sum(1 for m in at_edge if m.cause not in FAILED_TO_START)
        print(
            f"<!-- {scenario.name} truth ({args.truth}): "
            f"{truth.describe() if truth else 'the memory and cost models themselves'} -->"
        )
        print(
            f"<!-- {scenario.name}: {len(table)} configs in {time.perf_counter() - started:.0f} s, optimum "
            f"{optimum:.0f} tok/s, vLLM defaults {default.value:.0f} ({default.cause or 'ok'}), "
            f"{failing} fail to start; the uncalibrated memory model refuses {len(refused)}, "
            f"{refused_start} of which start; {near5} configs within 5 % of the optimum, {near2} "
            f"within 2 %; at utilization {edge}, {edge_starts} of {len(at_edge)} start; {len(crashing)} "
            f"start and crash under load, {beside} of them one utilization step above a config within 5 % "
            f"of the optimum -->",
            flush=True,
        )
        if args.draws > 1:
            ranked = sorted(table, key=lambda k: -table[k].value)
            picks = {"optimum": ranked[0], "vLLM defaults": key(scenario.defaults)}
            below = [k for k in ranked if table[k].value < 0.95 * optimum]
            if below:
                picks["below 95 %"] = below[0]
            for label, k in picks.items():
                flags = dict(zip(FLAG_NAMES, k, strict=True))
                values = across_draws(scenario, truth, flags, workload, args.draws)
                spread = (
                    (max(values) - min(values)) / statistics.fmean(values) if min(values) > 0 else math.inf
                )
                print(
                    f"<!-- {scenario.name}: {label} {k} over {args.draws} draws of the arrivals: "
                    f"{', '.join(f'{v:.0f}' for v in values)} tok/s, spread {spread:.1%} of their mean -->",
                    flush=True,
                )
        by_searcher: dict[str, list[Run]] = {}
        for searcher in searchers:
            if not searcher:
                continue
            if searcher == "auto_tune":
                runs = [run_auto_tune(table, args.launches, of)]  # deterministic: one run
            else:
                runs = [
                    run_study_searcher(scenario, table, searcher, seed, args.launches, of)
                    for seed in range(args.seeds)
                ]
            by_searcher[searcher] = runs
            got = [figures(r, optimum, args.launches) for r in runs]
            ok95 = sum(1 for g in got if g["to95"] is not None and g["to95"] <= 15)
            ok98 = sum(1 for g in got if g["to98"] is not None and g["to98"] <= args.launches)
            failed = sum(int(g["failed_late_n"] or 0) for g in got)
            late = sum(int(g["late_n"] or 0) for g in got)
            wrong = sum(int(g["wrong"] or 0) for g in got)
            wrong5 = sum(int(g["wrong_after5"] or 0) for g in got)
            rejects = sum(int(g["rejects"] or 0) for g in got)
            print(
                f"| {scenario.name} | {searcher} | {_spread([g['to95'] for g in got], lambda v: f'{v:.0f}')} "
                f"| {_spread([g['to98'] for g in got], lambda v: f'{v:.0f}')} "
                f"| {_spread([g['best15'] for g in got], lambda v: f'{v:.1%}')} "
                f"| {_spread([g['best30'] for g in got], lambda v: f'{v:.1%}')} "
                f"| {failed}/{late} ({failed / late if late else 0.0:.1%}) "
                f"| {ok95}/{len(got)}, {ok98}/{len(got)} "
                f"| {wrong} / {wrong5} (of {rejects}) |",
                flush=True,
            )
        if args.top:
            cache = Path(args.cache) if args.cache else None
            rows = on_long_runs(
                scenario, truth, workload, table, by_searcher, args.top, args.launches, cache, args.draws
            )
            long_rows.extend(rows)
    if long_rows:
        print(
            "\n| scenario | searcher | launches to 95 % | launches to 98 % | a launch within 2 % | pick @8 "
            "| pick @20 | pick @30 | seeds at 95 % @8 / 98 % @20 |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        print("\n".join(long_rows))


def on_long_runs(
    scenario: Scenario,
    truth: Truth | None,
    workload: list[WorkloadRequest],
    table: Mapping[tuple[Any, ...], Measured],
    by_searcher: Mapping[str, list[Run]],
    top: int,
    launches: int,
    cache: Path | None,
    draws: int,
) -> list[str]:
    """Configs measured again on long runs (:func:`long_runs`): the table's ``top``, :data:`SAMPLE` drawn
    from the rest of it, vLLM's defaults and every config a searcher would have picked after some launch.
    The best of them on long runs is the reference. Printed: where those configs stand on long runs, and
    a row per searcher (its picks scored against the reference). With ``draws`` over 1, the reference's
    config, the table's best and vLLM's defaults are measured on long runs on that many draws of the
    arrivals, and how far their shares of the reference move between draws is printed."""
    started = time.perf_counter()
    ranked = sorted(table, key=lambda k: -table[k].value)
    rest = [k for k in ranked[top:] if table[k].value > 0]
    sample = random.Random(LOAD_SEED).sample(rest, min(SAMPLE, len(rest)))
    chosen = {k for runs in by_searcher.values() for run in runs for k in picks(run) if k is not None}
    default = key(scenario.defaults)
    wanted = [*ranked[:top], *sample, default, *sorted(chosen)]
    long = long_runs(scenario, truth, workload, table, wanted, cache)
    best = max(dict.fromkeys(wanted), key=lambda k: long[k].value)
    reference = long[best].value

    def share(configs: Iterable[tuple[Any, ...]]) -> str:
        values = [long[k].value / reference for k in configs]
        return f"{min(values):.1%}-{max(values):.1%}" if values else "none"

    print(
        f"<!-- {scenario.name} on long runs (at least {LONG_REQUESTS} requests a rate): "
        f"{len(set(wanted))} configs ({time.perf_counter() - started:.0f} s); the best {best}, "
        f"{reference:.0f} tok/s (the table's #{ranked.index(best) + 1} of {len(ranked)}, "
        f"{table[best].value:.0f} there); of the best: the table's best {share(ranked[:1])}, its top {top} "
        f"{share(ranked[:top])}, {len(sample)} of the rest {share(sample)}, the searchers' picks "
        f"{share(chosen)}, vLLM's defaults {share([default])} -->",
        flush=True,
    )
    if draws > 1:
        flags = {k: dict(zip(FLAG_NAMES, k, strict=True)) for k in (best, ranked[0], default)}
        values = {
            k: across_draws(scenario, truth, f, workload, draws, LONG_REQUESTS) for k, f in flags.items()
        }
        ratios = {k: [v / r for v, r in zip(values[k], values[best], strict=True)] for k in flags}
        for k, label in (
            (best, "the reference"),
            (ranked[0], "the table's best"),
            (default, "vLLM's defaults"),
        ):
            print(
                f"<!-- {scenario.name}: {label} {k} on long runs over {draws} draws of the arrivals: "
                f"{', '.join(f'{v:.0f}' for v in values[k])} tok/s; of the reference's config on the same "
                f"draw {min(ratios[k]):.1%}-{max(ratios[k]):.1%} -->",
                flush=True,
            )
    rows = []
    for searcher, runs in by_searcher.items():
        got = [long_figures(r, long, reference, launches) for r in runs]
        ok95 = sum(1 for g in got if (g["at8"] or 0.0) >= 0.95)  # the pick then, not the first time there
        ok98 = sum(1 for g in got if (g["at20"] or 0.0) >= 0.98)
        counts = ("to95", "to98", "found98")
        cells = [_spread([g[name] for g in got], lambda v: f"{v:.0f}") for name in counts]
        cells += [_spread([g[name] for g in got], lambda v: f"{v:.1%}") for name in ("at8", "at20", "at30")]
        rows.append(
            f"| {scenario.name} | {searcher} | {' | '.join(cells)} | {ok95}/{len(got)}, {ok98}/{len(got)} |"
        )
    return rows


if __name__ == "__main__":
    main()
