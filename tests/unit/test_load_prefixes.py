"""Shared-prefix groups: lengths from `len` or a target hit rate, groups drawn from the study's stream,
system prompts shared within a probe and new in every probe; the ideal and the server's hit rates."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from autotune.inputs.spec import MeasurementSpec, SloSection, WorkloadSpec
from autotune.load.client import request_body
from autotune.load.prefixes import PrefixGroups, ideal_hit_rate
from autotune.load.probe import ProbeSchedule
from autotune.load.prom import delta, parse
from autotune.load.request import RequestSpec
from autotune.load.workload import build_requests

SLO = SloSection(terms=("ttft:p95<=1s",))
MEASUREMENT = MeasurementSpec(min_requests=40, min_tail_samples=1, saturation_requests=20, probe_duration=2.0)


def workload(**prefix: Any) -> WorkloadSpec:
    return WorkloadSpec.model_validate(
        {
            "endpoint": "chat",
            "dataset": {
                "input_len": {"dist": "uniform", "low": 50, "high": 150},
                "output_len": 8,
                "prefix": prefix,
            },
        }
    )


def test_a_target_hit_rate_sets_every_groups_length() -> None:
    """hit_rate h gives each group h / (1 - h) times the mean of input_len: a first turn's prompt is then
    that share prefix, on average."""
    groups = PrefixGroups.of(workload(groups=3, hit_rate=0.75), 100.0)
    assert groups is not None and groups.lengths == (300, 300, 300)
    requests = build_requests(workload(groups=3, hit_rate=0.75), 2000, 1, Path("."), shapes_seed=0)
    share = sum(r.prefix_len for r in requests) / sum(r.input_len for r in requests)
    assert share == pytest.approx(0.75, abs=0.01)


def test_group_lengths_are_drawn_once_per_study_and_groups_by_weight() -> None:
    """With `len` each group's length is drawn once from the workload seed; a request's group follows the
    weights, drawn from the stream (the same groups in the same order for every content seed)."""
    wl = workload(groups=4, len={"dist": "uniform", "low": 100, "high": 400}, weights=[4, 3, 2, 1])
    groups = PrefixGroups.of(wl, 100.0)
    assert groups is not None and len(set(groups.lengths)) == 4
    assert all(100 <= n <= 400 for n in groups.lengths)
    a = build_requests(wl, 3000, 1, Path("."), shapes_seed=0)
    b = build_requests(wl, 100, 2, Path("."), shapes_seed=0)
    assert [r.group for r in a[:100]] == [r.group for r in b]
    counts = Counter(r.group for r in a)
    assert [counts[g] / 3000 for g in range(4)] == pytest.approx([0.4, 0.3, 0.2, 0.1], abs=0.03)
    assert all(r.prefix_len == groups.lengths[r.group or 0] for r in a)


def test_lengths_without_groups_are_unchanged_by_groups() -> None:
    """A request's own length is the same with and without groups (the groups have a stream of their own):
    turning prefixes on compares like with like."""
    wl = workload(groups=2, hit_rate=0.5)
    plain = WorkloadSpec.model_validate(
        {"dataset": {"input_len": {"dist": "uniform", "low": 50, "high": 150}}}
    )
    grouped = build_requests(wl, 50, 1, Path("."), shapes_seed=0)
    alone = build_requests(plain, 50, 1, Path("."), shapes_seed=0)
    assert [r.input_len - r.prefix_len for r in grouped] == [r.input_len for r in alone]


def test_system_prompts_are_shared_within_a_probe_and_new_in_every_probe() -> None:
    """Within a probe every request of a group (warm-up ones too) carries the same system prompt; the next
    probe's are different (its cache never serves one probe from another), and the same probe number gets
    the same ones in every trial."""
    schedule = ProbeSchedule(workload(groups=3, hit_rate=0.8), SLO, MEASUREMENT, Path("."))
    first = schedule.plan(1, 20.0, warmup_s=1.0)
    systems: dict[int, set[Any]] = {}
    for r in first.requests:
        assert r.group is not None
        systems.setdefault(r.group, set()).add(r.system)
    assert first.judged.start > 0 and all(len(s) == 1 for s in systems.values())
    second = schedule.plan(2, 20.0, warmup_s=1.0)
    assert {r.system for r in first.requests}.isdisjoint({r.system for r in second.requests})
    again = ProbeSchedule(workload(groups=3, hit_rate=0.8), SLO, MEASUREMENT, Path(".")).plan(
        1, 20.0, warmup_s=1.0
    )
    assert [r.system for r in again.requests] == [r.system for r in first.requests]


def test_the_chat_endpoint_sends_the_system_prompt_as_a_system_message() -> None:
    """A grouped request's system prompt is a system message on chat, the prompt's head on completions."""
    request = RequestSpec("hi there", 5, 3, system="you are terse", group=0, prefix_len=3)
    chat = request_body("m", "chat", request, ignore_eos=True, temperature=0.0)
    assert chat["messages"] == [
        {"role": "system", "content": "you are terse"},
        {"role": "user", "content": "hi there"},
    ]
    completion = request_body("m", "completions", request, ignore_eos=True, temperature=0.0)
    assert completion["prompt"] == "you are terse hi there"
    ids = RequestSpec([7, 8], 5, 3, system=[1, 2, 3], group=0, prefix_len=3)
    assert request_body("m", "completions", ids, ignore_eos=True, temperature=0.0)["prompt"] == [
        1,
        2,
        3,
        7,
        8,
    ]


def test_the_ideal_hit_rate_counts_a_groups_prefix_after_its_first_use_and_a_turns_history() -> None:
    """The share of the judged prompt tokens a cache keeping everything serves: a group's prefix once the
    group was used before (warm-up included), and a later turn's whole history."""
    requests = [
        RequestSpec("", 100, 10, None, 0, 60),  # warm-up: first use of group 0
        RequestSpec("", 100, 10, None, 0, 60),  # judged: 60 of 100
        RequestSpec("", 80, 10, None, 1, 40),  # judged: first use of group 1, 0 of 80
        RequestSpec("", 130, 10, None, 1, 40, follows=2, turn=2),  # judged: history 90 of 130
    ]
    assert ideal_hit_rate(requests, range(1, 4)) == pytest.approx((60 + 0 + 90) / (100 + 80 + 130), abs=1e-4)
    assert ideal_hit_rate(requests, range(0)) is None


def test_the_server_delta_carries_the_prefix_caches_hit_rate() -> None:
    """vllm:prefix_cache_hits_total over ..._queries_total between two scrapes (vLLM 0.7-0.9's gpu_ names
    too); absent metrics give None and no key."""
    before = parse("vllm:prefix_cache_queries_total 100\nvllm:prefix_cache_hits_total 40\n")
    after = parse("vllm:prefix_cache_queries_total 1100\nvllm:prefix_cache_hits_total 840\n")
    d = delta(before, after)
    assert d.prefix_cache_hit_rate == 0.8 and d.as_dict()["prefix_cache_hit_rate"] == 0.8
    old = delta(
        parse("vllm:gpu_prefix_cache_queries_total 0\n"),
        parse("vllm:gpu_prefix_cache_queries_total 50\nvllm:gpu_prefix_cache_hits_total 5\n"),
    )
    assert old.prefix_cache_hit_rate == 0.1
    none = delta(parse("x 1\n"), parse("x 2\n"))
    assert none.prefix_cache_hit_rate is None and "prefix_cache_hit_rate" not in none.as_dict()
    assert not math.isnan(d.prefix_cache_queries or 0.0)
