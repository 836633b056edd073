"""`autotune simulate` as a real subprocess: the summary on stdout, bad input as one error line, exit 2."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

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


def test_simulate_calibrated_shows_the_fit_the_proposals_and_what_comes_next(tmp_path: Path) -> None:
    """A stored study of three measured trials (one of them a proposal): the surrogate's fitted constants,
    each trial's measured and predicted SLO rate, the proposal's record, the next configs; read only (the
    storage is unchanged). Without a memory model: one error line naming it, exit 2."""
    from autotune.study.loop import close_study, open_study
    from tests.unit.test_surrogate import CONFIGS, frozen, measured_attrs, surrogate_of, write_spec

    loaded = write_spec(tmp_path)
    s = surrogate_of(loaded)
    study = open_study(loaded, create=True, heartbeat=False)
    for i, flags in enumerate(CONFIGS):
        attrs = measured_attrs(s, flags)
        if i == 2:
            attrs["surrogate"] = {"slo_rate": attrs["estimate"]["rate"] * 1.1}
        study.add_trial(frozen(i, flags, attrs))
    close_study(study)
    storage = tmp_path / "work" / "study.db"
    before = storage.read_bytes() if storage.exists() else None
    result = _autotune("simulate", str(tmp_path / "spec.yaml"), "--calibrated", "--top", "3")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "calibrated surrogate of 'surrogate': Llama-3.1-8B on H100-80GB" in out
    assert "fitted to 3 measured trials" in out and "constants (x the simulator's): compute x" in out
    assert "SLO term factors: ttft:p95 x" in out
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit() and "flags" not in line]
    assert [r[0] for r in rows[:3]] == ["1", "2", "3"], out  # the measured trials (0: the queued defaults)
    assert "trial    3:" in out and "(-9%)" in out  # predicted 1.1x what it measured
    assert re.search(r"its fit on the 3 measured trials' SLO rates: median error \d+% \(limit 30%\)", out), (
        out
    )
    assert "status: it proposes the next launch" in out
    assert "top 3 configs no trial holds yet" in out
    if before is not None:
        assert storage.read_bytes() == before

    spec = yaml.safe_load((tmp_path / "spec.yaml").read_text())
    del spec["memory_model"]
    (tmp_path / "bare.yaml").write_text(yaml.safe_dump(spec))
    result = _autotune("simulate", str(tmp_path / "bare.yaml"), "--calibrated")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: memory_model: absent"), result.stderr
