"""The calibrated surrogate (autotune/predict/surrogate): calibration to measured probes, proposals,
hand-over, and the study loop that launches what it proposes."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import optuna
import pytest
import yaml
from optuna.distributions import CategoricalDistribution
from optuna.trial import FrozenTrial, TrialState

from autotune.events import Event, Kind
from autotune.flags import FlagValue
from autotune.inputs.loader import LoadedStudy, load_study
from autotune.outcome import Cause, TrialOutcome
from autotune.predict.feasibility import MemoryModel
from autotune.predict.surrogate.model import Params, Surrogate, calibrate, observations, prior
from autotune.predict.surrogate.propose import Proposer, proposer_for, track_record, traffic_of
from autotune.sim.cost import Scales
from autotune.store.record import TrialRecord
from autotune.study.loop import StudyRunner, open_study

from .fake_trials import FakeTrials

SEQS = [16, 32, 64, 128, 256, 512]
BATCHED = [1024, 2048, 4096, 8192]
SPACE = {
    "params": {
        "max_num_seqs": {"type": "categorical", "choices": SEQS, "default": 256},
        "max_num_batched_tokens": {"type": "categorical", "choices": BATCHED, "default": 2048},
        "kv_cache_dtype": {"type": "categorical", "choices": ["auto", "fp8"], "default": "auto"},
    },
    "constraints": [{"expr": "max_num_batched_tokens >= max_num_seqs"}],
}
TRUTH = Params(Scales(weights=0.8, attention=0.7, step_overhead=1.6), {"ttft:p95": 1.4, "tpot:p95": 1.1})
"""What the 'GPU' really does: the fluid model with other constants than the simulator's."""


def write_spec(
    tmp_path: Path,
    space: Mapping[str, Any] = SPACE,
    gpu: str = "H100-80GB",
    slo: tuple[str, ...] = ("ttft:p95<=300ms", "tpot:p95<=20ms"),
    **sampler: object,
) -> LoadedStudy:
    (tmp_path / "space.yaml").write_text(yaml.safe_dump(dict(space)))
    spec = {
        "study": {"name": "surrogate", "workdir": str(tmp_path / "work")},
        "server": {"command": ["true"], "model": "m", "args": {"max-model-len": 8192}},
        "search_space": "space.yaml",
        "workload": {
            "dataset": {
                "kind": "synthetic",
                "input_len": {"dist": "uniform", "low": 384, "high": 640},
                "output_len": {"dist": "uniform", "low": 96, "high": 160},
            }
        },
        "slo": {"terms": list(slo)},
        "memory_model": {"model": "Llama-3.1-8B", "gpu": gpu},
        "objectives": [{"metric": "slo_throughput", "direction": "maximize"}],
        "budget": {"launches": 6},
        "finalists": {"count": 0},
        "sampler": {"name": "random", "seed": 3, **sampler},
    }
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    return load_study(tmp_path / "spec.yaml")


def surrogate_of(loaded: LoadedStudy) -> Surrogate:
    memory = MemoryModel(
        *_arch_gpu(),
        loaded.spec.server.args,  # the study's fixed flags
    )
    return Surrogate(
        memory.arch, memory.gpu, loaded.search_space, traffic_of(loaded), loaded.spec.slo.terms, memory
    )


def _arch_gpu() -> tuple[Any, Any]:
    from autotune.hardware.catalog import GPUS, MODELS

    return MODELS["Llama-3.1-8B"], GPUS["H100-80GB"]


def true_rate(s: Surrogate, flags: Mapping[str, FlagValue]) -> float:
    engine = s.engine(flags, TRUTH.scales, s.kv_tokens(flags, None))
    assert engine is not None
    return s.slo_rate(engine, TRUTH)


def measured_attrs(s: Surrogate, flags: Mapping[str, FlagValue]) -> dict[str, Any]:
    """What a trial of ``flags`` records on the 'GPU' of :data:`TRUTH`: probes at 50-100 % of its SLO
    rate (the values the truth gives), its SLO rate, its KV capacity."""
    kv = s.kv_tokens(flags, None)
    engine = s.engine(flags, TRUTH.scales, kv)
    assert engine is not None
    rate = s.slo_rate(engine, TRUTH)
    points = []
    for frac in (0.5, 0.8, 0.95, 1.05):
        from autotune.predict.surrogate.model import Point

        values = s.predicted(engine, TRUTH, Point(rate * frac, dict.fromkeys(s.keys, 1.0)))
        points.append([rate * frac, *(values[k] for k in s.keys)])
    return TrialRecord(
        launched=True,
        flags=dict(flags),
        capacity={"kv_tokens": kv},
        curve={"terms": list(s.keys), "points": points},
        estimate={"rate": rate, "slo_throughput": rate * s.traffic.output},
    ).to_attrs()


def frozen(number: int, flags: Mapping[str, FlagValue], attrs: Mapping[str, Any]) -> FrozenTrial:
    trial = optuna.trial.create_trial(
        params=dict(flags),
        distributions={n: CategoricalDistribution(SPACE["params"][n]["choices"]) for n in flags},  # type: ignore[index]
        values=[1.0],
        user_attrs=dict(attrs),
    )
    trial.number = number
    return trial


CONFIGS = [
    {"max_num_seqs": 256, "max_num_batched_tokens": 2048, "kv_cache_dtype": "auto"},
    {"max_num_seqs": 64, "max_num_batched_tokens": 8192, "kv_cache_dtype": "fp8"},
    {"max_num_seqs": 512, "max_num_batched_tokens": 4096, "kv_cache_dtype": "auto"},
]
HELD_OUT = [
    {"max_num_seqs": 128, "max_num_batched_tokens": 1024, "kv_cache_dtype": "fp8"},
    {"max_num_seqs": 32, "max_num_batched_tokens": 2048, "kv_cache_dtype": "auto"},
    {"max_num_seqs": 512, "max_num_batched_tokens": 8192, "kv_cache_dtype": "fp8"},
]


def test_calibration_learns_the_gpus_constants_from_three_trials(tmp_path: Path) -> None:
    """Three trials measured on a 'GPU' whose constants differ from the simulator's: calibrated, the
    surrogate predicts the SLO rate of three configs it never saw within 5 %; uncalibrated it was off by
    more than 15 % on at least one. The fit is reported with the trials and points it used."""
    s = surrogate_of(write_spec(tmp_path))
    trials = [frozen(i, c, measured_attrs(s, c)) for i, c in enumerate(CONFIGS)]
    found = observations(trials)
    assert [o.trial for o in found] == [0, 1, 2] and all(o.slo_rate for o in found)
    cal = calibrate(s, found)
    assert cal.observations == 3 and 3 * 3 * 2 <= cal.points <= 3 * 4 * 2  # an overloaded probe is left out
    base = prior(s)
    errors, prior_errors = [], []
    for flags in HELD_OUT:
        truth = true_rate(s, flags)
        kv = s.kv_tokens(flags, None)
        for params, out in ((cal.params, errors), (base.params, prior_errors)):
            engine = s.engine(flags, params.scales, kv)
            assert engine is not None
            out.append(abs(s.slo_rate(engine, params) / truth - 1.0))
    assert max(errors) <= 0.05, errors
    assert max(prior_errors) > 0.15, prior_errors
    assert cal.error < 0.05


def test_calibration_keeps_the_prior_without_measurements(tmp_path: Path) -> None:
    s = surrogate_of(write_spec(tmp_path))
    cal = calibrate(s, [])
    assert cal.observations == 0 and cal.params == prior(s).params


def _proposed(
    number: int, flags: Mapping[str, FlagValue], predicted: float, measured: float | None, **said: object
) -> FrozenTrial:
    record = TrialRecord(
        launched=True,
        flags=dict(flags),
        surrogate={"slo_rate": predicted, **said},
        curve={"terms": ["tpot:p95"], "points": [[1.0, 0.01]]},
        estimate=None if measured is None else {"rate": measured},
        cause=None if measured is not None else Cause.SLO_UNREACHABLE,
    )
    trial = frozen(number, flags, record.to_attrs())
    if measured is None:
        trial = optuna.trial.create_trial(
            state=TrialState.PRUNED,
            params=trial.params,
            distributions=trial.distributions,
            user_attrs=trial.user_attrs,
        )
        trial.number = number
    return trial


def test_the_surrogate_hands_over_once_three_proposals_in_a_row_are_off() -> None:
    """Errors within 30 % keep it proposing; three proposals off by a median beyond 30 % hand over, naming
    them; a proposal that met the SLO at no rate counts as far off."""
    good = [_proposed(i, CONFIGS[i % 3], 10.0, 10.0 * (1.1 if i % 2 else 0.9)) for i in range(1, 6)]
    assert track_record(good).handed_over is None
    assert [p.trial for p in track_record(good).predictions] == [1, 2, 3, 4, 5]
    bad = [
        *good,
        _proposed(6, CONFIGS[0], 10.0, 5.0),
        _proposed(7, CONFIGS[1], 10.0, None),
        _proposed(8, CONFIGS[2], 10.0, 9.5),
    ]
    why = track_record(bad).handed_over
    assert why is not None and "trial 6" in why and "trial 7" in why and "sampler" in why
    # Once handed over, later good predictions do not bring it back.
    assert track_record([*bad, *[_proposed(9 + i, CONFIGS[i], 10.0, 10.0) for i in range(3)]]).handed_over


def test_a_proposal_is_a_config_no_trial_holds_with_its_interval(tmp_path: Path) -> None:
    loaded = write_spec(tmp_path)
    s = surrogate_of(loaded)
    proposer = Proposer(s, candidates=60, seed=1)
    trials = [frozen(i, c, measured_attrs(s, c)) for i, c in enumerate(CONFIGS)]
    proposal = proposer.propose(trials)
    assert proposal is not None
    held = {loaded.search_space.launch_key(c) for c in CONFIGS}
    assert loaded.search_space.launch_key(proposal.flags) not in held
    assert not loaded.search_space.violations(proposal.flags)
    assert proposal.lo <= proposal.rate <= proposal.hi and proposal.calibrated_on == 3
    assert math.isclose(proposal.throughput, proposal.rate * s.traffic.output)
    # Ranked by the truth, the proposal is among the best few of what is left.
    ranked = sorted(
        (c for c in proposer._candidates if loaded.search_space.launch_key(c) not in held),
        key=lambda c: -true_rate(s, c),
    )
    best = true_rate(s, ranked[0])
    assert true_rate(s, proposal.flags) >= 0.95 * best


def _study(root: Path, honest: bool) -> tuple[LoadedStudy, list[TrialRecord], list[Event]]:
    """A 6-launch study with the surrogate on, on a 'GPU' of :data:`TRUTH` (``honest``) or one that serves
    a quarter of what anything predicts; its trials' records in order and its events."""
    root.mkdir()
    loaded = write_spec(root)
    s = surrogate_of(loaded)
    events: list[Event] = []

    def run(number: int, flags: Mapping[str, FlagValue], phase: Callable[[str], None]) -> TrialOutcome:
        attrs = measured_attrs(s, flags)
        if not honest:
            attrs["estimate"] = {"rate": attrs["estimate"]["rate"] / 4}
        rate = attrs["estimate"]["rate"]
        return TrialOutcome(None, "ok", values=(rate * s.traffic.output,), attrs=attrs)

    study = open_study(loaded, create=True, heartbeat=False)
    proposer = proposer_for(loaded, s.memory)
    assert proposer is not None
    StudyRunner(
        loaded, study, FakeTrials(run), on_event=events.append, on_stale=lambda _: None, proposer=proposer
    ).run()
    trials = sorted(study.get_trials(deepcopy=False), key=lambda t: t.number)
    return loaded, [TrialRecord.from_trial(t) for t in trials], events


def test_the_study_launches_the_proposals_and_records_them(tmp_path: Path) -> None:
    """With the surrogate on, every launch after vLLM's defaults is a proposal (its prediction stored on the
    trial) and each launched config is new; a 'GPU' the surrogate mispredicts makes it hand over, said
    once, and the sampler draws the rest."""
    for honest in (True, False):
        loaded, records, events = _study(tmp_path / ("honest" if honest else "odd"), honest)
        assert records[0].baseline and records[0].surrogate is None
        keys = [loaded.search_space.launch_key(r.flags) for r in records]
        for i, r in enumerate(records):  # a proposal is never a config an earlier trial holds
            assert r.surrogate is None or keys[i] not in keys[:i], (i, keys)
        said = [e for e in events if e.data.get("surrogate") == "handed over"]
        if honest:
            assert all(r.surrogate is not None for r in records[1:]), [r.surrogate for r in records]
            assert not said
        else:
            # Its fit cannot reproduce what was measured (the rates a quarter of what the probes' latencies
            # say): once three trials are measured it hands over, before its third proposal is measured,
            # and stores why on the trial the sampler draws next.
            proposed = [r.surrogate is not None and "slo_rate" in r.surrogate for r in records]
            assert proposed[1:3] == [True, True] and not any(proposed[3:]) and len(records) > 4
            assert len(said) == 1 and said[0].kind == Kind.PHASE and "fit was off" in said[0].text
            assert records[3].surrogate == {
                "handed_over": said[0].text,
                "fit_error": pytest.approx(3.0, abs=0.3),
            }
            assert track_record(study_trials(loaded)).handed_over == said[0].text


def study_trials(loaded: LoadedStudy) -> list[FrozenTrial]:
    return open_study(loaded, create=False, heartbeat=False).get_trials(deepcopy=False)


def test_the_surrogate_is_off_when_asked_or_without_a_memory_model(tmp_path: Path) -> None:
    loaded = write_spec(tmp_path, surrogate=False)
    assert proposer_for(loaded, surrogate_of(loaded).memory) is None
    assert proposer_for(write_spec(tmp_path), None) is None


@pytest.mark.parametrize("value", ["yes please", 3])
def test_a_bad_surrogate_setting_is_refused(tmp_path: Path, value: object) -> None:
    from autotune.errors import SpecError

    with pytest.raises(SpecError) as caught:
        write_spec(tmp_path, surrogate=value)
    assert "sampler.surrogate" in str(caught.value)


def test_best_states_how_the_surrogates_proposals_fared(tmp_path: Path) -> None:
    """`autotune best` (table and JSON) and the HTML report carry each measured proposal's predicted and
    measured SLO rate and, once it handed over, why."""
    from autotune.results.best import best_record, best_table
    from autotune.results.htmlreport.page import build_report

    for honest in (True, False):
        loaded, records, _ = _study(tmp_path / str(honest), honest)
        study = open_study(loaded, create=False, heartbeat=False)
        table = best_table(study, loaded, width=400)
        record = best_record(study, loaded)["surrogate"]
        proposals = [
            i for i, r in enumerate(records) if r.surrogate is not None and "slo_rate" in r.surrogate
        ]
        assert [p["trial"] for p in record["predictions"]] == proposals
        for p in record["predictions"]:
            assert p["predicted_rate"] == records[p["trial"]].surrogate["slo_rate"]  # type: ignore[index]
            assert p["measured_rate"] == records[p["trial"]].estimate["rate"]  # type: ignore[index]
        assert f"The surrogate proposed {len(proposals)} measured launches: median error" in table
        assert ("handed over" in table) is (not honest) and (record["handed_over"] is None) is honest
        page = build_report(study, loaded)
        assert f"The surrogate proposed {len(proposals)} measured launches" in page


def test_a_surrogate_that_fails_leaves_the_config_to_the_sampler(tmp_path: Path) -> None:
    """A model that cannot rank (a numerical failure) costs no launch: each time the run says so and the
    sampler draws the config; the study still spends its budget."""
    loaded = write_spec(tmp_path)
    s = surrogate_of(loaded)

    class Broken(Proposer):
        def propose(self, trials: Any) -> None:
            raise ValueError("matrix is singular")

    def run(number: int, flags: Mapping[str, FlagValue], phase: Callable[[str], None]) -> TrialOutcome:
        attrs = measured_attrs(s, flags)
        return TrialOutcome(None, "ok", values=(attrs["estimate"]["rate"],), attrs=attrs)

    events: list[Event] = []
    study = open_study(loaded, create=True, heartbeat=False)
    StudyRunner(
        loaded, study, FakeTrials(run), on_event=events.append, on_stale=lambda _: None, proposer=Broken(s)
    ).run()
    records = [TrialRecord.from_trial(t) for t in study.get_trials(deepcopy=False)]
    assert sum(1 for r in records if r.launched) == 6 and not any(r.surrogate for r in records)
    failed = [e for e in events if e.data.get("surrogate") == "failed"]
    assert len(failed) == 5 and "matrix is singular" in failed[0].text


def test_a_fit_that_wandered_off_is_made_again_from_the_prior_and_says_so(tmp_path: Path) -> None:
    """A warm start far from the truth (the last fit, as if the study's earlier trials had led it astray)
    leaves the fit off on the measured trials; fitted again from the prior it reproduces them, ranks the
    proposal, and the proposal records it; `best`'s sentence names the trial it was made for."""
    from dataclasses import replace

    from autotune.predict.surrogate.model import prior
    from autotune.predict.surrogate.propose import describe

    s = surrogate_of(write_spec(tmp_path))
    trials = [frozen(i, c, measured_attrs(s, c)) for i, c in enumerate(CONFIGS)]
    fresh = Proposer(s, candidates=60, seed=1)
    assert fresh.propose(trials) is not None and fresh.fit is not None and not fresh.fit.refit
    astray = Proposer(s, candidates=60, seed=1)
    base = prior(s)
    astray._last = replace(base, mean=base.mean + 4.0)  # every constant e^4 = 55 times the simulator's
    proposal = astray.propose(trials)
    assert proposal is not None and astray.fit is not None
    assert astray.fit.refit and not astray.fit.over and astray.fit.trials == 3
    assert astray.fit.error == pytest.approx(fresh.fit.error, abs=1e-3)
    assert proposal.attrs()["refit"] == "prior" and "refit" not in fresh.propose(trials).attrs()  # type: ignore[union-attr]
    record = track_record([*trials, _proposed(3, HELD_OUT[0], 1.0, 1.0, refit="prior")])
    assert record.refits == (3,) and "made again from the prior for trial 3" in (describe(record) or "")
