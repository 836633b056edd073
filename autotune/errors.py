"""The one exception tree of autotune.

Every error the tool raises on purpose derives from :class:`AutotuneError`. Third-party errors are
wrapped at the boundary (``raise SpecError(...) from exc``). The CLI prints ``str(error)`` as one line
and exits with :attr:`AutotuneError.exit_code`.
"""

from __future__ import annotations

import signal


class AutotuneError(Exception):
    """Base of every error autotune raises on purpose. ``str()`` is one actionable line."""

    exit_code: int = 1
    transient: bool = False
    """A fault of the tuner or its environment that may pass (a port taken, a GPU briefly held, a run the
    client could not measure, storage briefly unreachable): the study retries it with a pause, a few
    times, before it stops. It never becomes data about a config."""


class SpecError(AutotuneError):
    """Bad user input (study spec, search space, CLI option): names the field path and the value."""

    exit_code = 2

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}" if field else message)


class ServerError(AutotuneError):
    """A server could not be launched, reached or stopped for reasons that are not the config's fault."""


class PortInUseError(ServerError):
    """The port the server should bind is already taken by another process."""

    transient = True


class TeardownError(ServerError):
    """A server's process group survived SIGKILL or its port stayed busy."""


class LoadError(AutotuneError):
    """The load generator could not run (bad dataset, unreachable server, invalid run)."""


class InvalidMeasurementError(LoadError):
    """A run checked itself and found it cannot be trusted (client fell behind, counts disagree)."""

    transient = True


class StudyError(AutotuneError):
    """The study cannot proceed (storage unreachable, no trials to export, ...)."""


class StorageUnavailableError(StudyError):
    """The study's storage did not answer (a database restarting, a network hiccup)."""

    transient = True


class StorageDamagedError(StudyError):
    """The study's storage file is damaged (empty, not SQLite, corrupt pages, a journal line that is not a
    whole record): nothing is written to it; the message says how to repair it."""


class DiskFullError(StudyError):
    """A write found no space left on its device (the storage, the event log, a probe file). Not
    transient: a full disk needs someone to free space, and retrying writes into it could cut more
    records short."""


class ExportError(AutotuneError):
    """The chosen trial cannot be exported."""


class Interrupted(KeyboardInterrupt):
    """The tuner got SIGTERM, SIGINT or SIGHUP: stop the trial's server, give the trial back, exit.

    A :class:`KeyboardInterrupt` so that it unwinds through event loops and ``finally`` blocks the way
    Ctrl-C does (asyncio and uvloop re-raise it instead of logging it).
    """

    def __init__(self, signum: int) -> None:
        self.signum = signum
        self.name = signal.Signals(signum).name
        super().__init__(f"interrupted by {self.name}")

    @property
    def exit_code(self) -> int:
        """128 + the signal number, as a shell reports a process killed by that signal."""
        return 128 + self.signum
