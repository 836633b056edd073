"""How trials end: causes, outcomes, and the diagnosis of a server that failed (docs/architecture.md)."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from autotune.errors import AutotuneError


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
    UNMEASURABLE = "unmeasurable"
    """The server ran, but the load client could not measure it validly at any rate (its self-check voided
    every probe after its repeats): a limit of the client's machine, not of the config."""


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


_EMPTY: Mapping[str, float] = MappingProxyType({})


@dataclass(frozen=True)
class Diagnosis:
    """Why a server failed: the cause, one summary line, the relevant log lines and extracted numbers.

    ``extras`` holds numbers the memory model can calibrate with, in GiB where the key ends in ``_gib``:
    ``needed_gib``, ``available_gib``, ``free_gib``, ``total_gib``, ``requested_gib``,
    ``requested_utilization``, ``tried_to_allocate_gib``, ``max_seq_len``, ``estimated_max_model_len``,
    ``exit_code``, ``health_status``.
    """

    cause: Cause
    summary: str
    lines: tuple[str, ...] = ()
    extras: Mapping[str, float] = field(default_factory=lambda: _EMPTY)

    def __post_init__(self) -> None:
        if not isinstance(self.extras, MappingProxyType):
            object.__setattr__(self, "extras", MappingProxyType(dict(self.extras)))


class ServerFailedError(AutotuneError):
    """The server failed for the config's reasons: it did not start, or it died or turned unhealthy while
    measured. :attr:`diagnosis` says why; the trial ends pruned with its cause (not a tuner fault)."""

    def __init__(self, diagnosis: Diagnosis) -> None:
        self.diagnosis = diagnosis
        if diagnosis.cause is Cause.CRASHED_UNDER_LOAD:
            text = f"the server died while measured: {diagnosis.summary}"
        else:
            text = f"server failed to start ({diagnosis.cause}): {diagnosis.summary}"
        super().__init__(text)
