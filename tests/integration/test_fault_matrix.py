"""The fault matrix: a tuner killed by SIGKILL, SIGTERM or SIGINT during a server's start, a probe, a
teardown, or between trials, then run again, always finishes its study with exactly the budget, launches no
config twice, and leaves no process and no port behind. Plus 20 seeded random kill points in one study.

The tuner is a real ``autotune tune`` process and the servers real simulated-vLLM processes; kill points
are read from the tuner's own event log (``events.jsonl``).
"""

from __future__ import annotations

import random
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from .faults import Tuner, check_study, marked_processes, marker_cleanup, write_spec

pytestmark = pytest.mark.integration

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


@pytest.mark.parametrize("phase", list(PHASES))
@pytest.mark.parametrize("sig_name", list(SIGNALS))
def test_a_killed_tuner_rerun_finishes_the_study_cleanly(
    tmp_path: Path, marker: str, sig_name: str, phase: str
) -> None:
    """Whatever signal hits the tuner in whatever phase, a rerun finishes with exactly the budget, no
    config launched twice, every interrupted trial retried once, and no process or port left."""
    sig = SIGNALS[sig_name]
    mark, delay, sim_flags = PHASES[phase]
    spec = write_spec(
        tmp_path, marker, launches=LAUNCHES, sim_flags=sim_flags, stop_timeout="1500ms", start_delay=1.0
    )
    first = Tuner(spec, tmp_path / "first.out", marker)
    # Trial 0 may be measured before the kill point of "between"; the baseline must not be the only one.
    seen = first.wait_for(mark)
    assert seen is not None, (tmp_path / "first.out").read_text()
    time.sleep(delay)
    first.signal(sig)
    code = first.wait(60)
    output = (tmp_path / "first.out").read_text()
    assert code == EXPECTED_EXIT[sig], output
    if sig != signal.SIGKILL:
        assert "Traceback" not in output, output
        assert f"interrupted by {sig.name}" in output.splitlines()[-1], output
        assert marked_processes(marker) == [], "a graceful stop leaves no server behind"
    second = Tuner(spec, tmp_path / "second.out", marker)
    assert second.wait(240) == 0, (tmp_path / "second.out").read_text()
    check_study(spec, marker, LAUNCHES)


def test_twenty_random_kill_points_in_one_study(tmp_path: Path, marker: str) -> None:
    """A study whose tuner is killed at 20 seeded random moments (any of the three signals), each time run
    again, still ends with exactly its budget, no config launched twice, nothing left running."""
    rng = random.Random(20261203)
    launches = 8
    spec = write_spec(
        tmp_path,
        marker,
        launches=launches,
        sim_flags=("--sim-orphan-child",),
        stop_timeout="1s",
        start_delay=0.5,
    )
    kills = 0
    for attempt in range(20):
        tuner = Tuner(spec, tmp_path / f"run-{attempt}.out", marker)
        started = tuner.wait_for(lambda e: e["kind"] == "started", timeout=60)
        assert started is not None, (tmp_path / f"run-{attempt}.out").read_text()
        time.sleep(rng.uniform(0.5, 4.0))
        sig = rng.choice(list(SIGNALS.values()))
        tuner.signal(sig)
        code = tuner.wait(60)
        kills += code != 0
        assert code in (0, EXPECTED_EXIT[sig]), (tmp_path / f"run-{attempt}.out").read_text()
    final = Tuner(spec, tmp_path / "final.out", marker)
    assert final.wait(300) == 0, (tmp_path / "final.out").read_text()
    counts = check_study(spec, marker, launches)
    assert kills >= 10, f"only {kills} of 20 kills landed while the study ran"
    assert counts["launched"] == launches
