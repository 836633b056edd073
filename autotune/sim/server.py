"""The simulated ``vllm serve``: startup log, OpenAI-compatible HTTP API and the engine loop.

The engine loop runs the shared scheduler (:mod:`autotune.sim.engine`) and sleeps until each step's
end in wall time (``step time / --sim-speedup``); tokens of a step are delivered when it ends.
Streaming chunks are pre-formatted byte templates around the changing text, so a chunk costs a few
microseconds of server CPU. Like vLLM's ``RequestOutputCollector``, a writer that falls behind (the loop
wakes more than :data:`MERGE_LATE_S` after a step's end) merges a stream's pending tokens into one chunk
when it catches up, instead of writing one late chunk per token; usage counts stay exact. The SSE shape is
that of vLLM 0.32's (tests/vllm/fixtures/sse_completions_stream.txt): content chunks carry no ``usage``
key, completion choices carry ``prompt_token_ids``/``token_ids`` (null), ids are ``cmpl-<16 hex>``.

Tokenisation is a documented toy: a prompt string has one token per whitespace-separated word, a list of
ints is taken as token ids, and a chat request counts each message's words + 4, plus 3. Without
``ignore_eos`` the output length is drawn uniformly from [max(1, min_tokens), max_tokens] with the
seeded RNG (finish_reason ``stop`` when below max_tokens).
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import zlib
from collections.abc import Awaitable, Callable
from typing import Any, TextIO

from aiohttp import web

from autotune.catalog import ModelArch
from autotune.sim.engine import Engine, Request
from autotune.sim.flags import ServeFlags
from autotune.sim.startup import LogEvent, StartupPlan

VLLM_VERSION = "0.34.0"
_VOCAB = (
    "the of and to in is that for it as was with be by on not he this are or his from at "
    "which but have an they you were her she there one all we their has been would more"
)
_WORDS = [f" {w}".encode() for w in _VOCAB.split()]
_DEATH_MESSAGE = "EngineCore encountered an issue. See stack trace (above) for the root cause."
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
MAX_DEBT_S = 0.005
"""How far (wall seconds) the engine loop may run behind its schedule and still catch up."""
MERGE_LATE_S = 0.002
"""A step delivered this late (wall seconds) or later is held back and merged into the next chunk."""
MAX_HOLD_S = 0.01
"""A late writer still writes held-back tokens (merged) at least this often (wall seconds)."""
TOKEN_COUNT_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0)
PREEMPTION_BUCKETS = (1.0, 2.0, 3.0, 4.0, 5.0, 10.0, 20.0)
_FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")


def _request_id(rid: int) -> str:
    """16 hex digits that look random but follow from the request number (vLLM 0.32: ``cmpl-<16 hex>``)."""
    return f"{(rid + 1) * 0x9E3779B97F4A7C15 % (1 << 64):016x}"


def _text(first: int, end: int) -> bytes:
    """The text of output tokens ``first`` .. ``end - 1`` (one word per token)."""
    words = _WORDS
    n = len(words)
    return b"".join(words[i % n] for i in range(first, end))


class Log:
    """vLLM-style log lines (``INFO 12-02 14:00:00 [file.py:123] text``) to a text stream."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def __call__(self, level: str, source: str, text: str) -> None:
        """Write one record; a multi-line text repeats the prefix like vLLM's logger does."""
        if not level:
            self._stream.write(text + "\n")
        else:
            stamp = time.strftime("%m-%d %H:%M:%S")
            prefix = f"{level} {stamp} [{source}] "
            self._stream.write("".join(prefix + line + "\n" for line in text.splitlines()))
        self._stream.flush()

    def event(self, event: LogEvent) -> None:
        """Write a startup event."""
        self(event.level, event.source, event.text)


class Histogram:
    """A Prometheus histogram with fixed buckets."""

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.total = 0.0
        self.n = 0

    def observe(self, value: float) -> None:
        """Record one observation."""
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.n += 1

    def render(self, name: str, labels: str, help_text: str) -> str:
        """Prometheus text exposition of this histogram."""
        lines = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        cumulative = 0
        for bound, count in zip(self.buckets, self.counts, strict=False):
            cumulative += count
            lines.append(f'{name}_bucket{{{labels},le="{bound}"}} {float(cumulative)}')
        lines.append(f'{name}_bucket{{{labels},le="+Inf"}} {float(self.n)}')
        lines.append(f"{name}_count{{{labels}}} {float(self.n)}")
        lines.append(f"{name}_sum{{{labels}}} {self.total}")
        return "\n".join(lines)


class _Stream:
    """Per-request delivery state between the engine loop and the HTTP handler."""

    __slots__ = (
        "arrival",
        "delivered",
        "done",
        "error",
        "first",
        "last",
        "max_tokens",
        "mid",
        "pre",
        "scheduled",
        "sent",
        "transport",
        "waiter",
    )

    def __init__(self, arrival: float, max_tokens: int) -> None:
        self.waiter: asyncio.Future[None] | None = None
        self.transport: asyncio.Transport | None = None
        """Set once the response is streaming: the engine loop then writes token chunks itself."""
        self.pre = b""
        self.mid = b""
        self.error = False
        self.sent = 0
        self.delivered = 0
        """Tokens whose step has ended in wall time (the engine's counters run one step ahead)."""
        self.done = False
        self.arrival = arrival
        self.first = -1.0
        self.last = -1.0
        self.scheduled = -1.0
        """When the engine first scheduled the request (its queueing ended)."""
        self.max_tokens = max_tokens


def _wake(stream: _Stream) -> None:
    waiter = stream.waiter
    if waiter is not None and not waiter.done():
        waiter.set_result(None)


def _json(body: object, status: int = 200) -> web.Response:
    """A JSON response in vLLM's compact form."""
    return web.Response(
        text=json.dumps(body, separators=(",", ":")), status=status, content_type="application/json"
    )


def _error_body(message: str, kind: str, code: int) -> web.Response:
    body = {"error": {"message": message, "type": kind, "param": None, "code": code}}
    return _json(body, status=code)


class SimServer:
    """One simulated vLLM server process (its HTTP app, engine loop, faults and shutdown)."""

    def __init__(
        self,
        flags: ServeFlags,
        arch: ModelArch,
        plan: StartupPlan,
        engine: Engine,
        log: Log,
        rng: random.Random,
    ) -> None:
        self.flags = flags
        self.arch = arch
        self.plan = plan
        self.engine = engine
        self.log = log
        self.rng = rng
        self.name = flags.name
        self.max_model_len = plan.max_model_len
        self.dead = False
        self.stopping = asyncio.Event()
        self._wake = asyncio.Event()
        self._next_id = 0
        self._admitted = 0
        self._die_pending = False
        self.exit_code = 0
        self._loop = asyncio.get_running_loop()
        self.created = int(time.time())
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.queue = Histogram(E2E_BUCKETS)
        self.iteration = Histogram(tuple(float(b) for b in ITERATION_BUCKETS))
        self.tpot = Histogram(ITL_BUCKETS)
        self.inference = Histogram(E2E_BUCKETS)
        self.prefill = Histogram(E2E_BUCKETS)
        self.decode = Histogram(E2E_BUCKETS)
        self.prompt_hist = Histogram(TOKEN_COUNT_BUCKETS)
        self.generation_hist = Histogram(TOKEN_COUNT_BUCKETS)
        self.max_tokens_hist = Histogram(TOKEN_COUNT_BUCKETS)
        self.preemption_hist = Histogram(PREEMPTION_BUCKETS)
        self.prefix_queries = 0
        self.lag_s = 0.0
        """Wall seconds the engine loop fell behind its schedule beyond MAX_DEBT_S (host CPU too slow)."""
        self.merged = 0
        """Tokens that were merged into another token's chunk because the writer was late."""
        self._behind: set[_Stream] = set()
        """Streams with tokens held back by a late writer (flushed, merged, when it is on time again)."""
        self._held_since = 0.0
        self.fingerprint = f"vllm-{VLLM_VERSION}-{zlib.crc32(repr(flags).encode()):08x}"
        self.success: dict[str, int] = dict.fromkeys(_FINISH_REASONS, 0)

    # ---- application -------------------------------------------------------------------------
    def app(self) -> web.Application:
        """The aiohttp application with vLLM's routes."""
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/version", self.version)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        return app

    async def health(self, _: web.Request) -> web.Response:
        """200 while the engine lives, 503 after it died."""
        return web.Response(status=503 if self.dead else 200)

    async def version(self, _: web.Request) -> web.Response:
        """The emulated vLLM version."""
        return _json({"version": VLLM_VERSION})

    async def models(self, _: web.Request) -> web.Response:
        """The served model with its max_model_len."""
        card = {
            "id": self.name,
            "object": "model",
            "created": self.created,
            "owned_by": "vllm",
            "root": self.flags.model,
            "parent": None,
            "max_model_len": self.max_model_len,
            "permission": [],
        }
        return _json({"object": "list", "data": [card]})

    def _token_ids(self, prompt: object) -> list[int] | None:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        if isinstance(prompt, str):
            vocab = self.arch.vocab_size
            return [zlib.crc32(w.encode()) % vocab for w in prompt.split()]
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return list(prompt)
        return None

    def _chat_tokens(self, messages: object) -> list[int] | None:
        if not isinstance(messages, list):
            return None
        ids: list[int] = []
        for message in messages:
            if not isinstance(message, dict):
                return None
            content = message.get("content", "")
            if isinstance(content, list):  # OpenAI content parts
                content = " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
            words = self._token_ids(str(content or ""))
            ids += [1, 2, 3, 4] + (words or [])
        return [*ids, 5, 6, 7]

    async def tokenize(self, request: web.Request) -> web.Response:
        """``{"count", "max_model_len", "tokens"}`` for a prompt or chat messages."""
        try:
            body = await request.json()
        except json.JSONDecodeError:
            return _error_body("Invalid JSON body", "BadRequestError", 400)
        if not isinstance(body, dict):
            return _error_body("Request body must be an object", "BadRequestError", 400)
        if "messages" in body:
            ids = self._chat_tokens(body["messages"])
        else:
            ids = self._token_ids(body.get("prompt"))
        if ids is None:
            return _error_body("prompt must be a string or a list of token ids",
                               "BadRequestError", 400)  # fmt: skip
        return _json(
            {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids,
             "token_strs": None}
        )  # fmt: skip

    async def metrics(self, _: web.Request) -> web.Response:
        """Prometheus text with vLLM's metric names."""
        e = self.engine
        labels = f'engine="0",model_name="{self.name}"'
        memory = self.plan.memory
        assert memory is not None
        info = (
            f'block_size="{self.flags.block_size}",cache_dtype="{self.flags.kv_cache_dtype}",'
            f'enable_prefix_caching="False",engine="0",'
            f'gpu_memory_utilization="{self.flags.gpu_memory_utilization}",'
            f'kv_cache_max_concurrency="{memory.max_concurrency:.2f}",'
            f'kv_cache_size_tokens="{memory.kv_tokens}",num_gpu_blocks="{memory.num_blocks}"'
        )
        parts = [
            "# HELP vllm:num_requests_running Number of requests in model execution batches.",
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{{{labels}}} {float(len(e.running))}",
            "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{{{labels}}} {float(len(e.waiting))}",
            "# HELP vllm:num_requests_waiting_by_reason Number of waiting requests by reason. Reason "
            "labels: 'capacity' = waiting for scheduling capacity; 'deferred' = deferred by transient "
            "constraints (LoRA budget, KV transfer, blocked status). Sum of all reasons equals "
            "vllm:num_requests_waiting.",
            "# TYPE vllm:num_requests_waiting_by_reason gauge",
            f'vllm:num_requests_waiting_by_reason{{{labels},reason="capacity"}} {float(len(e.waiting))}',
            f'vllm:num_requests_waiting_by_reason{{{labels},reason="deferred"}} 0.0',
            "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.",
            "# TYPE vllm:kv_cache_usage_perc gauge",
            f"vllm:kv_cache_usage_perc{{{labels}}} {e.kv_usage}",
            "# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried "
            "tokens.",
            "# TYPE vllm:prefix_cache_queries_total counter",
            f"vllm:prefix_cache_queries_total{{{labels}}} {float(self.prefix_queries)}",
            "# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.",
            "# TYPE vllm:prefix_cache_hits_total counter",
            f"vllm:prefix_cache_hits_total{{{labels}}} 0.0",
            "# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.",
            "# TYPE vllm:num_preemptions_total counter",
            f"vllm:num_preemptions_total{{{labels}}} {float(e.num_preemptions)}",
            "# HELP vllm:prompt_tokens_total Number of prefill tokens processed.",
            "# TYPE vllm:prompt_tokens_total counter",
            f"vllm:prompt_tokens_total{{{labels}}} {float(e.prompt_tokens)}",
            "# HELP vllm:prompt_tokens_cached_total Number of cached prompt tokens (local + external).",
            "# TYPE vllm:prompt_tokens_cached_total counter",
            f"vllm:prompt_tokens_cached_total{{{labels}}} 0.0",
            "# HELP vllm:generation_tokens_total Number of generation tokens processed.",
            "# TYPE vllm:generation_tokens_total counter",
            f"vllm:generation_tokens_total{{{labels}}} {float(e.generation_tokens)}",
            "# HELP vllm:request_success_total Count of successfully processed requests.",
            "# TYPE vllm:request_success_total counter",
            *(
                f'vllm:request_success_total{{{labels},finished_reason="{reason}"}} {float(n)}'
                for reason, n in self.success.items()
            ),
            self.ttft.render("vllm:time_to_first_token_seconds", labels,
                             "Histogram of time to first token in seconds."),
            self.itl.render("vllm:inter_token_latency_seconds", labels,
                            "Histogram of inter-token latency in seconds."),
            self.e2e.render("vllm:e2e_request_latency_seconds", labels,
                            "Histogram of e2e request latency in seconds."),
            self.queue.render("vllm:request_queue_time_seconds", labels,
                              "Histogram of time spent in WAITING phase for request."),
            self.iteration.render("vllm:iteration_tokens_total", labels,
                                  "Histogram of number of tokens per engine_step."),
            self.prompt_hist.render("vllm:request_prompt_tokens", labels,
                                    "Number of prefill tokens processed."),
            self.generation_hist.render("vllm:request_generation_tokens", labels,
                                        "Number of generation tokens processed."),
            self.max_tokens_hist.render("vllm:request_params_max_tokens", labels,
                                        "Histogram of the max_tokens request parameter."),
            self.tpot.render("vllm:request_time_per_output_token_seconds", labels,
                             "Histogram of time_per_output_token_seconds per request."),
            self.inference.render("vllm:request_inference_time_seconds", labels,
                                  "Histogram of time spent in RUNNING phase for request."),
            self.prefill.render("vllm:request_prefill_time_seconds", labels,
                                "Histogram of time spent in PREFILL phase for request."),
            self.decode.render("vllm:request_decode_time_seconds", labels,
                               "Histogram of time spent in DECODE phase for request."),
            self.preemption_hist.render("vllm:request_num_preemptions", labels,
                                        "Histogram of the number of times a request was preempted."),
            "# HELP autotune_sim:lag_seconds_total Wall seconds the simulated engine ran behind its "
            "schedule (a host too slow for the load makes every latency longer).",
            "# TYPE autotune_sim:lag_seconds_total counter",
            f"autotune_sim:lag_seconds_total{{{labels}}} {self.lag_s}",
            "# HELP autotune_sim:merged_tokens_total Tokens sent inside another token's chunk because "
            "the writer was late (as vLLM's output collector merges them).",
            "# TYPE autotune_sim:merged_tokens_total counter",
            f"autotune_sim:merged_tokens_total{{{labels}}} {float(self.merged)}",
            "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
            "# TYPE vllm:cache_config_info gauge",
            f"vllm:cache_config_info{{{info}}} 1.0",
        ]  # fmt: skip
        return web.Response(text="\n".join(parts) + "\n", content_type="text/plain")

    # ---- generation ----------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/completions`` (streaming or not)."""
        return await self._generate(request, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/chat/completions`` (streaming or not)."""
        return await self._generate(request, chat=True)

    def _dead_response(self) -> web.Response:
        return _error_body(_DEATH_MESSAGE, "InternalServerError", 500)

    async def _generate(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        if self.dead:
            return self._dead_response()
        try:
            body = await request.json()
        except json.JSONDecodeError:
            return _error_body("Invalid JSON body", "BadRequestError", 400)
        if not isinstance(body, dict):
            return _error_body("Request body must be an object", "BadRequestError", 400)
        ids = self._chat_tokens(body.get("messages")) if chat else self._token_ids(body.get("prompt"))
        if not ids:
            what = "messages" if chat else "prompt"
            return _error_body(f"{what} must be a non-empty string or list of token ids",
                               "BadRequestError", 400)  # fmt: skip
        prompt_len = len(ids)
        mml = self.max_model_len
        if prompt_len > mml:
            return _error_body(
                f"This model's maximum context length is {mml} tokens. However, your request has "
                f"{prompt_len} input tokens. Please reduce the length of the input messages.",
                "BadRequestError", 400)  # fmt: skip
        max_tokens = body.get("max_completion_tokens") if chat else None
        if max_tokens is None:
            max_tokens = body.get("max_tokens")
        if max_tokens is None:
            max_tokens = mml - prompt_len
        if not isinstance(max_tokens, int) or max_tokens < 1:
            return _error_body(f"max_tokens must be at least 1, got {max_tokens}.",
                               "BadRequestError", 400)  # fmt: skip
        if prompt_len + max_tokens > mml:
            return _error_body(
                f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's "
                f"maximum context length is {mml} tokens and your request has {prompt_len} input "
                f"tokens ({max_tokens} > {mml} - {prompt_len}).",
                "BadRequestError", 400)  # fmt: skip
        min_tokens = body.get("min_tokens") or 0
        if not isinstance(min_tokens, int) or min_tokens < 0 or min_tokens > max_tokens:
            return _error_body(f"min_tokens must be in [0, max_tokens], got {min_tokens}.",
                               "BadRequestError", 400)  # fmt: skip
        if body.get("ignore_eos"):
            output_len = max_tokens
        else:
            output_len = self.rng.randint(max(1, min_tokens), max_tokens)
        stream_opts = body.get("stream_options") or {}
        include_usage = bool(isinstance(stream_opts, dict) and stream_opts.get("include_usage"))

        rid = self._next_id
        self._next_id += 1
        req = Request(rid, prompt_len, output_len)
        state = _Stream(self._loop.time(), max_tokens)
        req.tag = state
        self._admitted += 1
        limit = self.flags.die_after_requests
        if limit is not None and self._admitted >= limit:
            self._die_pending = True
        self.engine.add(req)
        self._wake.set()
        try:
            if body.get("stream"):
                return await self._stream(request, req, state, chat=chat, usage=include_usage)
            return await self._complete(req, state, chat=chat)
        except asyncio.CancelledError:
            self._abort(req)
            raise

    def _abort(self, req: Request) -> None:
        """The client went away: drop the request from the engine."""
        self.engine.abort(req)
        if not req.finished:
            self.success["abort"] += 1

    async def _wait(self, state: _Stream) -> None:
        state.waiter = self._loop.create_future()
        await state.waiter
        state.waiter = None

    def _finish_reason(self, req: Request, state: _Stream) -> str:
        return "length" if req.output_len >= state.max_tokens else "stop"

    async def _complete(self, req: Request, state: _Stream, *, chat: bool) -> web.Response:
        while not state.done and not state.error:
            await self._wait(state)
        if state.error:
            return self._dead_response()
        text = b"".join(_WORDS[i % len(_WORDS)] for i in range(req.output_len)).decode()
        reason = self._finish_reason(req, state)
        usage = {"prompt_tokens": req.prompt_len, "total_tokens": req.prompt_len + req.output_len,
                 "completion_tokens": req.output_len, "prompt_tokens_details": None}  # fmt: skip
        if chat:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": text, "tool_calls": []},
                "logprobs": None, "finish_reason": reason, "stop_reason": None,
            }  # fmt: skip
            kind, prefix = "chat.completion", "chatcmpl"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason,
                      "stop_reason": None, "prompt_logprobs": None}  # fmt: skip
            kind, prefix = "text_completion", "cmpl"
        body = {"id": f"{prefix}-{_request_id(req.rid)}", "object": kind, "created": int(time.time()),
                "model": self.name, "choices": [choice], "usage": usage}  # fmt: skip
        return _json(body)

    async def _stream(
        self, request: web.Request, req: Request, state: _Stream, *, chat: bool, usage: bool
    ) -> web.StreamResponse:
        created = int(time.time())
        name = json.dumps(self.name)
        rid = _request_id(req.rid)
        if chat:
            head = (f'data: {{"id":"chatcmpl-{rid}","object":"chat.completion.chunk",'
                    f'"created":{created},"model":{name},"choices":')  # fmt: skip
            pre = (head + '[{"index":0,"delta":{"content":"').encode()
            mid = b'"},"logprobs":null,"finish_reason":null}]}\n\n'
            end = '"}},"logprobs":null,"finish_reason":"{}","stop_reason":null}}]}}\n\n'
            role = (head + '[{"index":0,"delta":{"role":"assistant","content":""},'
                    '"logprobs":null,"finish_reason":null}]}\n\n').encode()  # fmt: skip
            fingerprint = ""
        else:
            head = (f'data: {{"id":"cmpl-{rid}","object":"text_completion",'
                    f'"created":{created},"model":{name},"choices":')  # fmt: skip
            pre = (head + '[{"index":0,"text":"').encode()
            mid = (b'","logprobs":null,"finish_reason":null,"stop_reason":null,"prompt_token_ids":null,'
                   b'"token_ids":null}]}\n\n')  # fmt: skip
            end = ('","logprobs":null,"finish_reason":"{}","stop_reason":null,"prompt_token_ids":null,'
                   '"token_ids":null}}]}}\n\n')  # fmt: skip
            role = b""
            fingerprint = f',"system_fingerprint":"{self.fingerprint}"'
        response: web.StreamResponse | None = None
        try:
            while True:
                await self._wait(state)
                if state.error:
                    if response is None:
                        return self._dead_response()
                    err = {"error": {"message": _DEATH_MESSAGE, "type": "InternalServerError",
                                     "param": None, "code": 500}}  # fmt: skip
                    await response.write(
                        f"data: {json.dumps(err, separators=(',', ':'))}\n\ndata: [DONE]\n\n".encode()
                    )
                    return response
                if response is None:
                    response = web.StreamResponse(
                        headers={"Content-Type": "text/event-stream; charset=utf-8"}
                    )
                    await response.prepare(request)
                    out = [role] if role else []
                else:
                    out = []
                # Tokens not yet written (one, unless this task or the engine loop was late) go out
                # merged into one chunk, as vLLM's output collector merges them.
                upto = state.delivered
                sent = state.sent
                if upto - sent > 1:
                    self.merged += upto - sent - 1
                if state.done:
                    reason = self._finish_reason(req, state)
                    out.append(pre + _text(sent, upto) + end.format(reason).encode())
                    if usage:
                        c = req.output_len
                        out.append(
                            (head + f'[],"usage":{{"prompt_tokens":{req.prompt_len},"total_tokens":'
                             f'{req.prompt_len + c},"completion_tokens":{c}}}{fingerprint}}}\n\n').encode()
                        )  # fmt: skip
                    out.append(b"data: [DONE]\n\n")
                    await response.write(b"".join(out))
                    await response.write_eof()
                    return response
                if upto > sent:
                    out.append(pre + _text(sent, upto) + mid)
                state.sent = upto
                if out:
                    await response.write(b"".join(out))
                transport = request.transport
                if transport is not None and not transport.is_closing():
                    # From here on the engine loop frames and writes each token chunk directly (HTTP/1.1
                    # chunked encoding, as aiohttp's writer does) and wakes this task only at the end.
                    state.pre, state.mid = pre, mid
                    state.transport = transport
        except ConnectionResetError:  # the client went away (aiohttp's ClientConnectionResetError)
            self._abort(req)
            return response if response is not None else web.Response(status=499)

    # ---- engine loop ---------------------------------------------------------------------------
    async def engine_loop(self) -> None:
        """Step the engine in wall time until stopped or dead."""
        loop = self._loop
        engine = self.engine
        speedup = self.flags.speedup
        words = _WORDS
        nwords = len(words)
        target = loop.time()
        while not self.dead:
            if not engine.has_work():
                self._wake.clear()
                await self._wake.wait()
                target = loop.time()
                continue
            result = engine.step()
            if result.scheduled_tokens == 0:
                self._wake.clear()
                await self._wake.wait()
                target = loop.time()
                continue
            now = loop.time()
            for req in result.started:
                state = req.tag
                assert isinstance(state, _Stream)
                state.scheduled = now
                self.prefix_queries += req.prompt_len
                self.queue.observe(max(0.0, now - state.arrival))
            self.iteration.observe(result.scheduled_tokens)
            # Steps follow a schedule (end of previous step + duration / speedup), so the time spent
            # delivering tokens does not stretch simulated time; a loop more than MAX_DEBT_S late
            # gives up catching up and counts the difference as lag.
            if target < now - MAX_DEBT_S:
                self.lag_s += now - MAX_DEBT_S - target
                target = now - MAX_DEBT_S
            target += result.duration / speedup
            delay = target - loop.time()
            await asyncio.sleep(delay if delay > 0 else 0)
            now = loop.time()
            late = now - target > MERGE_LATE_S
            behind = self._behind
            for req in result.emitted:
                state = req.tag
                assert isinstance(state, _Stream)
                if state.first < 0:
                    state.first = now
                    self.ttft.observe(now - state.arrival)
                else:
                    self.itl.observe(now - state.last)
                state.last = now
                state.delivered += 1
                finished = state.delivered >= req.output_len
                state.done = finished
                transport = state.transport
                if transport is not None and not finished and not transport.is_closing():
                    if late:  # hold the token back: merged into this stream's next chunk
                        if not behind:
                            self._held_since = now
                        behind.add(state)
                        continue
                    i = state.sent
                    n = state.delivered
                    if n - i == 1:
                        data = state.pre + words[i % nwords] + state.mid
                    else:
                        self.merged += n - i - 1
                        data = state.pre + _text(i, n) + state.mid
                    transport.write(b"%x\r\n%b\r\n" % (len(data), data))
                    state.sent = n
                else:
                    _wake(state)
            if behind and (not late or now - self._held_since >= MAX_HOLD_S):
                self._flush_behind()
            for req in result.finished:
                state = req.tag
                assert isinstance(state, _Stream)
                self._observe_finished(req, state, now)
            if self._die_pending:
                self.die()

    def _flush_behind(self) -> None:
        """Write each held-back stream's pending tokens as one merged chunk."""
        for state in self._behind:
            transport = state.transport
            i = state.sent
            n = state.delivered
            if state.done or state.error or transport is None or transport.is_closing() or n <= i:
                continue  # a finished stream's handler writes the rest itself
            self.merged += n - i - 1
            data = state.pre + _text(i, n) + state.mid
            transport.write(b"%x\r\n%b\r\n" % (len(data), data))
            state.sent = n
        self._behind.clear()

    def _observe_finished(self, req: Request, state: _Stream, now: float) -> None:
        """Per-request histograms and the success counter at the end of a request."""
        self.e2e.observe(now - state.arrival)
        self.success[self._finish_reason(req, state)] += 1
        if req.output_len > 1 and state.first >= 0:
            self.tpot.observe((now - state.first) / (req.output_len - 1))
        scheduled = state.scheduled if state.scheduled >= 0 else state.arrival
        self.inference.observe(max(0.0, now - scheduled))
        self.prefill.observe(max(0.0, (state.first if state.first >= 0 else now) - scheduled))
        self.decode.observe(max(0.0, now - state.first) if state.first >= 0 else 0.0)
        self.prompt_hist.observe(req.prompt_len)
        self.generation_hist.observe(req.output_len)
        self.max_tokens_hist.observe(state.max_tokens)
        self.preemption_hist.observe(req.num_preemptions)

    def die(self) -> None:
        """Engine death: fatal-error log, /health 503, HTTP 500s, exit 0 about 1 s later."""
        if self.dead:
            return
        self.dead = True
        self.log("ERROR", "core.py:789", "EngineCore encountered a fatal error.")
        trace = (
            "Traceback (most recent call last):\n"
            '  File "/opt/vllm/vllm/v1/engine/core.py", line 780, in run_engine_core\n'
            "    engine_core.run_busy_loop()\n"
            '  File "/opt/vllm/vllm/v1/engine/core.py", line 807, in run_busy_loop\n'
            "    self._process_engine_step()\n"
            "RuntimeError: CUDA error: an illegal memory access was encountered (simulated by "
            "--sim-die-after-requests)"
        )
        self.log("ERROR", "core.py:789", trace)
        self.log(
            "ERROR",
            "async_llm.py:420",
            "AsyncLLM output_handler failed.\nTraceback (most recent call last):\n"
            '  File "/opt/vllm/vllm/v1/engine/async_llm.py", line 401, in output_handler\n'
            "    outputs = await engine_core.get_output_async()\n"
            f"vllm.v1.engine.exceptions.EngineDeadError: {_DEATH_MESSAGE}",
        )
        for req in [*self.engine.running, *self.engine.waiting]:
            state = req.tag
            if isinstance(state, _Stream):
                state.error = True
                _wake(state)
        self._loop.call_later(1.0, self.stopping.set)


class _ChildHandle:
    """The ``--sim-orphan-child`` process (same process group and session as the server)."""

    _CODE = (
        "import ctypes, time\n"
        "try:\n"
        "    ctypes.CDLL(None).prctl(15, b'VLLM::EngineCor', 0, 0, 0)\n"
        "except Exception:\n"
        "    pass\n"
        "time.sleep(3600)\n"
    )

    def __init__(self) -> None:
        self.proc = subprocess.Popen(["VLLM::EngineCore", "-c", self._CODE], executable=sys.executable)

    def stop(self) -> None:
        """Terminate the child on a clean shutdown (only a hard kill of the parent orphans it)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind (not listen) the server socket early, as vLLM does; OSError when the port is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


async def serve(
    flags: ServeFlags,
    arch: ModelArch,
    plan: StartupPlan,
    build: Callable[[], Engine],
    log: Log,
    rng: random.Random,
) -> int:
    """Run one simulated server from launch to exit; returns the exit status."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    def on_sigterm() -> None:
        if flags.ignore_sigterm:
            log("WARNING", "launcher.py:99",
                "Received SIGTERM; ignoring it (--sim-ignore-sigterm).")  # fmt: skip
            return
        log("INFO", "launcher.py:99", "Received SIGTERM, shutting down.")
        stop.set()

    loop.add_signal_handler(signal.SIGTERM, on_sigterm)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    child = _ChildHandle() if flags.orphan_child else None
    try:
        return await _serve(flags, arch, plan, build, log, rng, stop)
    finally:
        if child is not None:
            child.stop()


async def _sleep_or(stop: asyncio.Event, seconds: float) -> bool:
    """Sleep ``seconds``; True when ``stop`` was set meanwhile."""
    if stop.is_set():
        return True
    try:
        await asyncio.wait_for(stop.wait(), timeout=max(0.0, seconds))
    except TimeoutError:
        return False
    return True


async def _serve(
    flags: ServeFlags,
    arch: ModelArch,
    plan: StartupPlan,
    build: Callable[[], Engine],
    log: Log,
    rng: random.Random,
    stop: asyncio.Event,
) -> int:
    log("INFO", "api_server.py:1870", f"Started server process [{os.getpid()}]")
    try:
        sock = bind_socket(flags.host, flags.port)
    except OSError as exc:
        log("", "", "Traceback (most recent call last):\n"
            '  File "/opt/vllm/vllm/entrypoints/openai/api_server.py", line 1950, in setup_server\n'
            "    sock = create_server_socket(sock_addr)\n"
            f"OSError: [Errno {exc.errno}] {exc.strerror}")  # fmt: skip
        return 1
    with sock:
        t0 = loop_time()
        for event in plan.events:
            if flags.hang_at_start and event.at > 0.5:
                log("INFO", "core.py:95", "Waiting for the engine core to initialise...")
                await stop.wait()
                return 0
            if await _sleep_or(stop, t0 + event.at * plan.delay_s - loop_time()):
                return 0
            log.event(event)
        if await _sleep_or(stop, t0 + plan.delay_s - loop_time()):
            return 0
        if not plan.ok:
            return plan.exit_code
        server = SimServer(flags, arch, plan, build(), log, rng)
        runner = web.AppRunner(server.app(), access_log=None, handle_signals=False)
        await runner.setup()
        site = web.SockSite(runner, sock, shutdown_timeout=0.5)
        await site.start()
        shown = "0.0.0.0" if flags.host == "0.0.0.0" else flags.host
        log("INFO", "api_server.py:1912", f"Starting vLLM API server 0 on http://{shown}:{flags.port}")
        log("INFO", "launcher.py:34", "Available routes are: /health, /v1/models, /version, "
            "/metrics, /tokenize, /v1/completions, /v1/chat/completions")  # fmt: skip
        log("INFO", "server.py:82", "Waiting for application startup.")
        log("INFO", "on.py:62", "Application startup complete.")
        engine_task = asyncio.create_task(server.engine_loop())
        stopped = asyncio.create_task(stop.wait())
        died = asyncio.create_task(server.stopping.wait())
        await asyncio.wait({stopped, died}, return_when=asyncio.FIRST_COMPLETED)
        log("INFO", "launcher.py:101", "Shutting down FastAPI HTTP server.")
        engine_task.cancel()
        for task in (stopped, died):
            task.cancel()
        for req in [*server.engine.running, *server.engine.waiting]:
            state = req.tag
            if isinstance(state, _Stream):
                state.error = True
                _wake(state)
        await _quiet(asyncio.wait_for(runner.cleanup(), timeout=1.0))
        return 0


async def _quiet(awaitable: Awaitable[None]) -> None:
    with contextlib.suppress(asyncio.CancelledError, ConnectionError, TimeoutError):
        await awaitable


def loop_time() -> float:
    """The running loop's clock."""
    return asyncio.get_running_loop().time()
