"""The `autotune` command line: the only module that prints, exits or reads the environment."""

from __future__ import annotations

import contextlib
import enum
import inspect
import logging
import os
import re
import shutil
import signal
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn, TypeVar

import typer
from typer.core import TyperGroup

from autotune.errors import AutotuneError
from autotune.formats import BestFormat, Format, Policy
from autotune.units import format_duration, wrap

if TYPE_CHECKING:
    import optuna
    from rich.console import Console

    from autotune.events import Event
    from autotune.inputs.loader import LoadedStudy
    from autotune.inputs.newspec import Answers, Given
    from autotune.results.notify import Channels, Notifier


class _Group(TyperGroup):
    """The app's commands; its --help lists each with the first sentence of its help, whole (wrapped, never
    cut short with "...")."""

    def __init__(self, **attrs: Any) -> None:
        super().__init__(**attrs)
        for command in self.commands.values():
            if command.help and not command.short_help:
                paragraph = " ".join(inspect.cleandoc(command.help).split("\n\n")[0].split())
                command.short_help = re.split(r"(?<=\.) ", paragraph, maxsplit=1)[0]


# Help as click lays it out, not rich's panels: each paragraph flowed as one (a docstring's line breaks
# are not kept), a switch without a type label (no `<bool>`), and an option's choices `[a|b]` whole on
# its line; within the terminal's width, 80 columns at most (a pipe: 80).
app = typer.Typer(
    cls=_Group,
    add_completion=True,
    no_args_is_help=True,
    rich_markup_mode=None,
    help="Find the best `vllm serve` flags for a model, a GPU and a traffic pattern.",
    context_settings={"help_option_names": ["-h", "--help"]},
)

_T = TypeVar("_T")

SpecArg = Annotated[Path, typer.Argument(help="Study spec (YAML), e.g. studies/demo.yaml.")]


def _fail(ctx: typer.Context, exc: AutotuneError) -> NoReturn:
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


@contextlib.contextmanager
def _stored_study(ctx: typer.Context, loaded: LoadedStudy) -> Iterator[optuna.Study]:
    """The study in storage, read only (a missing or damaged one is one line), closed after the block."""
    from autotune.study.loop import close_study, open_study

    study = _guard(ctx, lambda: open_study(loaded, create=False, heartbeat=False))
    try:
        yield study
    finally:
        close_study(study)


def _quiet_libraries() -> None:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)


def _version(value: bool) -> None:
    if not value:
        return
    import platform
    from importlib.metadata import PackageNotFoundError, version

    def of(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed here"

    typer.echo(
        f"autotune {of('autotune')} (Python {platform.python_version()}, optuna {of('optuna')}, "
        f"vllm {of('vllm')})"
    )
    raise typer.Exit()


@app.callback()
def _root(
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks on errors.")] = False,
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_version, is_eager=True, help="Show the versions of autotune and vLLM."
        ),
    ] = False,
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
    from autotune.inputs.loader import load_study

    return _guard(ctx, lambda: load_study(spec, storage=storage))


@app.command()
def validate(ctx: typer.Context, spec: SpecArg, storage: StorageOpt = None) -> None:
    """Check a study spec, its search space and what a run needs here (the server command, the storage,
    the study folder) without launching anything or writing anything. The storage is only read: a damaged
    file, or a database that cannot be reached, is one line and exit 1."""
    from autotune.inputs.loader import preflight
    from autotune.store.storage import redact_url
    from autotune.study.loop import inspect_study_storage

    loaded = _load(ctx, spec, storage)
    _guard(ctx, lambda: preflight(loaded, os.environ))
    channels = _notify_channels(ctx, loaded)
    facts = _guard(ctx, lambda: inspect_study_storage(loaded))
    space = loaded.search_space
    bad = space.violations(space.defaults())
    budget = loaded.spec.budget
    _say(
        f"ok: study {loaded.spec.study.name!r}, {len(loaded.space.params)} parameters "
        f"({', '.join(loaded.space.params)}), {len(loaded.space.constraints)} constraints, "
        f"SLO {', '.join(str(t) for t in loaded.spec.slo.terms)}, budget {budget.launches} launches"
    )
    name = loaded.spec.study.name
    if facts.trials is not None:
        held = f"study {name!r} has {facts.trials} trials"
    elif facts.readable:
        held = f"study {name!r} is new: `autotune tune` creates it"
    else:
        held = f"study {name!r} not read now"
    _say(f"storage: {redact_url(loaded.storage_url)} ({facts.summary}; {held})")
    if channels is not None:
        _say(f"notify: {_notify_text(channels)}")
    for impossible in space.impossible:
        _say(f"note: {impossible}")
    for expr in space.unchecked:
        _say(
            f"note: constraint {expr!r} is not checked: it names a fact not known here (the model's "
            "architecture comes from memory_model.model or a catalog/local server.model; gpus_per_trial "
            "from the trial's GPU set)"
        )
    undeclared = [n for n, p in space.params.items() if p.default is None]
    if undeclared:
        _say(
            f"note: {', '.join(undeclared)} declare no default: the defaults' trial takes what the server "
            "reports"
        )
    if bad:
        _say("warning: the default config breaks " + "; ".join(str(v) for v in bad), err=True)
    _check_version(loaded)


def _check_version(loaded: LoadedStudy) -> None:
    """Warn when the server's vLLM is not a version the space was checked against, and about flags that
    version does not have (autotune/predict/flagcheck.py)."""
    from autotune.predict.flagcheck import server_version, unknown_flags, version_note

    env = {k: v for k, v in loaded.spec.server.env.items() if v is not None}
    version = server_version(loaded.spec.server.command, env)
    space = loaded.search_space
    note = version_note(space, version)
    if note is not None:
        _say(f"warning: {note}", err=True)
    unknown = unknown_flags(space, version)
    if unknown:
        _say(
            f"warning: vLLM {version or space.spec.vllm_versions[0]} has no {', '.join(unknown)}: every "
            "trial that passes it will end as invalid_config (unrecognized arguments)",
            err=True,
        )


PIPE_WIDTH = 80
"""The width of what is printed to a pipe or written to a file (``COLUMNS`` unset)."""


def _width(output: Path | None = None) -> int:
    """The width printed lines wrap at and tables fit: ``COLUMNS`` when set, else the terminal's, else
    (a pipe) :data:`PIPE_WIDTH`; a file written with ``--output`` is laid out for :data:`PIPE_WIDTH`."""
    if output is not None:
        return PIPE_WIDTH
    return shutil.get_terminal_size(fallback=(PIPE_WIDTH, 24)).columns


def _say(text: str, *, err: bool = False) -> None:
    """Print ``text`` wrapped at :func:`_width`, continuation lines indented (:func:`autotune.units.wrap`)."""
    typer.echo(wrap(text, _width()), err=err)


def _plain_width() -> int:
    """The width a run's event lines are cut to: ``COLUMNS`` or the terminal's; 0 (never cut) for a pipe or
    a file without ``COLUMNS`` (``events.jsonl`` keeps every line whole anyway)."""
    return shutil.get_terminal_size(fallback=(0, 0)).columns


def _where(path: Path) -> str:
    """``path`` relative to the working directory when it is inside it, else absolute."""
    try:
        return str(path.relative_to(Path.cwd())) or "."
    except ValueError:
        return str(path)


def relayed(line: str, width: int) -> str:
    """A fleet worker's line (``[gpus 0] text``) as the fleet prints it: cut to ``width``, but for an error,
    wrapped whole within it (an error cut short hides why the worker stopped), and a command to copy,
    printed whole on its line."""
    from autotune.results.progress import fit

    text = line.split("] ", 1)[-1]
    if text.startswith("  autotune "):
        return line
    if text.startswith("error: "):
        return wrap(line, width)
    return fit(line, width)


def _announce(loaded: LoadedStudy, command: str) -> None:
    """Where the study's records are, said once when a run starts."""
    from autotune.store.storage import redact_url

    workdir = _where(loaded.workdir)
    budget = loaded.spec.budget
    wall = f", wall time {format_duration(budget.wall_time)}" if budget.wall_time is not None else ""
    what = (
        "the finalists and the defaults measured again"
        if command == "verify"
        else f"budget {budget.launches} launches{wall}"
    )
    _say(f"{command} study {loaded.spec.study.name!r}: {what}")
    typer.echo(f"  storage  {redact_url(loaded.storage_url)}")  # a URL to copy: whole on its line
    _say(f"  records  {workdir}/trials/<n>/server.log, {workdir}/trials/<n>/probes/")
    _say(f"  events   {workdir}/events.jsonl (every line below, whole)")


@contextlib.contextmanager
def _progress(loaded: LoadedStudy) -> Iterator[Callable[[Event], None]]:
    """Show a run's events: on a terminal, milestone lines above a live bar (launches of the budget, ETA,
    the trial's phase); otherwise plain lines, one per event. Every line fits the width with the verdict
    and the best result first (:mod:`autotune.results.progress`)."""
    from rich.console import Console

    from autotune.results.progress import event_line

    console = Console(highlight=False, soft_wrap=False)
    if not console.is_terminal or console.is_dumb_terminal:
        width = _plain_width()

        def plain(event: Event) -> None:
            typer.echo(event_line(event, width))

        yield plain
        return
    with _live_bar(console, loaded) as show:
        yield show


@contextlib.contextmanager
def _live_bar(console: Console, loaded: LoadedStudy) -> Iterator[Callable[[Event], None]]:
    import time

    from rich.console import Group
    from rich.live import Live
    from rich.progress_bar import ProgressBar
    from rich.table import Table
    from rich.text import Text

    from autotune.events import read_events
    from autotune.results.progress import MILESTONES, Tracker, event_line, fit

    tracker = Tracker(loaded.spec.budget.launches)
    with contextlib.suppress(AutotuneError):  # an unreadable old log only costs the first ETA
        tracker.seed(read_events(loaded.workdir / "events.jsonl"))
    started = time.monotonic()

    def render() -> Group:
        now = tracker.standing()
        width = console.width
        row = Table.grid(padding=(0, 1))
        row.add_row(
            ProgressBar(total=max(1, now.budget), completed=now.launches, width=min(30, width // 4)),
            f"{now.launches}/{now.budget} launches",
            fit(f"{now.eta_text()}, elapsed {format_duration(time.monotonic() - started)}", width // 2),
        )
        return Group(row, Text(fit(now.phase_text(), width), no_wrap=True))

    with Live(get_renderable=render, console=console, refresh_per_second=2, transient=True) as live:

        def show(event: Event) -> None:
            tracker.update(event)
            if event.kind in MILESTONES:
                live.console.print(Text(event_line(event, console.width)), no_wrap=True, crop=True)
            live.refresh()

        yield show


GpusOpt = Annotated[
    str | None,
    typer.Option(
        "--gpus",
        help="Run one worker per GPU set on this host: 'all' or indices/UUIDs, e.g. 0,1,2,3.",
    ),
]
PerTrialOpt = Annotated[
    str,
    typer.Option(
        "--gpus-per-trial", help="GPUs of each trial (each worker's set, a whole number), with --gpus."
    ),
]
LabelOpt = Annotated[str, typer.Option("--worker-label", hidden=True)]
NoSummaryOpt = Annotated[bool, typer.Option("--no-summary", hidden=True)]


_Text = str | None
InitModel = Annotated[
    _Text, typer.Option("--model", help="A Hugging Face id, a local model folder or a catalog name.")
]
InitCommand = Annotated[
    _Text, typer.Option("--command", help="The `vllm serve MODEL ...` command, not --model.")
]
InitGpu = Annotated[
    _Text, typer.Option("--gpu", help="A catalog GPU (H100-80GB, ...); default: this machine's.")
]
InitSimulate = Annotated[
    bool, typer.Option("--simulate", help="Serve with the simulated vLLM server (no GPU).")
]
InitModelLen = Annotated[int | None, typer.Option("--max-model-len", help="Default: the model's own.")]
InitTraffic = Annotated[
    _Text, typer.Option("--traffic", help="chat (the default) or batch: the SLO and lengths.")
]
InitSlo = Annotated[
    list[str] | None, typer.Option("--slo", help="An SLO term, e.g. 'ttft:p95<=500ms'; repeat it.")
]
InitInputLen = Annotated[_Text, typer.Option("--input-len", help="Prompt tokens: 512-2048 or 1000.")]
InitOutputLen = Annotated[_Text, typer.Option("--output-len", help="Reply tokens: 64-512 or 256.")]
InitDataset = Annotated[
    Path | None, typer.Option("--dataset", help="ShareGPT JSON, JSONL prompts or a trace.")
]
InitBudget = Annotated[_Text, typer.Option("--budget", help="Launches (30) or hours (8h).")]
InitStorage = Annotated[_Text, typer.Option("--storage", help="Default: SQLite in the study's folder.")]
InitName = Annotated[_Text, typer.Option("--name", help="The study's name; default: the model's.")]
InitSpace = Annotated[
    Path | None, typer.Option("--search-space", help="Default: the one for the server's vLLM.")
]
InitOutput = Annotated[Path | None, typer.Option("--output", "-o", help="Default: ./NAME.yaml.")]
InitForce = Annotated[bool, typer.Option("--force", help="Overwrite files already there.")]


@app.command()
def init(
    ctx: typer.Context,
    model: InitModel = None,
    command: InitCommand = None,
    gpu: InitGpu = None,
    simulate: InitSimulate = False,
    max_model_len: InitModelLen = None,
    traffic: InitTraffic = None,
    slo: InitSlo = None,
    input_len: InitInputLen = None,
    output_len: InitOutputLen = None,
    dataset: InitDataset = None,
    budget: InitBudget = None,
    storage: InitStorage = None,
    name: InitName = None,
    search_space: InitSpace = None,
    output: InitOutput = None,
    force: InitForce = False,
) -> None:
    """Write a complete, commented study spec (and its search space beside it), then check that it loads.

    Each answer not given as a flag is asked on a terminal; elsewhere its default is taken (the model, and
    the GPU where NVML finds none, are required)."""
    import sys

    from autotune.inputs.newspec import Given, write

    given = Given(
        model=model,
        command=command,
        gpu=gpu,
        simulate=simulate,
        max_model_len=max_model_len,
        traffic=traffic,
        slo=tuple(slo or ()),
        input_len=input_len,
        output_len=output_len,
        dataset=dataset,
        budget=budget,
        storage=storage,
        name=name,
        search_space=search_space,
    )
    answers = _answers(ctx, given, ask=sys.stdin.isatty())
    path = output or Path(f"{answers.name}.yaml")
    written = _guard(ctx, lambda: write(answers, path, force=force))
    typer.echo(f"wrote {written[0]} and {written[1]} (from search_spaces/{answers.space.name})")
    typer.echo(f"next: autotune validate {written[0]}, then autotune tune {written[0]}")


def _answers(ctx: typer.Context, given: Given, *, ask: bool) -> Answers:
    """A new spec's answers from ``given``, the rest asked on a terminal (``ask``) or defaulted; this
    machine's GPU through NVML where none is named."""
    from autotune.hardware.gpu import device_profile, open_device
    from autotune.inputs.newspec import Asker, Host, gather
    from autotune.predict.flagcheck import server_version

    asker = (
        Asker(
            lambda question, default: typer.prompt(question, default=default),
            lambda why: typer.echo(why, err=True),
        )
        if ask
        else None
    )
    local = None if given.gpu or given.simulate else device_profile(open_device())
    host = Host(dict(os.environ), local, server_version)
    return _guard(ctx, lambda: gather(given, asker, host))


TuneSpecArg = Annotated[
    Path | None,
    typer.Argument(help="Study spec (YAML); none with --model: the spec its flags make (as init writes it)."),
]


@app.command()
def tune(
    ctx: typer.Context,
    spec: TuneSpecArg = None,
    model: InitModel = None,
    gpu: InitGpu = None,
    simulate: InitSimulate = False,
    max_model_len: InitModelLen = None,
    traffic: InitTraffic = None,
    slo: InitSlo = None,
    input_len: InitInputLen = None,
    output_len: InitOutputLen = None,
    dataset: InitDataset = None,
    budget: InitBudget = None,
    storage: StorageOpt = None,
    gpus: GpusOpt = None,
    gpus_per_trial: PerTrialOpt = "1",
    worker_label: LabelOpt = "",
    no_summary: NoSummaryOpt = False,
) -> None:
    """Run (or resume) the study until its budget is spent, then print the Pareto-best flags.

    Before it ends, the best configs and vLLM's defaults are measured again (finalists.*). With --gpus,
    one worker per GPU set shares the study. SIGTERM, SIGINT or SIGHUP stop the trial's server, give the
    trial back and exit with 128 + the signal's number; rerun the same command to resume.

    Without a spec, --model and the other answers of `autotune init` make one (NAME.yaml here, with its
    search space beside it); the same command run again resumes that study."""
    from autotune.inputs.newspec import Given

    given = Given(
        model=model,
        gpu=gpu,
        simulate=simulate,
        max_model_len=max_model_len,
        traffic=traffic,
        slo=tuple(slo or ()),
        input_len=input_len,
        output_len=output_len,
        dataset=dataset,
        budget=budget,
    )
    spec = _spec_of(ctx, spec, given)
    if gpus is not None:
        _fleet(ctx, spec, storage, gpus, gpus_per_trial)
        return
    if gpus_per_trial.strip() != "1":
        from autotune.errors import SpecError

        _fail(
            ctx,
            SpecError("--gpus-per-trial", f"{gpus_per_trial!r} needs --gpus (the GPUs to split into sets)"),
        )
    _run_with_signals(ctx, spec, storage, verify=False, label=worker_label, summary=not no_summary)


def _spec_of(ctx: typer.Context, spec: Path | None, given: Given) -> Path:
    """The spec ``tune`` runs: ``spec``; else the one ``given``'s flags make, written here as NAME.yaml or
    found there as the same flags wrote it before (the study resumes)."""
    from autotune.errors import SpecError
    from autotune.inputs.newspec import Given, space_beside, write, written_before

    if spec is not None:
        if given != Given(slo=()):
            _fail(ctx, SpecError("--model", "give a study spec or --model with its answers, not both"))
        return spec
    if given.model is None:
        _fail(ctx, SpecError("SPEC", "give a study spec, or --model (and its answers) to make one"))
    answers = _answers(ctx, given, ask=False)
    path = Path(f"{answers.name}.yaml")
    if written_before(answers, path):
        _say(f"resuming from {path} and {space_beside(path)}, written by these flags before")
        return path
    if path.exists():
        _fail(
            ctx,
            SpecError(
                "--model",
                f"{path} exists with other answers: `autotune tune {path}` resumes its study, "
                "`autotune init ... --force` rewrites it",
            ),
        )
    written = _guard(ctx, lambda: write(answers, path, force=False))
    _say(f"wrote {written[0]} and {written[1]}: this command, or `autotune tune {path}`, resumes the study")
    return path


RecordOpt = Annotated[
    Path | None,
    typer.Option(
        "--record",
        help="An `export --format json` file: measure its config once more (a fresh request stream, the "
        "study left as it is), say what differs from when it was measured and whether the figures agree "
        "(exit 1 when they do not).",
    ),
]


@app.command()
def verify(ctx: typer.Context, spec: SpecArg, storage: StorageOpt = None, record: RecordOpt = None) -> None:
    """Measure the study's finalists and vLLM's defaults once more (longer probes, fresh prompts), then
    print the front ranked by every measurement so far; with --record, measure an exported config again."""
    if record is not None:
        _reproduce(ctx, spec, storage, record)
        return
    _run_with_signals(ctx, spec, storage, verify=True, label="", summary=True)


def _reproduce(ctx: typer.Context, spec: Path, storage: str | None, path: Path) -> None:
    """``verify --record``: the recorded config launched and measured again, compared with the record."""
    from autotune.errors import Interrupted
    from autotune.hardware.gpu import visible_devices
    from autotune.inputs.loader import preflight, resolve_access
    from autotune.interrupts import stop_on_signals
    from autotune.results.reproduce import agreement, differences, now_facts, read_record
    from autotune.study.remeasure import remeasure

    _quiet_libraries()
    loaded = _load(ctx, spec, storage)
    recorded = _guard(ctx, lambda: read_record(path, loaded))
    _guard(ctx, lambda: preflight(loaded, os.environ))
    access = resolve_access(loaded, os.environ)
    gpus = visible_devices(os.environ.get("CUDA_VISIBLE_DEVICES"))
    what = "vLLM's defaults" if recorded.baseline else f"trial {recorded.trial}'s config"
    _say(f"measuring {what} again on a fresh request stream (the study is left as it is)")
    try:
        with stop_on_signals():
            again = _guard(
                ctx,
                lambda: remeasure(
                    loaded,
                    recorded.trial,
                    recorded.flags,
                    baseline=recorded.baseline,
                    gpus=gpus,
                    access=access,
                    phase=lambda text: typer.echo(text),
                ),
            )
    except Interrupted as sig:
        typer.echo(f"interrupted by {sig.name}: the server was stopped", err=True)
        raise typer.Exit(sig.exit_code) from None
    _say(f"records: {again.folder}")
    for line in differences(recorded.pinned, now_facts(loaded, again.record, os.environ)):
        _say(f"differs: {line}")
    if again.outcome.cause is not None:
        _say(f"not measured: {again.outcome.cause}: {again.outcome.summary}")
        raise typer.Exit(1)
    agrees, sentence = agreement(recorded, again.record.slo_throughput, again.record.slo_throughput_interval)
    _say(sentence)
    if not agrees:
        raise typer.Exit(1)


def _fleet(ctx: typer.Context, spec: Path, storage: str | None, gpus: str, per_trial: str) -> None:
    from autotune.errors import SpecError
    from autotune.hardware.gpu import host_gpus
    from autotune.inputs.loader import preflight
    from autotune.study.fleet import WITHOUT_NVML, check_parallelism, gpu_sets, run_fleet, worker_argv

    loaded = _load(ctx, spec, storage)
    _guard(ctx, lambda: preflight(loaded, os.environ))
    _notify_channels(ctx, loaded)
    without_nvml = os.environ.get(WITHOUT_NVML, "")
    if without_nvml not in ("", "0", "1"):
        _fail(ctx, SpecError(WITHOUT_NVML, f"{without_nvml!r}: set it to 1 (or 0), or unset it"))
    host = host_gpus()
    sets = _guard(ctx, lambda: gpu_sets(gpus, per_trial, host, without_nvml=without_nvml == "1"))
    _guard(ctx, lambda: check_parallelism(loaded, len(sets[0])))
    typer.echo(f"{len(sets)} workers on GPU sets {', '.join(','.join(s) for s in sets)}")
    width = _plain_width()

    def relay(line: str) -> None:  # each worker's line, prefixed with its set, cut to the terminal
        typer.echo(relayed(line, width))

    code = run_fleet(worker_argv(str(spec), storage), sets, relay)
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
    loaded = _load(ctx, spec, storage)
    with _stored_study(ctx, loaded) as study:
        _guard(ctx, lambda: _summary(spec, study, loaded))


def _summary(spec: Path, study: optuna.Study, loaded: LoadedStudy) -> None:
    from optuna.trial import TrialState

    from autotune.results.best import best_table
    from autotune.results.export import choose, pareto_front
    from autotune.study.finalists import existing_ledger, pending

    running = len(study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)))
    book = existing_ledger(study)
    if book is not None:
        running += sum(pending(book))
    if running:  # the worker that ends the study prints the table
        _say(
            f"\nFinished here; {running} trials or reruns still run elsewhere: `autotune best {spec}` once "
            "they end."
        )
        return
    typer.echo("")
    width = _width()
    typer.echo(best_table(study, loaded, width))
    typer.echo("")
    front = pareto_front(study)
    if front and not choose(study, loaded, trial=None, policy=None).beats_defaults:
        text = (
            "No config beats vLLM's defaults beyond the noise: keep serving with them (pass none of the "
            f"tuned flags), or widen the search and rerun to continue the study (`autotune export {spec} "
            "--diff` shows how the study's best config differs from them)."
        )
        _say(text)
    elif front:
        _say("Export the chosen flags (or --diff, --format helm|args|json):")
        typer.echo(f"  autotune export {spec} -o best.yaml")  # a command to copy: whole
    else:
        text = (
            "Nothing to export: no trial met the SLOs. Read the causes above; then loosen slo.terms, "
            "widen the search space or raise budget.launches, and rerun to continue the study."
        )
        _say(text)


def _run_with_signals(
    ctx: typer.Context, spec: Path, storage: str | None, *, verify: bool, label: str, summary: bool
) -> None:
    from autotune.errors import Interrupted
    from autotune.events import EventLog
    from autotune.hardware.gpu import check_visible_devices, host_gpus, visible_devices
    from autotune.inputs.loader import preflight, resolve_access
    from autotune.interrupts import stop_on_signals
    from autotune.study.fleet import check_fixed_parallelism
    from autotune.study.loop import close_study, inspect_study_storage
    from autotune.study.trial import run_study, verify_study

    _quiet_libraries()
    loaded = _load(ctx, spec, storage)
    _guard(ctx, lambda: preflight(loaded, os.environ))
    access = resolve_access(loaded, os.environ)  # checked by preflight
    channels = _notify_channels(ctx, loaded, [access.api_key or "", *access.headers.values()])
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    host = host_gpus()
    _guard(ctx, lambda: check_visible_devices(visible, host))
    gpus = visible_devices(visible)
    per_trial = len(gpus) if visible else len(host.uuids) or None  # unset: every GPU of the host
    if per_trial is not None:  # a TP x DP above the trial's GPUs: refused (fixed) or rejected (sampled)
        _guard(ctx, lambda: check_fixed_parallelism(loaded, per_trial))
        loaded = loaded.for_gpus(per_trial)
    log = EventLog(loaded.workdir / "events.jsonl")
    run = verify_study if verify else run_study
    command = "verify" if verify else "tune"
    _guard(ctx, lambda: inspect_study_storage(loaded))  # a damaged storage is one line, before anything
    _announce(loaded, command)
    try:
        with stop_on_signals(), _progress(loaded) as show:

            def shown_and_logged(event: Event) -> None:
                show(event)
                log(event)

            notifier = _notifier(loaded, channels, shown_and_logged) if channels and not verify else None

            def on_event(event: Event) -> None:
                shown_and_logged(event)
                if notifier is not None:
                    notifier(event)

            try:
                study = _guard(
                    ctx, lambda: run(loaded, on_event=on_event, gpus=gpus, label=label, access=access)
                )
            finally:
                if notifier is not None:
                    notifier.close()  # the last notifications (finished, stopped) go out before the end
    except Interrupted as sig:
        typer.echo(
            f"interrupted by {sig.name}: the server was stopped; rerun `autotune {command} {spec}` to resume",
            err=True,
        )
        raise typer.Exit(sig.exit_code) from None
    try:
        if summary:
            _guard(ctx, lambda: _summary(spec, study, loaded))
    finally:
        close_study(study)


def _notify_channels(
    ctx: typer.Context, loaded: LoadedStudy, also_secret: Sequence[str] = ()
) -> Channels | None:
    """The spec's notification channels with their secrets read from the environment (exit 2 when a
    variable is not set); ``None`` without a ``notify:`` section. ``also_secret``: the study's other
    secrets, kept out of notification failures too."""
    from autotune.results.notify import resolve_notify

    section = loaded.spec.notify
    if section is None:
        return None
    return _guard(
        ctx,
        lambda: resolve_notify(section, os.environ, also_secret=also_secret, storage_url=loaded.storage_url),
    )


def _notify_text(channels: Channels) -> str:
    where = []
    if channels.command is not None:
        where.append(f"command {channels.command[0]!r}")
    if channels.url_shown is not None:
        where.append(f"webhook {channels.url_shown}")
    return f"{' and '.join(where)} on {', '.join(sorted(channels.events))}"


def _notifier(loaded: LoadedStudy, channels: Channels, on_failure: Callable[[Event], None]) -> Notifier:
    """A notifier whose payloads carry the export's pick and where the records are."""
    from autotune.results.notify import Notifier
    from autotune.results.status import pick_summary, read_study, records
    from autotune.study.loop import close_study

    def extra(kind: str, _event: Event) -> dict[str, object]:
        out: dict[str, object] = {"records": records(loaded)}
        if kind in ("finished", "new_best"):
            study = read_study(loaded)
            pick = None
            if study is not None:
                try:
                    pick = pick_summary(study, loaded)
                finally:
                    close_study(study)
            if pick is not None:
                out["pick"] = pick
                out["headline"] = f"best: trial {pick['trial']}: {pick['headline']}"
        return out

    return Notifier(channels, loaded.spec.study.name, on_failure, extra)


def _choice(ctx: typer.Context, option: str, value: str | None, choices: type[enum.StrEnum]) -> None:
    """Refuse a value of ``option`` that is not one of ``choices``: one line naming both, exit 2."""
    from autotune.errors import SpecError

    allowed = [c.value for c in choices]
    if value is not None and value not in allowed:
        what = option.removeprefix("--")
        _fail(ctx, SpecError(option, f"unknown {what} {value!r}: use one of {', '.join(allowed)}"))


def _write(ctx: typer.Context, output: Path | None, text: str, note: str) -> None:
    """``text`` to stdout, or to ``output`` (then ``note`` on stderr); an unwritable file is bad input."""
    from autotune.errors import SpecError

    if output is None:
        typer.echo(text, nl=False)
        return
    try:
        output.write_text(text, encoding="utf-8")
    except OSError as exc:
        _fail(ctx, SpecError("--output", f"cannot write {str(output)!r}: {exc.strerror}"))
    typer.echo(f"wrote {output} ({note})", err=True)


def _complete(choices: type[enum.StrEnum]) -> Callable[[str], list[str]]:
    def complete(incomplete: str) -> list[str]:
        return [c.value for c in choices if c.value.startswith(incomplete)]

    return complete


def _choices(choices: type[enum.StrEnum]) -> str:
    return "[" + "|".join(c.value for c in choices) + "]"


OutputOpt = Annotated[Path | None, typer.Option("--output", "-o", help="Write here, not stdout.")]


@app.command()
def best(
    ctx: typer.Context,
    spec: SpecArg,
    fmt: Annotated[
        str,
        typer.Option(
            "--format",
            "-f",
            metavar=_choices(BestFormat),
            autocompletion=_complete(BestFormat),
            help="table (fits the terminal; flags equal to vLLM's defaults folded), json, or csv (one row "
            "per config).",
        ),
    ] = "table",
    output: OutputOpt = None,
    storage: StorageOpt = None,
) -> None:
    """Print the Pareto front and vLLM's defaults: SLO-constrained throughput, measured again, p95 TTFT and
    TPOT, p99 E2EL, gain over the defaults, and the flags that differ from the defaults."""
    from autotune.results.best import render_best

    _quiet_libraries()
    _choice(ctx, "--format", fmt, BestFormat)
    loaded = _load(ctx, spec, storage)
    with _stored_study(ctx, loaded) as study:
        text = _guard(ctx, lambda: render_best(study, loaded, BestFormat(fmt), _width(output)))
    _write(ctx, output, text, f"study {loaded.spec.study.name!r}, {fmt}")


@app.command()
def export(
    ctx: typer.Context,
    spec: SpecArg,
    fmt: Annotated[
        str,
        typer.Option(
            "--format",
            "-f",
            metavar=_choices(Format),
            autocompletion=_complete(Format),
            help="vllm-yaml (for `vllm serve --config`), args (a command line), json, or helm (values for "
            "the vLLM production stack's chart).",
        ),
    ] = "vllm-yaml",
    trial: Annotated[int | None, typer.Option("--trial", help="Export this trial number.")] = None,
    policy: Annotated[
        str | None,
        typer.Option(
            "--policy",
            metavar=_choices(Policy),
            autocompletion=_complete(Policy),
            help="Pick from the Pareto front: max-throughput (the default) or min-latency.",
        ),
    ] = None,
    show_diff: Annotated[
        bool,
        typer.Option(
            "--diff", help="Show the config against vLLM's defaults (a unified diff of the vllm-yaml)."
        ),
    ] = False,
    output: OutputOpt = None,
    storage: StorageOpt = None,
) -> None:
    """Export a chosen config as `vllm serve --config` YAML, a command line, JSON or Helm values, or show
    how it differs from vLLM's defaults."""
    from autotune.errors import SpecError
    from autotune.results.export import choose, diff, render

    _quiet_libraries()
    _choice(ctx, "--format", fmt, Format)
    _choice(ctx, "--policy", policy, Policy)
    if policy is not None and trial is not None:
        _fail(ctx, SpecError("--policy", "give either --trial or --policy, not both"))
    if show_diff and fmt != Format.VLLM_YAML:
        _fail(ctx, SpecError("--diff", f"shows the vllm-yaml against the defaults: drop --format {fmt}"))
    loaded = _load(ctx, spec, storage)
    chosen = Policy(policy) if policy else None
    with _stored_study(ctx, loaded) as study:
        choice = _guard(ctx, lambda: choose(study, loaded, trial=trial, policy=chosen))
        width = _width(output)
        text = (
            diff(choice, loaded, width)
            if show_diff
            else render(choice, loaded, Format(fmt), width, os.environ)
        )
    _write(ctx, output, text, f"trial {choice.trial.number}")


@app.command()
def status(
    ctx: typer.Context,
    spec: SpecArg,
    as_json: Annotated[bool, typer.Option("--json", help="Print the status as one JSON object.")] = False,
    storage: StorageOpt = None,
) -> None:
    """Where the study stands, during or after a run; reads only.

    From any host that reaches the storage: launches against the budget, the trial running and its phase,
    the ETA, the best config so far, outcomes by cause, the last fault and where the records are. It
    writes nothing and locks nothing, so it is safe while tuners run."""
    import json

    from autotune.results.status import read_status

    _quiet_libraries()
    loaded = _load(ctx, spec, storage)
    found = _guard(ctx, lambda: read_status(loaded))
    typer.echo(json.dumps(found.as_dict(), indent=2, default=str) if as_json else found.render(_width()))


@app.command()
def report(
    ctx: typer.Context,
    spec: SpecArg,
    output: Annotated[
        Path | None,
        typer.Option("--output", "-o", help="Write the HTML here (default: <workdir>/report.html)."),
    ] = None,
    storage: StorageOpt = None,
) -> None:
    """Write the study's HTML report: one self-contained file, the answer first.

    It opens with no network: the chosen flags against the defaults, their figures and the `vllm serve`
    line, then the Pareto front, progress, failures, parameter importances, latency distributions, rate
    searches and the run's facts."""
    from autotune.errors import SpecError, StudyError
    from autotune.results.htmlreport import build_report
    from autotune.results.status import read_study
    from autotune.study.loop import close_study

    _quiet_libraries()
    loaded = _load(ctx, spec, storage)
    study = _guard(ctx, lambda: read_study(loaded))
    if study is None:
        _fail(
            ctx, StudyError(f"no study {loaded.spec.study.name!r} in storage yet: run `autotune tune {spec}`")
        )
    assert study is not None
    try:
        page = build_report(study, loaded, spec_shown=str(spec))
    finally:
        close_study(study)
    target = output if output is not None else loaded.workdir / "report.html"
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(page, encoding="utf-8")
    except OSError as exc:
        _fail(ctx, SpecError("--output", f"cannot write {str(target)!r}: {exc.strerror or exc}"))
    typer.echo(f"wrote {target} ({len(page.encode()) / 1024:.0f} KiB); open it in a browser")


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
    from autotune.hardware.catalog import GpuProfile
    from autotune.hardware.gpu import device_profile, open_device
    from autotune.predict.kvreport import kv_report

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
    calibrated: Annotated[
        bool,
        typer.Option(
            "--calibrated",
            help="Show the surrogate calibrated to the study's measured trials: its fit, how its "
            "proposals fared, and the configs it would launch next.",
        ),
    ] = False,
) -> None:
    """Dry-run the search space on the simulator: start failures, best configs, gain over the defaults."""
    from autotune.errors import SpecError
    from autotune.inputs.loader import load_study
    from autotune.predict.dryrun import dry_run, render

    _quiet_libraries()
    if top < 1:
        _fail(ctx, SpecError("--top", f"must be >= 1, got {top}"))
    loaded = _guard(ctx, lambda: load_study(spec))
    if calibrated:
        _calibrated(ctx, loaded, top)
        return
    result = _guard(ctx, lambda: dry_run(loaded, samples=samples, seed=seed, model=model, gpu=gpu))
    typer.echo(render(result, loaded, top=top), nl=False)


def _calibrated(ctx: typer.Context, loaded: LoadedStudy, top: int) -> None:
    """``simulate --calibrated``: the study's surrogate, calibrated to its stored trials."""
    from autotune.errors import SpecError
    from autotune.hardware.gpu import open_devices
    from autotune.predict.feasibility import memory_model_for
    from autotune.predict.surrogate.propose import build_proposer
    from autotune.predict.surrogate.report import render, view

    memory = _guard(ctx, lambda: memory_model_for(loaded, open_devices([0])))
    if memory is None:
        why = "absent" if loaded.spec.memory_model is None else "'gpu: auto' and NVML sees no GPU here"
        _fail(
            ctx,
            SpecError(
                "memory_model",
                f"{why}: the surrogate needs the model and the GPU (memory_model.model, memory_model.gpu)",
            ),
        )
    proposer = _guard(ctx, lambda: build_proposer(loaded, memory))
    if proposer is None:
        _fail(ctx, SpecError("workload", "the surrogate cannot read the workload's request lengths"))
    with _stored_study(ctx, loaded) as study:
        trials = study.get_trials(deepcopy=False)
        shown = _guard(ctx, lambda: view(proposer, trials, top))
    typer.echo(render(shown, loaded.spec.study.name), nl=False)


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
        typer.Option(
            "--rate",
            help="One probe at this rate (req/s, inf, or trace: the trace's recorded rate times "
            "dataset.time_scale) instead of the rate search.",
        ),
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
    from autotune.errors import ServerError
    from autotune.inputs.loader import load_study, resolve_access
    from autotune.study.bench import (
        TRACE_RATE,
        failed_everything,
        parse_rate,
        parse_url,
        render_report,
        run_bench,
        trace_replay_rate,
    )

    _quiet_libraries()
    _guard(ctx, lambda: parse_url(url))
    by_trace = rate is not None and rate.strip().lower() == TRACE_RATE
    fixed = _guard(ctx, lambda: parse_rate(rate)) if rate is not None and not by_trace else None
    loaded = _guard(ctx, lambda: load_study(spec))
    if by_trace:
        fixed = _guard(ctx, lambda: trace_replay_rate(loaded))
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
    """Console-script entry point (named ``autotune`` however it is started: usage lines, completion)."""
    app(prog_name="autotune")
