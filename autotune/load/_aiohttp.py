"""The ``aiohttp`` engine of the load client: one session without a connection limit, ``iter_any()`` reads.

The alternative to the raw engine (``measurement.client: aiohttp``): the same
:class:`~autotune.load.exchange.Exchange` decoding and per-read ``perf_counter()``, over aiohttp's
connection pool (``TCPConnector(limit=0)``: its default of 100 connections would throttle a probe).
"""

from __future__ import annotations

import time

import aiohttp

from autotune.load.exchange import Exchange

_HEADERS = {"Content-Type": "application/json", "Accept": "text/event-stream"}


class AiohttpPool:
    """Connections to one server through an aiohttp session (made at the first request, in its loop)."""

    def __init__(self, base_url: str) -> None:
        self._base = base_url.rstrip("/")
        self._session: aiohttp.ClientSession | None = None

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=None)
            self._session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
        return self._session

    async def post(self, path: str, body: bytes, ex: Exchange, timeout: float) -> None:
        """POST ``body`` to ``path`` and fill ``ex`` until the response ends, fails or times out."""
        session = self._open()
        perf = time.perf_counter
        try:
            async with session.post(
                self._base + path, data=body, headers=_HEADERS, timeout=aiohttp.ClientTimeout(total=timeout)
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
