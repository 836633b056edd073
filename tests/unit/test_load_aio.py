"""run_sync: a coroutine made for the loop is never left un-awaited, whatever lands between making and
running it (a signal turned into an exception, as autotune.interrupts does)."""

from __future__ import annotations

import asyncio
import gc
import warnings
from collections.abc import Coroutine
from typing import Any

import pytest

from autotune.errors import LoadError
from autotune.load.aio import run_sync


async def _answer() -> int:
    await asyncio.sleep(0)
    return 42


def test_runs_the_coroutine_it_makes_and_returns_its_result() -> None:
    assert run_sync(_answer) == 42


def test_a_coroutine_made_but_never_run_is_closed_quietly(monkeypatch: pytest.MonkeyPatch) -> None:
    """An exception between making the coroutine and running it (here: the runner's run raising at once,
    as a SIGTERM's exception would) propagates, and the coroutine is closed: no 'coroutine ... was never
    awaited' RuntimeWarning, which would print after the tuner's interrupt line."""
    made: list[Coroutine[Any, Any, int]] = []

    def make() -> Coroutine[Any, Any, int]:
        made.append(_answer())
        return made[-1]

    def interrupted(self: asyncio.Runner, coro: Coroutine[Any, Any, Any], **_: Any) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(asyncio.Runner, "run", interrupted)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(KeyboardInterrupt):
            run_sync(make)
        gc.collect()
    assert len(made) == 1 and made[0].cr_frame is None, "the coroutine was left open"
    assert not [w for w in caught if "never awaited" in str(w.message)], [str(w.message) for w in caught]


def test_inside_a_running_loop_it_refuses_without_making_the_coroutine() -> None:
    made: list[object] = []

    def make() -> Coroutine[Any, Any, int]:
        made.append(1)
        return _answer()

    async def inside() -> None:
        with pytest.raises(LoadError, match="inside a running event loop"):
            run_sync(make)

    asyncio.run(inside())
    assert made == []
