"""The Optuna wiring: budget, baseline, outcome recording, pruned causes, resume and retries."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

import optuna
import pytest
import yaml
from optuna.trial import TrialState

from autotune.errors import Interrupted, PortInUseError, StudyError
from autotune.events import Event
from autotune.flags import FlagValue
from autotune.inputs.loader import LoadedStudy, load_study
from autotune.interrupts import stop_on_signals
from autotune.outcome import Cause, TrialOutcome
from autotune.study.defaults_trial import baseline_elsewhere, ensure_baseline
from autotune.study.loop import StudyRunner, close_study, default_trial, open_study, sampler_seed
from autotune.study.recovery import recover
from autotune.study.standing import finished_trials

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
        # The list optuna-dashboard reads, which Optuna reads as constraints "0", "1" (once each).
        assert trial.system_attrs["constraints"] == [-0.1, 0.0]
        assert trial.constraints == {"0": -0.1, "1": 0.0}
        assert trial.user_attrs["cause"] is None
    assert study.user_attrs["constraints"] == ["slo ttft:p95<=500ms", "error budget"]


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
    assert events[-1].text.startswith("study finished: ")


def test_trial_of_dead_tuner_is_failed_and_requeued_with_same_flags(tmp_path: Path) -> None:
    """A RUNNING trial whose tuner process is gone is marked FAIL and re-queued once, same params."""
    loaded = write_spec(tmp_path, trials=4)
    study = open_study(loaded, create=True, heartbeat=False)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=30)
    trial = study.ask()
    trial.suggest_int("max_num_seqs", 8, 256, log=True)
    trial.set_user_attr("worker", f"{socket.gethostname()}:{dead.pid}:1.000")
    stale: list[int] = []
    requeued = recover(study, lambda t: stale.append(t.number), 3)
    assert stale == [trial.number]
    assert requeued == [trial.number]
    states = [t.state for t in study.get_trials()]
    assert states == [TrialState.FAIL, TrialState.WAITING]
    assert study.get_trials()[1].params == trial.params
    # A second recovery does not queue it again.
    assert recover(study, lambda t: None, 3) == []


def test_live_local_worker_trial_is_left_alone(tmp_path: Path) -> None:
    """A RUNNING trial owned by a live tuner on this host is not touched."""
    from autotune.study.recovery import worker_id

    loaded = write_spec(tmp_path, trials=4)
    study = open_study(loaded, create=True, heartbeat=False)
    trial = study.ask()
    trial.set_user_attr("worker", worker_id())
    assert recover(study, lambda t: None, 3) == []
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
    assert not loaded.workdir.exists(), "reading a study creates no storage"


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


def _port_taken_until(attempt: int, calls: list[int]) -> FakeTrials:
    """A stand-in whose first ``attempt - 1`` launches find the port taken (the tuner's fault), then work."""
    works = fake_trial()

    def run(number: int, flags: Mapping[str, FlagValue], phase: Callable[[str], None]) -> TrialOutcome:
        calls.append(number)
        if len(calls) < attempt:
            raise PortInUseError("port 8000 on 127.0.0.1 is already in use by pid 1 (x): stop it")
        return works.run(number, flags, phase)

    return FakeTrials(run)


def _baseline_chain(study: optuna.Study) -> list[tuple[int, str, str | None]]:
    return [
        (t.number, t.state.name, t.user_attrs.get("failed_because"))
        for t in study.get_trials()
        if t.user_attrs.get("baseline")
    ]


def test_the_defaults_are_measured_when_the_port_frees_before_the_last_retry(tmp_path: Path) -> None:
    """A port taken for faults.retries attempts and freed before the next: every attempt was the baseline
    (its config is queued again as often as the fault is retried), so the defaults are measured."""
    loaded = write_spec(tmp_path, trials=3, faults={"retries": 3, "pause": "1ms"})
    calls: list[int] = []
    study, _ = run(loaded, _port_taken_until(4, calls))
    chain = _baseline_chain(study)
    assert [state for _, state, _ in chain] == ["FAIL", "FAIL", "FAIL", "COMPLETE"]
    assert calls[:4] == [n for n, _, _ in chain]
    baseline = default_trial(study)
    assert baseline is not None and baseline.state == TrialState.COMPLETE


def test_the_defaults_given_up_every_retry_are_still_queued_and_measured_on_the_next_run(
    tmp_path: Path,
) -> None:
    """A port held through every retry stops the study; the baseline is never given up for good: its
    config is still queued, and the next run measures it first."""
    loaded = write_spec(tmp_path, trials=3, faults={"retries": 2, "pause": "1ms"})
    with pytest.raises(PortInUseError):
        run(loaded, _port_taken_until(100, []))
    study = open_study(loaded, create=False, heartbeat=False)
    chain = _baseline_chain(study)
    assert [state for _, state, _ in chain] == ["FAIL", "FAIL", "FAIL", "WAITING"]
    assert not any(why and "not retried" in why for _, _, why in chain)
    resumed, _ = run(loaded)
    baseline = default_trial(resumed)
    assert baseline is not None and baseline.number == chain[-1][0]
    assert len(finished_trials(resumed)) == 3


def test_another_config_is_given_up_after_faults_retries(tmp_path: Path) -> None:
    """A config other than the defaults that the tuner fails on every time is tried faults.retries + 1
    times, then given up with that count in its record (not queued again)."""
    loaded = write_spec(tmp_path, trials=4, faults={"retries": 2, "pause": "1ms"})
    works = fake_trial()

    def defaults_only(
        number: int, flags: Mapping[str, FlagValue], phase: Callable[[str], None]
    ) -> TrialOutcome:
        if flags != {"max_num_seqs": 64, "gpu_memory_utilization": 0.9}:
            raise PortInUseError("port 8000 is already in use")
        return works.run(number, flags, phase)

    with pytest.raises(PortInUseError):
        run(loaded, FakeTrials(defaults_only))
    trials = open_study(loaded, create=False, heartbeat=False).get_trials()
    assert [t.state.name for t in trials] == ["COMPLETE", "FAIL", "FAIL", "FAIL"]
    assert len({json.dumps(t.params, sort_keys=True) for t in trials[1:]}) == 1
    assert [t.user_attrs.get("retry_of") for t in trials[1:]] == [None, 1, 2]
    assert (
        "not retried: its config was given up 3 times (faults.retries is 2)"
        in trials[3].user_attrs["failed_because"]
    )


def test_a_study_whose_defaults_were_given_up_for_good_queues_them_again(tmp_path: Path) -> None:
    """A study left with its baseline FAIL and no retry (as an earlier version gave it up after three
    faults) queues the defaults again on the next run and measures them."""
    loaded = write_spec(tmp_path, trials=3)
    study = open_study(loaded, create=True, heartbeat=False)
    trial = study.ask()
    loaded.search_space.suggest(trial)
    trial.set_user_attr("failed_because", "PortInUseError: x; not retried: its config was given up 3 times")
    study.tell(trial, state=TrialState.FAIL)
    close_study(study)
    resumed, events = run(loaded)
    baseline = default_trial(resumed)
    assert baseline is not None and baseline.state == TrialState.COMPLETE
    assert baseline.user_attrs["retry_of"] == trial.number
    assert any("defaults were never measured" in e.text for e in events)


def test_no_baseline_is_queued_when_the_budget_is_spent(tmp_path: Path) -> None:
    """A study whose launches are all spent gets no new baseline (it would wait for ever): the budget
    stays exact and nothing is left queued."""
    loaded = write_spec(tmp_path, trials=1)
    study = open_study(loaded, create=True, heartbeat=False)
    trial = study.ask()
    loaded.search_space.suggest(trial)
    study.tell(trial, state=TrialState.FAIL)
    other = study.ask({"max_num_seqs": optuna.distributions.IntDistribution(8, 256, log=True)})
    other.set_user_attr("launched", True)
    study.tell(other, state=TrialState.PRUNED)
    assert ensure_baseline(study, loaded) is None
    assert not study.get_trials(states=(TrialState.WAITING,))


def test_no_new_study_is_made_beside_the_trial_folders_of_an_old_one(tmp_path: Path) -> None:
    """A study folder with trial folders but a storage without the study (the database removed, emptied
    or replaced): refused before anything is opened, and no database file is created."""
    loaded = write_spec(tmp_path, trials=2)
    run(loaded)
    for number in (0, 1):
        loaded.trial_dir(number).mkdir(parents=True, exist_ok=True)
    (loaded.workdir / "study.db").unlink()
    with pytest.raises(StudyError, match=r"holds no study 'unit', but .* holds 2 trial folders of one"):
        open_study(loaded, create=True)
    assert not (loaded.workdir / "study.db").exists()
    with pytest.raises(StudyError, match="holds 2 trial folders"):
        open_study(loaded, create=False, heartbeat=False)
    assert not (loaded.workdir / "study.db").exists()


def test_sampler_seeds_differ_by_tuner_and_history() -> None:
    """A tuner's seed is sampler.seed mixed with the history and its identity: the same inputs give the
    same seed, another tuner (or a later resume) another one; an unseeded sampler stays unseeded."""
    seed = sampler_seed(7, history=3, identity="host:100:1.000|")
    assert seed == sampler_seed(7, history=3, identity="host:100:1.000|")
    others = {
        sampler_seed(7, history=3, identity="host:101:1.000|"),
        sampler_seed(7, history=3, identity="other:100:1.000|"),
        sampler_seed(7, history=3, identity="host:100:1.000|gpus-1"),
        sampler_seed(7, history=4, identity="host:100:1.000|"),
        sampler_seed(8, history=3, identity="host:100:1.000|"),
    }
    assert seed not in others and len(others) == 5
    assert sampler_seed(None, history=3, identity="x") is None


def test_one_tuner_on_a_new_study_draws_what_its_seed_says(tmp_path: Path) -> None:
    """The tuner that creates a study keeps sampler.seed: two new studies with one seed draw the same
    configs (a single tuner's study is reproducible)."""
    draws = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        loaded = write_spec(tmp_path / name, trials=4, sampler={"name": "random", "seed": 11})
        study, _ = run(loaded)
        draws.append([t.params for t in study.trials])
    assert draws[0] == draws[1]


class _SignalWhileAsked(optuna.samplers.RandomSampler):
    """A sampler that sends this process SIGTERM while Optuna makes a trial (after it is in storage)."""

    def before_trial(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        super().before_trial(study, trial)
        os.kill(os.getpid(), signal.SIGTERM)


def test_a_signal_while_a_trial_is_being_made_gives_that_trial_back(tmp_path: Path) -> None:
    """SIGTERM while the storage makes the trial (inside Optuna's ask): the trial is not left RUNNING
    without a worker (the next run would wait a minute for it), it is given back at once."""
    loaded = write_spec(tmp_path, trials=2)
    study = open_study(loaded, create=True, heartbeat=False)
    study.sampler = _SignalWhileAsked(seed=1)
    runner = StudyRunner(
        loaded, study, fake_trial(), on_event=lambda e: None, on_stale=lambda t: None, sleep=lambda s: None
    )
    with stop_on_signals(), pytest.raises(Interrupted):
        runner.run()
    states = [(t.number, t.state.name, t.user_attrs.get("discarded")) for t in study.get_trials()]
    assert states[0][1] == "FAIL" and "interrupted by SIGTERM" in states[0][2], states
    assert not study.get_trials(states=(TrialState.RUNNING,)), states


def test_a_study_whose_writer_was_killed_mid_write_opens_beside_its_trial_folders(tmp_path: Path) -> None:
    """A tuner killed inside an SQLite transaction leaves a hot rollback journal that read-only looks
    cannot get past: the study is then not called missing (its trial folders are not a reason to
    refuse), and the writable open rolls the write back and finds the study."""
    loaded = write_spec(tmp_path, trials=2)
    run(loaded)
    for number in (0, 1):
        loaded.trial_dir(number).mkdir(parents=True, exist_ok=True)
    killed = (
        "import os, sqlite3, sys\n"
        "c = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
        "c.execute('PRAGMA cache_size=1')\n"
        "c.execute('BEGIN')\n"
        'c.execute("UPDATE trial_user_attributes SET value_json = \'\\"" + \'y\' * 5000 + "\\"\'")\n'
        "os._exit(0)\n"
    )
    db = loaded.workdir / "study.db"
    subprocess.run([sys.executable, "-c", killed, str(db)], check=True, timeout=30)
    assert (loaded.workdir / "study.db-journal").stat().st_size > 0
    study = open_study(loaded, create=True, heartbeat=False)
    try:
        assert len(finished_trials(study)) == 2
        assert all("y" * 5000 not in json.dumps(t.user_attrs) for t in study.trials)
    finally:
        close_study(study)


def _queue_baseline(study: optuna.Study, loaded: LoadedStudy) -> None:
    """Queue vLLM's defaults as a baseline, as :func:`ensure_baseline` does (no check for one queued)."""
    study.enqueue_trial(dict(loaded.search_space.defaults()), user_attrs={"baseline": True})


def test_two_baselines_queued_together_launch_the_defaults_once(tmp_path: Path) -> None:
    """Two tuners recovering one lost baseline together can each queue it: the defaults are launched
    once, the other queued baseline is discarded naming the trial that measures them."""
    loaded = write_spec(tmp_path, trials=3, finalists={"count": 0})
    study = open_study(loaded, create=True, heartbeat=False)  # its creator queues the defaults
    _queue_baseline(study, loaded)
    close_study(study)
    trials = fake_trial()
    resumed, _ = run(loaded, trials)
    assert trials.baselines == [0]
    chain = _baseline_chain(resumed)
    assert [state for _, state, _ in chain] == ["COMPLETE", "FAIL"]
    assert resumed.trials[1].user_attrs["discarded"] == "vLLM's defaults are measured in trial 0"
    assert len(finished_trials(resumed)) == 3, "the discarded one spent no launch of the budget"


def test_a_baseline_defers_to_a_lower_running_one_unless_that_one_is_being_given_back(
    tmp_path: Path,
) -> None:
    """A queued baseline defers to a running one with a lower number (the lowest running launches), but
    not to one whose retry is queued (it is being given back), nor to a higher one."""
    loaded = write_spec(tmp_path, trials=3)
    study = open_study(loaded, create=True, heartbeat=False)  # its creator queues the defaults
    _queue_baseline(study, loaded)
    first, second = study.ask(), study.ask()
    assert baseline_elsewhere(study.get_trials(), first.number) is None
    assert baseline_elsewhere(study.get_trials(), second.number) == first.number
    study.enqueue_trial({}, user_attrs={"baseline": True, "retry_of": first.number})
    assert baseline_elsewhere(study.get_trials(), second.number) is None
    study.tell(second, [1.0, 1.0])
    assert baseline_elsewhere(study.get_trials(), first.number) == second.number
    close_study(study)
