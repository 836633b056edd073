"""``python -m autotune.sim``: the simulated vLLM server (see :mod:`autotune.sim.cli`)."""

import sys

from autotune.sim.cli import main

sys.exit(main(sys.argv[1:]))
