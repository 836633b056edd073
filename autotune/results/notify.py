"""Notifications: a command and/or a webhook told when a study finishes, stops, or finds a new best.

The ``notify:`` section of a spec (:class:`autotune.inputs.spec.NotifySpec`) is resolved once against the
environment (:func:`resolve_notify`: ``${NAME}`` in the webhook's URL and headers, a missing variable is
bad input). :class:`Notifier` is an ``on_event`` callback of the study loop: it turns the events that
matter (:func:`notification_for`) into a JSON payload and sends it from a background thread, so a slow or
dead receiver never holds a trial up. A notification that fails (a command that exits non-zero or runs
past the timeout, a webhook that refuses or does not answer) is reported as a
:attr:`~autotune.events.Kind.NOTIFY_FAILED` event, with every secret replaced by ``***``; it never
raises into the study.

The command is an argv list run without a shell, in its own process group (killed whole at the timeout),
with the tuner's environment plus ``AUTOTUNE_EVENT``, ``AUTOTUNE_STUDY`` and ``AUTOTUNE_TEXT``, and the
payload as JSON on its stdin. The webhook gets the payload as a JSON POST; its top-level ``text`` makes it
readable by chat webhooks that show a ``text`` field.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import queue
import re
import signal
import subprocess
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

import httpx

from autotune.events import Event, Kind
from autotune.inputs.loader import expand_variables, variables
from autotune.inputs.spec import NotifySpec
from autotune.units import format_figure

OUTPUT_TAIL = 300
"""Characters of a failed command's output kept in the failure's message."""
KILL_WAIT_S = 5.0
"""Seconds to read a killed command's last output before giving up on it."""

Extra = Callable[[str, Event], Mapping[str, Any]]
"""Adds facts to a notification's payload (e.g. the chosen config when the study finished)."""

STORAGE_VAR = "AUTOTUNE_STORAGE"
"""The storage URL's environment variable (``--storage``; how a fleet's workers get it): the command
inherits it."""

_URL_PASSWORD = re.compile(r"^[A-Za-z][\w+.-]*://[^:/@]*:(?P<password>.*)@[^@]*$", re.S)
_QUERY_PASSWORD = re.compile(r"[?&]password=(?P<password>[^&]*)", re.I)


def url_passwords(url: str | None) -> list[str]:
    """The passwords in a storage URL (in its user part, or a ``password=`` query parameter), each as
    written and percent-decoded."""
    if not url:
        return []
    match = _URL_PASSWORD.match(url)
    found = [match["password"]] if match is not None else []
    found += [m["password"] for m in _QUERY_PASSWORD.finditer(url)]
    return [form for text in found if text for form in dict.fromkeys((text, unquote(text)))]


@dataclass(frozen=True)
class Channels:
    """A ``notify:`` section resolved against the environment. Its ``repr`` shows no secret."""

    events: frozenset[str]
    timeout: float
    command: tuple[str, ...] | None = None
    url_shown: str | None = None
    """The webhook's URL as the spec writes it (``${NAME}`` unexpanded): safe to log."""
    url: str | None = field(default=None, repr=False)
    headers: Mapping[str, str] = field(default_factory=dict, repr=False)
    secrets: tuple[str, ...] = field(default=(), repr=False)
    """Values read from the environment: scrubbed from every message."""
    environ: Mapping[str, str] = field(default_factory=dict, repr=False)
    """The environment the command runs in (the tuner's)."""

    def scrub(self, text: str) -> str:
        """``text`` with every secret replaced by ``***``."""
        for secret in sorted(self.secrets, key=len, reverse=True):
            if secret:
                text = text.replace(secret, "***")
        return text


def resolve_notify(
    spec: NotifySpec,
    environ: Mapping[str, str],
    *,
    also_secret: Sequence[str] = (),
    storage_url: str | None = None,
) -> Channels:
    """The channels of ``spec`` with ``${NAME}`` read from ``environ``; a variable that is not set is a
    :class:`~autotune.errors.SpecError` naming the field and the variable (exit 2). ``also_secret``: other
    values to keep out of failure messages (the server's API key, the workload's header values: the
    command inherits the environment and might print them). The password of the storage URL
    (``storage_url``, and :data:`STORAGE_VAR` of ``environ``) is kept out of them too."""
    secrets: list[str] = [s for s in also_secret if s]
    secrets += url_passwords(storage_url) + url_passwords(environ.get(STORAGE_VAR))
    url = headers = None
    if spec.webhook is not None:
        url = expand_variables(spec.webhook.url, environ, "notify.webhook.url")
        headers = {
            name: expand_variables(text, environ, f"notify.webhook.headers.{name}")
            for name, text in spec.webhook.headers.items()
        }
        texts = [spec.webhook.url, *spec.webhook.headers.values()]
        secrets += [environ[name] for text in texts for name in variables(text) if environ.get(name)]
    return Channels(
        events=frozenset(spec.events),
        timeout=spec.timeout,
        command=spec.command,
        url_shown=spec.webhook.url if spec.webhook is not None else None,
        url=url,
        headers=headers or {},
        secrets=tuple(secrets),
        environ=dict(environ),
    )


def notification_for(event: Event) -> str | None:
    """Which notification ``event`` is: ``finished`` (the budget is spent and no trial runs elsewhere),
    ``stopped`` (a fault, or a signal), ``new_best`` (a new confirmed best: a finalist's rerun made another
    config the pick, or confirmed the pick first; in a study without finalists, a new best of the search
    from the tuner that measured it: the study marks these ``notify``), or ``None``."""
    if event.kind is Kind.FINISHED:
        return None if event.data.get("running_elsewhere") else "finished"
    if event.kind is Kind.STOPPED:
        return "stopped"
    if event.kind is Kind.NEW_BEST and event.data.get("notify") is True:
        return "new_best"
    return None


def payload(kind: str, event: Event, study: str, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The JSON a notification carries."""
    extra = dict(extra or {})
    text = f"autotune study {study!r}: {event.text}"
    headline = extra.get("headline")
    if isinstance(headline, str) and headline:
        text += f"; {headline}"
    return {
        "event": kind,
        "study": study,
        "text": text,
        "trial": event.trial,
        "launches": event.launches,
        "budget": event.budget,
        "best": event.best,
        "time": datetime.datetime.fromtimestamp(event.time, datetime.UTC).isoformat(timespec="seconds"),
        "worker": event.worker,
        "details": dict(event.data),
        **extra,
    }


def run_command(channels: Channels, kind: str, body: Mapping[str, Any]) -> str | None:
    """Run the command with ``body`` on stdin; why it failed (secrets scrubbed), or ``None``."""
    assert channels.command is not None
    env = {
        **channels.environ,
        "AUTOTUNE_EVENT": kind,
        "AUTOTUNE_STUDY": str(body.get("study", "")),
        "AUTOTUNE_TEXT": str(body.get("text", "")),
    }
    shown = " ".join(channels.command)
    try:
        proc = subprocess.Popen(
            list(channels.command),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # its own group: a timeout kills what it started too
        )
    except OSError as exc:
        return f"command {shown!r} did not start: {exc.strerror or exc}"
    data = json.dumps(body).encode()
    try:
        output, _ = proc.communicate(data, timeout=channels.timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)
        # A process that left the group may still hold the pipes: stop reading after a while.
        try:
            proc.communicate(timeout=KILL_WAIT_S)
        except subprocess.TimeoutExpired:
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None:
                    pipe.close()
            proc.kill()  # the command itself, had it left its group too
            proc.wait()
        waited = format_figure(channels.timeout, "s")
        return f"command {shown!r} ran past the timeout of {waited} and was killed"
    if proc.returncode != 0:
        tail = output.decode("utf-8", "replace").strip()[-OUTPUT_TAIL:]
        said = f": {tail}" if tail else ""
        return channels.scrub(f"command {shown!r} exited with status {proc.returncode}{said}")
    return None


def post_webhook(channels: Channels, body: Mapping[str, Any]) -> str | None:
    """POST ``body`` as JSON to the webhook; why it failed (the URL as written, secrets scrubbed), or
    ``None``."""
    assert channels.url is not None
    where = f"webhook {channels.url_shown}"
    try:
        with httpx.Client(timeout=channels.timeout, follow_redirects=False) as client:
            reply = client.post(channels.url, json=dict(body), headers=dict(channels.headers))
    except httpx.TimeoutException:
        return f"{where} did not answer within {format_figure(channels.timeout, 's')}"
    except (httpx.HTTPError, OSError, ValueError) as exc:
        return channels.scrub(f"{where}: {type(exc).__name__}: {exc}")
    if reply.status_code >= 300:
        return channels.scrub(f"{where} answered HTTP {reply.status_code} {reply.reason_phrase}")
    return None


def send(channels: Channels, kind: str, body: Mapping[str, Any]) -> list[tuple[str, str]]:
    """Send one notification to every channel; ``(channel, why)`` for each that failed."""
    failures = []
    if channels.command is not None:
        why = run_command(channels, kind, body)
        if why is not None:
            failures.append(("command", why))
    if channels.url is not None:
        why = post_webhook(channels, body)
        if why is not None:
            failures.append(("webhook", why))
    return failures


_STOP = object()


class Notifier:
    """An ``on_event`` callback that sends notifications from a background thread.

    ``on_failure`` gets a :attr:`~autotune.events.Kind.NOTIFY_FAILED` event for each channel that failed
    (from that thread); ``extra`` adds facts to a payload (a failure there is reported, and the
    notification still goes). Call :meth:`close` (or use it as a context manager) before the process
    ends: it waits for the notifications still queued.
    """

    def __init__(
        self,
        channels: Channels,
        study: str,
        on_failure: Callable[[Event], None],
        extra: Extra | None = None,
    ) -> None:
        self.channels = channels
        self.study = study
        self._on_failure = on_failure
        self._extra = extra
        self._queue: queue.Queue[object] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def __call__(self, event: Event) -> None:
        """Queue the notification ``event`` stands for, if it is one the spec asks for."""
        kind = notification_for(event)
        if kind is None or kind not in self.channels.events:
            return
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="autotune-notify", daemon=True)
                self._thread.start()
        self._queue.put((kind, event))

    def close(self) -> None:
        """Wait for the queued notifications (each at most the timeout per channel), then stop."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is None:
            return
        pending = self._queue.qsize() + 1
        self._queue.put(_STOP)
        thread.join(timeout=pending * (2 * self.channels.timeout + 5.0))

    def __enter__(self) -> Notifier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _work(self) -> None:
        while (item := self._queue.get()) is not _STOP:
            assert isinstance(item, tuple)
            kind, event = item
            with contextlib.suppress(Exception):  # never let the thread die: the next one may go through
                self._deliver(kind, event)

    def _deliver(self, kind: str, event: Event) -> None:
        extra: Mapping[str, Any] = {}
        failures: list[tuple[str, str]] = []
        if self._extra is not None:
            try:
                extra = self._extra(kind, event)
            except Exception as exc:
                failures.append(("payload", self.channels.scrub(f"{type(exc).__name__}: {exc}")))
        failures += send(self.channels, kind, payload(kind, event, self.study, extra))
        for channel, why in failures:
            self._report(kind, event, channel, why)

    def _report(self, kind: str, event: Event, channel: str, why: str) -> None:
        failed = Event(
            kind=Kind.NOTIFY_FAILED,
            text=f"notification {kind} failed: {why}",
            trial=event.trial,
            launches=event.launches,
            budget=event.budget,
            elapsed_s=event.elapsed_s,
            best=event.best,
            data={"notification": kind, "channel": channel, "error": why},
            worker=event.worker,
        )
        with contextlib.suppress(Exception):  # the event log itself failing must not end the thread
            self._on_failure(failed)
