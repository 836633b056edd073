"""Server launch, readiness and teardown; its HTTP checks; failure classification; the capacity line."""

from autotune.server.capacity import Capacity, parse_capacity
from autotune.server.classify import classify_runtime_failure, classify_start_failure
from autotune.server.endpoint import Endpoint
from autotune.server.launcher import ReadyInfo, ServerProcess, kill_orphans

__all__ = [
    "Capacity",
    "Endpoint",
    "ReadyInfo",
    "ServerProcess",
    "classify_runtime_failure",
    "classify_start_failure",
    "kill_orphans",
    "parse_capacity",
]
