"""Dry run of a whole search space on the in-process simulator: what the space looks like before GPU hours.

:func:`dry_run` samples configs of a study's search space (seeded, plus the space's defaults) and, for each,
runs the simulated vLLM (:func:`autotune.sim.simulate`) in virtual time: the start outcome and its cause,
the KV-cache capacity, and the SLO-constrained throughput for the spec's workload and SLO. The throughput
comes from the study's own rate search (:func:`autotune.load.ratesearch.find_slo_throughput`) driven by a
probe that replays the same requests and arrivals a trial's probes send (same seeds) through
``simulate()``, and summarises them with :func:`autotune.load.metrics.summarize`, so the definitions
match the real measurement. Differences from a real trial: no early stop (a failing probe runs to the
end, the verdict is the same), no over-saturation check (queue growth shows up as TTFT instead), no
warm-up requests, and outputs always run to their planned length (``ignore_eos: false`` is not modelled).

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
from dataclasses import dataclass, replace

import optuna

from autotune.catalog import ModelArch, gpu_profile, load_model_arch
from autotune.errors import SpecError
from autotune.load.metrics import Dist, summarize
from autotune.load.probe import ProbeOutcome, ProbeSchedule, probe_seed
from autotune.load.ratesearch import find_slo_throughput
from autotune.load.records import RequestRecord
from autotune.load.workload import RequestSpec
from autotune.loader import LoadedStudy
from autotune.sim import SimResult, WorkloadRequest, simulate
from autotune.sim.flags import FlagError, ServeFlags, parse_flags
from autotune.space import SearchSpace
from autotune.spec import FlagValue

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
    same seeds), with the requests cached across configs."""

    def __init__(self, loaded: LoadedStudy) -> None:
        self.loaded = loaded
        spec = loaded.spec
        if spec.workload.arrival.process == "concurrency":
            raise SpecError(
                "workload.arrival.process",
                "'concurrency' cannot be dry-run (the simulator takes arrival times): "
                "use poisson, gamma or trace",
            )
        self.schedule = ProbeSchedule(spec.workload, spec.slo, spec.measurement, loaded.base_dir)
        self._requests: dict[tuple[int, int], list[RequestSpec]] = {}

    def probe(self, number: int, rate: float) -> tuple[list[WorkloadRequest], list[RequestSpec]]:
        """The ``number``-th probe (from 1) at ``rate``: as the simulator and as the client sees it."""
        n = self.schedule.count(rate)
        seed = probe_seed(self.loaded.spec.workload.seed, number)
        key = (n, seed)
        if key not in self._requests:
            self._requests[key] = self.schedule.requests(n, seed)
        requests = self._requests[key]
        arrivals = self.schedule.arrivals(rate, n, seed)
        sim = [WorkloadRequest(r.input_len, r.output_len, t) for r, t in zip(requests, arrivals, strict=True)]
        return sim, requests


def _records(sim: SimResult) -> list[RequestRecord]:
    """Client-side records of a simulated run: chunk times from TTFT, TPOT and E2EL; failures last."""
    records = []
    for i, r in enumerate(sim.requests):
        chunks = (*(r.ttft + k * r.tpot for k in range(r.output_len - 1)), r.e2el)
        records.append(
            RequestRecord(
                index=i,
                send_time=0.0,
                chunk_times=chunks,
                output_tokens=r.output_len,
                prompt_tokens=r.prompt_len,
                input_len=r.prompt_len,
                output_len=r.output_len,
                success=True,
                end_time=r.e2el,
            )
        )
    for j in range(sim.failed):
        records.append(
            RequestRecord(
                index=len(records) + j,
                send_time=0.0,
                chunk_times=(),
                output_tokens=None,
                prompt_tokens=None,
                input_len=0,
                output_len=0,
                success=False,
                error="rejected: longer than max_model_len",
            )
        )
    return records


def _sim_probe(
    flags: ServeFlags, arch: ModelArch, workload: _Workload, seed: int
) -> Callable[[float], ProbeOutcome]:
    count = [0]

    def probe(rate: float) -> ProbeOutcome:
        count[0] += 1
        requests, _ = workload.probe(count[0], rate)
        sim = simulate(flags, flags.hardware, arch, requests, seed=seed)
        metrics = summarize(_records(sim), sim.duration, workload.loaded.spec.slo)
        metrics = replace(metrics, itl=Dist.of(sim.itl))  # the engine's pooled gaps, exactly
        done = len(sim.requests)
        return ProbeOutcome(
            rate=rate,
            metrics=metrics,
            requests=len(requests),
            duration_s=sim.duration,
            arrival_window_s=max((r.arrival for r in requests), default=0.0),
            capacity=done / sim.duration if sim.duration > 0 else 0.0,
        )

    return probe


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
    broken = space.violations(config)
    if broken:
        return ConfigResult(config, REJECTED, "; ".join(str(v) for v in broken), is_default=is_default)
    flags = serve_flags(target, config)
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
        _sim_probe(flags, target.arch, workload, sim_seed), spec.slo, spec.measurement
    )
    if result.slo_unreachable or result.metrics is None:
        last = result.probes[-1].why if result.probes else ""
        return ConfigResult(config, SLO_UNREACHABLE, last, start.kv_tokens, is_default=is_default)
    m = result.metrics
    probe = next(i for i, p in enumerate(result.probes, 1) if p.outcome.metrics is m)
    return ConfigResult(
        config,
        OK,
        "",
        start.kv_tokens,
        slo_throughput=m.output_throughput,
        rate=result.rate,
        ttft_p95=m.ttft.p95,
        tpot_p95=m.tpot.p95,
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
