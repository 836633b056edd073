"""Finalists: the best configs and the defaults measured again before a study ends, and an export that
ranks by every measurement and calls a gain within the noise what it is."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

from autotune.events import Kind
from autotune.export import Format, choose, headline, render
from autotune.finalists import confirmations, confirmed, throughput_gain
from autotune.outcome import TrialOutcome
from autotune.report import best_table
from autotune.spec import FlagValue
from autotune.study import StudyRunner, default_trial, is_launch, open_study

from .fake_trials import FakeTrials
from .test_study import run, write_spec


def _outcome(tput: float) -> TrialOutcome:
    return TrialOutcome(
        cause=None,
        summary=f"{tput:.0f} tok/s",
        values=(tput, 100.0),
        constraints=(-0.1, 0.0),
        attrs={"operating_point": {"output_throughput": tput}},
    )


def surface(flags: Mapping[str, FlagValue]) -> float:
    return 1000.0 * float(flags["gpu_memory_utilization"]) * min(int(flags["max_num_seqs"]), 64) / 64


def steady() -> FakeTrials:
    def measure(number: int, flags: Mapping[str, FlagValue], phase: Callable[[str], None]) -> TrialOutcome:
        return _outcome(surface(flags))

    return FakeTrials(measure)


def test_after_the_budget_the_finalists_and_the_defaults_are_measured_again(tmp_path: Path) -> None:
    loaded = write_spec(tmp_path, trials=8, finalists={"count": 3})
    trials = steady()
    study, events = run(loaded, trials)
    launched = [t for t in study.get_trials(deepcopy=False) if is_launch(t)]
    assert len(launched) == 8  # confirmations spend no launch and are not trials
    baseline = default_trial(study)
    assert baseline is not None
    assert baseline.number in trials.confirmed and len(set(trials.confirmed)) == len(trials.confirmed)
    assert 3 <= len(trials.confirmed) <= 4  # three best, plus the defaults unless among them
    best = sorted(launched, key=lambda t: -t.values[0])[0]
    assert trials.confirmed[0] == best.number  # best first
    assert set(confirmations(study)) == set(trials.confirmed)
    assert [e.kind for e in events].count(Kind.CONFIRMED) == len(trials.confirmed)
    # A rerun of the finished study measures nothing again.
    again = steady()
    run(loaded, again)
    assert again.confirmed == []


def test_the_export_ranks_by_every_measurement_not_the_luckiest(tmp_path: Path) -> None:
    """The best first measurement, measured at half of it again, loses to a config measured alike twice."""
    lucky: list[int] = []

    def again(number: int, flags: Mapping[str, FlagValue], phase: Callable[[str], None]) -> TrialOutcome:
        if not lucky:  # the first finalist measured again is the best first measurement
            lucky.append(number)
            return _outcome(surface(flags) * 0.5)
        return _outcome(surface(flags))

    loaded = write_spec(tmp_path, trials=8, finalists={"count": 3})
    trials = FakeTrials(steady().run, again)
    study, _ = run(loaded, trials)
    table = confirmed(study)
    runner_up = max((c for n, c in table.items() if n != lucky[0]), key=lambda c: c.mean(0))
    assert runner_up.mean(0) > table[lucky[0]].mean(0)  # the surface's best values are close
    choice = choose(study, loaded, trial=None, policy=None)
    assert choice.trial.number == runner_up.trial
    assert choice.confirmed is not None and len(choice.confirmed.throughputs) == 2
    text = render(choice, loaded, Format.VLLM_YAML)
    assert "mean of 2 runs, spread 0.0%" in text.splitlines()[1]


def test_a_gain_within_the_noise_is_called_so(tmp_path: Path) -> None:
    """Every config measures +-10 % around one value: the best's gain over the defaults is noise."""
    calls: dict[int, int] = {}

    def noisy(number: int, flags: Mapping[str, FlagValue], phase: Callable[[str], None]) -> TrialOutcome:
        calls[number] = calls.get(number, 0) + 1
        wobble = 1.1 if (number + calls[number]) % 2 else 0.9
        return _outcome(500.0 * wobble)

    loaded = write_spec(tmp_path, trials=6, finalists={"count": 2})
    study, _ = run(loaded, FakeTrials(noisy))
    choice = choose(study, loaded, trial=None, policy=None)
    gain = throughput_gain(confirmed(study), choice.trial, choice.baseline)
    assert gain is not None and gain.confirmed and gain.within_noise, gain
    assert "within the noise" in headline(choice)
    assert "(noise)" in best_table(study, loaded)
    assert f"Export picks trial {choice.trial.number}" in best_table(study, loaded)


def test_no_finalists_when_count_is_zero(tmp_path: Path) -> None:
    loaded = write_spec(tmp_path, trials=5, finalists={"count": 0})
    trials = steady()
    study, _ = run(loaded, trials)
    assert trials.confirmed == [] and confirmations(study) == {}
    choice = choose(study, loaded, trial=None, policy=None)
    assert choice.confirmed is None and "over the vLLM defaults" in headline(choice)


def test_verify_measures_every_finalist_once_more(tmp_path: Path) -> None:
    loaded = write_spec(tmp_path, trials=6, finalists={"count": 2})
    study, _ = run(loaded, steady())
    before = sum(len(v) for v in confirmations(study).values())
    trials = steady()
    StudyRunner(loaded, open_study(loaded, create=False), trials, on_event=lambda e: None,
                on_stale=lambda t: None).verify()  # fmt: skip
    assert sum(len(v) for v in confirmations(study).values()) == before + len(trials.confirmed)
    assert len(trials.confirmed) >= 2
