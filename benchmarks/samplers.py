"""Which Optuna sampler finds SLO throughput fastest while launching the fewest crashing configs?

The objective is the simulator run IN PROCESS (:mod:`autotune.sim.startup` for the start,
:func:`autotune.sim.simulate` for the load) behind the real study wiring: :class:`autotune.study.StudyRunner`
with SQLite storage, the space's known constraints, and :class:`autotune.feasibility.PreLaunchCheck`
(repeats + memory model, calibrated from storage) exactly as ``run_study`` builds it. Start failures are
PRUNED with their cause, SLO misses are PRUNED ``slo_unreachable`` with constraints, as in trial.py.

The SLO-constrained throughput of a launched config: a saturation run gives the capacity R; rates
0.9R, 0.7R, 0.5R, 0.35R, 0.2R are tried in order and the first meeting ttft:p95<=500ms and
tpot:p95<=50ms is the operating point (the demo's SLO and workload).

Figures per variant (mean over seeds): crash share of launches from trial 10 on, configs launched again
after they crashed, best feasible SLO throughput within 20 and 40 trials.
GPSampler needs torch, which is not installed here: it is not compared.

Run: ``python benchmarks/samplers.py [--seeds 3] [--trials 40]`` (results: benchmarks/RESULTS.md)
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import tempfile
import zlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import optuna
import yaml

from autotune.catalog import GIB, GPUS, MODELS
from autotune.feasibility import Decision, MemoryModel, PreLaunchCheck
from autotune.loader import LoadedStudy, load_study
from autotune.outcome import Cause, TrialOutcome
from autotune.sim import simulate, synthetic_workload
from autotune.sim.flags import ServeFlags
from autotune.sim.startup import plan_startup
from autotune.spec import FlagValue
from autotune.study import StudyRunner, open_study

ROOT = Path(__file__).resolve().parents[1]
MODEL, GPU, MML = "Llama-3.1-8B", "RTX-4090-24GB", 2048
TTFT_SLO, TPOT_SLO = 0.5, 0.05
CRASHES = {
    Cause.OOM.value,
    Cause.KV_TOO_SMALL.value,
    Cause.START_FAILED.value,
    Cause.CRASHED_UNDER_LOAD.value,
}
WORKLOAD = synthetic_workload(150, input_len=(128, 512), output_len=(32, 128), seed=0)


def make_loaded(tmp: Path, sampler: str, seed: int, trials: int, memory_model: bool) -> LoadedStudy:
    """A study spec like the demo's, stored in ``tmp``."""
    spec: dict[str, Any] = {
        "study": {"name": "bench", "workdir": str(tmp)},
        "server": {"command": ["sim"], "model": MODEL, "args": {"max-model-len": MML}},
        "search_space": str(ROOT / "search_spaces" / "sim.yaml"),
        "slo": {"terms": ["ttft:p95<=500ms", "tpot:p95<=50ms"]},
        "budget": {"trials": trials},
        "sampler": {"name": sampler, "seed": seed, "startup_trials": 6},
    }
    if memory_model:
        spec["memory_model"] = {"model": MODEL, "gpu": GPU}
    path = tmp / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    return load_study(path)


class SimTrials:
    """The study's trials with trial.py's semantics, launching the in-process simulator."""

    def __init__(self, loaded: LoadedStudy, study: optuna.Study, seed: int, memory_model: bool) -> None:
        self.space = loaded.search_space
        self.seed = seed
        model = MemoryModel(MODELS[MODEL], GPUS[GPU], loaded.spec.server.args) if memory_model else None
        self.prelaunch = PreLaunchCheck(model, lambda: study.get_trials(deepcopy=False))

    def screen(self, flags: Mapping[str, FlagValue]) -> Decision:
        violations = self.space.violations(flags)
        if violations:
            return Decision(TrialOutcome(Cause.INVALID_CONFIG, "rejected", attrs={"launched": False}))
        return self.prelaunch(flags)

    def launch(
        self, number: int, flags: Mapping[str, FlagValue], decision: Decision, phase: Callable[[str], None]
    ) -> TrialOutcome:
        del phase
        return _launch(number, flags, decision, self.seed)


def _launch(number: int, flags: Mapping[str, FlagValue], decision: Decision, seed: int) -> TrialOutcome:
    arch, gpu = MODELS[MODEL], GPUS[GPU]
    attrs: dict[str, Any] = {"launched": True, "memory_prediction": decision.prediction}
    serve = ServeFlags(model=MODEL, hardware=gpu, max_model_len=MML, **flags)  # type: ignore[arg-type]
    trial_seed = zlib.crc32(f"{seed}:{number}".encode())
    plan = plan_startup(serve, arch, random.Random(trial_seed))
    if not plan.ok:
        assert plan.failure is not None
        if (
            plan.memory is not None
            and plan.failure.value == "kv_too_small"
            and plan.memory.kv_cache_bytes > 0
        ):
            attrs["diagnosis"] = {"available_gib": round(plan.memory.kv_cache_bytes / GIB, 2)}
        return TrialOutcome(Cause(plan.failure.value), plan.error[:200], attrs=attrs)
    assert plan.memory is not None
    attrs["capacity"] = {
        "kv_tokens": plan.memory.kv_tokens,
        "available_kv_cache_gib": round(plan.memory.kv_cache_bytes / GIB, 2),
    }
    saturation = simulate(serve, gpu, arch, WORKLOAD, rate=math.inf, seed=trial_seed)
    capacity = saturation.request_throughput
    closest: tuple[float, ...] = ()
    for fraction in (0.9, 0.7, 0.5, 0.35, 0.2):
        result = simulate(serve, gpu, arch, WORKLOAD, rate=fraction * capacity, seed=trial_seed)
        ttft, tpot = result.stat("ttft", 95), result.stat("tpot", 95)
        constraints = ((ttft - TTFT_SLO) / TTFT_SLO, (tpot - TPOT_SLO) / TPOT_SLO, result.failed / 150)
        if not closest or max(constraints) < max(closest):
            closest = constraints
        if max(constraints) <= 0:
            attrs["server_delta"] = {"preemptions": float(result.num_preemptions)}
            return TrialOutcome(
                None,
                "measured",
                values=(result.output_throughput, ttft * 1000),
                constraints=constraints,
                attrs=attrs,
            )
    return TrialOutcome(Cause.SLO_UNREACHABLE, "no rate met the SLO", constraints=closest, attrs=attrs)


def measure(sampler: str, seed: int, trials: int, memory_model: bool) -> dict[str, float]:
    """Run one study; return its crash share after trial 10, relaunches of crashed configs, best@20/40."""
    with tempfile.TemporaryDirectory() as tmp:
        loaded = make_loaded(Path(tmp), sampler, seed, trials, memory_model)
        opened = open_study(loaded, create=True)
        study = StudyRunner(
            loaded,
            opened,
            SimTrials(loaded, opened, seed, memory_model),
            on_event=lambda _: None,
            on_stale=lambda _: None,
        ).run()
        done = sorted(study.get_trials(deepcopy=False), key=lambda t: t.number)
        crashed: set[str] = set()
        relaunched = launches = crashes = 0
        best = {20: 0.0, trials: 0.0}
        for t in done:
            key = repr(sorted(t.user_attrs.get("flags", {}).items()))
            cause = t.user_attrs.get("cause")
            if t.user_attrs.get("launched"):
                relaunched += key in crashed
                if t.number >= 10:
                    launches += 1
                    crashes += cause in CRASHES
                if cause in CRASHES:
                    crashed.add(key)
            feasible = t.values and all(v <= 0 for v in (t.constraints or {}).values()) if t.values else False
            if feasible and t.values:
                for limit in best:
                    if t.number < limit:
                        best[limit] = max(best[limit], t.values[0])
        return {
            "crash_share": crashes / launches if launches else 0.0,
            "launches": launches,
            "relaunched": relaunched,
            "best20": best[20],
            "best_all": best[trials],
        }


def main() -> None:
    """Compare samplers (with and without the memory model) over seeds; print a markdown table."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--trials", type=int, default=40)
    args = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    variants = [("tpe", True), ("random", True), ("nsga2", True), ("tpe", False), ("random", False)]
    print(
        f"| sampler | memory model | crash share of launches (trial >= 10) | launches (>= 10) "
        f"| crashed configs relaunched | best SLO tok/s @20 | best SLO tok/s @{args.trials} |"
    )
    print("|---|---|---|---|---|---|---|")
    for sampler, memory_model in variants:
        runs = [measure(sampler, seed, args.trials, memory_model) for seed in range(args.seeds)]

        def mean(key: str, runs: list[dict[str, float]] = runs) -> float:
            return statistics.fmean(r[key] for r in runs)

        print(
            f"| {sampler} | {'on' if memory_model else 'off'} | {100 * mean('crash_share'):.1f} % "
            f"| {mean('launches'):.1f} | {mean('relaunched'):.1f} | {mean('best20'):.0f} "
            f"| {mean('best_all'):.0f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
