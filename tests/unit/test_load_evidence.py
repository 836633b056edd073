"""The per-chunk evidence beside a saved probe, and a verdict re-checked from the files."""

from __future__ import annotations

import dataclasses
import errno
import gzip
import json
import math
from collections.abc import Iterator
from pathlib import Path

import pytest

from autotune.errors import DiskFullError, LoadError
from autotune.inputs.slo_terms import MetricKey
from autotune.inputs.spec import MeasurementSpec, SloSection, WorkloadSpec
from autotune.load.evidence import (
    evidence_path,
    first_token_times,
    read_evidence,
    recheck,
    write_evidence,
)
from autotune.load.metrics import summarize
from autotune.load.probe import Prober, _save_probe
from autotune.load.records import ClientFigures, RequestRecord, RunResult
from autotune.load.selfcheck import MAX_SHIFT, with_problems

from .sse_server import SseServer


@pytest.fixture(scope="module")
def server() -> Iterator[SseServer]:
    with SseServer() as srv:
        yield srv


def _run(early: float = 0.0) -> RunResult:
    """Ten requests of 20 chunks 20 ms apart; the older chunk of each read of two carries ``early``."""
    records = []
    for i in range(10):
        send = 100.0 + i * 0.01
        times = tuple(send + 0.05 + 0.02 * k for k in range(20))
        records.append(
            RequestRecord(
                index=i,
                send_time=send,
                chunk_times=times,
                output_tokens=20,
                prompt_tokens=3,
                input_len=3,
                output_len=20,
                success=True,
                request_id=f"run-{i}",
                send_wait=0.000012,
                chunk_waits=(0.0001,) * 20,
                chunk_late=(early,) + (0.0,) * 19 if early else (),
            )
        )
    failed = RequestRecord(10, 100.2, (), None, None, 3, 20, False, error="HTTP 500", request_id="run-10")
    run = RunResult((*records, failed), 100.0, 101.0, 11, client=ClientFigures(kernel_timed=True))
    return with_problems(dataclasses.replace(run, wall_start=1_800_000_000.0))


def _save(run: RunResult, path: Path) -> Path:
    """A probe file as the prober writes it (the keys the re-check reads) and its evidence."""
    path.write_text(
        json.dumps({"valid": run.valid, "problems": list(run.problems), "client": run.client.as_dict()})
    )
    write_evidence(evidence_path(path), run)
    return path


def test_the_evidence_round_trips_to_the_microsecond(tmp_path: Path) -> None:
    """Each request's id, success, tokens, send, first-token time and every chunk's time, wait and
    allowance come back from the file to the µs (allowances rounded up, never down)."""
    run = _run(early=0.0123456)
    path = tmp_path / "probe-1.chunks.jsonl.gz"
    write_evidence(path, run)
    header, back = read_evidence(path)
    assert header["format"] == "autotune-chunks" and header["version"] == 1 and header["kernel_timed"]
    assert header["wall_offset"] == pytest.approx(1_800_000_000.0 - 100.0)
    assert [r.request_id for r in back] == [r.request_id for r in run.records]
    for a, b in zip(run.records, back, strict=True):
        assert (a.index, a.success, a.output_tokens, a.send_time) == (
            b.index,
            b.success,
            b.output_tokens,
            b.send_time,
        )
        assert b.chunk_times == pytest.approx(a.chunk_times, abs=1e-6)
        assert b.chunk_waits == pytest.approx(a.chunk_waits, abs=1e-6)
        assert len(b.chunk_late) == len(a.chunk_late)
        assert all(0 <= y - x < 1e-6 for x, y in zip(a.chunk_late, b.chunk_late, strict=True))
        assert 0 <= b.send_wait - a.send_wait < 1e-6
    firsts = first_token_times(run)
    assert firsts[0] == pytest.approx(1_800_000_000.0 + 0.05, abs=1e-6) and firsts[-1] is None
    with gzip.open(path, "rt") as src:
        lines = [json.loads(line) for line in src]
    assert lines[1]["t"][:3] == [50000, 20000, 20000]  # µs: the first from the send, then gaps
    assert lines[1]["first"] == firsts[0]


def test_a_verdict_is_rechecked_from_the_files(tmp_path: Path) -> None:
    """The bounds and the verdict recomputed from the evidence are the saved ones, for a valid run and for
    one voided by late chunks; evidence that disagrees with its probe file is caught."""
    valid = recheck(_save(_run(), tmp_path / "probe-1.json"))
    assert valid.valid and not valid.late and valid.agrees
    late_run = _run(early=0.04)  # every first chunk may have come 40 ms earlier: TTFT bound 400 %
    late = recheck(_save(late_run, tmp_path / "probe-2.json"))
    assert not late.valid and late.late and late.saved_late and late.agrees
    assert dict(late.shifts)["ttft:p95"] == pytest.approx(dict(late_run.client.shifts)["ttft:p95"], abs=1e-3)
    # A study that judges only E2EL (the last chunks are exact; the write took 12 µs): the same late chunks
    # move TTFT's bound, which it records and does not judge; the re-check reads what it judged from the
    # file and agrees.
    e2el_only = with_problems(dataclasses.replace(late_run, problems=()), (MetricKey("e2el", "p95"),))
    again = recheck(_save(e2el_only, tmp_path / "probe-3.json"))
    assert again.valid and not again.late and not again.saved_late and again.agrees
    assert dict(again.shifts)["ttft:p95"] > MAX_SHIFT and dict(again.shifts)["e2el:p95"] < 1e-4
    # The probe file of the valid run with the evidence of the late one: they disagree.
    write_evidence(evidence_path(tmp_path / "probe-1.json"), late_run)
    assert not recheck(tmp_path / "probe-1.json").agrees


def test_a_missing_or_foreign_file_is_a_load_error(tmp_path: Path) -> None:
    """No evidence file, or a file of another format, is one LoadError naming the file."""
    probe = tmp_path / "probe-1.json"
    probe.write_text("{}")
    with pytest.raises(LoadError, match=r"probe-1\.chunks\.jsonl\.gz"):
        recheck(probe)
    with gzip.open(evidence_path(probe), "wt") as out:
        out.write('{"format": "something else"}\n')
    with pytest.raises(LoadError, match="not an autotune-chunks file"):
        recheck(probe)


def test_the_prober_saves_first_token_times_and_evidence_a_recheck_agrees_with(
    server: SseServer, tmp_path: Path
) -> None:
    """A real probe: probe-1.json has absolute first-token times (start time + TTFT), its evidence file
    holds every chunk of every request under its id (ITLs as in the probe file), and re-checking the
    verdict from the files gives the saved one."""
    wl = WorkloadSpec.model_validate({"dataset": {"input_len": 4, "output_len": 6}})
    meas = MeasurementSpec(min_requests=10, saturation_requests=10)
    probe = Prober(
        server.url,
        "pace-20",
        wl,
        SloSection(terms=("ttft:p50<=1s",)),
        meas,
        base_dir=tmp_path,
        save_dir=tmp_path / "probes",
        metrics_url="",
        engine="raw",
    )
    probe(math.inf)
    path = tmp_path / "probes" / "probe-1.json"
    saved = json.loads(path.read_text())
    # (a loaded machine may warn of a bound the probe does not judge, ITL p99's: not what this tests)
    assert saved["evidence"] == "probe-1.chunks.jsonl.gz" and isinstance(saved["warnings"], list)
    firsts = saved["first_token_times"]
    assert len(firsts) == 10
    for first, start, ttft in zip(firsts, saved["start_times"], saved["ttfts"], strict=True):
        assert first == pytest.approx(start + ttft, abs=2e-6)
    header, records = read_evidence(tmp_path / "probes" / saved["evidence"])
    assert header["kernel_timed"]
    assert [r.request_id for r in records] == saved["request_ids"]
    for r, itls in zip(records, saved["itls"], strict=True):
        assert r.chunks == 6 and len(r.chunk_waits) == 6
        assert r.itls == pytest.approx(itls, abs=2e-6)
    again = recheck(path)
    assert again.agrees and again.valid == saved["valid"]


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT])
def test_a_full_disk_while_saving_a_probe_is_a_disk_full_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    """No space left (or quota exceeded) while writing a probe file or its evidence is a DiskFullError
    naming the file (not retried); any other write error stays a LoadError."""
    run = _run()
    metrics = summarize(run.records, 1.0, None)
    path = tmp_path / "probe-1.json"

    def full(*args: object, **kwargs: object) -> None:
        raise OSError(code, "No space left on device")

    with monkeypatch.context() as patch:
        patch.setattr(Path, "write_text", full)
        with pytest.raises(DiskFullError, match=r"probe-1\.json"):
            _save_probe(path, 1.0, 11, run, metrics, None, {}, "m")
    with monkeypatch.context() as patch:
        patch.setattr(gzip, "open", full)
        with pytest.raises(DiskFullError, match=r"probe-1\.chunks\.jsonl\.gz"):
            _save_probe(path, 1.0, 11, run, metrics, None, {}, "m")
        with pytest.raises(DiskFullError, match="no space left"):
            write_evidence(evidence_path(path), run)
    with monkeypatch.context() as patch:

        def denied(*args: object, **kwargs: object) -> None:
            raise OSError(errno.EACCES, "Permission denied")

        patch.setattr(Path, "write_text", denied)
        with pytest.raises(LoadError, match="cannot write probe results"):
            _save_probe(path, 1.0, 11, run, metrics, None, {}, "m")
