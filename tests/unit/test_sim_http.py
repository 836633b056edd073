"""The simulated server's HTTP layer in process: vLLM's API-key middleware and X-Request-Id handling."""

from __future__ import annotations

import asyncio
import io
import random
from collections.abc import Awaitable, Callable

import pytest
from aiohttp.test_utils import TestClient, TestServer

from autotune.hardware.catalog import MODELS
from autotune.sim.flags import parse_flags
from autotune.sim.model import build_engines
from autotune.sim.server import Log, SimServer, api_keys
from autotune.sim.startup import plan_startup

MODEL = "Llama-3.1-8B"
Check = Callable[[TestClient], Awaitable[None]]  # type: ignore[type-arg]


def _serve(argv: list[str], check: Check) -> None:
    """Run ``check`` against an in-process simulated server started with ``argv``."""

    async def main() -> None:
        flags = parse_flags([MODEL, "--max-model-len", "2048", "--sim-speedup", "1000", *argv])
        plan = plan_startup(flags, MODELS[MODEL], random.Random(0))
        engines = build_engines(flags, MODELS[MODEL], plan)
        server = SimServer(flags, MODELS[MODEL], plan, engines, Log(io.StringIO()), random.Random(0),
                           api_keys(flags))  # fmt: skip
        loops = [asyncio.create_task(server.engine_loop(i)) for i in range(len(engines))]
        try:
            async with TestClient(TestServer(server.app())) as client:
                await check(client)
        finally:
            for task in loops:
                task.cancel()
            await asyncio.gather(*loops, return_exceptions=True)

    asyncio.run(main())


BODY = {"prompt": "a b c", "max_tokens": 2, "ignore_eos": True}


def test_api_key_protects_v1_routes_only_with_vllms_401() -> None:
    """With --api-key, /v1/* without the bearer token (or with a wrong one) answers 401
    {"error":"Unauthorized"}; /health, /metrics, /version and /tokenize stay open; the right key works."""

    async def check(client: TestClient) -> None:  # type: ignore[type-arg]
        for path in ("/v1/models",):
            reply = await client.get(path)
            assert reply.status == 401 and await reply.text() == '{"error":"Unauthorized"}'
            assert reply.headers["Content-Type"].startswith("application/json")
        wrong = await client.post("/v1/completions", json=BODY, headers={"Authorization": "Bearer nope"})
        assert wrong.status == 401
        for path in ("/health", "/metrics", "/version"):
            assert (await client.get(path)).status == 200, path
        assert (await client.post("/tokenize", json={"prompt": "a b"})).status == 200
        good = await client.post("/v1/completions", json=BODY, headers={"Authorization": "Bearer k2"})
        assert good.status == 200 and (await good.json())["usage"]["completion_tokens"] == 2

    _serve(["--api-key", "k1", "k2"], check)


def test_vllm_api_key_environment_variable_applies_without_the_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    """VLLM_API_KEY protects the server when --api-key is not given; --api-key wins over it."""
    monkeypatch.setenv("VLLM_API_KEY", "env-key")
    assert api_keys(parse_flags(["m"])) == ("env-key",)
    assert api_keys(parse_flags(["m", "--api-key", "flag-key"])) == ("flag-key",)
    monkeypatch.delenv("VLLM_API_KEY")
    assert api_keys(parse_flags(["m"])) == ()


def test_x_request_id_names_the_response_and_is_echoed_with_request_id_headers() -> None:
    """An incoming X-Request-Id becomes the response id (cmpl-<id>); with --enable-request-id-headers
    every response carries X-Request-Id (the request's, else a random uuid4 hex)."""

    async def check(client: TestClient) -> None:  # type: ignore[type-arg]
        reply = await client.post("/v1/completions", json=BODY, headers={"X-Request-Id": "abc-123"})
        assert (await reply.json())["id"] == "cmpl-abc-123"
        assert reply.headers["X-Request-Id"] == "abc-123"
        health = await client.get("/health")
        assert len(health.headers["X-Request-Id"]) == 32

    _serve(["--enable-request-id-headers"], check)

    async def plain(client: TestClient) -> None:  # type: ignore[type-arg]
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        reply = await client.post("/v1/chat/completions", json=chat, headers={"X-Request-Id": "r1"})
        assert (await reply.json())["id"] == "chatcmpl-r1" and "X-Request-Id" not in reply.headers

    _serve([], plain)


def test_a_second_turn_that_resends_the_reply_hits_the_cached_reply() -> None:
    """Output tokens have fixed ids, so a multi-turn client that sends prompt + reply + a new question
    finds the prompt's and the reply's full blocks cached (128 + 64 tokens of 16-token blocks, less the
    partly filled last block of the first turn)."""

    async def check(client: TestClient) -> None:  # type: ignore[type-arg]
        prompt = " ".join(f"p{i}" for i in range(128))
        first = await client.post(
            "/v1/completions", json={"prompt": prompt, "max_tokens": 64, "ignore_eos": True}
        )
        reply = (await first.json())["choices"][0]["text"]
        second = {"prompt": f"{prompt}{reply} and one more question", "max_tokens": 2, "ignore_eos": True}
        assert (await client.post("/v1/completions", json=second)).status == 200
        metrics = await (await client.get("/metrics")).text()
        hits = next(line for line in metrics.splitlines() if line.startswith("vllm:prefix_cache_hits_total{"))
        assert float(hits.rsplit(" ", 1)[1]) == 128 + 48

    _serve([], check)
