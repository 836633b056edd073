"""Signals as an exception: delivered once, held by shields, never lost, not printed when Python drops one."""

from __future__ import annotations

import logging
import os
import signal
import time

import pytest

from autotune.errors import Interrupted
from autotune.interrupts import acknowledge, shielded, stop_on_signals


def _wait_for_interrupt(seconds: float = 3.0, send: int | None = None) -> Interrupted | None:
    """The interrupt caught within ``seconds`` (after sending ``send`` to this process), acknowledged."""
    deadline = time.monotonic() + seconds
    try:
        if send is not None:
            os.kill(os.getpid(), send)
        while time.monotonic() < deadline:
            time.sleep(0.01)
    except Interrupted as caught:
        acknowledge()
        return caught
    return None


def test_a_signal_raises_interrupted_with_its_number() -> None:
    with stop_on_signals():
        caught = _wait_for_interrupt(send=signal.SIGTERM)
    assert caught is not None and caught.signum == signal.SIGTERM


def test_a_shield_holds_the_signal_until_it_ends() -> None:
    with stop_on_signals():
        finished = False
        try:
            with shielded():
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.6)  # longer than a redelivery period: still held
                finished = True
        except Interrupted:
            acknowledge()
        else:
            pytest.fail("the held signal was not raised when the shield ended")
    assert finished


def test_an_interrupt_dropped_by_python_is_silent_and_delivered_again(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """Raised inside a ``__del__`` (as in a GC callback), the interrupt is dropped by Python; it is not
    printed, and the next redelivery reaches the main code."""

    class Dropper:
        def __del__(self) -> None:
            os.kill(os.getpid(), signal.SIGTERM)  # the handler raises here, inside __del__
            time.sleep(0.05)

    with stop_on_signals():
        Dropper()  # deleted at once: the interrupt raised in __del__ is unraisable
        caught = _wait_for_interrupt()
    assert caught is not None and caught.signum == signal.SIGTERM
    assert "Traceback" not in capfd.readouterr().err


@pytest.mark.parametrize("cleanup_fails", [False, True], ids=["logged", "cleanup-failed-after"])
def test_an_interrupt_a_library_catches_and_logs_is_not_printed(
    capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, cleanup_fails: bool
) -> None:
    """SQLAlchemy's pool catches what its connection reset raised, logs it with the traceback ("Exception
    during reset or similar") and raises it again: with no logging configured that reached stderr. Or
    its cursor's close, run while the interrupt is handled, fails on the database the interrupt closed
    and is logged ("Error closing cursor": an error whose context is the interrupt). The record is
    dropped; the interrupt still reaches the main code, and other errors are still printed."""
    monkeypatch.setattr(logging.root, "handlers", [])  # as in the CLI: records reach logging's last resort
    library = logging.getLogger("autotune.tests.library")

    def close_cursor() -> None:
        try:
            raise RuntimeError("Cannot operate on a closed database.")
        except RuntimeError:
            library.error("Error closing cursor", exc_info=True)

    def reset_connection() -> None:
        try:
            os.kill(os.getpid(), signal.SIGINT)  # the handler raises here, inside the library's cleanup
            time.sleep(0.05)
        except BaseException:
            if cleanup_fails:
                close_cursor()
            else:
                library.error("Exception during reset or similar", exc_info=True)
            raise

    with stop_on_signals():
        with pytest.raises(Interrupted) as caught:
            reset_connection()
        acknowledge()
        assert caught.value.signum == signal.SIGINT
        library.error("a real failure", exc_info=ValueError("disk full"))
    err = capfd.readouterr().err
    assert "Exception during reset" not in err and "Interrupted" not in err
    assert "Error closing cursor" not in err and "closed database" not in err
    assert "a real failure" in err and "ValueError: disk full" in err


def test_after_acknowledge_further_signals_are_ignored() -> None:
    with stop_on_signals():
        assert _wait_for_interrupt(send=signal.SIGTERM) is not None
        assert _wait_for_interrupt(0.8, send=signal.SIGTERM) is None
