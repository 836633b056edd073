"""The `autotune` command line: the only module that prints, exits or reads the environment."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, TypeVar

import typer

from autotune.errors import AutotuneError
from autotune.units import format_duration

if TYPE_CHECKING:
    import optuna

    from autotune.events import Event
    from autotune.loader import LoadedStudy

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Find the best `vllm serve` flags for a model, a GPU and a traffic pattern.",
    context_settings={"help_option_names": ["-h", "--help"]},
)

_T = TypeVar("_T")

SpecArg = Annotated[Path, typer.Argument(help="Study spec (YAML), e.g. studies/demo.yaml.")]


def _fail(ctx: typer.Context, exc: AutotuneError) -> None:
    if ctx.find_root().params.get("debug"):
        traceback.print_exception(exc)
    typer.echo(f"error: {exc}", err=True)
    raise typer.Exit(exc.exit_code)


def _guard(ctx: typer.Context, fn: Callable[[], _T]) -> _T:
    try:
        return fn()
    except AutotuneError as exc:
        _fail(ctx, exc)
        raise AssertionError("unreachable") from exc


def _quiet_libraries() -> None:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)


@app.callback()
def _root(
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks on errors.")] = False,
) -> None:
    """Find the best `vllm serve` flags for a model, a GPU and a traffic pattern."""


StorageOpt = Annotated[
    str | None,
    typer.Option(
        "--storage",
        envvar="AUTOTUNE_STORAGE",
        help="Storage URL replacing study.storage (sqlite:///, journal:///, postgresql://...).",
        show_envvar=True,
    ),
]


def _load(ctx: typer.Context, spec: Path, storage: str | None) -> LoadedStudy:
    from autotune.loader import load_study

    return _guard(ctx, lambda: load_study(spec, storage=storage))


@app.command()
def validate(ctx: typer.Context, spec: SpecArg, storage: StorageOpt = None) -> None:
    """Check a study spec, its search space and what a run needs here (the server command, the storage,
    the study folder) without launching anything or writing anything."""
    from autotune.loader import preflight
    from autotune.storage import redact_url

    loaded = _load(ctx, spec, storage)
    _guard(ctx, lambda: preflight(loaded, os.environ))
    space = loaded.search_space
    bad = space.violations(space.defaults())
    budget = loaded.spec.budget
    typer.echo(
        f"ok: study {loaded.spec.study.name!r}, {len(loaded.space.params)} parameters "
        f"({', '.join(loaded.space.params)}), {len(loaded.space.constraints)} constraints, "
        f"SLO {', '.join(str(t) for t in loaded.spec.slo.terms)}, budget {budget.launches} launches"
    )
    typer.echo(f"storage: {redact_url(loaded.storage_url)}")
    for impossible in space.impossible:
        typer.echo(f"note: {impossible}")
    if bad:
        typer.echo("warning: the default config breaks " + "; ".join(str(v) for v in bad), err=True)


def _line_printer() -> Callable[[Event], None]:
    """Progress lines, cut to the terminal's width on a terminal."""
    width = shutil.get_terminal_size().columns if sys.stdout.isatty() else 0

    def show(event: Event) -> None:
        where = f"trial {event.trial}" if event.trial is not None else "study"
        best = f" | best {event.best}" if event.best else ""
        line = (
            f"[{format_duration(event.elapsed_s):>6}] {event.launches}/{event.budget} launched | "
            f"{where}: {event.text}{best}"
        )
        if width and len(line) > width:
            line = line[: width - 1] + "…"
        typer.echo(line)

    return show


GpusOpt = Annotated[
    str | None,
    typer.Option(
        "--gpus",
        help="Run one worker per GPU set on this host: 'all' or indices/UUIDs, e.g. 0,1,2,3.",
    ),
]
PerTrialOpt = Annotated[
    int, typer.Option("--gpus-per-trial", help="GPUs of each trial (each worker's set), with --gpus.")
]
LabelOpt = Annotated[str, typer.Option("--worker-label", hidden=True)]
NoSummaryOpt = Annotated[bool, typer.Option("--no-summary", hidden=True)]


@app.command()
def tune(
    ctx: typer.Context,
    spec: SpecArg,
    storage: StorageOpt = None,
    gpus: GpusOpt = None,
    gpus_per_trial: PerTrialOpt = 1,
    worker_label: LabelOpt = "",
    no_summary: NoSummaryOpt = False,
) -> None:
    """Run (or resume) the study until its budget is spent, then print the Pareto-best flags.

    Before it ends, the best configs and vLLM's defaults are measured again (finalists.*). With --gpus,
    one worker per GPU set shares the study. SIGTERM, SIGINT or SIGHUP stop the trial's server, give the
    trial back and exit with 128 + the signal's number; rerun the same command to resume."""
    if gpus is not None:
        _fleet(ctx, spec, storage, gpus, gpus_per_trial)
        return
    _run_with_signals(ctx, spec, storage, verify=False, label=worker_label, summary=not no_summary)


@app.command()
def verify(ctx: typer.Context, spec: SpecArg, storage: StorageOpt = None) -> None:
    """Measure the study's finalists and vLLM's defaults once more (longer probes, fresh prompts), then
    print the front ranked by every measurement so far."""
    _run_with_signals(ctx, spec, storage, verify=True, label="", summary=True)


def _fleet(ctx: typer.Context, spec: Path, storage: str | None, gpus: str, per_trial: int) -> None:
    from autotune.fleet import check_parallelism, gpu_sets, run_fleet, worker_argv
    from autotune.gpu import device_count
    from autotune.loader import preflight

    loaded = _load(ctx, spec, storage)
    _guard(ctx, lambda: preflight(loaded, os.environ))
    sets = _guard(ctx, lambda: gpu_sets(gpus, per_trial, device_count))
    _guard(ctx, lambda: check_parallelism(loaded, per_trial))
    typer.echo(f"{len(sets)} workers on GPU sets {', '.join(','.join(s) for s in sets)}")
    code = run_fleet(worker_argv(str(spec), storage), sets, typer.echo)
    if code > 128:
        typer.echo(
            f"interrupted by {signal.Signals(code - 128).name}: every worker stopped its server; rerun "
            f"`autotune tune {spec} --gpus {gpus}` to resume",
            err=True,
        )
    if code:
        raise typer.Exit(code)
    _print_summary(ctx, spec, storage)


def _print_summary(ctx: typer.Context, spec: Path, storage: str | None) -> None:
    from autotune.study import open_study

    loaded = _load(ctx, spec, storage)
    study = _guard(ctx, lambda: open_study(loaded, create=False, heartbeat=False))
    _summary(spec, study, loaded)


def _summary(spec: Path, study: optuna.Study, loaded: LoadedStudy) -> None:
    from optuna.trial import TrialState

    from autotune.export import pareto_front
    from autotune.report import best_table

    running = len(study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)))
    if running:  # the worker that ends the study prints the table
        typer.echo(
            f"\nFinished here; {running} trials still run elsewhere: `autotune best {spec}` once they end."
        )
        return
    typer.echo("")
    typer.echo(best_table(study, loaded))
    if pareto_front(study):
        typer.echo(f"\nExport the chosen flags: autotune export {spec} --format vllm-yaml -o best.yaml")
    else:
        typer.echo(
            "\nNothing to export: no trial met the SLOs. Read the causes above; then loosen slo.terms, "
            "widen the search space or raise budget.launches, and rerun to continue the study."
        )


def _run_with_signals(
    ctx: typer.Context, spec: Path, storage: str | None, *, verify: bool, label: str, summary: bool
) -> None:
    from autotune.errors import Interrupted
    from autotune.events import EventLog
    from autotune.gpu import visible_devices
    from autotune.interrupts import stop_on_signals
    from autotune.loader import preflight, resolve_access
    from autotune.trial import run_study, verify_study

    _quiet_libraries()
    loaded = _load(ctx, spec, storage)
    _guard(ctx, lambda: preflight(loaded, os.environ))
    access = resolve_access(loaded, os.environ)  # checked by preflight
    gpus = visible_devices(os.environ.get("CUDA_VISIBLE_DEVICES"))
    log = EventLog(loaded.workdir / "events.jsonl")
    show = _line_printer()

    def on_event(event: Event) -> None:
        show(event)
        log(event)

    run = verify_study if verify else run_study
    command = "verify" if verify else "tune"
    try:
        with stop_on_signals():
            study = _guard(ctx, lambda: run(loaded, on_event=on_event, gpus=gpus, label=label, access=access))
    except Interrupted as sig:
        typer.echo(
            f"interrupted by {sig.name}: the server was stopped; rerun `autotune {command} {spec}` to resume",
            err=True,
        )
        raise typer.Exit(sig.exit_code) from None
    if summary:
        _summary(spec, study, loaded)


@app.command()
def best(ctx: typer.Context, spec: SpecArg, storage: StorageOpt = None) -> None:
    """Print the Pareto front (flags, SLO-constrained throughput, latencies, gain over the defaults)."""
    from autotune.report import best_table
    from autotune.study import open_study

    _quiet_libraries()
    loaded = _load(ctx, spec, storage)
    study = _guard(ctx, lambda: open_study(loaded, create=False, heartbeat=False))
    typer.echo(best_table(study, loaded))


@app.command()
def export(
    ctx: typer.Context,
    spec: SpecArg,
    fmt: Annotated[
        str, typer.Option("--format", "-f", help="vllm-yaml (for `vllm serve --config`), args or json.")
    ] = "vllm-yaml",
    trial: Annotated[int | None, typer.Option("--trial", help="Export this trial number.")] = None,
    policy: Annotated[
        str | None,
        typer.Option("--policy", help="Pick from the Pareto front: max-throughput or min-latency."),
    ] = None,
    output: Annotated[Path | None, typer.Option("--output", "-o", help="Write here, not stdout.")] = None,
    storage: StorageOpt = None,
) -> None:
    """Export a chosen config as `vllm serve --config` YAML, a command line, or JSON."""
    from autotune.errors import SpecError
    from autotune.export import Format, Policy, choose, render
    from autotune.study import open_study

    _quiet_libraries()
    formats = [f.value for f in Format]
    policies = [p.value for p in Policy]
    if fmt not in formats:
        _fail(ctx, SpecError("--format", f"unknown format {fmt!r}: use one of {', '.join(formats)}"))
    if policy is not None and policy not in policies:
        _fail(ctx, SpecError("--policy", f"unknown policy {policy!r}: use one of {', '.join(policies)}"))
    if policy is not None and trial is not None:
        _fail(ctx, SpecError("--policy", "give either --trial or --policy, not both"))
    loaded = _load(ctx, spec, storage)
    study = _guard(ctx, lambda: open_study(loaded, create=False, heartbeat=False))
    chosen = Policy(policy) if policy else None
    choice = _guard(ctx, lambda: choose(study, loaded, trial=trial, policy=chosen))
    text = render(choice, loaded, Format(fmt))
    if output is None:
        typer.echo(text, nl=False)
        return
    try:
        output.write_text(text, encoding="utf-8")
    except OSError as exc:
        _fail(ctx, SpecError("--output", f"cannot write {str(output)!r}: {exc.strerror}"))
    typer.echo(f"wrote {output} (trial {choice.trial.number})", err=True)


@app.command(
    "sim-serve",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    add_help_option=False,
)
def sim_serve(ctx: typer.Context) -> None:
    """Run the simulated vLLM server (accepts `vllm serve`'s command line; see --help)."""
    from autotune.sim.cli import main as sim_main

    raise typer.Exit(sim_main(list(ctx.args)))


@app.command()
def kv(
    ctx: typer.Context,
    model: Annotated[str, typer.Argument(help="Catalog model (Llama-3.1-70B) or a config.json directory.")],
    gpu: Annotated[
        str | None, typer.Option("--gpu", help="GPU profile (H100-80GB, ...); default: the local GPU (NVML).")
    ] = None,
    gpu_memory_utilization: Annotated[float, typer.Option("--gpu-memory-utilization")] = 0.9,
    kv_cache_dtype: Annotated[str, typer.Option("--kv-cache-dtype")] = "auto",
    tensor_parallel_size: Annotated[int, typer.Option("--tensor-parallel-size", "-tp")] = 1,
    max_model_len: Annotated[int | None, typer.Option("--max-model-len")] = None,
) -> None:
    """Print KV bytes per token, weights, KV capacity, max concurrency and where a config stops fitting."""
    from autotune.catalog import GpuProfile
    from autotune.gpu import device_profile, open_device
    from autotune.kvreport import kv_report

    device: str | GpuProfile | None = gpu if gpu is not None else device_profile(open_device())
    text = _guard(
        ctx,
        lambda: kv_report(
            model,
            gpu=device,
            gpu_memory_utilization=gpu_memory_utilization,
            kv_cache_dtype=kv_cache_dtype,
            tensor_parallel_size=tensor_parallel_size,
            max_model_len=max_model_len,
        ),
    )
    typer.echo(text, nl=False)


@app.command()
def simulate(
    ctx: typer.Context,
    spec: SpecArg,
    samples: Annotated[
        int, typer.Option("--samples", "-n", help="Random configs to sample (plus the defaults).")
    ] = 200,
    seed: Annotated[
        int, typer.Option("--seed", help="Seed of the sampling and of the simulated starts.")
    ] = 0,
    model: Annotated[
        str | None,
        typer.Option("--model", help="Catalog model to simulate when server.command is a real vLLM."),
    ] = None,
    gpu: Annotated[
        str | None, typer.Option("--gpu", help="GPU profile to simulate when server.command is a real vLLM.")
    ] = None,
    top: Annotated[int, typer.Option("--top", help="How many of the best configs to list.")] = 10,
) -> None:
    """Dry-run the search space on the simulator: start failures, best configs, gain over the defaults."""
    from autotune.dryrun import dry_run, render
    from autotune.errors import SpecError
    from autotune.loader import load_study

    _quiet_libraries()
    if top < 1:
        _fail(ctx, SpecError("--top", f"must be >= 1, got {top}"))
    loaded = _guard(ctx, lambda: load_study(spec))
    result = _guard(ctx, lambda: dry_run(loaded, samples=samples, seed=seed, model=model, gpu=gpu))
    typer.echo(render(result, loaded, top=top), nl=False)


@app.command()
def bench(
    ctx: typer.Context,
    spec: SpecArg,
    url: Annotated[str, typer.Option("--url", help="Base URL of the running server, e.g. http://host:8000.")],
    model: Annotated[
        str | None, typer.Option("--model", help="Served model name (default: the spec's server.model).")
    ] = None,
    rate: Annotated[
        str | None,
        typer.Option("--rate", help="One probe at this rate (req/s, or inf) instead of the rate search."),
    ] = None,
    save_result: Annotated[
        Path | None,
        typer.Option("--save-result", help="Folder for each probe's JSON (`vllm bench serve` keys)."),
    ] = None,
    no_metrics: Annotated[
        bool, typer.Option("--no-metrics", help="Do not scrape the server's /metrics.")
    ] = False,
) -> None:
    """Measure a running server (no launch) with the spec's workload and SLO; print metrics and throughput."""
    from autotune.bench import failed_everything, parse_rate, parse_url, render_report, run_bench
    from autotune.errors import ServerError
    from autotune.loader import load_study, resolve_access

    _quiet_libraries()
    _guard(ctx, lambda: parse_url(url))
    fixed = _guard(ctx, lambda: parse_rate(rate)) if rate is not None else None
    loaded = _guard(ctx, lambda: load_study(spec))
    access = _guard(ctx, lambda: resolve_access(loaded, os.environ))

    def progress(line: str) -> None:
        typer.echo(line, err=True)

    result = _guard(
        ctx,
        lambda: run_bench(
            loaded,
            url,
            model=model,
            rate=fixed,
            save_dir=save_result,
            scrape_metrics=not no_metrics,
            on_progress=progress,
            access=access,
        ),
    )
    typer.echo(render_report(result))
    if save_result is not None:
        typer.echo(f"probe results: {save_result}/probe-<k>.json")
    if result.stopped is not None:
        _fail(ctx, ServerError(result.stopped))
    nothing = failed_everything(result)
    if nothing is not None:
        _fail(ctx, ServerError(nothing))


def main() -> None:
    """Console-script entry point."""
    app()
