"""A ``vllm serve`` flag's value type and the forms of its name: snake case as stored, dashed as on vLLM's
command line, and the argv items that pass it."""

from __future__ import annotations

from collections.abc import Mapping

FlagValue = bool | int | float | str


def flag_key(name: str) -> str:
    """Normalise a flag name (``--max-num-seqs``, ``max-num-seqs``, ``max_num_seqs``) to snake case."""
    return name.lstrip("-").replace("-", "_")


def dashed(name: str) -> str:
    """A flag's name as on vLLM's command line (``max-num-seqs``), whichever form it came in."""
    return flag_key(name).replace("_", "-")


def dashed_flags(flags: Mapping[str, FlagValue]) -> dict[str, FlagValue]:
    """Flags keyed as on vLLM's command line (``max-num-seqs``)."""
    return {dashed(k): v for k, v in flags.items()}


def flag_argv(name: str, value: FlagValue) -> list[str]:
    """The argv items for one flag: ``--name value``; booleans become ``--name`` / ``--no-name``."""
    if isinstance(value, bool):
        return [f"--{dashed(name)}"] if value else [f"--no-{dashed(name)}"]
    return [f"--{dashed(name)}", str(value)]
