"""The gain in GPUs: replicas of the pick and of the defaults for the expected traffic, from their stated
figures, and each one's cost per million output tokens at a GPU's price."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

from autotune.flags import FlagValue
from autotune.inputs.loader import LoadedStudy, load_study
from autotune.outcome import TrialOutcome
from autotune.results.best import best_json, best_table
from autotune.results.export import choose
from autotune.results.serving import gpus_per_replica, serving, serving_lines
from autotune.study.loop import StudyRunner, open_study

from .fake_trials import FakeTrials

SPACE = {"params": {"max_num_seqs": {"type": "categorical", "choices": [64, 256], "default": 256}}}

#: max_num_seqs -> SLO rate (req/s) of one server; 50 output tokens a request.
RATES = {64: 6.0, 256: 4.0}


def measured(flags: Mapping[str, FlagValue]) -> TrialOutcome:
    rate = RATES[int(flags["max_num_seqs"])]
    tput = rate * 50
    estimate = {
        "kind": "crossed",
        "rate": rate,
        "tokens_per_request": 50.0,
        "slo_throughput": tput,
        "slo_throughput_lo": tput * 0.9,
        "slo_throughput_hi": tput * 1.1,
    }
    return TrialOutcome(None, "ok", (tput, 100.0), (-0.5, 0.0), {"estimate": estimate, "flags": dict(flags)})


def study_of(tmp_path: Path, **extra: Any) -> LoadedStudy:
    (tmp_path / "space.yaml").write_text(yaml.safe_dump(SPACE))
    spec = {
        "study": {"name": "gpus"},
        "server": {"command": "vllm serve m", "model": "m", "args": {"tensor-parallel-size": 2}},
        "search_space": "space.yaml",
        "slo": {"terms": ["ttft:p95<=500ms"]},
        "budget": {"launches": 2},
        "finalists": {"count": 0},
        **extra,
    }
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    loaded = load_study(path)
    study = open_study(loaded, create=True, heartbeat=False)
    study.enqueue_trial({"max_num_seqs": 64})

    def run(number: int, flags: Mapping[str, FlagValue], phase: Callable[[str], None]) -> TrialOutcome:
        return measured(flags)

    StudyRunner(loaded, study, FakeTrials(run), on_event=lambda e: None, on_stale=lambda t: None).run()
    return loaded


def test_replicas_and_cost_of_the_pick_and_the_defaults(tmp_path: Path) -> None:
    """20 req/s: the pick (6 req/s a replica, 2 GPUs each) needs 4 replicas, 8 GPUs; the defaults (4 req/s)
    5, 10 GPUs. At $2 a GPU-hour a million tokens cost 2 x 2 / (300 x 3600 / 1e6) = $3.70 for the pick."""
    loaded = study_of(tmp_path, workload={"expected_rate": 20.0}, cost={"gpu_hour": 2.0})
    study = open_study(loaded, create=False, heartbeat=False)
    pick = choose(study, loaded, trial=None, policy=None)
    assert pick.tuned["max_num_seqs"] == 64
    mine = serving(pick, loaded)
    assert mine.rate == pytest.approx(6.0) and mine.gpus_per_replica == 2
    assert (mine.replicas, mine.gpus) == (4, 8)
    assert mine.replicas_range == (4, 4)  # 20 / 6.6 and 20 / 5.4 both round to 4
    assert mine.cost_per_million == pytest.approx(2 * 2 / (300 * 3600 / 1e6))
    assert pick.baseline is not None
    base = serving(choose(study, loaded, trial=pick.baseline.number, policy=None), loaded)
    assert (base.replicas, base.gpus, base.replicas_range) == (5, 10, (5, 6))
    lines = serving_lines(mine, base, loaded)
    assert lines[0] == (
        f"Serving the expected 20 req/s within the SLOs: trial {pick.trial.number} needs 4 replicas "
        "(8 GPUs); vLLM's defaults need 5 replicas (10 GPUs), 5-6 within its interval: 2 GPUs fewer."
    )
    assert lines[1] == (
        f"Cost per million output tokens at its SLO rate ($2 a GPU-hour): trial {pick.trial.number} $3.7, "
        "vLLM's defaults $5.56."
    )
    table = best_table(study, loaded, 200)
    assert lines[0] in table and lines[1] in table
    configs = {c["role"]: c for c in json.loads(best_json(study, loaded))["configs"]}
    assert configs["front"]["replicas"] == 4 and configs["defaults"]["gpus"] == 10
    assert configs["front"]["cost_per_million_output_tokens"] == pytest.approx(mine.cost_per_million)


def test_without_expected_traffic_or_price_nothing_is_said(tmp_path: Path) -> None:
    loaded = study_of(tmp_path)
    study = open_study(loaded, create=False, heartbeat=False)
    mine = serving(choose(study, loaded, trial=None, policy=None), loaded)
    assert mine.replicas is None and mine.cost_per_million is None
    assert serving_lines(mine, None, loaded) == []
    assert "Serving the expected" not in best_table(study, loaded, 200)


@pytest.mark.parametrize(
    ("flags", "gpus"),
    [
        ({}, 1),
        ({"tensor_parallel_size": 4}, 4),
        ({"tensor_parallel_size": 2, "pipeline_parallel_size": 2, "data_parallel_size": 2}, 8),
        ({"tensor_parallel_size": True}, 1),
    ],
)
def test_gpus_per_replica(flags: dict[str, FlagValue], gpus: int) -> None:
    assert gpus_per_replica(flags) == gpus


BAD_COSTS = [{"gpu_hour": 0}, {"gpu_hour": -1}, {"gpu_hour": "cheap"}, {"currency": "$"}]


@pytest.mark.parametrize("given", BAD_COSTS)
def test_bad_cost_is_refused(tmp_path: Path, given: dict[str, Any]) -> None:
    from autotune.errors import SpecError

    with pytest.raises(SpecError, match="cost"):
        study_of(tmp_path, cost=given)
