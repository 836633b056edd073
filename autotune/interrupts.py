"""Signals that stop a study (SIGTERM, SIGINT, SIGHUP) as an exception, and the sections they must not cut.

:func:`stop_on_signals` makes those signals raise :class:`~autotune.errors.Interrupted` in the main thread,
so a study unwinds through its ``finally`` blocks: the trial's server is torn down, the trial is given back.
Code that must not be cut short (launching a server and recording its pid, tearing a server down, writing
a trial's outcome) runs :func:`shielded`: a signal that arrives inside is held and raised when the section
ends.

Python runs a signal handler wherever the main thread is. An exception raised inside a garbage
collector's callback or a ``__del__`` is dropped (and would be printed: the block's unraisable hook keeps
those quiet), and a library that catches every exception where it cleans up may log it before raising it
again (SQLAlchemy's pool: "Exception during reset or similar"), or log the error its cleanup then met
because the interrupt had already closed the connection ("Error closing cursor": an error whose context
is the interrupt); the block's logging filter drops both.
So an interrupt is raised again every :data:`REDELIVER_S` (a SIGALRM timer) until the study says it got
it (:func:`acknowledge`): the first signal is never lost. Once acknowledged, further signals are ignored,
so the teardown always completes (an orphaned server would keep holding the GPU).

Signal dispositions belong to the whole process, so the state here is the process's own: one handler,
one shield depth, one pending signal. Only the CLI installs the handler; without it every function here
is a no-op.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import sys
import threading
from collections.abc import Iterator
from types import FrameType

from autotune.errors import Interrupted

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
REDELIVER_S = 0.5
"""How often an interrupt not yet acknowledged is raised again."""


class _State:
    """The process's signal state (only the main thread runs Python signal handlers)."""

    def __init__(self) -> None:
        self.installed = False
        self.depth = 0
        self.pending: int | None = None
        self.acknowledged = False


_STATE = _State()


def _raise_pending() -> None:
    pending = _STATE.pending
    if pending is not None and not _STATE.acknowledged and _STATE.depth == 0:
        raise Interrupted(pending)


def _on_signal(signum: int, _frame: FrameType | None) -> None:
    if _STATE.acknowledged or _STATE.pending is not None:
        return  # already stopping: the pending interrupt is being (re)delivered
    _STATE.pending = signum
    signal.setitimer(signal.ITIMER_REAL, REDELIVER_S, REDELIVER_S)
    _raise_pending()


def _on_alarm(_signum: int, _frame: FrameType | None) -> None:
    if _STATE.pending is None or _STATE.acknowledged:
        signal.setitimer(signal.ITIMER_REAL, 0)
        return
    _raise_pending()


def acknowledge() -> None:
    """The interrupt reached the code that handles it: stop raising it again (no-op when none)."""
    if _STATE.pending is not None:
        _STATE.acknowledged = True
        signal.setitimer(signal.ITIMER_REAL, 0)


def _from_interrupt(exc: BaseException | None) -> bool:
    """Whether ``exc`` is an interrupt, or was raised while one was handled (its cause or context chain
    holds one: a library's cleanup that failed because the interrupt had already closed what it cleans,
    e.g. SQLAlchemy's "Error closing cursor" on a database the interrupt closed)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, Interrupted):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


def _quiet_dropped_interrupts(previous: object) -> object:
    def hook(unraisable: sys.UnraisableHookArgs) -> None:
        if _from_interrupt(unraisable.exc_value):
            return  # raised where Python cannot propagate it; it is delivered again (_on_alarm)
        previous(unraisable)  # type: ignore[operator]

    return hook


class _QuietLoggedInterrupts(logging.Filter):
    """Drops a log record whose exception is an interrupt or came of handling one: the interrupt is
    delivered again and handled, and says what happened in one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.exc_info is None or not _from_interrupt(record.exc_info[1])


def _stderr_handlers() -> list[logging.Handler]:
    """The handlers a library's log record reaches: the root logger's, else logging's last resort."""
    last_resort = [logging.lastResort] if logging.lastResort is not None else []
    return [*logging.root.handlers, *last_resort]


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """Within the block, SIGTERM, SIGINT and SIGHUP raise :class:`Interrupted` (until acknowledged)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, _on_signal) for sig in SIGNALS}
    previous[signal.SIGALRM] = signal.signal(signal.SIGALRM, _on_alarm)
    _STATE.installed, _STATE.depth, _STATE.pending, _STATE.acknowledged = True, 0, None, False
    previous_hook = sys.unraisablehook
    sys.unraisablehook = _quiet_dropped_interrupts(previous_hook)  # type: ignore[assignment]
    quiet, handlers = _QuietLoggedInterrupts(), _stderr_handlers()
    for handler in handlers:
        handler.addFilter(quiet)
    try:
        yield
    finally:
        for handler in handlers:
            handler.removeFilter(quiet)
        sys.unraisablehook = previous_hook
        signal.setitimer(signal.ITIMER_REAL, 0)
        for sig, old in previous.items():
            signal.signal(sig, old)
        _STATE.installed = False


@contextlib.contextmanager
def shielded() -> Iterator[None]:
    """Hold a stopping signal until the block ends, then raise it (no-op without :func:`stop_on_signals`)."""
    if not _STATE.installed or threading.current_thread() is not threading.main_thread():
        yield
        return
    _STATE.depth += 1
    try:
        yield
    finally:
        _STATE.depth -= 1
        _raise_pending()
