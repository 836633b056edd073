"""The load client's HTTP engines behind one interface: ``raw`` (the default) and ``aiohttp``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal, Protocol

from autotune.load._aiohttp import AiohttpPool
from autotune.load._rawhttp import RawPool
from autotune.load.exchange import Exchange

Engine = Literal["aiohttp", "raw"]


class Pool(Protocol):
    """Connections to one server that stream responses into :class:`~autotune.load.exchange.Exchange`."""

    async def preconnect(self, count: int, timeout: float) -> int:
        """Open about ``count`` connections ahead of a run."""
        ...

    async def post(
        self,
        path: str,
        body: bytes,
        ex: Exchange,
        timeout: float,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        """POST ``body`` to ``path`` (with ``headers`` beyond the pool's); fill ``ex`` until the response
        ends, fails or times out. ``ex.send`` is stamped when the request is written."""
        ...

    async def close(self) -> None:
        """Close every connection."""
        ...


def open_pool(engine: Engine, base_url: str, headers: Mapping[str, str] | None = None) -> Pool:
    """A pool of ``engine`` for ``base_url`` (``http[s]://host:port``, no path) sending ``headers``."""
    return RawPool(base_url, headers) if engine == "raw" else AiohttpPool(base_url, headers)
