"""Truth benchmark: is every run of autotune's load client either right (within 5 % of the server's own
timing) or marked invalid by its self-check? A wrong-but-valid run is the one thing this must never show.

A reference SSE server (non-blocking sockets on uvloop, pinned to core 0) streams vLLM-format chunks and
records, per request (matched by the ``X-Request-Id`` the client sends), when the request arrived (the
kernel's receive time of its first bytes, ``SO_TIMESTAMPNS``: so the server's own delay in reading a
request counts in its TTFT) and the ``perf_counter()`` of every chunk it wrote (CLOCK_MONOTONIC, shared
by every process of the machine: server and client times are on one clock). The first chunk leaves
``--prefill-ms`` after arrival (plus the wait for the next engine step in ``step`` pacing), then one chunk
per ``pace`` ms.

The client runs in its own process pinned to core 1 (``taskset``), optionally with a neighbour that spins
on the same core (at the client's priority, or with the client at ``nice 19``), or as two worker processes
on that one core. Each run is summarised twice with autotune's own metric definitions
(:func:`autotune.load.metrics.summarize`): from the client's records, and from the server's truth. The
table gives reported / true for TTFT p95, ITL p99 and TPOT p99, and the client's verdict.

    python benchmarks/truth.py                    # every condition, 3 repetitions (about 15 minutes)
    python benchmarks/truth.py --reps 1 --only starved
    python benchmarks/truth.py serve --port 0     # only the server (prints its port)
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import resource
import socket
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

_CHUNK_JSON = (
    '{"id":"cmpl-truth","object":"text_completion","created":1733000000,"model":"truth",'
    '"choices":[{"index":0,"text":" word","logprobs":null,"finish_reason":null,"stop_reason":null}],'
    '"usage":null}'
)


_SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)


def _frame(payload: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(payload), payload)


_EVENT = _frame(b"data: " + _CHUNK_JSON.encode() + b"\n\n")
_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
    b"Connection: keep-alive\r\n\r\n"
)

# ----------------------------------------------------------------------------------------------
# The reference server
# ----------------------------------------------------------------------------------------------


class _Steps:
    """One engine-step clock: every ``period`` s each registered stream writes its next chunk."""

    def __init__(self, period: float) -> None:
        self.period = period
        self.streams: list[Any] = []
        self.running = False

    def add(self, step: Any) -> None:
        self.streams.append(step)
        if not self.running:
            self.running = True
            loop = asyncio.get_running_loop()
            loop.call_at(loop.time() + self.period, self._tick, loop.time() + self.period)

    def _tick(self, at: float) -> None:
        self.streams = [s for s in self.streams if s()]
        if not self.streams:
            self.running = False
            return
        asyncio.get_running_loop().call_at(at + self.period, self._tick, at + self.period)


class _Conn:
    """One client connection, read with ``recvmsg`` for the kernel's receive time of each request."""

    truth: ClassVar[dict[str, dict[str, Any]]] = {}
    steps: ClassVar[dict[float, _Steps]] = {}
    prefill_s: ClassVar[float] = 0.015
    offset: ClassVar[float] = 0.0
    """perf_counter - CLOCK_REALTIME, to put the kernel's receive times on the perf_counter clock."""

    def __init__(self, sock: socket.socket, loop: asyncio.AbstractEventLoop) -> None:
        self.sock = sock
        self.loop = loop
        self.buf = b""
        self.arrived: float | None = None
        self.out = bytearray()
        self.closed = False
        sock.setblocking(False)
        sock.setsockopt(socket.SOL_SOCKET, _SO_TIMESTAMPNS, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        loop.add_reader(sock, self._readable)

    def _readable(self) -> None:
        try:
            data, ancillary, _, _ = self.sock.recvmsg(1 << 16, 256)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self.close()
            return
        if self.arrived is None:  # the first bytes of a request: the kernel says when they came
            stamp = time.perf_counter()
            for level, kind, raw in ancillary:
                if level == socket.SOL_SOCKET and kind == _SO_TIMESTAMPNS:
                    sec, nsec = struct.unpack("qq", raw[:16])
                    stamp = sec + nsec / 1e9 + _Conn.offset
            self.arrived = stamp
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end].decode("latin-1")
            headers = {}
            for line in head.split("\r\n")[1:]:
                key, _, value = line.partition(":")
                headers[key.strip().lower()] = value.strip()
            length = int(headers.get("content-length", "0"))
            if len(self.buf) < end + 4 + length:
                return
            body = self.buf[end + 4 : end + 4 + length]
            self.buf = self.buf[end + 4 + length :]
            arrived = self.arrived
            self.arrived = time.perf_counter() if self.buf else None
            self._handle(head.split(" ")[1], headers, body, arrived)

    def write(self, data: bytes) -> None:
        if self.closed:
            return
        if self.out:
            self.out += data
            return
        try:
            sent = self.sock.send(data)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            self.close()
            return
        if sent < len(data):
            self.out += data[sent:]
            self.loop.add_writer(self.sock, self._writable)

    def _writable(self) -> None:
        try:
            sent = self.sock.send(self.out)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self.close()
            return
        del self.out[:sent]
        if not self.out:
            self.loop.remove_writer(self.sock)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.loop.remove_reader(self.sock)
            self.loop.remove_writer(self.sock)
            self.sock.close()

    def _reply(self, status: str, payload: bytes) -> None:
        self.write(
            b"HTTP/1.1 %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
            % (status.encode(), len(payload), payload)
        )

    def _handle(self, path: str, headers: dict[str, str], body: bytes, arrived: float) -> None:
        if path == "/dump":
            self._reply("200 OK", json.dumps(_Conn.truth).encode())
            _Conn.truth = {}
            return
        if path == "/health":
            self._reply("200 OK", b"{}")
            return
        if path != "/v1/completions":
            self._reply("404 Not Found", b"{}")
            return
        req = json.loads(body)
        n = int(req["max_tokens"])
        kind, _, ms = str(req["model"]).partition("-")
        pace = float(ms) / 1000.0
        writes: list[float] = []
        _Conn.truth[headers.get("x-request-id", f"anon-{len(_Conn.truth)}")] = {
            "arrive": arrived,
            "writes": writes,
        }
        self.write(_HEAD)
        loop = self.loop
        usage = json.dumps(
            {"id": "x", "choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": n}},
            separators=(",", ":"),
        ).encode()
        tail = _frame(b"data: " + usage + b"\n\n") + _frame(b"data: [DONE]\n\n") + b"0\r\n\r\n"

        def write() -> bool:
            if self.closed:
                return False
            self.write(_EVENT)
            writes.append(time.perf_counter())
            if len(writes) < n:
                return True
            self.write(tail)
            return False

        # The first chunk leaves prefill after the request arrived (the kernel's time), whenever the
        # server got round to reading it: its own delays are part of its TTFT.
        t0 = loop.time() + max(0.0, arrived + _Conn.prefill_s - time.perf_counter())

        def paced(k: int) -> None:
            if write():
                loop.call_at(t0 + (k + 1) * pace, paced, k + 1)

        if kind == "step":
            loop.call_at(t0, _Conn.steps.setdefault(pace, _Steps(pace)).add, write)
        else:
            loop.call_at(t0, paced, 0)


async def _serve(port: int) -> None:
    loop = asyncio.get_running_loop()
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(8192)
    listener.setblocking(False)
    _Conn.offset = time.perf_counter() - time.time()
    conns: list[_Conn] = []

    def accept() -> None:
        while True:
            try:
                sock, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            conns.append(_Conn(sock, loop))

    loop.add_reader(listener, accept)
    print(listener.getsockname()[1], flush=True)
    await asyncio.Event().wait()


def serve(port: int, prefill_ms: float) -> None:
    """Run the reference server until killed."""
    import uvloop

    _Conn.prefill_s = prefill_ms / 1000.0
    uvloop.run(_serve(port))


# ----------------------------------------------------------------------------------------------
# The client under test (its own process)
# ----------------------------------------------------------------------------------------------


def client(args: argparse.Namespace) -> None:
    """Run autotune's client once and write its records and verdict as JSON."""
    from autotune.load import selfcheck
    from autotune.load.client import run_requests
    from autotune.load.records import Preparation

    if args.late_floor_ms is not None:  # calibration runs only: the shipped floor is selfcheck's
        selfcheck.LATE_FLOOR_S = args.late_floor_ms / 1e3
    if args.keep_gc:  # what freezing the collector costs: the same run with it left on
        import types

        selfcheck.gc = types.SimpleNamespace(  # type: ignore[assignment]
            collect=gc.collect, freeze=lambda: None, unfreeze=lambda: None, disable=lambda: None,
            enable=gc.enable, isenabled=gc.isenabled, callbacks=gc.callbacks,
        )  # fmt: skip
    from autotune.load.workload import RequestSpec, arrival_times
    from autotune.spec import ArrivalSpec

    rng = random.Random(args.seed)
    n = args.streams * args.rounds
    lengths = [rng.randint(50, 150) for _ in range(n)]
    requests = [RequestSpec(prompt=f"r{i}", input_len=1, output_len=lengths[i]) for i in range(n)]
    if args.arrival == "poisson":
        # Offered load keeping about `streams` requests in flight: rate = streams / mean E2EL.
        mean_e2el = args.prefill_ms / 1e3 + 100 * args.pace_ms / 1e3
        rate = args.streams / mean_e2el
        arrivals = arrival_times(ArrivalSpec(process="poisson"), rate, n, args.seed)
        limit = None
    else:
        arrivals = [0.0] * n
        limit = args.streams
    model = f"{'step' if args.step else 'pace'}-{args.pace_ms:g}"
    result = run_requests(
        args.base,
        model,
        "completions",
        requests,
        arrivals,
        max_concurrency=limit,
        workers=args.workers,
        engine=args.engine,
        prepare=Preparation(connections=args.streams if limit else min(n, args.streams)),
    )
    out = {
        "records": [
            {"id": r.request_id, "send": r.send_time, "chunks": list(r.chunk_times), "ok": r.success}
            for r in result.records
        ],
        "problems": list(result.problems),
        "check": result.client.as_dict(),
        # Memory held while measuring: peak resident set, and what one collection frees afterwards.
        "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "gc_freed_after": gc.collect(),
    }
    Path(args.out).write_text(json.dumps(out))


# ----------------------------------------------------------------------------------------------
# The driver
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Condition:
    """One way of running the client."""

    name: str
    streams: int
    pace_ms: float
    step: bool = False
    arrival: str = "concurrency"
    engine: str = "raw"
    workers: int = 1
    keep_gc: bool = False
    """Leave the garbage collector on while measuring (to see what freezing it costs)."""
    neighbour: str = ""
    """"" (none), "equal" (a spinning process at the client's priority on its core) or "starved" (the
    client at nice 19 beside one at nice 0)."""
    rounds: int = 3


CONDITIONS = (
    Condition("256x20 concurrency", 256, 20),
    Condition("256x20 poisson", 256, 20, arrival="poisson"),
    Condition("256x20 step", 256, 20, step=True),
    Condition("256x20 aiohttp", 256, 20, engine="aiohttp"),
    Condition("256x5", 256, 5, rounds=6),
    Condition("1024x20", 1024, 20, rounds=2),
    Condition("1024x5", 1024, 5, rounds=3),
    Condition("1024x20 aiohttp", 1024, 20, engine="aiohttp", rounds=2),
    Condition("64x20 starved", 64, 20, neighbour="starved"),
    Condition("256x20 equal neighbour", 256, 20, neighbour="equal"),
    Condition("256x20 poisson equal neighbour", 256, 20, arrival="poisson", neighbour="equal"),
    Condition("1024x20 2 workers on 1 core", 1024, 20, workers=2, rounds=2),
    Condition("1024x20 gc left on", 1024, 20, rounds=2, keep_gc=True),
)


def _summary(records: list[dict[str, Any]], key_send: str, key_chunks: str) -> dict[str, float]:
    from autotune.load.metrics import summarize
    from autotune.load.records import RequestRecord

    recs = [
        RequestRecord(
            index=i,
            send_time=r[key_send],
            chunk_times=tuple(r[key_chunks]),
            output_tokens=len(r[key_chunks]),
            prompt_tokens=1,
            input_len=1,
            output_len=len(r[key_chunks]),
            success=True,
            end_time=r[key_chunks][-1] if r[key_chunks] else r[key_send],
        )
        for i, r in enumerate(records)
    ]
    span = max(r.end_time for r in recs) - min(r.send_time for r in recs)
    m = summarize(recs, span, None)
    return {"ttft_p95": m.ttft.p95, "itl_p99": m.itl.p99, "tpot_p99": m.tpot.p99, "itl_p50": m.itl.p50}


def run_condition(
    base: str, cond: Condition, rep: int, prefill_ms: float, tmp: Path, late_floor_ms: float | None = None
) -> dict[str, Any]:
    """One run of ``cond``: the client in its own pinned process, then its figures against the truth."""
    import httpx

    httpx.post(base + "/dump", timeout=30)  # clear
    out = tmp / f"client-{os.getpid()}-{rep}.json"
    argv = [
        sys.executable,
        __file__,
        "client",
        "--base",
        base,
        "--streams",
        str(cond.streams),
        "--pace-ms",
        str(cond.pace_ms),
        "--rounds",
        str(cond.rounds),
        "--arrival",
        cond.arrival,
        "--engine",
        cond.engine,
        "--workers",
        str(cond.workers),
        "--prefill-ms",
        str(prefill_ms),
        "--seed",
        str(rep),
        "--out",
        str(out),
        *(["--step"] if cond.step else []),
        *(["--keep-gc"] if cond.keep_gc else []),
        *(["--late-floor-ms", str(late_floor_ms)] if late_floor_ms is not None else []),
    ]
    prefix = ["taskset", "-c", "1"]
    if cond.neighbour == "starved":
        prefix += ["nice", "-n", "19"]
    spinner = None
    if cond.neighbour:
        spinner = subprocess.Popen(["taskset", "-c", "1", sys.executable, "-c", "while True: pass"])
    try:
        subprocess.run([*prefix, *argv], check=True, timeout=600)
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()
    got = json.loads(out.read_text())
    truth = httpx.post(base + "/dump", timeout=30).json()
    matched = [r for r in got["records"] if r["ok"] and r["id"] in truth]
    server = [{"send": truth[r["id"]]["arrive"], "chunks": truth[r["id"]]["writes"]} for r in matched]
    reported = _summary(matched, "send", "chunks")
    true = _summary(server, "send", "chunks")
    ratios = {
        k: reported[k] / true[k] if true[k] > 0 else float("nan") for k in ("ttft_p95", "itl_p99", "tpot_p99")
    }
    agrees = all(abs(v - 1.0) <= 0.05 for v in ratios.values())
    valid = not got["problems"]
    return {
        "condition": cond.name,
        "rep": rep,
        "matched": len(matched),
        "records": len(got["records"]),
        "ratios": ratios,
        "reported_ms": {k: v * 1e3 for k, v in reported.items()},
        "true_ms": {k: v * 1e3 for k, v in true.items()},
        "valid": valid,
        "agrees": agrees,
        "wrong_but_valid": valid and not agrees,
        "problems": got["problems"],
        "check": got["check"],
        "max_rss_mib": got["max_rss_mib"],
        "gc_freed_after": got["gc_freed_after"],
    }


def _row(r: dict[str, Any]) -> str:
    ratios = r["ratios"]
    verdict = "valid" if r["valid"] else "invalid"
    flag = " **WRONG BUT VALID**" if r["wrong_but_valid"] else ""
    why = "; ".join(p.split(":")[0] for p in r["problems"])
    shifts = r["check"].get("shifts", {}) if r["check"] else {}
    bound = max(shifts.values(), default=0.0)
    return (
        f"| {r['condition']} | {r['rep']} | {ratios['ttft_p95']:.3f} | {ratios['itl_p99']:.3f} | "
        f"{ratios['tpot_p99']:.3f} | {r['true_ms']['ttft_p95']:.1f} / {r['true_ms']['itl_p99']:.1f} ms | "
        f"{bound:.1%} | {r['check'].get('gc_collections', 0)} / {r['max_rss_mib']:.0f} MiB | "
        f"{verdict}{flag} | {why} |"
    )


HEADER = (
    "| condition | rep | TTFT p95 rep/true | ITL p99 rep/true | TPOT p99 rep/true | true TTFT p95 / ITL p99 "
    "| own error bound | GC runs / client RSS | verdict | why invalid |\n"
    "|---|---|---|---|---|---|---|---|---|---|"
)


def main() -> None:
    """Start the reference server, run every condition, print the table (and JSON with --json)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", nargs="?", default="bench", choices=["bench", "serve", "client"])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--only", help="run only conditions whose name contains this")
    parser.add_argument("--json", help="also write every run's figures to this file")
    parser.add_argument("--prefill-ms", type=float, default=15.0)
    # client options
    parser.add_argument("--base")
    parser.add_argument("--streams", type=int)
    parser.add_argument("--pace-ms", type=float)
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--arrival", default="concurrency")
    parser.add_argument("--engine", default="raw")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--step", action="store_true")
    parser.add_argument("--out")
    parser.add_argument("--late-floor-ms", type=float, help="calibration: another lateness floor")
    parser.add_argument("--keep-gc", action="store_true", help="leave the garbage collector on")
    args = parser.parse_args()
    if args.mode == "serve":
        serve(args.port, args.prefill_ms)
        return
    if args.mode == "client":
        client(args)
        return
    if len(os.sched_getaffinity(0)) < 2:
        sys.exit("truth.py needs two cores: the server on core 0, the client on core 1")
    conditions = [c for c in CONDITIONS if not args.only or args.only in c.name]
    server = subprocess.Popen(
        [
            "taskset",
            "-c",
            "0",
            sys.executable,
            __file__,
            "serve",
            "--port",
            str(args.port),
            "--prefill-ms",
            str(args.prefill_ms),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    rows: list[dict[str, Any]] = []
    try:
        assert server.stdout is not None
        base = f"http://127.0.0.1:{int(server.stdout.readline())}"
        print(HEADER, flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            for cond in conditions:
                for rep in range(args.reps):
                    row = run_condition(base, cond, rep, args.prefill_ms, Path(tmp), args.late_floor_ms)
                    rows.append(row)
                    print(_row(row), flush=True)
    finally:
        server.terminate()
        server.wait(10)
    bad = [r for r in rows if r["wrong_but_valid"]]
    invalid = [r for r in rows if not r["valid"]]
    print(
        f"\n{len(rows)} runs: {len(rows) - len(invalid)} valid, {len(invalid)} invalid, "
        f"{len(bad)} wrong but valid"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
