"""A model's files, found offline: a local folder's, else the newest snapshot's in the Hugging Face cache."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path


def hub_cache(env: Mapping[str, str]) -> Path:
    """The Hugging Face hub cache: ``HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``
    (``huggingface_hub``'s own order)."""
    if env.get("HF_HUB_CACHE"):
        return Path(env["HF_HUB_CACHE"])
    return Path(env.get("HF_HOME") or os.path.join(Path.home(), ".cache", "huggingface")) / "hub"


def model_file(model: str, name: str, env: Mapping[str, str]) -> Path | None:
    """``name`` (``config.json``, ``tokenizer.json``) of ``model``: in ``model`` as a local folder, else in
    the newest cached snapshot of ``model`` as a hub id (``org/name``); None where neither holds it."""
    local = Path(model).expanduser()
    if (local / name).is_file():
        return local / name
    if "/" not in model or local.exists():
        return None
    snapshots = hub_cache(env) / ("models--" + model.replace("/", "--")) / "snapshots"
    found = sorted(snapshots.glob(f"*/{name}"), key=lambda p: p.stat().st_mtime, reverse=True)
    return found[0] if found else None
