"""Classify why a vLLM server failed to start or died, from its log text (docs/vllm.md, "Failure texts").

Pure functions: no processes, no I/O. The patterns cover vLLM 0.34 and older releases, GPU and CPU
backends. A specific root cause always wins over the generic ``EngineCore failed to start.`` line,
and ``Address already in use`` is never a config cause: it raises :class:`PortInUseError`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from autotune.errors import PortInUseError
from autotune.outcome import Cause, Diagnosis

MAX_LINES = 20
"""At most this many log lines are kept on a :class:`Diagnosis`."""
MAX_LINE_CHARS = 2000
"""Longer log lines are cut to this many characters on a :class:`Diagnosis`."""

_CONTEXT_BEFORE = 2
_CONTEXT_AFTER = 3
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


@dataclass(frozen=True)
class _Rule:
    cause: Cause
    pattern: re.Pattern[str]
    summary: str
    extract: Callable[[str], dict[str, float]] | None = None


_UNITS_GIB = {"B": 1 / 2**30, "KiB": 1 / 2**20, "MiB": 1 / 2**10, "GiB": 1.0, "TiB": 2.0**10}
_U = r"(?:B|KiB|MiB|GiB|TiB)"


@dataclass(frozen=True)
class _Numbers:
    """Numbers to read from a log: regexes whose named groups are ``extras`` keys (a group ``X_unit``
    gives the unit of ``X``, converted to GiB); the first pattern that sets a key wins; ``aliases`` copy
    one key to another (``available_gib`` is the free memory of a node-memory message, for example)."""

    patterns: tuple[re.Pattern[str], ...]
    aliases: tuple[tuple[str, str], ...] = ()

    def __call__(self, text: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for pattern in self.patterns:
            match = pattern.search(text)
            if match is None:
                continue
            groups = match.groupdict()
            for key, value in groups.items():
                if key.endswith("_unit") or value is None or key in out:
                    continue
                out[key] = float(value) * _UNITS_GIB.get(groups.get(f"{key}_unit") or "GiB", 1.0)
        for source, alias in self.aliases:
            if source in out:
                out.setdefault(alias, out[source])
        return out


def _numbers(*patterns: str, aliases: tuple[tuple[str, str], ...] = ()) -> _Numbers:
    return _Numbers(tuple(re.compile(p) for p in patterns), aliases)


_KV_NEEDED = _numbers(
    r"\((?P<needed_gib>[\d.]+) GiB KV cache is needed, which is larger than the available KV cache "
    r"memory \((?P<available_gib>[\d.]+) GiB\)",
    r"max seq len \((?P<max_seq_len>\d+)\)",
    r"estimated maximum model length is (?P<estimated_max_model_len>\d+)",
)
_NODE_KV = _numbers(
    r"\((?P<free_gib>[\d.]+)/(?P<total_gib>[\d.]+) GiB\) on kv cache allocation is less than requested "
    r"memory for kv \((?P<needed_gib>[\d.]+) GiB\)",
    aliases=(("free_gib", "available_gib"), ("needed_gib", "requested_gib")),
)
_UTILIZATION = _numbers(
    r"\((?P<free_gib>[\d.]+)/(?P<total_gib>[\d.]+) GiB\) on startup is less than desired (?:GPU|CPU) "
    r"memory utilization \((?P<requested_utilization>[\d.]+), (?P<requested_gib>[\d.]+) GiB\)",
    aliases=(("free_gib", "available_gib"), ("requested_gib", "needed_gib")),
)
_CUDA_OOM = _numbers(
    rf"Tried to allocate (?P<tried_to_allocate_gib>[\d.]+) (?P<tried_to_allocate_gib_unit>{_U})",
    # torch 2.x: "GPU 0 has a total capacity of 79.19 GiB of which 1.06 GiB is free."
    rf"total capacity of (?P<total_gib>[\d.]+) (?P<total_gib_unit>{_U}) of which "
    rf"(?P<free_gib>[\d.]+) (?P<free_gib_unit>{_U}) is free",
    # torch 1.x: "(GPU 0; 15.78 GiB total capacity; 14.56 GiB already allocated; 3.44 MiB free; ...)"
    rf"(?P<total_gib>[\d.]+) (?P<total_gib_unit>{_U}) total capacity",
    rf"(?P<free_gib>[\d.]+) (?P<free_gib_unit>{_U}) free",
)
_MAX_LEN = _numbers(
    r"User-specified max_model_len \((?P<max_seq_len>\d+)\) is greater than the derived",
    r"derived max_model_len \([a-z_]+=(?P<estimated_max_model_len>[\d.]+)",
)


def _rule(
    cause: Cause,
    pattern: str,
    summary: str,
    extract: Callable[[str], dict[str, float]] | None = None,
    flags: int = 0,
) -> _Rule:
    return _Rule(cause, re.compile(pattern, flags), summary, extract)


# Ordered by priority: the first rule that matches anywhere in the log decides the cause.
# Validation and argparse errors happen before any memory is touched, so they come first; the
# KV-cache texts come before CUDA OOM texts; the generic engine lines are a fallback (see below).
_START_RULES: tuple[_Rule, ...] = (
    _rule(
        Cause.INVALID_CONFIG,
        r"max_num_batched_tokens \(\d+\) is smaller than max_model_len \(\d+\)",
        "max_num_batched_tokens is smaller than max_model_len (needed with chunked prefill off)",
    ),
    _rule(
        Cause.INVALID_CONFIG,
        r"max_num_batched_tokens \(\d+\) must be greater than or equal to max_num_seqs \(\d+\)",
        "max_num_batched_tokens must be >= max_num_seqs",
    ),
    _rule(
        Cause.INVALID_CONFIG,
        r"Invalid kv_cache_dtype",
        "vLLM rejected the --kv-cache-dtype value",
    ),
    _rule(
        Cause.INVALID_CONFIG,
        r"No valid attention backend found|No common block size for|block_size not supported"
        r"|kv_cache_dtype not supported",
        "no attention backend supports this block size / KV-cache dtype",
    ),
    _rule(
        Cause.INVALID_CONFIG,
        r"FP8 KV cache on CPU requires",
        "this CPU cannot hold an FP8 KV cache (vLLM needs x86 with AVX-512 or AMX): use kv_cache_dtype auto",
    ),
    _rule(
        Cause.INVALID_CONFIG,
        r"User-specified max_model_len \(\d+\) is greater than the derived max_model_len",
        "max_model_len is greater than the model's derived maximum",
        _MAX_LEN,
    ),
    _rule(
        Cause.INVALID_CONFIG,
        r"Input should be (?:greater than|less than or equal to|greater than or equal to) ",
        "a flag value is out of its allowed range (pydantic validation error)",
    ),
    _rule(
        Cause.INVALID_CONFIG,
        r"^.*: error: (?:argument |unrecognized arguments|unknown arguments?|the following arguments are "
        r"required)",
        "vLLM's argument parser rejected the command line",
        flags=re.MULTILINE,
    ),
    _rule(
        Cause.KV_TOO_SMALL,
        r"KV cache is needed, which is larger than the available KV cache memory",
        "KV cache too small for one max_model_len sequence",
        _KV_NEEDED,
    ),
    _rule(
        Cause.KV_TOO_SMALL,
        r"No available memory for the cache blocks",
        "no memory left for KV-cache blocks",
    ),
    _rule(
        Cause.KV_TOO_SMALL,
        r"Cannot auto-fit max_model_len",
        "cannot auto-fit max_model_len: not enough memory for even one token of KV cache",
    ),
    _rule(
        Cause.KV_TOO_SMALL,
        r"on kv cache allocation is less than requested memory for kv",
        "requested KV-cache memory is larger than the free memory on the node",
        _NODE_KV,
    ),
    _rule(
        Cause.OOM,
        r"is less than desired (?:GPU|CPU) memory utilization",
        "free device memory at start is less than the requested memory utilization "
        "(something else may hold the device: another process or a server that was not stopped)",
        _UTILIZATION,
    ),
    _rule(
        Cause.OOM,
        r"CUDA out of memory|CUDA error: out of memory|OutOfMemoryError|HIP out of memory",
        "device out of memory during start",
        _CUDA_OOM,
    ),
)

_PORT_IN_USE = re.compile(r"Address already in use")
_GENERIC_START = re.compile(
    r"EngineCore failed to start|Engine core initialization failed|"
    r"Engine process failed to start"
)
_DEATH = re.compile(
    r"EngineCore encountered a fatal error|EngineDeadError|died unexpectedly|"
    r"CUDA out of memory|CUDA error: out of memory|OutOfMemoryError|Traceback \(most recent"
)
_ERRORISH = re.compile(r"Error|error:|Exception|Traceback")


def _clean(log_text: str) -> list[str]:
    return _ANSI.sub("", log_text).splitlines()


def _cap(line: str) -> str:
    return line if len(line) <= MAX_LINE_CHARS else line[:MAX_LINE_CHARS] + " [...]"


def _context(lines: list[str], index: int) -> tuple[str, ...]:
    start = max(0, index - _CONTEXT_BEFORE)
    stop = min(len(lines), index + _CONTEXT_AFTER + 1)
    return tuple(_cap(line) for line in lines[start:stop][:MAX_LINES])


def _context_many(lines: list[str], indexes: tuple[int, ...]) -> tuple[str, ...]:
    keep: set[int] = set()
    for index in indexes:
        keep.update(range(max(0, index - _CONTEXT_BEFORE), min(len(lines), index + _CONTEXT_AFTER + 1)))
    return tuple(_cap(lines[i]) for i in sorted(keep))[:MAX_LINES]


def _find_line(lines: list[str], pattern: re.Pattern[str]) -> int | None:
    """Index of the last line matching ``pattern`` (the last one is nearest to the exit)."""
    for index in range(len(lines) - 1, -1, -1):
        if pattern.search(lines[index]):
            return index
    return None


def _tail(lines: list[str], count: int = 10) -> tuple[str, ...]:
    return tuple(_cap(line) for line in lines[-count:])


def _match_rules(lines: list[str]) -> tuple[_Rule, int] | None:
    text = "\n".join(lines)
    for rule in _START_RULES:
        if rule.pattern.search(text) is None:  # one fast scan before the line-by-line one
            continue
        index = _find_line(lines, rule.pattern)
        if index is not None:
            return rule, index
    return None


def _port_in_use(lines: list[str]) -> None:
    index = _find_line(lines, _PORT_IN_USE)
    if index is not None:
        raise PortInUseError(
            f"the server could not bind its port ({lines[index].strip()[-160:]}); another process "
            "holds it: stop that process or choose another port"
        )


_UNRECOGNIZED = re.compile(r"(?:unrecognized arguments|unknown arguments?):\s*(?P<args>.*)$")


def unknown_flags(log_text: str) -> tuple[str, ...]:
    """The flags an argument parser refused as unknown (``vllm: error: unrecognized arguments: --x 1``,
    or an ``unknown argument`` text): the ``--`` items of that line, else its first item."""
    for line in reversed(_clean(log_text)):
        match = _UNRECOGNIZED.search(line)
        if match is None:
            continue
        items = match["args"].split()
        flags = tuple(item.split("=", 1)[0] for item in items if item.startswith("-"))
        return flags or tuple(items[:1])
    return ()


def _parser_summary(lines: list[str], exit_part: str) -> str | None:
    """A summary naming the flags vLLM does not know, when its parser said so."""
    flags = unknown_flags("\n".join(lines))
    if not flags:
        return None
    return (
        f"the installed vLLM does not know the flag {', '.join(flags)} (its argument parser refused it"
        f"{exit_part.replace(' (', ', ').rstrip(')')}): remove it from the search space or server.args, "
        "or use a space checked against this version"
    )


def _extras(base: Mapping[str, float]) -> Mapping[str, float]:
    return MappingProxyType(dict(base))


def classify_start_failure(log_text: str, exit_code: int | None, timed_out: bool) -> Diagnosis:
    """Say why a server failed to become ready, from its log, exit code and whether it timed out.

    ``timed_out`` wins (cause ``start_timeout``; a recognised error in the log is named in the
    summary). Otherwise the highest-priority recognised root cause wins over the generic
    ``EngineCore failed to start.``; an unrecognised exit is ``start_failed``.
    Raises :class:`PortInUseError` when the log says ``Address already in use`` (the environment's
    fault, not the config's).
    """
    lines = _clean(log_text)
    found = _match_rules(lines)
    if timed_out:
        summary = "the server did not become ready before the start timeout"
        context = _tail(lines)
        extras: dict[str, float] = {}
        if found is not None:
            rule, index = found
            summary += f"; the log shows: {rule.summary}"
            context = _context(lines, index)
            if rule.extract is not None:
                extras = rule.extract("\n".join(lines))
        return Diagnosis(Cause.START_TIMEOUT, summary, context, _extras(extras))

    _port_in_use(lines)
    exit_part = f" (exit code {exit_code})" if exit_code is not None else ""
    base_extras: dict[str, float] = {} if exit_code is None else {"exit_code": float(exit_code)}
    if found is not None:
        rule, index = found
        extras = rule.extract("\n".join(lines)) if rule.extract is not None else {}
        return Diagnosis(
            rule.cause,
            (_parser_summary(lines, exit_part) if rule.cause == Cause.INVALID_CONFIG else None)
            or rule.summary + exit_part,
            _context(lines, index),
            _extras({**base_extras, **extras}),
        )
    if exit_code == 2:
        usage = _find_line(lines, re.compile(r"error:|usage:"))
        if usage is not None:
            return Diagnosis(
                Cause.INVALID_CONFIG,
                "vLLM's argument parser rejected the command line (exit code 2)",
                _context(lines, usage),
                _extras(base_extras),
            )
    generic = _find_line(lines, _GENERIC_START)
    if generic is not None:
        # The root cause is printed above the generic line: show the first error-looking line too.
        first_error = next((i for i, line in enumerate(lines) if _ERRORISH.search(line)), generic)
        shown = _context_many(lines, (first_error, generic))
        return Diagnosis(
            Cause.START_FAILED,
            f"the engine failed to start for a reason no pattern recognises{exit_part}",
            shown,
            _extras(base_extras),
        )
    return Diagnosis(
        Cause.START_FAILED,
        f"the server exited during start{exit_part}; no known failure text in the log",
        _tail(lines),
        _extras(base_extras),
    )


def classify_runtime_failure(log_text: str, exit_code: int | None, health_status: int | None) -> Diagnosis:
    """Describe a server that died or went unhealthy after it was ready: always ``crashed_under_load``.

    ``exit_code`` is None while the process still runs; ``health_status`` is the ``/health`` status
    code, or None when it could not be reached. Exit code 0 counts too (vLLM exits 0 after an engine
    death). The summary names an out-of-memory error when the log shows one.
    """
    lines = _clean(log_text)
    parts: list[str] = []
    if exit_code is not None:
        parts.append(f"the server exited with code {exit_code}")
    if health_status is not None and health_status != 200:
        parts.append(f"/health answered {health_status}")
    elif exit_code is None:
        parts.append("/health did not answer")
    summary = "; ".join(parts) or "the server stopped serving"
    extras: dict[str, float] = {}
    if exit_code is not None:
        extras["exit_code"] = float(exit_code)
    if health_status is not None:
        extras["health_status"] = float(health_status)
    oom = _find_line(lines, re.compile(r"CUDA out of memory|CUDA error: out of memory|OutOfMemory"))
    index = oom if oom is not None else _find_line(lines, _DEATH)
    if oom is not None:
        summary += " (device out of memory under load)"
        extras.update(_CUDA_OOM("\n".join(lines)))
    context = _context(lines, index) if index is not None else _tail(lines)
    return Diagnosis(Cause.CRASHED_UNDER_LOAD, summary, context, _extras(extras))
