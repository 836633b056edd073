"""A realistic finished study without a server, for tests of what reads a study (report, status): the real
study loop (:class:`autotune.study.loop.StudyRunner`) over SQLite, with a stand-in server whose outcomes carry
the keys a real trial stores (estimate, operating point, probes) and whose probe files hold per-request
``vllm bench serve`` arrays. Some configs OOM, some miss every SLO, some are ruled out before a launch.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import yaml

from autotune.events import EventLog
from autotune.flags import FlagValue
from autotune.inputs.loader import LoadedStudy, load_study
from autotune.outcome import Cause, TrialOutcome
from autotune.predict.feasibility import Decision
from autotune.study.loop import StudyRunner, close_study, open_study

from .fake_trials import FakeTrials

SPACE = {
    "params": {
        "gpu_memory_utilization": {"type": "float", "low": 0.8, "high": 0.98, "step": 0.02, "default": 0.9},
        "max_num_seqs": {"type": "int", "low": 8, "high": 512, "log": True, "default": 256},
        "block_size": {"type": "categorical", "choices": [16, 32], "default": 16},
        "kv_cache_dtype": {"type": "categorical", "choices": ["auto", "fp8"], "default": "auto"},
    }
}
TTFT_LIMIT_MS = 500.0
TPOT_LIMIT_MS = 50.0


def throughput(flags: Mapping[str, FlagValue]) -> float:
    """The stand-in's SLO-constrained throughput: grows with max_num_seqs up to 128, with utilization,
    a little with fp8."""
    seqs = min(int(flags["max_num_seqs"]), 128)
    util = float(flags["gpu_memory_utilization"])
    fp8 = 1.08 if flags["kv_cache_dtype"] == "fp8" else 1.0
    return round(8.0 * seqs * util * fp8, 3)


def _probe_file(path: Path, rate: float, rng: random.Random, ttft_ms: float, tpot_ms: float) -> None:
    """A probe in ``vllm bench serve --save-detailed`` form: 60 requests, the first 10 warm-up, one
    failed; seconds in the arrays."""
    n = 60
    ttfts, latencies, outputs, errors = [], [], [], []
    for i in range(n):
        ttft = max(0.005, rng.gauss(ttft_ms, ttft_ms / 4)) / 1000
        tokens = rng.randint(8, 40)
        tpot = max(0.002, rng.gauss(tpot_ms, tpot_ms / 5)) / 1000
        ttfts.append(ttft)
        latencies.append(ttft + tpot * (tokens - 1))
        outputs.append(tokens)
        errors.append("timeout" if i == 30 else "")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps(
            {
                "request_rate": rate,
                "rate": rate,
                "ttfts": ttfts,
                "latencies": latencies,
                "output_lens": outputs,
                "errors": errors,
                "itls": [[] for _ in range(n)],
                "request_ids": [f"autotune-abc-p1-{i}" for i in range(n)],
                "judged": [10, n],
            }
        )
    )


class StandIn(FakeTrials):
    """Configs asking the most memory are ruled out before a launch (as the memory model would)."""

    def screen(self, flags: Mapping[str, FlagValue]) -> Decision:
        if float(flags["gpu_memory_utilization"]) >= 0.96 and int(flags["max_num_seqs"]) >= 200:
            outcome = TrialOutcome(
                Cause.PREDICTED_INFEASIBLE, "the memory model says it cannot start", attrs={"launched": False}
            )
            return Decision(outcome)
        return Decision(None)


def stand_in(loaded_of: Callable[[], LoadedStudy]) -> StandIn:
    """A server stand-in that writes probe files into the study's trial folders."""

    def run(number: int, flags: Mapping[str, FlagValue], phase: Callable[[str], None]) -> TrialOutcome:
        phase("starting server")
        phase("probe 1 at rate inf")
        util = float(flags["gpu_memory_utilization"])
        seqs = int(flags["max_num_seqs"])
        if util >= 0.92 and seqs >= 64:
            return TrialOutcome(Cause.OOM, "CUDA out of memory", attrs={"launched": True})
        if seqs < 16:
            return TrialOutcome(
                Cause.SLO_UNREACHABLE, "no probed rate met every SLO term", attrs={"launched": True}
            )
        tput = throughput(flags)
        tokens = 24.0
        rate = tput / tokens
        ttft, tpot = 60.0 + seqs * 0.8, 20.0 + seqs * 0.05
        rng = random.Random(number)
        probes = [
            {"rate": None, "saturation": True, "passed": False, "status": "fail", "capacity": rate * 1.4,
             "why": "fail: ttft"},
            {"rate": rate * 0.97, "saturation": False, "passed": True, "status": "pass",
             "why": "meets every SLO term"},
            {"rate": rate * 1.1, "saturation": False, "passed": False, "status": "fail",
             "why": "fail: tpot:p95"},
        ]  # fmt: skip
        curve = {  # each finite probe's SLO terms in seconds, as judge.py stores them
            "terms": ["ttft:p95", "tpot:p95"],
            "points": [
                [rate * 0.97, ttft * 1.4 / 1000, tpot * 1.2 / 1000],
                [rate * 1.1, ttft * 1.7 / 1000, tpot * 1.5 / 1000],
            ],
            "capacity": rate * 1.4,
        }
        folder = loaded_of().trial_dir(number) / "probes"
        _probe_file(folder / "probe-2.json", rate * 0.97, rng, ttft, tpot)
        attrs: dict[str, Any] = {
            "launched": True,
            "server_version": "0.34.0",
            "estimate": {
                "rate": rate,
                "rate_lo": rate * 0.9,
                "rate_hi": rate * 1.12,
                "binding": "tpot:p95",
                "slo_throughput": tput,
                "slo_throughput_lo": tput * 0.9,
                "slo_throughput_hi": tput * 1.12,
            },
            "operating_point": {
                "request_rate": rate * 0.97,
                "output_throughput": tput * 0.97,
                "p95_ttft_ms": ttft * 1.4,
                "p95_tpot_ms": tpot * 1.2,
                "p99_e2el_ms": 900.0 + seqs,
            },
            "probes": probes,
            "curve": curve,
        }
        return TrialOutcome(
            None,
            f"slo_throughput={tput:.1f}",
            values=(tput, ttft * 1.4),
            constraints=(ttft * 1.4 / TTFT_LIMIT_MS - 1, tpot * 1.2 / TPOT_LIMIT_MS - 1, 0.0),
            attrs=attrs,
        )

    return StandIn(run)


def write_spec(root: Path, *, launches: int = 14, name: str = "rep", **extra: Any) -> Path:
    """The spec (and search space) of the stand-in study in ``root``."""
    (root / "space.yaml").write_text(yaml.safe_dump(SPACE))
    spec = {
        "study": {"name": name},
        "server": {
            "command": ["vllm", "serve", "my/model"],
            "model": "my/model",
            "args": {"max-model-len": 4096},
        },
        "search_space": "space.yaml",
        "slo": {"terms": [f"ttft:p95<={TTFT_LIMIT_MS:g}ms", f"tpot:p95<={TPOT_LIMIT_MS:g}ms"]},
        "budget": {"launches": launches},
        "finalists": {"count": 0},
        "sampler": {"name": "random", "seed": 2},
        **extra,
    }
    path = root / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def run_study(root: Path, *, launches: int = 14, **extra: Any) -> LoadedStudy:
    """Run the stand-in study to its budget (events in ``<workdir>/events.jsonl``); returns it loaded.
    With the default seed it has OOMs, configs that met no SLO, and one config ruled out before launch."""
    loaded = load_study(write_spec(root, launches=launches, **extra))
    study = open_study(loaded, create=True)
    study.enqueue_trial(
        {"gpu_memory_utilization": 0.98, "max_num_seqs": 400, "block_size": 32, "kv_cache_dtype": "fp8"}
    )
    try:
        StudyRunner(
            loaded,
            study,
            stand_in(lambda: loaded),
            on_event=EventLog(loaded.workdir / "events.jsonl"),
            on_stale=lambda t: None,
            sleep=lambda s: None,
        ).run()
    finally:
        close_study(study)
    return loaded
