"""Notifications: the ``notify:`` section checked at the edge, which events notify, and delivery to a real
local HTTP server and a real command, with failures reported (secrets scrubbed) and never raised."""

from __future__ import annotations

import contextlib
import dataclasses
import http.server
import json
import os
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from pydantic import ValidationError

from autotune.errors import SpecError
from autotune.events import Event, Kind
from autotune.inputs.spec import NotifySpec, StudySpec, format_validation
from autotune.results.notify import Channels, Notifier, notification_for, payload, resolve_notify, send

SECRET = "s3cr3t-token-value"
URL_SECRET = "T0KEN-IN-URL"
BASE = {
    "study": {"name": "x"},
    "server": {"command": ["vllm"], "model": "m"},
    "search_space": "s.yaml",
    "slo": {"terms": ["ttft:p95<=1s"]},
}


class _Receiver(http.server.BaseHTTPRequestHandler):
    """Records each POST (path, headers, JSON body) and answers with the server's ``status``."""

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length", "0"))
        body = json.loads(self.rfile.read(length))
        server: Any = self.server
        server.received.append({"path": self.path, "headers": dict(self.headers), "body": body})
        self.send_response(server.status)
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:  # keep pytest's output clean
        pass


@contextlib.contextmanager
def receiver(status: int = 200) -> Iterator[Any]:
    """A real HTTP server on a free local port, in a thread."""
    server: Any = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    server.received = []
    server.status = status
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=30)


def _spec(**notify: Any) -> NotifySpec:
    spec = StudySpec.model_validate({**BASE, "notify": notify})
    assert spec.notify is not None
    return spec.notify


def _event(
    kind: Kind, trial: int | None = 3, best: str | None = "trial 3: slo_throughput=900", **data: Any
) -> Event:
    return Event(
        kind=kind, text=f"{kind.value} happened", trial=trial, launches=4, budget=12, best=best, data=data
    )


def _webhook(server: Any, environ: dict[str, str] | None = None, timeout: float = 5.0) -> Channels:
    url = f"http://127.0.0.1:{server.server_port}/hook/${{URL_TOKEN}}"
    spec = _spec(webhook={"url": url, "headers": {"Authorization": "Bearer ${HOOK_SECRET}"}}, timeout=timeout)
    env = {"HOOK_SECRET": SECRET, "URL_TOKEN": URL_SECRET} if environ is None else environ
    return resolve_notify(spec, env)


@pytest.mark.parametrize(
    ("notify", "field", "shown"),
    [
        ({"command": ["x"], "events": ["bogus"]}, "notify.events.0", "'bogus'"),
        ({"command": "curl -d @- https://x | jq"}, "notify.command", "curl -d @- https://x | jq"),
        ({"command": []}, "notify.command", "must not be empty, got []"),
        ({"command": [""]}, "notify.command", "argv item 0 is empty ('') in ['']"),
        ({"command": ["notify-send", " \t"]}, "notify.command", "argv item 1 is only whitespace (' \\t')"),
        ({}, "notify", "give a command, a webhook, or both"),
        ({"webhook": {"url": "ftp://host/x"}}, "notify.webhook.url", "'ftp://host/x'"),
        (
            {"webhook": {"url": "https://h/x", "headers": {"Bad Name": "v"}}},
            "notify.webhook.headers",
            "'Bad Name'",
        ),
        ({"command": ["x"], "timeout": "soon"}, "notify.timeout", "'soon'"),
        ({"command": ["x"], "on": ["finished"]}, "notify.on", "unknown key"),
    ],
)
def test_a_bad_notify_section_is_one_error_naming_the_field_and_value(
    notify: dict[str, Any], field: str, shown: str
) -> None:
    """Each mistake in ``notify:`` is refused at the edge with the field's path and the value."""
    with pytest.raises(ValidationError) as caught:
        StudySpec.model_validate({**BASE, "notify": notify})
    error = format_validation("", caught.value)
    assert error.field == field
    assert shown in str(error)
    assert "\n" not in str(error)


def test_secrets_come_from_the_environment_and_a_missing_one_is_named() -> None:
    """``${NAME}`` in the URL and headers is read from the environment; a variable that is not set is bad
    input naming the field and the variable; the channels' repr shows no secret."""
    spec = _spec(
        webhook={"url": "https://hooks.example/${URL_TOKEN}", "headers": {"X-Key": "k ${HOOK_SECRET}"}}
    )
    channels = resolve_notify(spec, {"URL_TOKEN": URL_SECRET, "HOOK_SECRET": SECRET})
    assert channels.url == f"https://hooks.example/{URL_SECRET}"
    assert channels.headers == {"X-Key": f"k {SECRET}"}
    assert channels.url_shown == "https://hooks.example/${URL_TOKEN}"
    assert SECRET not in repr(channels) and URL_SECRET not in repr(channels)
    with pytest.raises(SpecError) as caught:
        resolve_notify(spec, {"URL_TOKEN": URL_SECRET})
    assert caught.value.field == "notify.webhook.headers.X-Key"
    assert "'HOOK_SECRET' is not set" in str(caught.value)


def test_which_events_notify() -> None:
    """Finished (only when nothing runs elsewhere), stopped (fault or signal), and a new best the study
    marked to notify (confirmed, or the search's in a study without finalists); a new best it did not
    mark (the search's unconfirmed one, another tuner's), and progress events, are not notified."""
    assert notification_for(_event(Kind.FINISHED, running_elsewhere=0)) == "finished"
    assert notification_for(_event(Kind.FINISHED, running_elsewhere=2)) is None
    assert notification_for(_event(Kind.STOPPED, error="port taken")) == "stopped"
    assert notification_for(_event(Kind.NEW_BEST, confirmed=True, notify=True)) == "new_best"
    assert notification_for(_event(Kind.NEW_BEST, confirmed=False, notify=False)) is None
    assert notification_for(_event(Kind.NEW_BEST)) is None
    for kind in (Kind.PHASE, Kind.TRIAL_DONE, Kind.FAULT, Kind.RETRY, Kind.CONFIRMED, Kind.STARTED):
        assert notification_for(_event(kind)) is None


def test_the_webhook_gets_the_payload_as_json_with_its_headers() -> None:
    """A real local HTTP server receives one POST: the event, the study, a text line, the figures, and
    the secret header and URL token read from the environment."""
    with receiver() as server:
        channels = _webhook(server)
        failures = send(
            channels, "new_best", payload("new_best", _event(Kind.NEW_BEST), "demo", {"pick": {"trial": 3}})
        )
    assert failures == []
    (got,) = server.received
    assert got["path"] == f"/hook/{URL_SECRET}"
    assert got["headers"]["Authorization"] == f"Bearer {SECRET}"
    body = got["body"]
    assert body["event"] == "new_best" and body["study"] == "demo" and body["trial"] == 3
    assert body["text"].startswith("autotune study 'demo': ")
    assert body["launches"] == 4 and body["budget"] == 12 and body["pick"] == {"trial": 3}


def test_a_failing_webhook_is_reported_without_its_secrets_and_never_raises() -> None:
    """An error status, a refused connection and a receiver that never answers each become one failure
    line naming the URL as the spec writes it, with no secret in it; nothing is raised."""
    body = payload("stopped", _event(Kind.STOPPED), "demo")
    with receiver(status=500) as server:
        (failure,) = send(_webhook(server), "stopped", body)
    assert failure[0] == "webhook" and "HTTP 500" in failure[1] and "${URL_TOKEN}" in failure[1]

    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]  # bound, never listening: connections are refused
        spec = _spec(webhook={"url": f"http://127.0.0.1:{port}/${{URL_TOKEN}}"}, timeout=5)
        (refused,) = send(resolve_notify(spec, {"URL_TOKEN": URL_SECRET}), "stopped", body)
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()  # accepts into the backlog, never answers
        spec = _spec(
            webhook={"url": f"http://127.0.0.1:{silent.getsockname()[1]}/${{URL_TOKEN}}"}, timeout=0.5
        )
        (slow,) = send(resolve_notify(spec, {"URL_TOKEN": URL_SECRET}), "stopped", body)
    assert "ConnectError" in refused[1]
    assert "did not answer within 0.5 s" in slow[1]
    for _, why in (failure, refused, slow):
        assert SECRET not in why and URL_SECRET not in why


def test_the_command_gets_the_payload_on_stdin_and_the_event_in_its_environment(tmp_path: Path) -> None:
    """A real command (argv, no shell) reads the JSON payload on stdin and AUTOTUNE_EVENT/STUDY/TEXT."""
    out = tmp_path / "got.json"
    script = (
        "import json, os, sys; body = json.load(sys.stdin); "
        f"open({str(out)!r}, 'w').write(json.dumps([body, os.environ['AUTOTUNE_EVENT'], "
        "os.environ['AUTOTUNE_STUDY'], os.environ['AUTOTUNE_TEXT']]))"
    )
    channels = resolve_notify(_spec(command=[sys.executable, "-c", script]), dict(os.environ))
    assert send(channels, "finished", payload("finished", _event(Kind.FINISHED), "demo")) == []
    body, event, study, text = json.loads(out.read_text())
    assert body["event"] == event == "finished"
    assert study == "demo" and text == body["text"]


def test_a_command_that_fails_or_hangs_is_reported_and_killed_with_its_children(tmp_path: Path) -> None:
    """A non-zero exit is reported with its output's tail; a command past the timeout is killed with the
    processes it started (its own process group), and the failure says so."""
    body = payload("finished", _event(Kind.FINISHED), "demo")
    failing = resolve_notify(
        _spec(command=[sys.executable, "-c", "print('no route'); raise SystemExit(3)"]), {}
    )
    (failure,) = send(failing, "finished", body)
    assert failure[0] == "command" and "exited with status 3: no route" in failure[1]

    pid_file = tmp_path / "child.pid"
    hang = (
        "import subprocess, sys, time; "
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
        f"open({str(pid_file)!r}, 'w').write(str(child.pid)); time.sleep(600)"
    )
    hanging = resolve_notify(_spec(command=[sys.executable, "-c", hang], timeout=3), dict(os.environ))
    (slow,) = send(hanging, "finished", body)
    assert "ran past the timeout of 3 s and was killed" in slow[1]
    assert _gone(int(pid_file.read_text())), "the command's child was killed with it"


def test_a_killed_command_whose_escaped_child_holds_its_output_is_let_go(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A command past the timeout is killed with its group; a child that left the group (its own session)
    and still holds the output pipe does not keep the tuner reading: it is let go after KILL_WAIT_S."""
    import autotune.results.notify

    monkeypatch.setattr(autotune.results.notify, "KILL_WAIT_S", 0.5)
    pid_file = tmp_path / "escaped.pid"
    escape = (
        "import subprocess, sys, time; "
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], "
        "start_new_session=True); "
        f"open({str(pid_file)!r}, 'w').write(str(child.pid)); time.sleep(600)"
    )
    body = payload("finished", _event(Kind.FINISHED), "demo")
    hanging = resolve_notify(_spec(command=[sys.executable, "-c", escape], timeout=2), dict(os.environ))
    try:
        (slow,) = send(hanging, "finished", body)  # without the bound: held until the test's timeout
        assert "ran past the timeout of 2 s and was killed" in slow[1]
    finally:
        with contextlib.suppress(OSError, ValueError):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)


def _gone(pid: int) -> bool:
    """Whether process ``pid`` ended (a zombie not yet reaped by its new parent counts)."""
    try:
        proc = psutil.Process(pid)
        proc.wait(timeout=10)
    except psutil.NoSuchProcess:
        return True
    except psutil.TimeoutExpired:
        return proc.status() == psutil.STATUS_ZOMBIE
    return True


def test_the_notifier_sends_in_the_background_reports_failures_and_drains_on_close() -> None:
    """The notifier filters events, sends from its thread, reports a failing channel as a notify_failed
    event (the secret scrubbed) through ``on_failure``, and ``close`` waits for what is queued."""
    reported: list[Event] = []
    with receiver(status=503) as server:
        notifier = Notifier(_webhook(server), "demo", reported.append, lambda kind, event: {"extra": kind})
        notifier(_event(Kind.PHASE))
        notifier(_event(Kind.NEW_BEST, notify=True))
        notifier(_event(Kind.FINISHED, running_elsewhere=0))
        notifier.close()
        assert [r["body"]["event"] for r in server.received] == ["new_best", "finished"]
        assert all(r["body"]["extra"] == r["body"]["event"] for r in server.received)
    assert [e.kind for e in reported] == [Kind.NOTIFY_FAILED, Kind.NOTIFY_FAILED]
    assert reported[0].data["notification"] == "new_best" and reported[0].data["channel"] == "webhook"
    assert all(SECRET not in e.text and URL_SECRET not in e.text for e in reported)


def test_only_the_events_asked_for_are_sent_and_a_broken_extra_still_sends() -> None:
    """``events: [finished]`` sends nothing for a new best; an ``extra`` that raises is reported, and the
    notification goes without it."""
    reported: list[Event] = []

    def broken(kind: str, event: Event) -> dict[str, Any]:
        raise RuntimeError(f"storage gone {SECRET}")

    with receiver() as server:
        url = f"http://127.0.0.1:{server.server_port}/h"
        channels = resolve_notify(_spec(webhook={"url": url}, events=["finished"]), {})
        channels = dataclasses.replace(channels, secrets=(SECRET,))
        with Notifier(channels, "demo", reported.append, broken) as notifier:
            notifier(_event(Kind.NEW_BEST))
            notifier(_event(Kind.FINISHED))
        assert [r["body"]["event"] for r in server.received] == ["finished"]
    (failure,) = reported
    assert failure.data["channel"] == "payload" and "storage gone ***" in failure.text


def test_the_studys_other_secrets_are_kept_out_of_a_failing_commands_output() -> None:
    """A command inherits the environment and may print the server's API key: values passed as
    ``also_secret`` are scrubbed from its failure like the webhook's own."""
    key = "server-api-key-123456"
    spec = _spec(command=[sys.executable, "-c", f"print('using {key}'); raise SystemExit(1)"])
    channels = resolve_notify(spec, {}, also_secret=[key, ""])
    (failure,) = send(channels, "finished", payload("finished", _event(Kind.FINISHED), "demo"))
    assert "using ***" in failure[1] and key not in failure[1]


def test_the_storage_password_is_kept_out_of_a_failing_commands_output() -> None:
    """A fleet's workers get the storage URL as AUTOTUNE_STORAGE and a command inherits the environment: a
    failing command that prints it must not put the database password in events.jsonl (as written, or
    percent-decoded); nor the password of the URL given as ``storage_url`` (--storage, study.storage)."""
    url = "postgresql://tuner:pg-p%40ss-789@db.example:5432/autotune?sslmode=require"
    prints = (
        "import os, urllib.parse; url = os.environ['AUTOTUNE_STORAGE']; "
        "print(url, urllib.parse.unquote(urllib.parse.urlsplit(url).password)); raise SystemExit(1)"
    )
    channels = resolve_notify(_spec(command=[sys.executable, "-c", prints]), {"AUTOTUNE_STORAGE": url})
    body = payload("finished", _event(Kind.FINISHED), "demo")
    (failure,) = send(channels, "finished", body)
    assert "postgresql://tuner:***@db.example:5432/autotune?sslmode=require ***" in failure[1], failure
    assert "pg-p" not in failure[1] and "pg-p" not in repr(channels)

    given = "postgresql://tuner:user-part-pw@db.example/autotune?password=query-pw"
    said = "print('user-part-pw query-pw'); raise SystemExit(1)"
    channels = resolve_notify(_spec(command=[sys.executable, "-c", said]), {}, storage_url=given)
    (failure,) = send(channels, "finished", body)
    assert "exited with status 1: *** ***" in failure[1], failure
