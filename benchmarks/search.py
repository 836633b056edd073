"""Search efficiency: how many launches until the study holds a config near the best one, and how many of
its launches fail, for this project's search against plain TPE, random search and vLLM's ``auto_tune.sh``.

Each scenario is a simulated model on a simulated GPU with ``max-model-len`` at the model's full context,
a workload and SLOs. Its space is a grid (gpu-memory-utilization 0.80-0.98 by 0.02, max-num-seqs 16-1024,
max-num-batched-tokens 1024-32768, KV cache dtype auto/fp8; chunked prefill stays on: off it can never hold
at full context), and every config of the grid is launched once, up front, on the in-process simulator
(:func:`autotune.sim.startup.plan_startup` for the start, :func:`autotune.sim.simulate` for the load), with
a seed derived from the config: a config gives the same outcome however often it is launched, as on a real
GPU where the same flags capture the same graphs. The grid's best SLO throughput is the scenario's optimum.

SLO throughput of a config that starts: a saturation run gives its capacity; rates of 0.95, 0.9, 0.8, ...,
0.2 of it are simulated in order, and the first whose p95 TTFT, p95 TPOT and failures meet the SLOs gives
the output throughput. A config that meets them at no rate is ``slo_unreachable``.

Searchers, 30 launches each (configs rejected before a launch do not spend one):

* ``autotune``: this project's study (:class:`autotune.study.StudyRunner`, SQLite storage, the default
  sampler of :func:`autotune.study.make_sampler`, vLLM's defaults as trial 0, the space's constraints and
  impossible values, repeats, the crash boundary and the memory model with its learned device edge, as
  ``run_study`` wires them);
* ``tpe``: Optuna's ``TPESampler(seed)`` with its own defaults, the same defaults first, no pre-launch
  checks but the space's constraints;
* ``random``: ``RandomSampler(seed)``, the same way;
* ``auto_tune``: vLLM's ``benchmarks/auto_tune/auto_tune.sh`` order: gpu-memory-utilization from 0.98 down
  (0.02 steps here, 0.01 there) until the largest max-num-seqs with the largest max-num-batched-tokens
  starts, then every max-num-seqs x max-num-batched-tokens pair at that utilization (fp8 KV never tried).

Reported per scenario and searcher, over seeds: launches to 95 % and 98 % of the optimum (best feasible
config so far), best after 15 and 30 launches (% of the optimum), and the share of launches from the 11th on
that failed to start (oom, kv_too_small, invalid_config, start_failed).

Run: ``python benchmarks/search.py [--seeds 5] [--launches 30] [--only NAME]`` (results:
benchmarks/RESULTS.md).
"""

from __future__ import annotations

import argparse
import itertools
import math
import random
import statistics
import sys
import tempfile
import time
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from autotune.catalog import GIB, GPUS, MODELS  # noqa: E402
from autotune.feasibility import Decision, MemoryModel, PreLaunchCheck  # noqa: E402
from autotune.loader import LoadedStudy, load_study  # noqa: E402
from autotune.outcome import Cause, TrialOutcome  # noqa: E402
from autotune.record import TrialRecord  # noqa: E402
from autotune.sim import simulate, synthetic_workload  # noqa: E402
from autotune.sim.flags import ServeFlags  # noqa: E402
from autotune.sim.model import WorkloadRequest  # noqa: E402
from autotune.sim.startup import plan_startup  # noqa: E402
from autotune.spec import FlagValue  # noqa: E402
from autotune.study import StudyRunner, is_launch, open_study  # noqa: E402

UTILS = tuple(round(0.80 + 0.02 * i, 2) for i in range(10))
SEQS = (16, 32, 64, 128, 256, 512, 1024)
BATCHED = (1024, 2048, 4096, 8192, 16384, 32768)
KV_DTYPES = ("auto", "fp8")
RATE_FRACTIONS = (0.95, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2)
FAILED_TO_START = {Cause.OOM, Cause.KV_TOO_SMALL, Cause.INVALID_CONFIG, Cause.START_FAILED}
REQUESTS = 200


@dataclass(frozen=True)
class Scenario:
    name: str
    model: str
    gpu: str
    input_len: tuple[int, int]
    output_len: tuple[int, int]
    ttft_s: float
    tpot_s: float

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
    Scenario("8B on H100, KV plentiful", "Llama-3.1-8B", "H100-80GB", (384, 640), (96, 160), 0.5, 0.05),
    Scenario("7B on RTX 4090, KV scarce", "Qwen2.5-7B", "RTX-4090-24GB", (384, 640), (96, 160), 1.0, 0.06),
    Scenario("8B on A100, long prompts", "Llama-3.1-8B", "A100-80GB", (3072, 5120), (128, 256), 2.0, 0.06),
    Scenario("7B on L40S, tight TPOT", "Mistral-7B", "L40S-48GB", (384, 640), (96, 160), 1.0, 0.025),
)


def space_yaml(scenario: Scenario) -> dict[str, Any]:
    d = scenario.defaults
    return {
        "name": "search-benchmark",
        "params": {
            "gpu_memory_utilization": {"type": "categorical", "choices": list(UTILS), "default": 0.9},
            "max_num_seqs": {"type": "categorical", "choices": list(SEQS), "default": d["max_num_seqs"]},
            "max_num_batched_tokens": {
                "type": "categorical",
                "choices": list(BATCHED),
                "default": d["max_num_batched_tokens"],
            },
            "kv_cache_dtype": {"type": "categorical", "choices": list(KV_DTYPES), "default": "auto"},
        },
        "constraints": [{"expr": "max_num_batched_tokens >= max_num_seqs"}],
    }


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
    """Output tok/s at the SLO operating point (0.0 when none)."""
    summary: str
    capacity: Mapping[str, float] | None = None


def evaluate(scenario: Scenario, flags: Mapping[str, FlagValue], workload: list[WorkloadRequest]) -> Measured:
    """Launch ``flags`` on the simulator (seeded by the config) and find its SLO throughput."""
    arch, gpu = MODELS[scenario.model], GPUS[scenario.gpu]
    seed = zlib.crc32(repr(key(flags)).encode())
    serve = ServeFlags(
        model=scenario.model,
        hardware=gpu,
        max_model_len=scenario.max_model_len,
        **flags,  # type: ignore[arg-type]
    )
    plan = plan_startup(serve, arch, random.Random(seed))
    if not plan.ok:
        assert plan.failure is not None
        return Measured(Cause(plan.failure.value), 0.0, plan.error[:160])
    assert plan.memory is not None
    capacity = {
        "kv_tokens": float(plan.memory.kv_tokens),
        "available_kv_cache_gib": round(plan.memory.kv_cache_bytes / GIB, 3),
    }
    saturation = simulate(serve, gpu, arch, workload, rate=math.inf, seed=seed)
    for fraction in RATE_FRACTIONS:
        result = simulate(
            serve, gpu, arch, workload, rate=fraction * saturation.request_throughput, seed=seed
        )
        ok = (
            result.stat("ttft", 95) <= scenario.ttft_s
            and result.stat("tpot", 95) <= scenario.tpot_s
            and result.failed == 0
        )
        if ok:
            return Measured(
                None, result.output_throughput, f"SLOs met at {fraction:.0%} of capacity", capacity
            )
    return Measured(Cause.SLO_UNREACHABLE, 0.0, "no rate met the SLOs", capacity)


def grid() -> Iterator[dict[str, FlagValue]]:
    for util, seqs, batched, kv in itertools.product(UTILS, SEQS, BATCHED, KV_DTYPES):
        if batched >= seqs:
            yield {
                "gpu_memory_utilization": util,
                "max_num_seqs": seqs,
                "max_num_batched_tokens": batched,
                "kv_cache_dtype": kv,
            }


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
        self.prelaunch = PreLaunchCheck(model, lambda: study.get_trials(deepcopy=False)) if checks else None

    def screen(self, flags: Mapping[str, FlagValue]) -> Decision:
        violations = self.space.violations(flags)
        if violations:
            shown = tuple(str(v) for v in violations)
            attrs = TrialRecord(launched=False, violations=shown).to_attrs()
            return Decision(TrialOutcome(Cause.INVALID_CONFIG, "rejected: " + shown[0], attrs=attrs))
        return self.prelaunch(flags) if self.prelaunch is not None else Decision(None)

    def launch(
        self, number: int, flags: Mapping[str, FlagValue], decision: Decision, phase: Callable[[str], None]
    ) -> TrialOutcome:
        del number, phase
        measured = self.table[key(flags)]
        attrs = TrialRecord(launched=True, flags=dict(flags), capacity=measured.capacity).to_attrs()
        if decision.prediction is not None:
            attrs["memory_prediction"] = dict(decision.prediction)
        if measured.cause is None:
            return TrialOutcome(None, measured.summary, values=(measured.value, 0.0), attrs=attrs)
        return TrialOutcome(measured.cause, measured.summary, attrs=attrs)

    def confirm(
        self, number: int, flags: Mapping[str, FlagValue], phase: Callable[[str], None]
    ) -> TrialOutcome:
        """The table is the truth: measured again, a config gives the same figures."""
        return self.launch(number, flags, Decision(None), phase)


def run_study_searcher(
    scenario: Scenario, table: Mapping[tuple[Any, ...], Measured], searcher: str, seed: int, launches: int
) -> list[Measured]:
    """The launches of one study, in order."""
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        (base / "space.yaml").write_text(yaml.safe_dump(space_yaml(scenario)))
        spec = {
            "study": {"name": "search", "workdir": str(base)},
            "server": {
                "command": ["sim"],
                "model": scenario.model,
                "args": {"max-model-len": scenario.max_model_len},
            },
            "search_space": "space.yaml",
            "slo": {"terms": [f"ttft:p95<={scenario.ttft_s}s", f"tpot:p95<={scenario.tpot_s}s"]},
            "objectives": [
                {"metric": "slo_throughput", "direction": "maximize"},
                {"metric": "ttft:p95", "direction": "minimize"},
            ],
            "budget": {"launches": launches},
            "finalists": {"count": 0},  # measured again from the same table: nothing to learn
            "sampler": {"name": "random" if searcher == "random" else "tpe", "seed": seed},
        }
        (base / "spec.yaml").write_text(yaml.safe_dump(spec))
        loaded = load_study(base / "spec.yaml")
        study = open_study(loaded, create=True, heartbeat=False)
        if searcher == "tpe":
            study.sampler = optuna.samplers.TPESampler(seed=seed)
        elif searcher == "random":
            study.sampler = optuna.samplers.RandomSampler(seed=seed)
        trials = TableTrials(loaded, study, table, searcher == "autotune", scenario)
        StudyRunner(loaded, study, trials, on_event=lambda _: None, on_stale=lambda _: None).run()
        done = sorted(study.get_trials(deepcopy=False), key=lambda t: t.number)
        return [table[key(TrialRecord.from_trial(t).flags)] for t in done if is_launch(t)]


def run_auto_tune(table: Mapping[tuple[Any, ...], Measured], launches: int) -> list[Measured]:
    """vLLM's auto_tune.sh order (see the module docstring)."""
    out: list[Measured] = []
    chosen = None
    for util in sorted(UTILS, reverse=True):
        if util < 0.9 or len(out) >= launches:
            break
        measured = table[(util, SEQS[-1], BATCHED[-1], "auto")]
        out.append(measured)
        if measured.cause not in FAILED_TO_START:
            chosen = util
            break
    if chosen is None:
        return out
    for seqs, batched in itertools.product(SEQS, BATCHED):
        if len(out) >= launches:
            break
        if batched < seqs:  # vLLM refuses it at start
            out.append(Measured(Cause.INVALID_CONFIG, 0.0, "max_num_batched_tokens < max_num_seqs"))
            continue
        out.append(table[(chosen, seqs, batched, "auto")])
    return out[:launches]


# ----------------------------------------------------------------------------------------------
# Figures
# ----------------------------------------------------------------------------------------------


def figures(runs: Sequence[Measured], optimum: float, launches: int) -> dict[str, float | None]:
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
    failed = sum(1 for m in late if m.cause in FAILED_TO_START)
    last = at.get(len(runs), 0.0)
    return {
        "to95": to95,
        "to98": to98,
        "best15": at.get(15, last) / optimum,
        "best30": at.get(launches, last) / optimum,
        "failed_late": failed / len(late) if late else 0.0,
        "failed_late_n": failed,
        "late_n": len(late),
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
    parser.add_argument("--searchers", default="autotune,tpe,random,auto_tune")
    args = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    searchers = args.searchers.split(",")
    print(
        "| scenario | searcher | launches to 95 % | launches to 98 % | best @15 | best @30 "
        "| failed launches from #11 | seeds at 95 % by 15 / 98 % by 30 |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for scenario in SCENARIOS:
        if args.only and args.only not in scenario.name:
            continue
        started = time.perf_counter()
        workload = synthetic_workload(
            REQUESTS, input_len=scenario.input_len, output_len=scenario.output_len, seed=0
        )
        table = {key(flags): evaluate(scenario, flags, workload) for flags in grid()}
        optimum = max(m.value for m in table.values())
        default = table[key(scenario.defaults)]
        failing = sum(1 for m in table.values() if m.cause in FAILED_TO_START)
        print(
            f"<!-- {scenario.name}: {len(table)} configs in {time.perf_counter() - started:.0f} s, optimum "
            f"{optimum:.0f} tok/s, vLLM defaults {default.value:.0f} ({default.cause or 'ok'}), "
            f"{failing} fail to start -->",
            flush=True,
        )
        for searcher in searchers:
            if searcher == "auto_tune":
                runs = [run_auto_tune(table, args.launches)]  # deterministic: one run
            else:
                runs = [
                    run_study_searcher(scenario, table, searcher, seed, args.launches)
                    for seed in range(args.seeds)
                ]
            got = [figures(r, optimum, args.launches) for r in runs]
            ok95 = sum(1 for g in got if g["to95"] is not None and g["to95"] <= 15)
            ok98 = sum(1 for g in got if g["to98"] is not None and g["to98"] <= args.launches)
            failed = sum(int(g["failed_late_n"] or 0) for g in got)
            late = sum(int(g["late_n"] or 0) for g in got)
            print(
                f"| {scenario.name} | {searcher} | {_spread([g['to95'] for g in got], lambda v: f'{v:.0f}')} "
                f"| {_spread([g['to98'] for g in got], lambda v: f'{v:.0f}')} "
                f"| {_spread([g['best15'] for g in got], lambda v: f'{v:.1%}')} "
                f"| {_spread([g['best30'] for g in got], lambda v: f'{v:.1%}')} "
                f"| {failed}/{late} ({failed / late if late else 0.0:.1%}) "
                f"| {ok95}/{len(got)}, {ok98}/{len(got)} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
