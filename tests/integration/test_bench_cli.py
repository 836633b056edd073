"""`autotune bench SPEC --url URL` against the simulated server, started as a real subprocess.

The CLI runs as the console script does, in a fresh interpreter; the server is
``python -m autotune.sim Llama-3.1-8B --sim-hardware H100-80GB --port P --sim-start-delay 0.2``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

REPO = Path(__file__).resolve().parents[2]
MODEL = "Llama-3.1-8B"


def free_port() -> int:
    """A port that was free a moment ago (bind port 0)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def sim_server(tmp_path: Path, *extra: str) -> Iterator[str]:
    """Start the simulated server in its own session, wait for /health 200, yield its URL; kill its group.

    ``--max-num-seqs 8`` keeps its saturation throughput (and so the probed rates) low enough that the
    client keeps up on a busy 2-core box.
    """
    port = free_port()
    log_path = tmp_path / f"sim-{port}.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                *("-m", "autotune.sim", MODEL, "--sim-hardware", "H100-80GB"),
                *("--host", "127.0.0.1", "--port", str(port), "--sim-start-delay", "0.2"),
                *("--max-model-len", "2048", "--max-num-seqs", "8", *extra),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 20.0
        while True:
            assert proc.poll() is None, log_path.read_text()
            with suppress(httpx.TransportError):
                if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                    break
            assert time.monotonic() < deadline, f"sim not ready:\n{log_path.read_text()}"
            time.sleep(0.05)
        yield url
    finally:
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def write_spec(tmp_path: Path, **overrides: Any) -> Path:
    """A small study spec for the simulated server (the search space is the repo's sim.yaml)."""
    spec: dict[str, Any] = {
        "study": {"name": "bench-check"},
        "server": {
            "command": ["python", "-m", "autotune.sim", MODEL],
            "model": MODEL,
            "args": {"max-model-len": 2048},
        },
        "search_space": str(REPO / "search_spaces" / "sim.yaml"),
        "workload": {
            "dataset": {
                "kind": "synthetic",
                "input_len": {"dist": "uniform", "low": 64, "high": 256},
                "output_len": {"dist": "uniform", "low": 16, "high": 48},
            },
            "seed": 0,
        },
        "slo": {"terms": ["ttft:p90<=80ms", "tpot:p90<=30ms"]},
        "measurement": {
            "probe_duration": "2s",
            "min_requests": 20,
            "min_tail_samples": 2,
            "saturation_requests": 40,
            "max_probes": 4,
            "precision": 0.15,
            "request_timeout": "30s",
            # A run the client's self-check voids (a busy 2-core box) is repeated soon, as often as a
            # study repeats it: the tests check what bench does, not how quiet the machine is.
            "invalid_retries": 4,
            "invalid_pause": "200ms",
        },
    }
    for section, value in overrides.items():
        spec[section] = value
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec), encoding="utf-8")
    return path


def autotune(*args: str | Path) -> subprocess.CompletedProcess[str]:
    """Run the CLI exactly as the console script does, in a fresh interpreter."""
    return subprocess.run(
        [sys.executable, "-c", "from autotune.cli import main; main()", *map(str, args)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )


def error_line(proc: subprocess.CompletedProcess[str]) -> str:
    """The CLI's single error line (asserting there is exactly one line on stderr starting 'error:')."""
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    return errors[0]


def test_fixed_rate_prints_metrics_and_saves_vllm_bench_keys(tmp_path: Path) -> None:
    """--rate runs one probe at that rate: a table of TTFT/TPOT/ITL/E2EL statistics, throughput, goodput,
    failed, the probe's pass/fail and its output throughput (one probe is not a rate search: never
    called the SLO-constrained throughput); --save-result holds its JSON with `vllm bench serve
    --save-result` keys, and its per-chunk evidence beside it."""
    spec = write_spec(tmp_path)
    out = tmp_path / "results"
    # A slower server (4x longer token gaps): a chunk read a millisecond or two late on a busy 2-core box
    # moves itl:p99 by well under the self-check's bound, so the measurement is judged valid.
    with sim_server(tmp_path, "--sim-speedup", "0.25") as url:
        proc = autotune("bench", spec, "--url", url, "--rate", "10", "--save-result", out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = proc.stdout
    for row in ("TTFT", "TPOT", "ITL", "E2EL"):
        assert any(line.startswith(row) and len(line.split()) == 6 for line in text.splitlines()), text
    for word in ("mean", "p50", "p90", "p95", "p99", "goodput", "failed", "output throughput at 10 req/s:"):
        assert word in text, text
    assert "SLO-constrained throughput:" not in text, text
    assert "operating point" not in text, text
    assert "rate     10 req/s" in text, text
    assert "server /metrics:" in text, text
    saved = json.loads((out / "probe-1.json").read_text())
    for k in ("completed", "failed", "request_throughput", "output_throughput", "request_goodput"):
        assert k in saved
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p99"):
            assert f"{stat}_{metric}_ms" in saved
    assert saved["rate"] == 10
    assert saved["completed"] + saved["failed"] == 20  # min_requests (10 req/s x 2 s = 20)
    assert sorted(p.name for p in out.iterdir()) == ["probe-1.chunks.jsonl.gz", "probe-1.json"]
    # Text prompts were sized through the server's /tokenize, and usage confirms every token.
    assert saved["prompt_calibration"]["source"] == "server /tokenize"
    assert saved["prompt_tokens_per_intended"] == 1.0
    assert "prompts: calibrated by server /tokenize" in text, text
    assert "counted 1.000-1.000 of the intended prompt tokens" in text, text


@pytest.mark.slow
def test_rate_search_reports_slo_throughput(tmp_path: Path) -> None:
    """Without --rate the search runs (saturation probe first, then rates below it) and prints the
    SLO-constrained throughput in tok/s; --no-metrics skips /metrics. The SLOs are ten times the spec's
    usual: a server paced by the wall clock on a busy 2-core machine read 5 of 20 TPOTs over 30 ms at its
    lowest rate, and the test checks what bench prints, not how fast the machine is."""
    spec = write_spec(tmp_path, slo={"terms": ["ttft:p90<=800ms", "tpot:p90<=300ms"]})
    with sim_server(tmp_path, "--sim-speedup", "0.25") as url:
        proc = autotune("bench", spec, "--url", url, "--no-metrics")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    probes = [line for line in lines if line.strip().startswith(tuple(f"{i}. rate" for i in range(1, 9)))]
    assert len(probes) >= 2, proc.stdout
    assert "rate    inf req/s" in probes[0], probes
    final = [line for line in lines if line.startswith("SLO-constrained throughput:")]
    assert len(final) == 1, proc.stdout
    assert "tok/s" in final[0], final
    assert "server /metrics:" not in proc.stdout


@pytest.mark.slow
def test_server_that_dies_between_probes_stops_with_clear_error(tmp_path: Path) -> None:
    """A server whose /health stops answering 200 between probes stops the bench: exit 1 and one line
    saying /health no longer answers, after the probes that finished."""
    spec = write_spec(tmp_path)
    with sim_server(tmp_path, "--sim-die-after-requests", "45") as url:
        proc = autotune("bench", spec, "--url", url, "--no-metrics")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    line = error_line(proc)
    assert "stopped answering /health" in line, line
    assert url in line, line


def test_unreachable_server_exits_1_with_actionable_line(tmp_path: Path) -> None:
    """Nothing listening at --url: exit 1 and one line naming the URL and what to do."""
    spec = write_spec(tmp_path)
    url = f"http://127.0.0.1:{free_port()}"
    proc = autotune("bench", spec, "--url", url)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    line = error_line(proc)
    assert f"cannot reach the server at {url}" in line, line
    assert "--url" in line, line


@pytest.mark.parametrize(
    ("args", "field", "value"),
    [
        (["--url", "not a url"], "--url", "not a url"),
        (["--url", "ftp://127.0.0.1:8000"], "--url", "ftp://127.0.0.1:8000"),
        (["--url", "http://127.0.0.1:1", "--rate", "-2"], "--rate", "-2"),
        (["--url", "http://127.0.0.1:1", "--rate", "fast"], "--rate", "fast"),
    ],
)
def test_bad_options_exit_2_naming_option_and_value(
    tmp_path: Path, args: list[str], field: str, value: str
) -> None:
    """A bad --url or --rate: exit 2 and one line naming the option and the value, before any request."""
    proc = autotune("bench", write_spec(tmp_path), *args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    line = error_line(proc)
    assert line.startswith(f"error: {field}:"), line
    assert repr(value) in line, line


def test_spec_error_exits_2_naming_field(tmp_path: Path) -> None:
    """A spec error: exit 2 and one line naming the field path and the value."""
    spec = write_spec(tmp_path, slo={"terms": ["ttft:p95<=fast"]})
    proc = autotune("bench", spec, "--url", "http://127.0.0.1:1")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    line = error_line(proc)
    assert "slo.terms" in line and "ttft:p95<=fast" in line, line


def test_unknown_model_and_unwritable_save_dir_exit_2(tmp_path: Path) -> None:
    """--model that the server does not serve, and --save-result that is a file: exit 2 naming the option."""
    spec = write_spec(tmp_path)
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with sim_server(tmp_path) as url:
        wrong_model = autotune("bench", spec, "--url", url, "--model", "no-such-model")
        bad_dir = autotune("bench", spec, "--url", url, "--rate", "5", "--save-result", blocker)
    assert wrong_model.returncode == 2, wrong_model.stderr
    line = error_line(wrong_model)
    assert line.startswith("error: --model:") and "'no-such-model'" in line and MODEL in line, line
    assert bad_dir.returncode == 2, bad_dir.stderr
    assert error_line(bad_dir).startswith("error: --save-result:"), bad_dir.stderr


def _autotune_env(env: dict[str, str], *args: str | Path) -> subprocess.CompletedProcess[str]:
    """The CLI with extra environment variables."""
    return subprocess.run(
        [sys.executable, "-c", "from autotune.cli import main; main()", *map(str, args)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
        env={**os.environ, **env},
    )


@pytest.mark.slow
def test_a_server_behind_an_api_key_is_measured_with_the_key_and_refuses_a_wrong_one(tmp_path: Path) -> None:
    """A server started with --api-key: measured with server.api_key_env's key (sent as a bearer token,
    written to no file); without it, or with a wrong one, one line naming the field and exit 2."""
    key = "s3cret-key-1234"
    spec = write_spec(
        tmp_path,
        server={
            "command": ["python", "-m", "autotune.sim", MODEL],
            "model": MODEL,
            "args": {"max-model-len": 2048},
            "api_key_env": "BENCH_TEST_KEY",
        },
    )
    out = tmp_path / "results"
    with sim_server(tmp_path, "--api-key", key, "--sim-speedup", "0.25") as url:
        good = _autotune_env({"BENCH_TEST_KEY": key}, "bench", spec, "--url", url, "--rate", "10",
                             "--save-result", out)  # fmt: skip
        wrong = _autotune_env({"BENCH_TEST_KEY": "nope"}, "bench", spec, "--url", url, "--rate", "10")
        unset = autotune("bench", spec, "--url", url, "--rate", "10")
        (tmp_path / "plain").mkdir()
        plain = autotune("bench", write_spec(tmp_path / "plain"), "--url", url, "--rate", "10")
    assert good.returncode == 0, good.stdout + good.stderr
    saved = [p.read_text() for p in out.glob("*.json")]
    assert saved and not any(key in text for text in saved), "the key is written nowhere"
    assert key not in good.stdout + good.stderr
    assert wrong.returncode == 2
    line = error_line(wrong)
    assert "server.api_key_env" in line and "HTTP 401" in line and "nope" not in line
    assert unset.returncode == 2 and "BENCH_TEST_KEY" in error_line(unset)
    assert plain.returncode == 2 and "wants an API key" in error_line(plain)


@pytest.mark.slow
def test_a_bench_whose_every_request_fails_exits_1_with_the_error(tmp_path: Path) -> None:
    """Every request refused (prompts longer than the server's max-model-len): the report still prints,
    then one error line with the server's first error text and exit 1, never a table of zeros and 0."""
    spec = write_spec(
        tmp_path,
        workload={"dataset": {"kind": "synthetic", "input_len": 3000, "output_len": 8}, "seed": 0},
    )
    with sim_server(tmp_path) as url:
        proc = autotune("bench", spec, "--url", url, "--rate", "5")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    line = error_line(proc)
    assert "every request failed" in line and "HTTP 400" in line, line


@pytest.mark.slow
def test_multi_turn_chat_with_prefix_groups_over_http(tmp_path: Path) -> None:
    """Conversations of system prompts and turns against the simulated server: every turn completes, the
    server's prefix cache serves close to the share the plan says a cache could (below it: whole blocks
    only, first uses), TTFT is reported by turn, and the prompts reach their intended lengths (the chat
    template's few tokens per message aside)."""
    workload = {
        "endpoint": "chat",
        "dataset": {
            "kind": "synthetic",
            "input_len": {"dist": "uniform", "low": 32, "high": 96},
            "output_len": {"dist": "uniform", "low": 8, "high": 24},
            "prefix": {"groups": 3, "len": {"dist": "uniform", "low": 200, "high": 400}},
        },
        "conversation": {"turns": {"dist": "uniform", "low": 2, "high": 3}, "think_time": "50ms"},
        "seed": 0,
    }
    spec = write_spec(tmp_path, workload=workload)
    out = tmp_path / "results"
    # A server eight times slower than the H100 it models: cached prompts' TTFTs of a few ms would otherwise
    # be within the client's own lateness on a busy machine (the run then voids itself: at four times
    # slower, 1-ms late reads moved TTFT p95 5.5 % while other tests ran beside it).
    with sim_server(tmp_path, "--sim-speedup", "0.125") as url:
        proc = autotune("bench", spec, "--url", url, "--rate", "2", "--save-result", out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "traffic: p95 TTFT turn 1" in proc.stdout and "prefix cache served" in proc.stdout, proc.stdout
    saved = json.loads((out / "probe-1.json").read_text())
    assert saved["failed"] == 0 and saved["completed"] >= 20
    ideal, served = saved["prefix_hit_rate_ideal"], saved["prefix_hit_rate_server"]
    assert 0.6 < ideal < 1 and ideal - 0.15 < served <= ideal, (ideal, served)
    assert {"1", "2"} <= set(saved["ttft_by_turn"])
    assert 1.0 <= saved["prompt_tokens_per_intended"] < 1.1


@pytest.mark.slow
def test_rate_trace_replays_the_trace_at_its_time_scale(tmp_path: Path) -> None:
    """`--rate trace` is one probe at the trace's recorded rate times dataset.time_scale (here 30 requests
    0.5 s apart: 2 req/s, twice that); the probe says how much faster than recorded it ran. Without a
    trace's arrivals `--rate trace` is one error line naming --rate, exit 2."""
    trace = tmp_path / "trace.jsonl"
    rows = [{"timestamp": 0.5 * i, "input_len": 64 + i, "output_len": 8} for i in range(30)]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    workload = {
        "dataset": {"kind": "trace", "path": str(trace), "time_scale": 2},
        "arrival": {"process": "trace"},
        "seed": 0,
    }
    spec = write_spec(tmp_path, workload=workload)
    # 4x longer token gaps: a chunk read a millisecond late moves itl:p99 well under the bound.
    with sim_server(tmp_path, "--sim-speedup", "0.25") as url:
        proc = autotune("bench", spec, "--url", url, "--rate", "trace")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "output throughput at 4 req/s" in proc.stdout, proc.stdout
        assert "trace replayed at 2.00x its recorded speed" in proc.stdout, proc.stdout
        plain = write_spec(tmp_path, workload={"seed": 0})
        bad = autotune("bench", plain, "--url", url, "--rate", "trace")
    assert bad.returncode == 2
    assert error_line(bad).startswith("error: --rate: 'trace' replays a trace's arrivals")


def test_a_server_that_writes_several_events_at_once_is_read_in_groups_and_timed_exactly(
    tmp_path: Path,
) -> None:
    """With --sim-events-per-write 4 the simulated server writes a stream's chunks four at a time: the client
    reads most gaps as 0 (three in four inside a write; a late read only merges more). Each write reaches
    the socket as one TCP segment, so the raw engine times every chunk of it exactly, with no allowance
    (before segments were counted, the three older chunks of every write carried one: about a quarter of
    the chunks were exact). A client stalled long enough to read two writes at once bounds their chunks
    again, so at least three in four are exact, not all."""
    from autotune.load.client import load_job, run_requests
    from autotune.load.request import RequestSpec

    requests = [RequestSpec(prompt="a " * 100, input_len=100, output_len=64) for _ in range(8)]
    with sim_server(tmp_path, "--sim-events-per-write", "4") as url:
        run = run_requests(load_job(url, MODEL, "completions", requests, [0.02 * i for i in range(8)]))
    assert all(r.success and r.tokens == 64 for r in run.records), [r.error for r in run.records]
    assert run.server_bursts >= 0.6, run.server_bursts
    chunks = [late for r in run.records for late in (r.chunk_late or (0.0,) * r.chunks)]
    assert sum(1 for late in chunks if late == 0.0) >= 0.75 * len(chunks), chunks
