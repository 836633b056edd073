"""The wire's own clock: kernel timestamps of HTTP requests and SSE chunks on the loopback interface.

A raw ``AF_PACKET`` socket on ``lo`` (needs root or CAP_NET_RAW) receives every TCP packet to and from the
server's port with its kernel receive time (``SO_TIMESTAMPNS``). For each ``POST`` it records when the
request went out and when the first and the last packet carrying a content chunk (``"choices":[{``) came
back; the request's body tells which client sent it. A client's reported TTFT minus the wire's TTFT is then
what the client itself added: the ground truth the agreement benchmark needs when two clients disagree.

The capture runs in its own process: a thread would share the GIL with a Python client under test in the
same process and delay its reads (it handles every packet, in bursts). Timestamps are ``CLOCK_REALTIME``
(kernel); only differences within one capture are used.
"""

from __future__ import annotations

import multiprocessing
import select
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

ETH_P_ALL = 0x0003
PACKET_OUTGOING = 4
SO_TIMESTAMPNS = 35
_CHOICES = b'"choices":[{'


@dataclass
class WireRequest:
    """One request as the wire saw it (seconds, kernel clock)."""

    sent: float
    """When the request's first packet (its headers) went out."""
    body: float
    """When its body went out (the same packet, or a later one when the client wrote them apart)."""
    client: str
    """The label :class:`Wiretap`'s ``classify`` gave the request body."""
    head: float | None = None
    """When the first packet of the response (its status line and headers) came back."""
    first: float | None = None
    last: float | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.sent

    @property
    def e2el(self) -> float | None:
        return None if self.last is None else self.last - self.sent


@dataclass
class _Conn:
    open: WireRequest | None = None
    pending_header: float | None = None


@dataclass
class Wiretap:
    """Capture the requests to ``port`` on ``lo`` in a child process (``start``/``stop``)."""

    port: int
    classify: Callable[[bytes], str]
    """Label of a request from its bytes (headers and body as first seen); a module-level function."""
    paths: tuple[bytes, ...] = (b"/v1/completions", b"/v1/chat/completions")
    """The request paths captured (other requests are ignored)."""
    announce: tuple[str, int] = ("", 0)
    """``(label, k)``: report the send times of the first ``k`` requests with that label as they happen
    (:meth:`next_announced`), e.g. to start another client in step with one under observation."""
    requests: list[WireRequest] = field(default_factory=list)
    _proc: Any = None
    _pipe: Connection | None = None
    """The parent's end of the pipe to the capture process."""
    _announce_to: Connection | None = None
    """In the capture process: where announcements go, and how many went."""
    _announced: int = 0

    def start(self) -> None:
        """Start capturing; raises :class:`PermissionError` without root or CAP_NET_RAW."""
        ctx = multiprocessing.get_context("fork")
        here, there = ctx.Pipe()
        self._proc = ctx.Process(target=self._child, args=(there,), name="wiretap", daemon=True)
        self._proc.start()
        there.close()
        self._pipe = here
        status, detail = here.recv()
        if status != "ready":
            self._proc.join()
            raise PermissionError(detail)

    def next_announced(self, timeout: float) -> float:
        """The wire's send time (kernel clock) of the next announced request; :class:`TimeoutError` when
        none comes within ``timeout`` seconds."""
        assert self._pipe is not None
        if not self._pipe.poll(timeout):
            raise TimeoutError(f"no {self.announce[0]!r} request on the wire within {timeout:g} s")
        kind, sent = self._pipe.recv()
        assert kind == "seen"
        return float(sent)

    def stop(self) -> list[WireRequest]:
        """Stop capturing and return every request seen."""
        if self._pipe is not None:
            self._pipe.send("stop")
            while True:  # announcements nobody read come first
                kind, payload = self._pipe.recv()
                if kind == "requests":
                    self.requests = payload
                    break
            self._pipe.close()
            self._pipe = None
        if self._proc is not None:
            self._proc.join()
            self._proc = None
        return self.requests

    def _child(self, pipe: Connection) -> None:
        try:
            sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
        except PermissionError as exc:
            pipe.send(("denied", str(exc)))
            return
        sock.bind(("lo", 0))
        sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        pipe.send(("ready", ""))
        self._announce_to = pipe
        conns: dict[int, _Conn] = {}
        while not pipe.poll():
            ready, _, _ = select.select([sock], [], [], 0.05)
            if not ready:
                continue
            data, anc, _, addr = sock.recvmsg(65536, 64)
            if addr[2] == PACKET_OUTGOING:  # loopback shows each packet twice: keep the delivered copy
                continue
            stamp = next((a for a in anc if a[0] == socket.SOL_SOCKET and a[1] == SO_TIMESTAMPNS), None)
            if stamp is None:
                continue
            sec, nsec = struct.unpack("qq", stamp[2][:16])
            self._packet(data, sec + nsec * 1e-9, conns)
        sock.close()
        pipe.recv()
        pipe.send(("requests", self.requests))

    def _packet(self, frame: bytes, t: float, conns: dict[int, _Conn]) -> None:
        if len(frame) < 14 + 20 or frame[12:14] != b"\x08\x00":  # IPv4 only (the benchmark's 127.0.0.1)
            return
        ip = frame[14:]
        ihl = (ip[0] & 0x0F) * 4
        if ip[9] != 6:  # TCP
            return
        tcp = ip[ihl:]
        src, dst = struct.unpack("!HH", tcp[:4])
        payload = tcp[(tcp[12] >> 4) * 4 : struct.unpack("!H", ip[2:4])[0] - ihl]
        if not payload:
            return
        if dst == self.port:  # client -> server
            conn = conns.setdefault(src, _Conn())
            if payload.startswith(b"POST "):
                conn.open = conn.pending_header = None
                if payload[5 : payload.find(b" ", 5)] not in self.paths:
                    return  # e.g. a /tokenize call
                conn.pending_header = t
                if b"\r\n\r\n" in payload and payload.split(b"\r\n\r\n", 1)[1]:
                    self._open(conn, t, t, payload)
            elif conn.pending_header is not None:  # the body in its own packet
                self._open(conn, conn.pending_header, t, payload)
        elif src == self.port:
            reply = conns.get(dst)
            if reply is None or reply.open is None:
                return
            if reply.open.head is None:
                reply.open.head = t
            if _CHOICES not in payload:
                return
            if reply.open.first is None:
                reply.open.first = t
            reply.open.last = t

    def _open(self, conn: _Conn, sent: float, body_at: float, body: bytes) -> None:
        conn.pending_header = None
        conn.open = WireRequest(sent=sent, body=body_at, client=self.classify(body))
        self.requests.append(conn.open)
        label, k = self.announce
        if conn.open.client == label and self._announced < k and self._announce_to is not None:
            self._announced += 1
            self._announce_to.send(("seen", sent))
