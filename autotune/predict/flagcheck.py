"""What the installed vLLM would refuse, told before any launch: flags its version does not have, and a
space checked against other versions.

``autotune validate`` asks the server command for its version (``vllm --version``, at most
:data:`VERSION_TIMEOUT_S`; the simulated server is vLLM 0.34.0 by construction) and compares it with
the space's ``vllm_versions``. Flags are checked against vLLM 0.34's option table
(:mod:`autotune.sim.vllm_options`, taken from its parser) when the version is 0.34 (or, when the
version cannot be read, when the space names 0.34): a flag that is not there ends every trial that passes
it as ``invalid_config`` (vLLM's ``unrecognized arguments``), so it is worth a warning first. Running
``vllm serve --help`` instead would cover every version, but costs the seconds of importing vLLM and
its prose differs between versions; the table is exact for the version it was taken from.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

from autotune.flags import FlagValue
from autotune.inputs.space import SearchSpace
from autotune.sim.report import VLLM_VERSION
from autotune.sim.speculative import FIELDS as SPECULATIVE_KEYS
from autotune.sim.vllm_options import DEST_ORDER

VERSION_TIMEOUT_S = 60.0
TABLE_VERSION = "0.34"
"""The vLLM version whose option table autotune holds."""
_VERSION = re.compile(r"(\d+\.\d+(?:\.\d+)?(?:[.+][\w.]+)?)")


def _is_sim(command: Sequence[str]) -> bool:
    return "autotune.sim" in command or (
        bool(command) and Path(command[0]).name == "autotune" and "sim-serve" in command
    )


def server_version(command: Sequence[str], env: Mapping[str, str] | None = None) -> str | None:
    """The vLLM version the server command runs: the simulator's, or ``vllm --version`` when the command
    is ``vllm``; ``None`` when it cannot be told (another launcher, or no answer in time)."""
    if _is_sim(command):
        return VLLM_VERSION
    if not command or Path(command[0]).name != "vllm":
        return None
    try:
        done = subprocess.run(
            [command[0], "--version"],
            capture_output=True,
            text=True,
            timeout=VERSION_TIMEOUT_S,
            env={**os.environ, **(env or {})},
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    lines = [line.strip() for line in done.stdout.splitlines() if line.strip()]
    match = _VERSION.search(lines[-1]) if done.returncode == 0 and lines else None
    return match.group(1) if match else None


def _covers(version: str, checked: str) -> bool:
    base = version.split("+", 1)[0]
    return base == checked or base.startswith(checked + ".")


def unknown_flags(space: SearchSpace, version: str | None) -> list[str] | None:
    """The flags of the space and the fixed args that vLLM 0.34's ``vllm serve`` does not know (and keys
    of ``--speculative-config`` it refuses); ``None`` when the version is not 0.34 (nothing checked)."""
    checked = space.spec.vllm_versions
    if version is not None:
        if not _covers(version, TABLE_VERSION):
            return None
    elif not any(v == TABLE_VERSION or v.startswith(TABLE_VERSION + ".") for v in checked):
        return None
    names: dict[str, FlagValue | None] = {**dict.fromkeys(space.spec.params), **space.fixed}
    out: list[str] = []
    for name in names:
        flag, dot, key = name.partition(".")
        dest = flag.removeprefix("no_") if flag.removeprefix("no_") in DEST_ORDER else flag
        if dest not in DEST_ORDER:
            out.append(f"--{flag.replace('_', '-')}")
        elif dot and flag == "speculative_config" and key not in SPECULATIVE_KEYS:
            out.append(f"--speculative-config key {key!r}")
    return sorted(set(out))


def version_note(space: SearchSpace, version: str | None) -> str | None:
    """A warning when ``version`` is none of the space's ``vllm_versions`` (``None``: it is one, or
    nothing can be compared)."""
    checked = space.spec.vllm_versions
    if version is None or not checked or any(_covers(version, v) for v in checked):
        return None
    return (
        f"the server runs vLLM {version}, the search space was checked against "
        f"{', '.join(checked)}: check its defaults, values and constraints for this version"
    )
