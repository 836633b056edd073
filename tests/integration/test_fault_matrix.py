"""The fault matrix: a tuner killed by SIGKILL, SIGTERM or SIGINT during a server's start, a probe, a
teardown, or between trials, then run again, always finishes its study with exactly the budget, launches no
config twice, and leaves no process and no port behind. Plus 20 seeded random kill points in one study.

The tuner is a real ``autotune tune`` process and the servers real simulated-vLLM processes; kill points
are read from the tuner's own event log (``events.jsonl``).
"""

from __future__ import annotations

import contextlib
import os
import random
import shlex
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from optuna.trial import FrozenTrial

from autotune.inputs.loader import load_study
from autotune.store.record import TrialRecord
from autotune.study import slots
from autotune.study.loop import close_study, default_trial, open_study

from .faults import (
    MARKER_VAR,
    Tuner,
    autotune,
    check_study,
    marked_processes,
    marker_cleanup,
    write_spec,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

LAUNCHES = 3
SIGNALS = {"kill": signal.SIGKILL, "term": signal.SIGTERM, "int": signal.SIGINT}
EXPECTED_EXIT = {signal.SIGKILL: -9, signal.SIGTERM: 128 + 15, signal.SIGINT: 128 + 2}


def _starting(e: dict[str, Any]) -> bool:
    return e["kind"] == "phase" and e["text"].startswith("starting server on port")


def _measuring(e: dict[str, Any]) -> bool:
    return e["kind"] == "phase" and e["text"].startswith("ready in")


def _tearing_down(e: dict[str, Any]) -> bool:
    return e["kind"] == "phase" and e["text"] == "stopping the server"


def _between(e: dict[str, Any]) -> bool:
    return e["kind"] == "trial_done"


# phase → (the event that marks it, seconds to wait after it, extra simulator flags)
PHASES: dict[str, tuple[Callable[[dict[str, Any]], bool], float, tuple[str, ...]]] = {
    "start": (_starting, 0.2, ()),
    "probe": (_measuring, 0.4, ("--sim-speedup", "0.5")),
    "teardown": (_tearing_down, 0.3, ("--sim-ignore-sigterm", "--sim-orphan-child")),
    "between": (_between, 0.0, ()),
}


@pytest.fixture
def marker() -> Iterator[str]:
    name = f"faults-{uuid.uuid4().hex[:10]}"
    with marker_cleanup(name):
        yield name


def _check_stop(tuner: Tuner, sig: signal.Signals, code: int) -> None:
    """How a tuner hit by ``sig`` ended: its exit status, and on its standard error (read on its own) the
    interrupt line and nothing else, wherever it fell among the standard output's lines: no warning (a
    coroutine never awaited), no traceback, nothing from asyncio. SIGKILL leaves standard error empty."""
    errors = tuner.stderr_lines()
    assert code == EXPECTED_EXIT[sig], tuner.output()
    if sig == signal.SIGKILL:
        assert errors == [], tuner.output()
    else:
        assert len(errors) == 1 and errors[0].startswith(f"interrupted by {sig.name}: "), tuner.output()
    assert "Traceback" not in tuner.output(), tuner.output()


@pytest.mark.parametrize("phase", list(PHASES))
@pytest.mark.parametrize("sig_name", list(SIGNALS))
def test_a_killed_tuner_rerun_finishes_the_study_cleanly(
    tmp_path: Path, marker: str, sig_name: str, phase: str
) -> None:
    """Whatever signal hits the tuner in whatever phase, it stops with one line (SIGTERM, SIGINT) and a
    rerun finishes with exactly the budget, no config launched twice, every interrupted trial retried
    once, and no process or port left."""
    sig = SIGNALS[sig_name]
    mark, delay, sim_flags = PHASES[phase]
    spec = write_spec(
        tmp_path, marker, launches=LAUNCHES, sim_flags=sim_flags, stop_timeout="1500ms", start_delay=1.0
    )
    first = Tuner(spec, tmp_path / "first.out", marker, split=True)
    # Trial 0 may be measured before the kill point of "between"; the baseline must not be the only one.
    seen = first.wait_for(mark)
    assert seen is not None, first.output()
    time.sleep(delay)
    first.signal(sig)
    _check_stop(first, sig, first.wait(60))
    if sig != signal.SIGKILL:
        assert marked_processes(marker) == [], "a graceful stop leaves no server behind"
    second = Tuner(spec, tmp_path / "second.out", marker)
    assert second.wait(240) == 0, second.output()
    check_study(spec, marker, LAUNCHES)


KILL_POINTS = 20
FIRST_LAUNCH_EVENT = 6
"""A run's first launch can be complete only when it is killed at this event of the run or later (the
events before it: started, trial, starting, starting server, ready, a probe)."""


@pytest.mark.timeout(600)  # 131 s alone, 144 s beside the rest of the module, on a shared 2-core machine
def test_twenty_random_kill_points_in_one_study(tmp_path: Path, marker: str) -> None:
    """A study whose tuner is killed at 20 seeded random points (any of the three signals), each time run
    again, still ends with exactly its budget, no config launched twice, nothing left running; each
    SIGTERM and SIGINT prints the interrupt line alone on standard error.

    A kill point is the n-th event that run writes to the event log (n from 1 to 9: from just after the
    start to past the end of its first trial, a trial being about seven events); the signal is sent as
    soon as the event is read, so where it lands is set by the seed, not by how fast the machine is. A
    run completes at most one launch before its kill (a second needs a server started after the first
    one's end, seconds later), and only when n >= FIRST_LAUNCH_EVENT: the budget is two launches more
    than those runs, so no run finishes the study first and all 20 kills land (asserted, not hoped)."""
    rng = random.Random(20261203)
    points = [(rng.randint(1, 9), rng.choice(list(SIGNALS.values()))) for _ in range(KILL_POINTS)]
    launches = 2 + sum(1 for nth, _ in points if nth >= FIRST_LAUNCH_EVENT)
    spec = write_spec(
        tmp_path,
        marker,
        launches=launches,
        sim_flags=("--sim-orphan-child",),
        stop_timeout="1s",
        start_delay=0.5,
    )
    for attempt, (nth, sig) in enumerate(points):
        tuner = Tuner(spec, tmp_path / f"run-{attempt}.out", marker, split=True)
        reached = tuner.wait_for_count(nth, timeout=120)
        assert reached, f"run {attempt} ended before its event {nth}:\n{tuner.output()}"
        tuner.signal(sig)
        _check_stop(tuner, sig, tuner.wait(60))
    final = Tuner(spec, tmp_path / "final.out", marker)
    assert final.wait(300) == 0, final.output()
    counts = check_study(spec, marker, launches)
    assert counts["launched"] == launches


# ----------------------------------------------------------------------------------------------
# The baseline survives the tuner's own faults
# ----------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _held_port() -> Iterator[tuple[int, socket.socket]]:
    """A port held by a listening socket of this test (as another server would hold it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1], sock


def _baseline(spec: Path) -> tuple[list[str], FrozenTrial | None]:
    """The states of the study's baseline trials, in order, and its measured baseline (None if none)."""
    study = open_study(load_study(spec), create=False, heartbeat=False)
    try:
        trials = study.get_trials(deepcopy=False)
        measured = default_trial(study)
    finally:
        close_study(study)
    reasons = [TrialRecord.from_trial(t).failed_because or "" for t in trials]
    assert not any("not retried" in why for why in reasons if why), reasons
    return [t.state.name for t in trials if TrialRecord.from_trial(t).baseline], measured


def test_a_port_held_through_every_retry_keeps_the_defaults_for_the_next_run(
    tmp_path: Path, marker: str
) -> None:
    """The server's port held by another process through every retry: the study stops with one line
    (exit 1); once the port is free, the next run measures vLLM's defaults first and finishes."""
    with _held_port() as (port, _):
        spec = write_spec(tmp_path, marker, launches=2, port=port, faults={"retries": 2, "pause": "200ms"})
        first = Tuner(spec, tmp_path / "first.out", marker)
        assert first.wait(60) == 1, (tmp_path / "first.out").read_text()
    output = (tmp_path / "first.out").read_text()
    assert output.splitlines()[-1].startswith(f"error: port {port} on 127.0.0.1 is already in use"), output
    assert "Traceback" not in output
    states, measured = _baseline(spec)
    assert states == ["FAIL", "FAIL", "FAIL", "WAITING"], states
    second = Tuner(spec, tmp_path / "second.out", marker)
    assert second.wait(120) == 0, (tmp_path / "second.out").read_text()
    states, measured = _baseline(spec)
    assert measured is not None and measured.state.name == "COMPLETE", states
    check_study(spec, marker, 2)


def test_a_port_freed_before_the_last_retry_costs_the_defaults_nothing(tmp_path: Path, marker: str) -> None:
    """The port held for faults.retries attempts and freed during the last pause: the next attempt is
    vLLM's defaults again (a config is queued again as often as a fault is retried), measured in the
    same run."""
    with _held_port() as (port, sock):
        spec = write_spec(tmp_path, marker, launches=2, port=port, faults={"retries": 3, "pause": "300ms"})
        tuner = Tuner(spec, tmp_path / "tune.out", marker)
        last = tuner.wait_for(lambda e: e["kind"] == "retry" and e["data"].get("retry") == 3, timeout=60)
        assert last is not None, (tmp_path / "tune.out").read_text()
        sock.close()
        assert tuner.wait(120) == 0, (tmp_path / "tune.out").read_text()
    states, measured = _baseline(spec)
    assert states == ["FAIL", "FAIL", "FAIL", "COMPLETE"], states
    assert measured is not None
    check_study(spec, marker, 2)


# ----------------------------------------------------------------------------------------------
# Damaged storage and full disks: one line, exit 1, the file as it was
# ----------------------------------------------------------------------------------------------


def _sqlite_db(root: Path) -> Path:
    return root / "faults" / "study.db"


def _journal(root: Path) -> Path:
    return root / "faults" / "study.log"


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    """A finished two-launch study on each local storage (SQLite, journal), to copy and then damage."""
    marker = f"faults-{uuid.uuid4().hex[:10]}"
    studies = {}
    with marker_cleanup(marker):
        for kind in ("sqlite", "journal"):
            root = tmp_path_factory.mktemp(kind)
            storage = f"journal:///{_journal(root)}" if kind == "journal" else None
            spec = write_spec(root, marker, launches=2, storage=storage)
            assert Tuner(spec, root / "tune.out", marker).wait(120) == 0, (root / "tune.out").read_text()
            studies[kind] = root
        yield studies


def _copy_study(
    source: Path, target: Path, marker: str, *, launches: int, workdir: str | None = None
) -> Path:
    """A copy of the study in ``source`` at ``target`` (its storage there too), its servers marked with
    ``marker``, with ``launches`` (and the study folder at ``workdir``, relative to the spec, if given)."""
    shutil.copytree(source, target, dirs_exist_ok=True)
    spec = target / "spec.yaml"
    data = yaml.safe_load(spec.read_text())
    data["server"]["env"][MARKER_VAR] = marker
    data["budget"]["launches"] = launches
    folder = target / (workdir or "faults")
    if workdir is not None:
        data["study"]["workdir"] = workdir
        shutil.move(target / "faults", folder)
    if "storage" in data["study"]:
        data["study"]["storage"] = f"journal:///{folder / 'study.log'}"
    spec.write_text(yaml.safe_dump(data))
    return spec


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _one_error_line(result: subprocess.CompletedProcess[str] | str, code: int = 1) -> str:
    """The single line a refused run prints (stdout and stderr together), checked."""
    if isinstance(result, subprocess.CompletedProcess):
        assert result.returncode == code, result
        text = result.stdout + result.stderr
    else:
        text = result
    lines = text.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), text
    return lines[0]


def _empty(path: Path) -> None:
    path.write_bytes(b"")


def _not_sqlite(path: Path) -> None:
    path.write_text("this is not a database\n" * 100)


def _garbage_page(path: Path) -> None:
    with path.open("r+b") as file:
        file.seek(4096 * 2)
        file.write(b"\xde\xad\xbe\xef" * 1024)


def _cut(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-40])


def _garbage_tail(path: Path) -> None:
    path.write_bytes(path.read_bytes() + b"\x00garbage \xff\n")


def _garbage_middle(path: Path) -> None:
    lines = path.read_bytes().split(b"\n")
    lines[5] = b'{"op_code": 8, "trial_id": 0, "user_at'
    path.write_bytes(b"\n".join(lines))


# case → (storage kind, the file, the damage, words of the error line, whether its repair is spelt out)
DAMAGE: dict[str, tuple[str, Callable[[Path], Path], Callable[[Path], None], str, bool]] = {
    "sqlite-empty": ("sqlite", _sqlite_db, _empty, "is empty (0 bytes)", False),
    "sqlite-not-sqlite": ("sqlite", _sqlite_db, _not_sqlite, "is not an SQLite database", False),
    "sqlite-garbage-page": ("sqlite", _sqlite_db, _garbage_page, "is damaged (SQLite's quick_check", False),
    "sqlite-removed": ("sqlite", _sqlite_db, Path.unlink, "holds no study 'faults', but", False),
    "journal-emptied": ("journal", _journal, _empty, "holds no study 'faults', but", False),
    "journal-cut-mid-record": ("journal", _journal, _cut, "is cut short", True),
    "journal-garbage-last-line": ("journal", _journal, _garbage_tail, "is not a journal record", True),
    "journal-garbage-middle": ("journal", _journal, _garbage_middle, "line 6 of the journal", True),
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_damaged_storage_is_one_line_and_left_as_it_was(
    tmp_path: Path, marker: str, finished: dict[str, Path], case: str
) -> None:
    """A damaged or missing storage file: `tune` and `validate` print one line (exit 1), nothing in the
    study's folder changes (no new study over the old trial folders, no record appended after a cut one);
    where the line spells out a repair, doing it lets the study go on to its budget."""
    kind, file_of, damage, words, repairable = DAMAGE[case]
    spec = _copy_study(finished[kind], tmp_path, marker, launches=3)
    damage(file_of(tmp_path))
    before = _tree(tmp_path / "faults")
    tuner = Tuner(spec, tmp_path / "damaged.out", marker)
    assert tuner.wait(60) == 1
    line = _one_error_line((tmp_path / "damaged.out").read_text())
    assert words in line, line
    assert _tree(tmp_path / "faults") == before
    assert _one_error_line(_run_cli("validate", str(spec))) == line
    assert _tree(tmp_path / "faults") == before
    if not repairable:
        return
    command = line.split("`")[1]
    assert command.startswith("truncate -s "), line
    _repair_journal(command)
    again = Tuner(spec, tmp_path / "again.out", marker)
    assert again.wait(120) == 0, (tmp_path / "again.out").read_text()
    check_study(spec, marker, 3)


def _run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(autotune(*args), capture_output=True, text=True, timeout=60, check=False)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs at ``tmp_path/disk`` (needs the right to mount: root; skipped otherwise), unmounted
    afterwards."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)],
        capture_output=True,
        text=True,
        check=False,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs to fill (needs root): {mounted.stderr.strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True, check=False)


def _fill(disk: Path) -> Path:
    """Fill ``disk`` to the last byte with one file; returns it (remove it to free the space)."""
    filler = disk / "filler"
    with filler.open("wb", buffering=0) as file, contextlib.suppress(OSError):
        while True:
            file.write(b"\0" * 4096)
    assert shutil.disk_usage(disk).free == 0
    return filler


def _repair_journal(command: str) -> None:
    """Do what a journal's error message says, as a user would, without a shell: append the missing
    newline (``echo >> FILE``) or cut the damaged tail (``truncate -s N FILE``)."""
    words = shlex.split(command)
    if words[:2] == ["echo", ">>"] and len(words) == 3:
        with Path(words[2]).open("a") as journal:
            journal.write("\n")
    elif words[:2] == ["truncate", "-s"] and len(words) == 4:
        os.truncate(words[3], int(words[2]))
    else:
        raise AssertionError(f"a repair this test does not know: {command}")


@pytest.mark.parametrize("kind", ["sqlite", "journal"])
def test_a_full_disk_stops_the_study_with_one_line_and_the_next_run_finishes_it(
    tmp_path: Path, marker: str, finished: dict[str, Path], small_disk: Path, kind: str
) -> None:
    """The study's disk full (the storage, its event log and trial folders on one 4 MiB tmpfs): the tuner
    stops with one line, no traceback, exit 1 (SQLite's file keeps every byte: the write was rolled back);
    once space is freed, the next run finishes the study (a journal record the full disk cut short is
    reported first, with its repair)."""
    spec = _copy_study(finished[kind], tmp_path, marker, launches=4, workdir="disk/faults")
    storage = small_disk / "faults" / ("study.db" if kind == "sqlite" else "study.log")
    before = storage.read_bytes()
    filler = _fill(small_disk)
    tuner = Tuner(spec, tmp_path / "full.out", marker)
    assert tuner.wait(120) == 1, (tmp_path / "full.out").read_text()
    output = (tmp_path / "full.out").read_text()
    assert "Traceback" not in output, output
    assert output.splitlines()[-1].startswith("error: no space left on the device of"), output
    if kind == "sqlite":
        assert storage.read_bytes() == before
    filler.unlink()
    last = tmp_path / "again.out"
    again = Tuner(spec, last, marker)
    code = again.wait(180)
    if code == 1 and "is cut short" in last.read_text():
        _repair_journal(_one_error_line(last.read_text()).split("`")[1])
        last = tmp_path / "repaired.out"
        again = Tuner(spec, last, marker)
        code = again.wait(180)
    assert code == 0, last.read_text()
    check_study(spec, marker, 4)


# ----------------------------------------------------------------------------------------------
# Tuners that would draw alike
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sampler", ["random", "tpe"])
def test_two_plain_tuners_on_one_study_draw_their_own_configs(
    tmp_path: Path, marker: str, sampler: str
) -> None:
    """Two `autotune tune` processes started together on one study with one sampler.seed: their first
    drawn configs differ (each seeds its sampler from its own identity), and no draw is wasted on a
    config the other already ran or is running.

    Both must draw before either finishes a trial, else the faster one may take the whole budget (in CI the
    defaults' trial once outlasted the other tuner's five): the servers wait at a gate (a file) that opens
    once each tuner has launched its first drawn config, and the defaults are measured before, by a first
    run of one launch."""
    gate = tmp_path / "gate"
    gate.touch()
    spec = write_spec(tmp_path, marker, launches=1, sampler={"name": sampler, "seed": 7})
    data = yaml.safe_load(spec.read_text())
    wait = 'while [ ! -e "$0" ]; do sleep 0.02; done; exec "$@"'  # the gate is a file: $0, the command after
    data["server"]["command"] = ["sh", "-c", wait, str(gate), *data["server"]["command"]]
    data["server"]["start_timeout"] = "120s"  # the gate waits for the other tuner's start-up too
    spec.write_text(yaml.safe_dump(data))
    assert Tuner(spec, tmp_path / "defaults.out", marker).wait(120) == 0, (
        tmp_path / "defaults.out"
    ).read_text()
    gate.unlink()
    data["budget"]["launches"] = 6
    spec.write_text(yaml.safe_dump(data))
    tuners = [Tuner(spec, tmp_path / f"w{k}.out", marker) for k in range(2)]
    launched: set[str] = set()
    while len(launched) < 2:
        event = tuners[0].wait_for(
            lambda e: (
                e["kind"] == "trial" and e["data"].get("baseline") is False and e["worker"] not in launched
            ),
            timeout=120,
        )
        assert event is not None, tuners[0].output()
        launched.add(event["worker"])
    gate.touch()
    codes = [t.wait(300) for t in tuners]
    assert codes == [0, 0], [t.output() for t in tuners]
    study = open_study(load_study(spec), create=False, heartbeat=False)
    try:
        trials = study.get_trials(deepcopy=False)
    finally:
        close_study(study)
    records = {t.number: TrialRecord.from_trial(t) for t in trials}
    drawn = [t for t in trials if not records[t.number].baseline and records[t.number].retry_of is None]
    first = {}
    for trial in drawn:
        first.setdefault(records[trial.number].worker, trial.params)
    assert len(first) == 2, [(t.number, records[t.number].worker) for t in trials]
    one, other = first.values()
    assert one != other, first
    # Two tuners asking at once for the budget's last launch may both draw: one gives way, a refused slot
    # and not a config drawn twice.
    wasted = [
        n
        for n, r in records.items()
        if r.repeat_of is not None or (r.discarded is not None and r.discarded not in slots.REFUSALS)
    ]
    assert wasted == [], [(n, records[n].discarded, records[n].repeat_of) for n in wasted]
    check_study(spec, marker, 6)


# ----------------------------------------------------------------------------------------------
# Bad input that ran anyway: one line naming the field and the value, exit 2, nothing written
# ----------------------------------------------------------------------------------------------

WITHOUT_NVML = {"AUTOTUNE_GPUS_WITHOUT_NVML": "1"}

# case → (the command after `autotune`, extra environment, spec edits, exit status, words of the line)
BAD_INPUT: dict[str, tuple[tuple[str, ...], dict[str, str], dict[str, Any], int, tuple[str, ...]]] = {
    "gpus-index-past-the-count": (("tune", "--gpus", "7"), {}, {}, 2, ("--gpus: ", "'7'")),
    "gpus-garbage": (("tune", "--gpus", "abc"), WITHOUT_NVML, {}, 2, ("--gpus: ", "'abc' is neither")),
    "gpus-without-nvml-not-a-switch": (
        ("tune", "--gpus", "0"),
        {"AUTOTUNE_GPUS_WITHOUT_NVML": "yes"},
        {},
        2,
        ("AUTOTUNE_GPUS_WITHOUT_NVML: ", "'yes'"),
    ),
    "gpus-per-trial-not-a-number": (
        ("tune", "--gpus", "0,1", "--gpus-per-trial", "two"),
        WITHOUT_NVML,
        {},
        2,
        ("--gpus-per-trial: ", "'two' is not a whole number"),
    ),
    "gpus-per-trial-without-gpus": (
        ("tune", "--gpus-per-trial", "two"),
        {},
        {},
        2,
        ("--gpus-per-trial: ", "'two' needs --gpus"),
    ),
    "api-key-and-authorization-header": (
        ("tune",),
        {"SERVER_KEY": "k", "GATEWAY": "g"},
        {
            "server": {"api_key_env": "SERVER_KEY"},
            "workload": {"headers": {"Authorization": "Bearer ${GATEWAY}"}},
        },
        2,
        ("workload.headers.Authorization: ", "server.api_key_env ('SERVER_KEY')"),
    ),
    "validate-unreachable-postgresql": (
        ("validate", "--storage", "postgresql://tuner:hunter2@127.0.0.1:1/studies"),
        {},
        {},
        1,
        ("cannot reach storage postgresql://tuner:***@127.0.0.1:1/studies", "Connection refused"),
    ),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_is_one_line_and_runs_nothing(tmp_path: Path, marker: str, case: str) -> None:
    """Each bad input that used to run a whole study (or say "ok") is one `error:` line naming the field
    and the value, with its exit status; nothing is written and no server is started."""
    args, env, edits, code, words = BAD_INPUT[case]
    spec = write_spec(tmp_path, marker, launches=2)
    data = yaml.safe_load(spec.read_text())
    for section, values in edits.items():
        data[section].update(values)
    spec.write_text(yaml.safe_dump(data))
    before = _tree(tmp_path)
    command, *options = args
    result = subprocess.run(
        autotune(command, str(spec), *options),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, **env},
    )
    line = _one_error_line(result, code)
    for word in words:
        assert word in line, line
    assert "hunter2" not in line
    assert _tree(tmp_path) == before
    assert not (tmp_path / "faults").exists()
    assert marked_processes(marker) == []
