"""What the calibrated surrogate knows about a study, as text (``autotune simulate SPEC --calibrated``): its
fitted constants, how well it reproduces each measured trial, how its proposals fared, and the configs it
would launch next."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from optuna.trial import FrozenTrial

from autotune.flags import FlagValue
from autotune.predict.surrogate.model import observations
from autotune.predict.surrogate.propose import Proposal, Proposer, track_record
from autotune.sim.cost import Scales


@dataclass(frozen=True)
class Fitted:
    """One measured trial as the calibrated surrogate reproduces it (SLO rates, requests per second)."""

    trial: int
    flags: Mapping[str, FlagValue]
    measured: float
    predicted: float

    @property
    def error(self) -> float | None:
        if self.measured <= 0 or self.predicted <= 0:
            return None
        return self.predicted / self.measured - 1.0


@dataclass(frozen=True)
class SurrogateView:
    """Everything :func:`render` shows."""

    proposer: Proposer
    fitted: tuple[Fitted, ...]
    ranked: tuple[Proposal, ...]
    handed_over: str | None
    proposals: tuple[tuple[int, float, float], ...]
    """(trial, predicted, measured) of each measured proposal."""


def view(proposer: Proposer, trials: Sequence[FrozenTrial], top: int) -> SurrogateView:
    """Calibrate ``proposer`` to ``trials`` and gather what :func:`render` shows."""
    ranked = proposer.ranked(trials, limit=top)
    cal = proposer.calibration
    assert cal is not None
    fitted = [
        Fitted(obs.trial, obs.flags, obs.slo_rate or 0.0, predicted)
        for obs, predicted in proposer.reproduced(cal, observations(trials), proposer.memory_calibration)
    ]
    record = track_record(trials)
    proposals = tuple((p.trial, p.predicted, p.measured) for p in record.predictions)
    return SurrogateView(proposer, tuple(fitted), tuple(ranked[:top]), record.handed_over, proposals)


def _flags(flags: Mapping[str, FlagValue]) -> str:
    return " ".join(f"{k.replace('_', '-')}={v}" for k, v in sorted(flags.items())) or "(vLLM's defaults)"


def _pct(x: float | None) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{x:+.0%}"


def render(v: SurrogateView, study_name: str) -> str:
    """The view as text, one section per question."""
    s = v.proposer.surrogate
    cal = v.proposer.calibration
    assert cal is not None
    lines = [
        f"calibrated surrogate of {study_name!r}: {s.arch.name} on {s.gpu.name}, mean prompt "
        f"{s.traffic.prompt:.0f} and output {s.traffic.output:.0f} tokens",
    ]
    if cal.observations == 0:
        lines.append("no measured trial yet: the simulator's own constants (the cold-start ranking)")
    else:
        lines.append(
            f"fitted to {cal.observations} measured trials ({cal.points} probe values), median error "
            f"{math.expm1(cal.error):.1%} per value"
        )
    scales = ", ".join(f"{n.replace('_', ' ')} x{getattr(cal.params.scales, n):.2f}" for n in Scales.names())
    factors = ", ".join(f"{k} x{f:.2f}" for k, f in cal.params.factors.items())
    lines += [f"constants (x the simulator's): {scales}", f"SLO term factors: {factors}", ""]
    if v.fitted:
        lines.append("measured trials, SLO-constrained rate (req/s) as measured and as the fit predicts it:")
        lines.append(f"  {'trial':>5} {'measured':>9} {'predicted':>9} {'error':>6}  flags")
        for f in v.fitted:
            lines.append(
                f"  {f.trial:>5} {f.measured:>9.3g} {f.predicted:>9.3g} {_pct(f.error):>6}  {_flags(f.flags)}"
            )
        lines.append("")
    if v.proposals:
        lines.append("its proposals, predicted when proposed and then measured (req/s):")
        for trial, predicted, measured in v.proposals:
            error = measured / predicted - 1.0 if predicted > 0 and measured > 0 else None
            lines.append(f"  trial {trial:>4}: {predicted:.3g} -> {measured:.3g} ({_pct(error)})")
        lines.append("")
    fit = v.proposer.fit
    if fit is not None and fit.trials:
        again = "; the warm fit was off, this one is fitted again from the prior" if fit.refit else ""
        judged = f", judged from {fit.window} trials" if fit.trials < fit.window else ""
        lines.append(
            f"its fit on the {fit.trials} measured trials' SLO rates: median error "
            f"{math.expm1(fit.error):.0%} (limit {fit.tolerance:.0%}{judged}){again}"
        )
    if v.handed_over:
        lines.append(f"handed over: {v.handed_over}")
    elif fit is not None and fit.over:
        lines.append(f"handed over at the next launch: {fit.handed_over()}")
    else:
        lines.append("status: it proposes the next launch")
    lines.append("")
    lines.append(f"top {len(v.ranked)} configs no trial holds yet, as predicted now:")
    lines.append("  (runs: its chance to start and then run through its probes without crashing under load)")
    lines.append(f"  {'#':>3} {'req/s':>7} {'10-90 %':>15} {'tok/s':>8} {'runs':>6}  flags")
    for i, p in enumerate(v.ranked, 1):
        spread = f"{p.lo:.3g}-{p.hi:.3g}"
        lines.append(
            f"  {i:>3} {p.rate:>7.3g} {spread:>15} {p.throughput:>8,.0f} {p.run_probability:>6.0%}  "
            f"{_flags(p.flags)}"
        )
    return "\n".join(lines) + "\n"
