"""How conservative and how useful the pre-launch memory prediction is, against the simulator's startup.

For each shipped GPU search space and a few model/GPU pairs, sample configs at random (configs that break
the space's known constraints are left out: they are never launched anyway), start each one with the
simulator's in-process startup checks (:func:`autotune.sim.startup.plan_startup`) under several
independent seeds (the OOM edge at CUDA-graph capture is random), and compare with
:meth:`autotune.predict.feasibility.MemoryModel.predict` (uncalibrated: the worst case, before any trial ran).

Figures:
* skipped-but-ran: configs predicted infeasible that started under at least one seed (must be 0);
* caught: configs that failed at start (oom / kv_too_small) under every seed and were predicted
  infeasible (target >= 90 %);
* launch-level: failed launches avoided / all failed launches (includes the random edge band).

Run: ``python -m benchmarks.feasibility [--configs 1500] [--seeds 5]`` (results: benchmarks/RESULTS.md)
"""

from __future__ import annotations

import argparse
import random
import zlib
from pathlib import Path

import optuna

from autotune.hardware.catalog import GPUS, MODELS
from autotune.inputs.space import SearchSpace
from autotune.inputs.spec import load_space
from autotune.predict.feasibility import MemoryModel
from autotune.sim.flags import ServeFlags
from autotune.sim.startup import StartFailure, plan_startup
from benchmarks import QUICK_HELP

ROOT = Path(__file__).resolve().parents[1]
CASES = [
    ("sim.yaml", "Llama-3.1-8B", "RTX-4090-24GB", 2048, 1),
    ("sim.yaml", "Mistral-7B", "RTX-4090-24GB", 8192, 1),
    ("vllm-0.34.yaml", "Llama-3.1-8B", "L40S-48GB", 8192, 1),
    ("vllm-0.34.yaml", "Llama-3.1-70B", "H100-80GB", 8192, 4),
    ("vllm-0.34.yaml", "Qwen2.5-7B", "RTX-4090-24GB", 32768, 1),
    ("vllm-legacy.yaml", "Qwen2.5-7B", "A100-80GB", 32768, 1),
    ("vllm-legacy.yaml", "Mixtral-8x7B", "H100-80GB", 32768, 2),
]
MEMORY_FAILURES = (StartFailure.OOM, StartFailure.KV_TOO_SMALL)


def run_case(
    space_file: str, model: str, gpu: str, mml: int, tp: int, configs: int, seeds: int
) -> dict[str, int]:
    """Counts for one space / model / GPU: classes of configs and what the prediction did with them."""
    fixed = {"max_model_len": mml, "tensor_parallel_size": tp}
    space = SearchSpace(load_space(ROOT / "search_spaces" / space_file), fixed)
    arch, profile = MODELS[model], GPUS[gpu]
    predictor = MemoryModel(arch, profile, fixed)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    out = dict.fromkeys(
        ("configs", "invalid", "always_ran", "sometimes", "always_failed", "skipped_but_ran", "caught",
         "launches_failed", "launches_avoided", "skipped"), 0)  # fmt: skip
    for _ in range(configs):
        trial = study.ask()
        flags = space.suggest(trial)
        study.tell(trial, 0.0)
        if space.violations(flags):
            continue
        serve = ServeFlags(model=model, hardware=profile, **fixed, **flags)  # type: ignore[arg-type]
        base = zlib.crc32(repr(sorted(flags.items())).encode())
        starts = [plan_startup(serve, arch, random.Random(base * 1000 + s)) for s in range(seeds)]
        if any(p.failure == StartFailure.INVALID_CONFIG for p in starts):
            out["invalid"] += 1  # the attention backend refuses it: not a memory question
            continue
        out["configs"] += 1
        ran = sum(p.ok for p in starts)
        skipped = not predictor.predict(flags).feasible
        out["skipped"] += skipped
        failed = sum(p.failure in MEMORY_FAILURES for p in starts)
        out["launches_failed"] += failed
        out["launches_avoided"] += failed if skipped else 0
        if ran == seeds:
            out["always_ran"] += 1
        elif ran == 0:
            out["always_failed"] += 1
            out["caught"] += skipped
        else:
            out["sometimes"] += 1
        if ran and skipped:
            out["skipped_but_ran"] += 1
    return out


def main() -> None:
    """Run every case and print (or write) the results table."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--configs", type=int, default=1500)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help=QUICK_HELP)
    args = parser.parse_args()
    if args.quick:
        args.configs, args.seeds = 30, 2
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    header = (
        "| space | model | GPU | max_model_len | TP | configs | always ran | sometimes | always failed "
        "| caught | skipped but ran | failed launches avoided |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    rows = [header]
    total = dict.fromkeys(
        ("always_failed", "caught", "skipped_but_ran", "launches_failed", "launches_avoided"), 0
    )
    for case in CASES:
        r = run_case(*case, configs=args.configs, seeds=args.seeds)
        for key in total:
            total[key] += r[key]
        caught = f"{r['caught']}/{r['always_failed']}" + (
            f" ({100 * r['caught'] / r['always_failed']:.0f} %)" if r["always_failed"] else ""
        )
        avoided = f"{r['launches_avoided']}/{r['launches_failed']}" + (
            f" ({100 * r['launches_avoided'] / r['launches_failed']:.0f} %)" if r["launches_failed"] else ""
        )
        rows.append(
            f"| {case[0]} | {case[1]} | {case[2]} | {case[3]} | {case[4]} | {r['configs']} "
            f"| {r['always_ran']} "
            f"| {r['sometimes']} | {r['always_failed']} | {caught} | {r['skipped_but_ran']} | {avoided} |"
        )
        print(rows[-1], flush=True)
    summary = (
        f"\nAll cases: caught {total['caught']}/{total['always_failed']} "
        f"({100 * total['caught'] / max(1, total['always_failed']):.1f} %) of the configs that failed "
        "at start "
        f"under every seed; skipped but ran: {total['skipped_but_ran']}; failed launches avoided "
        f"{total['launches_avoided']}/{total['launches_failed']} "
        f"({100 * total['launches_avoided'] / max(1, total['launches_failed']):.1f} %)."
    )
    print(summary)


if __name__ == "__main__":
    main()
