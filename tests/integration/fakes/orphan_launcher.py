"""Launch a fake server through ServerProcess, report its pid, then sleep until SIGKILLed.

Usage: orphan_launcher.py LOG_PATH PORT REPORT_PATH. Used to leave an orphaned server behind.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from autotune.server import ServerProcess

FAKE = str(Path(__file__).with_name("fake_server.py"))


def main() -> None:
    log_path, port, report = Path(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    server = ServerProcess(
        [sys.executable, FAKE, "--port", str(port)],
        env={},
        log_path=log_path,
        host="127.0.0.1",
        port=port,
        model="fake-model",
    )
    server.start()
    server.wait_ready(timeout=20)
    tmp = report.with_suffix(".tmp")
    tmp.write_text(str(server.pid))
    tmp.rename(report)
    time.sleep(600)


if __name__ == "__main__":
    main()
