"""Server launch, readiness and teardown; classification of failure logs; the capacity line."""

from autotune.server.capacity import Capacity, parse_capacity
from autotune.server.classify import Diagnosis, classify_runtime_failure, classify_start_failure
from autotune.server.launcher import ReadyInfo, ServerProcess, ServerStartError, kill_orphans

__all__ = [
    "Capacity",
    "Diagnosis",
    "ReadyInfo",
    "ServerProcess",
    "ServerStartError",
    "classify_runtime_failure",
    "classify_start_failure",
    "kill_orphans",
    "parse_capacity",
]
