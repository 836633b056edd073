"""`autotune init` as a new user meets it: asked question by question on a terminal (a pseudo-terminal
here), and the spec it writes run as a whole study on the simulated server."""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.integration

CLI = [sys.executable, "-c", "from autotune.cli import main; main()"]


class Terminal:
    """A command on a pseudo-terminal: what it printed so far, and answers typed into it."""

    def __init__(self, argv: list[str], cwd: Path) -> None:
        self.master, slave = os.openpty()
        self.proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, cwd=cwd, close_fds=True)
        os.close(slave)
        self.seen = ""

    def expect(self, text: str, timeout: float = 30.0) -> None:
        """Read until ``text`` has been printed since the last expectation."""
        deadline = time.monotonic() + timeout
        while text not in self.seen:
            left = deadline - time.monotonic()
            assert left > 0, f"waited {timeout} s for {text!r}; the terminal shows:\n{self.seen}"
            ready, _, _ = select.select([self.master], [], [], left)
            if ready:
                try:
                    chunk = os.read(self.master, 4096)
                except OSError:  # the command ended (EIO)
                    chunk = b""
                assert chunk, f"the command ended before {text!r}; the terminal shows:\n{self.seen}"
                self.seen += chunk.decode(errors="replace")
        self.seen = self.seen.split(text, 1)[1]

    def type(self, line: str) -> None:
        os.write(self.master, line.encode() + b"\r")

    def close(self) -> int:
        code = self.proc.wait(timeout=60)
        os.close(self.master)
        return code


def test_init_asks_each_answer_on_a_terminal_and_asks_again_after_a_bad_one(tmp_path: Path) -> None:
    """With no flags but --simulate, each answer is asked; an unknown GPU is refused with its reason and
    asked again; Enter takes the default shown (batch traffic's SLO and lengths)."""
    term = Terminal([*CLI, "init", "--simulate", "-o", "first.yaml"], tmp_path)
    try:
        term.expect("Model (a Hugging Face id, a local folder or a catalog name):")
        term.type("Llama-3.1-8B")
        term.expect("GPU (")
        term.type("B300")
        term.expect("--gpu: unknown GPU 'B300'")
        term.expect("GPU (")
        term.type("L40S-48GB")
        term.expect("Traffic (chat or batch) [chat]:")
        term.type("batch")
        term.expect("SLO terms [ttft:p95<=10s, tpot:p95<=100ms]:")
        term.type("")
        term.expect("Prompt lengths in tokens (512-2048, or 1000) [1024-4096]:")
        term.type("")
        term.expect("Reply lengths in tokens (64-512, or 256) [256-1024]:")
        term.type("128-256")
        term.expect("Budget: launches (30) or hours (8h) [30]:")
        term.type("2")
        term.expect("Storage URL (empty: SQLite in the study's folder) []:")
        term.type("")
        term.expect("wrote first.yaml and first.space.yaml")
    finally:
        code = term.close()
    assert code == 0
    spec = yaml.safe_load((tmp_path / "first.yaml").read_text())
    assert spec["slo"]["terms"] == ["ttft:p95<=10s", "tpot:p95<=100ms"]
    assert spec["workload"]["dataset"] == {
        "input_len": {"dist": "uniform", "low": 1024, "high": 4096},
        "output_len": {"dist": "uniform", "low": 128, "high": 256},
    }
    assert spec["budget"] == {"launches": 2}
    assert spec["server"]["command"][-2:] == ["--sim-hardware", "L40S-48GB"]
    assert "storage" not in spec["study"]


@pytest.mark.slow
@pytest.mark.timeout(600)  # 104 s alone on the 2-core machine; a tuning study on a loaded one takes longer
def test_a_spec_init_writes_runs_as_a_study_and_tune_with_the_same_flags_resumes_it(tmp_path: Path) -> None:
    """init writes a spec; `tune --model ...` with the same answers finds it (nothing rewritten) and runs
    it on the simulated server: one launch, vLLM's defaults, measured; `best` reads the study (~2 min)."""
    answers = ["--model", "Qwen2.5-7B", "--gpu", "H100-80GB", "--simulate", "--budget", "1",
               "--max-model-len", "4096", "--input-len", "128-512", "--output-len", "16-64"]  # fmt: skip
    made = subprocess.run(
        [*CLI, "init", *answers],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        check=False,
    )
    assert made.returncode == 0, made.stderr
    spec = (tmp_path / "qwen2.5-7b.yaml").read_text()
    tuned = subprocess.run(
        [*CLI, "tune", *answers], cwd=tmp_path, capture_output=True, text=True, stdin=subprocess.DEVNULL,
        timeout=540, check=False, env={**os.environ, "COLUMNS": "200"},
    )  # fmt: skip
    assert tuned.returncode == 0, tuned.stdout[-2000:] + tuned.stderr[-2000:]
    assert "resuming from qwen2.5-7b.yaml and qwen2.5-7b.space.yaml, written by these flags" in tuned.stdout
    assert (tmp_path / "qwen2.5-7b.yaml").read_text() == spec
    best = subprocess.run(
        [*CLI, "best", "qwen2.5-7b.yaml"], cwd=tmp_path, capture_output=True, text=True, check=False
    )
    assert best.returncode == 0, best.stderr
    assert "Trials: 1 complete" in best.stdout
