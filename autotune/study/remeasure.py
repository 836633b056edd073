"""A recorded config measured once more, outside its study: ``autotune verify SPEC --record FILE``.

The config the export recorded is launched with the spec's server and measured with a whole rate search
on a fresh request stream (a seed of its own, so that a figure that held only for the study's stream shows
as such), in ``<workdir>/reproduced/<trial>-<seed>``. Nothing is written to the study's storage.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from autotune.flags import FlagValue
from autotune.hardware.gpu import DeviceGuard, open_devices
from autotune.inputs.loader import Access, LoadedStudy
from autotune.outcome import TrialOutcome
from autotune.store.record import TrialRecord
from autotune.study.trial import TrialRunner

SEED_STEP = 104_729
"""Between the seeds of successive re-measurements (apart from the study's and the finalists' streams)."""


@dataclass(frozen=True)
class Remeasured:
    """What the new measurement gave."""

    outcome: TrialOutcome
    record: TrialRecord
    folder: Path
    seed: int


def remeasure(
    loaded: LoadedStudy,
    number: int,
    flags: Mapping[str, FlagValue],
    *,
    baseline: bool,
    gpus: Sequence[int | str],
    access: Access,
    phase: Callable[[str], None],
) -> Remeasured:
    """Launch trial ``number``'s config (``flags``; ``baseline``: vLLM's defaults, no tuned flag) and
    measure it on a fresh stream."""
    root = loaded.workdir / "reproduced"
    done = sum(1 for p in root.iterdir() if p.is_dir()) if root.is_dir() else 0
    seed = loaded.spec.workload.seed + SEED_STEP * (done + 1)
    folder = root / f"{number}-{seed}"
    runner = TrialRunner(loaded, device=DeviceGuard(open_devices(list(gpus))), access=access)
    outcome = runner.measure(number, flags, folder, phase, seed=seed, baseline=baseline)
    return Remeasured(outcome, TrialRecord.from_attrs(outcome.attrs), folder, seed)
