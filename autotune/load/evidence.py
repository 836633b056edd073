"""Per-chunk evidence beside a saved probe, and a verdict re-checked from it.

``probe-<k>.json`` keeps vLLM's per-request arrays; this module writes the rest of what the self-check
judged, one request per line, to ``probe-<k>.chunks.jsonl.gz`` (:func:`evidence_path`), so a verdict can
be checked again from the files alone (:func:`recheck`). The format (``docs/measurement.md``):

* line 1, the header: ``{"format": "autotune-chunks", "version": 1, "wall_offset": <s>,
  "kernel_timed": <bool>}``; ``wall_offset`` turns the file's ``perf_counter()`` seconds into Unix
  seconds; ``kernel_timed``: the raw engine timed every chunk and bounded it (else the allowances are the
  aiohttp engine's estimates);
* then per request: ``i`` (index), ``id`` (its ``X-Request-Id``), ``ok``, ``tokens`` (usage, or null),
  ``send`` (perf_counter seconds), ``send_wait`` (µs its write took), ``first`` (the first content chunk,
  Unix seconds), and per content chunk in µs: ``t`` (the chunk's time, as gaps: the first from ``send``,
  each next from the one before), ``wait`` (how long its read's newest bytes waited in the socket: the
  read happened at the chunk's time plus this; absent without the kernel's times) and ``early`` (its
  allowance: how much earlier it may have arrived; absent when all are 0).

Times are rounded to the µs; allowances up, so a re-checked bound is never smaller than the saved one's.
"""

from __future__ import annotations

import errno
import gzip
import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotune.errors import AutotuneError, DiskFullError, LoadError
from autotune.inputs.slo_terms import parse_metric_key
from autotune.load.records import RequestRecord, RunResult
from autotune.load.selfcheck import MAX_SHIFT, REPORTED, lateness_shifts

FORMAT = "autotune-chunks"
VERSION = 1
#: Re-checked bounds within this of the saved ones agree (the file's times are rounded to the µs).
SHIFT_TOLERANCE = 0.002


def evidence_path(probe: Path) -> Path:
    """The evidence file beside ``probe`` (``probe-3.json`` → ``probe-3.chunks.jsonl.gz``)."""
    return probe.with_name(probe.stem + ".chunks.jsonl.gz")


def first_token_times(run: RunResult) -> list[float | None]:
    """Each request's first content chunk in Unix seconds (µs), ``None`` where none came."""
    offset = run.wall_start - run.start
    return [round(r.chunk_times[0] + offset, 6) if r.chunk_times else None for r in run.records]


def write_failed(what: str, path: Path, exc: OSError) -> AutotuneError:
    """The error for a probe file or its evidence that could not be written: :class:`DiskFullError` when
    its device is full (ENOSPC, EDQUOT: not retried), else a :class:`LoadError`."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return DiskFullError(
            f"no space left on the device of {what} {str(path)!r}: free space there, then rerun to resume"
        )
    return LoadError(f"cannot write {what} to {str(path)!r}: {exc}")


def write_evidence(path: Path, run: RunResult) -> None:
    """Write ``run``'s per-chunk evidence to ``path`` (gzip'd JSON lines)."""
    offset = run.wall_start - run.start
    header = {
        "format": FORMAT,
        "version": VERSION,
        "wall_offset": offset,
        "kernel_timed": run.client.kernel_timed,
    }
    try:
        with gzip.open(path, "wt", encoding="utf-8", compresslevel=5) as out:
            out.write(json.dumps(header, separators=(",", ":")) + "\n")
            for r in run.records:
                out.write(json.dumps(_line(r, offset), separators=(",", ":")) + "\n")
    except OSError as exc:
        raise write_failed("chunk evidence", path, exc) from exc


def _line(r: RequestRecord, offset: float) -> dict[str, Any]:
    line: dict[str, Any] = {
        "i": r.index,
        "id": r.request_id,
        "ok": r.success,
        "tokens": r.output_tokens,
        "send": r.send_time,
        "send_wait": math.ceil(r.send_wait * 1e6),
        "first": round(r.chunk_times[0] + offset, 6) if r.chunk_times else None,
        "t": _gaps(r.send_time, r.chunk_times),
    }
    if r.chunk_waits:
        line["wait"] = [round(w * 1e6) for w in r.chunk_waits]
    if r.chunk_late:
        line["early"] = [math.ceil(x * 1e6) for x in r.chunk_late]
    return line


def _gaps(send: float, times: Sequence[float]) -> list[int]:
    """Chunk times as µs gaps (from ``send``, then from the chunk before), rounded without drifting."""
    marks = [round((t - send) * 1e6) for t in times]
    return [b - a for a, b in zip([0, *marks], marks, strict=False)]


def read_evidence(path: Path) -> tuple[dict[str, Any], tuple[RequestRecord, ...]]:
    """The header and the records (as the self-check saw them, to the µs) of an evidence file."""
    try:
        with gzip.open(path, "rt", encoding="utf-8") as src:
            header = json.loads(next(src))
            if header.get("format") != FORMAT or header.get("version") != VERSION:
                raise LoadError(f"{str(path)!r} is not an {FORMAT} file of version {VERSION}")
            records = tuple(_record(json.loads(line)) for line in _lines(src))
    except (OSError, ValueError, StopIteration, KeyError, TypeError) as exc:
        raise LoadError(f"cannot read chunk evidence {str(path)!r}: {exc}") from exc
    return header, records


def _lines(src: Any) -> Iterator[str]:
    for line in src:
        if line.strip():
            yield line


def _record(line: dict[str, Any]) -> RequestRecord:
    send = float(line["send"])
    times, at = [], 0
    for gap in line["t"]:
        at += int(gap)
        times.append(send + at / 1e6)
    return RequestRecord(
        index=int(line["i"]),
        send_time=send,
        chunk_times=tuple(times),
        output_tokens=line["tokens"],
        prompt_tokens=None,
        input_len=0,
        output_len=0,
        success=bool(line["ok"]),
        request_id=str(line["id"]),
        send_wait=int(line.get("send_wait", 0)) / 1e6,
        chunk_waits=tuple(w / 1e6 for w in line.get("wait", ())),
        chunk_late=tuple(x / 1e6 for x in line.get("early", ())),
    )


@dataclass(frozen=True)
class Recheck:
    """A saved probe's lateness verdict, judged again from its evidence file."""

    shifts: tuple[tuple[str, float], ...]
    """Each bounded statistic's bound, recomputed from the evidence."""
    saved_shifts: tuple[tuple[str, float], ...]
    """... as the probe file states them."""
    late: bool
    """The recomputed bounds void the run (a judged statistic's exceeds
    :data:`~autotune.load.selfcheck.MAX_SHIFT`; the probe file names them, ``client.judged``)."""
    saved_late: bool
    """The probe file's bounds of its judged statistics voided the run."""
    valid: bool
    """The probe file's verdict."""

    @property
    def agrees(self) -> bool:
        """The evidence gives the verdict and the bounds the probe file states."""
        saved = dict(self.saved_shifts)
        close = all(abs(v - saved.get(k, math.inf)) <= SHIFT_TOLERANCE for k, v in self.shifts)
        return close and self.late == self.saved_late


def recheck(probe: Path) -> Recheck:
    """Judge the lateness of the probe saved at ``probe`` again from its evidence file."""
    try:
        saved = json.loads(probe.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise LoadError(f"cannot read probe {str(probe)!r}: {exc}") from exc
    _, records = read_evidence(evidence_path(probe))
    client = saved.get("client", {})
    saved_shifts = tuple((str(k), float(v)) for k, v in client.get("shifts", {}).items())
    try:
        keys = [parse_metric_key(k) for k, _ in saved_shifts] or list(REPORTED)
    except ValueError as exc:
        raise LoadError(f"probe {str(probe)!r} names an unknown statistic: {exc}") from exc
    # Before a probe named what it judged, every statistic it bounded voided it.
    judged = set(client.get("judged", [k.key for k in keys]))
    shifts = lateness_shifts(records, keys)
    return Recheck(
        shifts=shifts,
        saved_shifts=saved_shifts,
        late=any(v > MAX_SHIFT for k, v in shifts if k in judged),
        saved_late=any(v > MAX_SHIFT for k, v in saved_shifts if k in judged),
        valid=bool(saved.get("valid", False)),
    )
