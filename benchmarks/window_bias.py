"""How far a short window's tail percentile reads from the long run's, for one config of
``benchmarks/precision.py``.

On the in-process simulator (virtual time), the config serves long Poisson runs at a few fixed rates, on
several workload seeds. For each rate and SLO term it reports the term's statistic (``tpot:p95`` …) over
the steady state of the whole run (requests sent between 10 % and 90 % of the arrival span), and the
median of the same statistic over consecutive windows of ``--window`` seconds of that steady state (what
one probe judging that long a window sees, typically). Each gives an SLO boundary, the rate where the
first term reaches its limit (log-log interpolation between the rates around it, per seed), reported as
output tok/s: the long run's is the config's true SLO-constrained throughput; the windows' one is what
short probes converge to. Their ratio is the bias a window of that length brings, whatever the search.

Run: ``python -m benchmarks.window_bias [--scenario demo] [--config defaults] [--rates 16,16.5,...]
[--duration 1800] [--window 20] [--window 200] [--seeds 4]`` (a few seconds per run of 1,800 s).
"""

from __future__ import annotations

import argparse
import math
import statistics
from pathlib import Path

from autotune.hardware.catalog import load_model_arch
from autotune.inputs.slo_terms import SloTerm
from autotune.inputs.spec import SloSection, WorkloadSpec
from autotune.load.crossing import Point, cross, statistic, term_values
from autotune.load.records import RequestRecord
from autotune.load.workload import arrival_times, build_requests
from autotune.predict.dryrun import sim_records
from autotune.sim import WorkloadRequest, simulate
from autotune.sim.flags import parse_flags
from benchmarks import QUICK_HELP
from benchmarks.precision import SCENARIOS

REPO = Path(__file__).resolve().parents[1]

MIN_SAMPLES = 50
"""A window is judged on at least this many requests (fewer: left out)."""


def value(records: list[RequestRecord], term: SloTerm) -> float:
    """The term's statistic over ``records``, as a probe judges it."""
    found = statistic(term_values(records, term), term)
    return found if found is not None else math.nan


def boundary(rates: list[float], values: list[float], term: SloTerm) -> float:
    """Where ``term`` reaches its limit over ``values`` (one per rate), as the search places a crossing
    (:func:`autotune.load.crossing.cross`); inf when it never does."""
    found = cross([Point(r, v) for r, v in zip(rates, values, strict=True)], term)
    assert found is not None
    if found.kind == "below":
        raise SystemExit(f"window_bias: {term} over its limit already at {rates[0]:g} req/s: start lower")
    return found.rate if found.kind == "crossed" else math.inf


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", default="demo")
    parser.add_argument("--config", default="defaults")
    parser.add_argument("--rates", default="16,16.5,17,17.5,18,18.5,19", help="requests/s, comma-separated")
    parser.add_argument("--duration", type=float, default=1800.0, help="seconds of arrivals per run")
    parser.add_argument("--window", type=float, action="append", help="window seconds (repeatable; 20)")
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help=QUICK_HELP)
    args = parser.parse_args()
    if args.quick:
        args.duration, args.seeds = 300.0, 1
    scenario = next((s for s in SCENARIOS if s.name == args.scenario), None)
    if scenario is None:
        raise SystemExit(f"window_bias: unknown scenario {args.scenario!r}")
    extra = dict(scenario.configs).get(args.config)
    if extra is None:
        raise SystemExit(f"window_bias: unknown config {args.config!r} of {scenario.name}")
    rates = sorted(float(r) for r in args.rates.split(","))
    windows = args.window or [20.0]
    flags = parse_flags([*scenario.argv, *extra])
    arch = load_model_arch(flags.model)
    slo = SloSection(terms=scenario.slo)
    found: dict[str, list[float]] = {"long run": [], **{f"{w:g}-s window": [] for w in windows}}
    for seed in range(1, args.seeds + 1):
        workload = WorkloadSpec.model_validate({**scenario.workload, "seed": 10_000 + seed})
        tokens: list[float] = []
        series: dict[str, list[list[float]]] = {k: [[] for _ in slo.terms] for k in found}
        for rate in rates:
            n = int(rate * args.duration)
            requests = build_requests(workload, n, workload.seed, REPO, prompts=False)
            arrivals = arrival_times(workload.arrival, rate, n, workload.seed)
            sim = simulate(
                flags,
                flags.hardware,
                arch,
                [
                    WorkloadRequest(r.input_len, r.output_len, t)
                    for r, t in zip(requests, arrivals, strict=True)
                ],
            )
            span = max(arrivals)
            sent = [
                (t, r)
                for r, t in zip(sim_records(sim), arrivals, strict=True)
                if 0.1 * span <= t <= 0.9 * span
            ]
            steady = [r for _, r in sent]  # in send order
            groups: dict[float, list[list[RequestRecord]]] = {}
            for w in windows:
                cut: dict[int, list[RequestRecord]] = {}
                for t, r in sent:
                    cut.setdefault(int((t - 0.1 * span) // w), []).append(r)
                groups[w] = [g for g in cut.values() if sum(r.success for r in g) >= MIN_SAMPLES]
            tokens.append(statistics.fmean(r.tokens for r in steady if r.success))
            line = [f"seed {seed} rate {rate:g}"]
            for i, term in enumerate(slo.terms):
                whole = value(steady, term)
                series["long run"][i].append(whole)
                line.append(f"{term.key} {whole * 1e3:.1f} ms")
                for w in windows:
                    each = [value(g, term) for g in groups[w]]
                    median = statistics.median(each) if each else math.nan
                    series[f"{w:g}-s window"][i].append(median)
                    line.append(f"median of {len(each)} {w:g}-s windows {median * 1e3:.1f}")
            print(", ".join(line), flush=True)
        per_request = statistics.fmean(tokens)
        for key, per_term in series.items():
            rate = min(boundary(rates, v, term) for v, term in zip(per_term, slo.terms, strict=True))
            if not math.isfinite(rate):
                raise SystemExit(f"window_bias: no term reached its limit by {rates[-1]:g} req/s: go higher")
            found[key].append(rate * per_request)
    print()
    truth = statistics.fmean(found["long run"])
    for key, figures in found.items():
        shown = ", ".join(f"{f:,.0f}" for f in figures)
        mean = statistics.fmean(figures)
        print(f"{key:14} boundary {mean:8,.1f} tok/s ({shown}): {mean / truth - 1:+.1%}")


if __name__ == "__main__":
    main()
