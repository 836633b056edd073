"""Parse the KV-cache capacity a vLLM server reports at start (docs/vllm.md, "Failure texts").

Handles the 0.34 one-line form (``GPU KV cache size: 1,196,643 tokens, Maximum concurrency for
8,192 tokens per request: 146.07x``; ``CPU`` on the CPU backend) and the older two-line form.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

_KV_TOKENS = re.compile(r"KV cache size: ([\d,]+) tokens")
_CONCURRENCY = re.compile(r"Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x")
_AVAILABLE = re.compile(r"Available KV cache memory: ([\d.]+) Gi?B")
_LOADING = re.compile(r"Model loading took ([\d.]+) Gi?B")


@dataclass(frozen=True)
class Capacity:
    """What the server reported about its KV cache at start; optional fields are None when not logged."""

    kv_tokens: int
    """Tokens the KV cache holds (``KV cache size: N tokens``)."""
    tokens_per_request: int | None = None
    """The request length the concurrency figure is for (normally max_model_len)."""
    max_concurrency: float | None = None
    """How many requests of ``tokens_per_request`` tokens fit at once."""
    available_kv_cache_gib: float | None = None
    """``Available KV cache memory: X GiB``."""
    model_loading_gib: float | None = None
    """``Model loading took X GiB memory``."""

    def as_dict(self) -> dict[str, int | float | None]:
        """The fields as a JSON-serialisable dict (for trial attributes)."""
        return dataclasses.asdict(self)


def _last(pattern: re.Pattern[str], text: str) -> re.Match[str] | None:
    found = None
    for found in pattern.finditer(text):  # noqa: B007 - we want the last match
        pass
    return found


def _int(value: str) -> int:
    return int(value.replace(",", ""))


def parse_capacity(log_text: str) -> Capacity | None:
    """Return the capacity facts in ``log_text`` (the last of each), or None without a KV cache size line."""
    tokens = _last(_KV_TOKENS, log_text)
    if tokens is None:
        return None
    concurrency = _last(_CONCURRENCY, log_text)
    available = _last(_AVAILABLE, log_text)
    loading = _last(_LOADING, log_text)
    return Capacity(
        kv_tokens=_int(tokens.group(1)),
        tokens_per_request=_int(concurrency.group(1)) if concurrency else None,
        max_concurrency=float(concurrency.group(2)) if concurrency else None,
        available_kv_cache_gib=float(available.group(1)) if available else None,
        model_loading_gib=float(loading.group(1)) if loading else None,
    )
