"""Entry point of the simulated server: ``python -m autotune.sim MODEL [vllm serve flags] [--sim-*]``.

This is the simulated server's process boundary: it parses the command line, writes the log to
stdout/stderr and returns the exit status (2 for argparse-level errors, 1 for start failures, 0 for a
clean stop or after an engine death, as vLLM does).
"""

from __future__ import annotations

import asyncio
import os
import random
import sys

from autotune.errors import SpecError
from autotune.hardware.catalog import load_model_arch
from autotune.sim.flags import FlagError, help_text, parse_flags
from autotune.sim.model import build_engines
from autotune.sim.server import Log, serve
from autotune.sim.startup import plan_startup


def main(argv: list[str]) -> int:
    """Run the simulated ``vllm serve`` with ``argv`` (without the program name); exit status."""
    if "-h" in argv or "--help" in argv:
        sys.stdout.write(help_text())
        return 0
    try:
        flags = parse_flags(argv)
    except FlagError as exc:
        sys.stderr.write(exc.render())
        return 2
    log = Log(sys.stdout)
    try:
        arch = load_model_arch(flags.model)
    except SpecError as exc:
        log("", "", f"OSError: {exc.message}")
        return 1
    seed = flags.seed if flags.seed is not None else random.SystemRandom().randrange(2**31)
    rng = random.Random(seed)
    log("INFO", "sim.py:1", f"autotune.sim on {flags.hardware.name} (seed {seed})")
    variables = {k: v for k, v in sorted(os.environ.items()) if k.startswith("VLLM_") and "KEY" not in k}
    if variables:  # vLLM's environment variables: passed, not modelled
        log("INFO", "sim.py:3", f"autotune.sim environment (not simulated): {variables}")
    plan = plan_startup(flags, arch, rng)

    coroutine = serve(flags, arch, plan, lambda: build_engines(flags, arch, plan, seed), log, rng)
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        return asyncio.run(coroutine)
    return uvloop.run(coroutine)
