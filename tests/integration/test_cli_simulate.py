"""`autotune simulate` as a real subprocess: the summary on stdout, bad input as one error line, exit 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

REPO = Path(__file__).resolve().parents[2]


def _autotune(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", "from autotune.cli import main; main()", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )


def test_simulate_demo_prints_the_summary() -> None:
    """20 samples of the demo: outcomes, top configs, the default and the gain, nothing on stderr."""
    result = _autotune("simulate", "studies/demo.yaml", "--samples", "20")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "21 configs" in out
    assert "outcomes:" in out and "ok" in out
    assert "top 10 configs:" in out
    assert "default config:" in out
    assert "gain of the best over the default: +" in out
    assert result.stderr == ""


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("--samples", "0"), "--samples: must be >= 1, got 0"),
        (("--gpu", "B300"), "--gpu: unknown GPU profile 'B300'"),
        (("--top", "0"), "--top: must be >= 1, got 0"),
    ],
)
def test_simulate_bad_input_is_one_line(args: tuple[str, ...], needle: str) -> None:
    """A bad option is one `error:` line naming the option and the value, exit 2."""
    result = _autotune("simulate", "studies/demo.yaml", *args)
    assert result.returncode == 2, result
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], result.stderr
