"""Every command that reads a study names a storage failure's real cause, the same way: an empty SQLite
file, a half-truncated one and an unreachable PostgreSQL server each give one `error:` line saying so
(not Optuna's "exception during the commit"), exit 1, and nothing written."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
COMMANDS = ("status", "report", "best", "export", "validate")


def _spec(tmp_path: Path) -> Path:
    spec = {
        "study": {"name": "causes", "workdir": str(tmp_path / "study")},
        "server": {"command": [sys.executable], "model": "Llama-3.1-8B", "args": {"max-model-len": 4096}},
        "search_space": str(REPO / "search_spaces" / "sim.yaml"),
        "slo": {"terms": ["ttft:p95<=1s"]},
    }
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def _empty(tmp_path: Path) -> str:
    (tmp_path / "empty.db").write_bytes(b"")
    return f"sqlite:///{tmp_path / 'empty.db'}"


def _half(tmp_path: Path) -> str:
    whole = tmp_path / "whole.db"
    with sqlite3.connect(whole) as db:
        db.execute("CREATE TABLE t (a TEXT)")
        db.executemany("INSERT INTO t VALUES (?)", [("x" * 500,)] * 2000)
    db.close()
    data = whole.read_bytes()
    (tmp_path / "half.db").write_bytes(data[: len(data) // 2])
    whole.unlink()
    return f"sqlite:///{tmp_path / 'half.db'}"


def _unreachable(tmp_path: Path) -> str:
    del tmp_path
    return "postgresql://tuner:p@127.0.0.1:1/studies"  # port 1: nothing listens


FAILURES = {
    "empty-sqlite": (_empty, "the file is empty (0 bytes)"),
    "half-truncated-sqlite": (
        _half,
        "the file is damaged (SQLite's quick_check: database disk image is malformed)",
    ),
    "unreachable-postgresql": (_unreachable, "port 1 failed: Connection refused"),
}


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("failure", list(FAILURES))
def test_a_storage_failure_is_named_alike_by_every_command(
    tmp_path: Path, command: str, failure: str
) -> None:
    make, cause = FAILURES[failure]
    url = make(tmp_path)
    spec = _spec(tmp_path)
    before = sorted((p.relative_to(tmp_path), p.stat().st_size) for p in tmp_path.rglob("*"))
    done = subprocess.run(
        [sys.executable, "-c", "from autotune.cli import main; main()", command, str(spec), "--storage", url],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1, done.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    assert cause in lines[0] and "exception" not in lines[0], lines[0]
    assert ":p@" not in lines[0]  # the password stays hidden
    assert sorted((p.relative_to(tmp_path), p.stat().st_size) for p in tmp_path.rglob("*")) == before
