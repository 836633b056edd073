"""The simulator and the dry run replay the new traffic: a later turn arrives `think` after the turn before it
finished, its history hits the prefix cache; prefix groups share their first tokens."""

from __future__ import annotations

import copy
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from autotune.errors import SpecError
from autotune.inputs.loader import load_study
from autotune.load.probe import ProbeSchedule
from autotune.predict.dryrun import SimProber, dry_run, resolve_target, serve_flags, sim_requests
from autotune.sim import WorkloadRequest, simulate

REPO = Path(__file__).resolve().parents[2]
HW, MODEL = "H100-80GB", "Llama-3.1-8B"
FLAGS = {"max_model_len": 4096}


def test_a_later_turn_arrives_think_seconds_after_the_turn_before_it_finished() -> None:
    """`after` makes a request wait for another's end plus `think`; its own arrival time is ignored."""
    workload = [
        WorkloadRequest(500, 20, 0.0),
        WorkloadRequest(600, 20, 99.0, after=0, think=0.5),
        WorkloadRequest(700, 20, 99.0, after=1, think=0.25),
    ]
    sim = simulate(FLAGS, HW, MODEL, workload)
    first, second, third = sorted(sim.requests, key=lambda r: r.index)
    assert second.arrival == pytest.approx(first.arrival + first.e2el + 0.5)
    assert third.arrival == pytest.approx(second.arrival + second.e2el + 0.25)
    assert sim.failed == 0


def test_a_turn_after_a_rejected_one_never_arrives() -> None:
    """A turn that follows a request too long for max_model_len is rejected with it (and what follows)."""
    workload = [
        WorkloadRequest(5000, 20, 0.0),
        WorkloadRequest(100, 20, 0.0, after=0, think=0.1),
        WorkloadRequest(100, 20, 0.0, after=1),
        WorkloadRequest(100, 20, 0.0),
    ]
    sim = simulate(FLAGS, HW, MODEL, workload)
    assert sorted(sim.rejected) == [0, 1, 2] and sim.failed == 3
    assert [r.index for r in sim.requests] == [3]


def test_after_must_name_another_request() -> None:
    """`after` pointing outside the workload, at itself, or twice at one request is refused."""
    for bad in ([WorkloadRequest(10, 2, after=5)], [WorkloadRequest(10, 2, after=0)]):
        with pytest.raises(ValueError, match="after"):
            simulate(FLAGS, HW, MODEL, bad)
    twice = [WorkloadRequest(10, 2), WorkloadRequest(10, 2, after=0), WorkloadRequest(10, 2, after=0)]
    with pytest.raises(ValueError, match="after"):
        simulate(FLAGS, HW, MODEL, twice)


def _chat_spec(root: Path, **workload: Any) -> Path:
    data = yaml.safe_load((REPO / "studies" / "prefix-chat.yaml").read_text(encoding="utf-8"))
    data["workload"] = {**data["workload"], **workload}
    (root / "studies").mkdir()
    (root / "search_spaces").mkdir()
    shutil.copy(REPO / "search_spaces" / "sim-prefix.yaml", root / "search_spaces" / "sim-prefix.yaml")
    spec = root / "studies" / "chat.yaml"
    spec.write_text(yaml.safe_dump(data), encoding="utf-8")
    return spec


def test_sim_requests_repeat_a_turns_prompt_and_reply_in_the_next() -> None:
    """The dry run's token ids for a later turn start with the turn before it and that turn's reply; a
    group's requests share their group's first tokens."""
    loaded = load_study(REPO / "studies" / "prefix-chat.yaml")
    spec = loaded.spec
    schedule = ProbeSchedule(spec.workload, spec.slo, spec.measurement, loaded.base_dir, prompts=False)
    plan = schedule.plan(2, 5.0, warmup_s=1.0)
    requests = sim_requests(plan)
    for i, (w, r) in enumerate(zip(requests, plan.requests, strict=True)):
        ids = w.token_ids(i)
        assert ids is not None and len(ids) == r.input_len
        if r.follows is not None:
            before = requests[r.follows]
            previous = before.token_ids(r.follows)
            assert previous is not None and tuple(ids[: len(previous)]) == tuple(previous)
            assert w.after == r.follows and w.think == r.think
    heads = {}
    for i, (w, r) in enumerate(zip(requests, plan.requests, strict=True)):
        if r.follows is None:
            ids = w.token_ids(i)
            assert ids is not None
            head = tuple(ids[: r.prefix_len])
            assert heads.setdefault(r.group, head) == head


def test_the_dry_run_of_prefix_heavy_chat_hits_the_cache_as_planned() -> None:
    """A probe of the prefix-chat study on the simulator: the cache serves close to the ideal share of the
    prompt tokens (below it: whole blocks only), TTFT is reported by turn, and with prefix caching off the
    same traffic hits nothing."""
    loaded = load_study(REPO / "studies" / "prefix-chat.yaml")
    spec = loaded.spec
    target = resolve_target(loaded)
    schedule = ProbeSchedule(spec.workload, spec.slo, spec.measurement, loaded.base_dir, prompts=False)
    defaults = dict(loaded.search_space.defaults())
    on = SimProber(serve_flags(target, defaults), target.arch, schedule)(5.0, 1.0, 4.0)
    assert on.ideal_hit_rate is not None and on.ideal_hit_rate > 0.8
    assert on.server is not None and on.server.prefix_cache_hit_rate is not None
    assert on.ideal_hit_rate - 0.1 < on.server.prefix_cache_hit_rate <= on.ideal_hit_rate
    assert on.ttft_by_turn is not None and {"1", "2"} <= set(on.ttft_by_turn)
    off = SimProber(serve_flags(target, {**defaults, "enable_prefix_caching": False}), target.arch, schedule)
    cold = off(5.0, 1.0, 4.0)
    assert cold.server is not None and not cold.server.prefix_cache_hits
    assert cold.metrics.ttft.p95 > on.metrics.ttft.p95


def test_the_dry_run_refuses_only_the_concurrency_process(tmp_path: Path) -> None:
    """Conversations and prefix groups dry-run; the concurrency process is still refused in one line."""
    spec = _chat_spec(tmp_path)
    loaded = load_study(spec)
    assert dry_run(loaded, samples=1).default.outcome in ("ok", "slo_unreachable")
    data = yaml.safe_load(spec.read_text(encoding="utf-8"))
    bad = copy.deepcopy(data)
    bad["workload"].pop("conversation")
    bad["workload"]["arrival"] = {"process": "concurrency"}
    spec.write_text(yaml.safe_dump(bad), encoding="utf-8")
    with pytest.raises(SpecError, match="concurrency"):
        dry_run(load_study(spec), samples=1)
