"""The ``aiohttp`` engine of the load client: one session without a connection limit, ``iter_any()`` reads.

The alternative to the raw engine (``measurement.client: aiohttp``): the same
:class:`~autotune.load.exchange.Exchange` decoding and per-read ``perf_counter()``, over aiohttp's
connection pool (``TCPConnector(limit=0)``: its default of 100 connections would throttle a probe). A
request's send time is taken when aiohttp has written its body (a trace hook), after the connection is
ready, as in the raw engine. A request that the server drops unanswered on a kept-alive connection (the
idle-timeout race) is sent once more on a fresh connection (a second session whose connections are never
reused), as the raw engine does.

aiohttp's ``session.post(...)`` makes the request's coroutine at once and awaits it only when its
``async with`` is entered: a stopping signal raised in between (:mod:`autotune.interrupts`) would drop it
unawaited, and Python would print "coroutine ... was never awaited" after the tuner's interrupt line. Each
request is made with signals held and closed if it was never entered (:func:`_request`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Mapping
from types import SimpleNamespace
from typing import Any

import aiohttp

from autotune.interrupts import shielded
from autotune.load.aio import start_task
from autotune.load.exchange import Exchange

_HEADERS = {"Content-Type": "application/json", "Accept": "text/event-stream"}


class _Attempt:
    """One sending of a request, as the trace hooks see it."""

    __slots__ = ("ex", "reused")

    def __init__(self, ex: Exchange) -> None:
        self.ex = ex
        self.reused = False
        """It went out on a kept-alive connection."""


async def _sent(_session: aiohttp.ClientSession, ctx: SimpleNamespace, _params: Any) -> None:
    """Trace hook: the request body went out; stamp the exchange's send time."""
    attempt = ctx.trace_request_ctx
    if isinstance(attempt, _Attempt):
        attempt.ex.send = time.perf_counter()


async def _reused(_session: aiohttp.ClientSession, ctx: SimpleNamespace, _params: Any) -> None:
    """Trace hook: the request got a kept-alive connection from the pool."""
    attempt = ctx.trace_request_ctx
    if isinstance(attempt, _Attempt):
        attempt.reused = True


_DROPPED = (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError, ConnectionResetError)
"""What a connection closed by the server before it answered raises."""


@contextlib.asynccontextmanager
async def _request(
    make: Callable[[], aiohttp.client._RequestContextManager],
) -> AsyncIterator[aiohttp.ClientResponse]:
    """``async with make() as response``, with the request's coroutine made while stopping signals are
    held and closed if it was never awaited (closing one that ran is a no-op)."""
    request = None
    try:
        with shielded():
            request = make()
        async with request as response:
            yield response
    finally:
        if request is not None:
            request.close()


class AiohttpPool:
    """Connections to one server through an aiohttp session (made at the first request, in its loop)."""

    def __init__(self, base_url: str, headers: Mapping[str, str] | None = None) -> None:
        self._base = base_url.rstrip("/")
        self._headers = {**_HEADERS, **(headers or {})}
        self._session: aiohttp.ClientSession | None = None
        self._fresh: aiohttp.ClientSession | None = None
        """For a request sent again: a new connection every time."""

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = _new_session(force_close=False)
        return self._session

    def _open_fresh(self) -> aiohttp.ClientSession:
        if self._fresh is None:
            self._fresh = _new_session(force_close=True)
        return self._fresh

    async def preconnect(self, count: int, timeout: float) -> int:
        """Open about ``count`` connections (concurrent ``GET /health``, kept alive); returns how many
        requests succeeded."""
        session = self._open()

        async def one() -> bool:
            try:
                async with _request(
                    lambda: session.get(self._base + "/health", headers=self._headers)
                ) as resp:
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
        """POST ``body`` to ``path`` and fill ``ex`` until the response ends, fails or times out.

        A kept-alive connection that the server closed before answering (the idle-timeout race) is
        retried once on a fresh connection; nothing else is retried."""
        deadline = time.perf_counter() + timeout
        first = _Attempt(ex)
        dropped = await self._attempt(self._open(), path, body, first, timeout, headers)
        if dropped and first.reused and ex.status is None and not ex.times:
            ex.error = ""
            ex.done = False
            remaining = max(0.001, deadline - time.perf_counter())
            await self._attempt(self._open_fresh(), path, body, _Attempt(ex), remaining, headers)

    async def _attempt(
        self,
        session: aiohttp.ClientSession,
        path: str,
        body: bytes,
        attempt: _Attempt,
        timeout: float,
        headers: Mapping[str, str] | None,
    ) -> bool:
        """Send once; True when the connection was closed under the request (``ex.error`` says so)."""
        ex = attempt.ex
        perf = time.perf_counter
        dropped = False
        try:
            async with _request(
                lambda: session.post(
                    self._base + path,
                    data=body,
                    headers={**self._headers, **(headers or {})},
                    timeout=aiohttp.ClientTimeout(total=timeout),
                    trace_request_ctx=attempt,
                )
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
            dropped = isinstance(exc, _DROPPED)
        finally:
            ex.done = True
        return dropped

    async def close(self) -> None:
        """Close the sessions and their connections."""
        for session in (self._session, self._fresh):
            if session is not None:
                await session.close()
        self._session = self._fresh = None


def _new_session(*, force_close: bool) -> aiohttp.ClientSession:
    """A session without a connection limit whose trace hooks stamp each request's send and reuse."""
    connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=None, force_close=force_close)
    trace = aiohttp.TraceConfig()
    trace.on_request_chunk_sent.append(_sent)
    trace.on_connection_reuseconn.append(_reused)
    return aiohttp.ClientSession(connector=connector, auto_decompress=False, trace_configs=[trace])
