"""Where a server command's name resolves, as the launcher runs it (and the spec's check finds it)."""

from __future__ import annotations

import os
import shutil
import sys


def find_executable(name: str, path_env: str | None) -> str | None:
    """``name`` as the launcher runs it: a path (with a ``/``) when it is an executable file; a bare
    name found next to the running interpreter first, then on ``path_env``; else ``None``."""
    if os.sep in name:
        return name if os.path.isfile(name) and os.access(name, os.X_OK) else None
    here = os.path.dirname(sys.executable)
    return shutil.which(name, path=here) or shutil.which(name, path=path_env)
