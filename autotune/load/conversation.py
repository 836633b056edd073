"""Multi-turn conversations: the turns of each conversation of a stream, as requests that follow each other.

A conversation of ``workload.conversation`` has ``turns`` requests. Turn 1 is a synthetic request (its
group's system prompt, if any, then a message of ``dataset.input_len`` tokens); turn ``k > 1`` sends the
conversation so far (every earlier message and the reply received to it) and a new message of
``dataset.input_len`` tokens, ``think_time`` after the reply to turn ``k - 1`` ended
(:attr:`~autotune.load.workload.RequestSpec.follows`). Its intended ``input_len`` counts that history: the
previous turn's prompt and reply (``ignore_eos`` makes the reply exactly ``output_len`` tokens).

Common random numbers: the shape of every conversation (its group, turn count, message and reply
lengths, think times) is drawn from the stream's seed, so every trial sees the same conversations in the
same order; only the messages' tokens come from the probe's own seed. The client
(:func:`autotune.load.client.run_requests`) and the dry run (:func:`autotune.sim.simulate`) both send a
later turn only after the previous one ended, so the load is a closed loop within each conversation and
an open one across conversations (they start at the probe's rate).
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from autotune.inputs.spec import ThinkTime, WorkloadSpec
from autotune.load.lengths import expected_length, sample_length
from autotune.load.metrics import percentile
from autotune.load.records import RequestRecord
from autotune.load.request import RequestSpec
from autotune.load.workload import PromptFormat, prompt_maker

if TYPE_CHECKING:
    from autotune.load.calibrate import PromptCalibration

#: Turns from this one on are reported together (``"8+"``) in :func:`ttft_by_turn`.
TURNS_SHOWN = 8


@dataclass(frozen=True)
class Turn:
    """One turn's shape: its new message's tokens, its reply's, and the pause before it (0 for turn 1)."""

    message_len: int
    output_len: int
    think: float


def draw_think(spec: ThinkTime, rng: random.Random) -> float:
    """One think time in seconds."""
    if spec.dist == "fixed":
        assert spec.value is not None
        return spec.value
    if spec.dist == "uniform":
        assert spec.low is not None and spec.high is not None
        return rng.uniform(spec.low, spec.high)
    assert spec.mean is not None
    value = rng.expovariate(1.0 / spec.mean)
    return min(value, spec.high) if spec.high is not None else value


def mean_think(spec: ThinkTime) -> float:
    """The mean think time in seconds (an exponential's clip at ``high`` ignored)."""
    if spec.dist == "fixed":
        assert spec.value is not None
        return spec.value
    if spec.dist == "uniform":
        assert spec.low is not None and spec.high is not None
        return (spec.low + spec.high) / 2
    assert spec.mean is not None
    return spec.mean


def mean_turns(workload: WorkloadSpec) -> float:
    """Mean turns per conversation (1 without ``workload.conversation``)."""
    spec = workload.conversation
    return expected_length(spec.turns) if spec is not None else 1.0


def shapes(workload: WorkloadSpec, n: int, stream_seed: int) -> list[tuple[Turn, ...]]:
    """The turns of the first ``n`` conversations of stream ``stream_seed``."""
    spec = workload.conversation
    assert spec is not None
    ds = workload.dataset
    rng = random.Random(f"{workload.seed}:{stream_seed}:conversations")
    out: list[tuple[Turn, ...]] = []
    for _ in range(n):
        count = sample_length(spec.turns, rng)
        turns = []
        for k in range(count):
            message, reply = sample_length(ds.input_len, rng), sample_length(ds.output_len, rng)
            turns.append(Turn(message, reply, draw_think(spec.think_time, rng) if k else 0.0))
        out.append(tuple(turns))
    return out


def build_conversations(
    workload: WorkloadSpec,
    n: int,
    seed: int,
    *,
    stream_seed: int,
    prefix_seed: int,
    prompt_format: PromptFormat = "text",
    calibration: PromptCalibration | None = None,
    prompts: bool = True,
) -> list[list[RequestSpec]]:
    """The first ``n`` conversations of stream ``stream_seed`` (shapes and groups), their messages' tokens
    drawn from ``seed`` and their system prompts' from ``prefix_seed``. A later turn's ``follows`` is the
    index of the turn before it within its conversation (:func:`flatten` makes it the run's index)."""
    make = prompt_maker(workload, prompt_format, calibration, prefix_seed)
    rng = random.Random(f"{workload.seed}:{seed}:requests")
    groups = make.groups.draw(n, workload.seed, stream_seed) if make.groups is not None else None
    legacy = workload.dataset.prefix_len
    out: list[list[RequestSpec]] = []
    for c, turns in enumerate(shapes(workload, n, stream_seed)):
        first = turns[0]
        if groups is not None:
            head = make.grouped(groups[c], first.message_len, first.output_len, rng, prompts)
        elif prompts:
            head = make.synthetic(first.message_len, first.output_len, rng)
        else:
            head = RequestSpec("", legacy + first.message_len, first.output_len)
        conversation = [head]
        for k, turn in enumerate(turns[1:], 1):
            before = conversation[-1]
            body = make.body(rng, turn.message_len) if prompts else ""
            conversation.append(
                dataclasses.replace(
                    head,
                    prompt=body,
                    input_len=before.input_len + before.output_len + turn.message_len,
                    output_len=turn.output_len,
                    follows=k - 1,
                    think=turn.think,
                    turn=k + 1,
                )
            )
        out.append(conversation)
    return out


def flatten(conversations: Sequence[Sequence[RequestSpec]], start: int = 0) -> list[RequestSpec]:
    """The conversations' turns one after another, numbered from ``start``: each later turn ``follows``
    the run's index of the turn before it."""
    out: list[RequestSpec] = []
    for conversation in conversations:
        base = start + len(out)
        for turn in conversation:
            follows = None if turn.follows is None else base + turn.follows
            out.append(dataclasses.replace(turn, follows=follows))
    return out


def ttft_by_turn(
    records: Sequence[RequestRecord], requests: Sequence[RequestSpec]
) -> dict[str, dict[str, float]] | None:
    """TTFT by turn of the successful ``records`` (``requests`` indexed as the records are): per turn
    (``"1"``, ``"2"``, ..., ``"8+"``) the count and the mean, p50 and p95 in ms. ``None`` when every
    record is a first turn (nothing to compare)."""
    by: dict[int, list[float]] = {}
    for record in records:
        if not record.success or record.ttft is None or not 0 <= record.index < len(requests):
            continue
        turn = min(requests[record.index].turn, TURNS_SHOWN)
        by.setdefault(turn, []).append(record.ttft)
    if not by or max(by) == 1:
        return None
    out: dict[str, dict[str, float]] = {}
    for turn in sorted(by):
        values = by[turn]
        key = f"{turn}+" if turn == TURNS_SHOWN else str(turn)
        out[key] = {
            "n": len(values),
            "mean_ms": round(math.fsum(values) / len(values) * 1e3, 3),
            "p50_ms": round(percentile(values, 50) * 1e3, 3),
            "p95_ms": round(percentile(values, 95) * 1e3, 3),
        }
    return out


def turn_summary(by_turn: Mapping[str, Mapping[str, float]] | None) -> str:
    """One line: p95 TTFT of the first turns against the later ones (empty without later turns)."""
    if not by_turn:
        return ""
    first = by_turn.get("1")
    later = [v for k, v in by_turn.items() if k != "1"]
    if first is None or not later:
        return ""
    n = sum(v["n"] for v in later)
    p95 = max(v["p95_ms"] for v in later)
    return f"p95 TTFT turn 1 {first['p95_ms']:.0f} ms, later turns up to {p95:.0f} ms ({n:.0f} requests)"
