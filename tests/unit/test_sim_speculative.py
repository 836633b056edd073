"""Speculative decoding in the simulator: vLLM's config validation, tokens per step, cost and metrics."""

from __future__ import annotations

import math
import random
from dataclasses import replace
from typing import Any

import pytest

from autotune.hardware.catalog import GPUS, MODELS
from autotune.sim.engine import CostModel, Engine, EngineConfig, Request
from autotune.sim.flags import ServeFlags, parse_flags
from autotune.sim.metrics import EngineStats, render
from autotune.sim.model import simulate, synthetic_workload
from autotune.sim.startup import StartFailure, plan_startup

HW, MODEL = "H100-80GB", "Llama-3.1-8B"
NGRAM = {"method": "ngram", "num_speculative_tokens": 4}


def _engine(k: int, p: float, *, seqs: int = 8) -> Engine:
    config = EngineConfig(seqs, 2048, 16, 10_000, num_speculative_tokens=k, acceptance_rate=p)
    return Engine(config, CostModel(MODELS[MODEL], GPUS[HW]), seed=1)


def _start(spec: dict[str, Any]) -> str:
    flags = replace(ServeFlags(model=MODEL, max_model_len=4096), speculative_config=spec)
    plan = plan_startup(flags, MODELS[MODEL], random.Random(0))
    assert plan.failure is StartFailure.INVALID_CONFIG and plan.exit_code == 1
    text = "\n".join(e.text for e in plan.events)
    assert "1 validation error for SpeculativeConfig" in text
    return text


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        ({"method": "ngram"}, "Value error, num_speculative_tokens must be provided with speculative model "
         "unless the draft model config contains an n_predict parameter."),
        ({"method": "ngram", "num_speculative_tokens": 0},
         "num_speculative_tokens\n  Input should be greater than 0 [type=greater_than, input_value=0"),
        ({**NGRAM, "prompt_lookup_min": 3, "prompt_lookup_max": 2},
         "Value error, prompt_lookup_min=3 must be <= prompt_lookup_max=2"),
        ({"method": "foo", "num_speculative_tokens": 3},
         "method\n  Value error, Unknown speculative method 'foo'. Built-in methods: ['bailing_hybrid_mtp'"),
        ({"num_speculative_tokens": 3},
         "Value error, num_speculative_tokens was provided but without speculative model."),
        ({"method": "eagle", "num_speculative_tokens": 3},
         "Value error, num_speculative_tokens was provided but without speculative model."),
        ({"model": "Llama-3.2-1B"},
         "Value error, A speculative model was provided, but `num_speculative_tokens` was not provided"),
        ({**NGRAM, "bogus": 1}, "bogus\n  Unexpected keyword argument [type=unexpected_keyword_argument"),
        ({"model": "/nonexistent/draft", "num_speculative_tokens": 3},
         "Value error, Invalid repository ID or local directory specified: '/nonexistent/draft'."),
    ],
)  # fmt: skip
def test_invalid_speculative_configs_fail_with_vllms_text(spec: dict[str, Any], fragment: str) -> None:
    """Each speculative config vLLM 0.34 rejects fails the start with its pydantic text."""
    assert fragment in _start(spec)


def test_speculative_config_parses_from_json_and_dotted_flags() -> None:
    """--speculative-config takes JSON, also built key by key (--speculative-config.method ngram);
    invalid JSON is the argparse error vLLM prints."""
    a = parse_flags(["m", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
    dotted = ["--speculative-config.method", "ngram", "--speculative_config.num_speculative_tokens", "3"]
    b = parse_flags(["m", *dotted])
    assert a.speculative_config == b.speculative_config == {"method": "ngram", "num_speculative_tokens": 3}
    with pytest.raises(Exception, match="argument --speculative-config/-sc: Value x cannot be converted"):
        parse_flags(["m", "--speculative-config", "x"])


def test_a_decode_step_emits_one_plus_the_accepted_drafts() -> None:
    """With k = 4 drafts accepted left to right with P = 0.7, a decode step emits 2.77 tokens on average
    ((1 - P^5) / (1 - P)); P = 1 always emits 1 + k, P = 0 one token; accepted + rejected = drafted."""
    for p, expected in ((0.7, (1 - 0.7**5) / 0.3), (1.0, 5.0), (0.0, 1.0)):
        engine = _engine(4, p)
        for i in range(8):
            engine.add(Request(i, 32, 2000))
        engine.step()  # prefill: one token each
        emitted = steps = 0
        for _ in range(40):
            result = engine.step()
            emitted += sum(r.step_tokens for r in result.emitted)
            steps += len(result.emitted)
        assert emitted / steps == pytest.approx(expected, rel=0.06)
        spec = engine.spec
        assert spec.num_draft_tokens == 4 * spec.num_drafts == 4 * steps
        assert spec.num_accepted_tokens == emitted - steps


def test_drafts_never_go_past_the_output_length() -> None:
    """A request with 3 output tokens has 2 left after its prefill, so its decode step verifies 1 draft
    (1 bonus token + 1 accepted draft), and it gets exactly 3 tokens although k = 4 and P = 1."""
    engine = _engine(4, 1.0)
    req = Request(0, 32, 3)
    engine.add(req)
    tokens = []
    while engine.has_work():
        tokens.append(engine.step().scheduled_tokens)
    assert tokens == [32, 2] and req.num_output == 3


def test_speculation_cuts_tpot_at_low_load_and_loses_throughput_at_saturation() -> None:
    """At low load verifying drafts is nearly free (decode is memory-bound), so TPOT falls ~2.5x with
    ngram k=4 at P=0.7; at saturation verification costs compute, the gain shrinks, and with a low
    acceptance rate (P=0.3) speculative decoding loses throughput."""
    light = synthetic_workload(60, input_len=(128, 256), output_len=(128, 256), seed=5, rate=0.5)
    base = simulate({"max_model_len": 4096}, HW, MODEL, light)
    spec = simulate({"max_model_len": 4096, "speculative_config": NGRAM}, HW, MODEL, light)
    assert base.stat("tpot", 50) / spec.stat("tpot", 50) > 2.3
    heavy = synthetic_workload(600, input_len=(128, 256), output_len=(128, 256), seed=5)
    sat = simulate({"max_model_len": 4096}, HW, MODEL, heavy, rate=math.inf)
    sat_spec = simulate({"max_model_len": 4096, "speculative_config": NGRAM}, HW, MODEL, heavy, rate=math.inf)
    low_p = {"max_model_len": 4096, "speculative_config": NGRAM, "acceptance_rate": 0.3}
    sat_low_p = simulate(low_p, HW, MODEL, heavy, rate=math.inf)
    assert sat_spec.output_throughput / sat.output_throughput < 1.5
    assert sat_low_p.output_throughput < 0.8 * sat.output_throughput
    assert spec.spec_num_accepted_tokens / spec.spec_num_drafts == pytest.approx(1.77, rel=0.05)


def test_a_draft_model_costs_memory_and_time_ngram_does_not() -> None:
    """A Llama-3.2-1B draft takes weights and KV from the cache budget and k forward passes per step, so
    its TPOT gain is smaller than ngram's at the same acceptance rate; ngram leaves the KV capacity alone."""
    light = synthetic_workload(40, input_len=(128, 256), output_len=(128, 256), seed=5, rate=0.5)
    base = simulate({"max_model_len": 4096}, HW, MODEL, light)
    ngram = simulate({"max_model_len": 4096, "speculative_config": NGRAM}, HW, MODEL, light)
    draft_spec = {"model": "Llama-3.2-1B", "num_speculative_tokens": 4}
    draft = simulate({"max_model_len": 4096, "speculative_config": draft_spec}, HW, MODEL, light)
    assert draft.startup.config is not None and draft.startup.config.speculative is not None
    assert draft.startup.config.speculative.method == "draft_model"
    assert ngram.kv_tokens == base.kv_tokens > draft.kv_tokens
    assert ngram.stat("tpot", 50) < draft.stat("tpot", 50) < base.stat("tpot", 50)


def test_spec_decode_metrics_use_vllms_names_and_appear_only_when_enabled() -> None:
    """/metrics carries vllm:spec_decode_num_drafts/draft_tokens/accepted_tokens(_per_pos) counters with
    the engine's numbers when speculative decoding is on, and none of them when it is off."""
    engine = _engine(2, 1.0)
    engine.add(Request(0, 16, 10))
    while engine.has_work():
        engine.step()
    text = render("m", [engine], [EngineStats()], ['engine="0"'], lag_s=0.0, merged_tokens=0)
    labels = 'engine="0",model_name="m"'
    drafts = engine.spec.num_drafts
    assert f"vllm:spec_decode_num_drafts_total{{{labels}}} {float(drafts)}" in text
    assert f"vllm:spec_decode_num_draft_tokens_total{{{labels}}} {float(2 * drafts)}" in text
    assert f"vllm:spec_decode_num_accepted_tokens_total{{{labels}}} {float(2 * drafts)}" in text
    assert (
        f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{labels},position="1"}} {float(drafts)}' in text
    )
    plain = render("m", [_engine(0, 0.0)], [EngineStats()], ['engine="0"'], lag_s=0.0, merged_tokens=0)
    assert "spec_decode" not in plain
