"""How well the surrogate's closed-form latencies (:mod:`autotune.predict.surrogate.fluid`) match the
simulator's, config by config, near each config's SLO boundary: what its calibration cannot fix.

The calibration fits one factor per SLO term (``docs/surrogate.md``), so a bias common to every config
costs nothing; what ranks configs wrongly is the part of the error that changes from config to config.
For each scenario of ``benchmarks/search.py`` (its model, GPU, workload and SLOs) and a sample of its grid
(max-num-seqs 16-1024 x max-num-batched-tokens 1,024, 2,048 and 8,192 x KV dtype auto/fp8, utilization
0.90), on the simulator's own constants (no hidden truth: the question is the model's structure, not its
constants), each config that starts is run at 0.8, 1.0 and 1.2 times the SLO rate the uncalibrated model
predicts for it (at most 0.97 of its predicted capacity): :data:`REQUESTS` Poisson requests, the same
draw for every config (scaled to each rate), judged on those sent in the middle half of the span, as
``benchmarks/search.py`` judges its runs. Each run's p95 TTFT and p95 TPOT are compared with the model's
at the same rate, over the runs where the simulated value lies within :data:`NEAR` of the term's limit
(where the boundary is decided). Reported per scenario and term: the runs compared, the median of
``ln(simulated / modelled)`` (the bias a factor absorbs), their standard deviation and the largest
deviation from that median (what no factor absorbs).

``--admissions`` prints instead, per scenario, what the model of TPOT's tail rests on, for two configs
at 32 and 64 sequences (2,048 batched tokens, fp8, utilization 0.90) at 0.8 of the smaller one's predicted
SLO rate: over the judged requests of one run, the least-squares line of a request's TPOT against the
prompts whose first token came during its decode (its life after its own first token) per output token
(and its R²), and that count's mean, variance and 95th percentile.

``--rates`` compares instead what the search ranks by, the SLO rate, over the whole grid of
``benchmarks/search.py`` as its cache (``--cache DIR``) holds it for the truth named (``--truth model``: the
simulator's own constants, the default; ``perturbed``: the scenario's hidden truth): for every config that
met the SLOs there, the uncalibrated model's SLO rate (at the KV capacity the config reported) against
the grid's passing rate. A latency's error near a config's boundary moves its SLO rate far less where the
latency climbs steeply with the rate, so this, not the latencies' spread, is what ranks configs wrongly.
Reported per scenario: the configs within 10 % of the grid's optimum, the median and standard deviation of
``ln(grid / modelled)`` over them (the median is a bias the calibration absorbs; over the configs that
met the SLOs at all too), Spearman's rank correlation over them, and where the model's ten best-predicted
configs stand on the grid (the least and the median share of its optimum).

Run: ``python -m benchmarks.fluid_accuracy [--only NAME] [--admissions | --rates --cache DIR [--truth
model|perturbed]]`` (results: benchmarks/RESULTS.md)
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import math
import random
import statistics
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from autotune.flags import FlagValue
from autotune.hardware.catalog import GPUS, MODELS
from autotune.predict.surrogate.fluid import Bound, Engine, Traffic, capacity, latency, slo_rate, state
from autotune.results.htmlreport.importance import spearman
from autotune.sim import simulate, synthetic_workload
from autotune.sim.cost import CostModel
from autotune.sim.flags import ServeFlags
from autotune.sim.model import RequestMetrics, WorkloadRequest, percentile
from autotune.sim.startup import plan_startup
from benchmarks import QUICK_HELP
from benchmarks.search import (
    FLAG_NAMES,
    MAX_REQUESTS,
    SCENARIOS,
    Measured,
    Scenario,
    at_rate,
    cache_name,
    key,
    read_cache,
    unit_arrivals,
)

REPO = Path(__file__).resolve().parents[1]

SEQS = (16, 32, 64, 128, 256, 1024)
BATCHED = (1024, 2048, 8192)
KV_DTYPES = ("auto", "fp8")
UTILIZATION = 0.9
FRACTIONS = (0.8, 1.0, 1.2)
"""Rates run, as fractions of the model's predicted SLO rate."""
REQUESTS = 3000
"""Requests per run: about 1,500 judged, so a p95 is the 75th worst."""
NEAR = (0.5, 1.6)
"""A run is compared on a term when its simulated value lies within these multiples of the limit."""
TERMS = (("ttft", "ttft_s"), ("tpot", "tpot_s"))


@dataclass(frozen=True)
class Setup:
    """A scenario's model, GPU, workload, traffic and SLO terms as the fluid model takes them."""

    scenario: Scenario
    workload: list[WorkloadRequest]
    traffic: Traffic
    bounds: list[Bound]
    unit: tuple[float, ...]

    @classmethod
    def of(cls, scenario: Scenario) -> Setup:
        workload = synthetic_workload(
            MAX_REQUESTS, input_len=scenario.input_len, output_len=scenario.output_len, seed=0
        )
        traffic = Traffic.of([w.prompt_len for w in workload[:600]], [w.output_len for w in workload[:600]])
        bounds = [Bound(metric, 0.95, getattr(scenario, limit)) for metric, limit in TERMS]
        return cls(scenario, workload, traffic, bounds, unit_arrivals(REQUESTS))

    def launch(self, flags: dict[str, FlagValue]) -> tuple[ServeFlags, int, Engine] | None:
        """The simulator's flags, seed and the model's engine for ``flags`` (None: it does not start)."""
        sc = self.scenario
        arch, gpu = MODELS[sc.model], GPUS[sc.gpu]
        serve = ServeFlags(model=sc.model, hardware=gpu, max_model_len=sc.max_model_len, **flags)  # type: ignore[arg-type]
        seed = zlib.crc32(repr(key(flags)).encode())
        plan = plan_startup(serve, arch, random.Random(seed))
        if not plan.ok or plan.memory is None or plan.config is None:
            return None
        cfg = plan.config  # the startup resolved the flags already
        cost = CostModel(
            arch,
            gpu,
            kv_cache_dtype=cfg.kv_cache_dtype,
            dtype=serve.dtype,
            tensor_parallel_size=cfg.tensor_parallel_size,
            block_size=cfg.block_size,
            execution=cfg.execution,
        )
        return serve, seed, Engine(cost, cfg.max_num_seqs, cfg.max_num_batched_tokens, plan.memory.kv_tokens)

    def run(
        self, serve: ServeFlags, seed: int, rate: float
    ) -> tuple[Sequence[RequestMetrics], list[RequestMetrics]] | None:
        """One run at ``rate``: every request, and those sent in the middle half of its span (the judged
        ones); None when the run failed."""
        sc = self.scenario
        workload = at_rate(self.workload[:REQUESTS], self.unit, rate)
        result = simulate(serve, GPUS[sc.gpu], MODELS[sc.model], workload, seed=seed)
        if result.failed or not result.requests:
            return None
        span = self.unit[-1] / rate
        return result.requests, [r for r in result.requests if span / 4 <= r.arrival <= 3 * span / 4]


def grid_flags(seqs: int, batched: int, kv_dtype: str) -> dict[str, FlagValue]:
    return {
        "gpu_memory_utilization": UTILIZATION,
        "max_num_seqs": seqs,
        "max_num_batched_tokens": batched,
        "kv_cache_dtype": kv_dtype,
    }


def runs(
    scenario: Scenario, seqs_sample: tuple[int, ...] = SEQS, batched_sample: tuple[int, ...] = BATCHED
) -> list[tuple[str, float, float, float]]:
    """``(metric, simulated, modelled, limit)`` for every run of the scenario's sample and SLO term."""
    setup = Setup.of(scenario)
    out: list[tuple[str, float, float, float]] = []
    for seqs in seqs_sample:
        for batched in batched_sample:
            for kv_dtype in KV_DTYPES:
                launched = setup.launch(grid_flags(seqs, batched, kv_dtype))
                if launched is None:
                    continue
                serve, seed, engine = launched
                predicted = slo_rate(engine, setup.traffic, setup.bounds)
                if predicted <= 0:
                    continue
                ceiling = 0.97 * capacity(engine, setup.traffic)
                for fraction in FRACTIONS:
                    rate = min(fraction * predicted, ceiling)
                    st = state(engine, setup.traffic, rate)
                    ran = setup.run(serve, seed, rate)
                    if st is None or ran is None:
                        continue
                    judged = ran[1]
                    simulated = {
                        "ttft": percentile([r.ttft for r in judged], 95),
                        "tpot": percentile([r.tpot for r in judged if r.output_len > 1], 95),
                    }
                    for metric, limit in TERMS:
                        out.append(
                            (
                                metric,
                                simulated[metric],
                                latency(st, engine, setup.traffic, metric, 0.95),
                                getattr(scenario, limit),
                            )
                        )
    return out


def admitted(firsts: list[float], r: RequestMetrics) -> int:
    """The prompts whose first token (``firsts``: every request's, sorted) came while ``r`` decoded."""
    return bisect.bisect_right(firsts, r.arrival + r.e2el) - bisect.bisect_right(firsts, r.arrival + r.ttft)


def admissions(scenario: Scenario) -> list[str]:
    """The ``--admissions`` lines of one scenario (the module's docstring says what they hold)."""
    setup = Setup.of(scenario)
    found = [setup.launch(grid_flags(seqs, 2048, "fp8")) for seqs in (32, 64)]
    launched = [f for f in found if f is not None]
    if len(launched) < len(found):
        return [f"{scenario.name}: a config at 32 or 64 sequences does not start"]
    rate = 0.8 * slo_rate(launched[0][2], setup.traffic, setup.bounds)
    lines = []
    for seqs, (serve, seed, _) in zip((32, 64), launched, strict=True):
        ran = setup.run(serve, seed, rate)
        if ran is None:
            lines.append(f"{scenario.name}, {seqs} sequences at {rate:.3g} req/s: the run failed")
            continue
        everyone, judged = ran
        firsts = sorted(r.arrival + r.ttft for r in everyone)
        points = [(admitted(firsts, r), r) for r in judged if r.output_len > 1]
        xs = [n / r.output_len for n, r in points]
        ys = [r.tpot for _, r in points]
        slope, intercept = statistics.linear_regression(xs, ys)
        residual = sum((y - intercept - slope * x) ** 2 for x, y in zip(xs, ys, strict=True))
        r2 = 1.0 - residual / (statistics.pvariance(ys) * len(ys))
        counts = [n for n, _ in points]
        lines.append(
            f"{scenario.name}, {seqs} sequences at {rate:.3g} req/s: TPOT = {intercept * 1e3:.1f} ms + "
            f"{slope * 1e3:.0f} ms x prompts admitted per output token (R2 {r2:.2f}, {len(points)} "
            "requests); "
            f"prompts admitted during a life: mean {statistics.fmean(counts):.1f}, variance "
            f"{statistics.pvariance(counts):.1f}, p95 {percentile(counts, 95):.0f}"
        )
    return lines


TOP_SHARE = 0.9
"""``--rates`` compares the configs within this share of the grid's optimum (where the search decides)."""
MODEL_TOP = 10
"""``--rates`` places the model's best-predicted configs, this many, on the grid."""


def _fmt(correlation: float | None) -> str:
    return "n/a (all alike)" if correlation is None else f"{correlation:.2f}"


def rates(setup: Setup, table: Mapping[tuple[FlagValue, ...], Measured]) -> str:
    """The ``--rates`` row of one scenario (the module's docstring says what it holds)."""
    optimum = max(m.value for m in table.values())
    points = []  # (share of the grid's optimum, grid's rate, model's rate)
    for k, measured in table.items():
        reported = (measured.capacity or {}).get("kv_tokens")
        if measured.rate is None or not reported:
            continue
        launched = setup.launch(dict(zip(FLAG_NAMES, k, strict=True)))
        if launched is None:  # starts on this truth, not on the simulator's own constants
            continue
        engine = dataclasses.replace(launched[2], kv_tokens=int(reported))
        predicted = slo_rate(engine, setup.traffic, setup.bounds)
        if predicted > 0:
            points.append((measured.value / optimum, measured.rate, predicted))
    top = [p for p in points if p[0] >= TOP_SHARE]
    if len(top) < 2:
        return f"| {setup.scenario.name} | {len(top)} of {len(points)} | | | | |"
    errors = [math.log(grid / model) for _, grid, model in top]
    every = [math.log(grid / model) for _, grid, model in points]
    best = sorted(points, key=lambda p: -p[2])[:MODEL_TOP]
    return (
        f"| {setup.scenario.name} | {len(top)} of {len(points)} | {statistics.median(errors):+.3f} "
        f"| {statistics.pstdev(errors):.3f} ({statistics.pstdev(every):.3f}) "
        f"| {_fmt(spearman([p[1] for p in top], [p[2] for p in top]))} "
        f"| {min(p[0] for p in best):.1%}, {statistics.median(p[0] for p in best):.1%} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--only", help="run only scenarios whose name contains this")
    parser.add_argument("--admissions", action="store_true", help="print the TPOT tail's evidence instead")
    parser.add_argument(
        "--rates", action="store_true", help="compare SLO rates with benchmarks/search.py's grids instead"
    )
    parser.add_argument("--cache", help="benchmarks/search.py's cache folder (with --rates)")
    parser.add_argument("--truth", choices=("model", "perturbed"), default="model", help="the grids' truth")
    parser.add_argument("--quick", action="store_true", help=QUICK_HELP)
    args = parser.parse_args()
    if args.rates:
        if not args.cache:
            parser.error("--rates needs --cache DIR (the folder benchmarks/search.py --cache filled)")
        print(
            f"| scenario ({args.truth}) | configs within {1 - TOP_SHARE:.0%} of the optimum, of those met "
            "| median ln(grid / modelled) | sd (over all met) | Spearman | the model's top 10 on the grid: "
            "least, median |"
        )
        print("|---|---|---|---|---|---|")
        for scenario in SCENARIOS:
            if args.only and args.only not in scenario.name:
                continue
            truth = scenario.truth if args.truth == "perturbed" else None
            setup = Setup.of(scenario)
            path = Path(args.cache) / f"search-{cache_name(scenario, truth, setup.workload)}.pickle"
            table = read_cache(path)
            if not table:
                print(
                    f"| {scenario.name} | no grid in {args.cache}: run benchmarks/search.py "
                    f"--searchers '' --top 0 --truth {args.truth} --cache {args.cache} first | | | | |"
                )
                continue
            print(rates(setup, table), flush=True)
        return
    if args.admissions:
        for scenario in SCENARIOS:
            if not args.only or args.only in scenario.name:
                print("\n".join(admissions(scenario)), flush=True)
        return
    print("| scenario | term | runs compared | median ln(simulated / modelled) | sd | largest deviation |")
    print("|---|---|---|---|---|---|")
    for scenario in SCENARIOS[:1] if args.quick else SCENARIOS:
        if args.only and args.only not in scenario.name:
            continue
        measured = runs(scenario, (256,), (2048,)) if args.quick else runs(scenario)
        for metric, _ in TERMS:
            errors = [
                math.log(sim / model)
                for m, sim, model, limit in measured
                if m == metric and NEAR[0] * limit <= sim <= NEAR[1] * limit and model > 0
            ]
            if not errors:
                print(f"| {scenario.name} | p95 {metric.upper()} | 0 | | | |", flush=True)
                continue
            middle = statistics.median(errors)
            print(
                f"| {scenario.name} | p95 {metric.upper()} | {len(errors)} | {middle:+.3f} "
                f"| {statistics.pstdev(errors):.3f} | {max(abs(e - middle) for e in errors):.3f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
