"""Finalists: the leader, its rivals within the noise and vLLM's defaults measured again, and the one rule
that picks the config a study recommends and states its gain.

The search measures every config on one stream of requests (common random numbers), and the leader is the
config whose figure came out highest: that figure is the luckiest of many, so it cannot state its own gain
(the winner's curse). Once the budget is spent and no trial runs anywhere, the leader, every other config
the search could not tell from it (:func:`tied`: their figures compared pair by pair on the stream both
met; at most ``finalists.count`` in all, and only while the stage's estimated time stays within
``finalists.max_share`` of the study's) and the trial of vLLM's defaults are launched again,
``finalists.rounds`` times. Round ``k`` sends every finalist the same fresh stream (:func:`round_seed`), so
the finalists of one round are compared pair by pair on the same requests, and starts each search at the
config's known boundary (no saturation probe, no bracket to find).

Each (finalist, round) is a trial of a companion study in the same storage (``<study>.finalists``: the
ledger), queued once and claimed the way Optuna hands out enqueued trials (on a local storage under the
storage's queue lock, which makes that atomic where SQLite does not), so however many workers run, each
round of each finalist is measured once; a worker that dies leaves it to be claimed again. Reruns are not
trials of the study: they spend no launch of the budget and the sampler never sees them.

**The rule** (:func:`pick`): with reruns, of the finalists with the fewest reruns that missed the SLOs, the
one with the highest mean SLO-constrained throughput over its reruns (the search's figure left out; a mean
over the reruns that met would otherwise crown a config that failed most rounds); before them, the best
feasible measured trial. The progress line, ``best``, ``export``, ``verify`` and the report all name this
config. Its **gain** over the defaults (:func:`gain`) comes from reruns only: in each round both configs ran
on the same requests, so the ratio of their figures carries only the luck they did not share (the paired
noise of their batches, :func:`autotune.load.crossing.paired_noise`, and each side's bracket), pooled over
the rounds with the spread of the rounds' ratios (:func:`_paired`). A gain whose interval holds zero is
"within the noise". (The pick among finalists within the noise of each other uses the same reruns that
state its gain: a small selection effect, bounded by that noise, remains.)
"""

from __future__ import annotations

import math
import statistics
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import optuna
from optuna.trial import FrozenTrial, TrialState

from autotune.inputs.loader import LoadedStudy
from autotune.load.crossing import BATCHES, NOISE_Z, batch_spread, t_975
from autotune.outcome import Cause
from autotune.store import optuna_private
from autotune.store.record import TrialRecord
from autotune.store.storage import create_or_load_study
from autotune.units import gain_spread, plural

LEDGER = ".finalists"
"""Suffix of the companion study that holds the reruns."""
ROUND_SEED_STEP = 1_000_003
"""Round ``k`` sends the stream of workload seed ``seed + k × ROUND_SEED_STEP``."""


def round_seed(workload_seed: int, round_number: int) -> int:
    """The workload seed of round ``round_number`` (from 1): fresh against the search's, shared by every
    finalist of the round."""
    return workload_seed + round_number * ROUND_SEED_STEP


@dataclass(frozen=True)
class Rerun:
    """One finalist measured again in one round."""

    trial: int
    round: int
    slo_throughput: float | None
    """Output tok/s at its estimated boundary; ``None`` when the rerun met no SLO or failed."""
    estimate: Mapping[str, Any] | None = None
    """The rerun's estimate (:meth:`autotune.load.ratesearch.Estimate.as_dict`)."""
    cause: str | None = None
    summary: str = ""

    @property
    def met(self) -> bool:
        return self.slo_throughput is not None

    @property
    def unmeasured(self) -> bool:
        """The client could not measure it at any rate: neither met nor missed (the client's limit)."""
        return self.cause == Cause.UNMEASURABLE.value

    def attrs(self) -> dict[str, Any]:
        """What the ledger trial stores besides its value."""
        return {
            "estimate": dict(self.estimate) if self.estimate else None,
            "cause": self.cause,
            "summary": self.summary,
        }


@dataclass(frozen=True)
class Finalist:
    """Every rerun of one config."""

    trial: int
    reruns: tuple[Rerun, ...]

    @property
    def met(self) -> tuple[Rerun, ...]:
        return tuple(r for r in self.reruns if r.met)

    @property
    def misses(self) -> int:
        """Reruns that met no SLO or failed (a rerun the client could not measure is not one)."""
        return sum(1 for r in self.reruns if not r.met and not r.unmeasured)

    @property
    def throughput(self) -> float | None:
        """Mean SLO-constrained throughput over the reruns that met the SLOs."""
        met = self.met
        return (
            statistics.fmean(r.slo_throughput for r in met if r.slo_throughput is not None) if met else None
        )

    @property
    def interval(self) -> tuple[float, float] | None:
        """The interval of the mean over the reruns (each rerun's own, combined), tok/s."""
        met = [r for r in self.met if r.estimate]
        if not met or self.throughput is None:
            return None
        halves = []
        for r in met:
            assert r.estimate is not None and r.slo_throughput
            lo, hi = r.estimate.get("slo_throughput_lo"), r.estimate.get("slo_throughput_hi")
            if not isinstance(lo, int | float) or not isinstance(hi, int | float):
                return None
            halves.append((hi - lo) / 2 / r.slo_throughput)
        half = math.sqrt(sum(h * h for h in halves)) / len(halves)
        return (self.throughput * (1 - half), self.throughput * (1 + half))


@dataclass(frozen=True)
class Gain:
    """A config's SLO-constrained throughput over the defaults', from paired reruns, with its interval."""

    value: float
    """Relative gain (0.05: 5 % more)."""
    lo: float
    hi: float
    rounds: int
    """Rounds in which both were measured again (0: from the search's figures, unconfirmed)."""

    @property
    def confirmed(self) -> bool:
        return self.rounds > 0

    @property
    def within_noise(self) -> bool:
        """The interval holds zero: no gain (or loss) beyond the noise."""
        return self.lo <= 0.0 <= self.hi

    def text(self) -> str:
        """The gain in words with its interval: ``+28.1% ±3.0% over the vLLM defaults (2 paired reruns)``
        (a range where the interval is not symmetric: :func:`autotune.units.gain_spread`)."""
        where = plural(self.rounds, "paired rerun") if self.rounds else "unconfirmed"
        figure = gain_spread(self.value, self.lo, self.hi)
        if self.within_noise:
            return f"{figure} over the vLLM defaults: within the noise ({where})"
        return f"{figure} over the vLLM defaults ({where})"


# ----------------------------------------------------------------------------------------------
# Who the finalists are
# ----------------------------------------------------------------------------------------------


def _feasible(trial: FrozenTrial) -> bool:
    return all(c <= 0 for c in (trial.constraints or {}).values())


def is_measured(trial: FrozenTrial) -> bool:
    """A COMPLETE trial that launched its own server (not a repeat answered from another trial)."""
    record = TrialRecord.from_trial(trial)
    return trial.state == TrialState.COMPLETE and bool(trial.values) and record.repeat_of is None


def _ranked(trials: Sequence[FrozenTrial], loaded: LoadedStudy) -> list[FrozenTrial]:
    """The feasible measured trials, best first by the first objective (the lowest number among equals)."""
    sign = 1 if loaded.spec.objectives[0].direction == "maximize" else -1
    measured = [t for t in trials if is_measured(t) and _feasible(t)]
    return sorted(measured, key=lambda t: (-sign * t.values[0], t.number))


def leader(study: optuna.Study, loaded: LoadedStudy) -> FrozenTrial | None:
    """The best feasible measured trial by the first objective (the lowest number among equals)."""
    ranked = _ranked(study.get_trials(deepcopy=False), loaded)
    return ranked[0] if ranked else None


def baseline_trial(study: optuna.Study) -> FrozenTrial | None:
    """The measured trial of vLLM's defaults (the newest, if it was retried), or ``None``."""
    return _baseline(study.get_trials(deepcopy=False))


def _baseline(trials: Sequence[FrozenTrial]) -> FrozenTrial | None:
    found = [t for t in trials if is_measured(t) and TrialRecord.from_trial(t).baseline]
    return found[-1] if found else None


@dataclass(frozen=True)
class Stage:
    """Whom the finalists' stage measures again, and the configs tied with the leader it leaves out."""

    chosen: tuple[FrozenTrial, ...]
    """The leader, the configs tied with it that fit, then the defaults' trial (:func:`finalists`)."""
    left_out: tuple[FrozenTrial, ...] = ()
    """Measured configs the search could not tell from the leader (:func:`tied`) that the stage leaves
    out, best first, one trial per config: the luck of the search's draw ranked them below the leader."""
    bound: Literal["count", "max_share"] | None = None
    """What left them out: ``finalists.count`` or ``finalists.max_share`` (the stage's estimated time),
    whichever came first."""

    def left_out_text(self, loaded: LoadedStudy) -> str:
        """One sentence on the configs left out and how to measure them (some were: :func:`left_out`)."""
        spec = loaded.spec.finalists
        numbers = ", ".join(str(t.number) for t in self.left_out)
        which = "trial" if len(self.left_out) == 1 else "trials"
        if self.bound == "count":
            held, raise_ = f"finalists.count ({spec.count})", "finalists.count"
        else:
            held = f"finalists.max_share ({spec.max_share:g} of the study's time)"
            raise_ = "finalists.max_share"
        return (
            f"Not measured again, though the search could not tell them from its leader (trial "
            f"{self.chosen[0].number}): {which} {numbers}, left out by {held}; raise {raise_} and run "
            "`autotune verify` to measure them."
        )


def stage(study: optuna.Study, loaded: LoadedStudy) -> Stage:
    """The finalists (:func:`finalists`) and the ties they leave out; empty when ``finalists.count`` is 0
    or nothing met the SLOs."""
    spec = loaded.spec.finalists
    if not spec.count:
        return Stage(())
    trials = study.get_trials(deepcopy=False)
    ranked = _ranked(trials, loaded)
    if not ranked:
        return Stage(())
    top = ranked[0]  # the leader (:func:`leader`)
    best = TrialRecord.from_trial(top)
    seen = {_config(best)}
    base = _baseline(trials)
    base_record = TrialRecord.from_trial(base) if base is not None else None
    base_key = _config(base_record) if base_record is not None else None
    spent = sum(_seconds(t) for t in trials)
    allowance = math.inf if spec.max_share >= 1 else spent * spec.max_share / (1 - spec.max_share)
    # The leader and the defaults run whatever it costs; the ties, while the stage fits its share.
    seconds = spec.rounds * rerun_seconds(top, best, spec.probe_scale)
    if base is not None and base_record is not None and base_key not in seen:
        seconds += spec.rounds * rerun_seconds(base, base_record, spec.probe_scale)
    out, left = [top], list[FrozenTrial]()
    bound: Literal["count", "max_share"] | None = None
    for trial in ranked[1:]:
        record = TrialRecord.from_trial(trial)
        key = _config(record)
        if key in seen or not tied(best, record):
            continue
        if bound is None and len(out) >= spec.count:
            bound = "count"
        if bound is None and key != base_key:
            seconds += spec.rounds * rerun_seconds(trial, record, spec.probe_scale)
            if seconds > allowance:
                bound = "max_share"
        if bound is not None and key == base_key:
            continue  # the defaults run anyway (below)
        (left if bound is not None else out).append(trial)
        seen.add(key)
    if base is not None and base_key not in seen:
        out.append(base)
    return Stage(tuple(out), tuple(left), bound)


def left_out(study: optuna.Study, loaded: LoadedStudy) -> Stage | None:
    """The finalists' stage with the ties it left out, once its reruns were queued (None before: while the
    study runs, a longer study's share may still take them in)."""
    book = existing_ledger(study)
    if book is None or not rounds_done(book):
        return None
    found = stage(study, loaded)
    return found if found.left_out else None


def finalists(study: optuna.Study, loaded: LoadedStudy) -> list[FrozenTrial]:
    """The leader, then the measured configs the search could not tell from it (:func:`tied`; best first,
    one trial per config, ``finalists.count`` in all, while the stage's estimated time, every round, stays
    within ``finalists.max_share`` of the study's: :func:`rerun_seconds`), then the defaults' trial when
    measured; empty when ``finalists.count`` is 0 or nothing met the SLOs."""
    return list(stage(study, loaded).chosen)


def rerun_seconds(trial: FrozenTrial, record: TrialRecord, probe_scale: float) -> float:
    """The time measuring ``trial``'s config again (``record``: its record) is expected to take: its own
    trial's (a launch, then probes), with the probes ``probe_scale`` times longer. An upper bound: a rerun
    starts at the known boundary, with no saturation probe and no bracket to find."""
    return _seconds(trial) + (probe_scale - 1) * (record.probe_seconds or 0.0)


def _seconds(trial: FrozenTrial) -> float:
    """How long a finished trial took (0 for one not finished)."""
    return trial.duration.total_seconds() if trial.duration is not None else 0.0


def tied(leader: TrialRecord, other: TrialRecord) -> bool:
    """Whether the search could not tell ``other``'s SLO-constrained throughput from the leader's.

    Every trial of a study is measured on one stream of requests, so what both met (a burst, a run of
    long prompts) moves both figures alike: they are compared pair by pair, batch against batch
    (:func:`pair_half_width`), and ``other`` is tied when the leader's lead is within that interval.
    Trials without batches (a boundary beyond the highest rate, records from before them) are compared by
    their own intervals: tied when they overlap."""
    x, y = leader.slo_throughput or 0.0, other.slo_throughput or 0.0
    half = pair_half_width(leader.estimate, other.estimate)
    if x > 0 and y > 0 and half is not None:
        return math.log(x / y) <= half
    low, _ = _interval(leader)
    _, high = _interval(other)
    return high >= low


def pair_half_width(a: Mapping[str, Any] | None, b: Mapping[str, Any] | None) -> float | None:
    """Half the interval of ``log(a / b)`` for two estimates measured on one stream (Student's t over the
    unshared noise of their batches, each side's bracket counted too); ``None`` when either has no
    batches."""
    if not _batches(a) or not _batches(b):
        return None
    return NOISE_Z * math.sqrt(_pair_variance(a, b))


def _config(record: TrialRecord) -> str:
    return repr(sorted(record.flags.items()))


def _interval(record: TrialRecord) -> tuple[float, float]:
    interval = record.slo_throughput_interval
    if interval is not None:
        return interval
    value = record.slo_throughput or 0.0
    return (value, value)


# ----------------------------------------------------------------------------------------------
# The ledger: one trial of a companion study per (finalist, round)
# ----------------------------------------------------------------------------------------------


def ledger(study: optuna.Study) -> optuna.Study:
    """The companion study holding ``study``'s reruns (created on first use, race-free), in its storage."""
    storage = optuna_private.storage(study)
    sampler = optuna.samplers.RandomSampler(seed=0)
    found, _ = create_or_load_study(storage, study.study_name + LEDGER, ["maximize"], sampler)
    return found


def existing_ledger(study: optuna.Study) -> optuna.Study | None:
    """The companion study when it exists (read only: nothing is created), else ``None``."""
    try:
        return optuna.load_study(study_name=study.study_name + LEDGER, storage=optuna_private.storage(study))
    except KeyError:
        return None


def is_ledger(study: optuna.Study) -> bool:
    return study.study_name.endswith(LEDGER)


def _key(trial: FrozenTrial) -> tuple[int, int] | None:
    attrs = trial.user_attrs
    finalist, number = attrs.get("finalist"), attrs.get("round")
    if isinstance(finalist, int) and isinstance(number, int):
        return (finalist, number)
    return None


def scheduled(book: optuna.Study) -> dict[tuple[int, int], FrozenTrial]:
    """The live ledger trial of each (finalist, round): the lowest-numbered one not failed."""
    out: dict[tuple[int, int], FrozenTrial] = {}
    for trial in book.get_trials(deepcopy=False):
        key = _key(trial)
        if key is None or trial.state == TrialState.FAIL or key in out:
            continue
        out[key] = trial
    return out


def rounds_done(book: optuna.Study) -> int:
    """The highest round scheduled so far (0: none)."""
    return max((k[1] for k in scheduled(book)), default=0)


def schedule(book: optuna.Study, trials: Sequence[FrozenTrial], rounds: Sequence[int], seed: int) -> int:
    """Queue every (trial, round) not scheduled yet; returns how many were queued. Two workers queueing at
    once may queue one twice: only the lowest-numbered is ever measured (:func:`claim`)."""
    have = scheduled(book)
    queued = 0
    for number in rounds:
        for trial in trials:
            if (trial.number, number) in have:
                continue
            book.enqueue_trial(
                {},
                user_attrs={"finalist": trial.number, "round": number, "seed": round_seed(seed, number)},
            )
            queued += 1
    return queued


def requeue(book: optuna.Study, trial: FrozenTrial) -> None:
    """Queue a rerun again whose worker died (the ledger's part of the heartbeat's callback)."""
    key = _key(trial)
    if key is None:
        return
    live = scheduled(book)
    if key in live and live[key].number != trial.number:
        return
    book.enqueue_trial({}, user_attrs={k: trial.user_attrs[k] for k in ("finalist", "round", "seed")})


def pending(book: optuna.Study) -> tuple[int, int]:
    """(waiting, running) reruns of the ledger."""
    live = scheduled(book).values()
    waiting = sum(1 for t in live if t.state == TrialState.WAITING)
    running = sum(1 for t in live if t.state == TrialState.RUNNING)
    return waiting, running


def claim(book: optuna.Study) -> optuna.Trial | None:
    """Take the next queued rerun (the caller holds :func:`autotune.store.storage.queue_lock`: SQLite does not
    hand an enqueued trial to one caller by itself), or
    ``None`` when none waits. A trial that is not the live one of its (finalist, round), or that Optuna
    made fresh because another worker took the last queued one, is dropped as FAIL."""
    while pending(book)[0]:
        with warnings.catch_warnings():  # the study loop beats the heartbeat itself
            warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used")
            trial = book.ask()
        frozen = next(t for t in book.get_trials(deepcopy=False) if t.number == trial.number)
        key = _key(frozen)
        live = scheduled(book)
        if key is not None and live.get(key) is not None and live[key].number == trial.number:
            return trial
        book.tell(trial, state=TrialState.FAIL)
    return None


def record(book: optuna.Study, trial: optuna.Trial, rerun: Rerun) -> None:
    """Store a rerun on its ledger trial: COMPLETE with its SLO throughput, or PRUNED when it met none."""
    for key, value in rerun.attrs().items():
        trial.set_user_attr(key, value)
    if rerun.slo_throughput is not None:
        book.tell(trial, rerun.slo_throughput)
    else:
        book.tell(trial, state=TrialState.PRUNED)


def reruns(study: optuna.Study) -> dict[int, Finalist]:
    """Every finalist's reruns (one per round: the live ledger trial), by trial number."""
    book = existing_ledger(study)
    if book is None:
        return {}
    found: dict[int, list[Rerun]] = {}
    for (finalist, number), trial in sorted(scheduled(book).items()):
        if trial.state not in (TrialState.COMPLETE, TrialState.PRUNED):
            continue
        attrs = trial.user_attrs
        value = trial.values[0] if trial.state == TrialState.COMPLETE and trial.values else None
        estimate = attrs.get("estimate")
        found.setdefault(finalist, []).append(
            Rerun(
                finalist,
                number,
                value,
                estimate if isinstance(estimate, Mapping) else None,
                attrs.get("cause"),
                str(attrs.get("summary", "")),
            )
        )
    return {n: Finalist(n, tuple(r)) for n, r in found.items()}


# ----------------------------------------------------------------------------------------------
# The race: one more round while the gain is not precise enough
# ----------------------------------------------------------------------------------------------


def rerun_durations(book: optuna.Study) -> dict[int, list[float]]:
    """The seconds each finalist's finished reruns took, by trial number."""
    out: dict[int, list[float]] = {}
    for (finalist, _), trial in scheduled(book).items():
        if trial.state in (TrialState.COMPLETE, TrialState.PRUNED) and trial.duration is not None:
            out.setdefault(finalist, []).append(trial.duration.total_seconds())
    return out


def next_round(study: optuna.Study, loaded: LoadedStudy, book: optuna.Study) -> list[FrozenTrial] | None:
    """Who runs one more round of the race (``finalists.target`` set), or ``None`` when it ends: every
    scheduled round is done, and the pick's gain over the defaults is known less precisely than
    ``finalists.target`` (half its interval, in points), the rounds are fewer than ``finalists.max_rounds``
    and the next round fits ``finalists.max_share`` of the study's time (each rerun as long as its
    config's reruns took). Who runs: the pick, every finalist whose paired interval against the pick does
    not lie wholly below it (the others drop out), and the defaults."""
    spec = loaded.spec.finalists
    done = rounds_done(book)
    waiting, running = pending(book)
    if spec.target is None or not done or waiting or running or done >= max(spec.max_rounds, spec.rounds):
        return None
    table = reruns(study)
    chosen = pick(study, loaded, table)
    base = baseline_trial(study)
    if chosen is None or not chosen.confirmed or base is None or base.number == chosen.trial.number:
        return None
    over = gain(table, chosen.trial, base)
    if over is None or not over.confirmed or (over.hi - over.lo) / 2 <= spec.target:
        return None
    by_number = {t.number: t for t in study.get_trials(deepcopy=False)}
    racing = [chosen.trial]
    for number, finalist in sorted(table.items()):
        if number in (chosen.trial.number, base.number) or number not in by_number or not finalist.met:
            continue
        if finalist.misses > (chosen.finalist.misses if chosen.finalist else 0):
            continue  # missed the SLOs more often than the pick: it cannot become the pick
        against = gain(table, by_number[number], chosen.trial)
        if against is not None and against.confirmed and against.hi < 0:
            continue  # trails the pick beyond its paired interval
        racing.append(by_number[number])
    racing.append(base)
    took = rerun_durations(book)
    stage_s = sum(sum(v) for v in took.values())
    next_s = sum(statistics.fmean(took[t.number]) for t in racing if took.get(t.number))
    study_s = sum(_seconds(t) for t in by_number.values())
    allowance = math.inf if spec.max_share >= 1 else study_s * spec.max_share / (1 - spec.max_share)
    return racing if stage_s + next_s <= allowance else None


@dataclass(frozen=True)
class Narrowing:
    """What more paired rounds would make of the pick's gain: at ±``target`` after ``more`` rounds of
    about ``seconds`` in all (the pick's and the defaults' reruns, as long as theirs took)."""

    half: float
    """Half the gain's interval now (0.061: ±6.1 points)."""
    rounds: int
    more: int
    seconds: float | None
    target: float

    def text(self) -> str:
        """``±6.1 points from 2 paired reruns; 6 more rounds (about 9 min) would give about ±3``."""
        took = f" (about {self.seconds / 60:.0f} min)" if self.seconds else ""
        rounds = plural(self.more, "more round")
        return (
            f"The gain is known to ±{self.half * 100:.1f} points from {plural(self.rounds, 'paired rerun')}; "
            f"{rounds} of the pick and the defaults{took} would "
            f"give about ±{self.target * 100:g} (`autotune verify` runs one round; the race, "
            "finalists.target, runs them where finalists.max_share leaves room)."
        )


NARROW_TARGET = 0.03
"""The precision of the gain :func:`narrowing` aims at when the spec sets no ``finalists.target``."""


def narrowing(study: optuna.Study, loaded: LoadedStudy) -> Narrowing | None:
    """How many more paired rounds would bring the pick's gain to ± ``finalists.target`` (else
    :data:`NARROW_TARGET`; the interval narrows as one over the square root of the rounds), or ``None`` when
    it is that precise already, or not paired."""
    target = loaded.spec.finalists.target or NARROW_TARGET
    table = reruns(study)
    chosen = pick(study, loaded, table)
    base = baseline_trial(study)
    if chosen is None or base is None or base.number == chosen.trial.number:
        return None
    over = gain(table, chosen.trial, base)
    if over is None or not over.confirmed:
        return None
    half = (over.hi - over.lo) / 2
    if half <= target:
        return None
    more = max(1, math.ceil(over.rounds * (half / target) ** 2) - over.rounds)
    book = existing_ledger(study)
    took = rerun_durations(book) if book is not None else {}
    per_round = [statistics.fmean(took[n]) for n in (chosen.trial.number, base.number) if took.get(n)]
    seconds = more * sum(per_round) if len(per_round) == 2 else None
    return Narrowing(half, over.rounds, more, seconds, target)


# ----------------------------------------------------------------------------------------------
# The one rule, and the gain
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pick:
    """The config a study recommends, and how it was chosen."""

    trial: FrozenTrial
    confirmed: bool
    """Chosen by its reruns (True) or by the search alone."""
    finalist: Finalist | None


def pick(
    study: optuna.Study, loaded: LoadedStudy, table: Mapping[int, Finalist] | None = None
) -> Pick | None:
    """The one rule (module docstring); ``table``: :func:`reruns`, when already read."""
    table = reruns(study) if table is None else table
    by_number = {t.number: t for t in study.get_trials(deepcopy=False)}
    sign = 1 if loaded.spec.objectives[0].direction == "maximize" else -1
    measured = [f for f in table.values() if f.throughput is not None and f.trial in by_number]
    if measured and loaded.spec.objectives[0].metric == "slo_throughput":
        best = max(measured, key=lambda f: (-f.misses, sign * (f.throughput or 0.0), -f.trial))
        return Pick(by_number[best.trial], True, best)
    top = leader(study, loaded)
    return Pick(top, False, table.get(top.number)) if top is not None else None


def gain(table: Mapping[int, Finalist], trial: FrozenTrial, baseline: FrozenTrial | None) -> Gain | None:
    """``trial``'s SLO-constrained throughput over ``baseline``'s, paired on the requests both met: on the
    rounds in which both were measured again (:func:`_paired`); without such a round, on the study's stream
    their searches met (their batches compared pair by pair, :func:`pair_half_width`; their own intervals
    combined where either has no batches: unconfirmed, the winner's curse is in it). Zero for the same
    trial; ``None`` when either has no figure."""
    if baseline is None:
        return None
    mine, base = table.get(trial.number), table.get(baseline.number)
    pairs = []
    if mine is not None and base is not None:
        theirs = {r.round: r for r in base.met}
        pairs = [(r, theirs[r.round]) for r in mine.met if r.round in theirs]
    if pairs:
        if trial.number == baseline.number:
            return Gain(0.0, 0.0, 0.0, len(pairs))  # one config against itself: the same figures
        return _paired(pairs)
    a, b = TrialRecord.from_trial(trial), TrialRecord.from_trial(baseline)
    x, y = a.slo_throughput, b.slo_throughput
    if x is None or y is None or y <= 0 or trial.state != TrialState.COMPLETE:
        return None
    if trial.number == baseline.number:
        return Gain(0.0, 0.0, 0.0, 0)
    # Both searches met the study's one stream: paired batch by batch where both have batches.
    paired = pair_half_width(a.estimate, b.estimate)
    half = paired if paired is not None else math.hypot(_half(a.estimate), _half(b.estimate))
    ratio = math.log(x / y)
    return Gain(x / y - 1, math.exp(ratio - half) - 1, math.exp(ratio + half) - 1, 0)


def _paired(pairs: Sequence[tuple[Rerun, Rerun]]) -> Gain:
    """The gain from paired rounds: the mean of their log ratios, with Student's t over one pooled estimate
    of a round's variance. Its readings are pooled by their degrees of freedom: each round's own (its
    batches compared pair by pair, and the brackets: :func:`_pair_variance`, ``BATCHES - 1`` each) and,
    from two rounds on, the spread of the rounds' ratios (one a round, less one), which carries all of a
    round's noise, including what its batches do not see. Four batches make one reading erratic and two or
    three ratios make their spread erratic: pooled, three rounds read the variance on eleven degrees of
    freedom (``benchmarks/racing.py`` measured the intervals this gives: ``benchmarks/RESULTS.md``,
    "Racing the finalists"). The same pair's searches are left out: their batches read the noise of a
    coarser search (the demo's: 8 % where its round read 1.8 %), not a round's."""
    logs = []
    for mine, base in pairs:
        assert mine.slo_throughput and base.slo_throughput
        logs.append(math.log(mine.slo_throughput / base.slo_throughput))
    mean = statistics.fmean(logs)
    rounds = len(logs)
    squares = (BATCHES - 1) * sum(_pair_variance(a.estimate, b.estimate) for a, b in pairs)
    df = (BATCHES - 1) * rounds
    if rounds > 1:
        squares += (rounds - 1) * statistics.variance(logs)
        df += rounds - 1
    half = t_975(df) * math.sqrt(squares / df / rounds)
    return Gain(math.exp(mean) - 1, math.exp(mean - half) - 1, math.exp(mean + half) - 1, rounds)


def _pair_variance(a: Mapping[str, Any] | None, b: Mapping[str, Any] | None) -> float:
    """The variance of log(a / b) for two reruns of one round: the noise their batches did not share,
    plus each one's bracket (the interpolation), as standard deviations."""
    batches_a, batches_b = _batches(a), _batches(b)
    if batches_a and batches_b:
        shared = batch_spread(batches_a, batches_b)
    else:
        shared = math.hypot(_noise(a), _noise(b))
    return shared**2 + (_bracket(a) / NOISE_Z) ** 2 + (_bracket(b) / NOISE_Z) ** 2


def _batches(estimate: Mapping[str, Any] | None) -> list[float]:
    rates = estimate.get("batch_rates") if estimate else None
    if (
        not isinstance(rates, list)
        or len(rates) != BATCHES
        or not all(isinstance(r, int | float) and r > 0 for r in rates)
    ):
        return []
    return [float(r) for r in rates]


def _noise(estimate: Mapping[str, Any] | None) -> float:
    value = estimate.get("noise") if estimate else None
    return float(value) if isinstance(value, int | float) else 0.0


def _bracket(estimate: Mapping[str, Any] | None) -> float:
    """Half the bracket around the estimate, relative to it."""
    if not estimate:
        return 0.0
    bracket, rate = estimate.get("bracket"), estimate.get("rate")
    if not isinstance(bracket, list) or len(bracket) != 2 or not isinstance(rate, int | float) or rate <= 0:
        return 0.0
    lo, hi = bracket
    if not isinstance(lo, int | float) or not isinstance(hi, int | float):
        return 0.0
    return (hi - lo) / 2 / rate


def _half(estimate: Mapping[str, Any] | None) -> float:
    """Half the interval of an estimate's throughput on the log scale (0 when unknown)."""
    if not estimate:
        return 0.0
    value, lo, hi = (estimate.get(k) for k in ("slo_throughput", "slo_throughput_lo", "slo_throughput_hi"))
    if not all(isinstance(v, int | float) and v > 0 for v in (value, lo, hi)):
        return 0.0
    assert isinstance(value, int | float) and isinstance(lo, int | float) and isinstance(hi, int | float)
    return (math.log(hi) - math.log(lo)) / 2


def verdict(pick: Pick, g: Gain | None, baseline: FrozenTrial | None) -> str:
    """The study's answer in one sentence: the pick and its gain (``g``, :func:`gain`), or that nothing
    beat the defaults."""
    if baseline is None:
        return f"trial {pick.trial.number} (vLLM defaults not measured: no gain to state)"
    if pick.trial.number == baseline.number:
        return f"{NO_GAIN}: the defaults themselves measured best (trial {baseline.number})"
    if baseline.state != TrialState.COMPLETE:
        cause = TrialRecord.from_trial(baseline).cause
        why = f"did not run ({cause.value})" if cause is not None else "were not measured"
        return f"trial {pick.trial.number} (vLLM's defaults {why}: no gain to state)"
    if g is None:
        return f"trial {pick.trial.number}"
    if not beats_defaults(pick, g, baseline):
        return f"{NO_GAIN}: best trial {pick.trial.number}, {g.text()}"
    return f"trial {pick.trial.number}, {g.text()}"


NO_GAIN = "no config beats the vLLM defaults beyond the noise"
"""The verdict's words when nothing beat the defaults (every output that states the verdict uses them)."""


def beats_defaults(pick: Pick, g: Gain | None, baseline: FrozenTrial | None) -> bool:
    """Whether the pick beats vLLM's defaults beyond the noise (``g``: its :func:`gain` over them). False
    when the pick is the defaults, or the gain is within the noise or not above 0; True when the gain
    cannot be stated (defaults not measured, or did not run): the pick is then the study's answer."""
    if baseline is not None and pick.trial.number == baseline.number:
        return False
    if baseline is None or baseline.state != TrialState.COMPLETE or g is None:
        return True
    return not (g.within_noise or g.value <= 0)
