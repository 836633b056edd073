"""Running the load client's coroutines from synchronous code, on a fresh (uvloop) event loop."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from autotune.errors import LoadError

_T = TypeVar("_T")


def run_sync(make: Callable[[], Coroutine[Any, Any, _T]]) -> _T:
    """Run the coroutine ``make()`` returns on a fresh event loop (uvloop when installed) in this thread.

    The coroutine is made here, inside the loop's runner, and closed whatever happens: an exception that
    lands between making it and running it (a signal turned into :class:`~autotune.errors.Interrupted`)
    leaves no coroutine that was never awaited, and so no ``RuntimeWarning`` printed at exit.

    Raises :class:`LoadError` when called from a thread whose event loop is already running.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        raise LoadError("run_requests() was called inside a running event loop: use run_requests_async()")
    factory: Callable[[], asyncio.AbstractEventLoop] | None = None
    try:
        import uvloop

        factory = uvloop.new_event_loop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        factory = None
    with asyncio.Runner(loop_factory=factory) as runner:
        coro = None
        try:
            coro = make()
            return runner.run(coro)
        finally:
            if coro is not None:
                coro.close()  # a no-op once it ran; a coroutine never started is closed quietly
