"""Running the load client's coroutines from synchronous code, on a fresh (uvloop) event loop.

A study stops on a signal as an exception (:class:`~autotune.errors.Interrupted`, raised in the main
thread wherever it is: :mod:`autotune.interrupts`). :func:`run_sync` makes sure such an exception, landing
anywhere in a run, leaves nothing for Python or asyncio to print afterwards: no coroutine that was never
awaited, no task destroyed while pending, no task exception never retrieved.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from autotune.errors import Interrupted, LoadError
from autotune.interrupts import shielded

_T = TypeVar("_T")


def run_sync(make: Callable[[], Coroutine[Any, Any, _T]]) -> _T:
    """Run the coroutine ``make()`` returns on a fresh event loop (uvloop when installed) in this thread.

    The coroutine is made here, once the loop exists, and whatever exception lands where (a signal
    turned into :class:`~autotune.errors.Interrupted` included), the loop is shut down before it
    propagates: every task still pending is cancelled and run to its end, the loop is closed, and a
    coroutine never started is closed quietly. The shutdown holds a stopping signal until it is done
    (:func:`~autotune.interrupts.shielded`), so a repeated interrupt cannot cut it short either. An
    :class:`~autotune.errors.Interrupted` that a task of the run raised is the one that stops the study:
    the copy the task keeps is not reported again (as "Task exception was never retrieved").

    Raises :class:`LoadError` when called from a thread whose event loop is already running.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        raise LoadError("run_requests() was called inside a running event loop: use run_requests_async()")
    loop: asyncio.AbstractEventLoop | None = None
    coro: Coroutine[Any, Any, _T] | None = None
    try:
        with shielded():  # made and recorded at once: an interrupt is raised once each is ours to close
            loop = _new_loop()
            coro = make()
        # Given a coroutine, the loop wraps it in a task of its own and retrieves that task's exception.
        return loop.run_until_complete(coro)
    finally:
        with shielded():
            if loop is not None:
                _shut_down(loop)
            if coro is not None and inspect.getcoroutinestate(coro) == inspect.CORO_CREATED:
                coro.close()  # made, never started (nothing to run: closing it is silent)


def start_task(make: Callable[[], Coroutine[Any, Any, _T]]) -> asyncio.Task[_T]:
    """``asyncio.create_task(make())`` on the running loop, with stopping signals held from before the
    coroutine is made until its task is scheduled: an interrupt cannot land between the two and leave
    a coroutine that is never awaited (it is raised once the task exists, and the loop's shutdown
    cancels the task)."""
    with shielded():
        return asyncio.create_task(make())


def _new_loop() -> asyncio.AbstractEventLoop:
    """A new event loop (uvloop when installed) that does not report a task's copy of an interrupt."""
    try:
        import uvloop

        loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        loop = asyncio.new_event_loop()
    loop.set_exception_handler(_quiet_interrupts)
    return loop


def _quiet_interrupts(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """The loop's exception handler: an interrupt a task kept is dropped (like a task, the interrupt went
    on out of the loop to the study, which handles it); anything else is reported as asyncio does."""
    if isinstance(context.get("exception"), Interrupted):
        return
    loop.default_exception_handler(context)


def _shut_down(loop: asyncio.AbstractEventLoop) -> None:
    """Cancel the loop's pending tasks and run them to their end, finish its async generators, close it."""
    try:
        pending = asyncio.all_tasks(loop)
        for task in pending:
            task.cancel()
        if pending:
            # Collected with return_exceptions: an error raised while a task unwinds is not reported
            # (the run already failed with the exception that propagates).
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.run_until_complete(loop.shutdown_default_executor())
    finally:
        loop.close()
