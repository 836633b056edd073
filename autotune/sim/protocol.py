"""vLLM's OpenAI-compatible wire format for the simulated server: request checks, bodies, SSE chunks, auth.

Generation requests are checked with vLLM's error texts (:func:`parse_generation`); responses are JSON in
vLLM's compact form; streaming chunks are byte templates around the changing text (:class:`ChunkTemplates`,
the SSE shape of vLLM 0.32). :class:`BearerAuth` is vLLM 0.34's AuthenticationMiddleware and
:func:`request_id_header` its XRequestIdMiddleware.
"""

from __future__ import annotations

import hashlib
import json
import random
import secrets
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from autotune.sim.tokens import chat_ids, prompt_ids

GUARDED_PREFIXES = ("/v1", "/v2", "/inference", "/cohere")
"""Paths vLLM's AuthenticationMiddleware protects."""


def json_response(body: object, status: int = 200) -> web.Response:
    """A JSON response in vLLM's compact form."""
    return web.Response(
        text=json.dumps(body, separators=(",", ":")), status=status, content_type="application/json"
    )


def error_response(message: str, kind: str, code: int) -> web.Response:
    """vLLM's error body (``{"error": {"message", "type", "param", "code"}}``) with HTTP status ``code``."""
    body = {"error": {"message": message, "type": kind, "param": None, "code": code}}
    return json_response(body, status=code)


async def read_object(request: web.Request) -> dict[str, Any] | web.Response:
    """The request's JSON object body, or the 400 response for invalid JSON or a non-object."""
    try:
        body = await request.json()
    except json.JSONDecodeError:
        return error_response("Invalid JSON body", "BadRequestError", 400)
    if not isinstance(body, dict):
        return error_response("Request body must be an object", "BadRequestError", 400)
    return body


@dataclass(frozen=True)
class Generation:
    """A checked completion request: prompt ids, token limits, the drawn output length, stream options."""

    ids: list[int]
    max_tokens: int
    output_len: int
    stream: bool
    include_usage: bool


def parse_generation(
    body: dict[str, Any], *, chat: bool, vocab: int, max_model_len: int, rng: random.Random
) -> Generation | web.Response:
    """Check a (chat) completion body against ``max_model_len`` (vLLM's 400 texts) and draw its output
    length from ``rng`` (``max_tokens`` with ``ignore_eos``, else uniform in [max(1, min_tokens),
    max_tokens])."""
    ids = chat_ids(body.get("messages"), vocab) if chat else prompt_ids(body.get("prompt"), vocab)
    if not ids:
        what = "messages" if chat else "prompt"
        return error_response(f"{what} must be a non-empty string or list of token ids",
                              "BadRequestError", 400)  # fmt: skip
    prompt_len = len(ids)
    mml = max_model_len
    if prompt_len > mml:
        return error_response(
            f"This model's maximum context length is {mml} tokens. However, your request has "
            f"{prompt_len} input tokens. Please reduce the length of the input messages.",
            "BadRequestError", 400)  # fmt: skip
    max_tokens = body.get("max_completion_tokens") if chat else None
    if max_tokens is None:
        max_tokens = body.get("max_tokens")
    if max_tokens is None:
        max_tokens = mml - prompt_len
    if not isinstance(max_tokens, int) or max_tokens < 1:
        return error_response(f"max_tokens must be at least 1, got {max_tokens}.",
                              "BadRequestError", 400)  # fmt: skip
    if prompt_len + max_tokens > mml:
        return error_response(
            f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's "
            f"maximum context length is {mml} tokens and your request has {prompt_len} input "
            f"tokens ({max_tokens} > {mml} - {prompt_len}).",
            "BadRequestError", 400)  # fmt: skip
    min_tokens = body.get("min_tokens") or 0
    if not isinstance(min_tokens, int) or min_tokens < 0 or min_tokens > max_tokens:
        return error_response(f"min_tokens must be in [0, max_tokens], got {min_tokens}.",
                              "BadRequestError", 400)  # fmt: skip
    output_len = max_tokens if body.get("ignore_eos") else rng.randint(max(1, min_tokens), max_tokens)
    stream_opts = body.get("stream_options") or {}
    include_usage = bool(isinstance(stream_opts, dict) and stream_opts.get("include_usage"))
    return Generation(ids, max_tokens, output_len, bool(body.get("stream")), include_usage)


def completion_body(
    *, chat: bool, response_id: str, model: str, text: str, reason: str, prompt_len: int, output_len: int
) -> dict[str, Any]:
    """The non-streaming (chat) completion response body."""
    usage = {"prompt_tokens": prompt_len, "total_tokens": prompt_len + output_len,
             "completion_tokens": output_len, "prompt_tokens_details": None}  # fmt: skip
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
    return {"id": f"{prefix}-{response_id}", "object": kind, "created": int(time.time()),
            "model": model, "choices": [choice], "usage": usage}  # fmt: skip


@dataclass(frozen=True)
class ChunkTemplates:
    """The byte templates of one SSE response: a token chunk is ``pre + text + mid``, the last one
    ``pre + text + end.format(reason)``; ``role`` opens a chat stream."""

    head: str
    pre: bytes
    mid: bytes
    end: str
    role: bytes
    fingerprint: str

    def usage_chunk(self, prompt_len: int, output_len: int) -> bytes:
        """The closing chunk with the request's token counts (``stream_options.include_usage``)."""
        c = output_len
        return (self.head + f'[],"usage":{{"prompt_tokens":{prompt_len},"total_tokens":'
                f'{prompt_len + c},"completion_tokens":{c}}}{self.fingerprint}}}\n\n').encode()  # fmt: skip


def chunk_templates(
    *, chat: bool, model: str, response_id: str, created: int, fingerprint: str
) -> ChunkTemplates:
    """The SSE templates of a (chat) completion stream; ``fingerprint`` is the completions' system
    fingerprint (chat chunks carry none)."""
    name = json.dumps(model)
    rid = json.dumps(response_id)[1:-1]
    if chat:
        head = (f'data: {{"id":"chatcmpl-{rid}","object":"chat.completion.chunk",'
                f'"created":{created},"model":{name},"choices":')  # fmt: skip
        pre = (head + '[{"index":0,"delta":{"content":"').encode()
        mid = b'"},"logprobs":null,"finish_reason":null}]}\n\n'
        end = '"}},"logprobs":null,"finish_reason":"{}","stop_reason":null}}]}}\n\n'
        role = (head + '[{"index":0,"delta":{"role":"assistant","content":""},'
                '"logprobs":null,"finish_reason":null}]}\n\n').encode()  # fmt: skip
        return ChunkTemplates(head, pre, mid, end, role, "")
    head = (f'data: {{"id":"cmpl-{rid}","object":"text_completion",'
            f'"created":{created},"model":{name},"choices":')  # fmt: skip
    pre = (head + '[{"index":0,"text":"').encode()
    mid = (b'","logprobs":null,"finish_reason":null,"stop_reason":null,"prompt_token_ids":null,'
           b'"token_ids":null}]}\n\n')  # fmt: skip
    end = ('","logprobs":null,"finish_reason":"{}","stop_reason":null,"prompt_token_ids":null,'
           '"token_ids":null}}]}}\n\n')  # fmt: skip
    return ChunkTemplates(head, pre, mid, end, b"", f',"system_fingerprint":"{fingerprint}"')


class BearerAuth:
    """vLLM's AuthenticationMiddleware: a bearer token among ``keys`` on the guarded paths, else 401."""

    def __init__(self, keys: Sequence[str]) -> None:
        self._tokens = [hashlib.sha256(k.encode()).digest() for k in keys]

    @property
    def enabled(self) -> bool:
        """Whether any key is set (without one, no request is checked)."""
        return bool(self._tokens)

    def authorized(self, request: web.Request) -> bool:
        """Whether the request carries one of the keys (compared in constant time)."""
        scheme, _, param = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            return False
        digest = hashlib.sha256(param.encode()).digest()
        match = False
        for token in self._tokens:
            match |= secrets.compare_digest(digest, token)
        return match

    @web.middleware
    async def middleware(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        """The 401 ``{"error":"Unauthorized"}`` for a guarded path without the token (not OPTIONS)."""
        if (
            request.method != "OPTIONS"
            and request.path.startswith(GUARDED_PREFIXES)
            and not self.authorized(request)
        ):
            return json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)


async def request_id_header(request: web.Request, response: web.StreamResponse) -> None:
    """vLLM's XRequestIdMiddleware: echo X-Request-Id, or send a random one."""
    response.headers["X-Request-Id"] = request.headers.get("X-Request-Id", uuid.uuid4().hex)
