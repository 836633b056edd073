"""A study as autotune runs it: the spec, its search space bound to the fixed flags, resolved paths.

:func:`load_study` reads the spec and its search space (:mod:`autotune.inputs.spec`, one file each) and does
the checks across the two: reserved and duplicated flags, constraints that name unknown flags, files the spec
points at. Every problem is a :class:`~autotune.errors.SpecError`; nothing is written.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Container, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from autotune.errors import SpecError
from autotune.executable import find_executable
from autotune.flags import FlagValue, flag_key
from autotune.hardware.catalog import ModelArch, load_model_arch
from autotune.inputs.space import SearchSpace, model_facts
from autotune.inputs.spec import (
    MemoryModelSpec,
    SearchSpaceSpec,
    ServerSection,
    StudySpec,
    load_space,
    read_spec,
)
from autotune.store.storage import check_folder, check_storage_url


@dataclass(frozen=True)
class LoadedStudy:
    """A validated spec with its search space (as written, and bound to the fixed flags) and paths."""

    spec: StudySpec
    space: SearchSpaceSpec
    search_space: SearchSpace
    """The space bound to ``server.args``: sampling, constraints, argv (built once per study)."""
    spec_path: Path
    space_path: Path
    workdir: Path
    storage_url: str
    storage_field: str = "study.storage"
    """Where the storage URL came from, for messages: ``study.storage`` or ``--storage``."""

    @property
    def base_dir(self) -> Path:
        """The spec file's directory: relative paths in the spec are resolved against it."""
        return self.spec_path.parent

    @property
    def tokenizer_path(self) -> Path | None:
        """``workload.tokenizer`` resolved against the spec's folder, or ``None``."""
        tokenizer = self.spec.workload.tokenizer
        return (self.base_dir / tokenizer).resolve() if tokenizer is not None else None

    def trial_dir(self, number: int) -> Path:
        """Where trial ``number`` keeps its server log and probe results."""
        return self.workdir / "trials" / str(number)

    def rerun_dir(self, number: int, seed: int) -> Path:
        """Where trial ``number``'s config measured again on the stream of ``seed`` (a finalists' round)
        keeps its server log and probe results."""
        return self.workdir / "confirmations" / f"{number}-{seed}"

    def server_argv(
        self,
        flags: Mapping[str, FlagValue],
        *,
        host: str | None = None,
        port: int | None = None,
        baseline: bool = False,
    ) -> list[str]:
        """The server's command line for ``flags``: the command, ``--host``/``--port`` when given, the fixed
        args, then the tuned flags, as separate argv items (never a shell string). ``baseline``: vLLM's
        defaults, so none of the tuned flags (the server picks them)."""
        where = [] if host is None else ["--host", host]
        where += [] if port is None else ["--port", str(port)]
        space = self.search_space
        tuned = space.baseline_argv() if baseline else space.argv(flags)
        return [*self.spec.server.command, *where, *tuned]

    def server_env(self, flags: Mapping[str, FlagValue], *, baseline: bool = False) -> dict[str, str | None]:
        """The server's environment on top of the tuner's: ``server.env``, then the space's environment
        parameters of ``flags`` (none for the defaults' trial)."""
        tuned = {} if baseline else self.search_space.env(flags)
        return {**self.spec.server.env, **tuned}

    def for_gpus(self, count: int) -> LoadedStudy:
        """This study for trials on ``count`` GPUs each (``gpus_per_trial`` in constraints; a
        ``tensor_parallel_size × data_parallel_size`` above it is rejected before launch)."""
        return dataclasses.replace(self, search_space=self.search_space.with_facts(gpus_per_trial=count))


def _check_command_flags(server: ServerSection, tuned: set[str]) -> None:
    """A flag in the command itself would override the tuned or fixed value (command line wins)."""
    for i, token in enumerate(server.command):
        if not token.startswith("--"):
            continue
        name = flag_key(token.split("=", 1)[0])
        if name.startswith("no_") and name[3:] in tuned | set(server.args):
            name = name[3:]
        if name in tuned or name in server.args or name in ("host", "port"):
            where = "tuned by the search space" if name in tuned else "set elsewhere in the spec"
            raise SpecError(
                f"server.command.{i}",
                f"{token!r} is {where}: a flag in the command would override the trial's value; "
                "remove it from server.command",
            )


def _check_authorization(spec: StudySpec) -> None:
    """``server.api_key_env`` sends ``Authorization: Bearer <key>`` on every request: an Authorization
    header in ``workload.headers`` too would be replaced by it (HTTP has one such header)."""
    if spec.server.api_key_env is None:
        return
    for name in spec.workload.headers:
        if name.lower() == "authorization":
            raise SpecError(
                f"workload.headers.{name}",
                f"conflicts with server.api_key_env ({spec.server.api_key_env!r}), which sends "
                "'Authorization: Bearer <key>' on every request and would replace it: keep one of them",
            )


def _refuse_fixed(name: str, fixed: Container[str], section: str, what: str) -> None:
    """Refuse a name the search space tunes that ``server.<section>`` (``fixed``) also sets (``what``: what
    the name is)."""
    if name in fixed:
        raise SpecError(f"server.{section}.{name}", f"{what}: remove one of them")


def load_study(path: Path | str, *, storage: str | None = None) -> LoadedStudy:
    """Load a study spec and its search space, resolve paths, and check names across the two.

    ``storage`` (``--storage`` / ``AUTOTUNE_STORAGE``) replaces ``study.storage``. Raises
    :class:`SpecError` for any problem; nothing is written.
    """
    spec_path = Path(path)
    storage_given = storage is not None
    spec = read_spec(spec_path)
    base = spec_path.parent
    space_path = (base / spec.search_space).resolve()
    space = load_space(space_path)
    for reserved in ("host", "port", "model"):
        if reserved in spec.server.args:
            raise SpecError(
                f"server.args.{reserved}",
                f"set the server's {reserved} with server.{reserved}, not as a flag in server.args",
            )
    for name in space.params:
        _refuse_fixed(
            name, spec.server.args, "args", f"flag is also a search-space parameter in {str(space_path)!r}"
        )
        json_flag = name.partition(".")[0]
        if "." in name and json_flag in spec.server.args:
            raise SpecError(
                f"server.args.{json_flag}",
                f"the search space composes --{json_flag.replace('_', '-')} from its {name!r} parameter: "
                f"give fixed keys as '{json_flag}.KEY' in server.args instead",
            )
    for name in space.env:
        _refuse_fixed(
            name, spec.server.env, "env", f"variable is also an environment parameter in {str(space_path)!r}"
        )
    tuned = {n.partition(".")[0] for n in space.params}
    _check_command_flags(spec.server, tuned)
    _check_authorization(spec)
    workdir = ((base / spec.study.workdir) if spec.study.workdir else (base / spec.study.name)).resolve()
    storage = storage or spec.study.storage or f"sqlite:///{workdir / 'study.db'}"
    arch = _check_memory_model(spec.memory_model, base) if spec.memory_model is not None else None
    arch = arch or _served_arch(spec.server.model, base)
    # Constraint expressions are checked against the names they may use (flags, fixed args, facts).
    bound = SearchSpace(space, spec.server.args, model_facts(arch) if arch is not None else None)
    if spec.workload.tokenizer is not None and not (base / spec.workload.tokenizer).exists():
        raise SpecError("workload.tokenizer", f"not found: {str(base / spec.workload.tokenizer)!r}")
    if spec.workload.dataset.path is not None:
        data_path = base / spec.workload.dataset.path
        if not data_path.is_file():
            raise SpecError("workload.dataset.path", f"file not found: {str(data_path)!r}")
    return LoadedStudy(
        spec=spec,
        space=space,
        search_space=bound,
        spec_path=spec_path.resolve(),
        space_path=space_path,
        workdir=workdir,
        storage_url=storage,
        storage_field="--storage" if storage_given else "study.storage",
    )


def _check_memory_model(section: MemoryModelSpec, base: Path) -> ModelArch:
    """The memory model's architecture, which must load (catalog name or a config.json beside the spec)."""
    try:
        return load_model_arch(resolve_model_path(section.model, base))
    except SpecError as exc:
        raise SpecError("memory_model.model", exc.message) from exc


def _served_arch(model: str, base: Path) -> ModelArch | None:
    """The architecture of ``server.model`` when it is a catalog name or a folder with a config.json
    (for the facts constraints may name), else ``None``."""
    try:
        return load_model_arch(resolve_model_path(model, base))
    except SpecError:
        return None


def resolve_model_path(model: str, base: Path) -> str:
    """A memory-model ``model`` as :func:`autotune.hardware.catalog.load_model_arch` takes it: a relative
    directory or file is resolved against the spec's directory; anything else is a catalog name."""
    candidate = base / model
    return str(candidate.resolve()) if candidate.exists() else model


def preflight(loaded: LoadedStudy, environ: Mapping[str, str]) -> None:
    """What a run needs from this machine, checked before anything is written: the server command is an
    executable (next to this interpreter, or on the ``PATH`` of ``environ`` and ``server.env``), the
    storage URL can be used, the study's folder can be created, and the environment variables the spec
    names are set. Raises :class:`SpecError`."""
    server = loaded.spec.server
    env = {**environ, **{k: v for k, v in server.env.items() if v is not None}}
    command = server.command[0]
    if find_executable(command, env.get("PATH")) is None:
        raise SpecError(
            "server.command.0",
            f"{command!r} is not an executable file nor found on PATH: install it, or give its full path",
        )
    check_storage_url(loaded.storage_url, loaded.storage_field)
    check_folder(loaded.workdir, "study.workdir")
    resolve_access(loaded, environ)


_VARIABLE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


@dataclass(frozen=True)
class Access:
    """What the tuner needs to talk to a server: its API key and the workload's extra headers (with
    ``${NAME}`` read from the environment). Its ``repr`` shows no secret."""

    api_key: str | None = field(default=None, repr=False)
    headers: Mapping[str, str] = field(default_factory=dict, repr=False)

    def request_headers(self) -> dict[str, str]:
        """Headers for every request: ``Authorization: Bearer <key>`` and the extra ones."""
        out = dict(self.headers)
        if self.api_key:
            out["Authorization"] = f"Bearer {self.api_key}"
        return out

    def server_env(self) -> dict[str, str]:
        """Environment for a launched server: the key as ``VLLM_API_KEY`` (vLLM reads it), never argv."""
        return {"VLLM_API_KEY": self.api_key} if self.api_key else {}

    def __repr__(self) -> str:
        return f"Access(api_key={'***' if self.api_key else None}, headers={sorted(self.headers)})"


def resolve_access(loaded: LoadedStudy, environ: Mapping[str, str]) -> Access:
    """The study's :class:`Access`, read from ``environ``. Raises :class:`SpecError` naming the field and
    the variable when one is missing or empty."""
    server, workload = loaded.spec.server, loaded.spec.workload
    key = None
    if server.api_key_env is not None:
        key = environ.get(server.api_key_env)
        if not key:
            raise SpecError(
                "server.api_key_env",
                f"the environment variable {server.api_key_env!r} is not set: export the API key in it",
            )
    headers = {
        name: expand_variables(text, environ, f"workload.headers.{name}")
        for name, text in workload.headers.items()
    }
    return Access(api_key=key, headers=headers)


def expand_variables(text: str, environ: Mapping[str, str], field: str) -> str:
    """``text`` with each ``${NAME}`` replaced by the environment variable ``NAME`` (a secret kept out of
    the spec). Raises :class:`SpecError` naming ``field`` and the variable when one is not set or holds a
    line break."""

    def value(match: re.Match[str]) -> str:
        got = environ.get(match.group(1))
        if got is None:
            raise SpecError(field, f"the environment variable {match.group(1)!r} is not set")
        if any(c in got for c in "\r\n"):
            raise SpecError(field, f"{match.group(1)!r} holds a line break")
        return got

    return _VARIABLE.sub(value, text)


def variables(text: str) -> list[str]:
    """The names of the ``${NAME}`` variables in ``text``."""
    return _VARIABLE.findall(text)
