"""The dry run (autotune.dryrun) on the demo spec: classified failures, an interior optimum, and results
that equal simulate() called directly on the same requests."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from autotune.dryrun import OK, REJECTED, DryRun, dry_run, evaluate_config, resolve_target
from autotune.errors import SpecError
from autotune.load.workload import arrival_times, build_requests
from autotune.loader import LoadedStudy, load_study
from autotune.sim import WorkloadRequest, simulate
from autotune.space import SearchSpace

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "studies" / "demo.yaml"


@pytest.fixture(scope="module")
def demo() -> LoadedStudy:
    return load_study(DEMO)


@pytest.fixture(scope="module")
def small_run(demo: LoadedStudy) -> DryRun:
    return dry_run(demo, samples=40, seed=0)


def _copy_demo(root: Path, **server: object) -> Path:
    (root / "studies").mkdir()
    (root / "search_spaces").mkdir()
    shutil.copy(REPO / "search_spaces" / "sim.yaml", root / "search_spaces" / "sim.yaml")
    data = yaml.safe_load(DEMO.read_text(encoding="utf-8"))
    data["server"].update(server)
    spec = root / "studies" / "demo.yaml"
    spec.write_text(yaml.safe_dump(data), encoding="utf-8")
    return spec


def test_target_is_parsed_from_the_command_and_fixed_args(demo: LoadedStudy) -> None:
    """The simulator's model, GPU profile and max_model_len come from server.command + server.args."""
    target = resolve_target(demo)
    assert target.arch.name == "Llama-3.1-8B"
    assert target.flags.hardware.name == "RTX-4090-24GB"
    assert target.flags.max_model_len == 2048
    assert target.source == "server.command"


def test_failures_are_classified(small_run: DryRun) -> None:
    """Every config ends in a named outcome; failed ones carry the error line and no throughput."""
    counts = small_run.outcomes()
    assert counts[OK] > 0
    assert counts["oom"] > 0  # utilisation close to 0.98 on a 24 GiB card
    assert counts[REJECTED] > 0  # chunked prefill off with a small token budget
    for r in small_run.results:
        if r.outcome == OK:
            assert r.slo_throughput is not None and r.slo_throughput > 0 and r.kv_tokens > 0
        else:
            assert r.slo_throughput is None and r.detail
    oom = next(r for r in small_run.results if r.outcome == "oom")
    assert "OutOfMemoryError" in oom.detail
    assert len(small_run.results) == 41  # the defaults plus 40 distinct samples


def test_rejected_config_names_the_constraint(demo: LoadedStudy) -> None:
    """A config breaking a known constraint is rejected before a launch, naming the rule."""
    config = {**demo.space.defaults(), "enable_chunked_prefill": False, "max_num_batched_tokens": 1024}
    result = evaluate_config(resolve_target(demo), demo, config)
    assert result.outcome == REJECTED
    assert "max_model_len" in result.detail


def test_optimum_is_interior_and_beats_the_default(demo: LoadedStudy, small_run: DryRun) -> None:
    """The best config is inside the space (neither tiny nor huge batches, not the OOM edge)."""
    best = small_run.best
    assert best is not None
    seqs = demo.space.params["max_num_seqs"]
    util = demo.space.params["gpu_memory_utilization"]
    assert 2 * seqs.low < int(best.flags["max_num_seqs"]) < seqs.high // 2
    assert float(best.flags["gpu_memory_utilization"]) < util.high
    assert small_run.default.slo_throughput is not None
    assert small_run.gain is not None and small_run.gain > 0.1


def test_result_matches_simulate_called_directly(demo: LoadedStudy, small_run: DryRun) -> None:
    """The operating point equals simulate() on the same requests and arrivals, with flags as a dict."""
    best = small_run.best
    assert best is not None and best.probe is not None and best.rate is not None
    wl = demo.spec.workload
    seed = wl.seed * 1000 + best.probe
    from autotune.load.probe import probe_requests

    n = probe_requests(best.rate, demo.spec.slo, demo.spec.measurement)
    requests = build_requests(wl, n, seed, demo.base_dir)
    arrivals = arrival_times(wl.arrival, best.rate, n, seed)
    workload = [
        WorkloadRequest(r.input_len, r.output_len, t) for r, t in zip(requests, arrivals, strict=True)
    ]
    direct = simulate(
        {**best.flags, "max_model_len": 2048}, "RTX-4090-24GB", "Llama-3.1-8B", workload, seed=0
    )
    assert direct.kv_tokens == best.kv_tokens
    assert direct.output_throughput == pytest.approx(best.slo_throughput, rel=1e-9)
    assert direct.stat("ttft", 95) == pytest.approx(best.ttft_p95, rel=1e-9)
    assert direct.stat("tpot", 95) == pytest.approx(best.tpot_p95, rel=1e-9)


def test_same_seed_same_result(demo: LoadedStudy) -> None:
    """The dry run is deterministic for a seed."""
    a = dry_run(demo, samples=5, seed=3)
    b = dry_run(demo, samples=5, seed=3)
    assert a.results == b.results


def test_real_server_needs_model_and_gpu(tmp_path: Path) -> None:
    """A spec launching real vLLM is dry-run only with --model and --gpu; the error names the option."""
    spec = _copy_demo(tmp_path, command=["vllm", "serve", "meta-llama/Llama-3.1-8B-Instruct"])
    loaded = load_study(spec)
    with pytest.raises(SpecError) as err:
        resolve_target(loaded)
    assert err.value.field == "--model" and "--gpu" in str(err.value)
    with pytest.raises(SpecError) as err:
        resolve_target(loaded, model="Llama-3.1-8B", gpu="B300")
    assert err.value.field == "--gpu" and "'B300'" in str(err.value)
    target = resolve_target(loaded, model="Llama-3.1-8B", gpu="H100-80GB")
    assert (target.arch.name, target.flags.hardware.name, target.source) == (
        "Llama-3.1-8B",
        "H100-80GB",
        "--model/--gpu",
    )
    assert target.flags.max_model_len == 2048


def test_bad_inputs_name_the_option(demo: LoadedStudy, tmp_path: Path) -> None:
    """--samples below 1 and a closed-loop workload are refused with the option or field named."""
    with pytest.raises(SpecError) as err:
        dry_run(demo, samples=0)
    assert err.value.field == "--samples"
    data = yaml.safe_load(DEMO.read_text(encoding="utf-8"))
    spec = _copy_demo(tmp_path)
    data["workload"]["arrival"] = {"process": "concurrency"}
    spec.write_text(yaml.safe_dump(data), encoding="utf-8")
    with pytest.raises(SpecError) as err:
        dry_run(load_study(spec), samples=1)
    assert err.value.field == "workload.arrival.process"


def test_space_defaults_are_the_default_row(demo: LoadedStudy, small_run: DryRun) -> None:
    """The default config is evaluated and marked as such."""
    assert dict(small_run.default.flags) == SearchSpace(demo.space, demo.spec.server.args).defaults()
