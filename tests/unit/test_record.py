"""What a trial stores for Optuna and optuna-dashboard (autotune/store/record.py, study.record)."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState

from autotune.flags import FlagValue
from autotune.outcome import TrialOutcome
from autotune.store.record import (
    DASHBOARD_ATTR_LIMIT,
    DETAIL_KEY,
    RECORD_FILE,
    full_record,
    named_constraints,
    stored_attrs,
)

from .fake_trials import FakeTrials
from .test_study import run, write_spec


def _probe(k: int) -> dict[str, Any]:
    """A probe as ProbeReport.as_dict writes it (the demo's shape: about 600 characters)."""
    return {
        "rate": 15.504044 + k,
        "saturation": False,
        "requests": 199,
        "completed": 199,
        "failed": 0,
        "duration_s": 18.135,
        "warmup_s": 3.0,
        "passed": k % 2 == 0,
        "status": "pass" if k % 2 == 0 else "fail",
        "why": "meets every SLO term",
        "early_stopped": False,
        "oversaturated": None,
        "capacity": 14.005718,
        "output_throughput": 741.271 + k,
        "request_throughput": 13.409052,
        "terms": {"ttft:p95": {"value_ms": 159.561, "violation": -0.6809}},
        "server": {"preemptions": 0.0, "kv_usage_peak": 0.2677435144395497, "running_peak": 37.0},
        "prompt_tokens_per_intended": 1.0,
    }


_STATS = ("mean", "median", "std", "p90", "p95", "p99", "max")
_KEYS = [f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for s in _STATS]  # as ProbeMetrics.as_dict
POINT = {key: 1234.567890123456 + i for i, key in enumerate(_KEYS)} | {
    "request_rate": 15.504044462801666,
    "completed": 199,
    "output_throughput": 741.2712532937088,
    "total_token_throughput": 3361.0226446950455,
    "request_goodput": 12.802612319407752,
}


def _dashboard(value: Any) -> str:
    """What optuna-dashboard shows of a non-string attribute (optuna_dashboard/_serializer.py)."""
    return json.dumps(value)


def test_stored_attributes_fit_the_dashboards_limit_and_keep_what_readers_use() -> None:
    """Eight probes (about 5,000 characters) keep each probe's rate, verdict, completed and throughput;
    the operating point keeps every key with 4 significant digits; both fit 1,024 characters, and a
    small attribute is stored as it is."""
    attrs = {"probes": [_probe(k) for k in range(8)], "operating_point": POINT, "summary": "x" * 3000}
    assert len(_dashboard(attrs["probes"])) > 4 * DASHBOARD_ATTR_LIMIT
    stored, shortened = stored_attrs({**attrs, "cause": None, "flags": {"max_num_seqs": 64}})
    assert shortened
    for key in ("probes", "operating_point"):
        assert len(_dashboard(stored[key])) <= DASHBOARD_ATTR_LIMIT, key
    assert [p["status"] for p in stored["probes"]] == [p["status"] for p in attrs["probes"]]
    assert stored["probes"][-1] == {
        "rate": 22.5,
        "status": "fail",
        "completed": 199,
        "failed": 0,
        "output_throughput": 748.3,
    }
    assert stored["operating_point"].keys() == POINT.keys()
    assert len(_dashboard(POINT)) > DASHBOARD_ATTR_LIMIT
    assert stored["operating_point"]["p95_ttft_ms"] == 1239.0
    assert stored["operating_point"]["completed"] == 199
    assert stored["summary"] == attrs["summary"]  # strings are shown whole by the dashboard
    assert stored["flags"] == {"max_num_seqs": 64}
    assert stored_attrs({"flags": {"a": 1}}) == ({"flags": {"a": 1}}, False)


def test_a_list_too_long_even_compacted_keeps_its_last_items() -> None:
    """Log lines beyond the limit keep the last ones (the end of a log says why it stopped)."""
    lines = [f"line {i}: " + "y" * 80 for i in range(40)]
    stored, shortened = stored_attrs({"log_lines": lines})
    assert shortened
    kept = stored["log_lines"]
    assert len(_dashboard(kept)) <= DASHBOARD_ATTR_LIMIT
    assert kept == lines[-len(kept) :] and len(kept) >= 5


def _measured(number: int, flags: Mapping[str, FlagValue], phase: Callable[[str], None]) -> TrialOutcome:
    tput = 100.0 + float(flags["max_num_seqs"])
    return TrialOutcome(
        cause=None,
        summary="ok",
        values=(tput, 120.0),
        constraints=(-0.1, 0.0),
        attrs={
            "probes": [_probe(k) for k in range(6)],
            "operating_point": {**POINT, "output_throughput": tput},
        },
    )


def test_a_study_keeps_the_whole_record_in_the_trials_folder(tmp_path: Path) -> None:
    """A trial whose probes were shortened names `trials/<n>/record.json`; full_record reads every probe
    back from it (and, without the folder, what the trial holds)."""
    loaded = write_spec(tmp_path, trials=3)
    study, _ = run(loaded, FakeTrials(_measured))
    for trial in study.get_trials(states=(TrialState.COMPLETE,)):
        for key, value in trial.user_attrs.items():
            assert isinstance(value, str) or len(_dashboard(value)) <= DASHBOARD_ATTR_LIMIT, key
        assert trial.user_attrs[DETAIL_KEY] == f"trials/{trial.number}/{RECORD_FILE}"
        whole = full_record(trial, loaded.trial_dir(trial.number))
        assert whole.probes == tuple(_probe(k) for k in range(6))
        assert whole.operating_point is not None
        assert whole.operating_point["p95_ttft_ms"] == POINT["p95_ttft_ms"]
        elsewhere = full_record(trial, tmp_path / "elsewhere")
        assert [p["status"] for p in elsewhere.probes] == [p["status"] for p in whole.probes]


def test_a_study_made_with_named_constraints_keeps_them(tmp_path: Path) -> None:
    """A study whose trials carry Optuna 5's named constraints (made before the list was written) gets
    named ones on its new trials too: GPSampler needs the same keys on every trial."""
    loaded = write_spec(tmp_path, trials=4)
    loaded.workdir.mkdir(parents=True)
    storage = optuna.storages.RDBStorage(loaded.storage_url)
    old = optuna.create_study(study_name="unit", storage=storage, directions=["maximize", "minimize"])
    old.add_trial(
        optuna.trial.create_trial(
            params={"max_num_seqs": 64, "gpu_memory_utilization": 0.9},
            distributions={
                "max_num_seqs": optuna.distributions.IntDistribution(8, 256, log=True),
                "gpu_memory_utilization": optuna.distributions.FloatDistribution(0.8, 0.98, step=0.02),
            },
            values=[100.0, 120.0],
            constraints={"slo ttft:p95<=500ms": -0.2, "error budget": 0.0},
            user_attrs={"baseline": True, "launched": True},
        )
    )
    assert named_constraints(old.get_trials())
    study, _ = run(loaded, FakeTrials(_measured))
    for trial in study.get_trials(states=(TrialState.COMPLETE,)):
        assert set(trial.constraints) == {"slo ttft:p95<=500ms", "error budget"}, trial.number
        assert "constraints" not in trial.system_attrs
