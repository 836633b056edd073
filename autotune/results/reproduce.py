"""The reproduce record: what an exported figure was measured with, pinned, so that it can be measured
again and told apart from a change of software, hardware, model or traffic.

``export --format json`` carries it (``reproduce``): the versions of autotune, Optuna, Python and vLLM (as
the server reported it at the trial), the GPU and its driver (NVML's, at the trial), the model and its
revision (the Hugging Face cache's snapshot, else a hash of its ``config.json``), and a hash of the workload
(the spec's ``workload`` section and the dataset file it names). ``autotune verify SPEC --record FILE``
measures the recorded config again (:mod:`autotune.study.remeasure`) and says what differs
(:func:`differences`) and whether the figures agree (:func:`agreement`).
"""

from __future__ import annotations

import hashlib
import json
import platform
from collections.abc import Mapping
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial

from autotune.errors import SpecError
from autotune.flags import FlagValue, dashed
from autotune.hardware.hub import model_file
from autotune.inputs.loader import LoadedStudy
from autotune.store.record import TrialRecord
from autotune.units import format_figure

RECORD_OPTION = "--record"
"""The option of ``autotune verify`` that names an exported JSON (bad input names it)."""

PINNED = (
    "autotune",
    "optuna",
    "python",
    "vllm",
    "gpu",
    "gpu_driver",
    "model",
    "model_revision",
    "workload_sha256",
)
"""The facts a reproduce record pins, in the order they are compared."""


def package_version(name: str) -> str | None:
    """An installed distribution's version, or ``None``."""
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def workload_hash(loaded: LoadedStudy) -> str:
    """SHA-256 of the spec's ``workload`` section (canonical JSON) and the bytes of the dataset file it
    names, if any: the same requests, rates aside."""
    digest = hashlib.sha256()
    digest.update(json.dumps(loaded.spec.workload.model_dump(mode="json"), sort_keys=True).encode())
    path = loaded.spec.workload.dataset.path
    if path is not None:
        try:
            digest.update((loaded.base_dir / path).read_bytes())
        except OSError:
            digest.update(b"<unreadable dataset>")
    return digest.hexdigest()


def model_revision(model: str, env: Mapping[str, str]) -> str | None:
    """The model's revision: the snapshot (commit) its ``config.json`` is in, in the Hugging Face cache;
    for a local folder ``config.json sha256:<first 16>``; ``None`` when neither is found."""
    path = model_file(model, "config.json", env)
    if path is None:
        return None
    if path.parent.parent.name == "snapshots":
        return path.parent.name
    return "config.json sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def reproduce_record(
    trial: FrozenTrial, launched: Mapping[str, FlagValue], loaded: LoadedStudy, env: Mapping[str, str]
) -> dict[str, Any]:
    """The reproduce record of ``trial`` (``launched``: the tuned flags its launch passed; ``env``: where
    the model's files are looked up)."""
    record = TrialRecord.from_trial(trial)
    return {
        **now_facts(loaded, record, env),
        "baseline": bool(record.baseline),
        "launched_flags": {dashed(k): v for k, v in launched.items()},
        "measured_at": trial.datetime_complete.isoformat() if trial.datetime_complete else None,
    }


@dataclass(frozen=True)
class Recorded:
    """An exported JSON read back: the trial, its flags, its figure, its SLOs and its reproduce record."""

    trial: int
    flags: dict[str, FlagValue]
    """The flags its launch passed (snake case); none for vLLM's defaults."""
    baseline: bool
    slo_throughput: float
    interval: tuple[float, float] | None
    slo: tuple[str, ...]
    pinned: Mapping[str, Any]


def read_record(path: Path, loaded: LoadedStudy) -> Recorded:
    """``path`` as an export's JSON with its reproduce record, for ``loaded``'s space; bad input is a
    :class:`SpecError` naming ``--record``."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise SpecError(RECORD_OPTION, f"cannot read {str(path)!r}: {exc.strerror or exc}") from exc
    except ValueError as exc:
        raise SpecError(RECORD_OPTION, f"{str(path)!r} is not JSON: {exc}") from exc
    pinned = data.get("reproduce") if isinstance(data, dict) else None
    if not isinstance(pinned, dict):
        raise SpecError(
            RECORD_OPTION,
            f"{str(path)!r} has no reproduce record: write it with `autotune export SPEC --format json`",
        )
    figure, trial = data.get("slo_throughput"), data.get("trial")
    if not isinstance(figure, int | float) or figure <= 0 or not isinstance(trial, int):
        raise SpecError(RECORD_OPTION, f"{str(path)!r} has no measured slo_throughput for its trial")
    names = {dashed(n): n for n in loaded.search_space.params}
    launched = pinned.get("launched_flags")
    if not isinstance(launched, dict):
        raise SpecError(RECORD_OPTION, f"{str(path)!r}: reproduce.launched_flags is missing")
    unknown = sorted(k for k in launched if k not in names)
    if unknown:
        raise SpecError(
            RECORD_OPTION,
            f"{str(path)!r} sets {', '.join(unknown)}, which the spec's search space does not tune",
        )
    slo = tuple(str(t) for t in (data.get("slo") or {}).get("terms", ()))
    if slo != tuple(str(t) for t in loaded.spec.slo.terms):
        raise SpecError(
            RECORD_OPTION,
            f"{str(path)!r} was measured against the SLOs {list(slo)}, the spec says "
            f"{[str(t) for t in loaded.spec.slo.terms]}: the figures would not compare",
        )
    interval = data.get("slo_throughput_interval")
    pair = None
    if isinstance(interval, list) and len(interval) == 2 and isinstance(interval[0], int | float):
        pair = (
            float(interval[0]),
            float(interval[1]) if isinstance(interval[1], int | float) else float("inf"),
        )
    return Recorded(
        trial=trial,
        flags={names[k]: v for k, v in launched.items()},
        baseline=bool(pinned.get("baseline")),
        slo_throughput=float(figure),
        interval=pair,
        slo=slo,
        pinned=pinned,
    )


def now_facts(loaded: LoadedStudy, measured: TrialRecord, env: Mapping[str, str]) -> dict[str, Any]:
    """The facts a record pins (:data:`PINNED`), as they are now: this install's versions, ``measured``'s
    server, GPU and driver, the model's revision and the workload's hash."""
    return {
        "autotune": package_version("autotune"),
        "optuna": optuna.__version__,
        "python": platform.python_version(),
        "vllm": measured.server_version,
        "gpu": measured.gpu,
        "gpu_driver": measured.gpu_driver,
        "model": loaded.spec.server.model,
        "model_revision": model_revision(loaded.spec.server.model, env),
        "workload_sha256": workload_hash(loaded),
    }


def differences(pinned: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
    """What differs between a record and now, one phrase each (``vllm: 0.10.1 then, 0.11.0 now``); a fact
    either side does not know is not compared."""
    out = []
    for key in PINNED:
        then, current = pinned.get(key), now.get(key)
        if then is not None and current is not None and then != current:
            out.append(f"{key}: {then} then, {current} now")
    return out


def agreement(
    recorded: Recorded, value: float | None, interval: tuple[float, float] | None
) -> tuple[bool, str]:
    """Whether a new figure agrees with the recorded one (their intervals overlap; without an interval,
    the figure within the other's), and the sentence that says so."""
    if value is None:
        return False, f"no figure measured: the record says {format_figure(recorded.slo_throughput, 'tok/s')}"
    then_lo, then_hi = recorded.interval or (recorded.slo_throughput, recorded.slo_throughput)
    now_lo, now_hi = interval or (value, value)
    agrees = now_lo <= then_hi and then_lo <= now_hi
    change = value / recorded.slo_throughput - 1
    verdict = "agrees with" if agrees else "differs from"
    return agrees, (
        f"measured {format_figure(value, 'tok/s')}{_span(interval)} ({change:+.1%}): {verdict} the record's "
        f"{format_figure(recorded.slo_throughput, 'tok/s')}{_span(recorded.interval)}"
        + ("" if agrees else " beyond both intervals")
    )


def _span(interval: tuple[float, float] | None) -> str:
    if interval is None:
        return ""
    high = "open" if interval[1] == float("inf") else format_figure(interval[1])
    return f" [{format_figure(interval[0])}-{high}]"
