"""Open a storage and create-or-load a study once a start file appears; print what happened as JSON.

Usage: open_study.py URL STUDY READY_PATH GO_PATH. Writes READY_PATH once imported, waits for GO_PATH
(so that several of these start at the same moment), then prints ``{"created": ..., "study_id": ...}``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import optuna

from autotune.store.storage import create_or_load_study, open_storage


def main() -> None:
    url, name, ready, go = sys.argv[1], sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4])
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    ready.write_text("")
    deadline = time.monotonic() + 60
    while not go.exists():
        if time.monotonic() > deadline:
            sys.exit("no start signal within 60 s")
        time.sleep(0.001)
    storage = open_storage(url, heartbeat=True)
    study, created = create_or_load_study(storage, name, ["maximize", "minimize"], None)
    print(json.dumps({"created": created, "study_id": study._study_id}))


if __name__ == "__main__":
    main()
