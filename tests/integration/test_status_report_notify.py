"""`autotune status`, `autotune report` and notifications around a real study against the simulated server:
status read from another process while the tuner runs, a webhook on a real local HTTP server and a real
command told of new bests and the end, a failing notification logged without stopping the study, and the
secrets of the notify section in no log, event, status or report."""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml

from autotune.inputs.loader import load_study
from autotune.results.export import choose
from autotune.results.status import read_study

from .test_study_e2e import write_spec

pytestmark = pytest.mark.integration

SECRET = "hdr-" + uuid.uuid4().hex
URL_TOKEN = "url-" + uuid.uuid4().hex


def _autotune(*args: str | Path) -> list[str]:
    return [sys.executable, "-c", "from autotune.cli import main; main()", *map(str, args)]


def _run(*args: str | Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(_autotune(*args), capture_output=True, text=True, timeout=120, env=env, check=False)


class _Hook(http.server.BaseHTTPRequestHandler):
    """Records each POST; the first one is answered 500 (a receiver having a bad moment), the rest 200."""

    def do_POST(self) -> None:
        server: Any = self.server
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
        server.received.append({"path": self.path, "auth": self.headers.get("Authorization"), "body": body})
        self.send_response(500 if len(server.received) == 1 else 200)
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


@contextlib.contextmanager
def _hook() -> Iterator[Any]:
    server: Any = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hook)
    server.received = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=30)


@pytest.fixture
def marker() -> Iterator[str]:
    """A unique served-model name; every server of the test carries it on its command line."""
    name = f"m-{uuid.uuid4().hex[:10]}"
    yield name
    for proc in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(OSError, psutil.Error):
            if name in " ".join(proc.info["cmdline"] or []) and proc.pid != os.getpid():
                os.killpg(os.getpgid(proc.pid), signal.SIGKILL)


def _with_notify(path: Path, notify: dict[str, Any]) -> None:
    spec = yaml.safe_load(path.read_text())
    spec["notify"] = notify
    path.write_text(yaml.safe_dump(spec))


@pytest.mark.slow
def test_status_while_running_then_notifications_report_and_no_secret_anywhere(
    tmp_path: Path, marker: str
) -> None:
    """While `autotune tune` runs, `autotune status --json` from another process shows the running trial
    and its phase; the webhook (first answer 500: logged as notify_failed, the study goes on) and the
    command get the new bests and `finished` with the export's pick; the status and the report afterwards
    agree with `choose`; the secrets are in no output, event, status or report."""
    path = write_spec(tmp_path, marker, trials=3, sim_flags=("--sim-speedup", "0.5"))
    told = tmp_path / "told.jsonl"
    script = f"import sys; open({str(told)!r}, 'a').write(sys.stdin.read().strip() + '\\n')"
    with _hook() as server:
        _with_notify(
            path,
            {
                "command": [sys.executable, "-c", script],
                "webhook": {
                    "url": f"http://127.0.0.1:{server.server_port}/hook?token=${{E2E_URL_TOKEN}}",
                    "headers": {"Authorization": "Bearer ${E2E_NOTIFY_SECRET}"},
                },
            },
        )
        env = {**os.environ, "E2E_NOTIFY_SECRET": SECRET, "E2E_URL_TOKEN": URL_TOKEN}
        out = tmp_path / "tune.out"
        with out.open("w") as log:
            tuner = subprocess.Popen(_autotune("tune", path), stdout=log, stderr=subprocess.STDOUT, env=env)
            try:
                seen = None
                deadline = time.monotonic() + 120
                while seen is None and time.monotonic() < deadline and tuner.poll() is None:
                    status = _run("status", path, "--json")
                    assert status.returncode == 0, status.stderr
                    found = json.loads(status.stdout)
                    if found["state"] == "running" and found["running"][0]["phase"]:
                        seen = found
                assert seen is not None, "status never caught a running trial: " + out.read_text()
                assert tuner.wait(timeout=300) == 0, out.read_text()
            finally:
                if tuner.poll() is None:
                    tuner.kill()
                    tuner.wait(timeout=30)
        received = list(server.received)

    (running,) = seen["running"]
    assert running["worker"].split(":")[1] == str(tuner.pid)
    assert running["server_log"].endswith(f"trials/{running['number']}/server.log")
    assert seen["budget"] == 3 and seen["records"]["events"].endswith("events.jsonl")

    loaded = load_study(path)
    study = read_study(loaded)
    assert study is not None
    pick = choose(study, loaded, trial=None, policy=None).trial.number

    kinds = [r["body"]["event"] for r in received]
    assert kinds.count("finished") == 1 and kinds[-1] == "finished" and "new_best" in kinds
    assert all(r["path"] == f"/hook?token={URL_TOKEN}" and r["auth"] == f"Bearer {SECRET}" for r in received)
    finished = received[-1]["body"]
    assert finished["pick"]["trial"] == pick and finished["study"] == "e2e"
    assert f"best: trial {pick}: " in finished["text"]
    by_command = [json.loads(line) for line in told.read_text().splitlines()]
    assert [b["event"] for b in by_command] == kinds

    events = (loaded.workdir / "events.jsonl").read_text()
    failed = [json.loads(line) for line in events.splitlines() if '"notify_failed"' in line]
    assert len(failed) == 1 and failed[0]["data"]["channel"] == "webhook"
    assert "HTTP 500" in failed[0]["text"] and "${E2E_URL_TOKEN}" in failed[0]["text"]

    after = _run("status", path)
    shown = " ".join(after.stdout.split())  # lines wrapped at 80 columns
    assert after.returncode == 0 and "study 'e2e'" in shown and ": finished" in shown
    assert re.search(rf"best so far: .*\btrial {pick}\b", shown), after.stdout
    page = tmp_path / "report.html"
    made = _run("report", path, "-o", page)
    assert made.returncode == 0, made.stderr
    html = page.read_text()
    assert f'Use trial <a href="#trial-{pick}">{pick}</a>' in html

    everything = out.read_text() + events + after.stdout + html + made.stdout
    everything += "".join(p.read_text(errors="replace") for p in loaded.workdir.rglob("*.log"))
    assert SECRET not in everything and URL_TOKEN not in everything


def test_bad_notify_input_exits_2_with_one_line_and_writes_nothing(tmp_path: Path, marker: str) -> None:
    """An unknown notification event, and a secret variable that is not set, are each one `error:` line
    naming the field and the value, exit status 2, and nothing written (validate and tune alike)."""
    path = write_spec(tmp_path, marker, trials=1)
    _with_notify(path, {"command": ["true"], "events": ["finished", "exploded"]})
    for command in ("validate", "tune"):
        result = _run(command, path)
        assert result.returncode == 2, result
        (line,) = result.stderr.splitlines()
        assert line.startswith("error: notify.events.1: ") and "'exploded'" in line

    _with_notify(
        path, {"webhook": {"url": "https://hooks.example/x", "headers": {"X-Key": "${E2E_UNSET_VAR}"}}}
    )
    env = {k: v for k, v in os.environ.items() if k != "E2E_UNSET_VAR"}
    for command in ("validate", "tune"):
        result = _run(command, path, env=env)
        assert result.returncode == 2, result
        (line,) = result.stderr.splitlines()
        assert (
            line == "error: notify.webhook.headers.X-Key: the environment variable 'E2E_UNSET_VAR' is not set"
        )
    assert not (tmp_path / "e2e").exists(), "nothing was written"


def test_status_and_report_read_a_postgresql_study_with_a_role_that_may_only_select(
    tmp_path: Path, new_postgres_url: str
) -> None:
    """On PostgreSQL, `status` and the report open the storage without creating or writing anything: a role
    granted SELECT only reads the study whole, and they agree with what the tuner's own role sees."""
    import psycopg

    from autotune.results.htmlreport import build_report
    from autotune.results.status import read_status
    from autotune.study.loop import close_study

    from ..unit.report_study import run_study

    loaded = run_study(tmp_path, launches=4, study={"name": "rep", "storage": new_postgres_url})
    role, password = f"reader_{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    scheme, _, rest = new_postgres_url.partition("://")
    where = rest.partition("@")[2]
    with psycopg.connect(new_postgres_url, autocommit=True) as admin:
        admin.execute(f"CREATE ROLE {role} LOGIN PASSWORD '{password}'")
        admin.execute(f"GRANT SELECT ON ALL TABLES IN SCHEMA public TO {role}")
    reader = load_study(loaded.spec_path, storage=f"{scheme}://{role}:{password}@{where}")

    status = read_status(reader)
    assert status.state == "finished" and status.launches == 4
    assert status.storage == f"{scheme}://{role}:***@{where}"
    study, owner = read_study(reader), read_study(loaded)
    assert study is not None and owner is not None
    try:
        assert status.best is not None
        assert status.best["trial"] == choose(owner, loaded, trial=None, policy=None).trial.number
        page = build_report(study, reader)
    finally:
        close_study(study)
        close_study(owner)
    assert "The answer: Use trial" in page and password not in page
