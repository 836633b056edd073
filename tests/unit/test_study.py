"""The Optuna wiring: budget, baseline, outcome recording, pruned causes, resume and retries."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

import optuna
import pytest
import yaml
from optuna.trial import TrialState

from autotune.errors import StudyError
from autotune.events import Event
from autotune.loader import LoadedStudy, load_study
from autotune.outcome import Cause, TrialOutcome
from autotune.spec import FlagValue
from autotune.study import StudyRunner, finished_trials, open_study, recover

from .fake_trials import FakeTrials

SPACE = {
    "params": {
        "max_num_seqs": {"type": "int", "low": 8, "high": 256, "log": True, "default": 64},
        "gpu_memory_utilization": {
            "type": "float",
            "low": 0.8,
            "high": 0.98,
            "step": 0.02,
            "default": 0.9,
        },
    }
}


def write_spec(tmp_path: Path, trials: int = 6, **overrides: object) -> LoadedStudy:
    (tmp_path / "space.yaml").write_text(yaml.safe_dump(SPACE))
    spec = {
        "study": {"name": "unit"},
        "server": {"command": ["true"], "model": "m"},
        "search_space": "space.yaml",
        "slo": {"terms": ["ttft:p95<=500ms"]},
        "budget": {"trials": trials},
        "sampler": {"name": "tpe", "seed": 1, "startup_trials": 2},
        **overrides,
    }
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    return load_study(path)


def fake_trial(crash_above: float = 0.94) -> FakeTrials:
    """A deterministic stand-in for a server: OOM above a memory fraction, else a smooth surface."""

    def run(number: int, flags: Mapping[str, FlagValue], phase: Callable[[str], None]) -> TrialOutcome:
        phase("measuring")
        util = float(flags["gpu_memory_utilization"])
        seqs = int(flags["max_num_seqs"])
        if util > crash_above:
            return TrialOutcome(cause=Cause.OOM, summary="CUDA out of memory", attrs={"launched": True})
        tput = 1000.0 * util * min(seqs, 64) / 64
        return TrialOutcome(
            cause=None,
            summary=f"{tput:.0f} tok/s",
            values=(tput, 100.0 + seqs),
            constraints=(-0.1, 0.0),
            attrs={"operating_point": {"output_throughput": tput}},
        )

    return FakeTrials(run)


def run(loaded: LoadedStudy, trials: FakeTrials | None = None) -> tuple[optuna.Study, list[Event]]:
    events: list[Event] = []
    runner = StudyRunner(
        loaded,
        open_study(loaded, create=True),
        trials or fake_trial(),
        on_event=events.append,
        on_stale=lambda t: None,
        sleep=lambda s: None,
    )
    return runner.run(), events


def test_budget_counts_complete_and_pruned_and_baseline_runs_first(tmp_path: Path) -> None:
    """The study stops at the budget of finished trials; trial 0 is the vLLM default config."""
    loaded = write_spec(tmp_path, trials=6)
    study, events = run(loaded)
    finished = finished_trials(study)
    assert len(finished) == 6
    first = study.trials[0]
    assert first.params == {"max_num_seqs": 64, "gpu_memory_utilization": 0.9}
    assert first.user_attrs["baseline"] is True
    assert events[-1].launches == 6
    assert any("measuring" in e.text for e in events)


def test_pruned_trials_carry_their_cause_and_no_values(tmp_path: Path) -> None:
    """A crash is a PRUNED trial with its cause stored, never a made-up objective value."""
    loaded = write_spec(tmp_path, trials=8)
    study, _ = run(loaded, fake_trial(crash_above=0.85))
    pruned = study.get_trials(states=(TrialState.PRUNED,))
    assert pruned, "the fake server crashes above 0.85: some trial must have been pruned"
    for trial in pruned:
        assert trial.user_attrs["cause"] == "oom"
        assert trial.user_attrs["outcome"] == "pruned"
        assert trial.values is None
    for trial in study.get_trials(states=(TrialState.COMPLETE,)):
        assert trial.constraints == {"slo ttft:p95<=500ms": -0.1, "error budget": 0.0}
        assert trial.user_attrs["cause"] is None


def test_rerun_resumes_without_redoing_finished_trials(tmp_path: Path) -> None:
    """Running the same study again with a larger budget continues it; the baseline is not re-queued."""
    loaded = write_spec(tmp_path, trials=3)
    run(loaded)
    bigger = write_spec(tmp_path, trials=5)
    study, _ = run(bigger)
    assert len(finished_trials(study)) == 5
    assert sum(1 for t in study.trials if t.user_attrs.get("baseline")) == 1
    again, events = run(bigger)
    assert len(again.trials) == len(study.trials)
    assert events[-1].text == "study finished"


def test_trial_of_dead_tuner_is_failed_and_requeued_with_same_flags(tmp_path: Path) -> None:
    """A RUNNING trial whose tuner process is gone is marked FAIL and re-queued once, same params."""
    loaded = write_spec(tmp_path, trials=4)
    study = open_study(loaded, create=True, heartbeat=False)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    trial = study.ask()
    trial.suggest_int("max_num_seqs", 8, 256, log=True)
    trial.set_user_attr("worker", f"{socket.gethostname()}:{dead.pid}:1.000")
    stale: list[int] = []
    requeued = recover(study, lambda t: stale.append(t.number))
    assert stale == [trial.number]
    assert requeued == [trial.number]
    states = [t.state for t in study.get_trials()]
    assert states == [TrialState.FAIL, TrialState.WAITING]
    assert study.get_trials()[1].params == trial.params
    # A second recovery does not queue it again.
    assert recover(study, lambda t: None) == []


def test_live_local_worker_trial_is_left_alone(tmp_path: Path) -> None:
    """A RUNNING trial owned by a live tuner on this host is not touched."""
    from autotune.study import worker_id

    loaded = write_spec(tmp_path, trials=4)
    study = open_study(loaded, create=True, heartbeat=False)
    trial = study.ask()
    trial.set_user_attr("worker", worker_id())
    assert recover(study, lambda t: None) == []
    assert study.get_trials()[0].state == TrialState.RUNNING


def test_changed_objectives_are_refused_on_resume(tmp_path: Path) -> None:
    """A stored study created with other objectives cannot be silently reused."""
    loaded = write_spec(tmp_path, trials=2)
    run(loaded)
    other = write_spec(
        tmp_path,
        trials=2,
        objectives=[
            {"metric": "slo_throughput", "direction": "maximize"},
            {"metric": "e2el:p99", "direction": "minimize"},
        ],
    )
    with pytest.raises(StudyError, match="objectives"):
        open_study(other, create=True)


def test_tuner_fault_fails_the_trial_and_stops_the_study(tmp_path: Path) -> None:
    """An error of the tuner's own (not the config's) stops the study; the trial is FAIL, not data."""
    loaded = write_spec(tmp_path, trials=4)

    def broken(number: int, flags: Mapping[str, FlagValue], phase: Callable[[str], None]) -> TrialOutcome:
        raise StudyError("the GPU is held by another process")

    with pytest.raises(StudyError, match="GPU is held"):
        run(loaded, FakeTrials(broken))
    study = open_study(loaded, create=False, heartbeat=False)
    # The trial is given back at once: FAIL, and its config queued again with the same flags.
    assert [t.state for t in study.trials] == [TrialState.FAIL, TrialState.WAITING]
    assert study.trials[0].user_attrs["failed_because"].startswith("StudyError: the GPU is held")
    # Resume runs the failed trial's config before sampling anything new.
    resumed, _ = run(loaded)
    assert resumed.trials[1].params == resumed.trials[0].params
    assert len(finished_trials(resumed)) == 4


def test_missing_study_is_a_clear_error(tmp_path: Path) -> None:
    """Loading a study that was never run names the study and what to do."""
    loaded = write_spec(tmp_path)
    with pytest.raises(StudyError, match="run `autotune tune` first"):
        open_study(loaded, create=False, heartbeat=False)


def test_resumed_study_continues_the_random_stream_instead_of_replaying_it(tmp_path: Path) -> None:
    """A seeded sampler reopened on a study with history does not suggest the first run's configs again."""
    loaded = write_spec(tmp_path, trials=4, sampler={"name": "random", "seed": 5})
    run(loaded)
    first = [t.params for t in open_study(loaded, create=False, heartbeat=False).trials[1:]]
    bigger = write_spec(tmp_path, trials=7, sampler={"name": "random", "seed": 5})
    study, _ = run(bigger)
    second = [t.params for t in study.trials[4:]]
    assert len(second) == 3
    assert not any(p in first for p in second)
