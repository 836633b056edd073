"""The simulated server as a real subprocess over real HTTP: startup log, failures, API, faults."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import pytest

from autotune.sim.server import _WORDS

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

FAST = ["--sim-speedup", "20", "--sim-start-delay", "0.2", "--sim-seed", "1"]
REAL_SSE = Path(__file__).resolve().parents[1] / "vllm" / "fixtures" / "sse_completions_stream.txt"
DEMO = ["Llama-3.1-8B", "--sim-hardware", "RTX-4090-24GB", "--max-model-len", "2048"]


def _merged_tokens(url: str) -> int:
    """How many tokens the simulated server merged into another token's chunk (its writer ran late)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    values = [
        line.rsplit(" ", 1)[1]
        for line in text.splitlines()
        if line.startswith("autotune_sim:merged_tokens_total")
    ]
    assert values, "the simulator reports autotune_sim:merged_tokens_total"
    return int(float(values[0]))


def free_port() -> int:
    """A port that was free a moment ago (bind port 0)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Sim:
    """A running simulated server: its process, port and log file."""

    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text()

    def wait_ready(self, timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log()
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise AssertionError(f"not ready after {timeout}s:\n{self.log()}")

    def wait_exit(self, timeout: float = 15.0) -> int:
        return self.proc.wait(timeout=timeout)


@contextmanager
def launch(tmp_path: Path, *args: str, port: int | None = None) -> Iterator[Sim]:
    """Start ``python -m autotune.sim`` in its own session; SIGKILL its whole group afterwards."""
    port = port or free_port()
    log_path = tmp_path / f"sim-{port}.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "autotune.sim", *args, "--host", "127.0.0.1", "--port", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        yield Sim(proc, port, log_path)
    finally:
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def _events(response: httpx.Response) -> list[str]:
    return [line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")]


def test_start_logs_capacity_and_serves_models_until_sigterm(tmp_path: Path) -> None:
    """A good start logs the capacity facts and 'Application startup complete.', answers /health,
    /v1/models and /version, warns about vLLM flags it does not model, and SIGTERM stops it with status 0
    (within the wait's bound: how fast is a benchmark's question, not a test's)."""
    with launch(tmp_path, *DEMO, *FAST, "--disable-log-stats", "--served-model-name", "demo") as sim:
        sim.wait_ready()
        log = sim.log()
        assert "GPU KV cache size: " in log and "Maximum concurrency for 2,048 tokens per request: " in log
        assert "Available KV cache memory: " in log and "Model loading took 14.9575 GiB memory" in log
        assert "Application startup complete." in log
        assert "WARNING" in log and "--disable-log-stats" in log
        models = httpx.get(f"{sim.url}/v1/models").json()
        assert models["data"][0]["id"] == "demo" and models["data"][0]["max_model_len"] == 2048
        assert httpx.get(f"{sim.url}/version").json()["version"]
        sim.proc.send_signal(signal.SIGTERM)
        assert sim.wait_exit(5) == 0


@pytest.mark.parametrize(
    ("args", "fragment", "status"),
    [
        (["--max-num-batched-tokens", "128"],
         "max_num_batched_tokens (128) must be greater than or equal to max_num_seqs (256).", 1),
        (["--no-enable-chunked-prefill", "--max-num-batched-tokens", "1024"],
         "max_num_batched_tokens (1024) is smaller than max_model_len (2048).", 1),
        (["--gpu-memory-utilization", "1.2"], "Input should be less than or equal to 1", 1),
        (["--block-size", "24"], "ValueError: No valid attention backend found for ", 1),
        (["--kv-cache-dtype", "fp4"], "Invalid kv_cache_dtype: 'fp4'. Valid values are: [", 2),
        (["--gpu-memory-utilization", "0.62"], "No available memory for the cache blocks. Try increasing "
         "`gpu_memory_utilization` when initializing the engine.", 1),
        (["--max-model-len", "131072"], "estimated maximum model length is ", 1),
        (["--bogus-flag", "1"], "vllm: error: unrecognized arguments: --bogus-flag 1", 2),
        (["--max-num-partial-prefills", "2"], "unrecognized arguments: --max-num-partial-prefills 2", 2),
        (["-tp", "3", "--sim-gpus", "4"], "Total number of attention heads (32) must be divisible by "
         "tensor parallel size (3).", 1),
        (["-tp", "2", "--sim-gpus", "1"],
         "World size (2) is larger than the number of available GPUs (1)", 1),
        (["--gpu-memory-utilization", "0.99"],
         "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate ", 1),
    ],
)  # fmt: skip
def test_start_failures_exit_with_vllms_text(
    tmp_path: Path, args: list[str], fragment: str, status: int
) -> None:
    """Each start failure prints vLLM's exact error and exits with its status, never answering /health."""
    base = [a for a in DEMO if a not in ("--max-model-len", "2048")] if "--max-model-len" in args else DEMO
    with launch(tmp_path, *base, *FAST, *args) as sim:
        assert sim.wait_exit() == status
        log = sim.log()
        assert fragment in log
        if status == 1 and "Input should" not in fragment and "max_num_batched_tokens" not in fragment \
                and "Size" not in fragment and "size" not in fragment:  # fmt: skip
            assert "EngineCore failed to start." in log
            assert "RuntimeError: Engine core initialization failed. See root cause above." in log
        assert "Application startup complete." not in log


def test_port_in_use_fails_fast(tmp_path: Path) -> None:
    """A port another process listens on gives 'OSError: [Errno 98] Address already in use', status 1."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = int(taken.getsockname()[1])
        with launch(tmp_path, *DEMO, *FAST, port=port) as sim:
            assert sim.wait_exit() == 1
            assert "OSError: [Errno 98] Address already in use" in sim.log()


def test_streaming_completion_matches_vllms_sse_format(tmp_path: Path) -> None:
    """Streaming completions send one chunk per token (tokens a late writer merged, as the server counts
    them, aside) in real vLLM 0.32's JSON (the captured stream in
    tests/vllm/fixtures: same keys in the same order, no ``usage`` key on content chunks, null
    ``prompt_token_ids``/``token_ids``, ids ``cmpl-<16 hex>``), finish_reason 'length' on the last, then
    the usage chunk with a system_fingerprint and [DONE]; chat streams chat.completion.chunk deltas."""
    real = [json.loads(line[6:]) for line in REAL_SSE.read_text().splitlines() if line.startswith("data: {")]
    real_content, real_usage = real[0], real[-1]
    with launch(tmp_path, *DEMO, *FAST) as sim:
        sim.wait_ready()
        body = {"model": "Llama-3.1-8B", "prompt": "one two three four", "max_tokens": 5, "stream": True,
                "ignore_eos": True, "stream_options": {"include_usage": True}}  # fmt: skip
        with httpx.stream("POST", f"{sim.url}/v1/completions", json=body, timeout=10) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            events = _events(response)
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        # One chunk per token, unless the server's writer ran late on a busy machine and merged tokens
        # into one chunk, as vLLM's output collector does (it counts them): 5 tokens in all either way.
        merged = _merged_tokens(sim.url)
        assert len(chunks) == 6 - merged, (len(chunks), merged)
        content, usage = chunks[:-1], chunks[-1]
        first = content[0]
        assert first["object"] == "text_completion" and re.fullmatch(r"cmpl-[0-9a-f]{16}", first["id"])
        assert first["model"] == "Llama-3.1-8B" and "usage" not in first
        assert list(first) == list(real_content)
        assert list(first["choices"][0]) == list(real_content["choices"][0])
        assert first["choices"] == [
            {"index": 0, "text": first["choices"][0]["text"], "logprobs": None, "finish_reason": None,
             "stop_reason": None, "prompt_token_ids": None, "token_ids": None}
        ]  # fmt: skip
        assert all("usage" not in c for c in content) and len({c["id"] for c in chunks}) == 1
        assert content[-1]["choices"][0]["finish_reason"] == "length"
        assert list(content[-1]["choices"][0]) == list(real[-2]["choices"][0])
        assert usage["choices"] == []
        assert usage["usage"] == {"prompt_tokens": 4, "total_tokens": 9, "completion_tokens": 5}
        assert list(usage) == list(real_usage)
        assert re.fullmatch(r"vllm-[0-9.]+-[0-9a-f]{8}", usage["system_fingerprint"])

        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True,
                "ignore_eos": True}  # fmt: skip
        with httpx.stream("POST", f"{sim.url}/v1/chat/completions", json=chat, timeout=10) as response:
            events = _events(response)
        chunks = [json.loads(e) for e in events[:-1]]
        assert all(c["object"] == "chat.completion.chunk" and "usage" not in c for c in chunks)
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        # 3 tokens, one chunk each unless the writer ran late again and merged some (the count is cumulative).
        chat_merged = _merged_tokens(sim.url) - merged
        finishes = [c["choices"][0]["finish_reason"] for c in chunks[1:]]
        assert finishes == [None] * (2 - chat_merged) + ["length"], (finishes, chat_merged)


def test_concurrent_streams_get_every_token_once_at_the_simulated_pace(tmp_path: Path) -> None:
    """Concurrent streams each receive exactly max_tokens tokens in order (one chunk per token unless the
    writer was late and merged some), and never faster than the simulated step times divided by
    --sim-speedup (decode of one sequence: one weight read per token; a busy host can only be slower)."""
    from concurrent.futures import ThreadPoolExecutor

    from autotune.hardware.catalog import GPUS, MODELS
    from autotune.sim.engine import CostModel

    step = CostModel(MODELS["Llama-3.1-8B"], GPUS["RTX-4090-24GB"]).step_time(1, 1, 100, 100.0, 1)
    with launch(tmp_path, *DEMO, "--sim-speedup", "2", "--sim-start-delay", "0.2") as sim:
        sim.wait_ready()

        def run(n: int) -> tuple[list[str], float]:
            body = {"prompt": "a b c", "max_tokens": n, "stream": True, "ignore_eos": True}
            started = time.monotonic()
            with httpx.stream("POST", f"{sim.url}/v1/completions", json=body, timeout=30) as response:
                chunks = [json.loads(e)["choices"][0]["text"] for e in _events(response)[:-1]]
            assert 0 < len(chunks) <= n
            return "".join(chunks).split(), time.monotonic() - started

        texts, elapsed = run(40)
        assert len(texts) == 40
        assert elapsed > 0.7 * 40 * step / 2
        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(run, [60, 61, 62, 63]))
        assert [len(t) for t, _ in results] == [60, 61, 62, 63]
        assert all(t[:40] == texts for t, _ in results)


def test_late_writer_merges_tokens_into_chunks_with_exact_usage(tmp_path: Path) -> None:
    """A writer that cannot keep up (steps far faster than the host can write 48 streams) merges each
    stream's pending tokens into one chunk, as vLLM's output collector does: fewer chunks than tokens,
    every token's text once and in order, usage exact, the merges counted in
    ``autotune_sim:merged_tokens_total``; autotune's client records it as chunks_per_token < 1 and
    does not call it a mis-parse."""
    import threading

    from autotune.load.client import load_job, run_requests
    from autotune.load.workload import RequestSpec

    with launch(tmp_path, *DEMO, "--sim-speedup", "5000", "--sim-start-delay", "0.2") as sim:
        sim.wait_ready()
        load = [RequestSpec(prompt="a b c", input_len=3, output_len=1500) for _ in range(48)]
        runs = []
        worker = threading.Thread(
            target=lambda: runs.append(run_requests(load_job(sim.url, "m", "completions", load, [0.0] * 48)))
        )
        worker.start()
        time.sleep(0.1)  # the checked stream runs while the load's 48 streams decode
        body = {"prompt": "x y", "max_tokens": 300, "stream": True, "ignore_eos": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        with httpx.stream("POST", f"{sim.url}/v1/completions", json=body, timeout=30) as response:
            chunks = [json.loads(e) for e in _events(response)[:-1]]
        worker.join(60)
        assert not worker.is_alive() and len(runs) == 1, "the 48-stream load did not finish in 60 s"
        run = runs[0]
        text = "".join(c["choices"][0]["text"] for c in chunks[:-1])
        assert chunks[-1]["usage"]["completion_tokens"] == 300
        assert text.split() == "".join(_WORDS[i % len(_WORDS)].decode() for i in range(300)).split()
        assert all(r.success and r.output_tokens == 1500 and 0 < r.chunks <= 1500 for r in run.records)
        assert run.chunks_per_token is not None and run.chunks_per_token < 1.0
        assert not [p for p in run.problems if "content chunks" in p]
        merged = httpx.get(f"{sim.url}/metrics").text.split("autotune_sim:merged_tokens_total{")[1]
        assert float(merged.split("} ")[1].split()[0]) > 0


def test_client_disconnect_aborts_and_sigterm_ends_open_streams(tmp_path: Path) -> None:
    """A client leaving mid-stream aborts its request quietly (no traceback in the log); SIGTERM with
    streams still open stops the server with status 0."""
    from concurrent.futures import ThreadPoolExecutor

    with launch(tmp_path, *DEMO, "--sim-start-delay", "0.2") as sim:
        sim.wait_ready()
        body = {"prompt": "a", "max_tokens": 1000, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", f"{sim.url}/v1/completions", json=body, timeout=10) as response:
            for i, _ in enumerate(response.iter_lines()):
                if i > 10:
                    break
        deadline = time.monotonic() + 5
        while 'finished_reason="abort"} 1.0' not in httpx.get(f"{sim.url}/metrics").text:
            assert time.monotonic() < deadline
            time.sleep(0.05)

        def stream() -> int:
            with httpx.stream("POST", f"{sim.url}/v1/completions", json=body, timeout=10) as response:
                return sum(1 for _ in response.iter_lines())

        with ThreadPoolExecutor(3) as pool:
            futures = [pool.submit(stream) for _ in range(3)]
            deadline = time.monotonic() + 10
            while _counter(httpx.get(f"{sim.url}/metrics").text, "vllm:num_requests_running") < 3:
                assert time.monotonic() < deadline, "the three streams never ran"
                time.sleep(0.05)
            sim.proc.send_signal(signal.SIGTERM)
            assert sim.wait_exit(5) == 0
            for future in futures:
                assert future.result(timeout=30) > 0
        assert "Traceback" not in sim.log()


def test_non_streaming_tokenize_and_length_errors(tmp_path: Path) -> None:
    """Non-streaming responses carry text and usage; /tokenize counts words; too-long prompts get 400;
    without ignore_eos the output length is at most max_tokens."""
    with launch(tmp_path, *DEMO, *FAST) as sim:
        sim.wait_ready()
        body = {"prompt": [1, 2, 3], "max_tokens": 4, "ignore_eos": True}
        reply = httpx.post(f"{sim.url}/v1/completions", json=body, timeout=10)
        assert reply.status_code == 200
        data = reply.json()
        assert data["usage"]["completion_tokens"] == 4 and data["usage"]["prompt_tokens"] == 3
        assert data["choices"][0]["finish_reason"] == "length"
        free = httpx.post(f"{sim.url}/v1/completions", json={"prompt": "a b", "max_tokens": 20}, timeout=10)
        assert 1 <= free.json()["usage"]["completion_tokens"] <= 20
        tok = httpx.post(f"{sim.url}/tokenize", json={"prompt": "a b c"}).json()
        assert tok["count"] == 3 and tok["max_model_len"] == 2048 and len(tok["tokens"]) == 3
        long = httpx.post(f"{sim.url}/v1/completions", json={"prompt": "w " * 3000, "max_tokens": 1})
        assert long.status_code == 400 and "maximum context length is 2048" in long.text


def test_metrics_count_requests_tokens_and_latencies(tmp_path: Path) -> None:
    """/metrics exposes vLLM's gauges, counters, histograms (the per-request ones too) and
    cache_config_info after some traffic, with real vLLM's names and no ``gpu_cache_usage_perc``."""
    with launch(tmp_path, *DEMO, *FAST) as sim:
        sim.wait_ready()
        for _ in range(3):
            httpx.post(f"{sim.url}/v1/completions",
                       json={"prompt": "x y z", "max_tokens": 4, "ignore_eos": True}, timeout=10)  # fmt: skip
        text = httpx.get(f"{sim.url}/metrics").text
        labels = 'engine="0",model_name="Llama-3.1-8B"'
        assert f"vllm:generation_tokens_total{{{labels}}} 12.0" in text
        assert f"vllm:prompt_tokens_total{{{labels}}} 9.0" in text
        assert f'vllm:request_success_total{{{labels},finished_reason="length"}} 3.0' in text
        assert f"vllm:time_to_first_token_seconds_count{{{labels}}} 3.0" in text
        assert f"vllm:inter_token_latency_seconds_count{{{labels}}} 9.0" in text
        assert f"vllm:e2e_request_latency_seconds_count{{{labels}}} 3.0" in text
        assert f"vllm:request_queue_time_seconds_count{{{labels}}} 3.0" in text
        assert f"vllm:iteration_tokens_total_count{{{labels}}} " in text
        assert f"autotune_sim:lag_seconds_total{{{labels}}} " in text
        for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                     "num_preemptions_total"):  # fmt: skip
            assert f"vllm:{name}{{{labels}}} " in text
        for name in ("request_prompt_tokens", "request_generation_tokens", "request_params_max_tokens",
                     "request_time_per_output_token_seconds", "request_inference_time_seconds",
                     "request_prefill_time_seconds", "request_decode_time_seconds",
                     "request_num_preemptions"):  # fmt: skip
            assert f"vllm:{name}_count{{{labels}}} 3.0" in text, name
        assert f"vllm:request_generation_tokens_sum{{{labels}}} 12.0" in text
        assert f'vllm:num_requests_waiting_by_reason{{{labels},reason="capacity"}} 0.0' in text
        assert f"vllm:prefix_cache_queries_total{{{labels}}} 9.0" in text
        assert f"vllm:prefix_cache_hits_total{{{labels}}} 0.0" in text
        assert f'vllm:request_success_total{{{labels},finished_reason="repetition"}} 0.0' in text
        assert "gpu_cache_usage_perc" not in text and "_created{" not in text
        assert 'vllm:cache_config_info{_block_size_resolved="True",_extensible_kv_cache_resolved="True",' \
            'block_size="16",cache_dtype="auto"' in text  # fmt: skip
        assert "kv_cache_size_tokens=" in text and "num_gpu_blocks=" in text


def test_hang_at_start_never_becomes_healthy(tmp_path: Path) -> None:
    """--sim-hang-at-start keeps the process alive without ever answering /health 200."""
    with launch(tmp_path, *DEMO, *FAST, "--sim-hang-at-start") as sim:
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            with pytest.raises(httpx.ConnectError):  # connection refused, as real vLLM before it is ready
                httpx.get(f"{sim.url}/health", timeout=0.5)
            time.sleep(0.1)
        assert sim.proc.poll() is None


def test_slow_start_delays_readiness(tmp_path: Path) -> None:
    """--sim-slow-start adds wall seconds before the server is ready."""
    with launch(tmp_path, *DEMO, *FAST, "--sim-slow-start", "1.0") as sim:
        started = time.monotonic()
        sim.wait_ready()
        assert time.monotonic() - started >= 0.9


def test_engine_death_after_n_requests(tmp_path: Path) -> None:
    """--sim-die-after-requests N: after N admitted requests the engine dies with vLLM's log; a stream in
    flight gets an error event, waiting and new requests get HTTP 500, /health answers 503, and the
    process exits 0 about a second later."""
    with launch(tmp_path, *DEMO, *FAST, "--sim-die-after-requests", "2") as sim:
        sim.wait_ready()
        body = {"prompt": "x", "max_tokens": 1000, "ignore_eos": True}
        with httpx.Client(timeout=10) as client:
            with client.stream("POST", f"{sim.url}/v1/completions", json={**body, "stream": True}) as stream:
                lines = stream.iter_lines()
                assert next(line for line in lines if line.startswith("data: ")).startswith('data: {"id"')
                second = httpx.post(f"{sim.url}/v1/completions", json=body, timeout=10)
                rest = [line for line in lines if line.startswith("data: ")]
            assert second.status_code == 500 and "EngineCore encountered an issue" in second.text
            assert rest[-1] == "data: [DONE]" and '"error"' in rest[-2]
            assert client.get(f"{sim.url}/health").status_code == 503
            assert client.post(f"{sim.url}/v1/completions", json=body).status_code == 500
        assert sim.wait_exit(5) == 0
        log = sim.log()
        assert "EngineCore encountered a fatal error." in log and "EngineDeadError" in log


def test_ignore_sigterm_needs_sigkill(tmp_path: Path) -> None:
    """--sim-ignore-sigterm logs and ignores SIGTERM; the process only stops on SIGKILL."""
    with launch(tmp_path, *DEMO, *FAST, "--sim-ignore-sigterm") as sim:
        sim.wait_ready()
        sim.proc.send_signal(signal.SIGTERM)
        time.sleep(1.0)
        assert sim.proc.poll() is None
        assert httpx.get(f"{sim.url}/health").status_code == 200
        assert "SIGTERM" in sim.log()
        sim.proc.kill()
        assert sim.wait_exit(5) == -signal.SIGKILL


def test_orphan_child_survives_the_parent_but_not_a_group_kill(tmp_path: Path) -> None:
    """--sim-orphan-child spawns a VLLM::EngineCore process in the server's process group that outlives
    a SIGKILL of the parent alone and dies with a kill of the whole group."""
    with launch(tmp_path, *DEMO, *FAST, "--sim-orphan-child") as sim:
        sim.wait_ready()
        children = psutil.Process(sim.proc.pid).children()
        assert len(children) == 1
        child = children[0]
        assert child.cmdline()[0] == "VLLM::EngineCore"
        assert os.getpgid(child.pid) == os.getpgid(sim.proc.pid) == sim.proc.pid
        sim.proc.kill()
        sim.wait_exit(5)
        time.sleep(0.2)
        assert child.is_running() and child.status() != psutil.STATUS_ZOMBIE
        os.killpg(sim.proc.pid, signal.SIGKILL)
        child.wait(timeout=5)
        assert not child.is_running()


def test_help_prints_usage_and_exits_zero() -> None:
    """`python -m autotune.sim --help` shows the usage, like `vllm serve --help`, and exits 0."""
    result = subprocess.run(
        [sys.executable, "-m", "autotune.sim", "--help"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0
    assert "--max-num-seqs" in result.stdout and "--sim-hardware" in result.stdout


def _ttft(client: httpx.Client, url: str, prompt: str) -> float:
    """Seconds from sending a streaming completion to its first token chunk. The client is made before
    the clock starts: a new one per request (``httpx.stream``) builds a TLS context, tens of milliseconds
    on a busy machine, which would swamp the prefill being compared."""
    body = {"prompt": prompt, "max_tokens": 2, "stream": True, "ignore_eos": True}
    started = time.monotonic()
    first = -1.0
    with client.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if first < 0 and line.startswith("data: {"):
                first = time.monotonic() - started
    return first


def _counter(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def test_shared_prefix_prompts_hit_the_prefix_cache_over_http(tmp_path: Path) -> None:
    """Prompts that share a 1,600-word text prefix are tokenized by the server into shared token ids: with
    prefix caching (vLLM's default) later requests reuse the cached blocks, get a much lower TTFT than
    with --no-enable-prefix-caching, and vllm:prefix_cache_hits_total counts the reused tokens. The server
    runs at half speed and the fastest warm TTFTs are compared: a busy host only adds to a TTFT, so it
    would have to delay every warm request by about the whole prefill to change the verdict."""
    shared = " ".join(f"w{i}" for i in range(1600))
    prompts = [f"{shared} " + " ".join(f"q{n}x{i}" for i in range(40)) for n in range(6)]
    ttft: dict[bool, list[float]] = {}
    for caching in (True, False):
        args = [] if caching else ["--no-enable-prefix-caching"]
        with launch(tmp_path, *DEMO, "--sim-speedup", "0.5", "--sim-start-delay", "0.2", *args) as sim:
            sim.wait_ready()
            with httpx.Client() as client:
                ttft[caching] = [_ttft(client, sim.url, p) for p in prompts]
            metrics = httpx.get(f"{sim.url}/metrics").text
            hits = _counter(metrics, "vllm:prefix_cache_hits_total")
            queries = _counter(metrics, "vllm:prefix_cache_queries_total")
        if caching:
            assert hits == 5 * 100 * 16  # 100 full blocks of the shared 1,600 tokens, 5 warm requests
            assert queries == 6 * 1640
        else:
            assert hits == queries == 0
    assert min(ttft[True][1:]) < 0.5 * min(ttft[False][1:]), ttft


def test_api_key_guards_v1_over_http(tmp_path: Path) -> None:
    """--api-key: /v1/models without the key is 401 {"error":"Unauthorized"}, /health is 200 without
    it, and completions work with Authorization: Bearer <key>."""
    with launch(tmp_path, *DEMO, *FAST, "--api-key", "sekret") as sim:
        sim.wait_ready()
        denied = httpx.get(f"{sim.url}/v1/models")
        assert denied.status_code == 401 and denied.json() == {"error": "Unauthorized"}
        assert httpx.get(f"{sim.url}/health").status_code == 200
        auth = {"Authorization": "Bearer sekret"}
        assert httpx.get(f"{sim.url}/v1/models", headers=auth).status_code == 200
        body = {"prompt": "a b", "max_tokens": 3, "ignore_eos": True}
        reply = httpx.post(f"{sim.url}/v1/completions", json=body, headers=auth, timeout=10)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 3
        assert "'api_key': '***'" in sim.log() and "sekret" not in sim.log()


def test_start_log_reports_the_resolved_config(tmp_path: Path) -> None:
    """The start-up log has vLLM's non-default args line and engine-config line, and the simulator's
    effective-config line, with the values used for flags that were not given."""
    with launch(tmp_path, *DEMO, *FAST, "--max-num-seqs", "64") as sim:
        sim.wait_ready()
        log = sim.log()
    expected = (
        r"non-default args: \{'model_tag': 'Llama-3\.1-8B', 'host': '127\.0\.0\.1', 'port': \d+, "
        r"'model': 'Llama-3\.1-8B', 'max_model_len': 2048, 'max_num_seqs': 64\}"
    )
    assert re.search(expected, log)
    engine = next(line for line in log.splitlines() if "Initializing a V1 LLM engine (v0.34.0)" in line)
    assert "enable_prefix_caching=True, enable_chunked_prefill=True" in engine
    assert "tensor_parallel_size=1, pipeline_parallel_size=1, data_parallel_size=1" in engine
    effective = next(line for line in log.splitlines() if "autotune.sim effective config: " in line)
    assert "'block_size': 16, 'max_num_seqs': 64, 'max_num_batched_tokens': 2048" in effective
