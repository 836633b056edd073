"""Multi-turn chat: the client sends a later turn after the one before it ended, with the conversation so far;
the schedule draws every conversation from the study's stream; TTFT is reported by turn."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from autotune.inputs.spec import MeasurementSpec, SloSection, WorkloadSpec
from autotune.load.client import load_job, request_body, run_requests
from autotune.load.conversation import build_conversations, flatten, mean_turns, shapes, ttft_by_turn
from autotune.load.engines import Engine
from autotune.load.exchange import Exchange
from autotune.load.probe import STREAM, Prober, ProbeSchedule, probe_seed
from autotune.load.ratesearch import valid_probe
from autotune.load.records import Preparation, RequestRecord
from autotune.load.request import RequestSpec
from autotune.load.workers import Job, run_limit

from .sse_server import SseServer

SLO = SloSection(terms=("ttft:p95<=1s",))
MEASUREMENT = MeasurementSpec(min_requests=30, min_tail_samples=1, saturation_requests=20, probe_duration=2.0)


def chat(**conversation: Any) -> WorkloadSpec:
    return WorkloadSpec.model_validate(
        {
            "endpoint": "chat",
            "dataset": {
                "input_len": {"dist": "uniform", "low": 3, "high": 9},
                "output_len": {"dist": "uniform", "low": 2, "high": 6},
                "prefix": {"groups": 3, "len": {"dist": "uniform", "low": 10, "high": 20}},
            },
            "conversation": {"turns": {"dist": "uniform", "low": 1, "high": 4}, **conversation},
        }
    )


@pytest.fixture(scope="module")
def server() -> Iterator[SseServer]:
    with SseServer() as srv:
        yield srv


@pytest.fixture(params=["aiohttp", "raw"])
def engine(request: pytest.FixtureRequest) -> Engine:
    value: Engine = request.param
    return value


def conversation(think: float = 0.0) -> list[RequestSpec]:
    return [
        RequestSpec("hello there", 12, 3, system="be brief", group=0, prefix_len=2),
        RequestSpec("and then", 17, 2, "be brief", 0, 2, follows=0, think=think, turn=2),
        RequestSpec("bye", 20, 4, "be brief", 0, 2, follows=1, think=think, turn=3),
    ]


def test_a_later_turn_sends_the_conversation_so_far_after_the_reply_ended(
    server: SseServer, engine: Engine
) -> None:
    """Turn k is sent `think` after turn k-1 ended, its messages the system prompt, every earlier message
    and the reply received to it (the text the server streamed), then its own message."""
    server.seen()
    result = run_requests(
        load_job(server.url, "pace-20", "chat", conversation(0.2), [0.0, 0.0, 0.0], engine=engine)
    )
    first, second, third = result.records
    assert all(r.success for r in result.records)
    # Never before its think time (sent at its arrival, 0, it would be early); how late a busy machine
    # wakes the client is the self-check's to judge, so the bound above is loose.
    assert 0.2 - 1e-3 <= second.send_time - first.end_time < 1.2
    assert 0.2 - 1e-3 <= third.send_time - second.end_time < 1.2
    bodies = server.seen()["bodies"]
    assert bodies[0]["messages"] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello there"},
    ]
    assert bodies[2]["messages"] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello there"},
        {"role": "assistant", "content": " w0 w1 w2"},
        {"role": "user", "content": "and then"},
        {"role": "assistant", "content": " w0 w1"},
        {"role": "user", "content": "bye"},
    ]


def test_completions_send_the_history_as_one_prompt(server: SseServer) -> None:
    """On the completions endpoint a later turn's prompt is the system prompt, the earlier prompts and
    replies, and its own message, in order, as one text."""
    server.seen()
    result = run_requests(load_job(server.url, "pace-1", "completions", conversation()[:2], [0.0, 0.0]))
    assert all(r.success for r in result.records)
    bodies = server.seen()["bodies"]
    assert bodies[0]["prompt"] == "be brief hello there"
    assert bodies[1]["prompt"] == "be brief hello there w0 w1 w2 and then"


def test_turns_after_a_failed_turn_are_recorded_failed_and_never_sent(server: SseServer) -> None:
    """A conversation whose turn failed cannot go on: its later turns are failures (the error budget counts
    them), none is sent, and the run ends."""
    server.seen()
    result = run_requests(load_job(server.url, "http500", "chat", conversation(), [0.0, 0.0, 0.0]))
    assert [r.success for r in result.records] == [False, False, False]
    assert "not sent: turn 1" in result.records[1].error
    assert "not sent: turn 1" in result.records[2].error
    assert len(server.seen()["bodies"]) == 1


def test_exchange_keeps_the_reply_text_only_when_asked() -> None:
    """Content events' text (completions `text`, chat `delta.content`) is kept for a turn that is followed,
    counted as before either way."""
    data = (
        b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
        b'data: {"choices":[{"index":0,"delta":{"content":" hi"}}]}\n\n'
        b'data: {"choices":[{"index":0,"text":" there"}]}\n\n'
        b'data: {"choices":[],"usage":{"completion_tokens":2,"prompt_tokens":3}}\n\ndata: [DONE]\n\n'
    )
    kept, plain = Exchange(keep_text=True), Exchange()
    kept.feed(data, 1.0)
    plain.feed(data, 1.0)
    assert kept.reply() == " hi there"
    assert plain.reply() == "" and plain.text is None
    assert len(kept.times) == len(plain.times) == 3


def test_request_body_refuses_a_history_with_token_ids() -> None:
    """Token-id prompts cannot carry a conversation's text history."""
    from autotune.errors import LoadError

    with pytest.raises(LoadError, match="token-id"):
        request_body(
            "m",
            "completions",
            RequestSpec([5, 6], 2, 1),
            ignore_eos=True,
            temperature=0.0,
            history=[("user", "x")],
        )


def test_workers_keep_each_conversation_on_one_worker() -> None:
    """Splitting a run over workers deals out conversations, not requests: every turn goes with its first."""
    turns = flatten([conversation(), conversation()[:1], conversation()[:2]])
    job = Job(
        "http://x",
        "m",
        "chat",
        turns,
        [0.0] * 6,
        list(range(6)),
        True,
        0.0,
        9.0,
        None,
        "raw",
        {},
        "p",
        Preparation(),
    )
    shares = [job.share(w, 2) for w in range(2)]
    assert shares[0].indices == [0, 1, 2, 4, 5] and shares[1].indices == [3]
    for share in shares:
        names = set(share.indices)
        assert all(r.follows is None or r.follows in names for r in share.requests)


def test_conversations_come_from_the_stream_and_tokens_from_the_probe() -> None:
    """Every draw of a stream gives the same conversations in the same order (shapes, groups); another
    content seed changes the messages' and system prompts' tokens only."""
    wl = chat(think_time={"dist": "exponential", "mean": "1s"})
    a = flatten(build_conversations(wl, 6, 11, stream_seed=0, prefix_seed=11))
    b = flatten(build_conversations(wl, 9, 12, stream_seed=0, prefix_seed=12))
    shape = [(r.input_len, r.output_len, r.group, r.follows, r.think, r.turn) for r in a]
    assert shape == [(r.input_len, r.output_len, r.group, r.follows, r.think, r.turn) for r in b[: len(a)]]
    assert all(x.prompt != y.prompt for x, y in zip(a, b, strict=False))
    assert {x.system for x in a}.isdisjoint({y.system for y in b})
    for r in a:  # a later turn counts the turn before it and its reply in its prompt
        if r.follows is not None:
            before = a[r.follows]
            assert r.input_len > before.input_len + before.output_len
            assert (r.turn, r.system) == (before.turn + 1, before.system)


def test_the_multi_turn_plan_judges_whole_conversations_at_the_request_rate() -> None:
    """A probe's judged requests are every turn of the stream's first conversations; conversations start
    at rate / mean turns, so the judged window offers about `rate` requests per second; warm-up
    conversations come before, drain ones after, each turn at its conversation's start."""
    wl = chat(think_time="0.5s")
    schedule = ProbeSchedule(wl, SLO, MEASUREMENT, Path("."))
    plan = schedule.plan(2, 10.0, warmup_s=1.0, window_s=4.0)
    judged = [plan.requests[i] for i in plan.judged]
    assert len(judged) >= 40 and judged[0].turn == 1 and plan.judged.start > 0
    assert plan.requests[plan.judged.stop].turn == 1  # the drain starts with a whole conversation
    conversations = sum(1 for r in judged if r.turn == 1)
    assert conversations == pytest.approx(len(judged) / mean_turns(wl), rel=0.3)
    assert plan.window_s == pytest.approx((conversations - 1) / (10.0 / mean_turns(wl)), rel=1e-6)
    for i, r in enumerate(plan.requests):
        if r.follows is not None:
            assert plan.arrivals[i] == plan.arrivals[r.follows]
    again = schedule.plan(5, 10.0, warmup_s=1.0, window_s=4.0)
    lengths = [(r.input_len, r.output_len, r.turn) for r in judged]
    assert (
        lengths
        == [
            (again.requests[i].input_len, again.requests[i].output_len, again.requests[i].turn)
            for i in again.judged
        ][: len(lengths)]
    )
    stream = flatten(
        build_conversations(wl, conversations, 0, stream_seed=probe_seed(wl.seed, STREAM), prefix_seed=0)
    )
    assert [(r.input_len, r.turn) for r in stream] == [(r.input_len, r.turn) for r in judged]


def test_the_saturation_probe_starts_as_many_conversations_as_it_has_requests() -> None:
    """At rate inf, `saturation_requests` conversations start at once (as many in flight as a single-turn
    saturation probe has requests) and all their turns are judged."""
    plan = ProbeSchedule(chat(), SLO, MEASUREMENT, Path(".")).plan(1, math.inf)
    assert sum(1 for r in plan.requests if r.turn == 1) == 20
    assert plan.judged == range(len(plan.requests)) and set(plan.arrivals) == {0.0}


def test_ttft_is_reported_by_turn() -> None:
    """TTFT by turn: count, mean, p50 and p95 per turn index; nothing for single-turn records."""
    requests = conversation()
    records = [RequestRecord(i, 0.0, (t,), 3, 3, 3, 3, True) for i, t in enumerate((0.5, 0.1, 0.2))]
    by = ttft_by_turn(records, requests)
    assert by is not None and list(by) == ["1", "2", "3"]
    assert by["1"]["p95_ms"] == 500.0 and by["2"]["n"] == 1
    assert ttft_by_turn(records[:1], requests) is None


def test_a_probe_of_conversations_on_the_sse_server_reports_turns(server: SseServer, tmp_path: Path) -> None:
    """A whole multi-turn probe: every judged turn finishes, the saved probe names each request's turn and
    the TTFT by turn, and the ideal prefix-cache hit rate of the plan."""
    import json

    wl = chat(think_time="20ms")
    meas = MeasurementSpec(
        min_requests=12, min_tail_samples=1, saturation_requests=10, probe_duration=0.5, invalid_retries=4
    )
    # 50-ms tokens: a read 1-2 ms late on a busy machine moves TPOT by a few percent, under the self-check's
    # 5 %; a probe voided all the same (a 4-ms stall moved ttft:p95 5.5 %, seen 1 in 8 beside a busy loop)
    # is repeated as a study repeats it: this test is about turns.
    probe = Prober(server.url, "pace-50", wl, SLO, meas, base_dir=tmp_path, metrics_url="", save_dir=tmp_path)
    out = valid_probe(probe, 20.0, meas, warmup_s=0.2, window_s=0.5, sleep=lambda _: None)
    assert out.metrics.completed == out.requests >= 12
    assert out.ttft_by_turn is not None and "2" in out.ttft_by_turn
    assert out.ideal_hit_rate is not None and 0.3 < out.ideal_hit_rate < 1
    saved = json.loads((tmp_path / "probe-1.json").read_text())
    assert saved["ttft_by_turn"] == out.ttft_by_turn
    assert len(saved["turns"]) == len(saved["ttfts"]) and saved["prefix_hit_rate_ideal"] == out.ideal_hit_rate
    assert {1, 2} <= set(saved["turns"])


def test_shapes_hold_at_least_one_turn() -> None:
    """Turns are clipped to at least one; messages and replies follow the dataset's lengths."""
    wl = chat()
    for turns in shapes(wl, 50, 3):
        assert 1 <= len(turns) <= 4 and turns[0].think == 0.0
        assert all(3 <= t.message_len <= 9 and 2 <= t.output_len <= 6 for t in turns)


def test_run_limit_counts_the_longest_conversation_and_the_concurrency_rounds() -> None:
    """A run's worst case: the last first turn's arrival, one request timeout per turn of the longest
    conversation plus its think times; with a concurrency limit, one timeout per round of slots."""
    two_turns = [
        RequestSpec("a", 4, 2),
        RequestSpec("b", 4, 2, follows=0, think=1.5, turn=2),
        RequestSpec("c", 4, 2, follows=1, think=2.0, turn=3),
        RequestSpec("d", 4, 2),
    ]
    job = Job("http://x", "m", "chat", two_turns, [0.0, 0.0, 0.0, 7.0], [0, 1, 2, 3], True, 0.0, 9.0, None,
              "raw", {}, "p", Preparation())  # fmt: skip
    assert run_limit(job) == pytest.approx(7.0 + 3 * 9.0 + 3.5)
    assert run_limit(replace(job, max_concurrency=1)) == pytest.approx(7.0 + 4 * 9.0 + 3.5)
    assert run_limit(replace(job, max_concurrency=3)) == pytest.approx(7.0 + 2 * 9.0 + 3.5)
    share = job.share(1, 2)  # the later turns go with their first turn: the share holds "d" alone
    assert [r.prompt for r in share.requests] == ["d"]
    assert run_limit(share) == pytest.approx(7.0 + 9.0)
    assert run_limit(replace(job, requests=[], arrivals=[], indices=[])) == 0.0
