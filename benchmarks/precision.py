"""How precise is one trial's SLO-constrained throughput? Today's estimate against the former bisection.

On the in-process simulator (:func:`autotune.sim.simulate`, virtual time: the same scheduler and cost
model as the simulated server, so every run is exact and repeatable), each config of each scenario is
measured:

* 5 times by the rate search as a study runs it (``autotune.load.ratesearch``, default measurement
  settings, workload seeds 1-5: fresh requests and arrivals each time), through
  :class:`autotune.predict.dryrun.SimProber` (warm-up, judged and drain requests; early stop and clean finish
  replayed every 0.1 s of virtual time, as the client checks them);
* 5 times by the former search (the bisection of autotune before this change: fresh requests per probe,
  every request judged, stop when the passing rate is within ``rate_tolerance`` (10 %) of the failing
  one, the figure the passing probe's measured ``output_throughput``), same seeds, same early stop;
* by a reference: the former bisection with 10× longer probes (and 10× ``min_requests``) and a 1 %
  tolerance, on 3 seeds of their own, each probe after a warm-up of twice the previous probe's p90
  end-to-end latency and judged on its steady state (judged requests only, drain load until they end);
  its figure is the passing rate times the mean output tokens of its judged requests.

Reported per config: the reference (mean of its 3 seeds, and their spread), repeatability of each method
(max − min over mean of its 5 runs), bias (mean of the 5 against the reference), probe-seconds per
trial, and for the new search its stated half-width and how many of its intervals hold the reference;
early stops whose whole run would have met the SLOs (must be 0); and per scenario each config's gain over
the defaults config with the same seed (the paired comparison a study makes). A summary table closes.

Run: ``python -m benchmarks.precision [--json out.json] [--only SCENARIO] [--config LABEL] [--seeds 5]
[--probe-duration S]`` (about 11 minutes on 2 cores; ``--probe-duration`` lengthens the new search's
probes only).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotune.hardware.catalog import load_model_arch
from autotune.inputs.spec import MeasurementSpec, SloSection, WorkloadSpec
from autotune.load.metrics import percentile, summarize
from autotune.load.probe import ProbePlan, ProbeSchedule, probe_seed
from autotune.load.ratesearch import Start, find_slo_throughput, judge
from autotune.load.workload import arrival_times, build_requests
from autotune.predict.dryrun import SimProber, replay_stop, sim_records
from autotune.sim import WorkloadRequest, simulate
from autotune.sim.flags import ServeFlags, parse_flags
from autotune.study.finalists import pair_half_width
from benchmarks import QUICK_HELP

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Scenario:
    name: str
    argv: tuple[str, ...]
    workload: dict[str, object]
    slo: tuple[str, ...]
    configs: tuple[tuple[str, tuple[str, ...]], ...]
    """(label, extra flags); the first is the defaults config every gain is measured against."""


SCENARIOS = (
    Scenario(
        "demo",
        ("Llama-3.1-8B", "--sim-hardware", "RTX-4090-24GB", "--max-model-len", "2048"),
        {
            "dataset": {
                "input_len": {"dist": "uniform", "low": 64, "high": 320},
                "output_len": {"dist": "uniform", "low": 16, "high": 96},
            }
        },
        ("ttft:p95<=500ms", "tpot:p95<=35ms"),
        (
            ("defaults", ()),
            (
                "seqs46-mbt5904-fp8-b32-u0.86",
                (
                    "--max-num-seqs",
                    "46",
                    "--max-num-batched-tokens",
                    "5904",
                    "--kv-cache-dtype",
                    "fp8",
                    "--block-size",
                    "32",
                    "--gpu-memory-utilization",
                    "0.86",
                ),
            ),
            ("seqs64-mbt4096", ("--max-num-seqs", "64", "--max-num-batched-tokens", "4096")),
            ("seqs32", ("--max-num-seqs", "32")),
        ),
    ),
    Scenario(
        "70b-low-rate",
        ("Llama-3.1-70B", "--sim-hardware", "H100-80GB", "-tp", "4", "--max-model-len", "8192"),
        {
            "dataset": {
                "input_len": {"dist": "lognormal", "mean": 1500, "std": 700, "low": 64, "high": 6000},
                "output_len": {"dist": "uniform", "low": 100, "high": 500},
            }
        },
        ("ttft:p95<=2s", "tpot:p95<=45ms"),
        (
            ("defaults", ()),
            ("mbt8192", ("--max-num-batched-tokens", "8192")),
            ("seqs64", ("--max-num-seqs", "64")),
            ("fp8-kv", ("--kv-cache-dtype", "fp8")),
        ),
    ),
    Scenario(
        "chat-h100-bursty",
        ("Llama-3.1-8B", "--sim-hardware", "H100-80GB", "--max-model-len", "4096"),
        {
            "dataset": {
                "input_len": {"dist": "uniform", "low": 300, "high": 1500},
                "output_len": {"dist": "uniform", "low": 50, "high": 300},
            },
            "arrival": {"process": "gamma", "burstiness": 0.5},
        },
        ("ttft:p95<=300ms", "tpot:p95<=20ms"),
        (
            ("defaults", ()),
            ("mbt8192", ("--max-num-batched-tokens", "8192")),
            ("seqs128-mbt4096", ("--max-num-seqs", "128", "--max-num-batched-tokens", "4096")),
            ("block32-mbt16384", ("--block-size", "32", "--max-num-batched-tokens", "16384")),
        ),
    ),
)

DEFAULT = MeasurementSpec()
FORMER_TOLERANCE = 0.1
REFERENCE = MeasurementSpec(
    probe_duration=DEFAULT.probe_duration * 10,
    min_requests=DEFAULT.min_requests * 10,
    saturation_requests=DEFAULT.saturation_requests,
    max_probes=30,
)
REFERENCE_TOLERANCE = 0.01
REFERENCE_SEEDS = (101, 102, 103)


# ----------------------------------------------------------------------------------------------
# The former search: bisection over fresh requests per probe, every request judged
# ----------------------------------------------------------------------------------------------


class FormerProber:
    """The former probe on the simulator: probe k sends fresh requests (seed ``seed*1000+k``) at Poisson
    arrivals rescaled to the rate, all judged, early stop replayed as the client checked it."""

    def __init__(
        self, flags: ServeFlags, workload: WorkloadSpec, slo: SloSection, m: MeasurementSpec
    ) -> None:
        self.flags = flags
        self.arch = load_model_arch(flags.model)
        self.workload = workload
        self.slo = slo
        self.schedule = ProbeSchedule(workload, slo, m, REPO, prompts=False)
        self.count = 0
        self.full_verdicts: list[bool] = []

    def __call__(self, rate: float, warmup_s: float = 0.0, window_s: float = 0.0) -> object:  # noqa: ARG002
        from autotune.load.probe import ProbeOutcome

        self.count += 1
        n = self.schedule.count(rate)
        seed = probe_seed(self.workload.seed, self.count)
        requests = build_requests(self.workload, n, seed, REPO, prompts=False)
        arrivals = arrival_times(self.workload.arrival, rate, n, seed)
        sim = simulate(
            self.flags,
            self.flags.hardware,
            self.arch,
            [WorkloadRequest(r.input_len, r.output_len, t) for r, t in zip(requests, arrivals, strict=True)],
        )
        records = sim_records(sim)
        plan = ProbePlan(rate, tuple(requests), tuple(arrivals), range(n))
        end = sim.duration
        stopped, reason = False, None
        if math.isfinite(rate):
            stopped, reason, stop_at = replay_stop(records, plan, self.slo)
            if stopped:
                full = summarize(records, sim.duration, self.slo)
                self.full_verdicts.append(judge_passed(full, self.slo))
                records = [r for r in records if r.end_time <= stop_at]
                end = stop_at
        metrics = summarize(records, end, self.slo)
        done = sum(1 for r in records if r.success)
        return ProbeOutcome(
            rate=rate,
            metrics=metrics,
            requests=n,
            duration_s=end,
            arrival_window_s=max(arrivals, default=0.0),
            capacity=done / end if end > 0 else 0.0,
            early_stopped=stopped,
            stop_reason=reason,
            records=tuple(records),
        )


def judge_passed(metrics: object, slo: SloSection) -> bool:
    from autotune.load.slo import evaluate

    return evaluate(slo, metrics, min_tail_samples=DEFAULT.min_tail_samples).passed  # type: ignore[arg-type]


def former_search(
    probe: FormerProber | SimProber,
    slo: SloSection,
    m: MeasurementSpec,
    tolerance: float,
    *,
    warm: bool = False,
) -> dict[str, float]:
    """The former bisection (autotune before the estimate): saturation, 0.7 × R_max, then bisection.
    With ``warm`` (the reference) each finite probe first runs twice the previous probe's p90 end-to-end
    latency of warm-up requests and is judged on its steady state."""
    reports = []
    warmup = [0.0]

    def run(rate: float):  # type: ignore[no-untyped-def]
        report = judge(probe(rate, warmup[0], 0.0), slo, m)  # type: ignore[arg-type]
        reports.append(report)
        e2el = [r.e2el for r in report.outcome.records if r.e2el is not None]
        if warm and e2el:
            warmup[0] = min(2 * percentile(e2el, 90), m.probe_duration)
        return report

    sat = run(math.inf)
    r_max = sat.outcome.capacity
    best = sat if sat.passed else None
    if best is None:
        lo, hi, confirmed, rate = 0.0, r_max, False, 0.7 * r_max
        while len(reports) < m.max_probes:
            report = run(rate)
            if report.passed:
                best, lo = report, rate
            else:
                hi, confirmed = rate, True
            if not confirmed:
                if rate >= hi:
                    hi *= 1.5
                rate = hi
                continue
            if best is not None and lo >= (1.0 - tolerance) * hi:
                break
            rate = (lo + hi) / 2
    seconds = math.fsum(p.duration_s for p in reports)
    if best is None:
        return {"figure": math.nan, "rate": math.nan, "seconds": seconds, "probes": len(reports)}
    tokens = statistics.fmean(r.tokens for r in best.outcome.records if r.success)
    return {
        "figure": best.outcome.metrics.output_throughput,
        "steady": best.rate * tokens,
        "rate": best.rate,
        "seconds": seconds,
        "probes": len(reports),
    }


# ----------------------------------------------------------------------------------------------
# Runs
# ----------------------------------------------------------------------------------------------


def new_run(
    flags: ServeFlags,
    workload: WorkloadSpec,
    slo: SloSection,
    m: MeasurementSpec = DEFAULT,
    start: Start | None = None,
) -> tuple[dict[str, float], list[bool]]:
    """The rate search as a study runs it on the simulator (from ``start``: a finalist's rerun)."""
    schedule = ProbeSchedule(workload, slo, m, REPO, prompts=False)
    prober = SimProber(flags, load_model_arch(flags.model), schedule)
    result = find_slo_throughput(prober, slo, m, start=start, rerun=start is not None)
    est = result.estimate
    out = {"seconds": result.probe_seconds, "probes": len(result.probes)}
    if est is None:
        out.update(figure=math.nan, lo=math.nan, hi=math.nan, rate=math.nan)
    else:
        lo, hi = est.throughput_interval
        out.update(figure=est.slo_throughput, lo=lo, hi=hi, rate=est.rate, binding=est.binding)  # type: ignore[arg-type]
        out["estimate"] = est.as_dict()  # type: ignore[assignment]
    return out, prober.full_verdicts


def spread(values: list[float]) -> float:
    return (max(values) - min(values)) / statistics.fmean(values)


def reference_figure(
    scenario: Scenario,
    extra: tuple[str, ...],
    reference: MeasurementSpec = REFERENCE,
    seeds: tuple[int, ...] = REFERENCE_SEEDS,
) -> tuple[float, list[float]]:
    """A config's reference figure (module docstring): the mean over ``seeds``, and each seed's."""
    flags = parse_flags([*scenario.argv, *extra])
    slo = SloSection(terms=scenario.slo)
    refs = []
    for seed in seeds:
        workload = WorkloadSpec.model_validate({**scenario.workload, "seed": seed})
        schedule = ProbeSchedule(workload, slo, reference, REPO, prompts=False)
        prober = SimProber(flags, load_model_arch(flags.model), schedule)
        r = former_search(prober, slo, reference, REFERENCE_TOLERANCE, warm=True)
        refs.append(r["steady"])
    return statistics.fmean(refs), refs


def measure_config(
    scenario: Scenario,
    label: str,
    extra: tuple[str, ...],
    seeds: int,
    measurement: MeasurementSpec = DEFAULT,
    reference: MeasurementSpec = REFERENCE,
    reference_seeds: tuple[int, ...] = REFERENCE_SEEDS,
) -> dict[str, object]:
    flags = parse_flags([*scenario.argv, *extra])
    slo = SloSection(terms=scenario.slo)
    truth, refs = reference_figure(scenario, extra, reference, reference_seeds)
    new, former, wrong_stops = [], [], 0
    for seed in range(1, seeds + 1):
        workload = WorkloadSpec.model_validate({**scenario.workload, "seed": seed})
        run, verdicts = new_run(flags, workload, slo, measurement)
        new.append(run)
        wrong_stops += sum(verdicts)
        prober = FormerProber(flags, workload, slo, DEFAULT)
        former.append(former_search(prober, slo, DEFAULT, FORMER_TOLERANCE))
        wrong_stops += sum(prober.full_verdicts)
    figures = [r["figure"] for r in new]
    old = [r["figure"] for r in former]
    covered = sum(1 for r in new if r["lo"] <= truth <= r["hi"])
    return {
        "scenario": scenario.name,
        "config": label,
        "reference": truth,
        "reference_spread": spread(refs),
        "new": new,
        "former": former,
        "new_repeat": spread(figures),
        "former_repeat": spread(old),
        "new_bias": statistics.fmean(figures) / truth - 1,
        "former_bias": statistics.fmean(old) / truth - 1,
        "new_seconds": statistics.fmean(r["seconds"] for r in new),
        "former_seconds": statistics.fmean(r["seconds"] for r in former),
        "new_half_width": statistics.fmean((r["hi"] - r["lo"]) / 2 / r["figure"] for r in new),
        "covered": covered,
        "wrong_early_stops": wrong_stops,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--only", action="append", help="scenario name (repeatable)")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--config", action="append", help="config label (repeatable)")
    parser.add_argument(
        "--probe-duration", type=float, help="the new search's probe_duration (s), instead of the default"
    )
    parser.add_argument("--from-json", type=Path, help="print the summary of a saved run, measure nothing")
    parser.add_argument("--quick", action="store_true", help=QUICK_HELP)
    args = parser.parse_args()
    if args.from_json:
        rows = json.loads(args.from_json.read_text(encoding="utf-8"))
        print(table(rows, len(rows[0]["new"])))
        print(ranking(rows))
        print(finalist_rules(rows))
        return
    measurement = DEFAULT
    if args.probe_duration:
        measurement = DEFAULT.model_copy(update={"probe_duration": args.probe_duration})
    reference, reference_seeds = REFERENCE, REFERENCE_SEEDS
    if args.quick:  # two configs of the first scenario, one seed, references of 2 probes' length
        args.only, args.config, args.seeds = [SCENARIOS[0].name], [c[0] for c in SCENARIOS[0].configs[:2]], 1
        measurement = measurement.model_copy(update={"probe_duration": DEFAULT.probe_duration / 2})
        reference = DEFAULT.model_copy(update={"min_requests": DEFAULT.min_requests * 2})
        reference_seeds = REFERENCE_SEEDS[:1]
    rows = []
    started = time.time()
    for scenario in SCENARIOS:
        if args.only and scenario.name not in args.only:
            continue
        for label, extra in scenario.configs:
            if args.config and label not in args.config:
                continue
            row = measure_config(scenario, label, extra, args.seeds, measurement, reference, reference_seeds)
            rows.append(row)
            print(
                f"{scenario.name:18} {label:30} ref {row['reference']:8.1f} (±{row['reference_spread']:.1%}) "
                f"new {row['new_repeat']:6.1%} {row['new_bias']:+6.1%} {row['new_seconds']:6.0f}s "
                f"hw {row['new_half_width']:5.1%} cover {row['covered']}/{args.seeds} "
                f"former {row['former_repeat']:6.1%} {row['former_bias']:+6.1%} "
                f"{row['former_seconds']:6.0f}s "
                f"wrong stops {row['wrong_early_stops']}",
                flush=True,
            )
    print()
    print(table(rows, args.seeds))
    print(ranking(rows))
    print(finalist_rules(rows))
    print(f"({time.time() - started:.0f} s)")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1, default=str), encoding="utf-8")


def table(rows: list[dict[str, object]], seeds: int) -> str:
    lines = [
        "| scenario | config | reference tok/s (spread of 3) | repeatability new / former | "
        "bias new / former | probe-s new / former | stated ± | reference inside | gain over defaults "
        "new (range) / reference |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    by_scenario: dict[str, list[dict[str, object]]] = {}
    for row in rows:
        by_scenario.setdefault(str(row["scenario"]), []).append(row)
    for scenario, group in by_scenario.items():
        base = group[0]
        for row in group:
            gains = ""
            if row is not base:
                paired = [
                    a["figure"] / b["figure"] - 1  # type: ignore[index]
                    for a, b in zip(row["new"], base["new"], strict=True)  # type: ignore[call-overload]
                ]
                true = row["reference"] / base["reference"] - 1  # type: ignore[operator]
                gains = (
                    f"{statistics.fmean(paired):+.1%} ({min(paired):+.1%}..{max(paired):+.1%}) / {true:+.1%}"
                )
            lines.append(
                f"| {scenario} | {row['config']} | {row['reference']:,.0f} ({row['reference_spread']:.1%}) | "
                f"{row['new_repeat']:.1%} / {row['former_repeat']:.1%} | "
                f"{row['new_bias']:+.1%} / {row['former_bias']:+.1%} | "
                f"{row['new_seconds']:.0f} / {row['former_seconds']:.0f} | ±{row['new_half_width']:.1%} | "
                f"{row['covered']}/{seeds} | {gains} |"
            )
    return "\n".join(lines)


def ranking(rows: list[dict[str, Any]], low: float = 0.02, high: float = 0.05) -> str:
    """How often each method ranks two configs of a scenario as the reference does, over the pairs whose
    reference figures lie ``low``-``high`` apart (each seed's runs compared: the same requests)."""
    pairs = [
        (a, b)
        for i, a in enumerate(rows)
        for b in rows[i + 1 :]
        if a["scenario"] == b["scenario"] and low <= abs(a["reference"] / b["reference"] - 1) <= high
    ]
    counts = {"new": 0, "former": 0}
    runs = 0
    for a, b in pairs:
        truth = a["reference"] > b["reference"]
        for method in counts:
            for x, y in zip(a[method], b[method], strict=True):
                counts[method] += (x["figure"] > y["figure"]) == truth
        runs += len(a["new"])
    return (
        f"{len(pairs)} pairs of configs {low:.0%}-{high:.0%} apart by the reference: ranked as the reference "
        f"does in {counts['new']} of {runs} seeded runs by the new search, {counts['former']} by the former"
    )


def _own_half(run: dict[str, Any]) -> float:
    """Half of one run's own interval on the log scale."""
    return (math.log(run["hi"]) - math.log(run["lo"])) / 2


RULES = {
    "own": "own intervals overlap",
    "paired": "paired interval holds the lead",
    "share": "paired, one beside the leader",
}
"""The finalist rules compared; ``share``: the paired rule with at most the closest tied config beside the
leader and the defaults (what ``finalists.max_share``'s 10 % allows in a 30-launch study)."""


def finalist_rules(rows: list[dict[str, Any]]) -> str:
    """Which configs a study would measure again beside the leader, by the rules of :data:`RULES`, seed by
    seed: their own intervals overlapping the leader's (the rule before 2026-12-06), the leader's lead
    within the paired interval of the two figures (:func:`autotune.study.finalists.tied`), or that with only
    the closest such config kept and the defaults added (a study always measures them again). For each
    rule: how many configs it keeps beside the leader (the defaults not counted), how often the paired
    comparison's interval holds the reference's ratio (over every pair of configs), and what keeping fewer
    costs: the best reference figure among the kept configs against the scenario's best (as if the reruns
    then picked the truly best of them)."""
    by_scenario: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_scenario.setdefault(str(row["scenario"]), []).append(row)
    kept = dict.fromkeys(RULES, 0)
    losses: dict[str, list[float]] = {rule: [] for rule in RULES}
    held = {"own": 0, "paired": 0}
    pairs = 0
    runs = 0
    for group in by_scenario.values():
        best_ref = max(r["reference"] for r in group)
        for seed in range(len(group[0]["new"])):
            runs_ = [(r, r["new"][seed]) for r in group if math.isfinite(r["new"][seed]["figure"])]
            runs_.sort(key=lambda x: -x[1]["figure"])
            lead_row, lead = runs_[0]
            runs += 1
            for rule in RULES:
                chosen = [lead_row]
                for row, run in runs_[1:]:
                    if rule == "share" and len(chosen) == 2:
                        break
                    lead_by = math.log(lead["figure"] / run["figure"])
                    half = pair_half_width(lead.get("estimate"), run.get("estimate"))
                    own = rule == "own" or half is None
                    if (run["hi"] >= lead["lo"]) if own else (lead_by <= half):
                        chosen.append(row)
                kept[rule] += len(chosen) - 1 - (rule == "share" and chosen[-1]["config"] == "defaults")
                if rule == "share":
                    chosen += [r for r in group if r["config"] == "defaults"]
                losses[rule].append(1 - max(r["reference"] for r in chosen) / best_ref)
            for i, (a, x) in enumerate(runs_):
                for b, y in runs_[i + 1 :]:
                    pairs += 1
                    true = math.log(a["reference"] / b["reference"])
                    measured = math.log(x["figure"] / y["figure"])
                    paired = pair_half_width(x.get("estimate"), y.get("estimate"))
                    own = math.hypot(_own_half(x), _own_half(y))
                    held["own"] += abs(measured - true) <= own
                    held["paired"] += paired is not None and abs(measured - true) <= paired
    lines = [f"finalists beside the leader over {runs} seeded studies of {len(rows)} configs:"]
    for rule, name in RULES.items():
        holds = (
            f"the interval holds the reference's ratio in {held[rule]} of {pairs} pairs; "
            if rule in held
            else "the defaults measured again too; "
        )
        lines.append(
            f"  {name}: {kept[rule] / runs:.2f} kept per study; {holds}best reference figure kept "
            f"{1 - statistics.fmean(losses[rule]):.1%} of the best on average, "
            f"{1 - max(losses[rule]):.1%} at worst"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
