"""The reference load: latency objectives read at one load shared by every config, set by the spec or by
vLLM's defaults, so that the Pareto front holds configs that buy latency with capacity."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import optuna
import pytest
import yaml

from autotune.flags import FlagValue
from autotune.inputs.loader import LoadedStudy, load_study
from autotune.inputs.spec import MeasurementSpec, SloSection
from autotune.load.probe import ProbeOutcome, probe_requests
from autotune.load.ratesearch import find_slo_throughput
from autotune.outcome import TrialOutcome
from autotune.results.export import Policy, choose, pareto_front
from autotune.store.record import TrialRecord
from autotune.study.judge import judge, objective_value
from autotune.study.loop import StudyRunner, open_study
from autotune.study.reference import (
    REFERENCE_ATTR,
    Reference,
    ReferenceLoad,
    read_reference,
    reads_at_reference,
    stored_reference,
)

from .fake_trials import FakeTrials
from .test_load_ratesearch import outcome

SLO = SloSection(terms=("ttft:p95<=500ms",))
MEAS = MeasurementSpec(probe_duration=20.0, min_requests=100, max_probes=8, precision=0.02)

SPACE = {"params": {"max_num_seqs": {"type": "categorical", "choices": [16, 64, 256], "default": 256}}}

#: max_num_seqs -> (capacity in req/s, TTFT floor in s): fewer sequences, less capacity, lower latency.
CURVES = {16: (7.0, 0.01), 64: (8.5, 0.06), 256: (10.0, 0.15)}


class CurveServer:
    """A config's server: TTFT p95 = floor + 0.2 s / (capacity - rate), 2 s at or beyond capacity."""

    def __init__(self, capacity: float, floor: float) -> None:
        self.capacity, self.floor = capacity, floor
        self.rates: list[float] = []

    def __call__(self, rate: float, warmup_s: float = 0.0, window_s: float = 0.0) -> ProbeOutcome:
        self.rates.append(rate)
        ttft = 2.0 if rate >= self.capacity else self.floor + 0.2 / (self.capacity - rate)
        n = probe_requests(rate, SLO, MEAS)
        duration = n / self.capacity if math.isinf(rate) else n / rate
        return outcome(rate, n, ttft, duration, capacity=self.capacity if math.isinf(rate) else 0.0)


def loaded_study(tmp_path: Path, **extra: Any) -> LoadedStudy:
    (tmp_path / "space.yaml").write_text(yaml.safe_dump(SPACE))
    spec = {
        "study": {"name": "ref"},
        "server": {"command": "vllm serve my/model", "model": "my/model"},
        "search_space": "space.yaml",
        "slo": {"terms": ["ttft:p95<=500ms"]},
        "measurement": {"probe_duration": "20s", "min_requests": 100, "max_probes": 8, "precision": 0.02},
        "budget": {"launches": 3},
        "sampler": {"name": "random", "seed": 0},
        **extra,
    }
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    return load_study(path)


def tuned(
    tmp_path: Path, **extra: Any
) -> tuple[LoadedStudy, optuna.Study, dict[int, CurveServer], dict[int, TrialOutcome], dict[int, float]]:
    """The defaults (256 sequences), then 16 and 64, each searched and probed at the reference load; with
    each one's TTFT at its own boundary, for comparison."""
    loaded = loaded_study(tmp_path, **extra)
    study = open_study(loaded, create=True, heartbeat=False)
    for seqs in (16, 64):
        study.enqueue_trial({"max_num_seqs": seqs})
    reference = ReferenceLoad(study, loaded)
    servers: dict[int, CurveServer] = {}
    results: dict[int, TrialOutcome] = {}
    boundary: dict[int, float] = {}

    def run(number: int, flags: Mapping[str, FlagValue], phase: Callable[[str], None]) -> TrialOutcome:
        server = servers[number] = CurveServer(*CURVES[int(flags["max_num_seqs"])])
        result = find_slo_throughput(server, SLO, MEAS, sleep=lambda s: None)
        baseline = number == 0
        at = read_reference(reference, server, result, number, baseline=baseline, phase=phase)
        boundary[number] = objective_value(loaded.spec.objectives[1], result)
        results[number] = judge(result, None, TrialRecord(flags=dict(flags)), loaded.spec.objectives, at)
        return results[number]

    StudyRunner(loaded, study, FakeTrials(run), on_event=lambda e: None, on_stale=lambda t: None).run()
    return loaded, study, servers, results, boundary


def test_the_front_holds_both_ends_and_min_latency_picks_the_low_end(tmp_path: Path) -> None:
    """Read at each config's own SLO boundary, TTFT is the SLO's limit for all three (the front an
    artefact); read at half the defaults' SLO rate, fewer sequences cost capacity and buy latency: all
    three are on the front, and --policy min-latency picks 16 sequences, max-throughput the defaults."""
    loaded, study, servers, _, boundary = tuned(tmp_path)
    assert all(abs(v - 500.0) < 25.0 for v in boundary.values()), boundary
    ref = stored_reference(study)
    assert ref is not None
    defaults_rate = TrialRecord.from_trial(study.trials[0]).estimate["rate"]  # type: ignore[index]
    assert ref.rate == pytest.approx(0.5 * defaults_rate)
    assert "vLLM's defaults in trial 0" in ref.source
    for number, server in servers.items():
        assert server.rates[-1] == pytest.approx(ref.rate), number  # one probe at the reference load
        record = TrialRecord.from_trial(study.trials[number])
        assert record.reference is not None and record.reference["passed"] is True
        assert record.reference["request_rate"] == pytest.approx(ref.rate, rel=1e-3)
    front = {t.number for t in pareto_front(study)}
    assert front == {0, 1, 2}
    ttft = {t.number: t.values[1] for t in study.trials}
    assert ttft[1] < ttft[2] < ttft[0]  # 16 < 64 < 256 sequences at the one load
    assert choose(study, loaded, trial=None, policy=Policy.MIN_LATENCY).trial.number == 1
    assert choose(study, loaded, trial=None, policy=Policy.MAX_THROUGHPUT).trial.number == 0


def test_the_expected_traffic_is_the_reference_load(tmp_path: Path) -> None:
    """With workload.expected_rate, every config is probed there, and the study keeps it."""
    _, study, servers, results, _ = tuned(tmp_path, workload={"expected_rate": 3.0})
    assert all(server.rates[-1] == 3.0 for server in servers.values())
    assert stored_reference(study) == Reference(3.0, "workload.expected_rate")  # a resume checks it
    assert all("at 3 req/s" in results[n].summary for n in servers)
    record = TrialRecord.from_trial(study.trials[1])
    assert record.reference is not None and record.reference["source"] == "workload.expected_rate"


def test_without_the_defaults_the_first_measured_config_sets_the_load(tmp_path: Path) -> None:
    """The defaults not measured (failed), a config sets the load from its own SLO rate, once."""
    loaded = loaded_study(tmp_path, measurement={"reference_fraction": 0.25})
    study = open_study(loaded, create=True, heartbeat=False)
    reference = ReferenceLoad(study, loaded)
    first = reference.settle(3, baseline=False, sustained=8.0, phase=lambda s: None)
    assert first == Reference(2.0, "0.25 x the SLO rate of trial 3 (vLLM's defaults were not measured)")
    again = reference.settle(4, baseline=False, sustained=100.0, phase=lambda s: None)
    assert again == first
    assert study.user_attrs[REFERENCE_ATTR] == {"rate": 2.0, "source": first.source}


def test_a_config_waits_for_the_defaults_running_elsewhere(tmp_path: Path) -> None:
    """While the defaults' trial runs in another worker, a finished config waits for the load it sets."""
    loaded = loaded_study(tmp_path)
    study = open_study(loaded, create=True, heartbeat=False)
    defaults = study.ask()  # the queued defaults, running "elsewhere"
    assert TrialRecord.from_trial(study.trials[defaults.number]).baseline
    said: list[str] = []
    naps: list[float] = []

    def sleep(seconds: float) -> None:  # the defaults finish their search during the second nap
        naps.append(seconds)
        if len(naps) == 2:
            other = ReferenceLoad(study, loaded)
            other.settle(defaults.number, baseline=True, sustained=9.0, phase=lambda s: None)

    ref = ReferenceLoad(study, loaded, sleep=sleep).settle(
        5, baseline=False, sustained=4.0, phase=said.append
    )
    assert ref.rate == 4.5 and "defaults in trial 0" in ref.source
    assert len(naps) == 2
    assert said == ["waiting for vLLM's defaults (trial 0) to set the reference load"]


def test_a_config_stops_waiting_at_the_deadline(tmp_path: Path) -> None:
    """Defaults that never finish: past the deadline the waiting config sets the load itself."""
    loaded = loaded_study(tmp_path)
    study = open_study(loaded, create=True, heartbeat=False)
    study.ask()
    now = [0.0]

    def sleep(seconds: float) -> None:
        now[0] += seconds

    load = ReferenceLoad(study, loaded, clock=lambda: now[0], sleep=sleep, wait_s=10.0)
    ref = load.settle(5, baseline=False, sustained=4.0, phase=lambda s: None)
    assert ref.rate == 2.0 and "trial 5" in ref.source
    assert 10.0 <= now[0] < 13.0


def test_a_study_begun_before_reads_latency_at_the_boundary(tmp_path: Path) -> None:
    """A stored study with finished trials and no mark keeps reading at each boundary; a new one is marked."""
    loaded = loaded_study(tmp_path)
    study = open_study(loaded, create=True, heartbeat=False)
    assert reads_at_reference(study)
    old = optuna.create_study(directions=["maximize", "minimize"])
    old.add_trial(optuna.trial.create_trial(values=[1.0, 2.0]))
    assert not reads_at_reference(old)
    assert not reads_at_reference(old)  # the mark is stored
    assert old.user_attrs["latency_at"] == "boundary"


@pytest.mark.parametrize("given", ["0", "-1", ".inf", "nan", "fast"])
def test_bad_expected_rate_is_refused(tmp_path: Path, given: str) -> None:
    from autotune.errors import SpecError

    with pytest.raises(SpecError, match="expected_rate"):
        loaded_study(tmp_path, workload={"expected_rate": yaml.safe_load(given)})


def test_a_config_does_not_wait_for_defaults_a_dead_tuner_left(tmp_path: Path) -> None:
    """The defaults' trial RUNNING under a tuner of this host that died (killed mid-trial): a finished
    config does not wait for it, it sets the load itself."""
    import socket

    loaded = loaded_study(tmp_path)
    study = open_study(loaded, create=True, heartbeat=False)
    defaults = study.ask()
    defaults.set_user_attr("worker", f"{socket.gethostname()}:999999999:0.000")  # no such process
    naps: list[float] = []
    ref = ReferenceLoad(study, loaded, sleep=naps.append).settle(
        5, baseline=False, sustained=4.0, phase=print
    )
    assert naps == [] and ref.rate == 2.0 and "trial 5" in ref.source


def test_a_study_resumed_with_another_expected_rate_is_refused(tmp_path: Path) -> None:
    """The load the study's latency was read at is stored; tune with expected_rate added, changed or
    removed since is refused, saying why; the same spec goes on."""
    from autotune.errors import StudyError
    from autotune.study.reference import check_reference

    loaded = loaded_study(tmp_path, workload={"expected_rate": 3.0})
    study = open_study(loaded, create=True, heartbeat=False)
    ReferenceLoad(study, loaded).settle(0, baseline=True, sustained=9.0, phase=lambda s: None)
    check_reference(study, loaded)  # the same spec: nothing to say
    said = r"latency objectives at 3 req/s \(workload\.expected_rate\)"
    for folder, changed in (("x", {"workload": {"expected_rate": 5.0}}), ("z", {})):
        (tmp_path / folder).mkdir()
        with pytest.raises(StudyError, match=said):
            check_reference(study, loaded_study(tmp_path / folder, **changed))
    (tmp_path / "y").mkdir()
    fresh = loaded_study(tmp_path / "y")
    defaults_set = open_study(fresh, create=True, heartbeat=False)
    ReferenceLoad(defaults_set, fresh).settle(0, baseline=True, sustained=8.0, phase=lambda s: None)
    with pytest.raises(StudyError, match=r"the spec now gives workload\.expected_rate 6"):
        check_reference(defaults_set, loaded_study(tmp_path / "y", workload={"expected_rate": 6.0}))
