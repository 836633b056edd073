"""Trial outcomes and their causes (DESIGN.md, "Definitions")."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


class Cause(enum.StrEnum):
    """Why a trial was pruned. Stored verbatim on the trial as the ``cause`` user attribute."""

    OOM = "oom"
    """Device out of memory at start (weights, activations, CUDA graphs)."""
    KV_TOO_SMALL = "kv_too_small"
    """No memory left for KV-cache blocks, or too little for one max_model_len sequence."""
    INVALID_CONFIG = "invalid_config"
    """vLLM refused the flags (validation error, unsupported block size or KV dtype)."""
    START_TIMEOUT = "start_timeout"
    """The server did not become ready within the start timeout (it was stopped)."""
    START_FAILED = "start_failed"
    """The server exited during start for a reason none of the patterns recognise."""
    CRASHED_UNDER_LOAD = "crashed_under_load"
    """The server started but died or went unhealthy while being measured."""
    PREDICTED_INFEASIBLE = "predicted_infeasible"
    """The memory model or a known constraint says it cannot start; never launched."""
    SLO_UNREACHABLE = "slo_unreachable"
    """The server ran, but no probed arrival rate met every SLO term."""


@dataclass(frozen=True)
class TrialOutcome:
    """What one trial produced: objective values (complete) or a cause (pruned), and what explains it.

    ``values`` follows the study's objectives in order. ``constraints`` are the SLO terms' relative
    violations at the operating point ((value - limit) / limit, then failed fraction - error budget):
    all <= 0 for a complete trial. ``attrs`` holds JSON-serialisable facts stored on the trial
    (metrics, probes, capacity, server deltas, relevant log lines).
    """

    cause: Cause | None
    summary: str
    values: tuple[float, ...] | None = None
    constraints: tuple[float, ...] = ()
    attrs: Mapping[str, Any] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        """True when the trial was measured (it has objective values and no cause)."""
        return self.cause is None
