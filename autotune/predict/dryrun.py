"""Dry run of a whole search space on the in-process simulator: what the space looks like before GPU hours.

:func:`dry_run` samples configs of a study's search space (seeded, plus the space's defaults) and, for each,
runs the simulated vLLM (:func:`autotune.sim.simulate`) in virtual time: the start outcome and its cause,
the KV-cache capacity, and the SLO-constrained throughput for the spec's workload and SLO. The throughput
comes from the study's own rate search (:func:`autotune.load.ratesearch.find_slo_throughput`) driven by
:class:`SimProber`, which replays the plan a trial's probe sends (the study's request stream, warm-up,
judged and drain requests) through ``simulate()``, replays the client's early stop and clean finish on
the simulated records, and summarises the judged ones with :func:`autotune.load.metrics.summarize`, so
the definitions match the real measurement. Differences from a real trial: no over-saturation check
(queue growth shows up as latency instead), no connection warm-up requests, and outputs always run to
their planned length (``ignore_eos: false`` is not modelled).

Shared prefixes and conversations are replayed as they are sent: a request of a prefix group (or of the
workload's one ``prefix_len`` prefix) shares its group's first tokens with the others; a later turn of a
conversation arrives ``think`` seconds after the turn before it finished, its prompt that turn's prompt and
reply and its own message (token ids standing for them, so the simulator's prefix cache hits the history as
the server's does). The simulator counts tokens as the plan intends them, without a chat template.

The simulated server is read from ``server.command`` (``python -m autotune.sim MODEL --sim-hardware ...``
or ``autotune sim-serve ...``) plus ``server.args`` with the simulator's own parser
(:func:`autotune.sim.flags.parse_flags`). For a spec that launches a real ``vllm serve``, the caller names
a catalog model and a GPU profile instead. Configs that break a known constraint of the space are
reported as rejected, as the tuner rejects them before a launch.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import optuna

from autotune.errors import SpecError
from autotune.flags import FlagValue
from autotune.hardware.catalog import ModelArch, gpu_profile, load_model_arch
from autotune.inputs.loader import LoadedStudy
from autotune.inputs.space import SearchSpace
from autotune.inputs.spec import SloSection, WorkloadSpec
from autotune.load.metrics import summarize
from autotune.load.probe import ProbeOutcome, ProbePlan, ProbeSchedule, judged_records, judged_span
from autotune.load.prom import ServerDelta
from autotune.load.ratesearch import find_slo_throughput
from autotune.load.records import Finished, InFlight, Progress, RequestRecord
from autotune.load.slo import EarlyStop, evaluate
from autotune.sim import SimResult, WorkloadRequest, simulate
from autotune.sim.flags import FlagError, ServeFlags, parse_flags

#: Outcome of a config that breaks one of the space's known constraints (never launched).
REJECTED = "rejected_by_constraint"
#: Outcome of a config that started but met no SLO at any probed rate.
SLO_UNREACHABLE = "slo_unreachable"
OK = "ok"

_SIM_ENTRIES = ("autotune.sim", "sim-serve")


@dataclass(frozen=True)
class SimTarget:
    """The simulated server a dry run launches: base command line, parsed flags and architecture."""

    argv: tuple[str, ...]
    """The simulator's command line without the study's flags (model, ``--sim-*`` options)."""
    flags: ServeFlags
    """The simulator's flags with the study's fixed args."""
    arch: ModelArch
    source: str
    """Where it came from: ``server.command`` or ``--model/--gpu``."""
    space: SearchSpace
    """The study's search space: its argv adds the fixed args and a config's flags."""


@dataclass(frozen=True)
class ConfigResult:
    """One config of the dry run: start outcome, KV capacity and SLO-constrained operating point."""

    flags: Mapping[str, FlagValue]
    outcome: str
    """``ok``, a start-failure cause (``oom``, ``kv_too_small``, ``invalid_config``), ``slo_unreachable``
    or ``rejected_by_constraint``."""
    detail: str = ""
    """The decisive error line or the broken constraint (empty when ok)."""
    kv_tokens: int = 0
    slo_throughput: float | None = None
    """Output tok/s at the best passing rate (``None`` unless ``outcome == "ok"``)."""
    rate: float | None = None
    ttft_p95: float | None = None
    tpot_p95: float | None = None
    probe: int | None = None
    """Which probe of the rate search (from 1) is the operating point: its requests are the workload's
    with seed ``workload.seed * 1000 + probe``."""
    is_default: bool = False

    @property
    def started(self) -> bool:
        """Whether the simulated server started (the SLO may still be unreachable)."""
        return self.outcome in (OK, SLO_UNREACHABLE)


@dataclass(frozen=True)
class DryRun:
    """Every config of a dry run (the default config first) and where the simulator came from."""

    target: SimTarget
    results: tuple[ConfigResult, ...]
    samples: int
    seed: int

    @property
    def default(self) -> ConfigResult:
        """The space's default config."""
        return next(r for r in self.results if r.is_default)

    def ranked(self) -> list[ConfigResult]:
        """Configs meeting the SLO, best SLO-constrained throughput first (ties: lower p95 TTFT)."""
        ok = [r for r in self.results if r.slo_throughput is not None]
        return sorted(ok, key=lambda r: (-(r.slo_throughput or 0.0), r.ttft_p95 or 0.0))

    @property
    def best(self) -> ConfigResult | None:
        """The config with the highest SLO-constrained throughput, if any met the SLO."""
        ranked = self.ranked()
        return ranked[0] if ranked else None

    def outcomes(self) -> Counter[str]:
        """How many configs ended in each outcome."""
        return Counter(r.outcome for r in self.results)

    @property
    def gain(self) -> float | None:
        """Relative gain of the best config's throughput over the default's (``None`` if not defined)."""
        best, default = self.best, self.default
        if best is None or not default.slo_throughput:
            return None
        return (best.slo_throughput or 0.0) / default.slo_throughput - 1.0


# ----------------------------------------------------------------------------------------------
# The simulated server of a spec
# ----------------------------------------------------------------------------------------------


def _sim_argv(command: Sequence[str]) -> list[str] | None:
    """The simulator's own arguments when ``command`` launches it, else ``None``."""
    for i, token in enumerate(command):
        if token in _SIM_ENTRIES:
            return list(command[i + 1 :])
    return None


def resolve_target(loaded: LoadedStudy, *, model: str | None = None, gpu: str | None = None) -> SimTarget:
    """The simulated server for ``loaded``: its own command, or ``model`` on ``gpu`` for a real server.

    ``model``/``gpu`` override what a simulator command names. Raises :class:`SpecError` naming the
    option or field when neither gives a simulator, or when the command line does not parse.
    """
    if gpu is not None:
        try:
            gpu_profile(gpu)
        except SpecError as exc:
            raise SpecError("--gpu", exc.message) from exc
    server = loaded.spec.server
    fixed = loaded.search_space.argv({})
    argv = _sim_argv(server.command)
    source = "server.command"
    if argv is None:
        if model is None or gpu is None:
            missing = "--model" if model is None else "--gpu"
            raise SpecError(
                missing,
                f"server.command {' '.join(server.command)!r} does not launch the simulated server "
                "(python -m autotune.sim): give --model NAME and --gpu PROFILE to dry-run the space "
                "on the simulator",
            )
        argv = [model, "--sim-hardware", gpu]
        source = "--model/--gpu"
    else:
        if model is not None:
            argv = ["--model", model, *argv]
        if gpu is not None:
            argv = [*argv, "--sim-hardware", gpu]
    try:
        flags = parse_flags([*argv, *fixed])
    except FlagError as exc:
        raise SpecError(source, f"the simulator rejects {' '.join(argv + fixed)!r}: {exc.message}") from exc
    try:
        arch = load_model_arch(flags.model)
    except SpecError as exc:
        field = "--model" if model is not None else "server.command"
        raise SpecError(field, exc.message) from exc
    return SimTarget(argv=tuple(argv), flags=flags, arch=arch, source=source, space=loaded.search_space)


def serve_flags(target: SimTarget, config: Mapping[str, FlagValue]) -> ServeFlags:
    """The simulator's flags for one config: the target's command line plus the config's flags."""
    argv = [*target.argv, *target.space.argv(config)]
    try:
        return parse_flags(argv)
    except FlagError as exc:
        raise SpecError("search_space", f"the simulator rejects {dict(config)}: {exc.message}") from exc


# ----------------------------------------------------------------------------------------------
# Sampling
# ----------------------------------------------------------------------------------------------


def sample_configs(space: SearchSpace, n: int, seed: int) -> list[dict[str, FlagValue]]:
    """The space's default config, then ``n`` seeded random configs (duplicates dropped)."""
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=seed))
    configs = [dict(space.defaults())]
    seen = {tuple(sorted(configs[0].items()))}
    for _ in range(n):
        trial = study.ask()
        config = space.suggest(trial)
        key = tuple(sorted(config.items()))
        if key not in seen:
            seen.add(key)
            configs.append(config)
    return configs


# ----------------------------------------------------------------------------------------------
# One config
# ----------------------------------------------------------------------------------------------


class _Workload:
    """The requests and arrivals a trial's probes send (:class:`~autotune.load.probe.ProbeSchedule`, the
    same seeds; lengths only, the simulator needs no tokens)."""

    def __init__(self, loaded: LoadedStudy, workload: WorkloadSpec | None = None) -> None:
        self.loaded = loaded
        spec = loaded.spec
        workload = workload or spec.workload
        if workload.arrival.process == "concurrency":
            raise SpecError(
                "workload.arrival.process",
                "'concurrency' cannot be dry-run (the simulator takes arrival times): "
                "use poisson, gamma or trace",
            )
        self.schedule = ProbeSchedule(workload, spec.slo, spec.measurement, loaded.base_dir, prompts=False)


class SimProber:
    """A :class:`~autotune.load.probe.Probe` on the in-process simulator, in virtual time: the schedule's
    requests (warm-up, judged, drain) through :func:`autotune.sim.simulate`, judged as a trial judges
    them. The early stop and the clean finish (every judged request done) are replayed on the simulated
    records every 0.1 s of virtual time, as the client checks them; ``full_verdicts`` keeps, for each
    probe stopped early, whether its whole run would have met the SLOs (it never should)."""

    def __init__(self, flags: ServeFlags, arch: ModelArch, schedule: ProbeSchedule, seed: int = 0) -> None:
        self.flags = flags
        self.arch = arch
        self.schedule = schedule
        self.seed = seed
        self.count = 0
        self.full_verdicts: list[bool] = []
        """For each probe stopped early: whether the full run would have passed (should be all False)."""

    def __call__(self, rate: float, warmup_s: float = 0.0, window_s: float = 0.0) -> ProbeOutcome:
        self.count += 1
        plan = self.schedule.plan(self.count, rate, warmup_s, window_s)
        requests = sim_requests(plan, self.schedule.workload.dataset.prefix_len)
        sim = simulate(self.flags, self.flags.hardware, self.arch, requests, seed=self.seed)
        records = sim_records(sim)
        slo = self.schedule.slo
        judged = judged_records(records, plan.judged)
        stopped, reason, end = False, None, max((r.end_time for r in records), default=0.0)
        if math.isfinite(rate):
            stopped, reason, end = replay_stop(records, plan, slo)
        if stopped:
            full = summarize(judged, judged_span(judged), slo)
            measurement = self.schedule.measurement
            self.full_verdicts.append(
                evaluate(slo, full, min_tail_samples=measurement.min_tail_samples).passed
            )
            judged = [r for r in judged if r.end_time <= end]
        metrics = summarize(judged, judged_span(judged), slo)
        done = sum(1 for r in records if r.success)
        traffic = self.schedule.traffic(plan, judged)
        return ProbeOutcome(
            rate=rate,
            metrics=metrics,
            requests=len(plan.judged),
            duration_s=end,
            arrival_window_s=plan.window_s,
            capacity=done / sim.duration if math.isinf(rate) and sim.duration > 0 else 0.0,
            early_stopped=stopped,
            stop_reason=reason,
            records=tuple(judged),
            warmup_s=warmup_s,
            stop_term=getattr(reason, "term", None),
            server=_cache_delta(sim),
            ttft_by_turn=traffic.ttft_by_turn,
            ideal_hit_rate=traffic.ideal_hit_rate,
            trace_speed=traffic.trace_speed,
        )


#: The prefix group standing for a workload's one shared ``prefix_len`` prefix (apart from its groups').
LEGACY_PREFIX_GROUP = 1 << 20


def sim_requests(plan: ProbePlan, prefix_len: int = 0) -> list[WorkloadRequest]:
    """A probe's requests as the simulator takes them: lengths and arrivals; a prefix group's (or the one
    ``prefix_len`` prefix's) shared first tokens; for a later turn, the turn it follows and its think
    time, and token ids that repeat that turn's prompt and reply before its own message."""
    out: list[WorkloadRequest] = []
    history: dict[int, tuple[int, ...]] = {}
    """Token ids of each prompt that a later turn follows, and of its reply after it."""
    followed = {r.follows for r in plan.requests if r.follows is not None}
    for i, (r, t) in enumerate(zip(plan.requests, plan.arrivals, strict=True)):
        group, shared = r.group, r.prefix_len
        if group is None and prefix_len:
            group, shared = LEGACY_PREFIX_GROUP, min(prefix_len, r.input_len)
        if r.follows is None and i not in followed:
            out.append(WorkloadRequest(r.input_len, r.output_len, t, prefix_group=group, prefix_len=shared))
            continue
        if r.follows is None:
            head = WorkloadRequest(r.input_len, r.output_len, prefix_group=group, prefix_len=shared)
            prompt = tuple(head.token_ids(i) or _own(i, 0, r.input_len))
        else:
            before = history.pop(r.follows)
            prompt = before + _own(i, 0, r.input_len - len(before))
        if i in followed:  # the reply comes back in the next turn's prompt
            history[i] = prompt + _own(i, r.input_len, r.input_len + r.output_len)
        out.append(
            WorkloadRequest(
                r.input_len, r.output_len, t, prompt_token_ids=prompt, after=r.follows, think=r.think
            )
        )
    return out


def _own(index: int, start: int, end: int) -> tuple[int, ...]:
    """Token ids ``start`` .. ``end - 1`` that only request ``index`` holds (its message, then its reply);
    odd, so apart from the prefix groups' even ids (:meth:`autotune.sim.WorkloadRequest.token_ids`)."""
    return tuple(2 * ((index << 32) | k) + 1 for k in range(start, max(start, end)))


def _cache_delta(sim: SimResult) -> ServerDelta:
    """The simulator's prefix-cache counters as a probe's server delta (the gauges are not sampled)."""
    return ServerDelta(
        preemptions=float(sim.num_preemptions),
        prompt_tokens=None,
        generation_tokens=float(sim.output_tokens),
        kv_usage_peak=sim.peak_kv_usage,
        kv_usage_last=None,
        waiting_peak=None,
        waiting_last=None,
        running_peak=float(sim.peak_running),
        running_last=None,
        prefix_cache_queries=float(sim.prefix_cache_queries),
        prefix_cache_hits=float(sim.prefix_cache_hits),
    )


def replay_stop(
    records: Sequence[RequestRecord], plan: ProbePlan, slo: SloSection
) -> tuple[bool, str | None, float]:  # the reason keeps its type (Stopped names the term)
    """Replay the client's stop check over simulated records: (stopped early, why, when the run ended)."""
    drained = len(plan.requests) > plan.judged.stop
    check = EarlyStop(slo, plan.judged, finish=drained)
    by_end = sorted(records, key=lambda r: r.end_time)
    by_send = sorted(records, key=lambda r: r.send_time)
    last = by_end[-1].end_time if by_end else 0.0
    finished: list[RequestRecord] = []
    active: dict[int, RequestRecord] = {}
    ended = sent = 0
    t = 0.0
    while t < last:
        t += 0.1
        while sent < len(by_send) and by_send[sent].send_time <= t:
            active[by_send[sent].index] = by_send[sent]
            sent += 1
        while ended < len(by_end) and by_end[ended].end_time <= t:
            finished.append(by_end[ended])
            active.pop(by_end[ended].index, None)
            ended += 1
        flying = [
            InFlight(
                r.send_time, r.chunk_times[0] if r.chunk_times and r.chunk_times[0] <= t else None, r.index
            )
            for r in active.values()
        ]
        why = check(Progress(t, len(plan.requests), sent, finished, flying))
        if why is not None:
            return not isinstance(why, Finished), why, t
    return False, None, last


def sim_records(sim: SimResult) -> list[RequestRecord]:
    """Client-side records of a simulated run: each request at its arrival, its chunks at the engine's
    emissions; failures (longer than max_model_len) at their arrival, without chunks."""
    records = []
    for r in sim.requests:
        chunks = [r.arrival + r.ttft]
        for gap in r.itls:
            chunks.append(chunks[-1] + gap)
        records.append(
            RequestRecord(
                index=r.index,
                send_time=r.arrival,
                chunk_times=tuple(chunks),
                output_tokens=r.output_len,
                prompt_tokens=r.prompt_len,
                input_len=r.prompt_len,
                output_len=r.output_len,
                success=True,
                end_time=r.arrival + r.e2el,
            )
        )
    done = {r.index for r in sim.requests}
    for index in sim.rejected:
        if index not in done:
            records.append(
                RequestRecord(
                    index=index,
                    send_time=0.0,
                    chunk_times=(),
                    output_tokens=None,
                    prompt_tokens=None,
                    input_len=0,
                    output_len=0,
                    success=False,
                    error="rejected: longer than max_model_len (or after a turn that was)",
                    end_time=0.0,
                )
            )
    return records


def evaluate_config(
    target: SimTarget,
    loaded: LoadedStudy,
    config: Mapping[str, FlagValue],
    *,
    seed: int = 0,
    workload: _Workload | None = None,
) -> ConfigResult:
    """Start the simulator with ``config`` and search its SLO-constrained throughput in virtual time.

    ``seed`` drives the startup's OOM randomness unless the command sets ``--sim-seed``.
    """
    space = loaded.search_space
    is_default = dict(config) == dict(space.defaults())
    broken = () if is_default else space.violations(config)  # the defaults pass no tuned flag
    if broken:
        return ConfigResult(config, REJECTED, "; ".join(str(v) for v in broken), is_default=is_default)
    flags = serve_flags(target, {} if is_default else config)
    sim_seed = flags.seed if flags.seed is not None else seed
    start = simulate(flags, flags.hardware, target.arch, [], seed=sim_seed)
    if not start.ok:
        assert start.failure is not None
        return ConfigResult(
            config, str(start.failure), start.startup.error, start.kv_tokens, is_default=is_default
        )
    workload = workload or _Workload(loaded)
    spec = loaded.spec
    result = find_slo_throughput(
        SimProber(flags, target.arch, workload.schedule, sim_seed), spec.slo, spec.measurement
    )
    if result.slo_unreachable or result.metrics is None:
        last = result.probes[-1].why if result.probes else ""
        return ConfigResult(config, SLO_UNREACHABLE, last, start.kv_tokens, is_default=is_default)
    operating = result.operating
    probe = next(i for i, p in enumerate(result.probes, 1) if p is operating)
    return ConfigResult(
        config,
        OK,
        "",
        start.kv_tokens,
        slo_throughput=result.slo_throughput,
        rate=result.rate,
        ttft_p95=result.value_at("ttft", "p95"),
        tpot_p95=result.value_at("tpot", "p95"),
        probe=probe,
        is_default=is_default,
    )


def dry_run(
    loaded: LoadedStudy,
    *,
    samples: int = 200,
    seed: int = 0,
    model: str | None = None,
    gpu: str | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> DryRun:
    """Dry-run ``samples`` seeded configs of the study's space plus its defaults on the simulator.

    Raises :class:`SpecError` (exit 2) for bad input: ``samples`` < 1, no simulator, a workload the
    simulator cannot replay.
    """
    if samples < 1:
        raise SpecError("--samples", f"must be >= 1, got {samples}")
    target = resolve_target(loaded, model=model, gpu=gpu)
    space = loaded.search_space
    workload = _Workload(loaded)
    configs = sample_configs(space, samples, seed)
    results = []
    for i, config in enumerate(configs):
        results.append(evaluate_config(target, loaded, config, seed=seed, workload=workload))
        if on_progress is not None:
            on_progress(i + 1, len(configs))
    return DryRun(target=target, results=tuple(results), samples=samples, seed=seed)


# ----------------------------------------------------------------------------------------------
# Rendering
# ----------------------------------------------------------------------------------------------


def _flags_text(flags: Mapping[str, FlagValue], defaults: Mapping[str, FlagValue]) -> str:
    changed = [f"{k}={v}" for k, v in flags.items() if defaults.get(k) != v]
    return ", ".join(changed) if changed else "(defaults)"


def _ms(value: float | None) -> str:
    return "-" if value is None or math.isnan(value) else f"{value * 1e3:,.1f}"


def render(dry: DryRun, loaded: LoadedStudy, *, top: int = 10) -> str:
    """The dry run as text: start failures by cause, the top configs, the default and the gain."""
    defaults = loaded.space.defaults()
    flags = dry.target.flags
    lines = [
        f"dry run of {loaded.spec.study.name!r}: {dry.target.arch.name} on {flags.hardware.name} "
        f"(simulator from {dry.target.source}), {len(dry.results)} configs "
        f"({dry.samples} sampled with seed {dry.seed}, duplicates dropped, plus the defaults)",
        f"SLO {', '.join(str(t) for t in loaded.spec.slo.terms)}; throughput = output tok/s at the "
        "highest passing arrival rate (virtual time)",
        "",
    ]
    counts = dry.outcomes()
    total = len(dry.results)
    lines.append("outcomes:")
    for outcome, n in sorted(counts.items(), key=lambda kv: (kv[0] != OK, -kv[1])):
        lines.append(f"  {outcome:<24} {n:>5}  ({n / total:.0%})")
    failures = [r for r in dry.results if not r.started and r.outcome != OK]
    if failures:
        lines.append("")
        lines.append("why configs fail to start or are rejected (one example each):")
        shown: set[tuple[str, str]] = set()
        for r in failures:
            example = r.detail.split(". ")[0][:160]
            key = (r.outcome, example.split(":")[0])
            if key in shown:
                continue
            shown.add(key)
            lines.append(f"  {r.outcome}: {_flags_text(r.flags, defaults)}")
            lines.append(f"      {example}")
    lines.append("")
    ranked = dry.ranked()
    lines.append(f"top {min(top, len(ranked))} configs:")
    header = _HEADER
    lines.append(header)
    for i, r in enumerate(ranked[:top], 1):
        lines.append(_row(str(i), r, defaults))
    lines.append("")
    d = dry.default
    if d.slo_throughput is not None:
        lines.append("default config:")
        lines.append(header)
        lines.append(_row("def", d, defaults))
    else:
        lines.append(f"default config: {d.outcome}" + (f" ({d.detail[:160]})" if d.detail else ""))
    gain = dry.gain
    best = dry.best
    if best is None:
        lines.append("no config meets the SLO: loosen the SLO or widen the space")
    elif gain is None:
        lines.append(f"gain of the best over the default: n/a (best {best.slo_throughput:,.0f} tok/s)")
    else:
        lines.append(
            f"gain of the best over the default: {gain:+.1%} "
            f"({best.slo_throughput:,.0f} vs {d.slo_throughput:,.0f} tok/s)"
        )
    return "\n".join(lines) + "\n"


_HEADER = (
    f"  {'#':>3} {'tok/s':>9} {'req/s':>7} {'p95 TTFT ms':>12} {'p95 TPOT ms':>12} {'KV tokens':>10}  flags"
)


def _row(label: str, r: ConfigResult, defaults: Mapping[str, FlagValue]) -> str:
    rate = "inf" if r.rate is not None and math.isinf(r.rate) else f"{r.rate or 0.0:.2f}"
    return (
        f"  {label:>3} {r.slo_throughput or 0.0:>9,.0f} {rate:>7} {_ms(r.ttft_p95):>12} "
        f"{_ms(r.tpot_p95):>12} {r.kv_tokens:>10,}  {_flags_text(r.flags, defaults)}"
    )
