"""The load client's HTTP engines behind one interface: ``raw`` (the default) and ``aiohttp``."""

from __future__ import annotations

from typing import Literal, Protocol

from autotune.load._aiohttp import AiohttpPool
from autotune.load._rawhttp import RawPool
from autotune.load.exchange import Exchange

Engine = Literal["aiohttp", "raw"]


class Pool(Protocol):
    """Connections to one server that stream responses into :class:`~autotune.load.exchange.Exchange`."""

    async def post(self, path: str, body: bytes, ex: Exchange, timeout: float) -> None:
        """POST ``body`` to ``path``; fill ``ex`` until the response ends, fails or times out."""
        ...

    async def close(self) -> None:
        """Close every connection."""
        ...


def open_pool(engine: Engine, base_url: str) -> Pool:
    """A pool of ``engine`` for ``base_url`` (``http://host:port``, no path)."""
    return RawPool(base_url) if engine == "raw" else AiohttpPool(base_url)
