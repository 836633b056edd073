"""Which flags mattered, and which way: Optuna's parameter importances, signed by the direction of each
flag's effect on the first (maximised or minimised) objective.

Importances are Optuna's PED-ANOVA (``optuna.importance.PedAnovaImportanceEvaluator``, Optuna 5's default:
it needs only numpy; fANOVA and mean-decrease-impurity need scikit-learn, which autotune does not
install). They are computed on the COMPLETE trials that launched their own server (repeats of a measured
config are left out: they would count one measurement twice), in a study of their own whose single
objective is the first objective of the spec, so "better" is that objective's direction. PED-ANOVA
compares the flags' distribution among the best ``target_quantile`` of trials with all of them; with few
trials that top group is a handful, so the quantile is raised to hold at least :data:`TOP_TRIALS`.

An importance has no sign. The sign shown is Spearman's rank correlation of the flag's value (booleans
as 0/1, categorical choices in their listed order when they are numbers) with the objective, turned so
that ``+`` means "a higher value gave a better result" whatever the direction; a correlation within what
chance gives (:data:`CHANCE_Z`) is shown as no clear trend. A categorical flag whose
choices are not numbers gets no sign: the choice with the best mean result is named instead.
Below :data:`MIN_TRIALS` measured trials the importances are noise, and none are given.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution
from optuna.trial import FrozenTrial, TrialState

from autotune.store.record import TrialRecord

MIN_TRIALS = 8
"""Fewer measured trials than this give no importances (the report says so)."""
TOP_TRIALS = 3
"""PED-ANOVA's best group holds at least this many trials."""
TARGET_QUANTILE = 0.1
"""PED-ANOVA's default share of the best trials, used once there are enough of them."""
CHANCE_Z = 1.645
"""A sign is shown when |rho| > CHANCE_Z / sqrt(n - 1): beyond what n unrelated values give 90 % of the
time (Spearman's rho is about normal with variance 1 / (n - 1) under no relation)."""


@dataclass(frozen=True)
class Importance:
    """One flag's importance (0 to 1, all flags summing to 1) and the way it pushes the objective."""

    name: str
    importance: float
    sign: int | None
    """+1: higher values did better; -1: lower values did better; 0: no clear trend; None: no order (a
    categorical flag of names)."""
    correlation: float | None
    """Spearman's rho of the value with "better" (the objective, negated when it is minimised)."""
    best_choice: str | None = None
    """For a categorical flag of names: the choice with the best mean result."""


@dataclass(frozen=True)
class Importances:
    """The flags' importances, most important first, or why there are none."""

    items: tuple[Importance, ...]
    trials: int
    """How many measured trials they rest on."""
    reason: str = ""
    """Why there are none (too few trials)."""
    method: str = ""
    constant: tuple[str, ...] = ()
    """Flags that took one value only among the measured trials (nothing to say about them)."""


def measured_trials(study: optuna.Study) -> list[FrozenTrial]:
    """COMPLETE trials that launched their own server (not repeats), with values."""
    out = []
    for trial in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        record = TrialRecord.from_trial(trial)
        if trial.values and record.repeat_of is None and record.launched is not False:
            out.append(trial)
    return out


def importances(study: optuna.Study, params: Sequence[str], *, maximize: bool) -> Importances:
    """Signed importances of ``params`` for the first objective (see the module docstring)."""
    trials = [t for t in measured_trials(study) if all(p in t.params for p in params)]
    if len(trials) < MIN_TRIALS:
        return Importances(
            (),
            len(trials),
            f"only {len(trials)} measured trials: importances need at least {MIN_TRIALS} to say more "
            "than noise",
        )
    varied = [p for p in params if len({repr(t.params[p]) for t in trials}) > 1]
    if not varied:
        return Importances((), len(trials), "no flag took more than one value among the measured trials")
    quantile = min(0.5, max(TARGET_QUANTILE, TOP_TRIALS / len(trials)))
    scratch = optuna.create_study(direction="maximize" if maximize else "minimize")
    for trial in trials:
        scratch.add_trial(
            optuna.trial.create_trial(
                params={p: trial.params[p] for p in varied},
                distributions={p: trial.distributions[p] for p in varied},
                value=trial.values[0],
            )
        )
    evaluator = optuna.importance.PedAnovaImportanceEvaluator(target_quantile=quantile)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Optuna warns when every importance is equal: shown as such
        scores = optuna.importance.get_param_importances(scratch, evaluator=evaluator, params=varied)
    better = [t.values[0] if maximize else -t.values[0] for t in trials]
    clear = CHANCE_Z / math.sqrt(len(trials) - 1)
    items = []
    for name, score in scores.items():
        values = [t.params[name] for t in trials]
        dist = trials[0].distributions[name]
        order = _order(values, dist)
        if order is None:
            items.append(Importance(name, score, None, None, _best_choice(values, better)))
            continue
        rho = spearman(order, better)
        sign = 0 if rho is None or abs(rho) <= clear else (1 if rho > 0 else -1)
        items.append(Importance(name, score, sign, rho))
    method = (
        f"Optuna PED-ANOVA on {len(trials)} measured trials (best {quantile:.0%} against all), "
        f"signed by Spearman's rank correlation with the first objective where |ρ| > {clear:.2f}"
    )
    constant = tuple(p for p in params if p not in varied)
    return Importances(tuple(items), len(trials), method=method, constant=constant)


def _order(values: Sequence[object], dist: BaseDistribution) -> list[float] | None:
    """The values as numbers that keep their order, or ``None`` for categorical names."""
    if isinstance(dist, CategoricalDistribution) and not all(
        isinstance(c, int | float) for c in dist.choices
    ):
        return None
    return [float(v) for v in values]  # type: ignore[arg-type]


def _best_choice(values: Sequence[object], better: Sequence[float]) -> str:
    groups: dict[str, list[float]] = {}
    for value, score in zip(values, better, strict=True):
        groups.setdefault(str(value), []).append(score)
    return max(groups, key=lambda k: sum(groups[k]) / len(groups[k]))


def _ranks(values: Sequence[float]) -> list[float]:
    """Ranks from 1, ties given their mean rank."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Spearman's rank correlation (Pearson's on ranks, ties averaged); ``None`` when either side is
    constant."""
    rx, ry = _ranks(xs), _ranks(ys)
    n = len(rx)
    mx, my = sum(rx) / n, sum(ry) / n
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    sxx = sum((a - mx) ** 2 for a in rx)
    syy = sum((b - my) ** 2 for b in ry)
    if sxx == 0 or syy == 0:
        return None
    return sxy / math.sqrt(sxx * syy)


def by_name(result: Importances) -> Mapping[str, Importance]:
    """The importances keyed by flag."""
    return {item.name: item for item in result.items}
