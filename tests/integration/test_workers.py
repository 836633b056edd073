"""Several tuners on one study at once (the several-GPUs recipe): the budget stays exact, the vLLM defaults
are queued once, no config runs twice, and a worker that is killed gives its trial back."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from autotune.inputs.loader import load_study
from autotune.store.record import TrialRecord
from autotune.study.loop import close_study, open_study

from .faults import (
    MARKER_VAR,
    Tuner,
    autotune,
    check_study,
    marked_processes,
    marker_cleanup,
    whole_lines,
    write_spec,
)

pytestmark = pytest.mark.integration


@pytest.fixture
def marker() -> Iterator[str]:
    name = f"workers-{uuid.uuid4().hex[:10]}"
    with marker_cleanup(name):
        yield name


def _baselines(spec: Path) -> list[int]:
    study = open_study(load_study(spec), create=False, heartbeat=False)
    try:
        trials = study.get_trials(deepcopy=False)
    finally:
        close_study(study)
    return [
        t.number
        for t in trials
        if TrialRecord.from_trial(t).baseline and TrialRecord.from_trial(t).retry_of is None
    ]


STORAGES = ["sqlite", "journal", "postgresql"]


def _storage_url(storage: str, tmp_path: Path, request: pytest.FixtureRequest) -> str | None:
    """The study's storage: the default SQLite file, a journal file, or a new database on the session's
    private PostgreSQL server (skipped with the reason when none can be started)."""
    if storage == "sqlite":
        return None
    if storage == "journal":
        return f"journal:///{tmp_path / 'faults' / 'study.log'}"
    return str(request.getfixturevalue("new_postgres_url"))


@pytest.mark.slow
@pytest.mark.parametrize("storage", STORAGES)
def test_two_tuners_started_together_share_one_budget(
    tmp_path: Path, marker: str, storage: str, request: pytest.FixtureRequest
) -> None:
    """Two tuners started at the same moment on a new study: both exit 0, exactly the budget is launched,
    the defaults are queued once, no config is launched twice."""
    spec = write_spec(tmp_path, marker, launches=4, storage=_storage_url(storage, tmp_path, request))
    tuners = [Tuner(spec, tmp_path / f"w{k}.out", marker) for k in range(2)]
    codes = [t.wait(300) for t in tuners]
    outputs = [(tmp_path / f"w{k}.out").read_text() for k in range(2)]
    assert codes == [0, 0], outputs
    check_study(spec, marker, 4)
    assert len(_baselines(spec)) == 1, "the vLLM defaults were queued once"
    assert any("finished" in out for out in outputs)


@pytest.mark.slow
@pytest.mark.parametrize("storage", STORAGES)
def test_a_killed_worker_gives_its_trial_back_to_the_others(
    tmp_path: Path, marker: str, storage: str, request: pytest.FixtureRequest
) -> None:
    """Three tuners started together on one study with a budget of 9; one is killed with SIGKILL
    mid-trial: the others finish the budget exactly, the killed trial is retried once, no config is
    launched twice, nothing is left running, both exit 0."""
    url = _storage_url(storage, tmp_path, request)
    spec = write_spec(tmp_path, marker, launches=9, sim_flags=("--sim-speedup", "0.5"), storage=url)
    tuners = [Tuner(spec, tmp_path / f"w{k}.out", marker) for k in range(3)]
    victim = tuners[1]
    ready = victim.wait_for(lambda e: e["kind"] == "phase" and e["text"].startswith("ready in")
                            and e["worker"].split(":")[1] == str(victim.proc.pid), timeout=120)  # fmt: skip
    assert ready is not None, (tmp_path / "w1.out").read_text()
    time.sleep(0.3)
    victim.signal(signal.SIGKILL)
    assert victim.wait(30) == -9
    codes = [t.wait(400) for t in (tuners[0], tuners[2])]
    assert codes == [0, 0], [(tmp_path / f"w{k}.out").read_text() for k in (0, 2)]
    counts = check_study(spec, marker, 9)
    assert counts["failed"] >= 1, "the killed worker's trial was given back"


@contextlib.contextmanager
def _fleet(spec: Path, out: Path, marker: str, *gpus_args: str) -> Iterator[subprocess.Popen[bytes]]:
    """`autotune tune SPEC --gpus ...` as a real process, its output in ``out``; told to run without NVML
    (``AUTOTUNE_GPUS_WITHOUT_NVML=1``) where it sees no GPU, as on the test machines."""
    with out.open("w") as file:
        proc = subprocess.Popen(
            autotune("tune", str(spec), *gpus_args),
            stdout=file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, MARKER_VAR: marker, "AUTOTUNE_GPUS_WITHOUT_NVML": "1"},
        )
        try:
            yield proc
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=30)


@pytest.mark.slow
def test_one_command_runs_one_worker_per_gpu_set(tmp_path: Path, marker: str) -> None:
    """`tune --gpus 0,1` (no GPU here: the simulated server ignores CUDA_VISIBLE_DEVICES): two workers share
    the budget exactly, their lines come prefixed with their set, one summary at the end."""
    spec = write_spec(tmp_path, marker, launches=4)
    with _fleet(spec, tmp_path / "fleet.out", marker, "--gpus", "0,1") as proc:
        assert proc.wait(300) == 0, (tmp_path / "fleet.out").read_text()
    output = (tmp_path / "fleet.out").read_text()
    assert "[gpus 0] " in output and "[gpus 1] " in output
    assert output.count("Pareto front of study") == 1
    check_study(spec, marker, 4)
    lines = (load_study(spec).workdir / "events.jsonl").read_text().splitlines()
    assert len({json.loads(line)["worker"] for line in lines if line.strip()}) == 2


@pytest.mark.slow
def test_sigterm_to_the_fleet_stops_every_worker(tmp_path: Path, marker: str) -> None:
    """SIGTERM to `tune --gpus`: every worker stops its server and gives its trial back (exit 143, nothing
    left running); a rerun finishes the study."""
    spec = write_spec(tmp_path, marker, launches=4, sim_flags=("--sim-speedup", "0.5"))
    events_path = load_study(spec).workdir / "events.jsonl"
    with _fleet(spec, tmp_path / "fleet.out", marker, "--gpus", "0,1") as proc:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            events = [json.loads(line) for line in whole_lines(events_path) if line.strip()]
            ready = {e["worker"] for e in events if e["kind"] == "phase" and e["text"].startswith("ready")}
            if len(ready) >= 2:
                break
            time.sleep(0.1)
        else:
            raise AssertionError((tmp_path / "fleet.out").read_text())
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 128 + signal.SIGTERM, (tmp_path / "fleet.out").read_text()
    output = (tmp_path / "fleet.out").read_text()
    assert "Traceback" not in output and "interrupted by SIGTERM" in output
    assert marked_processes(marker) == []
    again = Tuner(spec, tmp_path / "again.out", marker)
    assert again.wait(300) == 0, (tmp_path / "again.out").read_text()
    check_study(spec, marker, 4)
