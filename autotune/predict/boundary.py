"""The crash boundary: configs that ask at least as much of memory as one that already failed for memory.

A start that failed for memory (``oom`` or ``kv_too_small``) draws an edge through the space. What the
flags do to memory is monotone, so a config on the failing side of that edge (every flag at least as
demanding, everything else equal) fails as well and is not launched:

=============================  =====================================  =====================================
flag                           ``oom`` (the device ran out)           ``kv_too_small`` (KV got too little)
=============================  =====================================  =====================================
``gpu_memory_utilization``     higher asks more                       lower leaves less for KV
``max_num_seqs``               higher asks more (sampler, graphs)     higher leaves less for KV
``max_num_batched_tokens``     higher asks more (activations)         higher leaves less for KV
``kv_cache_memory_bytes``      higher asks more                       lower leaves less for KV
``kv_cache_dtype``             (no effect: KV fills the budget)       more bytes per element needs more
``max_model_len``              (equal required)                       longer needs more
=============================  =====================================  =====================================

Any other flag must be equal, and so must the set of flags given (a conditional flag absent on one side
makes two configs incomparable). The reasoning holds with the same model, device and fixed flags: a study's
own history. Sources: docs/vllm.md (how vLLM sizes the KV cache after its profile run).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from optuna.trial import FrozenTrial, TrialState

from autotune.flags import FlagValue
from autotune.outcome import Cause
from autotune.store.record import TrialRecord

MEMORY_FAILURES = (Cause.OOM, Cause.KV_TOO_SMALL)

#: flag → +1 when a larger value asks more of memory, -1 when a smaller one does, per failure cause.
DEMAND: Mapping[Cause, Mapping[str, int]] = {
    Cause.OOM: {
        "gpu_memory_utilization": 1,
        "max_num_seqs": 1,
        "max_num_batched_tokens": 1,
        "kv_cache_memory_bytes": 1,
    },
    Cause.KV_TOO_SMALL: {
        "gpu_memory_utilization": -1,
        "max_num_seqs": 1,
        "max_num_batched_tokens": 1,
        "kv_cache_memory_bytes": -1,
        "kv_cache_dtype": 1,
        "max_model_len": 1,
    },
}

_ONE_BYTE_KV = ("fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla", "int8")
_TWO_BYTE_KV = ("bfloat16", "float16", "half")


def _kv_dtype_order(a: str, b: str) -> int | None:
    """-1, 0, 1 as ``a`` stores a KV element in fewer, as many or more bytes than ``b``; None when unknown
    (``auto`` is the model's dtype: at least one byte more than fp8, of unknown size against bfloat16)."""
    if a == b:
        return 0

    def size(name: str) -> int | None:
        if name in _ONE_BYTE_KV:
            return 1
        if name in _TWO_BYTE_KV:
            return 2
        return None

    sa, sb = size(a), size(b)
    if sa is not None and sb is not None:
        return (sa > sb) - (sa < sb)
    if a == "auto" and sb == 1:
        return 1
    if b == "auto" and sa == 1:
        return -1
    return None


def _order(key: str, a: FlagValue, b: FlagValue) -> int | None:
    """How ``a`` compares with ``b`` for ``key``: -1, 0, 1, or None when they cannot be compared."""
    if a == b and type(a) is type(b):
        return 0
    if key == "kv_cache_dtype" and isinstance(a, str) and isinstance(b, str):
        return _kv_dtype_order(a, b)
    if isinstance(a, int | float) and isinstance(b, int | float) and bool not in (type(a), type(b)):
        return (a > b) - (a < b)
    return None


def asks_at_least(candidate: Mapping[str, FlagValue], failed: Mapping[str, FlagValue], cause: Cause) -> bool:
    """Whether ``candidate`` asks at least as much of memory as ``failed``, which failed with ``cause``
    (``oom`` or ``kv_too_small``): every flag at least as demanding in that cause's direction, every other
    flag equal, the same flags given."""
    demand = DEMAND[cause]
    if set(candidate) != set(failed):
        return False
    for key, value in candidate.items():
        order = _order(key, value, failed[key])
        if order is None:
            return False
        direction = demand.get(key, 0)
        if direction == 0 and order != 0:
            return False
        if order * direction < 0:
            return False
    return True


@dataclass(frozen=True)
class Beyond:
    """A config beyond the crash boundary: the trial it dominates, and that trial's cause."""

    trial: int
    cause: Cause
    flags: Mapping[str, FlagValue]

    def reason(self, candidate: Mapping[str, FlagValue]) -> str:
        """Which flags make the candidate at least as demanding (``util 0.97 >= 0.96``)."""
        demand = DEMAND[self.cause]
        moved = []
        for key, value in candidate.items():
            other = self.flags[key]
            if value != other and demand.get(key):
                sign = ">" if _order(key, value, other) == 1 else "<"
                moved.append(f"{key} {value} {sign} {other}")
        shown = ", ".join(moved) or "the same memory flags"
        return (
            f"it asks at least as much memory as trial {self.trial}, which failed to start ({self.cause}): "
            f"{shown}, everything else equal"
        )


def memory_failures(trials: Sequence[FrozenTrial]) -> list[tuple[int, Cause, Mapping[str, FlagValue]]]:
    """(number, cause, flags) of the launched trials that failed to start for memory."""
    out = []
    for trial in trials:
        if trial.state != TrialState.PRUNED:
            continue
        record = TrialRecord.from_trial(trial)
        if record.cause in MEMORY_FAILURES and record.launched is not False and record.flags:
            assert record.cause is not None
            out.append((trial.number, record.cause, record.flags))
    return out


def beyond(
    flags: Mapping[str, FlagValue], failures: Sequence[tuple[int, Cause, Mapping[str, FlagValue]]]
) -> Beyond | None:
    """The first of ``failures`` (:func:`memory_failures`) that ``flags`` asks at least as much as, or
    None."""
    for number, cause, failed in failures:
        if asks_at_least(flags, failed, cause):
            return Beyond(number, cause, failed)
    return None


def beyond_boundary(flags: Mapping[str, FlagValue], trials: Sequence[FrozenTrial]) -> Beyond | None:
    """The first memory failure among ``trials`` that ``flags`` asks at least as much as, or None."""
    return beyond(flags, memory_failures(trials))
