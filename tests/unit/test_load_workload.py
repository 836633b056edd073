"""Workload building: synthetic lengths, prefixes, file datasets, arrival processes."""

from __future__ import annotations

import itertools
import json
import math
import statistics
from pathlib import Path

import pytest

from autotune.errors import LoadError
from autotune.inputs.spec import ArrivalSpec, LengthDist, WorkloadSpec
from autotune.load.workload import arrival_times, build_requests, sample_length, trace_timestamps


def workload(**dataset: object) -> WorkloadSpec:
    return WorkloadSpec.model_validate({"dataset": dataset})


def test_fixed_lengths_give_prompts_of_exactly_that_many_words(tmp_path: Path) -> None:
    """A fixed input length gives prompts of that many whitespace-separated words (one sim token each)."""
    reqs = build_requests(workload(input_len=37, output_len=5), 20, seed=1, base_dir=tmp_path)
    assert len(reqs) == 20
    for r in reqs:
        assert isinstance(r.prompt, str)
        assert len(r.prompt.split()) == 37 == r.input_len
        assert r.output_len == 5


def test_shared_prefix_is_common_and_counted(tmp_path: Path) -> None:
    """prefix_len words are shared by all requests (and across seeds) and counted in input_len."""
    wl = workload(input_len=10, output_len=3, prefix_len=16)
    a = build_requests(wl, 5, seed=1, base_dir=tmp_path)
    b = build_requests(wl, 5, seed=2, base_dir=tmp_path)
    prefixes = {" ".join(str(r.prompt).split()[:16]) for r in a + b}
    assert len(prefixes) == 1
    assert all(r.input_len == 26 and len(str(r.prompt).split()) == 26 for r in a)
    assert a[0].prompt != b[0].prompt  # the unique parts differ between seeds


def test_token_id_prompts_have_exact_lengths_and_chat_refuses_them(tmp_path: Path) -> None:
    """prompt_format='token_ids' gives id lists of the intended length; chat needs text."""
    wl = workload(input_len=12, output_len=3, prefix_len=4)
    reqs = build_requests(wl, 3, seed=0, base_dir=tmp_path, prompt_format="token_ids")
    assert all(isinstance(r.prompt, list) and len(r.prompt) == 16 for r in reqs)
    chat = WorkloadSpec.model_validate({"endpoint": "chat"})
    with pytest.raises(LoadError, match="chat"):
        build_requests(chat, 1, seed=0, base_dir=tmp_path, prompt_format="token_ids")


def test_requests_are_deterministic_per_seed(tmp_path: Path) -> None:
    """The same seed gives identical requests; another seed different ones."""
    wl = workload(input_len={"dist": "uniform", "low": 5, "high": 50}, output_len=4)
    assert build_requests(wl, 10, 3, tmp_path) == build_requests(wl, 10, 3, tmp_path)
    assert build_requests(wl, 10, 3, tmp_path) != build_requests(wl, 10, 4, tmp_path)


@pytest.mark.parametrize(
    ("dist", "mean"),
    [
        ({"dist": "uniform", "low": 10, "high": 30}, 20.0),
        ({"dist": "normal", "mean": 100, "std": 10}, 100.0),
        ({"dist": "lognormal", "mean": 200, "std": 100}, 200.0),
    ],
)
def test_length_distributions_have_the_asked_mean(dist: dict[str, object], mean: float) -> None:
    """uniform/normal/lognormal lengths average to the asked mean (lognormal: mean of the lengths)."""
    import random

    rng = random.Random(0)
    spec = LengthDist.model_validate(dist)
    xs = [sample_length(spec, rng) for _ in range(20000)]
    assert statistics.fmean(xs) == pytest.approx(mean, rel=0.03)


def test_lengths_are_clipped_to_low_and_high() -> None:
    """normal lengths never leave [low, high]."""
    import random

    rng = random.Random(0)
    spec = LengthDist(dist="normal", mean=50, std=40, low=20, high=60)
    xs = [sample_length(spec, rng) for _ in range(5000)]
    assert min(xs) == 20
    assert max(xs) == 60


def test_arrivals_poisson_mean_rate_and_determinism() -> None:
    """Poisson arrivals start at 0, have exponential gaps (coefficient of variation 1), repeat per seed."""
    a = arrival_times(ArrivalSpec(), rate=10.0, n=20001, seed=7)
    assert a[0] == 0.0
    assert a == sorted(a)
    gaps = [y - x for x, y in itertools.pairwise(a)]
    assert statistics.pstdev(gaps) / statistics.fmean(gaps) == pytest.approx(1.0, rel=0.03)
    assert a == arrival_times(ArrivalSpec(), 10.0, 20001, 7)
    assert a != arrival_times(ArrivalSpec(), 10.0, 20001, 8)


@pytest.mark.parametrize("process", ["poisson", "gamma"])
@pytest.mark.parametrize("n", [2, 7, 90, 1000])
def test_every_seed_offers_exactly_the_nominal_rate(process: str, n: int) -> None:
    """The last request goes out at exactly (n - 1) / rate whatever the seed: the offered load is the
    nominal rate, not a draw 10 % above or below it (vllm bench serve rescales its draws the same way)."""
    spec = ArrivalSpec.model_validate({"process": process, "burstiness": 0.5})
    for seed in range(20):
        a = arrival_times(spec, 3.0, n, seed)
        assert a[-1] == pytest.approx((n - 1) / 3.0, rel=1e-12)


def test_gamma_burstiness_keeps_mean_and_changes_variance() -> None:
    """Gamma gaps with shape b keep mean 1/rate; their coefficient of variation is 1/sqrt(b)."""
    for shape in (0.25, 4.0):
        a = arrival_times(ArrivalSpec(process="gamma", burstiness=shape), 5.0, 20001, 1)
        gaps = [y - x for x, y in itertools.pairwise(a)]
        assert statistics.fmean(gaps) == pytest.approx(0.2, rel=0.05)
        cv = statistics.pstdev(gaps) / statistics.fmean(gaps)
        assert cv == pytest.approx(1 / math.sqrt(shape), rel=0.08)


def test_infinite_rate_and_concurrency_send_everything_at_zero() -> None:
    """rate=inf, or the concurrency process, puts every arrival at 0."""
    assert arrival_times(ArrivalSpec(), math.inf, 4, 0) == [0.0] * 4
    assert arrival_times(ArrivalSpec(process="concurrency"), 3.0, 4, 0) == [0.0] * 4
    with pytest.raises(LoadError):
        arrival_times(ArrivalSpec(), 0.0, 4, 0)


def test_trace_dataset_lengths_and_rescaled_timestamps(tmp_path: Path) -> None:
    """A trace gives its lengths in time order and its timestamps rescaled to the asked mean rate."""
    lines = [{"timestamp": t, "input_len": 10 + t, "output_len": 3} for t in (0, 1, 3, 4)]
    (tmp_path / "t.jsonl").write_text("\n".join(json.dumps(x) for x in lines))
    wl = WorkloadSpec.model_validate(
        {"dataset": {"kind": "trace", "path": "t.jsonl"}, "arrival": {"process": "trace"}}
    )
    reqs = build_requests(wl, 4, 0, tmp_path)
    assert [r.input_len for r in reqs] == [10, 11, 13, 14]
    ts = trace_timestamps(wl.dataset, tmp_path)
    a = arrival_times(wl.arrival, 2.0, 4, 0, trace=ts)
    assert a == pytest.approx([0.0, 0.375, 1.125, 1.5])  # gaps 1,2,1 (mean 4/3) scaled to mean 0.5


def test_an_unsorted_trace_keeps_each_requests_lengths_with_its_own_arrival(tmp_path: Path) -> None:
    """A trace file out of time order is read in time order: lengths stay with their timestamps; a trace
    whose timestamps are all equal has no pattern to replay (LoadError, not one burst)."""
    lines = [{"timestamp": t, "input_len": 100 + t, "output_len": 3} for t in (3, 0, 4, 1)]
    (tmp_path / "t.jsonl").write_text("\n".join(json.dumps(x) for x in lines))
    wl = WorkloadSpec.model_validate(
        {"dataset": {"kind": "trace", "path": "t.jsonl"}, "arrival": {"process": "trace"}}
    )
    assert [r.input_len for r in build_requests(wl, 4, 0, tmp_path)] == [100, 101, 103, 104]
    assert trace_timestamps(wl.dataset, tmp_path) == [0.0, 1.0, 3.0, 4.0]
    with pytest.raises(LoadError, match="all equal"):
        arrival_times(wl.arrival, 2.0, 4, 0, trace=[5.0, 5.0, 5.0])


def test_jsonl_and_sharegpt_datasets(tmp_path: Path) -> None:
    """JSONL prompts keep their output_len; ShareGPT takes the reply's word count; short files cycle."""
    (tmp_path / "p.jsonl").write_text('{"prompt": "a b c", "output_len": 7}\n{"text": "d e"}\n')
    wl = workload(kind="jsonl", path="p.jsonl", output_len=2)
    reqs = build_requests(wl, 4, 0, tmp_path)
    assert sorted((r.prompt, r.output_len) for r in reqs) == [("a b c", 7)] * 2 + [("d e", 2)] * 2
    share = [{"conversations": [{"from": "human", "value": "hi there"}, {"from": "gpt", "value": "x y z"}]}]
    (tmp_path / "s.json").write_text(json.dumps(share))
    reqs = build_requests(workload(kind="sharegpt", path="s.json"), 1, 0, tmp_path)
    assert (reqs[0].prompt, reqs[0].input_len, reqs[0].output_len) == ("hi there", 2, 3)


def test_bad_dataset_raises_load_error_with_line(tmp_path: Path) -> None:
    """A malformed JSONL line raises LoadError naming the file and line."""
    (tmp_path / "bad.jsonl").write_text('{"prompt": "ok"}\nnot json\n')
    with pytest.raises(LoadError, match="line 2"):
        build_requests(workload(kind="jsonl", path="bad.jsonl"), 1, 0, tmp_path)


def test_the_sample_trace_is_read_with_its_recorded_rate() -> None:
    """studies/traces/sample.jsonl (synthetic) holds 240 requests at 1.894 req/s as recorded; a probe
    replays its gaps rescaled to the probe's rate whatever time_scale says, and records how much faster
    than recorded its judged window was (time_scale only sets `bench --rate trace`'s rate)."""
    from autotune.inputs.spec import MeasurementSpec, SloSection
    from autotune.load.probe import ProbeSchedule
    from autotune.load.workload import trace_rate

    repo = Path(__file__).resolve().parents[2]
    plain = WorkloadSpec.model_validate(
        {"dataset": {"kind": "trace", "path": "studies/traces/sample.jsonl"}, "arrival": {"process": "trace"}}
    )
    stamps = trace_timestamps(plain.dataset, repo)
    assert len(stamps) == 240
    assert trace_rate(stamps) == pytest.approx(1.894, abs=0.001)
    assert trace_rate([5.0]) is None and trace_rate([1.0, 1.0]) is None
    scaled = plain.model_copy(update={"dataset": plain.dataset.model_copy(update={"time_scale": 2.0})})
    slo, meas = SloSection(terms=("ttft:p95<=1s",)), MeasurementSpec(min_requests=20, min_tail_samples=1)
    a = ProbeSchedule(plain, slo, meas, repo)
    b = ProbeSchedule(scaled, slo, meas, repo)
    plan_a, plan_b = a.plan(1, 3.788, 1.0), b.plan(1, 3.788, 1.0)
    assert plan_a.arrivals == plan_b.arrivals
    speed = a.traffic(plan_a, []).trace_speed
    # the speed is the judged window's own: its stretch of the recording over the time it was played in
    ordered, n = sorted(stamps), len(plan_a.judged)
    assert n < len(ordered)
    assert speed == pytest.approx((ordered[n - 1] - ordered[0]) / plan_a.window_s, rel=0.005)
