"""Every benchmark script runs: ``python -m benchmarks.<name> --quick`` exits 0 and prints its result, so a
rename or a changed signature in the product breaks here, not on the next person who runs the benchmark
(``benchmarks/README.md``; ``agreement`` needs real vLLM and runs in ``tests/vllm``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCHMARKS = REPO / "benchmarks"

pytestmark = [pytest.mark.integration, pytest.mark.slow]

#: Each script, and a line of its output that only a finished run prints.
QUICK = {
    "feasibility": "All cases: caught",
    "fluid_accuracy": "| 8B on H100, KV plentiful | p95 TPOT |",
    "loadgen": "| autotune raw x1 |",
    "precision": "finalists beside the leader over 1 seeded studies of 2 configs",
    "racing": "| demo | race |",
    "search": "failed launches from #11",
    "sim_cost": "| server CPU per streamed token, 16 concurrent streams |",
    "sim_vs_published": "mean absolute relative error:",
    "truth": "wrong but valid",
    "window_bias": "long run       boundary",
}
#: Modules that are not scripts: what the scripts share.
SHARED = {"__init__", "sse_server", "vllm_cpu", "wiretap"}


def test_every_script_has_a_quick_run() -> None:
    scripts = {path.stem for path in BENCHMARKS.glob("*.py")} - SHARED
    assert scripts == {*QUICK, "agreement"}, "a benchmark script without a --quick run in the test suite"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", sorted(QUICK))
def test_quick_run(name: str) -> None:
    if name == "truth" and len(os.sched_getaffinity(0)) < 2:
        pytest.skip("benchmarks.truth needs two cores (server and client pinned apart)")
    done = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{name}", "--quick"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=200,
        check=False,
    )
    assert done.returncode == 0, (
        f"benchmarks.{name} --quick failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    )
    assert QUICK[name] in done.stdout, f"benchmarks.{name} --quick printed no result:\n{done.stdout[-3000:]}"
