"""The simulated ``vllm serve``: startup log, OpenAI-compatible HTTP API and the engine loops.

Each data-parallel engine has its own loop: it runs the shared scheduler (:mod:`autotune.sim.engine`)
and sleeps until each step's end in wall time (``step time / --sim-speedup``); tokens of a step are
delivered when it ends. A new request goes to the engine vLLM's load balancer picks
(:mod:`autotune.sim.router`). Streaming chunks are pre-formatted byte templates around the changing text,
so a chunk costs a few microseconds of server CPU. A step that emits several tokens of a request
(speculative decoding) sends them as one chunk. Like vLLM's ``RequestOutputCollector``, a writer that
falls behind (the loop wakes more than :data:`MERGE_LATE_S` after a step's end) merges a stream's
pending tokens into one chunk when it catches up, instead of writing one late chunk per step; usage
counts stay exact. The SSE shape is that of vLLM 0.32's (tests/vllm/fixtures/sse_completions_stream.txt):
content chunks carry no ``usage`` key, completion choices carry ``prompt_token_ids``/``token_ids``
(null), ids are ``cmpl-<16 hex>``.

Tokenisation is the toy of :mod:`autotune.sim.tokens` (one token per word); prompts reach the engine as
token ids, so requests sharing a text prefix share prefix-cache blocks. Without ``ignore_eos`` the
output length is drawn uniformly from [max(1, min_tokens), max_tokens] with the seeded RNG
(finish_reason ``stop`` when below max_tokens).

Authentication and request ids, as vLLM 0.34's middlewares: with ``--api-key`` (or, without it, the
``VLLM_API_KEY`` environment variable) every request whose path starts with ``/v1``, ``/v2``,
``/inference`` or ``/cohere`` (except ``OPTIONS``) needs ``Authorization: Bearer <key>``, else HTTP 401
with ``{"error":"Unauthorized"}``; ``/health``, ``/metrics``, ``/version`` and ``/tokenize`` stay open.
An ``X-Request-Id`` header (else the body's ``request_id``) becomes the response id (``cmpl-<id>``,
``chatcmpl-<id>``); with ``--enable-request-id-headers`` every response carries ``X-Request-Id`` (the
request's, else a random uuid4 hex).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import time
import uuid
import zlib
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TextIO

from aiohttp import web

from autotune.catalog import ModelArch
from autotune.sim.engine import Engine, Request
from autotune.sim.flags import ServeFlags
from autotune.sim.metrics import EngineStats, render
from autotune.sim.report import VLLM_VERSION, cache_config_labels
from autotune.sim.router import LeastLoaded
from autotune.sim.startup import LogEvent, StartupPlan
from autotune.sim.tokens import OUTPUT_WORDS, chat_ids, output_text, prompt_ids

_WORDS = OUTPUT_WORDS
_text = output_text
_DEATH_MESSAGE = "EngineCore encountered an issue. See stack trace (above) for the root cause."
GUARDED_PREFIXES = ("/v1", "/v2", "/inference", "/cohere")
"""Paths vLLM's AuthenticationMiddleware protects."""
MAX_DEBT_S = 0.005
"""How far (wall seconds) the engine loop may run behind its schedule and still catch up."""
MERGE_LATE_S = 0.002
"""A step delivered this late (wall seconds) or later is held back and merged into the next chunk."""
MAX_HOLD_S = 0.01
"""A late writer still writes held-back tokens (merged) at least this often (wall seconds)."""


def _request_id(rid: int) -> str:
    """16 hex digits that look random but follow from the request number (vLLM 0.32: ``cmpl-<16 hex>``)."""
    return f"{(rid + 1) * 0x9E3779B97F4A7C15 % (1 << 64):016x}"


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


class _Stream:
    """Per-request delivery state between the engine loop and the HTTP handler."""

    __slots__ = (
        "arrival",
        "delivered",
        "done",
        "engine",
        "error",
        "first",
        "last",
        "max_tokens",
        "mid",
        "pending",
        "pre",
        "response_id",
        "scheduled",
        "sent",
        "transport",
        "waiter",
    )

    def __init__(self, arrival: float, max_tokens: int, engine: int = 0, response_id: str = "") -> None:
        self.waiter: asyncio.Future[None] | None = None
        self.transport: asyncio.Transport | None = None
        """Set once the response is streaming: the engine loop then writes token chunks itself."""
        self.pre = b""
        self.mid = b""
        self.pending: list[bytes] = []
        """Framed chunks the engine loop holds for one write (``--sim-events-per-write``)."""
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
        self.engine = engine
        """The data-parallel engine the request runs on."""
        self.response_id = response_id
        """The id after ``cmpl-``/``chatcmpl-`` (an incoming X-Request-Id, else a generated one)."""


def _wake(stream: _Stream) -> None:
    if stream.pending:  # what the engine loop held for one write goes before the handler's last write
        transport = stream.transport
        if transport is not None and not transport.is_closing():
            transport.write(b"".join(stream.pending))
        stream.pending.clear()
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
    """One simulated vLLM server process (its HTTP app, engine loops, faults and shutdown)."""

    def __init__(
        self,
        flags: ServeFlags,
        arch: ModelArch,
        plan: StartupPlan,
        engines: Sequence[Engine],
        log: Log,
        rng: random.Random,
        api_keys: Sequence[str] = (),
    ) -> None:
        self.flags = flags
        self.arch = arch
        self.plan = plan
        self.engines = list(engines)
        self.stats = [EngineStats() for _ in self.engines]
        self.router = LeastLoaded()
        self.log = log
        self.rng = rng
        self.name = flags.name
        self.max_model_len = plan.max_model_len
        self.dead = False
        self.stopping = asyncio.Event()
        self._wakes = [asyncio.Event() for _ in self.engines]
        self._next_id = 0
        self._admitted = 0
        self._die_pending = False
        self.exit_code = 0
        self._loop = asyncio.get_running_loop()
        self.created = int(time.time())
        self._tokens = [hashlib.sha256(k.encode()).digest() for k in api_keys]
        self.lag_s = 0.0
        """Wall seconds the engine loops fell behind their schedule beyond MAX_DEBT_S (host CPU too slow)."""
        self.merged = 0
        """Tokens that were merged into another token's chunk because the writer was late."""
        self._behind: set[_Stream] = set()
        """Streams with tokens held back by a late writer (flushed, merged, when it is on time again)."""
        self._held_since = 0.0
        self.fingerprint = f"vllm-{VLLM_VERSION}-{zlib.crc32(repr(flags).encode()):08x}"
        memory, config = plan.memory, plan.config
        assert memory is not None and config is not None
        self._cache_labels = [cache_config_labels(config, memory, i) for i in range(len(self.engines))]

    # ---- application -------------------------------------------------------------------------
    def app(self) -> web.Application:
        """The aiohttp application with vLLM's routes."""
        middlewares = [self._authenticate] if self._tokens else []
        app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=middlewares)
        if self.flags.enable_request_id_headers:
            app.on_response_prepare.append(self._request_id_header)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/version", self.version)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        return app

    def _authorized(self, request: web.Request) -> bool:
        scheme, _, param = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            return False
        digest = hashlib.sha256(param.encode()).digest()
        match = False
        for token in self._tokens:
            match |= secrets.compare_digest(digest, token)
        return match

    @web.middleware
    async def _authenticate(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        """vLLM's AuthenticationMiddleware: a bearer token on the guarded paths, else 401."""
        if (
            request.method != "OPTIONS"
            and request.path.startswith(GUARDED_PREFIXES)
            and not self._authorized(request)
        ):
            return _json({"error": "Unauthorized"}, status=401)
        return await handler(request)

    async def _request_id_header(self, request: web.Request, response: web.StreamResponse) -> None:
        """vLLM's XRequestIdMiddleware: echo X-Request-Id, or send a random one."""
        response.headers["X-Request-Id"] = request.headers.get("X-Request-Id", uuid.uuid4().hex)

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

    async def tokenize(self, request: web.Request) -> web.Response:
        """``{"count", "max_model_len", "tokens"}`` for a prompt or chat messages."""
        try:
            body = await request.json()
        except json.JSONDecodeError:
            return _error_body("Invalid JSON body", "BadRequestError", 400)
        if not isinstance(body, dict):
            return _error_body("Request body must be an object", "BadRequestError", 400)
        vocab = self.arch.vocab_size
        if "messages" in body:
            ids = chat_ids(body["messages"], vocab)
        else:
            ids = prompt_ids(body.get("prompt"), vocab)
        if ids is None:
            return _error_body("prompt must be a string or a list of token ids",
                               "BadRequestError", 400)  # fmt: skip
        return _json(
            {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids,
             "token_strs": None}
        )  # fmt: skip

    async def metrics(self, _: web.Request) -> web.Response:
        """Prometheus text with vLLM's metric names (:mod:`autotune.sim.metrics`)."""
        text = render(self.name, self.engines, self.stats, self._cache_labels, lag_s=self.lag_s,
                      merged_tokens=self.merged)  # fmt: skip
        return web.Response(text=text, content_type="text/plain")

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
        vocab = self.arch.vocab_size
        ids = chat_ids(body.get("messages"), vocab) if chat else prompt_ids(body.get("prompt"), vocab)
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
        given_id = request.headers.get("X-Request-Id", body.get("request_id"))
        req = Request(rid, prompt_len, output_len, token_ids=ids)
        index = self.router.choose(self.engines)
        response_id = str(given_id) if given_id is not None else _request_id(rid)
        state = _Stream(self._loop.time(), max_tokens, index, response_id)
        req.tag = state
        self._admitted += 1
        limit = self.flags.die_after_requests
        if limit is not None and self._admitted >= limit:
            self._die_pending = True
        self.engines[index].add(req)
        self._wakes[index].set()
        try:
            if body.get("stream"):
                return await self._stream(request, req, state, chat=chat, usage=include_usage)
            return await self._complete(req, state, chat=chat)
        except asyncio.CancelledError:
            self._abort(req)
            raise

    def _abort(self, req: Request) -> None:
        """The client went away: drop the request from its engine."""
        state = req.tag
        index = state.engine if isinstance(state, _Stream) else 0
        self.engines[index].abort(req)
        if not req.finished:
            self.stats[index].success["abort"] += 1

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
        body = {"id": f"{prefix}-{state.response_id}", "object": kind, "created": int(time.time()),
                "model": self.name, "choices": [choice], "usage": usage}  # fmt: skip
        return _json(body)

    async def _stream(
        self, request: web.Request, req: Request, state: _Stream, *, chat: bool, usage: bool
    ) -> web.StreamResponse:
        created = int(time.time())
        name = json.dumps(self.name)
        rid = json.dumps(state.response_id)[1:-1]
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
    async def engine_loop(self, index: int = 0) -> None:
        """Step engine ``index`` in wall time until stopped or dead."""
        loop = self._loop
        engine = self.engines[index]
        stats = self.stats[index]
        wake = self._wakes[index]
        speedup = self.flags.speedup
        words = _WORDS
        nwords = len(words)
        target = loop.time()
        while not self.dead:
            if not engine.has_work():
                wake.clear()
                await wake.wait()
                target = loop.time()
                continue
            result = engine.step()
            if result.scheduled_tokens == 0:
                wake.clear()
                await wake.wait()
                target = loop.time()
                continue
            now = loop.time()
            for req in result.started:
                state = req.tag
                assert isinstance(state, _Stream)
                state.scheduled = now
                stats.queue.observe(max(0.0, now - state.arrival))
            stats.iteration.observe(result.scheduled_tokens)
            # Steps follow a schedule (end of previous step + duration / speedup), so the time spent
            # delivering tokens does not stretch simulated time; a loop more than MAX_DEBT_S late
            # gives up catching up and counts the difference as lag.
            if target < now - MAX_DEBT_S:
                self.lag_s += now - MAX_DEBT_S - target
                target = now - MAX_DEBT_S
            target += result.duration / speedup
            delay = target - loop.time()
            await asyncio.sleep(delay if delay > 0 else 0)
            if self.dead:
                return
            now = loop.time()
            late = now - target > MERGE_LATE_S
            behind = self._behind
            for req in result.emitted:
                state = req.tag
                assert isinstance(state, _Stream)
                if state.first < 0:
                    state.first = now
                    stats.ttft.observe(now - state.arrival)
                else:
                    stats.itl.observe(now - state.last)
                state.last = now
                step = req.step_tokens
                state.delivered += step
                finished = state.delivered >= req.output_len
                state.done = finished
                transport = state.transport
                if transport is not None and not finished and not transport.is_closing():
                    if late:  # hold the tokens back: merged into this stream's next chunk
                        if not behind:
                            self._held_since = now
                        behind.add(state)
                        continue
                    i = state.sent
                    n = state.delivered
                    if n - i == 1:
                        data = state.pre + words[i % nwords] + state.mid
                    else:
                        self.merged += max(0, n - i - step)
                        data = state.pre + _text(i, n) + state.mid
                    self._write(state, transport, b"%x\r\n%b\r\n" % (len(data), data))
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
            self._write(state, transport, b"%x\r\n%b\r\n" % (len(data), data))
            state.sent = n
        self._behind.clear()

    def _write(self, state: _Stream, transport: asyncio.Transport, frame: bytes) -> None:
        """Write a stream's framed chunk, or hold it until ``--sim-events-per-write`` are gathered."""
        per_write = self.flags.events_per_write
        if per_write <= 1:
            transport.write(frame)
            return
        state.pending.append(frame)
        if len(state.pending) >= per_write:
            transport.write(b"".join(state.pending))
            state.pending.clear()

    def _observe_finished(self, req: Request, state: _Stream, now: float) -> None:
        """Per-request histograms and the success counter at the end of a request."""
        stats = self.stats[state.engine]
        stats.e2e.observe(now - state.arrival)
        stats.success[self._finish_reason(req, state)] += 1
        if req.output_len > 1 and state.first >= 0:
            stats.tpot.observe((now - state.first) / (req.output_len - 1))
        scheduled = state.scheduled if state.scheduled >= 0 else state.arrival
        stats.inference.observe(max(0.0, now - scheduled))
        stats.prefill.observe(max(0.0, (state.first if state.first >= 0 else now) - scheduled))
        stats.decode.observe(max(0.0, now - state.first) if state.first >= 0 else 0.0)
        stats.prompt.observe(req.prompt_len)
        stats.generation.observe(req.output_len)
        stats.max_tokens.observe(state.max_tokens)
        stats.preemptions.observe(req.num_preemptions)

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
        for engine in self.engines:
            for req in [*engine.running, *engine.waiting]:
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
    build: Callable[[], Sequence[Engine]],
    log: Log,
    rng: random.Random,
) -> int:
    """Run one simulated server from launch to exit; returns the exit status.

    ``build`` makes the engines (one per data-parallel rank) once the start succeeded.
    """
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
    build: Callable[[], Sequence[Engine]],
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
        server = SimServer(flags, arch, plan, build(), log, rng, api_keys(flags))
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
        engine_tasks = [asyncio.create_task(server.engine_loop(i)) for i in range(len(server.engines))]
        stopped = asyncio.create_task(stop.wait())
        died = asyncio.create_task(server.stopping.wait())
        await asyncio.wait({stopped, died}, return_when=asyncio.FIRST_COMPLETED)
        log("INFO", "launcher.py:101", "Shutting down FastAPI HTTP server.")
        for task in (*engine_tasks, stopped, died):
            task.cancel()
        for engine in server.engines:
            for req in [*engine.running, *engine.waiting]:
                state = req.tag
                if isinstance(state, _Stream):
                    state.error = True
                    _wake(state)
        await _quiet(asyncio.wait_for(runner.cleanup(), timeout=1.0))
        return 0


def api_keys(flags: ServeFlags) -> tuple[str, ...]:
    """The keys the server accepts: ``--api-key``'s, else ``VLLM_API_KEY``'s (none: no authentication)."""
    keys = flags.api_key or (os.environ.get("VLLM_API_KEY", ""),)
    return tuple(k for k in keys if k)


async def _quiet(awaitable: Awaitable[None]) -> None:
    with contextlib.suppress(asyncio.CancelledError, ConnectionError, TimeoutError):
        await awaitable


def loop_time() -> float:
    """The running loop's clock."""
    return asyncio.get_running_loop().time()
