"""The defaults read from the server, environment parameters, unknown flags and the GPU rule, against the
simulated vLLM server as a real subprocess over real HTTP (and the CLI as a real command)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml

from autotune.events import Event
from autotune.hardware.catalog import GIB
from autotune.hardware.gpu import open_device
from autotune.inputs.loader import load_study
from autotune.results.best import best_table
from autotune.results.export import defaults_of
from autotune.results.htmlreport import build_report
from autotune.store.record import TrialRecord, full_record
from autotune.study.loop import open_study
from autotune.study.trial import run_study

from ..unit.test_gpu import FakeNvml

pytestmark = pytest.mark.integration

TUNED = ("--block-size", "--max-num-batched-tokens", "--gpu-memory-utilization", "--enable-prefix-caching")


@pytest.fixture
def marker() -> Iterator[str]:
    """A unique served-model name; every server of the test carries it on its command line."""
    name = f"m-{uuid.uuid4().hex[:10]}"
    yield name
    for proc in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(OSError, psutil.Error):
            if name in " ".join(proc.info["cmdline"] or []) and proc.pid != os.getpid():
                os.killpg(os.getpgid(proc.pid), signal.SIGKILL)


def write_spec(
    tmp_path: Path, marker: str, space: dict[str, Any], *, launches: int, args: dict[str, Any]
) -> Path:
    (tmp_path / "space.yaml").write_text(yaml.safe_dump(space))
    command = [sys.executable, "-m", "autotune.sim", "Llama-3.1-8B", "--served-model-name", marker]
    command += ["--sim-start-delay", "0.2", "--sim-seed", "1"]
    spec = {
        "study": {"name": "flags"},
        "server": {"command": command, "model": marker, "args": {"max-model-len": 2048, **args}, "port": 0},
        "search_space": "space.yaml",
        "workload": {"dataset": {"input_len": 64, "output_len": 16, "prefix_len": 32}, "seed": 3},
        "slo": {"terms": ["ttft:p95<=2s", "tpot:p95<=200ms"]},
        "measurement": {
            "probe_duration": "1s",
            "min_requests": 20,
            "min_tail_samples": 1,
            "saturation_requests": 20,
            "max_probes": 2,
            "precision": 0.2,
            "request_timeout": "20s",
        },
        "budget": {"launches": launches},
        "finalists": {"count": 0},
        "sampler": {"name": "random", "seed": 7},
    }
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_the_defaults_trial_passes_no_tuned_flag_and_records_what_the_server_reported(
    tmp_path: Path, marker: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Trial 0 starts with the fixed flags only; its record holds the simulator's reported values, its
    params take them where the space declares none, a declared default that differs is a warning (the
    record's flags hold what ran), and `best`'s defaults are the reported ones (`best` and the report name
    the disagreement, and the report the GPU NVML named on the trials). A later trial gets its
    environment parameter."""
    space = {
        "name": "t",
        "vllm_versions": ["0.34"],
        "params": {
            "enable_prefix_caching": {"type": "bool", "default": True},
            "block_size": {"type": "categorical", "choices": [16, 32, 64]},
            "max_num_batched_tokens": {"type": "int", "low": 1024, "high": 8192, "log": True},
            "gpu_memory_utilization": {
                "type": "float",
                "low": 0.8,
                "high": 0.98,
                "step": 0.02,
                "default": 0.92,
            },
        },
        "env": {
            "VLLM_USE_FLASHINFER_SAMPLER": {"type": "categorical", "choices": ["0", "1"], "default": "1"}
        },
    }
    path = write_spec(tmp_path, marker, space, launches=2, args={})
    loaded = load_study(path)
    events: list[Event] = []
    gpu = FakeNvml([GIB], name="NVIDIA H100 80GB HBM3")  # the device the trials see, through NVML
    monkeypatch.setattr("autotune.study.trial.open_devices", lambda gpus: open_device(gpu))
    run_study(loaded, on_event=events.append)
    study = open_study(loaded, create=False, heartbeat=False)
    first, second = study.trials[:2]
    record = full_record(first, loaded.trial_dir(first.number))
    assert record.baseline is True
    assert not any(flag in record.argv for flag in TUNED), record.argv
    assert "--max-model-len" in record.argv
    reported = record.reported_defaults or {}
    assert reported["block_size"] == 16 and reported["max_num_batched_tokens"] == 2048
    assert reported["gpu_memory_utilization"] == 0.9 and reported["enable_prefix_caching"] is True
    assert reported["_source"]["block_size"] == "autotune.sim effective config line"
    assert first.params["block_size"] == 16 and first.params["max_num_batched_tokens"] == 2048
    assert first.params["gpu_memory_utilization"] == 0.92, "a declared default stays the param"
    assert record.flags["gpu_memory_utilization"] == 0.9, "the record's flags are what the trial ran"
    assert any("gpu_memory_utilization: the space declares 0.92" in w for w in record.default_warnings)
    assert any("warning: gpu_memory_utilization" in e.text for e in events)
    assert "VLLM_USE_FLASHINFER_SAMPLER" not in (loaded.trial_dir(0) / "server.log").read_text()
    log = (loaded.trial_dir(second.number) / "server.log").read_text()
    chosen = second.params["VLLM_USE_FLASHINFER_SAMPLER"]
    assert f"autotune.sim environment (not simulated): {{'VLLM_USE_FLASHINFER_SAMPLER': '{chosen}'}}" in log
    assert "--block-size" in TrialRecord.from_trial(second).argv
    defaults = defaults_of(loaded, first)
    assert defaults["gpu_memory_utilization"] == 0.9 and defaults["block_size"] == 16
    said = "gpu_memory_utilization: the space declares 0.92 as vLLM's default"
    assert said in " ".join(best_table(study, loaded, 200).split()), "best names the disagreement"
    page = build_report(study, loaded)
    assert said.replace("'", "&#x27;") in page, "so does the report"
    assert record.gpu == "NVIDIA H100 80GB HBM3" and "<td>NVIDIA H100 80GB HBM3</td>" in page


@pytest.mark.slow
def test_a_flag_the_server_does_not_know_ends_the_trial_as_invalid_config_naming_it(
    tmp_path: Path, marker: str
) -> None:
    """vLLM 0.34 removed --max-num-partial-prefills: the defaults run, the trial that passes it is
    invalid_config naming the flag; `validate` warned about it before anything ran."""
    space = {
        "vllm_versions": ["0.34"],
        "params": {"max_num_partial_prefills": {"type": "int", "low": 2, "high": 4}},
    }
    path = write_spec(tmp_path, marker, space, launches=2, args={})
    checked = subprocess.run(
        [sys.executable, "-c", "from autotune.cli import main; main()", "validate", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert checked.returncode == 0, checked.stderr
    assert "vLLM 0.34.0 has no --max-num-partial-prefills" in checked.stderr
    loaded = load_study(path)
    run_study(loaded, on_event=lambda _: None)
    study = open_study(loaded, create=False, heartbeat=False)
    refused = TrialRecord.from_trial(study.trials[1])
    assert refused.cause == "invalid_config"
    assert "does not know the flag --max-num-partial-prefills" in refused.summary
    assert TrialRecord.from_trial(study.trials[0]).outcome == "complete"


def test_tp_times_dp_above_the_trials_gpus_is_refused_before_any_launch(tmp_path: Path, marker: str) -> None:
    """Fixed TP 2 x DP 2 on a two-GPU trial: one line naming the flags and the GPUs, exit 2, nothing
    written."""
    space = {"params": {"max_num_seqs": {"type": "int", "low": 8, "high": 64, "default": 16}}}
    path = write_spec(
        tmp_path, marker, space, launches=1, args={"tensor-parallel-size": 2, "data-parallel-size": 2}
    )
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "0,1", "AUTOTUNE_GPUS_WITHOUT_NVML": "1"}
    done = subprocess.run(
        [sys.executable, "-c", "from autotune.cli import main; main()", "tune", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "= 4 GPUs, more than the 2 GPUs of each trial" in lines[0], done.stderr
    assert not (tmp_path / "flags").exists()
