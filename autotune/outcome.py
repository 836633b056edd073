"""Trial outcomes and their causes (DESIGN.md, "Definitions")."""

from __future__ import annotations

import enum


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
