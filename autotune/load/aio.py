"""Running the load client's coroutines from synchronous code, on a fresh (uvloop) event loop."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from autotune.errors import LoadError

_T = TypeVar("_T")


def run_sync(coro: Coroutine[Any, Any, _T]) -> _T:
    """Run ``coro`` on a fresh event loop (uvloop when installed) in this thread and return its result.

    Raises :class:`LoadError` when called from a thread whose event loop is already running.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        coro.close()
        raise LoadError("run_requests() was called inside a running event loop: use run_requests_async()")
    factory: Callable[[], asyncio.AbstractEventLoop] | None = None
    try:
        import uvloop

        factory = uvloop.new_event_loop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        factory = None
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(coro)
