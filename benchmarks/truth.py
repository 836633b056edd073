"""Truth benchmark: is every run of autotune's load client either right (within 5 % of the server's own
timing) or marked invalid by its self-check? A wrong-but-valid run is the one thing this must never show.

A reference SSE server (:mod:`benchmarks.sse_server`: non-blocking sockets on uvloop, pinned to core 0)
streams vLLM-format chunks and records, per request (matched by the ``X-Request-Id`` the client sends),
when the request arrived (the kernel's receive time of its first bytes, ``SO_TIMESTAMPNS``: so the
server's own delay in reading a request counts in its TTFT) and the ``perf_counter()`` of every chunk it
wrote (CLOCK_MONOTONIC, shared by every process of the machine: server and client times are on one
clock). The first chunk leaves ``--prefill-ms`` after arrival (plus the wait for the next engine step in
``step`` pacing), then one chunk per ``pace`` ms.

The client runs in its own process pinned to core 1 (``taskset``), optionally with a neighbour that spins
on the same core (at the client's priority, or with the client at ``nice 19``), as two worker processes
on that one core, in a cgroup with a CPU quota (made for the run where this machine allows it: root and
a writable cgroup ``cpu`` controller, v2 or v1), or with its event loop busy for a few ms every 0.1 s (a
callback that sleeps: several chunks of a stream pile up and come in one read). ``burst<k>-<ms>`` models
make the server write k chunks in one write (coalesced reads with a punctual client). Each run is
summarised twice with autotune's own metric definitions (:func:`autotune.load.metrics.summarize`): from
the client's records, and from the server's truth. The table gives reported / true for TTFT p95, ITL p99
and TPOT p99, the client's verdict, and whether the client's own stated error bound (its ``shifts``) is
at least each statistic's true error.

    python -m benchmarks.truth                    # every condition, 3 repetitions (about 15 minutes)
    python -m benchmarks.truth --reps 1 --only starved
    python -m benchmarks.truth --quick            # two short conditions, one rep (about 15 s)
    python -m benchmarks.truth serve --port 0     # only the server (prints its port)
    python -m benchmarks.truth rescore --keep DIR # chunk by chunk, runs kept with --keep DIR
    python -m benchmarks.truth ladder --reps 2    # the highest chunk rate one worker and `auto` measure
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from benchmarks import sse_server


def serve(port: int, prefill_ms: float) -> None:
    """Run the reference server (:mod:`benchmarks.sse_server`, its own chunks) until killed."""
    sse_server.serve(port, sse_server.Options(prefill_s=prefill_ms / 1000.0))


# ----------------------------------------------------------------------------------------------
# The client under test (its own process)
# ----------------------------------------------------------------------------------------------


def client(args: argparse.Namespace) -> None:
    """Run autotune's client once and write its records and verdict as JSON."""
    from autotune.load import selfcheck
    from autotune.load.client import load_job, run_requests
    from autotune.load.records import Preparation

    if args.late_floor_ms is not None:  # calibration runs only: the shipped floor is selfcheck's
        selfcheck.LATE_FLOOR_S = args.late_floor_ms / 1e3
    if args.keep_gc:  # what freezing the collector costs: the same run with it left on
        import types

        selfcheck.gc = types.SimpleNamespace(  # type: ignore[assignment,attr-defined]
            collect=gc.collect, freeze=lambda: None, unfreeze=lambda: None, disable=lambda: None,
            enable=gc.enable, isenabled=gc.isenabled, callbacks=gc.callbacks,
        )  # fmt: skip
    from autotune.inputs.spec import ArrivalSpec
    from autotune.load.request import RequestSpec
    from autotune.load.workload import arrival_times

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
    kind = "step" if args.step else f"burst{args.burst}" if args.burst > 1 else "pace"
    model = f"{kind}-{args.pace_ms:g}"

    def stall(_progress: Any) -> None:
        time.sleep(args.stall_ms / 1e3)  # called on the client's event loop every ~0.1 s

    result = run_requests(
        load_job(
            args.base,
            model,
            "completions",
            requests,
            arrivals,
            max_concurrency=limit,
            engine=args.engine,
            prepare=Preparation(connections=args.streams if limit else min(n, args.streams)),
        ),
        workers=args.workers,
        stop=stall if args.stall_ms else None,
    )
    out = {
        "records": [
            {
                "id": r.request_id,
                "send": r.send_time,
                "chunks": list(r.chunk_times),
                "ok": r.success,
                "late": list(r.chunk_late),
                "send_wait": r.send_wait,
            }
            for r in result.records
        ],
        "problems": list(result.problems),
        "warnings": list(result.warnings),
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
    cpu_quota: float = 0.0
    """Run the client in a cgroup limited to this many cores (0: not)."""
    stall_ms: float = 0.0
    """Keep the client's event loop busy this long every ~0.1 s (forces coalesced reads)."""
    burst: int = 1
    """The server writes this many chunks in one write."""
    cores: str = "1"
    """The cores the client may run on (``taskset -c``): the server has core 0."""


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
    Condition("256x5 loop busy 8 ms", 256, 5, rounds=4, stall_ms=8),
    Condition("64x2 loop busy 8 ms", 64, 2, rounds=2, stall_ms=8),
    Condition("256x20 server bursts of 3", 256, 20, burst=3),
    # At least 20,000 chunks/s (streams x burst / pace) with the server writing 1, 3 and 8 events at once.
    Condition("512x20", 512, 20, rounds=2),
    Condition("96x10 server bursts of 3", 96, 10, rounds=2, burst=3),
    Condition("64x20 server bursts of 8", 64, 20, rounds=2, burst=8),
    Condition("256x20 cgroup 0.3 core", 256, 20, cpu_quota=0.3),
    Condition("1024x20 cgroup 0.5 core", 1024, 20, rounds=2, cpu_quota=0.5),
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


def _client_argv(
    base: str, cond: Condition, rep: int, prefill_ms: float, out: Path, late_floor_ms: float | None
) -> list[str]:
    """The command line of one run of the client (``client`` mode) under ``cond``."""
    options = {
        "--base": base,
        "--streams": cond.streams,
        "--pace-ms": cond.pace_ms,
        "--rounds": cond.rounds,
        "--arrival": cond.arrival,
        "--engine": cond.engine,
        "--workers": cond.workers,
        "--prefill-ms": prefill_ms,
        "--seed": rep,
        "--out": out,
        "--stall-ms": cond.stall_ms or None,
        "--burst": cond.burst if cond.burst > 1 else None,
        "--late-floor-ms": late_floor_ms,
    }
    flags = {"--step": cond.step, "--keep-gc": cond.keep_gc}
    given = [(name, str(value)) for name, value in options.items() if value is not None]
    return [
        *(sys.executable, "-m", "benchmarks.truth", "client"),
        *(word for pair in given for word in pair),
        *(name for name, on in flags.items() if on),
    ]


def _run_client(cond: Condition, argv: list[str]) -> None:
    """Run the client's ``argv`` on ``cond``'s cores, beside its neighbour, in its cgroup."""
    prefix = ["taskset", "-c", cond.cores]
    if cond.neighbour == "starved":
        prefix += ["nice", "-n", "19"]
    spinner = None
    if cond.neighbour:
        spinner = subprocess.Popen(["taskset", "-c", "1", sys.executable, "-c", "while True: pass"])
    group = _quota_cgroup(cond.cpu_quota) if cond.cpu_quota else None
    if group is not None:  # the client joins the cgroup, then becomes the client
        prefix = ["sh", "-c", f'echo $$ > "{group}/cgroup.procs" && exec "$@"', "sh", *prefix]
    try:
        subprocess.run([*prefix, *argv], check=True, timeout=600, cwd=sse_server.REPO)
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()
        if group is not None:
            group.rmdir()


def run_condition(
    base: str,
    cond: Condition,
    rep: int,
    prefill_ms: float,
    tmp: Path,
    late_floor_ms: float | None = None,
    keep: Path | None = None,
) -> dict[str, Any]:
    """One run of ``cond``: the client in its own pinned process, then its figures against the truth."""
    sse_server.dump(base)  # clear
    out = tmp / f"client-{os.getpid()}-{rep}.json"
    _run_client(cond, _client_argv(base, cond, rep, prefill_ms, out, late_floor_ms))
    got = json.loads(out.read_text())
    truth = sse_server.dump(base)
    if keep is not None:  # every record and the server's truth, to look at a run afterwards
        name = f"{cond.name.replace(' ', '_')}-{rep}"
        (keep / f"{name}.json").write_text(json.dumps({"client": got, "truth": truth}))
    matched = [r for r in got["records"] if r["ok"] and r["id"] in truth]
    server = [{"send": truth[r["id"]]["arrive"], "chunks": truth[r["id"]]["writes"]} for r in matched]
    reported = _summary(matched, "send", "chunks")
    true = _summary(server, "send", "chunks")
    ratios = {
        k: reported[k] / true[k] if true[k] > 0 else float("nan") for k in ("ttft_p95", "itl_p99", "tpot_p99")
    }
    agrees = all(abs(v - 1.0) <= 0.05 for v in ratios.values())
    valid = not got["problems"]
    # The stated bound against the true error, statistic by statistic (BOUND_SLACK: the truth is the
    # server's write, the client's time the kernel's receipt: loopback transit and the server's stamp).
    shifts = got["check"].get("shifts", {})
    keys = {"ttft_p95": "ttft:p95", "itl_p99": "itl:p99", "tpot_p99": "tpot:p99"}
    errors = {k: abs(v - 1.0) for k, v in ratios.items()}
    covered = {k: errors[k] <= shifts.get(keys[k], 0.0) + BOUND_SLACK for k in keys}
    compared, short, worst = short_chunks(got["records"], truth)
    return {
        "condition": cond.name,
        "rep": rep,
        "workers": cond.workers,
        "matched": len(matched),
        "records": len(got["records"]),
        "ratios": ratios,
        "reported_ms": {k: v * 1e3 for k, v in reported.items()},
        "true_ms": {k: v * 1e3 for k, v in true.items()},
        "valid": valid,
        "agrees": agrees,
        "wrong_but_valid": valid and not agrees,
        "errors": errors,
        "bounds": {k: shifts.get(keys[k], 0.0) for k in keys},
        "bound_holds": all(covered.values()),
        "chunks_compared": compared,
        "chunks_short": short,
        "chunks_short_worst_ms": worst,
        "cpu_quota": cond.cpu_quota,
        "problems": got["problems"],
        "warnings": got.get("warnings", []),
        "check": got["check"],
        "max_rss_mib": got["max_rss_mib"],
        "gc_freed_after": got["gc_freed_after"],
    }


#: Slack when comparing a stated bound with a true error: the truth is the server's write, the client's
#: time the kernel's receipt (loopback transit, the server's stamp taken after its write returned).
BOUND_SLACK = 0.002
#: ... and a chunk's allowance with its lateness (its time minus the server's write), in seconds.
CHUNK_SLACK_S = 0.0002


def short_chunks(records: list[dict[str, Any]], truth: dict[str, Any]) -> tuple[int, int, float]:
    """(chunks compared, chunks whose allowance is short of their lateness by more than CHUNK_SLACK_S, the
    worst shortfall in ms), over the client's successful records matched to the server's writes."""
    compared = short = 0
    worst = 0.0
    for r in records:
        writes = truth.get(r["id"], {}).get("writes")
        if not r["ok"] or writes is None or len(writes) != len(r["chunks"]):
            continue
        late = r.get("late") or [0.0] * len(writes)
        for at, allowed, wrote in zip(r["chunks"], late, writes, strict=True):
            compared += 1
            excess = at - wrote - allowed
            if excess > CHUNK_SLACK_S:
                short += 1
                worst = max(worst, excess * 1e3)
    return compared, short, worst


def rescore(folder: Path) -> None:
    """Print the chunk-level comparison of every run kept in ``folder`` (``--keep``)."""
    print("| run | chunks | short of their allowance | worst shortfall |\n|---|---|---|---|")
    for path in sorted(folder.glob("*.json")):
        kept = json.loads(path.read_text())
        compared, short, worst = short_chunks(kept["client"]["records"], kept["truth"])
        print(f"| {path.stem} | {compared} | {short} | {worst:.1f} ms |")


_SHORT = {"ttft_p95": "TTFT", "itl_p99": "ITL", "tpot_p99": "TPOT"}


def _bound_cell(r: dict[str, Any]) -> str:
    """The statistic closest to breaking its bound: its true error against its stated bound."""
    errors, bounds = r["errors"], r["bounds"]
    key = max(errors, key=lambda k: errors[k] - bounds[k])
    text = f"{_SHORT[key]} {errors[key]:.1%} ≤ {bounds[key]:.1%}"
    return text if r["bound_holds"] else f"**NO**: {text.replace('≤', '>')}"


def _short_cell(r: dict[str, Any]) -> str:
    """Chunks whose allowance fell short of their true lateness (and the worst shortfall)."""
    if not r.get("chunks_short"):
        return "0"
    return f"**{r['chunks_short']}** (up to {r['chunks_short_worst_ms']:.1f} ms)"


def _row(r: dict[str, Any]) -> str:
    ratios = r["ratios"]
    verdict = "valid" if r["valid"] else "invalid"
    flag = " **WRONG BUT VALID**" if r["wrong_but_valid"] else ""
    why = "; ".join(p.split(":")[0] for p in r["problems"])
    if r.get("warnings"):
        why = "; ".join([*([why] if why else []), "warning: " + r["warnings"][0].split(":")[0]])
    shifts = r["check"].get("shifts", {}) if r["check"] else {}
    bound = max(shifts.values(), default=0.0)
    return (
        f"| {r['condition']} | {r['rep']} | {ratios['ttft_p95']:.3f} | {ratios['itl_p99']:.3f} | "
        f"{ratios['tpot_p99']:.3f} | {r['true_ms']['ttft_p95']:.1f} / {r['true_ms']['itl_p99']:.1f} ms | "
        f"{bound:.1%} | {_bound_cell(r)} | {_short_cell(r)} | {r['check'].get('cores', 1.0):g} | "
        f"{r['check'].get('gc_collections', 0)} / {r['max_rss_mib']:.0f} MiB | {verdict}{flag} | {why} |"
    )


HEADER = (
    "| condition | rep | TTFT p95 rep/true | ITL p99 rep/true | TPOT p99 rep/true | true TTFT p95 / ITL p99 "
    "| own error bound | true error ≤ bound (closest) | chunks short of their allowance | cores counted "
    "| GC runs / client RSS | verdict | why invalid |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)


# ----------------------------------------------------------------------------------------------
# The chunk-rate ladder: how fast a server one worker, and client_workers: auto, measure validly
# ----------------------------------------------------------------------------------------------

#: Chunks per second the ladder tries (streams x events per write / 20 ms), with the server writing
#: 1, 3 and 8 events at once.
LADDER_RATES = (12_800, 25_600, 38_400, 51_200)
LADDER_BURSTS = (1, 3, 8)
LADDER_PACE_MS = 20.0
MODES = ("one worker", "auto")


def ladder_conditions(mode: str) -> list[Condition]:
    """The ladder's conditions for ``mode``: "one worker" (the client alone on core 1) or "auto" (the
    client on both cores, core 0 shared with the server, as ``client_workers: auto`` finds them)."""
    cores = "1" if mode == "one worker" else "0,1"
    out = []
    for burst in LADDER_BURSTS:
        for rate in LADDER_RATES:
            streams = round(rate * LADDER_PACE_MS / 1e3 / burst)
            name = f"{mode}: {rate:,} chunks/s, {burst} a write"
            out.append(Condition(name, streams, LADDER_PACE_MS, rounds=2, burst=burst, cores=cores))
    return out


def _could_not_keep_up(row: dict[str, Any]) -> bool:
    """What makes the prober add a worker (``Prober._grow``): a voided run, or a client CPU warning."""
    return not row["valid"] or any(w.startswith("client CPU") for w in row["warnings"])


def run_auto(base: str, cond: Condition, rep: int, prefill_ms: float, tmp: Path) -> dict[str, Any]:
    """One probe as ``client_workers: auto`` measures it: one worker, then one more after each run the
    client could not keep up with, up to the cores it may use; the last run stands, with the runs it took."""
    most = len(cond.cores.split(","))
    tries = []
    while True:
        row = run_condition(base, cond, rep, prefill_ms, tmp)
        tries.append(row["valid"])
        if cond.workers >= most or not _could_not_keep_up(row):
            return {**row, "tries": tries}
        cond = replace(cond, workers=cond.workers + 1)


def _ladder_table(rows: list[dict[str, Any]]) -> str:
    """Per rate and events a write: valid / runs (and valid and within 5 % of the truth) for each mode;
    then, per events a write, the highest rate each mode measured validly and rightly in every run of it
    and of every rate below it."""
    cells: dict[tuple[int, int, str], list[dict[str, Any]]] = {}
    for r in rows:
        cells.setdefault((r["burst"], r["rate"], r["mode"]), []).append(r)

    def good(burst: int, rate: int, mode: str) -> bool:
        runs = cells.get((burst, rate, mode), [])
        return bool(runs) and all(r["valid"] and r["agrees"] for r in runs)

    lines = [
        "| chunks/s | events a write | one worker: valid (and within 5 %) | auto: valid (and within 5 %) "
        "| auto's workers |",
        "|---|---|---|---|---|",
    ]
    for burst in LADDER_BURSTS:
        for rate in LADDER_RATES:
            row = [f"| {rate:,} | {burst}"]
            for mode in MODES:
                runs = cells.get((burst, rate, mode), [])
                valid = sum(r["valid"] for r in runs)
                right = sum(r["valid"] and r["agrees"] for r in runs)
                row.append(f"{valid}/{len(runs)} ({right})")
            workers = sorted({r["workers"] for r in cells.get((burst, rate, "auto"), [])})
            row.append("-".join(map(str, workers)) or "-")
            lines.append(" | ".join(row) + " |")
    lines.append("")
    for burst in LADDER_BURSTS:
        highest = []
        for mode in MODES:
            top = 0
            for rate in LADDER_RATES:
                if not good(burst, rate, mode):
                    break
                top = rate
            highest.append(f"{mode} {top:,}")
        lines.append(f"{burst} event(s) a write, highest chunks/s measured validly: {', '.join(highest)}")
    return "\n".join(lines)


def ladder(base: str, reps: int, prefill_ms: float) -> list[dict[str, Any]]:
    """Every rung of the ladder in both modes, ``reps`` times; prints each run's row as it goes."""
    rows = []
    print(HEADER, flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for mode in MODES:
            for cond in ladder_conditions(mode):
                for rep in range(reps):
                    if mode == "auto":
                        row = run_auto(base, cond, rep, prefill_ms, Path(tmp))
                    else:
                        row = run_condition(base, cond, rep, prefill_ms, Path(tmp))
                    rate = round(cond.streams * cond.burst * 1e3 / cond.pace_ms)
                    rows.append({**row, "mode": mode, "burst": cond.burst, "rate": _rung(rate)})
                    print(_row(row), flush=True)
    print("\n" + _ladder_table(rows))
    return rows


def _rung(rate: int) -> int:
    """The ladder rate a condition's actual rate was rounded from (streams are whole)."""
    return min(LADDER_RATES, key=lambda r: abs(r - rate))


def _quota_cgroup(cores: float) -> Path | None:
    """A new cgroup limited to ``cores`` beside this process's own (v2 where the cpu controller is
    delegated, else v1's cpu hierarchy), or None (with a line on stderr) where this machine does not
    allow one. The caller removes it (rmdir) once its processes have ended."""
    own = Path("/proc/self/cgroup").read_text().splitlines()
    period = 100000
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or not tail or fields[3] != "/":
            continue
        if tail[0] == "cgroup2":
            path = next((x[3:] for x in own if x.startswith("0::")), None)
            knob, value = "cpu.max", f"{round(cores * period)} {period}"
        elif tail[0] == "cgroup" and len(tail) > 2 and "cpu" in tail[2].split(","):
            path = next((x.split(":", 2)[2] for x in own if "cpu" in x.split(":")[1].split(",")), None)
            knob, value = "cpu.cfs_quota_us", str(round(cores * period))
        else:
            continue
        if path is None:
            continue
        group = Path(fields[4] + path.rstrip("/")) / f"autotune-truth-{os.getpid()}"
        try:
            group.mkdir()
        except OSError:
            continue
        try:
            if knob == "cpu.cfs_quota_us":
                (group / "cpu.cfs_period_us").write_text(str(period))
            (group / knob).write_text(value)
        except OSError:
            group.rmdir()
            continue
        return group
    print("no cgroup with a CPU quota can be made here: the run is without one", file=sys.stderr)
    return None


#: ``--quick``: two short conditions (one round each), one rep: about 15 s on 2 cores.
QUICK = tuple(
    replace(c, rounds=1) for c in CONDITIONS if c.name in ("256x20 concurrency", "256x20 server bursts of 3")
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "mode", nargs="?", default="bench", choices=["bench", "ladder", "serve", "client", "rescore"]
    )
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--reps", type=int, help="repetitions of each condition (default: 3, 1 with --quick)")
    parser.add_argument(
        "--quick", action="store_true", help=f"only {', '.join(c.name for c in QUICK)}, shorter"
    )
    parser.add_argument("--only", help="run only conditions whose name contains this")
    parser.add_argument("--json", help="also write every run's figures to this file")
    parser.add_argument("--keep", help="write every run's records and the server's truth to this folder")
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
    parser.add_argument("--stall-ms", type=float, default=0.0, help="keep the loop busy this long")
    parser.add_argument("--burst", type=int, default=1, help="chunks per server write")
    return parser


def bench(base: str, args: argparse.Namespace, reps: int) -> list[dict[str, Any]]:
    """Every condition (``--quick``'s, those ``--only`` names), ``reps`` times; prints each run's row."""
    conditions = [c for c in (QUICK if args.quick else CONDITIONS) if not args.only or args.only in c.name]
    keep = Path(args.keep) if args.keep else None
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
    rows = []
    print(HEADER, flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for cond in conditions:
            for rep in range(reps):
                row = run_condition(base, cond, rep, args.prefill_ms, Path(tmp), args.late_floor_ms, keep)
                rows.append(row)
                print(_row(row), flush=True)
    return rows


def _verdicts(rows: list[dict[str, Any]]) -> str:
    """The closing line: how many runs were valid, wrong but valid, short of their bound or allowance."""
    bad = [r for r in rows if r["wrong_but_valid"]]
    invalid = [r for r in rows if not r["valid"]]
    broken = ", ".join(f"{r['condition']} rep {r['rep']}" for r in rows if not r["bound_holds"])
    short = ", ".join(f"{r['condition']} rep {r['rep']}" for r in rows if r["chunks_short"])
    right = [r for r in rows if r["agrees"]]
    kept = sum(r["valid"] for r in right) / len(right) if right else float("nan")
    return (
        f"{len(rows)} runs: {len(rows) - len(invalid)} valid, {len(invalid)} invalid, "
        f"{len(bad)} wrong but valid; valid among the runs truly within 5 %: {kept:.0%} of {len(right)}; "
        f"stated bound below the true error in: {broken or 'none'}; "
        f"chunks short of their allowance in: {short or 'none'}"
    )


def main() -> None:
    """Start the reference server, run every condition, print the table (and JSON with --json)."""
    args = _parser().parse_args()
    if args.mode == "serve":
        serve(args.port, args.prefill_ms)
        return
    if args.mode == "client":
        client(args)
        return
    if args.mode == "rescore":  # the chunk-level comparison of runs kept with --keep
        rescore(Path(args.keep))
        return
    if len(os.sched_getaffinity(0)) < 2:
        sys.exit("truth.py needs two cores: the server on core 0, the client on core 1")
    reps = args.reps if args.reps is not None else 1 if args.quick else 3
    serve_argv = [sys.executable, "-m", "benchmarks.truth", "serve", "--port", str(args.port)]
    with sse_server.running([*serve_argv, "--prefill-ms", str(args.prefill_ms)], cores="0") as base:
        rows = ladder(base, reps, args.prefill_ms) if args.mode == "ladder" else bench(base, args, reps)
    if args.mode == "bench":
        print("\n" + _verdicts(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
