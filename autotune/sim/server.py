"""The simulated ``vllm serve``: startup log, OpenAI-compatible HTTP API and the engine loops.

Each data-parallel engine has its own loop: it runs the shared scheduler (:mod:`autotune.sim.engine`)
and sleeps until each step's end in wall time (``step time / --sim-speedup``); tokens of a step are
delivered when it ends. A new request goes to the engine vLLM's load balancer picks
(:mod:`autotune.sim.router`). Streaming chunks are pre-formatted byte templates around the changing text,
so a chunk costs a few microseconds of server CPU. A step that emits several tokens of a request
(speculative decoding) sends them as one chunk. Like vLLM's ``RequestOutputCollector``, a writer that
falls behind (the loop wakes more than :data:`~autotune.sim.delivery.MERGE_LATE_S` after a step's end)
merges a stream's pending tokens into one chunk when it catches up, instead of writing one late chunk
per step; usage counts stay exact. The SSE shape is that of vLLM 0.32's
(tests/vllm/fixtures/sse_completions_stream.txt): content chunks carry no ``usage`` key, completion
choices carry ``prompt_token_ids``/``token_ids`` (null), ids are ``cmpl-<16 hex>``.

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

This module holds the process (:func:`serve`: log, socket, startup, shutdown) and the HTTP handlers
(:class:`SimServer`); the engine loops and token delivery are :mod:`autotune.sim.delivery`'s, the wire
format (request checks, bodies, SSE templates, the middlewares) :mod:`autotune.sim.protocol`'s.
"""

from __future__ import annotations

import asyncio
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
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import TextIO

from aiohttp import web

from autotune.hardware.catalog import ModelArch
from autotune.sim.delivery import EngineLoops, Stream, finish_reason
from autotune.sim.engine import Engine, Request
from autotune.sim.flags import ServeFlags
from autotune.sim.metrics import EngineStats, render
from autotune.sim.protocol import (
    BearerAuth,
    ChunkTemplates,
    chunk_templates,
    completion_body,
    error_response,
    json_response,
    parse_generation,
    read_object,
    request_id_header,
)
from autotune.sim.report import VLLM_VERSION, cache_config_labels
from autotune.sim.startup import LogEvent, StartupPlan
from autotune.sim.tokens import OUTPUT_WORDS, chat_ids, output_text, prompt_ids

_WORDS = OUTPUT_WORDS
_text = output_text
_DEATH_MESSAGE = "EngineCore encountered an issue. See stack trace (above) for the root cause."


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


class SimServer:
    """One simulated vLLM server process: its HTTP app and handlers, over the engine loops
    (:class:`~autotune.sim.delivery.EngineLoops`), with its engine-death fault."""

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
        self.loops = EngineLoops(flags, engines, on_die=self.die)
        self.log = log
        self.rng = rng
        self.name = flags.name
        self.max_model_len = plan.max_model_len
        self.stopping = asyncio.Event()
        self.exit_code = 0
        self._loop = asyncio.get_running_loop()
        self.created = int(time.time())
        self._auth = BearerAuth(api_keys)
        self.fingerprint = f"vllm-{VLLM_VERSION}-{zlib.crc32(repr(flags).encode()):08x}"
        memory, config = plan.memory, plan.config
        assert memory is not None and config is not None
        self._cache_labels = [cache_config_labels(config, memory, i) for i in range(len(self.engines))]

    @property
    def engines(self) -> list[Engine]:
        """The data-parallel engines."""
        return self.loops.engines

    @property
    def stats(self) -> list[EngineStats]:
        """Each engine's per-request statistics."""
        return self.loops.stats

    @property
    def dead(self) -> bool:
        """Whether the engine died (``--sim-die-after-requests``)."""
        return self.loops.dead

    # ---- application -------------------------------------------------------------------------
    def app(self) -> web.Application:
        """The aiohttp application with vLLM's routes."""
        middlewares = [self._auth.middleware] if self._auth.enabled else []
        app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=middlewares)
        if self.flags.enable_request_id_headers:
            app.on_response_prepare.append(request_id_header)
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
        return json_response({"version": VLLM_VERSION})

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
        return json_response({"object": "list", "data": [card]})

    async def tokenize(self, request: web.Request) -> web.Response:
        """``{"count", "max_model_len", "tokens"}`` for a prompt or chat messages."""
        body = await read_object(request)
        if isinstance(body, web.Response):
            return body
        vocab = self.arch.vocab_size
        if "messages" in body:
            ids = chat_ids(body["messages"], vocab)
        else:
            ids = prompt_ids(body.get("prompt"), vocab)
        if ids is None:
            return error_response("prompt must be a string or a list of token ids",
                                  "BadRequestError", 400)  # fmt: skip
        return json_response(
            {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids,
             "token_strs": None}
        )  # fmt: skip

    async def metrics(self, _: web.Request) -> web.Response:
        """Prometheus text with vLLM's metric names (:mod:`autotune.sim.metrics`)."""
        loops = self.loops
        text = render(self.name, loops.engines, loops.stats, self._cache_labels, lag_s=loops.lag_s,
                      merged_tokens=loops.merged)  # fmt: skip
        return web.Response(text=text, content_type="text/plain")

    # ---- generation ----------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/completions`` (streaming or not)."""
        return await self._generate(request, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/chat/completions`` (streaming or not)."""
        return await self._generate(request, chat=True)

    def _dead_response(self) -> web.Response:
        """The 500 every generation request gets once the engine died."""
        return error_response(_DEATH_MESSAGE, "InternalServerError", 500)

    async def _generate(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        """Check a generation request, admit it to an engine and answer it (streaming or not)."""
        if self.dead:
            return self._dead_response()
        body = await read_object(request)
        if isinstance(body, web.Response):
            return body
        gen = parse_generation(body, chat=chat, vocab=self.arch.vocab_size,
                               max_model_len=self.max_model_len, rng=self.rng)  # fmt: skip
        if isinstance(gen, web.Response):
            return gen
        given_id = request.headers.get("X-Request-Id", body.get("request_id"))
        req, state = self.loops.submit(gen.ids, gen.output_len, gen.max_tokens, given_id)
        try:
            if gen.stream:
                return await self._stream(request, req, state, chat=chat, usage=gen.include_usage)
            return await self._complete(req, state, chat=chat)
        except asyncio.CancelledError:
            self.loops.abort(req)
            raise

    async def _wait(self, state: Stream) -> None:
        """Sleep until the engine loop wakes this request's handler."""
        state.waiter = self._loop.create_future()
        await state.waiter
        state.waiter = None

    async def _complete(self, req: Request, state: Stream, *, chat: bool) -> web.Response:
        """The non-streaming response, once the request finished."""
        while not state.done and not state.error:
            await self._wait(state)
        if state.error:
            return self._dead_response()
        text = b"".join(_WORDS[i % len(_WORDS)] for i in range(req.output_len)).decode()
        return json_response(completion_body(
            chat=chat, response_id=state.response_id, model=self.name, text=text,
            reason=finish_reason(req, state), prompt_len=req.prompt_len, output_len=req.output_len,
        ))  # fmt: skip

    async def _stream(
        self, request: web.Request, req: Request, state: Stream, *, chat: bool, usage: bool
    ) -> web.StreamResponse:
        """The SSE response: the handler writes the first and last chunks (and any the engine loop
        could not), the engine loop the token chunks in between."""
        sse = chunk_templates(chat=chat, model=self.name, response_id=state.response_id,
                              created=int(time.time()), fingerprint=self.fingerprint)  # fmt: skip
        response: web.StreamResponse | None = None
        try:
            while True:
                await self._wait(state)
                if state.error:
                    return await self._stream_error(response)
                if response is None:
                    response = web.StreamResponse(
                        headers={"Content-Type": "text/event-stream; charset=utf-8"}
                    )
                    await response.prepare(request)
                    out = [sse.role] if sse.role else []
                else:
                    out = []
                if await self._write_tokens(response, out, req, state, sse, usage=usage):
                    return response
                transport = request.transport
                if transport is not None and not transport.is_closing():
                    # From here on the engine loop frames and writes each token chunk directly (HTTP/1.1
                    # chunked encoding, as aiohttp's writer does) and wakes this task only at the end.
                    state.pre, state.mid = sse.pre, sse.mid
                    state.transport = transport
        except ConnectionResetError:  # the client went away (aiohttp's ClientConnectionResetError)
            self.loops.abort(req)
            return response if response is not None else web.Response(status=499)

    async def _write_tokens(
        self,
        response: web.StreamResponse,
        out: list[bytes],
        req: Request,
        state: Stream,
        sse: ChunkTemplates,
        *,
        usage: bool,
    ) -> bool:
        """Write ``out`` and the tokens not yet written, merged into one chunk (one, unless this task or
        the engine loop was late, as vLLM's output collector merges them); True when the stream ended."""
        upto = state.delivered
        sent = state.sent
        if upto - sent > 1:
            self.loops.merged += upto - sent - 1
        if state.done:
            reason = finish_reason(req, state)
            out.append(sse.pre + _text(sent, upto) + sse.end.format(reason).encode())
            if usage:
                out.append(sse.usage_chunk(req.prompt_len, req.output_len))
            out.append(b"data: [DONE]\n\n")
            await response.write(b"".join(out))
            await response.write_eof()
            return True
        if upto > sent:
            out.append(sse.pre + _text(sent, upto) + sse.mid)
        state.sent = upto
        if out:
            await response.write(b"".join(out))
        return False

    async def _stream_error(self, response: web.StreamResponse | None) -> web.StreamResponse:
        """The engine died: a 500 before the stream began, else an error event and ``[DONE]``."""
        if response is None:
            return self._dead_response()
        err = {"error": {"message": _DEATH_MESSAGE, "type": "InternalServerError",
                         "param": None, "code": 500}}  # fmt: skip
        await response.write(f"data: {json.dumps(err, separators=(',', ':'))}\n\ndata: [DONE]\n\n".encode())
        return response

    # ---- engine --------------------------------------------------------------------------------
    async def engine_loop(self, index: int = 0) -> None:
        """Step engine ``index`` in wall time until stopped or dead."""
        await self.loops.run(index)

    def die(self) -> None:
        """Engine death: fatal-error log, /health 503, HTTP 500s, exit 0 about 1 s later."""
        if self.dead:
            return
        self.loops.dead = True
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
        self.loops.fail_streams()
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
    stop = _stop_on_signals(flags, log)
    with _orphan_child(flags.orphan_child):
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
            server.loops.fail_streams()
            await _quiet(asyncio.wait_for(runner.cleanup(), timeout=1.0))
            return 0


def _stop_on_signals(flags: ServeFlags, log: Log) -> asyncio.Event:
    """An event SIGTERM (unless ``--sim-ignore-sigterm``) and SIGINT set, on the running loop."""
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
    return stop


@contextlib.contextmanager
def _orphan_child(wanted: bool) -> Iterator[None]:
    """The ``--sim-orphan-child`` process while the server runs, when ``wanted``; stopped after."""
    child = _ChildHandle() if wanted else None
    try:
        yield
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
