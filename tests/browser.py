"""A real headless Chromium for tests, driven over the DevTools protocol: open a page, collect what would
show in its console, the requests it made, values of expressions, and a full-page screenshot.

Debian's ``chromium`` (``apt-get install -y chromium``; ``.ci/run`` installs it) runs with the sandbox off
(needed as root), no GPU, and the background services that phone home turned off (the closed network
otherwise fills its log). The browser picks its own debugging port and writes it to
``DevToolsActivePort`` in its profile folder; the page is driven through its websocket (aiohttp's
client). What counts as a console error: an uncaught exception (``Runtime.exceptionThrown``), a
``console.error``/``console.assert`` call (``Runtime.consoleAPICalled``), and a browser-side error entry
(``Log.entryAdded`` at level ``error``: a failed load, a refused request, a CSP violation).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")
INSTALL_HINT = "Chromium not found: apt-get install -y chromium (.ci/run installs it)"
START_TIMEOUT_S = 60.0
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--hide-scrollbars",
    "--remote-debugging-port=0",
)


def find_chromium() -> str | None:
    """The Chromium executable, or ``None``."""
    for name in CHROMIUM_NAMES:
        found = shutil.which(name)
        if found:
            return found
    return None


@dataclass
class PageReport:
    """What a page did while it loaded and was inspected."""

    errors: list[str] = field(default_factory=list)
    """Console errors: uncaught exceptions, console.error/assert calls, browser error entries."""
    requests: list[str] = field(default_factory=list)
    """Every URL the page asked for (the page's own file included)."""
    values: dict[str, Any] = field(default_factory=dict)
    """The value of each expression asked for."""
    screenshot: Path | None = None

    @property
    def external(self) -> list[str]:
        """Requests that would leave the machine (anything but file: and data: URLs)."""
        return [u for u in self.requests if not u.startswith(("file:", "data:", "about:"))]


@contextlib.contextmanager
def chromium(profile: Path) -> Iterator[str]:
    """A headless Chromium with its profile in ``profile``; yields its browser websocket URL's base
    (``http://127.0.0.1:PORT``). The whole process group is killed on exit."""
    exe = find_chromium()
    if exe is None:
        raise FileNotFoundError(INSTALL_HINT)
    profile.mkdir(parents=True, exist_ok=True)
    port_file = profile / "DevToolsActivePort"
    port_file.unlink(missing_ok=True)  # a previous browser's port: wait for this one's
    log = (profile / "chromium.log").open("wb")
    proc = subprocess.Popen(
        [exe, *FLAGS, f"--user-data-dir={profile}", "about:blank"],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not (port_file.is_file() and port_file.read_text().strip()):
            if proc.poll() is not None:
                raise RuntimeError(f"chromium exited with {proc.returncode}: see {profile / 'chromium.log'}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"chromium wrote no DevToolsActivePort in {START_TIMEOUT_S:g} s")
            time.sleep(0.05)
        port = int(port_file.read_text().split()[0])
        yield f"http://127.0.0.1:{port}"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        log.close()


class _Session:
    """One page's websocket: numbered commands, their answers, and the events in between."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse, report: PageReport) -> None:
        self.ws = ws
        self.report = report
        self.ids = itertools.count(1)
        self.loaded = asyncio.Event()

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        number = next(self.ids)
        await self.ws.send_str(json.dumps({"id": number, "method": method, "params": params}))
        while True:
            message = await self.ws.receive_json()
            if message.get("id") == number:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return dict(message.get("result", {}))
            self._event(message)

    async def until_loaded(self, timeout: float) -> None:
        async with asyncio.timeout(timeout):
            while not self.loaded.is_set():
                self._event(await self.ws.receive_json())

    def _event(self, message: Mapping[str, Any]) -> None:
        method, params = message.get("method"), message.get("params", {})
        if method == "Page.loadEventFired":
            self.loaded.set()
        elif method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            text = details.get("exception", {}).get("description") or details.get("text", "exception")
            self.report.errors.append(f"uncaught: {text}")
        elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            args = " ".join(str(a.get("value", a.get("description", ""))) for a in params.get("args", []))
            self.report.errors.append(f"console.{params['type']}: {args}")
        elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
            entry = params["entry"]
            self.report.errors.append(
                f"log ({entry.get('source')}): {entry.get('text')} {entry.get('url', '')}"
            )
        elif method == "Network.requestWillBeSent":
            self.report.requests.append(str(params.get("request", {}).get("url", "")))


async def _inspect(
    base: str,
    url: str,
    expressions: Mapping[str, str],
    screenshot: Path | None,
    width: int,
    timeout: float,
) -> PageReport:
    report = PageReport()
    async with aiohttp.ClientSession() as http:
        async with http.put(f"{base}/json/new?about:blank") as reply:
            target = await reply.json()
        async with http.ws_connect(target["webSocketDebuggerUrl"], max_msg_size=0) as ws:
            page = _Session(ws, report)
            for domain in ("Runtime", "Log", "Page", "Network"):
                await page.call(f"{domain}.enable")
            await page.call(
                "Emulation.setDeviceMetricsOverride",
                width=width,
                height=900,
                deviceScaleFactor=1,
                mobile=False,
            )
            await page.call("Page.navigate", url=url)
            await page.until_loaded(timeout)
            for name, expression in expressions.items():
                result = await page.call("Runtime.evaluate", expression=expression, returnByValue=True)
                if "exceptionDetails" in result:
                    report.errors.append(f"evaluating {name}: {result['exceptionDetails'].get('text')}")
                report.values[name] = result.get("result", {}).get("value")
            if screenshot is not None:
                metrics = await page.call("Page.getLayoutMetrics")
                size = metrics.get("cssContentSize") or metrics["contentSize"]
                shot = await page.call(
                    "Page.captureScreenshot",
                    format="png",
                    captureBeyondViewport=True,
                    clip={"x": 0, "y": 0, "width": width, "height": size["height"], "scale": 1},
                )
                screenshot.write_bytes(base64.b64decode(shot["data"]))
                report.screenshot = screenshot
            await page.call("Runtime.evaluate", expression="0")  # deliver the events still queued
    return report


def inspect_page(
    path: Path,
    profile: Path,
    *,
    expressions: Mapping[str, str] | None = None,
    screenshot: Path | None = None,
    width: int = 1200,
    timeout: float = 60.0,
) -> PageReport:
    """Open ``path`` in a fresh headless Chromium (profile in ``profile``) and report what it did."""
    with chromium(profile) as base:
        return asyncio.run(
            _inspect(base, path.resolve().as_uri(), expressions or {}, screenshot, width, timeout)
        )
