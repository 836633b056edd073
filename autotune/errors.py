"""The one exception tree of autotune.

Every error the tool raises on purpose derives from :class:`AutotuneError`. Third-party errors are
wrapped at the boundary (``raise SpecError(...) from exc``). The CLI prints ``str(error)`` as one line
and exits with :attr:`AutotuneError.exit_code`.
"""

from __future__ import annotations


class AutotuneError(Exception):
    """Base of every error autotune raises on purpose. ``str()`` is one actionable line."""

    exit_code: int = 1


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


class TeardownError(ServerError):
    """A server's process group survived SIGKILL or its port stayed busy."""


class LoadError(AutotuneError):
    """The load generator could not run (bad dataset, unreachable server, invalid run)."""


class InvalidMeasurementError(LoadError):
    """A run checked itself and found it cannot be trusted (client fell behind, counts disagree)."""


class StudyError(AutotuneError):
    """The study cannot proceed (storage unreachable, no trials to export, ...)."""


class ExportError(AutotuneError):
    """The chosen trial cannot be exported."""
