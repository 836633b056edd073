"""One streamed request/response: the send stamp, the SSE decoding and every content chunk's arrival time.

Both HTTP engines (:mod:`autotune.load._rawhttp`, :mod:`autotune.load._aiohttp`) feed the bytes of a
response body to :meth:`Exchange.feed` with the ``perf_counter()`` of the network read that brought them.
When the engine also knows how long those bytes had waited in the socket (the raw engine: the kernel's
receive time), a chunk's time is when its read's newest bytes arrived, and the wait is kept per chunk
(:attr:`Exchange.waits`); otherwise a chunk's time is the time of its read.

JSON is parsed only where needed: a compact vLLM content chunk (``"choices":[{``) after the first is
counted without parsing; the first content chunk, the usage chunk, errors and anything unusual are parsed.
Chunks are counted the way ``vllm bench serve`` counts them: every event with a non-empty ``choices``
list is a content chunk.
"""

from __future__ import annotations

import json

_FAST = b'"choices":[{'
_DATA = b"data:"
_DONE = b"[DONE]"


class Exchange:
    """What one request and its streamed response produced (filled in by an engine as bytes arrive)."""

    __slots__ = (
        "_fast",
        "_last_late",
        "_line",
        "done",
        "error",
        "first",
        "prompt_tokens",
        "send",
        "status",
        "times",
        "usage_tokens",
        "waits",
    )

    def __init__(self, send: float = 0.0) -> None:
        self.send = send
        """``perf_counter()`` when the request was sent."""
        self.times: list[float] = []
        """Arrival time of every content chunk."""
        self.waits: list[float] = []
        """Per content chunk, how long the newest bytes of its read had waited in the socket before the
        read (its time is then their arrival); empty when the engine cannot tell."""
        self.first: float | None = None
        """Arrival time of the first content chunk (readable while the stream runs)."""
        self.status: int | None = None
        self.error = ""
        self.usage_tokens: int | None = None
        self.prompt_tokens: int | None = None
        self.done = False
        self._line = b""
        self._fast = False
        self._last_late: float | None = None

    def feed(self, data: bytes, t: float, waited: float | None = None) -> None:
        """Decode SSE bytes of the body read at ``t`` (``data:`` events; partial lines are kept); ``waited``
        is how long the newest of them had waited in the socket (``None``: unknown): their chunks are then
        timed at ``t - waited``, when they arrived."""
        if waited is not None:
            self._last_late = waited
            t -= waited
        if self._line:
            data = self._line + data
        lines = data.split(b"\n")
        self._line = lines.pop()
        times = self.times
        before = len(times)
        for line in lines:
            if self._fast and _FAST in line:
                times.append(t)
                continue
            if not line.startswith(_DATA):
                continue  # blank separators, comments, event: lines
            payload = line[5:].strip()
            if payload == _DONE:
                continue
            try:
                obj = json.loads(payload)
            except ValueError:
                self.error = f"unparseable SSE event: {payload[:200]!r}"
                continue
            if not isinstance(obj, dict):
                continue
            if obj.get("choices"):
                times.append(t)
                if not self._fast:
                    self._fast = True
                    self.first = t
            usage = obj.get("usage")
            if isinstance(usage, dict):
                if isinstance(usage.get("completion_tokens"), int):
                    self.usage_tokens = usage["completion_tokens"]
                if isinstance(usage.get("prompt_tokens"), int):
                    self.prompt_tokens = usage["prompt_tokens"]
            if "error" in obj:
                self.error = f"error event: {str(obj['error'])[:300]}"
        if waited is not None and len(times) > before:
            self.waits.extend([waited] * (len(times) - before))

    def flush(self, t: float) -> None:
        """The body ended: decode a last event that had no trailing newline."""
        if self._line.strip():
            if self._last_late is not None and self.times:  # time the last event like the read it came in
                self.feed(b"\n", self.times[-1] + self._last_late, self._last_late)
            else:
                self.feed(b"\n", self.times[-1] if self.times else t)
        self._line = b""
