"""Several tuners opening one new storage and creating one new study at the same moment.

Real processes, started together behind a barrier (a file they wait for), on SQLite, a journal file
and a private PostgreSQL server: every one must succeed, and exactly one must say it created the study.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest

from autotune.store.storage import close_storage, open_storage

pytestmark = pytest.mark.integration

WORKER = str(Path(__file__).with_name("workers") / "open_study.py")
PROCESSES = 4
STUDY = "race"


def race(url: str, folder: Path) -> list[dict[str, object]]:
    """Start PROCESSES workers on ``url``, release them together, and return what each printed."""
    procs = []
    try:
        for i in range(PROCESSES):
            procs.append(
                subprocess.Popen(
                    [sys.executable, WORKER, url, STUDY, str(folder / f"ready-{i}"), str(folder / "go")],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        deadline = time.monotonic() + 60
        while not all((folder / f"ready-{i}").exists() for i in range(PROCESSES)):
            assert time.monotonic() < deadline, "workers did not start within 60 s"
            assert all(p.poll() is None for p in procs), "a worker exited before the start signal"
            time.sleep(0.01)
        (folder / "go").write_text("")
        results = []
        for proc in procs:
            out, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, f"worker failed (exit {proc.returncode}):\n{err}"
            results.append(json.loads(out.strip().splitlines()[-1]))
        return results
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)


def check(url: str, tmp_path: Path) -> None:
    results = race(url, tmp_path)
    assert sum(bool(r["created"]) for r in results) == 1, results
    assert len({r["study_id"] for r in results}) == 1, results
    storage = open_storage(url, heartbeat=False)
    try:
        summaries = optuna.get_all_study_summaries(storage)
    finally:
        close_storage(storage)
    assert [(s.study_name, [d.name for d in s.directions]) for s in summaries] == [
        (STUDY, ["MAXIMIZE", "MINIMIZE"])
    ]


def test_new_sqlite_storage(tmp_path: Path) -> None:
    """Four processes create one SQLite file (in a folder yet to be made) and one study in it."""
    check(f"sqlite:///{tmp_path}/new/study.db", tmp_path)


@pytest.mark.slow
def test_new_journal_storage(tmp_path: Path) -> None:
    """Four processes create one journal file and one study in it."""
    check(f"journal:///{tmp_path}/new/study.log", tmp_path)


@pytest.mark.slow
def test_new_postgres_database(new_postgres_url: str, tmp_path: Path) -> None:
    """Four processes create Optuna's tables in one empty PostgreSQL database, and one study."""
    check(new_postgres_url, tmp_path)
