"""Plain-text reports of a study: the Pareto front against the vLLM defaults, and trial outcomes.

Functions here build strings; only the CLI prints them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

import optuna
from optuna.trial import FrozenTrial, TrialState

from autotune.export import choose, headline, pareto_front, slo_throughput, trial_flags
from autotune.finalists import Confirmed, confirmed, throughput_gain
from autotune.loader import LoadedStudy
from autotune.record import TrialRecord
from autotune.spec import flag_key
from autotune.study import default_trial

_STATS = (("ttft", "p95"), ("tpot", "p95"), ("e2el", "p99"))


def _ms(point: Mapping[str, object], metric: str, stat: str) -> str:
    value = point.get(f"{stat}_{metric}_ms")
    return f"{float(value):.0f}" if isinstance(value, int | float) else "-"


def _flags(trial: FrozenTrial, names: Sequence[str]) -> list[str]:
    flags = trial_flags(trial)
    return [str(flags.get(n, "-")) for n in names]


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _confirmed(sure: Confirmed | None) -> str:
    if sure is None or not sure.confirmed:
        return "-"
    missed = f", {sure.misses} missed" if sure.misses else ""
    return f"{sure.throughput:.1f} ±{sure.throughput_spread / 2:.1%} ({len(sure.throughputs)} runs{missed})"


def _row(
    table: Mapping[int, Confirmed],
    trial: FrozenTrial,
    names: Sequence[str],
    baseline: FrozenTrial | None,
    tag: str,
) -> list[str]:
    point = TrialRecord.from_trial(trial).operating_point or {}
    tput = slo_throughput(trial)
    gain = throughput_gain(table, trial, baseline)
    rate = point.get("request_rate")
    shown = "-" if gain is None else f"{gain.value:+.1%}" + (" (noise)" if gain.within_noise else "")
    return [
        f"{trial.number}{tag}",
        *_flags(trial, names),
        f"{tput:.1f}" if tput is not None else "-",
        _confirmed(table.get(trial.number)),
        _rate(rate),
        *[_ms(point, m, s) for m, s in _STATS],
        shown,
    ]


def _rate(rate: object) -> str:
    if rate is None:
        return "sat"
    return f"{float(rate):.2f}" if isinstance(rate, int | float) else "-"


def best_table(study: optuna.Study, loaded: LoadedStudy) -> str:
    """The Pareto front (feasible, complete) with flags, SLO throughput, latencies and gain."""
    names = list(loaded.space.params)
    baseline = default_trial(study)
    header = [
        "trial",
        *[flag_key(n).replace("_", "-") for n in names],
        "slo tok/s",
        "measured again",
        "req/s",
        *[f"{m} {s} ms" for m, s in _STATS],
        "vs default",
    ]
    table = confirmed(study)
    rows = [_row(table, t, names, baseline, "") for t in pareto_front(study)]
    lines = []
    if not rows:
        lines.append("No complete trial meets the SLOs yet.")
    else:
        lines.append(f"Pareto front of study {loaded.spec.study.name!r} ({len(rows)} configs):")
        lines.append(_table(header, rows))
        choice = choose(study, loaded, trial=None, policy=None)
        lines.append(f"Export picks trial {choice.trial.number}: {headline(choice)}")
    if baseline is None:
        lines.append("vLLM defaults: not measured yet.")
    elif baseline.state == TrialState.COMPLETE:
        lines.append("vLLM defaults (baseline):")
        lines.append(_table(header, [_row(table, baseline, names, baseline, "*")]))
    else:
        record = TrialRecord.from_trial(baseline)
        lines.append(f"vLLM defaults (trial {baseline.number}): pruned ({record.cause}): {record.summary}")
    lines.append(outcome_summary(study))
    return "\n".join(lines)


def outcome_summary(study: optuna.Study) -> str:
    """One line: how many trials completed, were pruned (by cause), failed or are still running."""
    counts: Counter[str] = Counter()
    for trial in study.get_trials(deepcopy=False):
        if trial.state == TrialState.PRUNED:
            counts[f"pruned:{TrialRecord.from_trial(trial).cause or '?'}"] += 1
        else:
            counts[trial.state.name.lower()] += 1
    order = sorted(counts, key=lambda k: (not k.startswith("complete"), k))
    return "Trials: " + ", ".join(f"{counts[k]} {k}" for k in order)
