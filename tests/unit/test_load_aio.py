"""run_sync, start_task and the load workers: a signal turned into an exception (as autotune.interrupts does),
landing anywhere in a run, leaves nothing for Python or asyncio to print: no coroutine never awaited, no
task destroyed while pending, no task exception never retrieved, no error from the loop's shutdown, no
traceback from a worker process.

Each test fails on an earlier version: a run_sync that took a made coroutine (never awaited when the loop
could not start), one that closed the coroutine while its task was still pending ("cannot reuse already
awaited coroutine" at the shutdown; "Task exception was never retrieved"), one whose shutdown a repeated
interrupt could cut short ("Task was destroyed but it is pending!"); workers that printed a traceback when
the parent stopped waiting for them.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import inspect
import logging
import multiprocessing
import os
import signal
import socket
import threading
import warnings
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

import aiohttp
import pytest
import uvloop

from autotune import interrupts
from autotune.errors import Interrupted, LoadError
from autotune.load import workers
from autotune.load.aio import run_sync, start_task
from autotune.load.client import load_job, run_requests, run_requests_async
from autotune.load.records import Preparation
from autotune.load.request import RequestSpec


async def _answer() -> int:
    await asyncio.sleep(0)
    return 42


@pytest.fixture
def printed(caplog: pytest.LogCaptureFixture) -> Iterator[Callable[[], list[str]]]:
    """What asyncio logged and Python warned (RuntimeWarning 'never awaited' included) in the test, after
    a garbage collection: call it at the end; it must be empty."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        caplog.set_level(logging.DEBUG, logger="asyncio")

        def read() -> list[str]:
            gc.collect()  # a task or coroutine dropped reports itself when collected
            logged = [r for r in caplog.records if r.name == "asyncio" and r.levelno >= logging.WARNING]
            return [f"warning: {w.message}" for w in caught] + [f"asyncio: {r.getMessage()}" for r in logged]

        yield read


@pytest.fixture
def signals(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """The CLI's signal handling (SIGTERM raises Interrupted, raised again every 20 ms until acknowledged);
    the event is set at each redelivery. Acknowledged afterwards."""
    redelivered = threading.Event()
    on_alarm = interrupts._on_alarm

    def counting(signum: int, frame: Any) -> None:
        redelivered.set()
        on_alarm(signum, frame)

    monkeypatch.setattr(interrupts, "REDELIVER_S", 0.02)
    monkeypatch.setattr(interrupts, "_on_alarm", counting)
    with interrupts.stop_on_signals():
        try:
            yield redelivered
        finally:
            interrupts.acknowledge()


def _raises_interrupted(call: Callable[[], object]) -> bool:
    """Whether ``call()`` raised Interrupted (acknowledged at once, as the study does)."""
    try:
        call()
    except Interrupted:
        return True
    finally:
        interrupts.acknowledge()
    return False


def _interrupted(make: Callable[[], Coroutine[Any, Any, Any]]) -> bool:
    """Whether ``run_sync(make)`` raised Interrupted (acknowledged at once)."""
    return _raises_interrupted(lambda: run_sync(make))


def _sigterm_soon() -> None:
    """SIGTERM to this process from a loop callback: the interrupt is raised while the loop waits, in the
    loop's own code (uvloop handles the signal's wake-up), not in a task."""
    asyncio.get_running_loop().call_soon(os.kill, os.getpid(), signal.SIGTERM)


def test_runs_the_coroutine_it_makes_and_returns_its_result() -> None:
    assert run_sync(_answer) == 42


def test_a_loop_that_cannot_start_leaves_no_coroutine_unawaited(
    monkeypatch: pytest.MonkeyPatch, printed: Callable[[], list[str]]
) -> None:
    """The interrupt lands before the run starts (here: the event loop's creation raises it): the load
    client's coroutine is never made, or closed unstarted; nothing says it was never awaited (the CI
    failure: 'coroutine run_requests_async was never awaited' after the tuner's interrupt line)."""

    def interrupted() -> asyncio.AbstractEventLoop:
        raise Interrupted(signal.SIGTERM)

    monkeypatch.setattr(uvloop, "new_event_loop", interrupted)
    one = RequestSpec(input_len=4, output_len=2, prompt="hi")
    with pytest.raises(Interrupted):
        run_requests(load_job("http://127.0.0.1:9", "m", "completions", [one], [0.0]))
    assert printed() == []


def test_an_interrupt_between_making_the_coroutine_and_running_it_closes_it(
    monkeypatch: pytest.MonkeyPatch, printed: Callable[[], list[str]]
) -> None:
    """The interrupt lands once the coroutine is made, before the loop runs it (here: the loop's first
    run raises it): the coroutine is closed unstarted, silently, and the loop is still shut down."""
    loops: list[asyncio.AbstractEventLoop] = []

    class Interrupting(asyncio.SelectorEventLoop):
        def run_until_complete(self, future: Any) -> Any:
            if not loops:
                loops.append(self)
                raise Interrupted(signal.SIGTERM)
            return super().run_until_complete(future)

    made: list[Coroutine[Any, Any, int]] = []

    def make() -> Coroutine[Any, Any, int]:
        made.append(_answer())
        return made[-1]

    monkeypatch.setattr(uvloop, "new_event_loop", Interrupting)
    assert _interrupted(make)
    assert [inspect.getcoroutinestate(c) for c in made] == [inspect.CORO_CLOSED], "left open"
    assert loops[0].is_closed()
    assert printed() == []


def test_a_signal_while_the_loop_waits_runs_every_task_to_its_end(
    signals: threading.Event, printed: Callable[[], list[str]]
) -> None:
    """The interrupt raised in the loop's own code (no task running): it propagates, and before that the
    run and its tasks are cancelled and unwind completely (an ``await`` in their ``finally`` included),
    the loop is closed, and nothing is printed."""
    unwound: list[str] = []

    async def child() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            await asyncio.sleep(0)
            unwound.append("child")

    async def run() -> None:
        task = start_task(child)
        try:
            _sigterm_soon()
            await asyncio.Event().wait()
        finally:
            await asyncio.sleep(0)
            unwound.append("run")
        await task

    assert _interrupted(run)
    assert sorted(unwound) == ["child", "run"]
    assert printed() == []


def test_an_interrupt_raised_in_a_task_is_not_reported_again(
    printed: Callable[[], list[str]],
) -> None:
    """The interrupt raised in a task's code (the signal arrived while it ran) goes on out of the loop; the
    copy the task keeps is not logged as 'Task exception was never retrieved'."""

    async def child() -> None:
        raise Interrupted(signal.SIGTERM)

    async def run() -> None:
        start_task(child)
        await asyncio.Event().wait()

    assert _interrupted(run)
    assert printed() == []


def test_an_error_a_task_kept_is_still_reported(printed: Callable[[], list[str]]) -> None:
    """Only interrupts are kept quiet: a task's own error that nobody retrieved is logged as asyncio does."""

    async def child() -> None:
        raise ValueError("lost")

    async def run() -> None:
        start_task(child)
        await asyncio.sleep(0)

    run_sync(run)
    assert any("never retrieved" in line for line in printed())


def test_a_repeated_interrupt_cannot_cut_the_shutdown_short(
    signals: threading.Event, printed: Callable[[], list[str]]
) -> None:
    """The interrupt is raised again every REDELIVER_S until the study acknowledges it; one arriving while
    the run unwinds is held until the loop is shut down (then raised), so the unwinding completes and no
    task is left pending."""
    unwound: list[bool] = []

    async def run() -> None:
        try:
            _sigterm_soon()
            await asyncio.Event().wait()
        finally:
            signals.clear()
            unwound.append(signals.wait(5.0))  # a redelivery arrives while the run unwinds
            await asyncio.sleep(0)
            unwound.append(True)

    assert _interrupted(run)
    assert unwound == [True, True]
    assert printed() == []


def test_start_task_holds_a_signal_until_the_task_exists(
    signals: threading.Event, printed: Callable[[], list[str]]
) -> None:
    """A signal that arrives while the coroutine is being made is raised once its task is scheduled: the
    coroutine is run (cancelled by the shutdown), never left un-awaited."""
    started: list[Coroutine[Any, Any, None]] = []

    async def child() -> None:
        await asyncio.Event().wait()

    def make() -> Coroutine[Any, Any, None]:
        started.append(child())
        os.kill(os.getpid(), signal.SIGTERM)  # held: the handler runs here, and raises nothing yet
        return started[-1]

    async def run() -> None:
        start_task(make)
        await asyncio.Event().wait()

    assert _interrupted(run)
    assert [inspect.getcoroutinestate(c) for c in started] == [inspect.CORO_CLOSED], "not run to its end"
    assert printed() == []


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


# ----------------------------------------------------------------------------------------------
# Worker processes (client_workers > 1): a signal to the tuner leaves them quiet
# ----------------------------------------------------------------------------------------------


@pytest.fixture
def silent_server() -> Iterator[str]:
    """A server that accepts connections and never answers: a run on it lasts until it is stopped."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


def _two_worker_run(url: str) -> None:
    one = RequestSpec(input_len=4, output_len=2, prompt="hi")
    run_requests(load_job(url, "m", "completions", [one] * 4, [0.0] * 4, request_timeout=60.0), workers=2)


@pytest.fixture
def timers() -> Iterator[list[threading.Timer]]:
    """Timers a test starts to signal it later, cancelled when it ends: a signal sent after a test that
    failed early would reach whatever runs next (under pytest-xdist, a KeyboardInterrupt ends the worker)."""
    started: list[threading.Timer] = []
    yield started
    for timer in started:
        timer.cancel()
        timer.join()


def _later(timers: list[threading.Timer], seconds: float, call: Callable[..., object], *args: object) -> None:
    timer = threading.Timer(seconds, call, args)
    timers.append(timer)
    timer.start()


def _ctrl_c(timers: list[threading.Timer]) -> None:
    """SIGINT to the load workers and then, 0.5 s later, to this process, as a Ctrl-C at a terminal sends
    it to the whole foreground process group (the workers first: one that took it would have reported a
    failure by the time this process gets it)."""
    for proc in multiprocessing.active_children():
        if proc.pid is not None:
            os.kill(proc.pid, signal.SIGINT)
    _later(timers, 0.5, os.kill, os.getpid(), signal.SIGINT)


@pytest.mark.parametrize("when", ["starting", "running", "ctrl-c"])
def test_a_signal_during_a_run_on_worker_processes_prints_nothing(
    monkeypatch: pytest.MonkeyPatch,
    signals: threading.Event,
    silent_server: str,
    capfd: pytest.CaptureFixture[str],
    timers: list[threading.Timer],
    when: str,
) -> None:
    """SIGTERM to the tuner while its load workers start or while they run, or SIGINT to its workers and
    to it (a Ctrl-C) while they run: the tuner's interrupt propagates (not a worker's failure), the workers
    are stopped, and none prints anything (they printed a traceback each: a semaphore gone with the
    parent's objects, a broken pipe to the parent, a KeyboardInterrupt)."""
    await_ready = workers._await_ready
    readies: list[object] = []

    def interrupted_at(conn: Any) -> None:
        if when == "starting":
            os.kill(os.getpid(), signal.SIGTERM)  # raised here: the workers are still starting
        await_ready(conn)
        readies.append(conn)
        if len(readies) == 2:  # both ready: the start is sent next, and the run never ends on its own
            if when == "ctrl-c":
                _later(timers, 0.3, _ctrl_c, timers)
            else:
                _later(timers, 0.3, os.kill, os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(workers, "_await_ready", interrupted_at)
    assert _raises_interrupted(lambda: _two_worker_run(silent_server))
    assert multiprocessing.active_children() == []
    assert capfd.readouterr().err == ""


async def _stuck(job: workers.Job, stop: object, start_at: Callable[[], float]) -> object:
    """A worker's run that takes the shared start and then never ends (a stuck event loop)."""
    start_at()
    await asyncio.sleep(3600)
    raise AssertionError("a stuck run ended")


def test_a_stuck_worker_is_abandoned_when_its_run_must_be_over(monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker that sends nothing back is waited for as long as its requests could take (each cut at
    the request timeout) and a slack, not for ever: the run fails saying so and the worker is stopped."""
    monkeypatch.setattr(workers, "RESULT_SLACK_S", 0.5)
    monkeypatch.setattr(workers, "WORKER_STOP_TIMEOUT", 0.5)  # the stuck worker is terminated, not awaited
    one = RequestSpec(input_len=4, output_len=2, prompt="hi")
    job = workers.Job("http://127.0.0.1:9", "m", "completions", [one] * 2, [0.0, 0.2], [0, 1], True, 0.0, 1.0,
                      None, "raw", {}, "p", Preparation())  # fmt: skip
    with pytest.raises(LoadError, match=r"a load worker sent no result within 2 s of the run's start"):
        workers.run_workers(job, 2, None, _stuck)  # type: ignore[arg-type]
    assert not multiprocessing.active_children()


def test_worker_runs_share_nothing_on_the_multiprocessing_heap(monkeypatch: pytest.MonkeyPatch) -> None:
    """The shared objects of a run over worker processes are events only: a ``Value`` on multiprocessing's
    heap, interrupted while allocated or freed (a signal's redelivery in its finalizer), left the heap
    broken for the rest of the process; the next run failed with "pop from empty list"."""
    import multiprocessing.heap

    def no_heap(size: int) -> None:
        raise AssertionError(f"{size} bytes taken on multiprocessing's heap")

    monkeypatch.setattr(multiprocessing.heap, "BufferWrapper", no_heap)
    monkeypatch.setattr(workers, "RESULT_SLACK_S", 0.5)
    monkeypatch.setattr(workers, "WORKER_STOP_TIMEOUT", 0.5)
    one = RequestSpec(input_len=4, output_len=2, prompt="hi")
    job = workers.Job("http://127.0.0.1:9", "m", "completions", [one] * 2, [0.0, 0.2], [0, 1], True, 0.0, 1.0,
                      None, "raw", {}, "p", Preparation())  # fmt: skip
    with pytest.raises(LoadError, match=r"sent no result"):  # the run itself, not the heap, ends it
        workers.run_workers(job, 2, None, _stuck)  # type: ignore[arg-type]


@pytest.mark.parametrize("engine", ["raw", "aiohttp"])
def test_a_run_cancelled_midway_gives_the_collector_back(silent_server: str, engine: str) -> None:
    """A run freezes and disables the garbage collector while it measures; one that ends by an exception
    (here cancelled while its requests wait on a silent server) gives it back as it found it, or the
    process would run without a collector from then on."""
    one = RequestSpec(input_len=4, output_len=2, prompt="hi")

    async def cancelled_midway() -> None:
        task = start_task(
            lambda: run_requests_async(
                load_job(
                    silent_server,
                    "m",
                    "completions",
                    [one] * 2,
                    [0.0, 0.0],
                    request_timeout=60.0,
                    engine=engine,
                )
            )
        )
        for _ in range(1000):  # the run has started measuring once the collector is off
            if not gc.isenabled():
                break
            await asyncio.sleep(0.01)
        assert not gc.isenabled(), "the run never started measuring"
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    assert gc.isenabled() and gc.get_freeze_count() == 0
    asyncio.run(cancelled_midway())
    assert gc.isenabled()
    assert gc.get_freeze_count() == 0


def test_an_interrupt_once_aiohttp_made_its_request_closes_it(
    monkeypatch: pytest.MonkeyPatch, signals: threading.Event, printed: Callable[[], list[str]]
) -> None:
    """aiohttp's ``session.post`` makes the request's coroutine before ``async with`` awaits it: an interrupt
    landing in between is held until the engine has the request, which is then closed unstarted; nothing
    says it was never awaited (a user saw that line after the tuner's interrupt line)."""
    made: list[Any] = []
    post = aiohttp.ClientSession.post

    def interrupting_post(self: aiohttp.ClientSession, *args: Any, **kwargs: Any) -> Any:
        made.append(post(self, *args, **kwargs))
        os.kill(os.getpid(), signal.SIGTERM)  # the handler raises here, once the coroutine exists
        return made[-1]

    monkeypatch.setattr(aiohttp.ClientSession, "post", interrupting_post)
    with socket.socket() as sock:  # a port nobody listens on: the preconnect is refused at once
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    one = RequestSpec(input_len=4, output_len=2, prompt="hi")
    assert _raises_interrupted(
        lambda: run_requests(
            load_job(url, "m", "completions", [one], [0.0], request_timeout=5.0, engine="aiohttp")
        )
    )
    assert [inspect.getcoroutinestate(m._coro) for m in made] == [inspect.CORO_CLOSED]
    assert printed() == []
