"""Crashes under load teach every proposer (autotune/hardware/headroom.py): the runtime headroom they show,
the crash chance it gives other configs, the screen that refuses a config beyond it (the sampler's side), and
the surrogate's proposals that steer clear of it."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import optuna
import pytest
from optuna.distributions import CategoricalDistribution
from optuna.trial import FrozenTrial, TrialState

from autotune.flags import FlagValue
from autotune.hardware.catalog import GPUS, MODELS
from autotune.hardware.headroom import LEARN_WIDTH, UNTRIED_PRIOR, Run, RuntimeEdge, headroom_ratio
from autotune.outcome import Cause
from autotune.predict.feasibility import MemoryModel, PreLaunchCheck
from autotune.predict.surrogate.model import Surrogate
from autotune.predict.surrogate.propose import Proposer, traffic_of
from autotune.store.record import TrialRecord

from .test_surrogate import measured_attrs, write_spec

UTIL = [0.86, 0.9, 0.94, 0.98]
SEQS = [64, 128, 256, 512]
BATCHED = [2048, 4096, 8192]
SPACE = {
    "params": {
        "gpu_memory_utilization": {"type": "categorical", "choices": UTIL, "default": 0.9},
        "max_num_seqs": {"type": "categorical", "choices": SEQS, "default": 256},
        "max_num_batched_tokens": {"type": "categorical", "choices": BATCHED, "default": 2048},
    }
}
DEFAULTS = {"gpu_memory_utilization": 0.9, "max_num_seqs": 256, "max_num_batched_tokens": 2048}
CRASHED = {"gpu_memory_utilization": 0.94, "max_num_seqs": 512, "max_num_batched_tokens": 8192}


def model() -> MemoryModel:
    return MemoryModel(MODELS["Llama-3.1-8B"], GPUS["L40S-48GB"], {"max_model_len": 4096})


def frozen(
    number: int, flags: Mapping[str, FlagValue], attrs: Mapping[str, Any], state: TrialState
) -> FrozenTrial:
    trial = optuna.trial.create_trial(
        state=state,
        params=dict(flags),
        distributions={k: CategoricalDistribution(SPACE["params"][k]["choices"]) for k in flags},  # type: ignore[index]
        values=[1.0] if state == TrialState.COMPLETE else None,
        user_attrs=dict(attrs),
    )
    trial.number = number
    return trial


def ran(number: int, flags: Mapping[str, FlagValue], cause: Cause | None = None) -> FrozenTrial:
    """A launched trial that started: measured (no cause), or pruned with ``cause`` after it started."""
    record = TrialRecord(launched=True, flags=dict(flags), cause=cause, start_s=30.0)
    state = TrialState.COMPLETE if cause is None else TrialState.PRUNED
    return frozen(number, flags, record.to_attrs(), state)


def plan(flags: Mapping[str, FlagValue]) -> Any:
    return model().plan(flags)


def test_before_a_crash_untried_headroom_is_a_risk_and_tried_headroom_none() -> None:
    """No crash yet: chance 0 with at least the headroom of a launch that ran through (and with no launch
    at all); below every launch that ran through, UNTRIED_PRIOR times how far below it goes, never enough
    to refuse a launch (the screen refuses under min_start_probability, 0.005)."""
    crashed, defaults = headroom_ratio(plan(CRASHED)), headroom_ratio(plan(DEFAULTS))
    assert RuntimeEdge().crash_probability(plan(CRASHED)) == 0.0
    through = RuntimeEdge.of([Run(0, plan(DEFAULTS), False)])
    assert through.crash_probability(plan(DEFAULTS)) == 0.0
    roomier = {**DEFAULTS, "gpu_memory_utilization": 0.86}
    assert through.crash_probability(plan(roomier)) == 0.0
    assert through.crash_probability(plan(CRASHED)) == pytest.approx(UNTRIED_PRIOR * (1 - crashed / defaults))
    assert 0.0 < through.crash_probability(plan(CRASHED)) < UNTRIED_PRIOR
    assert "below the least that ran through" in through.reason(plan(CRASHED))
    assert PreLaunchCheck(model(), lambda: [ran(0, DEFAULTS)])(CRASHED).outcome is None
    # However high the bar a launch must clear: the untried risk ranks, only a crash refuses.
    strict = MemoryModel(
        MODELS["Llama-3.1-8B"], GPUS["L40S-48GB"], {"max_model_len": 4096}, min_start_probability=0.9
    )
    assert PreLaunchCheck(strict, lambda: [ran(0, DEFAULTS)])(CRASHED).outcome is None


def test_the_edge_is_certain_at_or_past_a_crash() -> None:
    """A crash: 1 at its headroom and below (every flag at least as demanding), falling linearly to 0 at
    the least headroom that ran through, or LEARN_WIDTH above the crash when nothing with less headroom
    than the defaults ran."""
    crashed, defaults = headroom_ratio(plan(CRASHED)), headroom_ratio(plan(DEFAULTS))
    edge = RuntimeEdge.of([Run(0, plan(DEFAULTS), False), Run(1, plan(CRASHED), True)])
    assert (edge.crashed, edge.crashed_trial, edge.survived) == (crashed, 1, defaults)
    assert edge.crash_probability(plan(CRASHED)) == 1.0
    assert edge.crash_probability(plan({**CRASHED, "gpu_memory_utilization": 0.98})) == 1.0
    middle = {"gpu_memory_utilization": 0.9, "max_num_seqs": 512, "max_num_batched_tokens": 4096}
    q = headroom_ratio(plan(middle))
    assert crashed < q < defaults
    assert edge.crash_probability(plan(middle)) == pytest.approx((defaults - q) / (defaults - crashed))
    assert edge.crash_probability(plan(DEFAULTS)) == 0.0
    alone = RuntimeEdge.of([Run(1, plan(CRASHED), True)])
    assert alone.crash_probability(plan(middle)) == pytest.approx(
        max(0.0, (crashed * (1 + LEARN_WIDTH) - q) / (crashed * LEARN_WIDTH))
    )


def test_a_crash_with_more_headroom_than_a_run_through_is_not_memorys() -> None:
    """A crash at the defaults' headroom while a hungrier config ran through is left out (and counted):
    it says nothing about memory."""
    hungry = {"gpu_memory_utilization": 0.94, "max_num_seqs": 512, "max_num_batched_tokens": 4096}
    edge = RuntimeEdge.of([Run(0, plan(hungry), False), Run(1, plan(DEFAULTS), True)])
    assert edge.crashed is None and edge.unexplained == 1
    without = RuntimeEdge.of([Run(0, plan(hungry), False)])
    assert edge.crash_probability(plan(CRASHED)) == without.crash_probability(plan(CRASHED)) < UNTRIED_PRIOR
    assert "1 crash(es) with more headroom left out" in edge.reason(plan(CRASHED))


def test_the_screen_refuses_a_config_beyond_a_crash_under_load_and_records_why() -> None:
    """The sampler's side: after a crash under load, a config with less headroom is predicted to crash
    and not launched; one between the crash and what ran through is launched with its crash chance in
    memory_prediction; the defaults' neighbours are untouched."""
    history = [ran(0, DEFAULTS), ran(1, CRASHED, Cause.CRASHED_UNDER_LOAD)]
    check = PreLaunchCheck(model(), lambda: history)
    twin = {**CRASHED, "gpu_memory_utilization": 0.98}
    refused = check(twin)
    assert refused.outcome is not None and refused.outcome.cause is Cause.PREDICTED_INFEASIBLE
    assert "predicted crashed_under_load" in refused.outcome.summary
    assert "trial 1 crashed under load" in refused.outcome.summary
    numbers = TrialRecord.from_attrs(refused.outcome.attrs).memory_prediction
    assert numbers is not None and numbers["crash_probability"] == 1.0
    assert numbers["runtime_headroom_ratio"] < numbers["runtime_crashed_ratio"]
    middle = check({"gpu_memory_utilization": 0.9, "max_num_seqs": 512, "max_num_batched_tokens": 4096})
    assert middle.outcome is None and middle.prediction is not None
    assert 0.0 < middle.prediction["crash_probability"] < 1.0
    assert "crash chance under load" in middle.prediction["reason"]
    # Without the crash nothing is refused for headroom.
    assert PreLaunchCheck(model(), lambda: history[:1])(twin).outcome is None


def _surrogate(tmp_path: Path) -> Surrogate:
    """The calibrated surrogate of a study over :data:`SPACE` on an L40S (where KV memory limits the rate)."""
    loaded = write_spec(tmp_path, SPACE, "L40S-48GB", ("ttft:p95<=1s", "tpot:p95<=60ms"))
    memory = model()
    return Surrogate(
        memory.arch, memory.gpu, loaded.search_space, traffic_of(loaded), loaded.spec.slo.terms, memory
    )


def test_a_proposal_steers_clear_of_a_config_that_crashed_under_load(tmp_path: Path) -> None:
    """The surrogate's side: with the defaults measured, its ranking holds configs with as little headroom
    as the one that then crashes under load, at the untried headroom's risk only; after the crash none
    of them, the crashed config's own signature is free again (a variant with more headroom may run),
    and the proposal carries its crash chance."""
    surrogate = _surrogate(tmp_path)
    measured = frozen(0, DEFAULTS, measured_attrs(surrogate, DEFAULTS), TrialState.COMPLETE)
    limit = headroom_ratio(plan(CRASHED))

    before = Proposer(surrogate, seed=1).ranked([measured])
    tight = [p for p in before if headroom_ratio(plan(p.flags)) <= limit]
    assert tight and all(0.0 < p.crash_probability < UNTRIED_PRIOR for p in tight)

    crash = TrialRecord(
        launched=True,
        flags=CRASHED,
        cause=Cause.CRASHED_UNDER_LOAD,
        start_s=30.0,
        capacity={"kv_tokens": surrogate.kv_tokens(CRASHED, None)},
        curve={"terms": [], "points": []},
    )
    history = [measured, frozen(1, CRASHED, crash.to_attrs(), TrialState.PRUNED)]
    proposer = Proposer(surrogate, seed=1)
    after = proposer.ranked(history)
    assert after and all(headroom_ratio(plan(p.flags)) > limit for p in after)
    assert proposer.memory_calibration is not None and proposer.memory_calibration.runtime.crashed_trial == 1
    signature = surrogate.signature(CRASHED, surrogate.kv_tokens(CRASHED, None))
    assert signature is not None
    assert signature not in proposer._measured_signatures(history, proposer.memory_calibration)
    risky = [p for p in after if p.crash_probability > 0]
    assert risky and all(0 < p.run_probability < 1 for p in risky)
    proposal = proposer.propose(history)
    assert proposal is not None and headroom_ratio(plan(proposal.flags)) > limit
    assert proposal.attrs()["crash_probability"] == round(proposal.crash_probability, 4) < 1.0
