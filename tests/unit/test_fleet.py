"""``--gpus``: GPU sets from the command line, and tensor parallelism that must fit a set."""

from __future__ import annotations

import dataclasses
import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from autotune.errors import SpecError
from autotune.hardware.gpu import HostGpus
from autotune.inputs.loader import load_study
from autotune.study import fleet
from autotune.study.fleet import check_parallelism, gpu_sets, label_of, run_fleet, worker_argv

FOUR = HostGpus(("GPU-a0", "GPU-b1", "GPU-c2", "GPU-d3"))


def test_gpu_sets_split_the_list() -> None:
    """--gpus split into sets of --gpus-per-trial, 'all' from NVML, UUIDs (or their unique starts) kept."""
    assert gpu_sets("0,1,2,3", "2", FOUR) == [("0", "1"), ("2", "3")]
    assert gpu_sets("all", "1", FOUR) == [("0",), ("1",), ("2",), ("3",)]
    assert gpu_sets(" GPU-a , GPU-b1 ", "1", FOUR) == [("GPU-a",), ("GPU-b1",)]
    assert gpu_sets("01", "1", FOUR) == [("1",)]
    assert label_of(("2", "3")) == "gpus-2,3"


def test_without_nvml_gpus_are_refused_unless_asked_for() -> None:
    """NVML sees no GPU: nothing can be checked, so --gpus is refused, naming the variable that allows
    it; with it, the sets are made and only the names' form is checked."""
    with pytest.raises(SpecError) as caught:
        gpu_sets("7", "1", HostGpus())
    assert caught.value.field == "--gpus" and "'7'" in str(caught.value)
    assert "AUTOTUNE_GPUS_WITHOUT_NVML=1" in str(caught.value)
    assert gpu_sets("0,1", "1", HostGpus(), without_nvml=True) == [("0",), ("1",)]
    with pytest.raises(SpecError, match="'abc' is neither a GPU index"):
        gpu_sets("abc", "1", HostGpus(), without_nvml=True)
    with pytest.raises(SpecError, match="'²' is neither a GPU index") as caught:
        gpu_sets("0,²", "1", HostGpus(), without_nvml=True)
    assert caught.value.field == "--gpus"


@pytest.mark.parametrize(
    ("gpus", "per_trial", "field", "words"),
    [
        ("all", "1", "--gpus", "NVML sees no GPU"),
        ("0,,1", "1", "--gpus", "'0,,1'"),
        ("0,0", "1", "--gpus", "names a GPU twice"),
        ("1,01", "1", "--gpus", "names a GPU twice"),
        ("0,1,2", "2", "--gpus-per-trial", "2 does not divide the 3 GPUs"),
        ("0,1", "0", "--gpus-per-trial", "at least 1, got 0"),
        ("0,1", "two", "--gpus-per-trial", "'two' is not a whole number"),
        ("0,1", "-1", "--gpus-per-trial", "'-1' is not a whole number"),
        ("7", "1", "--gpus", "GPU 7 does not exist: NVML sees 4 GPUs"),
        ("0,GPU-zz", "1", "--gpus", "no GPU has UUID 'GPU-zz'"),
        ("0,abc", "1", "--gpus", "'abc' is neither a GPU index"),
        # str.isdigit() takes these, int() does not (a traceback before)
        ("²", "1", "--gpus", "'²' is neither a GPU index"),
        ("0,1²", "1", "--gpus", "'1²' is neither a GPU index"),
        ("0,1", "²", "--gpus-per-trial", "'²' is not a whole number"),
        ("0,1", " 1² ", "--gpus-per-trial", "' 1² ' is not a whole number"),
    ],
)
def test_bad_gpu_sets_name_the_option(gpus: str, per_trial: str, field: str, words: str) -> None:
    """Each bad --gpus / --gpus-per-trial is a SpecError naming the option, with the value."""
    host = HostGpus() if gpus == "all" else FOUR
    with pytest.raises(SpecError) as caught:
        gpu_sets(gpus, per_trial, host)
    assert caught.value.field == field
    assert words in str(caught.value), str(caught.value)


def _loaded(tmp_path: Path, tp: dict[str, object] | None, fixed: int | None = None) -> object:
    params: dict[str, object] = {"max_num_seqs": {"type": "int", "low": 8, "high": 64, "default": 32}}
    if tp is not None:
        params["tensor_parallel_size"] = tp
    (tmp_path / "space.yaml").write_text(yaml.safe_dump({"params": params}))
    args = {"max-model-len": 2048, **({"tensor-parallel-size": fixed} if fixed else {})}
    spec = {
        "study": {"name": "fleet"},
        "server": {"command": ["vllm", "serve", "m"], "model": "m", "args": args},
        "search_space": "space.yaml",
        "slo": {"terms": ["ttft:p95<=1s"]},
    }
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    return load_study(tmp_path / "spec.yaml")


def test_tensor_parallelism_must_fit_each_set(tmp_path: Path) -> None:
    """A space whose larger layouts exceed the set is fine (they are never sampled); one whose smallest
    does, or a fixed size that does, is refused naming the field."""
    fits = _loaded(tmp_path, {"type": "categorical", "choices": [1, 2, 4, 8], "default": 1})
    check_parallelism(fits, 2)  # type: ignore[arg-type]
    check_parallelism(fits, 1)  # type: ignore[arg-type]
    impossible = fits.for_gpus(2).search_space.impossible  # type: ignore[attr-defined]
    assert sorted(i.value for i in impossible if i.param == "tensor_parallel_size") == [4, 8]
    too_big = _loaded(tmp_path, {"type": "categorical", "choices": [2, 4], "default": 2})
    with pytest.raises(
        SpecError, match=r"smallest layout \(tensor_parallel_size 2\) needs more than the 1"
    ) as caught:
        check_parallelism(too_big, 1)  # type: ignore[arg-type]
    assert caught.value.field == "search_space.tensor_parallel_size"
    fixed = _loaded(tmp_path, None, fixed=4)
    with pytest.raises(SpecError) as caught:
        check_parallelism(fixed, 2)  # type: ignore[arg-type]
    assert caught.value.field == "server.args.tensor_parallel_size"


PASSWORD = "pg-PASSWORD-42"
STORAGE = f"postgresql://tuner:{PASSWORD}@db.example:5432/autotune"


def test_the_storage_url_reaches_each_worker_in_its_environment_never_on_its_command_line() -> None:
    """The storage URL may hold a database password (AUTOTUNE_STORAGE from a Kubernetes Secret): every
    user of the host can read a command line (ps, /proc/PID/cmdline), so the workers get it as
    AUTOTUNE_STORAGE, which their --storage reads."""
    command = worker_argv("study.yaml", STORAGE)
    assert command.argv[-3:] == ("tune", "study.yaml", "--no-summary")
    assert not any(PASSWORD in item for item in command.argv), command.argv
    assert PASSWORD not in repr(command)
    shows = "import json, os, sys; print(json.dumps([sys.argv, os.environ.get('AUTOTUNE_STORAGE')]))"
    lines: list[str] = []
    fake = dataclasses.replace(command, argv=(sys.executable, "-c", shows))
    assert (
        run_fleet(fake, [("0",), ("1",)], lines.append, env={"AUTOTUNE_STORAGE": "sqlite:///other.db"}) == 0
    )
    seen = [json.loads(line.split("] ", 1)[1]) for line in lines]
    assert len(seen) == 2
    for argv, storage in seen:
        assert storage == STORAGE and not any(PASSWORD in item for item in argv)
    assert worker_argv("study.yaml", None).env == {}  # the spec's study.storage (or the default), as here


def test_a_signal_while_the_workers_start_stops_the_starting_and_reaches_those_started(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGTERM while the first of three workers starts (before the fleet counted it): no other worker
    starts, the one started gets the signal, and the fleet exits 128 + 15."""
    ready = tmp_path / "ready"
    worker = (
        "import pathlib, signal, sys, time\n"
        "def stop(signum, frame):\n"
        "    print('got', signum, flush=True)\n"
        "    sys.exit(128 + signum)\n"
        "signal.signal(signal.SIGTERM, stop)\n"
        f"pathlib.Path({str(ready)!r}).touch()\n"
        "time.sleep(5)\n"
        "print('never told', flush=True)\n"
    )
    real = subprocess.Popen
    started: list[Any] = []

    def popen(*args: Any, **kwargs: Any) -> Any:
        proc = real(*args, **kwargs)
        started.append(proc)
        if len(started) == 1:  # the signal comes as the first worker is up, before Popen returns
            deadline = time.monotonic() + 10
            while not ready.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            signal.raise_signal(signal.SIGTERM)  # the fleet's handler runs now, in this thread
        return proc

    monkeypatch.setattr(fleet.subprocess, "Popen", popen)
    lines: list[str] = []
    code = run_fleet([sys.executable, "-c", worker], [("0",), ("1",), ("2",)], lines.append)
    assert code == 128 + signal.SIGTERM
    assert len(started) == 1, "no worker starts once a signal came"
    assert lines == [f"[gpus 0] got {int(signal.SIGTERM)}"]
    assert started[0].returncode == 128 + signal.SIGTERM
