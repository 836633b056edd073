"""A new study spec from a few answers (``autotune init``): the spec, commented, and beside it the search
space that matches the server's vLLM with the batch defaults of the GPU, written only once both validate.

Every answer is checked before anything is written: a model that cannot be read, an unknown GPU or a
malformed SLO term is a :class:`SpecError` naming the option and the value, and no file is left behind.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import yaml

from autotune.errors import SpecError
from autotune.hardware.catalog import GIB, GPUS, MODELS, GpuProfile, ModelArch, load_model_arch
from autotune.hardware.hub import model_file
from autotune.inputs.loader import load_study
from autotune.inputs.slo_terms import parse_term

_T = TypeVar("_T")


@dataclass(frozen=True)
class Traffic:
    """A kind of traffic's starting point: SLO terms and token lengths a user edits from."""

    slo: tuple[str, ...]
    input_len: str
    output_len: str


TRAFFIC = {
    "chat": Traffic(("ttft:p95<=500ms", "tpot:p95<=50ms"), "256-2048", "64-512"),
    "batch": Traffic(("ttft:p95<=10s", "tpot:p95<=100ms"), "1024-4096", "256-1024"),
}
"""Interactive chat: a reply starts within half a second and streams faster than reading speed. Batch
(offline summarising, extraction): longer prompts and replies, loose latency, throughput first."""

SPACES = Path(__file__).resolve().parents[2] / "search_spaces"
"""The search spaces shipped beside the package (a checkout's ``search_spaces/``)."""


@dataclass(frozen=True)
class Model:
    """The model a spec serves: the name requests use, and where its architecture was read."""

    name: str
    """As the user gave it: a hub id, a folder or a catalog name (the served name)."""
    arch: ModelArch
    source: str
    """What the memory model and the simulator read: the catalog name, or the folder of its config.json."""


def find_model(model: str, env: Mapping[str, str]) -> Model:
    """``model`` as a catalog name, a folder with a ``config.json`` (or that file), or a hub id whose
    ``config.json`` is in the Hugging Face cache; :class:`SpecError` on ``--model`` when none reads."""
    config = model_file(model, "config.json", env)
    source = str(config.parent.resolve()) if config is not None else model
    try:
        arch = load_model_arch(source)
    except SpecError as exc:
        raise SpecError(
            "--model",
            f"{exc.message}; a hub id needs its config.json in the Hugging Face cache "
            f"(huggingface-cli download {model} config.json)",
        ) from exc
    return Model(model, arch, arch.name if arch.name in MODELS and config is None else source)


def find_gpu(name: str) -> GpuProfile:
    """A catalog GPU by name, case-insensitively; :class:`SpecError` on ``--gpu`` naming the known ones."""
    for key, profile in GPUS.items():
        if key.lower() == name.lower():
            return profile
    raise SpecError("--gpu", f"unknown GPU {name!r}: one of {', '.join(GPUS)}")


def slo_terms(terms: Sequence[str]) -> tuple[str, ...]:
    """``terms`` checked one by one (:class:`SpecError` on ``--slo`` naming the first malformed one)."""
    if not terms:
        raise SpecError("--slo", "at least one term is needed, e.g. 'ttft:p95<=500ms'")
    for term in terms:
        try:
            parse_term(term)
        except ValueError as exc:
            raise SpecError("--slo", str(exc)) from exc
    return tuple(terms)


def batch_defaults(gpu: GpuProfile) -> tuple[int, int]:
    """vLLM 0.34's ``max_num_seqs`` and ``max_num_batched_tokens`` defaults for ``gpu``
    (``get_batch_defaults``): 1,024 and 8,192 from 70 GiB (16,384 tokens from 160 GiB) but on an A100,
    else 256 and 2,048."""
    large = gpu.memory_bytes >= 70 * GIB and "A100" not in gpu.name.upper()
    if not large:
        return 256, 2048
    return 1024, 16384 if gpu.memory_bytes >= 160 * GIB else 8192


def space_for(version: str | None, *, simulated: bool, spaces: Path = SPACES) -> Path:
    """The shipped search space for a server: the simulator's, else the GPU space whose ``vllm_versions``
    names ``version``'s release (the newest GPU space when the version is unknown or newer; the legacy
    space before 0.30)."""
    if not spaces.is_dir():
        raise SpecError("--search-space", f"no search spaces at {spaces}: pass --search-space FILE")
    if simulated:
        return spaces / "sim.yaml"
    release = ".".join((version or "").split("+", 1)[0].split(".")[:2])
    gpu_spaces = {p: _versions(p) for p in sorted(spaces.glob("vllm-*.yaml")) if p.stem != "vllm-cpu"}
    named = [p for p, versions in gpu_spaces.items() if release in versions]
    if named:
        return min(named, key=lambda p: len(p.name))  # the base space, not a focused one
    if version is not None and _release_tuple(release) < (0, 30):
        return spaces / "vllm-legacy.yaml"
    newest = max((v for versions in gpu_spaces.values() for v in versions), key=_release_tuple)
    return min((p for p, versions in gpu_spaces.items() if newest in versions), key=lambda p: len(p.name))


def _versions(path: Path) -> list[str]:
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    return [str(v) for v in data.get("vllm_versions", [])] if isinstance(data, dict) else []


def _release_tuple(release: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in release.split("."))
    except ValueError:
        return (0,)


@dataclass(frozen=True)
class Answers:
    """Everything a new spec says, checked."""

    name: str
    model: Model
    gpu: GpuProfile
    gpu_auto: bool
    """The GPU was found through NVML: the memory model reads it at run time (``gpu: auto``)."""
    command: tuple[str, ...]
    simulated: bool
    max_model_len: int
    slo: tuple[str, ...]
    input_len: str
    output_len: str
    dataset: Path | None
    launches: int
    hours: float | None
    storage: str | None
    space: Path


def length(text: str, option: str) -> dict[str, object]:
    """``"512-2048"`` as a uniform length, ``"1000"`` as a fixed one (:class:`SpecError` on ``option``)."""
    match = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", text)
    if not match or int(match.group(1)) < 1 or (match.group(2) and int(match.group(2)) < int(match.group(1))):
        raise SpecError(option, f"{text!r} is not a token length: a number (1000) or a range (512-2048)")
    if match.group(2) is None:
        return {"dist": "fixed", "value": int(match.group(1))}
    return {"dist": "uniform", "low": int(match.group(1)), "high": int(match.group(2))}


def dataset_section(path: Path) -> dict[str, object]:
    """A dataset file's section: ShareGPT (a JSON list), a trace (JSONL rows with ``timestamp``,
    ``input_len`` and ``output_len``) or JSONL prompts (``prompt`` or ``text``)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError("--dataset", f"cannot read {path}: {exc}") from exc
    head = text.lstrip()
    if head.startswith("["):
        return {"kind": "sharegpt", "path": str(path.resolve())}
    try:
        row = json.loads(head.splitlines()[0]) if head else None
    except json.JSONDecodeError:
        row = None
    if isinstance(row, dict) and {"timestamp", "input_len", "output_len"} <= row.keys():
        return {"kind": "trace", "path": str(path.resolve())}
    if isinstance(row, dict) and ("prompt" in row or "text" in row):
        return {"kind": "jsonl", "path": str(path.resolve())}
    raise SpecError(
        "--dataset",
        f"{path} is neither ShareGPT JSON, JSONL prompts ('prompt' or 'text') nor a trace "
        "('timestamp', 'input_len', 'output_len' per line)",
    )


def _flow(value: object) -> str:
    """``value`` as one line of YAML (flow style), quoted only where YAML needs it."""
    return (
        str(yaml.safe_dump(value, default_flow_style=True, sort_keys=False, width=10_000))
        .strip()
        .removesuffix("\n...")
        .strip()
    )


def _workload(answers: Answers) -> list[str]:
    if answers.dataset is None:
        dataset: dict[str, object] = {"input_len": length(answers.input_len, "--input-len")}
        dataset["output_len"] = length(answers.output_len, "--output-len")
        arrival = "poisson"
    else:
        dataset = dataset_section(answers.dataset)
        if dataset["kind"] != "trace":
            dataset["output_len"] = length(answers.output_len, "--output-len")
        arrival = "trace" if dataset["kind"] == "trace" else "poisson"
    lines = ["workload:", "  dataset:"]
    lines += [f"    {key}: {_flow(value)}" for key, value in dataset.items()]
    lines.append(f"  arrival: {{process: {arrival}}}   # Poisson arrivals; the rate search moves the rate")
    return lines


_QUICK_PROBES = [
    "measurement:             # short probes, for a first run on the simulator (the demo's); on a GPU,",
    "  probe_duration: 6s     # delete this section: the defaults judge each tail on 100+ requests",
    "  min_requests: 40",
    "  min_tail_samples: 2",
    "  saturation_requests: 80",
    "  max_probes: 5",
]


def spec_text(answers: Answers, space_name: str) -> str:
    """The spec, with a comment on each choice a user may want to change."""
    gpu = "auto" if answers.gpu_auto else answers.gpu.name
    budget = f"  launches: {answers.launches}          # server launches; a launch takes minutes on a GPU"
    lines = [
        f"# A study spec written by `autotune init` for {answers.model.name} on {answers.gpu.name}.",
        "# Check it with `autotune validate SPEC`, run it with `autotune tune SPEC`; the README's",
        '# "The study spec" lists every key.',
        "study:",
        f"  name: {answers.name}",
        *(
            [f"  storage: {_flow(answers.storage)}"]
            if answers.storage
            else [
                "  # storage: postgresql://user@host/db   # many hosts; default SQLite in <spec dir>/<name>/"
            ]
        ),
        "server:",
        f"  command: {_flow(list(answers.command))}",
        f"  model: {_flow(answers.model.name)}",
        "  args:",
        f"    max-model-len: {answers.max_model_len}   # fixed for every trial; the model's own by default",
        "  port: 0               # a free port for each trial",
        f"  start_timeout: {'60s' if answers.simulated else '15m'}     # loading weights and compiling",
        f"search_space: {space_name}   # the flags to tune, vLLM's defaults for {answers.gpu.name} filled in",
        *_workload(answers),
        "slo:",
        f"  terms: {_flow(list(answers.slo))}",
        "budget:",
        budget,
        *([f"  wall_time: {answers.hours:g}h"] if answers.hours is not None else []),
        *(_QUICK_PROBES if answers.simulated else []),
        "memory_model:            # configs that cannot fit are pruned before any launch",
        f"  model: {_flow(answers.model.source)}",
        f"  gpu: {gpu}",
    ]
    return "\n".join(lines) + "\n"


def space_text(answers: Answers) -> str:
    """The shipped space, headed by where it came from; in a vLLM 0.34 GPU space the batch defaults
    are the GPU's (vLLM picks them by the GPU's memory, so the shipped file can name only one)."""
    text = answers.space.read_text(encoding="utf-8")
    head = f"# Copied by `autotune init` from search_spaces/{answers.space.name}"
    if answers.simulated or "0.34" not in _versions(answers.space):
        return f"{head}.\n{text}"
    seqs, tokens = batch_defaults(answers.gpu)
    text = _with_default(text, "max_num_seqs", seqs)
    text = _with_default(text, "max_num_batched_tokens", tokens)
    return f"{head}, the batch defaults set for {answers.gpu.name}: {seqs} / {tokens}.\n{text}"


def _with_default(text: str, param: str, value: int) -> str:
    line = re.compile(rf"^(\s+{param}:\s*\{{)(.*?)(\}}.*)$", re.M)

    def edit(match: re.Match[str]) -> str:
        body = re.sub(r",\s*default:\s*[^,}]+", "", match.group(2))
        return f"{match.group(1)}{body}, default: {value}{match.group(3)}"

    return line.sub(edit, text, count=1)


def space_beside(spec_path: Path) -> Path:
    """Where a new spec's search space goes: ``<spec>.space.yaml`` beside it."""
    return spec_path.with_name(f"{spec_path.stem}.space.yaml")


def write(answers: Answers, spec_path: Path, *, force: bool) -> list[Path]:
    """Write the spec and its space (``<spec>.space.yaml``) beside it, once both load as a study; with
    ``force`` over files already there, else :class:`SpecError` on ``--output`` and nothing written."""
    space_path = space_beside(spec_path)
    existing = [p for p in (spec_path, space_path) if p.exists()]
    if existing and not force:
        raise SpecError("--output", f"{existing[0]} exists: pass --force to overwrite it")
    spec_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=spec_path.parent, prefix=".autotune-init-") as tmp:
        trial_spec = Path(tmp) / spec_path.name
        (Path(tmp) / space_path.name).write_text(space_text(answers), encoding="utf-8")
        trial_spec.write_text(spec_text(answers, space_path.name), encoding="utf-8")
        load_study(trial_spec)
        for path in (space_path, spec_path):
            shutil.move(Path(tmp) / path.name, path)
    return [spec_path, space_path]


def written_before(answers: Answers, spec_path: Path) -> bool:
    """Whether ``spec_path`` and its space already hold exactly what ``answers`` would write (``tune
    --model ...`` run again: the study resumes from them)."""
    space_path = space_beside(spec_path)
    try:
        return spec_path.read_text(encoding="utf-8") == spec_text(
            answers, space_path.name
        ) and space_path.read_text(encoding="utf-8") == space_text(answers)
    except OSError:
        return False


# ----------------------------------------------------------------------------------------------
# The answers: from the flags, else asked on a terminal, else the defaults
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Given:
    """What ``autotune init``'s flags said (None: not given)."""

    model: str | None = None
    command: str | None = None
    gpu: str | None = None
    simulate: bool = False
    max_model_len: int | None = None
    traffic: str | None = None
    slo: tuple[str, ...] = ()
    input_len: str | None = None
    output_len: str | None = None
    dataset: Path | None = None
    budget: str | None = None
    storage: str | None = None
    name: str | None = None
    search_space: Path | None = None


@dataclass(frozen=True)
class Asker:
    """How to ask: ``ask(question, default)`` returns the typed text; ``tell`` shows why an answer was
    refused before it is asked again."""

    ask: Callable[[str, str | None], str]
    tell: Callable[[str], None]


@dataclass(frozen=True)
class Host:
    """What this machine tells: its environment, its GPU through NVML, and the version a server command
    runs (``vllm --version``)."""

    env: Mapping[str, str]
    gpu: GpuProfile | None
    version_of: Callable[[Sequence[str]], str | None]


def _answer(
    asker: Asker | None,
    option: str,
    question: str,
    given: str | None,
    default: str | None,
    parse: Callable[[str], _T],
) -> _T:
    """``given`` parsed; else, on a terminal, the answer to ``question`` (asked again until it parses);
    else ``default`` parsed, or :class:`SpecError` on ``option`` when there is none."""
    if given is not None:
        return parse(given)
    if asker is None:
        if default is None:
            raise SpecError(
                option, f"required: pass {option} (or run `autotune init` on a terminal to be asked)"
            )
        return parse(default)
    while True:
        try:
            return parse(asker.ask(question, default))
        except SpecError as exc:
            asker.tell(str(exc))


def _budget(text: str) -> tuple[int, float | None]:
    """``"30"`` launches, or ``"8h"`` of wall time (with up to 100 launches in it)."""
    match = re.fullmatch(r"\s*(\d+)\s*(h|hours?)?\s*", text)
    if not match or int(match.group(1)) < 1:
        raise SpecError("--budget", f"{text!r} is neither a count of launches (30) nor hours (8h)")
    return (int(match.group(1)), None) if match.group(2) is None else (100, float(match.group(1)))


def _name(text: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", text):
        raise SpecError(
            "--name", f"{text!r}: letters, digits, '_', '.' and '-', starting with a letter or digit"
        )
    return text


def _command(text: str, model: str | None) -> tuple[str, tuple[str, ...]]:
    """A ``vllm serve`` command and the model it serves (``model`` when given, else its first argument)."""
    argv = tuple(shlex.split(text))
    served = model or next((a for a in argv[2:] if not a.startswith("-")), None)
    if len(argv) < 3 or argv[1] != "serve" or served is None:
        raise SpecError("--command", f"{text!r} is not a `vllm serve MODEL ...` command")
    return served, argv


def gather(given: Given, asker: Asker | None, host: Host) -> Answers:
    """The answers: each from its flag, else asked (on a terminal), else its default; each checked."""
    model, gpu, gpu_auto, command = _served(given, asker, host)
    slo, input_len, output_len = _load(given, asker)
    launches, hours = _answer(
        asker, "--budget", "Budget: launches (30) or hours (8h)", given.budget, "30", _budget
    )
    storage = _answer(
        asker,
        "--storage",
        "Storage URL (empty: SQLite in the study's folder)",
        given.storage,
        "",
        lambda text: text.strip() or None,
    )
    version = None if given.search_space is not None else host.version_of(command)
    space = given.search_space or space_for(version, simulated=given.simulate)
    if not space.is_file():
        raise SpecError("--search-space", f"{space} is not a file")
    name = _name(given.name or re.sub(r"[^A-Za-z0-9_.-]+", "-", Path(model.name).name).strip("-.").lower())
    return Answers(
        name=name,
        model=model,
        gpu=gpu,
        gpu_auto=gpu_auto,
        command=command,
        simulated=given.simulate,
        max_model_len=given.max_model_len or model.arch.max_position_embeddings,
        slo=slo,
        input_len=input_len,
        output_len=output_len,
        dataset=given.dataset,
        launches=launches,
        hours=hours,
        storage=storage,
        space=space,
    )


def _served(given: Given, asker: Asker | None, host: Host) -> tuple[Model, GpuProfile, bool, tuple[str, ...]]:
    """What is served on what: the model, the GPU (and whether NVML found it), the server command."""
    model_name, command = given.model, None
    if given.command is not None:
        model_name, command = _command(given.command, given.model)
    model = _answer(
        asker,
        "--model",
        "Model (a Hugging Face id, a local folder or a catalog name)",
        model_name,
        None,
        lambda text: find_model(text, host.env),
    )
    if host.gpu is not None and given.gpu is None and not given.simulate:
        gpu, gpu_auto = host.gpu, True
    elif asker is None and given.gpu is None:
        raise SpecError("--gpu", f"no GPU found through NVML: name one ({', '.join(GPUS)})")
    else:
        gpu = _answer(asker, "--gpu", f"GPU ({', '.join(GPUS)})", given.gpu, None, find_gpu)
        gpu_auto = False
    if given.simulate:  # the simulator reads the architecture from source, serves the name requests use
        named = () if model.source == model.name else ("--served-model-name", model.name)
        command = ("python", "-m", "autotune.sim", model.source, "--sim-hardware", gpu.name, *named)
    return model, gpu, gpu_auto, command or ("vllm", "serve", model.name)


def _load(given: Given, asker: Asker | None) -> tuple[tuple[str, ...], str, str]:
    """The SLO terms and the prompt and reply lengths, from the kind of traffic's defaults."""
    traffic = _answer(asker, "--traffic", "Traffic (chat or batch)", given.traffic, "chat", _traffic)
    slo = _answer(
        asker,
        "--slo",
        "SLO terms",
        ", ".join(given.slo) if given.slo else None,
        ", ".join(traffic.slo),
        lambda text: slo_terms([t.strip() for t in text.split(",") if t.strip()]),
    )
    input_len = traffic.input_len
    if given.dataset is None:
        input_len = _answer(
            asker,
            "--input-len",
            "Prompt lengths in tokens (512-2048, or 1000)",
            given.input_len,
            traffic.input_len,
            _length_text("--input-len"),
        )
    output_len = _answer(
        asker,
        "--output-len",
        "Reply lengths in tokens (64-512, or 256)",
        given.output_len,
        traffic.output_len,
        _length_text("--output-len"),
    )
    return slo, input_len, output_len


def _length_text(option: str) -> Callable[[str], str]:
    """A parser that keeps a length's text once :func:`length` reads it."""

    def parse(text: str) -> str:
        length(text, option)
        return text.strip()

    return parse


def _traffic(text: str) -> Traffic:
    if text.strip().lower() not in TRAFFIC:
        raise SpecError("--traffic", f"{text!r}: one of {', '.join(TRAFFIC)}")
    return TRAFFIC[text.strip().lower()]
