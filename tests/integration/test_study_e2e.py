"""Whole studies against the simulated vLLM server as a real subprocess over real HTTP.

Each test writes a small study spec, runs the tuner (in process, or as the `autotune` command), and
checks what was stored: outcomes and causes, resume after SIGKILL, and that no server process survives.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import optuna
import psutil
import pytest
import yaml
from optuna.trial import FrozenTrial, TrialState

from autotune.events import Event, Kind
from autotune.inputs.loader import LoadedStudy, load_study, resolve_access
from autotune.results.export import Format, Policy, choose, render
from autotune.server.launcher import ServerProcess
from autotune.store.record import TrialRecord, full_record
from autotune.study.finalists import reruns
from autotune.study.loop import close_study, open_study
from autotune.study.standing import is_launch
from autotune.study.trial import free_port, run_study

pytestmark = pytest.mark.integration

SPACE = {
    "params": {
        "max_num_seqs": {"type": "int", "low": 8, "high": 128, "log": True, "default": 32},
        "max_num_batched_tokens": {"type": "int", "low": 512, "high": 4096, "log": True, "default": 2048},
    },
    "constraints": [{"expr": "max_num_batched_tokens >= max_num_seqs"}],
}


def _marker_processes(marker: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if marker in " ".join(proc.info["cmdline"] or []) and proc.pid != os.getpid():
                found.append(proc)
        except psutil.Error:
            continue
    return found


@pytest.fixture
def marker() -> Iterator[str]:
    """A unique served-model name; every server of the test carries it on its command line."""
    name = f"m-{uuid.uuid4().hex[:10]}"
    yield name
    for proc in _marker_processes(name):  # never leave anything behind, even when a test failed
        with contextlib.suppress(OSError, psutil.Error):
            os.killpg(os.getpgid(proc.pid), signal.SIGKILL)


def write_spec(
    tmp_path: Path,
    marker: str,
    *,
    model: str = "Llama-3.1-8B",
    hardware: str = "H100-80GB",
    sim_flags: tuple[str, ...] = (),
    trials: int = 3,
    start_timeout: str = "30s",
    stop_timeout: str = "5s",
    client: dict[str, Any] | None = None,
    finalists: int = 0,
) -> Path:
    """A small study over the simulated server, fast enough for CI (no finalists measured again unless
    asked)."""
    (tmp_path / "space.yaml").write_text(yaml.safe_dump(SPACE))
    command = [
        sys.executable,
        "-m",
        "autotune.sim",
        model,
        "--served-model-name",
        marker,
        "--sim-hardware",
        hardware,
        "--sim-start-delay",
        "0.2",
        "--sim-seed",
        "1",
        *sim_flags,
    ]
    spec: dict[str, Any] = {
        "study": {"name": "e2e"},
        "server": {
            "command": command,
            "model": marker,
            "args": {"max-model-len": 2048},
            "port": 0,
            "start_timeout": start_timeout,
            "stop_timeout": stop_timeout,
        },
        "search_space": "space.yaml",
        "workload": {
            "dataset": {
                "input_len": {"dist": "uniform", "low": 32, "high": 128},
                "output_len": {"dist": "uniform", "low": 8, "high": 32},
            },
            "seed": 3,
        },
        "slo": {"terms": ["ttft:p95<=2s", "tpot:p95<=200ms"]},
        "measurement": {
            "probe_duration": "1s",
            "min_requests": 20,
            "min_tail_samples": 1,
            "saturation_requests": 20,
            "max_probes": 3,
            "precision": 0.15,
            "request_timeout": "20s",
            # A run the client's self-check voids (a busy 2-core box) is repeated soon: these tests
            # check the study, not how quiet the machine is.
            "invalid_retries": 4,
            "invalid_pause": "200ms",
            **(client or {}),
        },
        "faults": {"pause": "1s"},
        "budget": {"trials": trials},
        "finalists": {"count": finalists, "max_share": 1},
        "sampler": {"name": "random", "seed": 7},
    }
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def tune(path: Path) -> tuple[LoadedStudy, list[Event]]:
    loaded = load_study(path)
    events: list[Event] = []
    run_study(loaded, on_event=events.append)
    return loaded, events


def test_small_study_completes_measures_and_leaves_nothing_running(tmp_path: Path, marker: str) -> None:
    """A 3-trial study measures each config, stores its estimate, operating point and probes, measures its
    leader (and a rival within its noise) and the defaults again, and tears down."""
    loaded, events = tune(write_spec(tmp_path, marker, finalists=2))
    study = open_study(loaded, create=False, heartbeat=False)
    complete = study.get_trials(states=(TrialState.COMPLETE,))
    assert len(complete) == 3
    for trial in complete:
        whole = full_record(trial, loaded.trial_dir(trial.number))  # the trial's folder holds every detail
        point = whole.operating_point
        assert point is not None and point["output_throughput"] > 0
        assert whole.estimate is not None
        assert trial.values[0] == pytest.approx(whole.estimate["slo_throughput"], rel=1e-3)
        assert whole.probes and trial.user_attrs["probes"], "every probe is recorded"
        assert len(whole.probes) == len(trial.user_attrs["probes"])
        assert trial.user_attrs["capacity"]["kv_tokens"] > 0
        assert (loaded.trial_dir(trial.number) / "server.log").is_file()
        probe = json.loads((loaded.trial_dir(trial.number) / "probes" / "probe-1.json").read_text())
        assert probe["prompt_tokens_per_intended"] == 1.0, "prompts had the intended lengths"
        assert trial.user_attrs["prompt_calibration"]["source"] == "server /tokenize"
        assert all(p["prompt_tokens_per_intended"] == 1.0 for p in whole.probes)
        assert probe["completed"] == probe["planned"]
        assert all(v <= 0 for v in trial.constraints.values())
    assert study.trials[0].user_attrs["baseline"] is True
    assert any("probe" in e.text for e in events)
    assert _marker_processes(marker) == []
    # Finalists: the leader, a rival within its noise, and the defaults, measured again in their own folders.
    again = reruns(study)
    assert 1 <= len(again) <= 3 and study.trials[0].number in again
    assert len(list((loaded.workdir / "confirmations").iterdir())) == len(again)
    assert [e.kind for e in events].count(Kind.CONFIRMED) == len(again)
    assert len(study.get_trials(deepcopy=False)) == 3  # no trial, no launch of the budget

    # The exported YAML starts the server with the chosen flags through `--config`.
    choice = choose(study, loaded, trial=None, policy=Policy.MAX_THROUGHPUT)
    config = tmp_path / "best.yaml"
    config.write_text(render(choice, loaded, Format.VLLM_YAML))
    port = free_port("127.0.0.1")
    argv = [*loaded.spec.server.command, "--config", str(config), "--host", "127.0.0.1", "--port", str(port)]
    with ServerProcess(
        argv, env={}, log_path=tmp_path / "exported.log", host="127.0.0.1", port=port, model=marker
    ) as server:
        ready = server.wait_ready(30)
        assert ready.capacity is not None
        # Same KV capacity as the trial measured: the exported flags took effect.
        assert ready.capacity.kv_tokens == choice.trial.user_attrs["capacity"]["kv_tokens"]
        reply = httpx.post(
            f"{server.base_url}/v1/completions",
            json={"model": marker, "prompt": "hello there", "max_tokens": 4},
            timeout=10,
        )
        assert reply.status_code == 200
    assert _marker_processes(marker) == []


@pytest.mark.slow
@pytest.mark.timeout(300)  # a hang guard: it took 112 s of the default 120 on busy cores (docs/testing.md)
def test_a_server_writing_several_events_at_once_is_measured_to_the_end_of_the_budget(
    tmp_path: Path, marker: str
) -> None:
    """The simulated server at four times its speed writes each stream's chunks eight at a time (vLLM's API
    server under load). The study judges what it reads (its SLO terms, TTFT p95 and TPOT p95, and its
    latency objective, TTFT p95), bounds ITL p99 and TPOT p99 too without judging them, and spends its
    whole budget: no probe is voided over a statistic it does not judge, so no probe's ITL ends it.

    On a loaded machine the client may read late enough to move a judged statistic too (with a core kept
    busy, a probe's TPOT p95 may move by 3.3 % of the 5 % its self-check allows): a config whose every
    probe is voided is pruned as one the client could not measure, said so, and the study goes on. That
    verdict is the machine's, not this test's to forbid."""
    sim = ("--sim-events-per-write", "8", "--sim-speedup", "4")
    loaded, events = tune(write_spec(tmp_path, marker, trials=3, sim_flags=sim))
    study = open_study(loaded, create=False, heartbeat=False)
    unjudged = ("itl:p99", "tpot:p99")
    for trial in _measured_or_unmeasurable(study, 3):
        record = full_record(trial, loaded.trial_dir(trial.number))
        if trial.state == TrialState.COMPLETE:
            assert record.estimate is not None and record.slo_throughput is not None
        else:
            assert not any(key in (record.summary or "") for key in unjudged), record.summary
        probes = sorted((loaded.trial_dir(trial.number) / "probes").glob("probe-*.json"))
        assert probes, trial.number
        for probe in probes:
            data = json.loads(probe.read_text())
            client = data["client"]
            assert client["judged"] == ["ttft:p95", "tpot:p95"], probe
            assert {"ttft:p95", "tpot:p95", *unjudged} <= set(client["shifts"]), probe
            voided_by = [problem for problem in data["problems"] if any(key in problem for key in unjudged)]
            assert voided_by == [], (probe, voided_by)
    assert not [e for e in events if e.kind == Kind.STOPPED]
    assert _marker_processes(marker) == []


def _measured_or_unmeasurable(study: optuna.Study, launches: int) -> list[FrozenTrial]:
    """The study's ``launches`` launched trials, each measured (COMPLETE) or pruned as a config the client
    could not measure, with its reason: on a loaded machine the client's self-check may void every probe of
    a config (docs/testing.md, the rule on timing), a verdict these tests do not forbid."""
    trials = [t for t in study.trials if is_launch(t)]
    ended = [
        (t.number, t.state.name, t.user_attrs.get("cause"), t.user_attrs.get("summary")) for t in study.trials
    ]
    assert len(trials) == launches, ended
    for trial in trials:
        record = TrialRecord.from_trial(trial)
        if trial.state != TrialState.COMPLETE:
            assert trial.state == TrialState.PRUNED and record.cause is not None, ended
            assert record.cause.value == "unmeasurable" and record.summary, ended
    return trials


def _client_voids_runs(monkeypatch: pytest.MonkeyPatch, when: Callable[[], bool]) -> None:
    """Every probe's run is voided by the client's self-check (a stand-in verdict) while ``when()``."""
    import dataclasses

    from autotune.load import probe

    real = probe.run_requests

    def voided(*args: Any, **kwargs: Any) -> Any:
        result = real(*args, **kwargs)
        if when():
            return dataclasses.replace(result, problems=("client starved (the test's verdict)",))
        return result

    monkeypatch.setattr(probe, "run_requests", voided)


@pytest.mark.slow
def test_a_config_the_client_cannot_measure_is_pruned_and_the_study_goes_on(
    tmp_path: Path, marker: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once vLLM's defaults are measured, the client's self-check voids every run (a client that cannot
    keep up): each later config is pruned as ``unmeasurable`` with the self-check's reason, and the study
    spends its budget instead of stopping."""
    done: list[int] = []
    _client_voids_runs(monkeypatch, lambda: bool(done))
    loaded = load_study(write_spec(tmp_path, marker, trials=3, client={"invalid_retries": 0}))
    events: list[Event] = []

    def on_event(event: Event) -> None:
        events.append(event)
        if event.kind == Kind.TRIAL_DONE:
            done.append(event.trial or 0)

    run_study(loaded, on_event=on_event)
    study = open_study(loaded, create=False, heartbeat=False)
    launched = [t for t in study.trials if is_launch(t)]
    assert len(launched) == 3 and launched[0].state == TrialState.COMPLETE
    for trial in launched[1:]:
        record = TrialRecord.from_trial(trial)
        assert trial.state == TrialState.PRUNED and record.cause is not None
        assert record.cause.value == "unmeasurable", record.cause
        assert "the test's verdict" in (record.summary or "")
    assert not [e for e in events if e.kind == Kind.STOPPED]
    assert _marker_processes(marker) == []


@pytest.mark.slow
def test_a_finalists_rerun_the_client_cannot_measure_is_an_unmeasured_round_and_the_study_finishes(
    tmp_path: Path, marker: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once the search is done the client's self-check voids every run: each finalist's rerun (real
    servers, real probes) is stored as an unmeasurable round, neither met nor missed, and the study
    finishes instead of stopping on a fault."""
    from autotune.study.finalists import reruns

    rerunning: list[int] = []
    _client_voids_runs(monkeypatch, lambda: bool(rerunning))
    loaded = load_study(write_spec(tmp_path, marker, trials=2, finalists=1, client={"invalid_retries": 0}))
    events: list[Event] = []

    def on_event(event: Event) -> None:
        events.append(event)
        if event.text.startswith("measuring the finalist again"):
            rerunning.append(event.trial or 0)

    run_study(loaded, on_event=on_event)
    assert rerunning and not [e for e in events if e.kind in (Kind.STOPPED, Kind.FAULT)]
    study = open_study(loaded, create=False, heartbeat=False)
    table = reruns(study)
    assert table and all(r.unmeasured and r.cause == "unmeasurable" for f in table.values() for r in f.reruns)
    assert all(f.misses == 0 for f in table.values())
    confirmed = [e for e in events if e.kind == Kind.CONFIRMED]
    assert confirmed and all("could not measure this rerun" in e.text for e in confirmed)
    assert _marker_processes(marker) == []


@pytest.mark.slow
def test_a_study_whose_defaults_the_client_cannot_measure_stops_saying_what_to_do(
    tmp_path: Path, marker: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the defaults there is nothing to compare: when the client cannot measure them at any rate the
    study stops (after its retries), and its message says what to do."""
    from autotune.errors import InvalidMeasurementError

    _client_voids_runs(monkeypatch, lambda: True)
    path = write_spec(tmp_path, marker, trials=2, client={"invalid_retries": 0})
    spec = yaml.safe_load(path.read_text())
    spec["faults"] = {"pause": "10ms", "retries": 1}
    path.write_text(yaml.safe_dump(spec))
    with pytest.raises(InvalidMeasurementError, match=r"client_workers.*another host"):
        tune(path)
    assert _marker_processes(marker) == []


@pytest.mark.slow
def test_oom_at_start_is_pruned_with_its_cause(tmp_path: Path, marker: str) -> None:
    """A model that cannot fit exits at start with vLLM's OOM text: pruned as oom, log lines stored."""
    path = write_spec(tmp_path, marker, model="Llama-3.1-70B", hardware="RTX-4090-24GB", trials=2)
    loaded, _ = tune(path)
    study = open_study(loaded, create=False, heartbeat=False)
    pruned = study.get_trials(states=(TrialState.PRUNED,))
    launched = [t for t in pruned if is_launch(t)]
    assert len(launched) == 2
    for trial in launched:
        assert trial.user_attrs["cause"] == "oom"
        assert any("out of memory" in line for line in trial.user_attrs["log_lines"])
    failed = {t.number for t in launched}
    for trial in pruned:  # configs asking more memory than a failed one were not launched
        if not is_launch(trial):
            record = TrialRecord.from_trial(trial)
            assert record.beyond in failed or record.repeat_of in failed, record
    assert _marker_processes(marker) == []


@pytest.mark.slow
def test_a_study_where_nothing_meets_the_slos_offers_no_export(tmp_path: Path, marker: str) -> None:
    """`autotune tune` whose every trial failed prints the causes and no export command."""
    path = write_spec(tmp_path, marker, model="Llama-3.1-70B", hardware="RTX-4090-24GB", trials=1)
    result = subprocess.run(_autotune("tune", str(path)), capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "autotune export" not in result.stdout
    assert "Nothing to export: no trial met the SLOs" in result.stdout
    assert "pruned:oom" in result.stdout


def test_hanging_server_is_stopped_at_the_start_timeout(tmp_path: Path, marker: str) -> None:
    """A server that never becomes ready is killed at the start timeout: pruned as start_timeout."""
    path = write_spec(tmp_path, marker, sim_flags=("--sim-hang-at-start",), trials=1, start_timeout="3s")
    loaded, _ = tune(path)
    trial = open_study(loaded, create=False, heartbeat=False).trials[0]
    assert trial.state == TrialState.PRUNED
    assert trial.user_attrs["cause"] == "start_timeout"
    assert _marker_processes(marker) == []


@pytest.mark.slow
def test_server_dying_mid_probe_with_exit_zero_is_a_crash_under_load(tmp_path: Path, marker: str) -> None:
    """vLLM exits 0 after its engine dies: the trial is crashed_under_load, not a measurement."""
    path = write_spec(tmp_path, marker, sim_flags=("--sim-die-after-requests", "10"), trials=1)
    loaded, _ = tune(path)
    trial = open_study(loaded, create=False, heartbeat=False).trials[0]
    assert trial.state == TrialState.PRUNED
    assert trial.user_attrs["cause"] == "crashed_under_load"
    assert trial.values is None
    assert _marker_processes(marker) == []


@pytest.mark.slow
@pytest.mark.timeout(300)  # a hang guard: it took 88 s of the default 120 on two busy cores (docs/testing.md)
def test_server_ignoring_sigterm_is_killed_and_the_study_goes_on(tmp_path: Path, marker: str) -> None:
    """A server that ignores SIGTERM (with a child left behind) is SIGKILLed by group; nothing survives."""
    path = write_spec(
        tmp_path,
        marker,
        # Slowed down: the aiohttp engine times a chunk at its read, so a ~2 ms loop lag on this busy
        # 2-core box must stay within the self-check's 5 % of the inter-token latency.
        sim_flags=("--sim-ignore-sigterm", "--sim-orphan-child", "--sim-speedup", "0.25"),
        trials=2,
        stop_timeout="1s",
        client={"client": "aiohttp", "client_workers": 2},  # the other client engine, in worker processes
    )
    loaded, _ = tune(path)
    study = open_study(loaded, create=False, heartbeat=False)
    _measured_or_unmeasurable(study, 2)  # each server killed, the study went on to the next
    assert _marker_processes(marker) == []


def _autotune(*args: str) -> list[str]:
    return [sys.executable, "-c", "from autotune.cli import main; main()", *args]


@pytest.mark.slow
def test_tuner_killed_mid_trial_then_resumed(tmp_path: Path, marker: str) -> None:
    """SIGKILL of the tuner mid-trial leaves a server behind; rerunning kills it, retries the trial
    with the same flags, completes the budget, and loses or duplicates nothing."""
    # A slowed-down server keeps trial 1 measuring long enough to be interrupted mid-trial.
    path = write_spec(tmp_path, marker, trials=3, sim_flags=("--sim-speedup", "0.25"))
    log = (tmp_path / "first.out").open("w")
    tuner = subprocess.Popen(
        _autotune("tune", str(path)), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            text = (tmp_path / "first.out").read_text()
            if "#1 ready" in text:  # the progress line of trial 1 once its server is ready
                break
            assert tuner.poll() is None, text
            time.sleep(0.1)
        else:
            pytest.fail("the tuner never got trial 1's server ready")
        os.killpg(tuner.pid, signal.SIGKILL)
        tuner.wait(10)
    finally:
        log.close()
    orphans = _marker_processes(marker)
    assert orphans, "the server of the killed tuner lives on in its own session (as vLLM's would)"

    result = subprocess.run(_autotune("tune", str(path)), capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr
    assert "re-queued interrupted trials [1]" in result.stdout
    assert _marker_processes(marker) == []

    loaded = load_study(path)
    study = open_study(loaded, create=False, heartbeat=False)
    states = [t.state for t in study.trials]
    assert states.count(TrialState.FAIL) == 1
    finished = [t for t in study.trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
    assert len(finished) == 3
    failed = next(t for t in study.trials if t.state == TrialState.FAIL)
    retries = [t for t in finished if t.params == failed.params and t.number > failed.number]
    assert len(retries) == 1, "the interrupted trial is retried once with the same flags"
    assert len({t.number for t in finished}) == 3


@pytest.mark.slow
def test_a_server_behind_an_api_key_is_tuned_and_the_key_is_written_nowhere(
    tmp_path: Path, marker: str
) -> None:
    """server.api_key_env: the server gets the key as VLLM_API_KEY (not on its command line), readiness,
    probes and /metrics send it; it appears in no stored attribute, log, probe file or event. A server
    that wants another key ends the trial as start_failed with its words, not start_timeout."""
    key = "k3y-" + uuid.uuid4().hex
    path = write_spec(tmp_path, marker, trials=1)
    spec = yaml.safe_load(path.read_text())
    spec["server"]["api_key_env"] = "E2E_TEST_KEY"
    path.write_text(yaml.safe_dump(spec))
    loaded = load_study(path)
    events: list[Event] = []
    study = run_study(loaded, on_event=events.append, access=resolve_access(loaded, {"E2E_TEST_KEY": key}))
    trial = study.trials[0]
    assert trial.state == TrialState.COMPLETE, trial.user_attrs.get("summary")
    stored = json.dumps(trial.user_attrs) + "".join(e.text for e in events)
    files = "".join(p.read_text(errors="replace") for p in loaded.workdir.rglob("*") if p.is_file()
                    and p.suffix in (".json", ".log", ".jsonl"))  # fmt: skip
    assert key not in stored and key not in files

    other = tmp_path / "other"
    other.mkdir()
    path = write_spec(other, marker, trials=1, start_timeout="20s")
    spec = yaml.safe_load(path.read_text())
    spec["server"]["api_key_env"] = "E2E_TEST_KEY"
    spec["server"]["args"]["api-key"] = "the-servers-own-key"  # the command line wins over VLLM_API_KEY
    path.write_text(yaml.safe_dump(spec))
    loaded = load_study(path)
    study = run_study(loaded, on_event=lambda e: None, access=resolve_access(loaded, {"E2E_TEST_KEY": key}))
    trial = study.trials[0]
    assert trial.user_attrs["cause"] == "start_failed", trial.user_attrs["summary"]
    assert "refused the API key" in trial.user_attrs["summary"] and "401" in trial.user_attrs["summary"]
    assert _marker_processes(marker) == []


@pytest.mark.slow
def test_verify_measures_the_finalists_again_from_the_cli(tmp_path: Path, marker: str) -> None:
    """`autotune tune` measures its leader and the defaults again before it ends; `autotune verify` adds a
    round; the table and the export recommend by the reruns and say so."""
    path = write_spec(tmp_path, marker, trials=2, finalists=1)
    tuned = subprocess.run(_autotune("tune", str(path)), capture_output=True, text=True, timeout=300)
    assert tuned.returncode == 0, tuned.stdout + tuned.stderr
    assert "measured again" in tuned.stdout and "Recommended: " in tuned.stdout
    loaded = load_study(path)
    study = open_study(loaded, create=False, heartbeat=False)
    first = {n: len(found.reruns) for n, found in reruns(study).items()}
    assert first and all(count == 1 for count in first.values())
    verified = subprocess.run(_autotune("verify", str(path)), capture_output=True, text=True, timeout=300)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    study = open_study(loaded, create=False, heartbeat=False)
    assert {n: len(found.reruns) for n, found in reruns(study).items()} == dict.fromkeys(first, 2)
    exported = subprocess.run(_autotune("export", str(path)), capture_output=True, text=True, timeout=60)
    assert exported.returncode == 0, exported.stderr
    lines = exported.stdout.splitlines()  # the header's comment lines, wrapped at 80 columns: read as one
    header = " ".join(
        line.lstrip("# ").strip() for line in itertools.takewhile(lambda x: x.startswith("#"), lines)
    )
    assert "mean of 2 reruns" in header or "missed the SLOs" in header, header
    assert "paired rerun" in header or "defaults" in header, header
    assert _marker_processes(marker) == []


def test_the_surrogate_proposes_launches_from_real_probes(tmp_path: Path, marker: str) -> None:
    """With a memory model (the model and GPU the simulated server runs), the launches after vLLM's defaults
    are the surrogate's proposals: each trial records its probes' curve (rate and SLO values) that the
    surrogate calibrates to, and each proposal its prediction and how many measured trials it rested on."""
    path = write_spec(tmp_path, marker, trials=3)
    spec = yaml.safe_load(path.read_text())
    spec["memory_model"] = {"model": "Llama-3.1-8B", "gpu": "H100-80GB"}
    path.write_text(yaml.safe_dump(spec))
    loaded, events = tune(path)
    study = open_study(loaded, create=False, heartbeat=False)
    trials = sorted(study.get_trials(deepcopy=False), key=lambda t: t.number)
    close_study(study)
    records = [TrialRecord.from_trial(t) for t in trials]
    assert records[0].baseline and records[0].surrogate is None
    launched = [r for r in records if r.launched]
    assert len(launched) == 3
    for r in launched:  # the saturation probe's rate, and each finite-rate probe's SLO values
        assert r.curve and r.curve["capacity"] > 0, r.curve
        assert all(len(p) == 3 and p[0] > 0 for p in r.curve["points"]), r.curve
    proposals = [r for r in records if r.surrogate is not None]
    assert len(proposals) == 2, [r.summary for r in records]
    assert [p.surrogate["calibrated_on"] for p in proposals] == [1, 2]  # type: ignore[index]
    assert all(p.surrogate["slo_rate"] > 0 for p in proposals)  # type: ignore[index]
    assert not [e for e in events if e.data.get("surrogate") == "handed over"]
