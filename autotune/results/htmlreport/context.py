"""What every section of the report shares, gathered once from the study: its trials' rows, the export's
choice and the defaults' row it is measured against with the defaults' reruns, vLLM's defaults, the Pareto
front, the best-so-far curve, the tuners' wall time, the signed importances and the spec's path as the user
gave it (:class:`ReportContext`, :func:`gather`).

The sections (:mod:`.answer`, :mod:`.charts`, :mod:`.latency`, :mod:`.tables`, :mod:`.facts`) only read
it; which config is best and its gain are the export's (:func:`autotune.results.export.choose`), and the
reruns' figures are the export's too (:func:`autotune.results.export.reruns_fields`).
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import optuna

from autotune.errors import ExportError, SpecError
from autotune.events import read_events
from autotune.flags import FlagValue
from autotune.inputs.loader import LoadedStudy
from autotune.inputs.spec import StudySpec
from autotune.results.export import Choice, choose, defaults_of, pareto_front, reruns_fields
from autotune.results.htmlreport.data import Progress, TrialRow, progress, trial_rows, tuner_seconds
from autotune.results.htmlreport.importance import Importances, importances
from autotune.store.record import TrialRecord
from autotune.study.finalists import reruns


@dataclass(frozen=True)
class ReportContext:
    """The study and what the report's sections read of it (see :func:`gather`)."""

    study: optuna.Study
    loaded: LoadedStudy
    now: datetime.datetime
    """When the page is generated (its footer)."""
    rows: Sequence[TrialRow]
    """Every trial, by number."""
    params: Sequence[str]
    """The tuned flags, in the space's order."""
    choice: Choice | None
    """The export's pick; ``None`` when no config met the SLOs (:attr:`why_none` says why)."""
    why_none: str
    pick: TrialRow | None
    """The row of the chosen trial."""
    base: TrialRow | None
    """The row of the defaults' trial the pick is measured against (the last finished one without a
    choice)."""
    defaults: Mapping[str, FlagValue]
    """vLLM's defaults as the server reported them at the defaults' trial (the space's otherwise)."""
    default_warnings: Sequence[str]
    """Where the space's declared defaults and what the server reported disagreed."""
    front: frozenset[int]
    """The numbers of the Pareto-optimal trials."""
    progress: Progress
    wall_s: float
    """The tuners' wall time from the event log (finalists included), else the trials' span."""
    importances: Importances
    base_reruns: Mapping[str, Any] | None = None
    """The defaults' reruns as the finalists' stage measured them again
    (:func:`autotune.results.export.reruns_fields`: ``runs``, ``slo_throughput_mean``,
    ``slo_throughput_runs``, ``interval``, ``missed``); ``None`` when they were not measured again."""
    spec_shown: str = ""
    """The spec's path as the user gave it (``studies/demo.yaml``); the resolved path when not given."""

    @property
    def spec(self) -> StudySpec:
        """The study's spec."""
        return self.loaded.spec

    def is_pick(self, row: TrialRow) -> bool:
        """Whether ``row`` is the chosen trial's."""
        return self.pick is not None and row.number == self.pick.number


def gather(
    study: optuna.Study, loaded: LoadedStudy, *, now: datetime.datetime, spec_shown: str | None = None
) -> ReportContext:
    """Read what the report's sections share from ``study`` (the export's choice, the rows, the curves);
    ``spec_shown`` is the spec's path as the user typed it (the resolved path when ``None``)."""
    spec = loaded.spec
    rows = trial_rows(study, loaded)
    by_number = {r.number: r for r in rows}
    params = list(loaded.space.params)
    maximize = spec.objectives[0].direction == "maximize"
    choice: Choice | None
    why_none = ""
    table = reruns(study)
    try:
        choice = choose(study, loaded, trial=None, policy=None, table=table)
    except (ExportError, SpecError) as exc:
        choice, why_none = None, str(exc)
    pick = by_number.get(choice.trial.number) if choice is not None else None
    measured = choice.baseline if choice is not None else None
    base = by_number.get(measured.number) if measured is not None else _baseline_row(rows)
    frozen = {t.number: t for t in study.get_trials(deepcopy=False)}
    base_trial = frozen.get(base.number) if base is not None else None
    prog = progress(rows, maximize)
    ran = tuner_seconds(list(read_events(loaded.workdir / "events.jsonl")))
    return ReportContext(
        study=study,
        loaded=loaded,
        now=now,
        rows=rows,
        params=params,
        choice=choice,
        why_none=why_none,
        pick=pick,
        base=base,
        defaults=defaults_of(loaded, base_trial),
        default_warnings=(
            TrialRecord.from_trial(base_trial).default_warnings if base_trial is not None else ()
        ),
        front=frozenset(t.number for t in pareto_front(study)),
        progress=prog,
        wall_s=ran if ran is not None else prog.hours * 3600,
        importances=importances(study, params, maximize=maximize),
        base_reruns=reruns_fields(table.get(base.number)) if base is not None else None,
        spec_shown=spec_shown or str(loaded.spec_path),
    )


def _baseline_row(rows: Sequence[TrialRow]) -> TrialRow | None:
    """The last finished trial of vLLM's defaults (when there is no choice to name one)."""
    done = [r for r in rows if r.baseline and r.state not in ("given back", "running", "queued")]
    return done[-1] if done else None
