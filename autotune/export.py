"""Pareto selection and export formats: a `vllm serve --config` YAML, a command line, JSON.

`vllm serve --config` turns each key into ``--key``; booleans only become ``--no-key`` when the key is
DASHED (``enable_chunked_prefill: false`` is silently ignored, docs/vllm.md), so every key is written
dashed. The model stays positional on the command line.
"""

from __future__ import annotations

import enum
import json
import shlex
from dataclasses import dataclass
from typing import Any

import optuna
import yaml
from optuna.trial import FrozenTrial, TrialState

from autotune.errors import ExportError, SpecError
from autotune.finalists import Confirmed, Gain, confirmed, throughput_gain
from autotune.loader import LoadedStudy
from autotune.record import TrialRecord
from autotune.spec import FlagValue, flag_key
from autotune.study import default_trial


class Format(enum.StrEnum):
    """Export formats."""

    VLLM_YAML = "vllm-yaml"
    ARGS = "args"
    JSON = "json"


class Policy(enum.StrEnum):
    """How to pick one config from the Pareto front."""

    MAX_THROUGHPUT = "max-throughput"
    MIN_LATENCY = "min-latency"


@dataclass(frozen=True)
class Choice:
    """A selected trial with everything an export needs."""

    trial: FrozenTrial
    tuned: dict[str, FlagValue]
    """The trial's tuned flags (snake-case keys)."""
    flags: dict[str, FlagValue]
    """Fixed server args then tuned flags (snake-case keys)."""
    baseline: FrozenTrial | None
    confirmed: Confirmed | None = None
    """Every measurement of the chosen config when it was measured again as a finalist."""
    gain: Gain | None = None
    """Its SLO-constrained throughput over the defaults' (confirmed means where both were remeasured)."""


def trial_flags(trial: FrozenTrial) -> dict[str, FlagValue]:
    """The tuned flags of a trial as the server got them (floats without binary noise)."""
    return dict(TrialRecord.from_trial(trial).flags)


def pareto_front(study: optuna.Study) -> list[FrozenTrial]:
    """Feasible Pareto-optimal COMPLETE trials, by trial number."""
    return sorted(study.best_trials, key=lambda t: t.number)


def _objective_index(loaded: LoadedStudy, policy: Policy) -> int:
    want = "maximize" if policy is Policy.MAX_THROUGHPUT else "minimize"
    for i, objective in enumerate(loaded.spec.objectives):
        if objective.direction == want:
            return i
    raise ExportError(
        f"--policy {policy.value}: the study has no objective to {want} "
        f"({[o.metric for o in loaded.spec.objectives]}): use --trial N"
    )


def choose(study: optuna.Study, loaded: LoadedStudy, *, trial: int | None, policy: Policy | None) -> Choice:
    """Pick the trial to export: ``trial`` if given, else the Pareto member best for ``policy`` (among the
    finalists measured again, by the mean of their runs)."""
    table = confirmed(study)
    if trial is not None:
        matches = [t for t in study.get_trials(deepcopy=False) if t.number == trial]
        if not matches:
            raise SpecError("--trial", f"no trial {trial} in study {loaded.spec.study.name!r}")
        chosen = matches[0]
        if chosen.state != TrialState.COMPLETE:
            cause = TrialRecord.from_trial(chosen).cause or chosen.state.name.lower()
            raise SpecError("--trial", f"trial {trial} was not measured ({cause}): nothing to export")
    else:
        front = pareto_front(study)
        if not front:
            raise ExportError(
                f"study {loaded.spec.study.name!r} has no complete trial that meets the SLOs yet"
            )
        index = _objective_index(loaded, policy or Policy.MAX_THROUGHPUT)
        sign = 1 if loaded.spec.objectives[index].direction == "maximize" else -1
        chosen = max(front, key=lambda t: (sign * t.values[index], -t.number))
        finalists = [table[n] for n in table if table[n].confirmed]
        if index == 0 and finalists:  # the finalists were ranked by the first objective and remeasured
            best = max(finalists, key=lambda c: (c.misses == 0, sign * c.mean(0), -c.trial))
            chosen = next(t for t in study.get_trials(deepcopy=False) if t.number == best.trial)
    tuned = trial_flags(chosen)
    flags = {**loaded.spec.server.args, **tuned}
    baseline = default_trial(study)
    return Choice(
        trial=chosen,
        tuned=tuned,
        flags=flags,
        baseline=baseline,
        confirmed=table.get(chosen.number),
        gain=throughput_gain(table, chosen, baseline),
    )


def render(choice: Choice, loaded: LoadedStudy, fmt: Format) -> str:
    """Render a choice in ``fmt``; the text ends with a newline."""
    if fmt is Format.VLLM_YAML:
        return _vllm_yaml(choice, loaded)
    if fmt is Format.ARGS:
        return shlex.join(_command(choice, loaded)) + "\n"
    return json.dumps(export_record(choice, loaded), indent=2, sort_keys=False) + "\n"


def _command(choice: Choice, loaded: LoadedStudy) -> list[str]:
    return loaded.server_argv(choice.tuned)


def _vllm_yaml(choice: Choice, loaded: LoadedStudy) -> str:
    body = {flag_key(name).replace("_", "-"): value for name, value in choice.flags.items()}
    command = shlex.join([*loaded.spec.server.command, "--config", "FILE.yaml"])
    header = (
        f"# autotune: study {loaded.spec.study.name!r}, trial {choice.trial.number}\n"
        f"# {headline(choice)}\n"
        f"# use: {command}\n"
    )
    return header + yaml.safe_dump(body, sort_keys=False, default_flow_style=False)


def headline(choice: Choice) -> str:
    """One line: the chosen config's SLO throughput (confirmed mean and spread when measured again) and
    its gain over the defaults (within the noise said as such)."""
    parts = []
    sure = choice.confirmed
    throughput = slo_throughput(choice.trial)
    if sure is not None and sure.confirmed:
        runs = len(sure.throughputs)
        missed = f", {sure.misses} rerun(s) missed the SLOs" if sure.misses else ""
        parts.append(
            f"SLO-constrained throughput {sure.throughput:.1f} tok/s (mean of {runs} runs, spread "
            f"{sure.throughput_spread:.1%}{missed})"
        )
    elif throughput is not None:
        parts.append(f"SLO-constrained throughput {throughput:.1f} tok/s")
    if choice.gain is not None:
        parts.append(choice.gain.text())
    return ", ".join(parts) or "measured"


def slo_throughput(trial: FrozenTrial) -> float | None:
    """A trial's SLO-constrained output throughput (tok/s), if it was measured."""
    if trial.state != TrialState.COMPLETE:
        return None
    return TrialRecord.from_trial(trial).slo_throughput


def export_record(choice: Choice, loaded: LoadedStudy) -> dict[str, Any]:
    """The JSON export: flags, command line, measured metrics, workload and SLOs."""
    trial = choice.trial
    record = TrialRecord.from_trial(trial)
    spec = loaded.spec
    baseline = choice.baseline
    base = TrialRecord.from_trial(baseline) if baseline is not None else None
    return {
        "study": spec.study.name,
        "trial": trial.number,
        "model": spec.server.model,
        "flags": {flag_key(k).replace("_", "-"): v for k, v in choice.flags.items()},
        "command": _command(choice, loaded),
        "objectives": {o.metric: v for o, v in zip(spec.objectives, trial.values or [], strict=False)},
        "operating_point": record.operating_point,
        "probes": list(record.probes) or None,
        "capacity": record.capacity,
        "server_delta": record.server_delta,
        "baseline": None
        if baseline is None or base is None
        else {
            "trial": baseline.number,
            "outcome": base.outcome,
            "cause": base.cause.value if base.cause is not None else None,
            "slo_throughput": slo_throughput(baseline),
        },
        "gain_over_baseline": choice.gain.value if choice.gain is not None else None,
        "gain_within_noise": choice.gain.within_noise if choice.gain is not None else None,
        "confirmed": None
        if choice.confirmed is None
        else {
            "runs": len(choice.confirmed.throughputs),
            "slo_throughput_mean": choice.confirmed.throughput,
            "slo_throughput_runs": list(choice.confirmed.throughputs),
            "spread": choice.confirmed.throughput_spread,
            "reruns_missed": choice.confirmed.misses,
        },
        "workload": spec.workload.model_dump(mode="json"),
        "slo": {"terms": [str(t) for t in spec.slo.terms], "error_budget": spec.slo.error_budget},
    }
