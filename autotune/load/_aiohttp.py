"""The ``aiohttp`` engine of the load client: one session without a connection limit, ``iter_any()`` reads.

The alternative to the raw engine (``measurement.client: aiohttp``): the same
:class:`~autotune.load.exchange.Exchange` decoding and per-read ``perf_counter()``, over aiohttp's
connection pool (``TCPConnector(limit=0)``: its default of 100 connections would throttle a probe). A
request's send time is taken when aiohttp has written its body (a trace hook), after the connection is
ready, as in the raw engine.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

import aiohttp

from autotune.load.aio import start_task
from autotune.load.exchange import Exchange

_HEADERS = {"Content-Type": "application/json", "Accept": "text/event-stream"}


async def _sent(_session: aiohttp.ClientSession, ctx: SimpleNamespace, _params: Any) -> None:
    """Trace hook: the request body went out; stamp the exchange's send time."""
    ex = ctx.trace_request_ctx
    if isinstance(ex, Exchange):
        ex.send = time.perf_counter()


class AiohttpPool:
    """Connections to one server through an aiohttp session (made at the first request, in its loop)."""

    def __init__(self, base_url: str, headers: Mapping[str, str] | None = None) -> None:
        self._base = base_url.rstrip("/")
        self._headers = {**_HEADERS, **(headers or {})}
        self._session: aiohttp.ClientSession | None = None

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=None)
            trace = aiohttp.TraceConfig()
            trace.on_request_chunk_sent.append(_sent)
            self._session = aiohttp.ClientSession(
                connector=connector, auto_decompress=False, trace_configs=[trace]
            )
        return self._session

    async def preconnect(self, count: int, timeout: float) -> int:
        """Open about ``count`` connections (concurrent ``GET /health``, kept alive); returns how many
        requests succeeded."""
        session = self._open()

        async def one() -> bool:
            try:
                async with session.get(self._base + "/health", headers=self._headers) as resp:
                    await resp.read()
                    return resp.status < 500
            except (aiohttp.ClientError, OSError, TimeoutError):
                return False

        tasks = [start_task(one) for _ in range(count)]
        done, pending = await asyncio.wait(tasks, timeout=timeout) if tasks else (set(), set())
        for task in pending:
            task.cancel()
        return sum(1 for task in done if task.exception() is None and task.result())

    async def post(
        self,
        path: str,
        body: bytes,
        ex: Exchange,
        timeout: float,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        """POST ``body`` to ``path`` and fill ``ex`` until the response ends, fails or times out."""
        session = self._open()
        perf = time.perf_counter
        try:
            async with session.post(
                self._base + path,
                data=body,
                headers={**self._headers, **(headers or {})},
                timeout=aiohttp.ClientTimeout(total=timeout),
                trace_request_ctx=ex,
            ) as resp:
                ex.status = resp.status
                if resp.status != 200:
                    ex.error = f"HTTP {resp.status}: {(await resp.text(errors='replace'))[:300]}"
                else:
                    async for data in resp.content.iter_any():
                        ex.feed(data, perf())
                    ex.flush(perf())
        except TimeoutError:
            ex.error = f"timed out after {timeout:g} s"
        except (aiohttp.ClientError, OSError) as exc:
            ex.error = f"{type(exc).__name__}: {exc}"
        finally:
            ex.done = True

    async def close(self) -> None:
        """Close the session and its connections."""
        if self._session is not None:
            await self._session.close()
            self._session = None
