"""One streamed request/response: the send stamp, the SSE decoding and every content chunk's arrival time.

Both HTTP engines (:mod:`autotune.load._rawhttp`, :mod:`autotune.load._aiohttp`) feed the bytes of a
response body to :meth:`Exchange.feed` with the ``perf_counter()`` of the network read that brought them.
When the engine also knows how long those bytes had waited in the socket (the raw engine: the kernel's
receive time), a chunk's time is when its read's newest bytes arrived, and the wait is kept per chunk
(:attr:`Exchange.waits`); otherwise a chunk's time is the time of its read. The raw engine also says how
much earlier than that any byte of the read may have arrived (``early``: the read's kernel time minus
the last moment the socket was known to hold none of them); every chunk of the read gets it as its
allowance (:attr:`Exchange.early`), except the read's newest chunk when nothing followed it in the read:
its bytes were the newest, so its time is theirs.

JSON is parsed only where needed: a compact vLLM content chunk (``"choices":[{``) after the first is
counted without parsing; the first content chunk, the usage chunk, errors and anything unusual are parsed.
An exchange made with ``keep_text`` (a turn whose reply the next turn of its conversation sends back) also
keeps its content events and parses them once the stream is over (:meth:`Exchange.reply`).
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
        "_last_read",
        "_line",
        "done",
        "early",
        "error",
        "first",
        "prompt_tokens",
        "send",
        "sent",
        "status",
        "text",
        "times",
        "usage_tokens",
        "waits",
    )

    def __init__(self, send: float = 0.0, *, keep_text: bool = False) -> None:
        self.send = send
        self.text: list[bytes] | None = [] if keep_text else None
        """The content events' lines, when kept (``keep_text``)."""
        """``perf_counter()`` when the request was sent (taken just before its write)."""
        self.sent = 0.0
        """``perf_counter()`` when its write returned (0.0: unknown): its bytes left between the two."""
        self.times: list[float] = []
        """Arrival time of every content chunk."""
        self.waits: list[float] = []
        """Per content chunk, how long the newest bytes of its read had waited in the socket before the
        read (its time is then their arrival); empty when the engine cannot tell."""
        self.early: list[float] = []
        """Per content chunk (with :attr:`waits`), how much earlier than its time it may have arrived: 0.0
        for a chunk whose bytes were its read's newest, else its read's ``early``."""
        self.first: float | None = None
        """Arrival time of the first content chunk (readable while the stream runs)."""
        self.status: int | None = None
        self.error = ""
        self.usage_tokens: int | None = None
        self.prompt_tokens: int | None = None
        self.done = False
        self._line = b""
        self._fast = False
        self._last_read: tuple[float, float | None, float] | None = None
        """The last read fed: its time, its wait (``None``: unknown) and its allowance."""

    def feed(
        self, data: bytes, t: float, waited: float | None = None, early: float = 0.0, whole: bool = True
    ) -> None:
        """Decode SSE bytes of the body read at ``t`` (``data:`` events; partial lines are kept).

        ``waited``: how long the newest of them had waited in the socket (``None``: unknown); their chunks
        are then timed at ``t - waited``, when they arrived, and each gets ``early`` as its allowance,
        except the newest when ``whole`` (``data`` is all of one read, which drained the socket and ended
        on a frame boundary) and nothing but blank lines follows it: that one's bytes were the newest."""
        self._last_read = (t, waited, early)
        if waited is not None:
            t -= waited
        if self._line:
            data = self._line + data
        lines = data.split(b"\n")
        self._line = lines.pop()
        times = self.times
        before = len(times)
        tail = False  # bytes of another event came after the newest content chunk of this read
        text = self.text
        for line in lines:
            if self._fast and _FAST in line:
                times.append(t)
                tail = False
                if text is not None:
                    text.append(line)
                continue
            if not line.startswith(_DATA):
                if line.strip():
                    tail = True  # a comment or an event: line
                continue  # blank separators, comments, event: lines
            payload = line[5:].strip()
            if payload == _DONE:
                tail = True
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
                tail = False
                if text is not None:
                    text.append(line)
                if not self._fast:
                    self._fast = True
                    self.first = t
            else:
                tail = True
            usage = obj.get("usage")
            if isinstance(usage, dict):
                if isinstance(usage.get("completion_tokens"), int):
                    self.usage_tokens = usage["completion_tokens"]
                if isinstance(usage.get("prompt_tokens"), int):
                    self.prompt_tokens = usage["prompt_tokens"]
            if "error" in obj:
                self.error = f"error event: {str(obj['error'])[:300]}"
        if waited is not None and len(times) > before:
            added = len(times) - before
            self.waits.extend([waited] * added)
            self.early.extend([early] * added)
            if whole and not tail and not self._line:
                self.early[-1] = 0.0

    def reply(self) -> str:
        """The text of the content events kept (``keep_text``): completions' ``text``, chat's ``delta``
        content, in order; empty when none was kept."""
        parts: list[str] = []
        for line in self.text or ():
            try:
                obj = json.loads(line[len(_DATA) :])
            except ValueError:
                continue
            choices = obj.get("choices") if isinstance(obj, dict) else None
            if not choices or not isinstance(choices[0], dict):
                continue
            choice = choices[0]
            piece = choice.get("text")
            if piece is None and isinstance(choice.get("delta"), dict):
                piece = choice["delta"].get("content")
            if isinstance(piece, str):
                parts.append(piece)
        return "".join(parts)

    def flush(self, t: float) -> None:
        """The body ended (at ``t``): decode a last event that had no trailing newline, timed like the
        read it came in (with that read's wait and allowance, where known)."""
        if self._line.strip():
            read, waited, early = self._last_read if self._last_read is not None else (t, None, 0.0)
            self.feed(b"\n", read, waited, early, whole=False)
        self._line = b""
