"""The report's closing sections: the run's facts (model, GPU, vLLM version, space, workload, SLOs,
budget, sampler, surrogate, finalists), where its records are, and how it was measured."""

from __future__ import annotations

from autotune.predict.surrogate.propose import describe, track_record
from autotune.results.htmlreport.context import ReportContext
from autotune.results.htmlreport.fmt import dashed, duration_text, esc
from autotune.results.status import records
from autotune.store.storage import redact_url
from autotune.study.finalists import left_out
from autotune.units import format_figure


def facts_section(ctx: ReportContext) -> str:
    """The run's facts as a table, beside where its records are."""
    rows = "".join(f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>" for k, v in _facts(ctx))
    rec = "".join(
        f"<tr><th>{esc(k)}</th><td><code>{esc(v)}</code></td></tr>" for k, v in records(ctx.loaded).items()
    )
    return (
        '<section id="facts"><h2>The run</h2><div class="grid2">'
        f"<table>{rows}</table><div><h3>Where the records are</h3><table>{rec}</table>"
        f'<p class="small">Browse the study interactively: <code>optuna-dashboard '
        f"{esc(redact_url(ctx.loaded.storage_url))}</code></p></div></div></section>"
    )


def _facts(ctx: ReportContext) -> list[tuple[str, str]]:
    """(name, text) of each fact of the run."""
    spec = ctx.spec
    versions = sorted({r.server_version for r in ctx.rows if r.server_version})
    arrival = spec.workload.arrival.process
    budget = f"{spec.budget.launches} launches" + (
        f", wall time {duration_text(spec.budget.wall_time)}" if spec.budget.wall_time else ""
    )
    launched = sum(1 for r in ctx.rows if r.launched)
    measurement = spec.measurement
    return [
        ("spec", ctx.spec_shown),
        ("model", spec.server.model),
        ("server command", " ".join(spec.server.command)),
        ("GPU", _gpu(ctx)),
        ("vLLM version (the server's /version)", ", ".join(versions) or "not recorded"),
        ("search space", f"{ctx.loaded.space_path.name}: {', '.join(dashed(p) for p in ctx.params)}"),
        (
            "workload",
            f"{spec.workload.endpoint} endpoint, {_dataset(ctx)}, {arrival} arrivals, "
            f"seed {spec.workload.seed}",
        ),
        (
            "SLO",
            f"{', '.join(str(t) for t in spec.slo.terms)}, "
            f"error budget {format_figure(spec.slo.error_budget)}",
        ),
        ("objectives", ", ".join(f"{o.direction} {o.metric}" for o in spec.objectives)),
        ("budget", f"{budget}; used {launched} launches"),
        ("wall time", duration_text(ctx.wall_s)),
        (
            "sampler",
            f"{spec.sampler.name}, seed {spec.sampler.seed}, {spec.sampler.startup_trials} startup trials",
        ),
        ("surrogate", _surrogate(ctx)),
        (
            "vLLM's defaults against the space",
            "; ".join(ctx.default_warnings)
            if ctx.default_warnings
            else "the defaults' trial ran with what the space declares (or declares nothing)",
        ),
        (
            "measurement",
            f"probes of {format_figure(measurement.probe_duration, 's')}, at least "
            f"{measurement.min_requests} requests, at most {measurement.max_probes} per launch, "
            f"{measurement.client} client",
        ),
        ("finalists", _finalists(ctx)),
    ]


def _gpu(ctx: ReportContext) -> str:
    """The devices the trials saw through NVML, and the memory model's profile if it names one."""
    model = ctx.spec.memory_model
    profile = model.gpu if model is not None and model.gpu != "auto" else None
    devices = sorted({r.gpu for r in ctx.rows if r.gpu})
    if devices:
        return ", ".join(devices) + (f" (memory model's profile: {profile})" if profile else "")
    if profile:
        return f"{profile} (the memory model's profile; no trial saw a device through NVML)"
    return "not recorded (no trial saw a device through NVML, no memory model)"


def _dataset(ctx: ReportContext) -> str:
    """The workload's prompts: synthetic lengths, or the dataset's kind and path."""
    dataset = ctx.spec.workload.dataset
    if dataset.kind != "synthetic":
        return f"{dataset.kind}: {dataset.path}"
    data = f"synthetic: input {_dist(dataset.input_len)}, output {_dist(dataset.output_len)} tokens"
    if dataset.prefix_len:
        data += f", shared prefix {dataset.prefix_len}"
    return data


def _dist(dist: object) -> str:
    """A length distribution: ``512``, ``uniform 10–20``, ``normal mean 200 std 50``."""
    kind = getattr(dist, "dist", "")
    if kind == "fixed":
        return str(getattr(dist, "value", ""))
    low, high = getattr(dist, "low", None), getattr(dist, "high", None)
    clip = f" {low if low is not None else ''}–{high if high is not None else ''}" if (low or high) else ""
    if kind == "uniform":
        return f"uniform{clip}"
    return f"{kind} mean {getattr(dist, 'mean', '')} std {getattr(dist, 'std', '')}{clip}"


def _finalists(ctx: ReportContext) -> str:
    """The finalists' stage as configured, and the ties it left out."""
    spec = ctx.spec.finalists
    if not spec.count:
        return "off"
    text = (
        f"{spec.count} best and the defaults measured again {spec.rounds}× with "
        f"{format_figure(spec.probe_scale)}× longer probes"
    )
    found = left_out(ctx.study, ctx.loaded)
    return f"{text}. {found.left_out_text(ctx.loaded)}" if found is not None else text


def _surrogate(ctx: ReportContext) -> str:
    """How the surrogate's proposals fared, or whether it was on at all."""
    said = describe(track_record(ctx.study.get_trials(deepcopy=False)))
    if said is not None:
        return said
    on = ctx.spec.sampler.surrogate and ctx.spec.memory_model is not None
    return "on, no proposal measured" if on else "off (no memory model, or sampler.surrogate: false)"


def method_section(ctx: ReportContext) -> str:
    """How it was measured: the launches, the SLO-constrained throughput, failures, the pick, the
    importances."""
    return (
        '<section id="method"><h2>How it was measured</h2><ul class="small">'
        "<li>Each trial launched a fresh <code>vllm serve</code> with the sampled flags and drove it "
        "with "
        "the workload above: streaming requests, a timestamp per chunk, TTFT, TPOT, ITL and E2EL as "
        "<code>vllm bench serve</code> defines them.</li>"
        "<li>SLO-constrained throughput: every trial met the same stream of requests at the same "
        "rate (common random numbers); each probe warmed the server up for one request lifetime, "
        "judged a window of several lifetimes and kept the load on until its judged requests ended. "
        "The SLO boundary is interpolated between the probes around it, with an interval that holds "
        "that bracket and the probes' sampling noise; the output tokens per second at that rate is "
        "the figure. The latencies shown are those of the highest probe that met every term.</li>"
        "<li>Crashes, OOMs and configs that could not start are recorded with their cause (pruned), "
        "never as a zero. Configs ruled out before a launch spend no budget.</li>"
        "<li>The chosen config is the recommendation: the leader, the configs the search could not "
        "tell from it, and the defaults were measured again on a fresh stream shared by all; the "
        "pick is the finalist with the best mean over those reruns, and its gain over the defaults "
        "comes from them, paired round by round, with its interval (within the noise when the "
        "interval holds zero).</li>"
        "<li>Importances: "
        f"{esc(ctx.importances.method or 'Optuna PED-ANOVA, signed by Spearman rank correlation')}; "
        f"{ctx.importances.trials} measured trials.</li>"
        "</ul></section>"
    )
