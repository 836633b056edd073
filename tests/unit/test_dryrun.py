"""The dry run (autotune.predict.dryrun) on the demo spec: classified failures, an interior optimum, and
results that equal simulate() called directly on the same requests."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from autotune.errors import SpecError
from autotune.inputs.loader import LoadedStudy, load_study
from autotune.inputs.space import SearchSpace
from autotune.load.metrics import percentile
from autotune.load.probe import ProbeSchedule
from autotune.predict.dryrun import (
    OK,
    REJECTED,
    DryRun,
    SimProber,
    dry_run,
    evaluate_config,
    resolve_target,
    serve_flags,
)
from autotune.sim import WorkloadRequest, simulate

REPO = Path(__file__).resolve().parents[2]
DEMO = Path(__file__).resolve().parent / "fixtures" / "rtx4090.yaml"
"""An RTX 4090 study: some configs OOM, some are refused by a constraint."""
SHIPPED = REPO / "studies" / "demo.yaml"


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
    data["search_space"] = "../search_spaces/sim.yaml"
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


def test_the_shipped_demo_has_an_interior_optimum_that_beats_the_default() -> None:
    """In the demo's landscape a smaller prefill chunk than vLLM's default 2,048 tokens sustains over 10 %
    more traffic within the SLO, and the smallest chunks lose again (TTFT): the optimum is interior."""
    shipped = dry_run(load_study(SHIPPED), samples=40, seed=0)
    best = shipped.best
    assert best is not None and shipped.gain is not None and shipped.gain > 0.1
    chunk = int(best.flags["max_num_batched_tokens"])
    assert 512 < chunk < 2048
    smallest = min(
        (r for r in shipped.results if r.slo_throughput is not None),
        key=lambda r: int(r.flags["max_num_batched_tokens"]),
    )
    assert smallest.slo_throughput is not None and smallest.slo_throughput < best.slo_throughput


def test_a_sim_probe_is_simulate_on_the_probes_plan(demo: LoadedStudy) -> None:
    """The dry run's probe is simulate() on the schedule's plan for that probe (warm-up, judged and drain
    requests, flags as a dict), judged on its judged requests only; the result's figure is its
    estimated rate times the judged requests' mean output tokens."""
    target = resolve_target(demo)
    config = dict(SearchSpace(demo.space, demo.spec.server.args).defaults())
    spec = demo.spec
    schedule = ProbeSchedule(spec.workload, spec.slo, spec.measurement, demo.base_dir, prompts=False)
    prober = SimProber(serve_flags(target, config), target.arch, schedule)
    outcome = prober(6.0, 1.5)
    plan = schedule.plan(1, 6.0, 1.5)
    workload = [
        WorkloadRequest(r.input_len, r.output_len, t)
        for r, t in zip(plan.requests, plan.arrivals, strict=True)
    ]
    direct = simulate({**config, "max_model_len": 2048}, "RTX-4090-24GB", "Llama-3.1-8B", workload, seed=0)
    judged = sorted((r for r in direct.requests if r.index in plan.judged), key=lambda r: r.index)
    assert [r.index for r in outcome.records] == [r.index for r in judged]
    assert outcome.metrics.ttft.p95 == pytest.approx(percentile([r.ttft for r in judged], 95), rel=1e-9)
    assert outcome.tokens_per_request == pytest.approx(sum(r.output_len for r in judged) / len(judged))
    assert outcome.warmup_s == 1.5 and not outcome.early_stopped
    result = evaluate_config(target, demo, config)
    assert result.rate is not None and result.slo_throughput is not None
    assert 0 < result.slo_throughput / result.rate < 96  # tokens per request: uniform 16-96


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
    spec = _copy_demo(tmp_path)
    data = yaml.safe_load(spec.read_text(encoding="utf-8"))
    data["workload"]["arrival"] = {"process": "concurrency"}
    spec.write_text(yaml.safe_dump(data), encoding="utf-8")
    with pytest.raises(SpecError) as err:
        dry_run(load_study(spec), samples=1)
    assert err.value.field == "workload.arrival.process"


def test_space_defaults_are_the_default_row(demo: LoadedStudy, small_run: DryRun) -> None:
    """The default config is evaluated and marked as such."""
    assert dict(small_run.default.flags) == SearchSpace(demo.space, demo.spec.server.args).defaults()
