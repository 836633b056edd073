"""Racing the finalists against fixed rounds of the same seconds: how precisely does a study state its pick's
gain over vLLM's defaults, and what does that cost?

In virtual time, on the in-process simulator (:func:`autotune.sim.simulate`, through
:class:`autotune.predict.dryrun.SimProber`: the rate search a study runs, probe by probe), for each scenario
of :mod:`benchmarks.precision` (vLLM's defaults and three configs) and each seed, one study:

* **the search**: every config searched once on the study's stream (workload seed ``seed``), as a launch
  does; the study is a ``--launches`` launch study (default 30): its other launches, which do not lead,
  are counted at the configs' mean launch time. A launch takes ``--launch-s`` (default 60 s: vLLM's start
  on a GPU takes 30 s to several minutes, docs/vllm.md) plus its probes and its probe at the reference load
  (one ``probe_duration``);
* **the finalists' stage**, decided by the product's own code (:func:`autotune.study.finalists.finalists`,
  :func:`~autotune.study.finalists.next_round`, :func:`~autotune.study.finalists.pick`,
  :func:`~autotune.study.finalists.gain`) on an in-memory Optuna study whose trials carry each
  measurement's virtual duration. Each rerun of a config in round ``k`` is its rate search started at its
  trial's boundary on the stream of :func:`~autotune.study.finalists.round_seed` (shared by every config of
  the round), with probes ``finalists.probe_scale`` times longer; it is measured once and shared by every
  arm, so the arms differ only in who runs which round and when they stop.

The arms (``finalists.max_share`` 0.1, or ``--max-share``, and ``finalists.count`` 3 as a study has them
by default):

* ``one round``: today's default (``finalists.rounds`` 1, no race);
* ``race``: ``finalists.target`` (default 0.03: ±3 points) with ``finalists.max_rounds`` (8): a round at a
  time while the gain is wider than the target and the next round fits the share; who trails the pick
  beyond its paired interval drops out;
* ``fixed``: every finalist in every round, as many whole rounds as fit in the seconds the race spent (at
  least one): fixed rounds of the same seconds;
* with ``--probe-scale S``, ``fixed xS``: the same seconds spent on rounds whose probes are S times longer
  (fewer launches for as many probe-seconds), and ``race xS``: the race on such rounds (S below 1 too:
  shorter probes, more rounds for the seconds).

The truth each arm is scored against: each config's reference figure
(:func:`benchmarks.precision.reference_figure`:
the former bisection with 10× longer probes and a 1 % tolerance, over 3 seeds of its own), the reference gain
the pick's reference over the defaults'. Reported per scenario and arm, over the seeds: how often the stated
gain is within ±3 points of the reference gain, how often its interval holds it, the median half-width, how
often the pick's reference figure is within 1 % of the best config's, the stage's rounds and its share of the
study's time (median and largest), and that share had each config's rounds after its first shared one launch,
or had no rerun paid for a launch at all (its probes alone: the least any design that saves launches could
spend on the same rounds). The issue's targets: at least 9 of 10, at least 95 %, at most 3 points, 9
of 10, at most 10 %.

Run: ``python -m benchmarks.racing [--seeds 10] [--only SCENARIO] [--launches 30] [--launch-s 60]
[--target 0.03] [--max-share 0.1] [--max-rounds 8] [--probe-scale S] [--references FILE] [--json out.json]``
(about 20 minutes on one core with the references kept; ``--references`` keeps the reference figures, the
slow part at about 11 minutes, for the next run while the simulator is unchanged; ``--max-share`` sets
every arm's ``finalists.max_share``, ``--max-rounds`` the race's ``finalists.max_rounds``).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import optuna
import yaml
from optuna.trial import FrozenTrial, TrialState, create_trial

from autotune.inputs.loader import LoadedStudy, load_study
from autotune.inputs.spec import MeasurementSpec, SloSection, WorkloadSpec
from autotune.load.crossing import NOISE_INFLATION, NOISE_Z, batch_spread
from autotune.sim.flags import parse_flags
from autotune.study.finalists import (
    baseline_trial,
    finalists,
    gain,
    ledger,
    next_round,
    pair_half_width,
    pick,
    reruns,
    round_seed,
)
from autotune.study.rerun_stage import start_of
from benchmarks import QUICK_HELP
from benchmarks.precision import (
    DEFAULT,
    REFERENCE,
    REFERENCE_SEEDS,
    SCENARIOS,
    Scenario,
    new_run,
    reference_figure,
)

EPOCH = datetime(2026, 1, 1)
WITHIN = 0.03
"""A stated gain is right when within this many points of the reference gain."""
NEAR_BEST = 0.01
"""The pick is right when its reference figure is within this of the best config's."""


@dataclass(frozen=True)
class Measured:
    """One search or rerun of a config: its SLO-constrained throughput (``None``: met no SLO), its estimate
    and the virtual seconds it took (launch included)."""

    figure: float | None
    estimate: dict[str, Any] | None
    seconds: float


@dataclass
class Lab:
    """Every measurement of one scenario's study of one seed, each simulated once and shared by the arms."""

    scenario: Scenario
    seed: int
    launch_s: float
    measurement: MeasurementSpec = DEFAULT
    _done: dict[tuple[str, int, float], Measured] = field(default_factory=dict)

    def search(self, label: str) -> Measured:
        """The config's rate search on the study's stream, with its probe at the reference load."""
        return self._measure(label, 0, 1.0)

    def rerun(self, label: str, round_number: int, scale: float) -> Measured:
        """The config measured again in round ``round_number``, from its search's boundary, with probes
        ``scale`` times longer."""
        return self._measure(label, round_number, scale)

    def _measure(self, label: str, round_number: int, scale: float) -> Measured:
        key = (label, round_number, scale)
        if key in self._done:
            return self._done[key]
        extra = dict(self.scenario.configs)[label]
        flags = parse_flags([*self.scenario.argv, *extra])
        slo = SloSection(terms=self.scenario.slo)
        start, m, seed = None, self.measurement, self.seed
        if round_number:
            start = start_of(self.search(label).estimate)
            seed = round_seed(self.seed, round_number)
            m = m.scaled(scale)
        workload = WorkloadSpec.model_validate({**self.scenario.workload, "seed": seed})
        run, _ = new_run(flags, workload, slo, m, start)
        seconds = self.launch_s + run["seconds"] + (0.0 if round_number else m.probe_duration)
        estimate: dict[str, Any] | None = run.get("estimate")  # type: ignore[assignment]
        found = Measured(run["figure"] if estimate is not None else None, estimate, seconds)
        self._done[key] = found
        return found


# ----------------------------------------------------------------------------------------------
# The study and its ledger, in memory, on virtual time
# ----------------------------------------------------------------------------------------------


def spec_for(folder: Path, launches: int, finalists_spec: Mapping[str, Any]) -> LoadedStudy:
    """A study spec with these launches and finalists' settings (the rest does not matter here)."""
    (folder / "space.yaml").write_text(
        yaml.safe_dump({"params": {"max_num_seqs": {"type": "int", "low": 8, "high": 1024}}}),
        encoding="utf-8",
    )
    spec = {
        "study": {"name": "racing"},
        "server": {"command": ["true"], "model": "m"},
        "search_space": "space.yaml",
        "slo": {"terms": ["ttft:p95<=1s"]},
        "budget": {"trials": launches},
        "finalists": dict(finalists_spec),
    }
    path = folder / "spec.yaml"
    path.write_text(yaml.safe_dump(spec), encoding="utf-8")
    return load_study(path)


def _trial(
    values: list[float] | None, seconds: float, attrs: Mapping[str, Any], at: float
) -> tuple[FrozenTrial, float]:
    """A finished trial of ``seconds`` from virtual time ``at``: COMPLETE with ``values`` (its constraints
    met), else PRUNED; and the time it ends."""
    trial = create_trial(
        state=TrialState.COMPLETE if values is not None else TrialState.PRUNED,
        values=values,
        user_attrs=dict(attrs),
        system_attrs={"constraints": [-1.0]} if values is not None else {},
    )
    trial.datetime_start = EPOCH + timedelta(seconds=at)
    trial.datetime_complete = trial.datetime_start + timedelta(seconds=seconds)
    return trial, at + seconds


@dataclass
class Study:
    """One arm's study: the search's trials (trial ``i``: the scenario's ``i``-th config, 0 the defaults),
    the other launches, and the finalists' ledger."""

    lab: Lab
    loaded: LoadedStudy
    launches: int
    scale: float = 1.0
    study: optuna.Study = field(init=False)
    book: optuna.Study = field(init=False)
    labels: list[str] = field(init=False)
    clock: float = 0.0
    stage_s: float = 0.0
    reran: list[str] = field(default_factory=list)
    """The config of each rerun, in order (what each paid for its launch is ``lab.launch_s``)."""

    def __post_init__(self) -> None:
        self.study = optuna.create_study(directions=["maximize", "minimize"])
        self.labels = [label for label, _ in self.lab.scenario.configs]
        searched = [self.lab.search(label) for label in self.labels]
        for number, (label, found) in enumerate(zip(self.labels, searched, strict=True)):
            attrs = {"flags": {"config": label}, "estimate": found.estimate, "baseline": number == 0}
            values = [found.figure, 0.0] if found.figure is not None else None
            trial, self.clock = _trial(values, found.seconds, attrs, self.clock)
            self.study.add_trial(trial)
        mean_s = statistics.fmean(m.seconds for m in searched)
        for _ in range(self.launches - len(searched)):  # the launches that did not lead
            trial, self.clock = _trial(None, mean_s, {"flags": {}}, self.clock)
            self.study.add_trial(trial)
        self.book = ledger(self.study)

    def round(self, trials: Iterable[FrozenTrial]) -> None:
        """Measure ``trials`` again in the next round, one after the other."""
        number = max((t.user_attrs["round"] for t in self.book.get_trials(deepcopy=False)), default=0) + 1
        for trial in trials:
            label = self.labels[trial.number]
            found = self.lab.rerun(label, number, self.scale)
            attrs = {
                "finalist": trial.number,
                "round": number,
                "seed": round_seed(self.lab.seed, number),
                "estimate": found.estimate,
            }
            values = [found.figure] if found.figure is not None else None
            rerun, self.clock = _trial(values, found.seconds, attrs, self.clock)
            self.book.add_trial(rerun)
            self.stage_s += found.seconds
            self.reran.append(label)

    def share_saving(self, launches: int) -> float:
        """The stage's share of the study's time had ``launches`` of its reruns' launches not been paid."""
        saved = launches * self.lab.launch_s
        return (self.stage_s - saved) / (self.clock - saved)

    def rounds(self) -> int:
        return len({t.user_attrs["round"] for t in self.book.get_trials(deepcopy=False)})


def run_stage(study: Study, seconds: float | None = None) -> Study:
    """Run the finalists' stage on ``study``: the rounds its spec asks for (and the race's, with
    ``finalists.target``); with ``seconds``, whole rounds of every finalist while they fit in them."""
    chosen = finalists(study.study, study.loaded)
    study.round(chosen)
    while racing := next_round(study.study, study.loaded, study.book):
        study.round(racing)
    if seconds is not None:
        per_round = study.stage_s
        while study.stage_s + per_round <= seconds * (1 + 1e-9):
            study.round(chosen)
    return study


# ----------------------------------------------------------------------------------------------
# Scoring
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Score:
    """What one arm's study stated, against the references."""

    pick: str
    defaults: bool
    """The pick is vLLM's defaults (its gain over them is zero, with no interval)."""
    stated: float
    lo: float
    hi: float
    truth: float
    pick_share: float
    """The pick's reference figure over the best config's."""
    rounds: int
    stage_share: float
    """The stage's seconds over the study's and the stage's."""
    one_launch_share: float
    """The same had each config's rounds after its first shared one launch."""
    probe_share: float
    """The same had no rerun paid for a launch: its probes alone (the least a launch-saving design spends)."""

    @property
    def right(self) -> bool:
        return abs(self.stated - self.truth) <= WITHIN

    @property
    def covered(self) -> bool:
        return self.lo <= self.truth <= self.hi

    @property
    def half(self) -> float:
        return (self.hi - self.lo) / 2


def score(study: Study, refs: Mapping[str, float]) -> Score:
    table = reruns(study.study)
    chosen = pick(study.study, study.loaded, table)
    base = baseline_trial(study.study)
    assert chosen is not None and base is not None
    label = study.labels[chosen.trial.number]
    stated = gain(table, chosen.trial, base)
    value, lo, hi = (stated.value, stated.lo, stated.hi) if stated is not None else (math.nan,) * 3
    best = max(refs[lab] for lab in study.labels if study.lab.search(lab).figure is not None)
    return Score(
        label,
        chosen.trial.number == base.number,
        value,
        lo,
        hi,
        refs[label] / refs[study.labels[0]] - 1,
        refs[label] / best,
        study.rounds(),
        study.stage_s / study.clock,
        study.share_saving(len(study.reran) - len(set(study.reran))),
        study.share_saving(len(study.reran)),
    )


def run_seed(
    scenario: Scenario, seed: int, refs: Mapping[str, float], args: argparse.Namespace
) -> dict[str, Score]:
    """Every arm of one scenario's study of ``seed``."""
    lab = Lab(scenario, seed, args.launch_s)
    out: dict[str, Score] = {}
    with tempfile.TemporaryDirectory() as folder:
        base = {"count": 3, "max_share": args.max_share}

        def arm(
            name: str, spec: Mapping[str, Any], scale: float = 1.0, seconds: float | None = None
        ) -> Study:
            loaded = spec_for(Path(folder), args.launches, {**base, **spec})
            done = run_stage(Study(lab, loaded, args.launches, scale), seconds)
            out[name] = score(done, refs)
            return done

        arm("one round", {"target": None})
        race = arm("race", {"target": args.target, "max_rounds": args.max_rounds})
        arm("fixed", {"target": None}, seconds=race.stage_s)
        if args.probe_scale:
            # A study's spec takes no scale below 1; for shorter probes its share bound (off with --max-share
            # 1) would read those reruns at full length.
            scaled = {"probe_scale": args.probe_scale} if args.probe_scale >= 1 else {}
            arm(f"fixed x{args.probe_scale:g}", {**scaled, "target": None}, args.probe_scale, race.stage_s)
            arm(
                f"race x{args.probe_scale:g}",
                {**scaled, "target": args.target, "max_rounds": args.max_rounds},
                args.probe_scale,
            )
    return out


def summary(name: str, arm: str, scores: Sequence[Score]) -> str:
    n = len(scores)
    shares = [s.stage_share for s in scores]
    halves = [s.half for s in scores if not s.defaults]
    half = f"±{statistics.median(halves) * 100:.1f} ({len(halves)})" if halves else "- (0)"
    return (
        f"| {name} | {arm} | {sum(s.right for s in scores)}/{n} | {sum(s.covered for s in scores)}/{n} | "
        f"{half} | "
        f"{sum(s.pick_share >= 1 - NEAR_BEST for s in scores)}/{n} | "
        f"{statistics.median(s.rounds for s in scores):g} ({max(s.rounds for s in scores)}) | "
        f"{statistics.median(shares):.1%} ({max(shares):.1%}) | "
        f"{statistics.median(s.one_launch_share for s in scores):.1%} | "
        f"{statistics.median(s.probe_share for s in scores):.1%} |"
    )


HEADER = (
    "| scenario | arm | gain within ±3 points | interval holds it | median ± (points; studies whose pick "
    "is not the defaults) | pick within 1 % "
    "of the best | rounds, median (most) | stage's share, median (most) | had a config's rounds shared one "
    "launch (median) | its probes alone, no launch (median) |\n|---|---|---|---|---|---|---|---|---|---|"
)


# ----------------------------------------------------------------------------------------------
# One round's own interval against the rounds' spread (--calibrate)
# ----------------------------------------------------------------------------------------------


def calibrate(scenario: Scenario, refs: Mapping[str, float], seeds: int, rounds: int, launch_s: float) -> str:
    """How well one round's own interval reads its noise: the scenario's best config by the references
    against the defaults, in rounds 1..``rounds`` of seeds 1..``seeds``. The rounds' spread (the standard
    deviation of their log ratios about each seed's mean, pooled) against the median of what each round's
    batches say (:func:`autotune.load.crossing.batch_spread`), and how many single rounds' intervals
    (:func:`autotune.study.finalists.pair_half_width`) hold the reference gain, and how wide they are
    (median), as the product states them and with the batches' spread inflated by
    :data:`autotune.load.crossing.NOISE_INFLATION` as a single figure's noise is."""
    top = max((label for label, _ in scenario.configs[1:]), key=lambda label: refs[label])
    truth = math.log(refs[top] / refs["defaults"])
    deviations: list[float] = []
    spreads: list[float] = []
    held = [0, 0]
    halves: tuple[list[float], list[float]] = ([], [])
    for seed in range(1, seeds + 1):
        lab = Lab(scenario, seed, launch_s)
        logs = []
        for k in range(1, rounds + 1):
            x, y = lab.rerun(top, k, 1.0), lab.rerun("defaults", k, 1.0)
            if x.figure is None or y.figure is None or x.estimate is None or y.estimate is None:
                continue
            g = math.log(x.figure / y.figure)
            logs.append(g)
            half = pair_half_width(x.estimate, y.estimate)
            a, b = x.estimate.get("batch_rates"), y.estimate.get("batch_rates")
            if half is None or not a or not b:
                continue
            spread = batch_spread(a, b)
            spreads.append(spread)
            inflated = NOISE_Z * math.sqrt((half / NOISE_Z) ** 2 + (NOISE_INFLATION**2 - 1) * spread**2)
            for i, h in enumerate((half, inflated)):
                held[i] += abs(g - truth) <= h
                halves[i].append(h)
        if len(logs) > 1:
            mean = statistics.fmean(logs)
            deviations += [(g - mean) ** 2 * len(logs) / (len(logs) - 1) for g in logs]
    n = len(halves[0])
    return (
        f"| {scenario.name} | {top} | {n} | {math.sqrt(statistics.fmean(deviations)) * 100:.2f} | "
        f"{statistics.median(spreads) * 100:.2f} | "
        f"{held[0]}/{n}, ±{statistics.median(halves[0]) * 100:.1f} | "
        f"{held[1]}/{n}, ±{statistics.median(halves[1]) * 100:.1f} |"
    )


CALIBRATE_HEADER = (
    "| scenario | config against the defaults | rounds | the rounds' spread (points) | the batches' spread, "
    "median (points) | one round's interval holds the reference gain, median ± | with the batches' spread "
    "inflated |\n|---|---|---|---|---|---|---|"
)


# ----------------------------------------------------------------------------------------------
# References and the run
# ----------------------------------------------------------------------------------------------


def references(
    scenarios: Sequence[Scenario],
    path: Path | None,
    measure: Callable[[Scenario, str], float],
) -> dict[str, dict[str, float]]:
    """Each config's reference figure by scenario, read from ``path`` where it holds them, else measured
    (and written there)."""
    known: dict[str, dict[str, float]] = {}
    if path is not None and path.exists():
        known = json.loads(path.read_text(encoding="utf-8"))
    for scenario in scenarios:
        have = known.setdefault(scenario.name, {})
        for label, _ in scenario.configs:
            if label not in have:
                have[label] = measure(scenario, label)
                if path is not None:
                    path.write_text(json.dumps(known, indent=1), encoding="utf-8")
    return known


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--only", action="append", help="scenario name (repeatable)")
    parser.add_argument("--launches", type=int, default=30)
    parser.add_argument("--launch-s", type=float, default=60.0, help="a launch's seconds before its probes")
    parser.add_argument("--target", type=float, default=0.03, help="the race's finalists.target")
    parser.add_argument("--max-share", type=float, default=0.1, help="every arm's finalists.max_share")
    parser.add_argument("--max-rounds", type=int, default=8, help="the race's finalists.max_rounds")
    parser.add_argument("--probe-scale", type=float, help="also fixed rounds with probes this much longer")
    parser.add_argument("--references", type=Path, help="a JSON file that keeps the reference figures")
    parser.add_argument("--json", type=Path, help="write every study's scores here")
    parser.add_argument(
        "--calibrate",
        type=int,
        metavar="ROUNDS",
        help="instead of the arms: one round's own interval against the spread of ROUNDS rounds per seed",
    )
    parser.add_argument("--quick", action="store_true", help=QUICK_HELP)
    args = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    scenarios = [s for s in SCENARIOS if not args.only or s.name in args.only]
    ref_spec = REFERENCE
    ref_seeds: tuple[int, ...] = REFERENCE_SEEDS
    if args.quick:  # the demo's defaults and one config, two seeds, short references, ten launches
        first = SCENARIOS[0]
        scenarios = [Scenario(first.name, first.argv, first.workload, first.slo, first.configs[:2])]
        args.seeds, args.launches = 2, 10
        ref_spec = DEFAULT.model_copy(update={"min_requests": DEFAULT.min_requests * 2})
        ref_seeds = REFERENCE_SEEDS[:1]
    started = time.time()

    def measure(scenario: Scenario, label: str) -> float:
        return reference_figure(scenario, dict(scenario.configs)[label], ref_spec, ref_seeds)[0]

    refs = references(scenarios, None if args.quick else args.references, measure)
    print(f"references measured ({time.time() - started:.0f} s)", flush=True)
    if args.calibrate:
        print(CALIBRATE_HEADER)
        for scenario in scenarios:
            print(
                calibrate(scenario, refs[scenario.name], args.seeds, args.calibrate, args.launch_s),
                flush=True,
            )
        print(f"({time.time() - started:.0f} s)")
        return
    rows: dict[str, dict[str, list[Score]]] = {}
    for scenario in scenarios:
        for seed in range(1, args.seeds + 1):
            for arm, found in run_seed(scenario, seed, refs[scenario.name], args).items():
                rows.setdefault(scenario.name, {}).setdefault(arm, []).append(found)
                print(
                    f"{scenario.name:18} seed {seed:2} {arm:10} pick {found.pick:30} "
                    f"{found.stated:+7.1%} [{found.lo:+7.1%}, {found.hi:+7.1%}] truth {found.truth:+7.1%} "
                    f"rounds {found.rounds} share {found.stage_share:5.1%}",
                    flush=True,
                )
    print()
    print(HEADER)
    for name, arms in rows.items():
        for arm, scores in arms.items():
            print(summary(name, arm, scores))
    print(f"({time.time() - started:.0f} s)")
    if args.json:
        out = {n: {a: [vars(s) for s in v] for a, v in arms.items()} for n, arms in rows.items()}
        args.json.write_text(json.dumps(out, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
