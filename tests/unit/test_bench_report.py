"""What `autotune bench` prints of the client's own error bound: the shown statistics it cannot vouch for."""

from __future__ import annotations

import dataclasses

from autotune.load.metrics import summarize
from autotune.load.probe import ProbeOutcome
from autotune.load.records import RequestRecord
from autotune.study.bench import unvouched


def _outcome(pairs_late: float) -> ProbeOutcome:
    """Ten streams of eight chunks 20 ms apart; chunks 1-2, 3-4 and 5-6 read together, the older of each
    pair allowed ``pairs_late`` seconds (the first and last chunks exact)."""
    records = []
    for i in range(10):
        send = i * 0.05
        times = [send + 0.03 + 0.02 * k for k in range(8)]
        for k in (2, 4, 6):
            times[k - 1] = times[k]
        late = tuple(pairs_late if k in (1, 3, 5) else 0.0 for k in range(8))
        record = RequestRecord(i, send, tuple(times), 8, 3, 3, 8, True, end_time=times[-1])
        records.append(dataclasses.replace(record, chunk_late=late if pairs_late else ()))
    metrics = summarize(records, 1.0, None)
    return ProbeOutcome(1.0, metrics, 10, 1.0, 1.0, 10.0, records=tuple(records))


def test_the_shown_statistics_the_client_cannot_vouch_for_are_named_with_their_bound() -> None:
    """ITL's statistics are named with their bound where the older chunk of a pair may have come 15 ms
    early; TTFT, TPOT and E2EL (first and last chunks exact) are not; exact chunks print nothing."""
    line = unvouched(_outcome(0.015))
    assert line.startswith("not vouched for") and "itl:p99 ±" in line and "itl:mean ±" in line, line
    assert not any(f"{m}:" in line for m in ("ttft", "tpot", "e2el")), line
    assert unvouched(_outcome(0.0)) == ""
