"""A tiny stand-in for `vllm serve` (stdlib only), run as a real subprocess by the launcher tests.

Modes: ready (serve /health, /v1/models, /version); exit (print --text, exit --exit-code); hang
(never answer); die (serve, exit 0 --die-after s after the first /v1/models, as vLLM does after an
engine death); unhealthy (the same, but stays up with /health 503); ignore-term (ignore SIGTERM,
with a child process in the same group that ignores it too). Unknown flags are accepted.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

CAPACITY = (
    "INFO 12-02 14:00:00 [kv_cache_utils.py:1] GPU KV cache size: 1,196,643 tokens, "
    "Maximum concurrency for 8,192 tokens per request: 146.07x"
)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--model", default="fake-model")
    parser.add_argument(
        "--mode", default="ready", choices=["ready", "exit", "hang", "die", "unhealthy", "ignore-term"]
    )
    parser.add_argument("--delay", type=float, default=0.0)
    parser.add_argument("--text", default="")
    parser.add_argument("--exit-code", type=int, default=1)
    parser.add_argument("--die-after", type=float, default=0.3)
    parser.add_argument("--argv-out")
    parser.add_argument("--child-pid-out")
    args, _unknown = parser.parse_known_args()
    if args.argv_out:
        with open(args.argv_out, "w") as fh:
            json.dump(sys.argv[1:], fh)
    print("INFO starting fake server", flush=True)
    time.sleep(args.delay)
    if args.mode == "exit":
        print(args.text, flush=True)
        print(f"EXIT_AT {time.time()}", flush=True)
        sys.exit(args.exit_code)
    if args.mode == "hang":
        time.sleep(3600)
    if args.mode == "ignore-term":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
        child = subprocess.Popen([sys.executable, "-c", code])
        if args.child_pid_out:
            with open(args.child_pid_out, "w") as fh:
                fh.write(str(child.pid))
    healthy = threading.Event()
    healthy.set()
    dying = threading.Event()

    def die() -> None:
        time.sleep(args.die_after)
        print("ERROR EngineCore encountered a fatal error.", flush=True)
        print("vllm.v1.engine.exceptions.EngineDeadError: EngineCore died.", flush=True)
        healthy.clear()
        if args.mode == "die":
            os._exit(0)

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *log_args: object) -> None:
            pass

        def _send(self, status: int, body: object) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/health":
                self._send(200 if healthy.is_set() else 503, {})
            elif self.path == "/v1/models":
                self._send(200, {"object": "list", "data": [{"id": args.model, "object": "model"}]})
                if args.mode in ("die", "unhealthy") and not dying.is_set():
                    dying.set()  # the death clock starts once a client saw us ready
                    threading.Thread(target=die, daemon=True).start()
            elif self.path == "/version":
                self._send(200, {"version": "0.0.0-fake"})
            else:
                self._send(404, {})

    server = ThreadingHTTPServer((args.host, args.port), Handler)
    print(CAPACITY, flush=True)
    print("INFO:     Application startup complete.", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
