"""`autotune status`: where a study stands, read from storage and the event log without writing anything."""

from __future__ import annotations

import datetime
import hashlib
import json
from pathlib import Path

import pytest
import yaml

from autotune.events import Event, EventLog, Kind, read_events
from autotune.inputs.loader import LoadedStudy, load_study
from autotune.results.export import choose, headline
from autotune.results.htmlreport import build_report
from autotune.results.status import read_status, read_study, status_of
from autotune.store.record import TrialRecord
from autotune.study.finalists import claim, ledger, pick
from autotune.study.loop import open_study
from autotune.study.standing import is_launch

from .report_study import run_study, write_spec


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> LoadedStudy:
    """The stand-in study run to its budget of 14 launches (shared: the tests here only read it)."""
    return run_study(tmp_path_factory.mktemp("status"))


def _tree(root: Path) -> dict[str, tuple[int, str]]:
    """Every file under ``root``: its modification time (ns) and content hash."""
    return {
        str(p.relative_to(root)): (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_status_of_a_finished_study(finished: LoadedStudy) -> None:
    """Launches against the budget, outcomes by cause, the export's pick and headline as the best, no
    ETA, and where the records are; the JSON form says the same."""
    status = read_status(finished)
    study = read_study(finished)
    assert study is not None
    trials = study.get_trials()
    assert status.state == "finished"
    assert status.launches == sum(1 for t in trials if is_launch(t)) == 14
    assert status.rejected == 1 and status.counts["rejected:predicted_infeasible"] == 1
    assert sum(status.counts.values()) == len(trials)
    assert status.counts["pruned:oom"] >= 1 and status.counts["pruned:slo_unreachable"] >= 1
    choice = choose(study, finished, trial=None, policy=None)
    assert status.best is not None
    assert status.best["trial"] == choice.trial.number
    assert status.best["headline"] == headline(choice)
    assert status.eta_s is None and status.running == ()
    assert status.records["events"] == str(finished.workdir / "events.jsonl")
    assert status.last_event is not None and status.last_event["kind"] == "finished"
    text = status.render()
    assert "launches: 14/14" in text and f"best so far: {headline(choice)}" in text
    assert "server logs: " in text and "trials/<n>/server.log" in text
    again = json.loads(json.dumps(status.as_dict()))
    assert again["launches"] == 14 and again["best"]["trial"] == choice.trial.number


def test_a_running_trial_shows_its_phase_elapsed_time_and_the_eta(tmp_path: Path) -> None:
    """A RUNNING trial is shown with its tuner, its last phase from the event log and how long it has run;
    the ETA is the mean launch time × launches left, less the running trial's time so far."""
    loaded = run_study(tmp_path, launches=3)
    spec = yaml.safe_load(loaded.spec_path.read_text())
    spec["budget"]["launches"] = 6
    loaded.spec_path.write_text(yaml.safe_dump(spec))
    loaded = load_study(loaded.spec_path)
    study = open_study(loaded, create=False, heartbeat=False)
    trial = study.ask()
    flags = {"gpu_memory_utilization": 0.86, "max_num_seqs": 64, "block_size": 16, "kv_cache_dtype": "auto"}
    for key, value in TrialRecord(worker="host-a:123:1.0", flags=flags).to_attrs().items():
        trial.set_user_attr(key, value)
    stored = study.get_trials()[-1]
    assert stored.datetime_start is not None
    started = stored.datetime_start.timestamp()
    log = EventLog(loaded.workdir / "events.jsonl")
    log(Event(kind=Kind.PHASE, text="probe 2 at rate 3.1: pass", trial=trial.number, time=started + 20))
    events = list(read_events(loaded.workdir / "events.jsonl"))
    status = status_of(study, loaded, events, now=started + 30)

    assert status.state == "running"
    (running,) = status.running
    assert running.number == trial.number and running.worker == "host-a:123:1.0"
    assert running.phase == "probe 2 at rate 3.1: pass"
    assert running.elapsed_s == pytest.approx(30, abs=0.01)
    assert running.phase_age_s == pytest.approx(10, abs=0.01)  # event times are kept to the millisecond
    assert running.server_log.endswith(f"trials/{trial.number}/server.log")
    launched = [t for t in study.get_trials() if is_launch(t)]
    mean = sum((t.datetime_complete - t.datetime_start).total_seconds() for t in launched) / len(launched)
    assert status.mean_launch_s == pytest.approx(mean)
    assert status.eta_s == pytest.approx(max(0.0, mean - 30) + 2 * mean)
    assert "3 launches left" in status.eta_how and "1 tuner(s)" in status.eta_how
    assert "phase: probe 2 at rate 3.1: pass (10s ago)" in status.render()


def test_the_last_fault_is_shown(tmp_path: Path, finished: LoadedStudy) -> None:
    """The newest fault, retry or stop in the event log is the status's last fault."""
    study = read_study(finished)
    assert study is not None
    events = [
        Event(kind=Kind.FAULT, text="trial 4 given back: port 8000 taken", trial=4, time=100.0),
        Event(kind=Kind.RETRY, text="retry 1 of 3 in 30 s after: port 8000 taken", time=101.0),
        Event(kind=Kind.PHASE, text="starting", trial=5, time=140.0),
    ]
    status = status_of(study, finished, events, now=160.0)
    assert status.last_fault is not None
    assert status.last_fault["text"] == "retry 1 of 3 in 30 s after: port 8000 taken"
    assert "last fault: 59s ago: retry 1 of 3" in status.render()


@pytest.mark.parametrize("scheme", ["sqlite", "journal"])
def test_status_and_report_write_nothing(tmp_path: Path, scheme: str) -> None:
    """Reading the status and building the report change no file of the study (storage, lock files, event
    log, trial folders) and create none, on SQLite and on a journal file."""
    storage = f"{scheme}:///{tmp_path / 'rep' / ('study.db' if scheme == 'sqlite' else 'journal.log')}"
    loaded = run_study(tmp_path, launches=3, study={"name": "rep", "storage": storage})
    before = _tree(tmp_path)
    status = read_status(loaded)
    study = read_study(loaded)
    assert study is not None
    build_report(study, loaded, now=datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC))
    assert status.launches == 3
    assert _tree(tmp_path) == before


def test_a_study_not_started_is_said_so_and_nothing_is_created(tmp_path: Path) -> None:
    """Before the first `autotune tune` the status is `not started`, and no storage file appears."""
    loaded = load_study(write_spec(tmp_path))
    status = read_status(loaded)
    assert status.state == "not started"
    assert not loaded.workdir.exists()
    assert "not started" in status.render()


def test_a_finalist_measured_again_is_shown_running_with_its_round(tmp_path: Path) -> None:
    """Once the budget is spent, a rerun of the finalists' ledger that runs now is shown as running: the
    finalist's number and flags, its round, the rerun's own folder; the state says the finalists are being
    measured again."""
    loaded = run_study(tmp_path, launches=3, finalists={"count": 1})
    study = open_study(loaded, create=False, heartbeat=False)
    chosen = pick(study, loaded)
    assert chosen is not None
    book = ledger(study)
    book.enqueue_trial({}, user_attrs={"finalist": chosen.trial.number, "round": 2, "seed": 1234})
    rerun = claim(book)
    assert rerun is not None
    rerun.set_user_attr("worker", "host-b:7:1.0")
    started = book.get_trials()[-1].datetime_start
    assert started is not None
    status = status_of(study, loaded, [], now=started.timestamp() + 12)
    assert status.state == "measuring the finalists again (1 runs to go)"
    (running,) = status.running
    assert running.number == chosen.trial.number and running.rerun_round == 2
    assert running.worker == "host-b:7:1.0" and running.elapsed_s == pytest.approx(12, abs=0.01)
    assert running.flags == dict(TrialRecord.from_trial(chosen.trial).flags)
    assert running.server_log.endswith(f"confirmations/{chosen.trial.number}-1234/server.log")
    text = status.render()
    assert f"running: finalist trial {chosen.trial.number} measured again (round 2) for 12s" in text
