"""Study specs and search spaces: YAML → validated, immutable spec objects (one file at a time).

Validation happens once, at the edge: here for each file, in :mod:`autotune.inputs.loader` for the checks
across the spec and its search space. Every problem becomes a :class:`SpecError` whose text names the field
path and the offending value, e.g. ``search_space.params.max_num_seqs: low (512) must be <= high (256)``.
Nothing else in autotune re-validates user input.
"""

from __future__ import annotations

import difflib
import math
import re
import shlex
import types
import typing
from collections.abc import Callable, Collection, Mapping, Sequence
from decimal import Decimal
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from autotune.errors import SpecError
from autotune.flags import FlagValue, flag_key
from autotune.hardware.catalog import GPUS
from autotune.inputs.slo_terms import MetricKey, SloTerm, parse_metric_key, parse_term
from autotune.units import parse_duration


def _duration(value: object) -> float:
    seconds = parse_duration(value)
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"must be a positive duration such as '500ms' or '30s', got {value!r}")
    return seconds


Duration = Annotated[float, BeforeValidator(_duration)]
"""A positive, finite number of seconds, given as a number or a string such as ``"500ms"``."""


def _flag_value(value: object) -> object:
    if not isinstance(value, bool | int | float | str):
        raise ValueError(f"a flag value must be a string, number or boolean, got {value!r}")
    return value


def _off_grid(value: float, low: float, step: float) -> bool:
    """Whether ``value`` is not ``low`` plus a whole number of ``step`` (decimal arithmetic, as Optuna)."""
    return (Decimal(str(value)) - Decimal(str(low))) % Decimal(str(step)) != 0


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=False)


def _number_not_bool(model: type[BaseModel], value: object, info: ValidationInfo) -> object:
    """``port: true`` is not port 1: a boolean where a number belongs is refused (pydantic's lax mode
    would take it as 0 or 1)."""
    if isinstance(value, bool) and info.field_name is not None:
        allowed = _annotation_types(model.model_fields[info.field_name].annotation)
        if bool not in allowed and (int in allowed or float in allowed):
            raise ValueError(f"expected a number, got {value!r}")
    return value


class _Section(_Frozen):
    """A spec section: every field refuses a boolean where a number belongs."""

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool(cls, value: object, info: ValidationInfo) -> object:
        return _number_not_bool(cls, value, info)


def _annotation_types(annotation: object) -> set[object]:
    """The plain types an annotation admits (``int | None`` → {int, NoneType})."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is typing.Annotated:
        return _annotation_types(args[0])
    if args and typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return set().union(*(_annotation_types(a) for a in args))
    return {annotation}


# ----------------------------------------------------------------------------------------------
# Search space
# ----------------------------------------------------------------------------------------------


class _Range(_Frozen):
    """A numeric flag's range: its bounds, step, default and unset value refuse a boolean where a number
    belongs (not its ``type``, the discriminator, nor ``log``)."""

    @field_validator("low", "high", "step", "default", "unset", mode="before", check_fields=False)
    @classmethod
    def _no_bool(cls, value: object, info: ValidationInfo) -> object:
        return _number_not_bool(cls, value, info)


class IntParam(_Range):
    """An integer flag, optionally log-scaled or stepped."""

    type: Literal["int"]
    low: int
    high: int
    log: bool = False
    step: int = 1
    default: int | None = None
    """vLLM's default (optional: the server reports the effective one at the defaults' trial)."""
    unset: int | None = None
    """A value that passes no flag at all (vLLM then picks its own)."""

    @model_validator(mode="after")
    def _check(self) -> IntParam:
        _check_order(self.low, self.high)
        if self.step < 1:
            raise ValueError(f"step ({self.step}) must be >= 1")
        if self.log and self.low < 1:
            raise ValueError(f"low ({self.low}) must be >= 1 when log is true")
        if self.log and self.step != 1:
            raise ValueError("step must be 1 when log is true")
        _check_grid(self, lambda value: (value - self.low) % self.step != 0)
        return self


class FloatParam(_Range):
    """A real-valued flag, optionally stepped (e.g. gpu-memory-utilization in steps of 0.02)."""

    type: Literal["float"]
    low: float
    high: float
    step: float | None = None
    log: bool = False
    default: float | None = None
    """vLLM's default (optional: the server reports the effective one at the defaults' trial)."""
    unset: float | None = None
    """A value that passes no flag at all (vLLM then picks its own)."""

    @model_validator(mode="after")
    def _check(self) -> FloatParam:
        if not (math.isfinite(self.low) and math.isfinite(self.high)):
            raise ValueError("low and high must be finite")
        _check_order(self.low, self.high)
        if self.step is not None and self.step <= 0:
            raise ValueError(f"step ({self.step}) must be > 0")
        if self.log and self.low <= 0:
            raise ValueError(f"low ({self.low}) must be > 0 when log is true")
        if self.log and self.step is not None:
            raise ValueError("step and log cannot both be set")
        _check_grid(self, lambda value: self.step is not None and _off_grid(value, self.low, self.step))
        return self


def _check_order(low: float | None, high: float | None) -> None:
    """Raise when ``low`` is above ``high`` (either may be missing)."""
    if low is not None and high is not None and low > high:
        raise ValueError(f"low ({low}) must be <= high ({high})")


def _check_grid(param: IntParam | FloatParam, off_grid: Callable[[float], bool]) -> None:
    """Raise unless the range of ``param`` is a whole number of steps and its default and unset value,
    where given, lie in the range on a step (``off_grid``: whether a value is not low plus a whole number
    of steps)."""
    low, high = param.low, param.high
    if off_grid(high):
        raise ValueError(f"range [{low}, {high}] is not a whole number of steps ({param.step})")
    for key, value in (("default", param.default), ("unset", param.unset)):
        if value is None:
            continue
        if not low <= value <= high:
            raise ValueError(f"{key} ({value}) must lie in [{low}, {high}]")
        if off_grid(value):
            raise ValueError(f"{key} ({value}) must be low ({low}) plus a multiple of step ({param.step})")


class CategoricalParam(_Frozen):
    """A flag with a fixed set of choices (block size, KV-cache dtype)."""

    type: Literal["categorical"]
    choices: tuple[int | float | str, ...]
    default: int | float | str | None = None
    """vLLM's default (optional: the server reports the effective one at the defaults' trial)."""
    unset: int | float | str | None = None
    """A choice that passes no flag at all (``auto``: vLLM picks); in a composed JSON flag
    (``speculative_config.method: off``) it leaves the whole flag out."""

    @model_validator(mode="after")
    def _check(self) -> CategoricalParam:
        if not self.choices:
            raise ValueError("choices must not be empty")
        if len(set(self.choices)) != len(self.choices):
            raise ValueError(f"choices {list(self.choices)} contain duplicates")
        for key, value in (("default", self.default), ("unset", self.unset)):
            if value is not None and value not in self.choices:
                raise ValueError(f"{key} ({value!r}) must be one of {list(self.choices)}")
        return self


class BoolParam(_Frozen):
    """An on/off flag, passed as ``--flag`` / ``--no-flag`` (chunked prefill)."""

    type: Literal["bool"]
    default: bool | None = None
    """vLLM's default (optional: the server reports the effective one at the defaults' trial)."""
    unset: bool | None = None
    """A value that passes no flag at all."""


ParamSpec = Annotated[IntParam | FloatParam | CategoricalParam | BoolParam, Field(discriminator="type")]


class ConstraintSpec(_Section):
    """A known rule between flags: a boolean expression over flag names and fixed server args."""

    expr: str
    why: str = ""


_VERSION = re.compile(r"^\d+(?:\.\d+){0,2}$")
_PARAM_NAME = re.compile(r"^[a-z][a-z0-9_]*(?:\.[a-z][a-z0-9_]*)?$")
_ENV_NAME = re.compile(r"^[A-Z_][A-Z0-9_]*$")


class SearchSpaceSpec(_Section):
    """A search space file: parameters keyed by snake-case flag name (``json_flag.key`` for a key of a
    JSON flag such as ``--speculative-config``), environment variables of the server as parameters,
    known constraints, and the vLLM versions it was checked against."""

    name: str = ""
    description: str = ""
    vllm_versions: tuple[str, ...] = ()
    """The vLLM versions the flags, defaults and constraints were checked against (``0.34`` is every
    0.34.x); ``validate`` and each launch compare them with the server's version and warn."""
    params: dict[str, ParamSpec]
    env: dict[str, ParamSpec] = Field(default_factory=dict)
    """Environment variables of the server as parameters (passed in its environment, never argv): a
    boolean is ``1``/``0``, anything else its text."""
    constraints: tuple[ConstraintSpec, ...] = ()

    @field_validator("vllm_versions", mode="before")
    @classmethod
    def _versions(cls, value: object) -> object:
        if isinstance(value, str | int | float):
            value = [value]
        if isinstance(value, list | tuple):
            out = []
            for item in value:
                text = str(item)
                if isinstance(item, bool) or not _VERSION.match(text):
                    raise ValueError(f"{item!r} is not a vLLM version such as '0.34' or '0.34.0'")
                out.append(text)
            return tuple(out)
        return value

    @field_validator("params")
    @classmethod
    def _non_empty(cls, value: dict[str, Any]) -> dict[str, Any]:
        if not value:
            raise ValueError("must define at least one parameter")
        for name in value:
            if not _PARAM_NAME.match(name):
                raise ValueError(
                    f"parameter name {name!r} must be a snake-case vLLM flag name (or json_flag.key)"
                )
        return value

    @field_validator("env")
    @classmethod
    def _env_names(cls, value: dict[str, Any]) -> dict[str, Any]:
        for name in value:
            if not _ENV_NAME.match(name):
                raise ValueError(f"environment variable {name!r} must be upper case (VLLM_...)")
        return value

    def all_params(self) -> dict[str, IntParam | FloatParam | CategoricalParam | BoolParam]:
        """Flag parameters, then environment parameters (the names Optuna samples)."""
        return {**self.params, **self.env}

    def defaults(self) -> dict[str, FlagValue]:
        """The vLLM defaults this space declares (parameters without ``default:`` are left out: the
        server reports them at the defaults' trial)."""
        return {name: p.default for name, p in self.all_params().items() if p.default is not None}


# ----------------------------------------------------------------------------------------------
# Study spec
# ----------------------------------------------------------------------------------------------


class StudySection(_Section):
    """Study identity and storage."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    storage: str | None = None
    """An Optuna storage URL; default ``sqlite:///<workdir>/study.db``."""
    workdir: str | None = None
    """Where storage and per-trial logs go; default ``<spec dir>/<name>``."""


class ServerSection(_Section):
    """How to launch the server under test."""

    command: tuple[str, ...]
    """The launch command without tuned flags, e.g. ``[vllm, serve, MODEL]`` (a string is shlex-split)."""
    model: str
    """The served model name: must appear in ``/v1/models``; requests use it."""
    args: dict[str, Annotated[FlagValue, BeforeValidator(_flag_value)]] = Field(default_factory=dict)
    """Fixed flags for every trial (``max-model-len: 4096``); booleans become --x / --no-x."""
    env: dict[str, str | None] = Field(default_factory=dict)
    """Environment for the server on top of the tuner's; a null value unsets a variable."""
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    """0 picks a free port for each trial."""
    start_timeout: Duration = 900.0
    stop_timeout: Duration = 30.0
    api_key_env: str | None = Field(default=None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    """The environment variable holding the server's API key: the server gets it as ``VLLM_API_KEY`` (never
    on a command line), every request as ``Authorization: Bearer``; it is never written anywhere."""

    @field_validator("command", mode="before")
    @classmethod
    def _split(cls, value: object) -> object:
        if isinstance(value, str):
            value = shlex.split(value)
        if isinstance(value, list | tuple) and not value:
            raise ValueError("must not be empty")
        if isinstance(value, list | tuple) and isinstance(value[0], str) and not value[0].strip():
            raise ValueError(
                f"the program (argv item 0) is {'empty' if not value[0] else 'only whitespace'} in "
                f"{list(value)!r}: give the program, then its arguments, e.g. [vllm, serve, MODEL]"
            )
        return value

    @field_validator("args")
    @classmethod
    def _normalise(cls, value: dict[str, FlagValue]) -> dict[str, FlagValue]:
        out: dict[str, FlagValue] = {}
        spelled: dict[str, str] = {}
        for name, flag in value.items():
            key = flag_key(name)
            if key in out:
                raise ValueError(f"{spelled[key]!r} and {name!r} are the same flag {key!r}: keep one")
            out[key], spelled[key] = flag, name
        return out


class _Dist(_Section):
    """A distribution that a bare value stands for as fixed (``512`` is ``{dist: fixed, value: 512}``)."""

    _BARE: ClassVar[tuple[type, ...]] = (int,)
    """The types of a bare value."""

    @model_validator(mode="before")
    @classmethod
    def _from_bare(cls, data: object) -> object:
        if isinstance(data, cls._BARE) and not isinstance(data, bool):
            return {"dist": "fixed", "value": data}
        return data


class LengthDist(_Dist):
    """A token-length distribution: fixed, uniform, normal or lognormal, clipped to [low, high]."""

    dist: Literal["fixed", "uniform", "normal", "lognormal"] = "fixed"
    value: int | None = None
    low: int | None = None
    high: int | None = None
    mean: float | None = None
    std: float | None = None

    @model_validator(mode="after")
    def _check(self) -> LengthDist:
        if self.dist == "fixed":
            if self.value is None or self.value < 1:
                raise ValueError(f"fixed length needs value >= 1, got {self.value}")
        elif self.dist == "uniform":
            if self.low is None or self.high is None:
                raise ValueError("uniform needs low and high")
        elif self.mean is None or self.std is None or self.mean <= 0 or self.std < 0:
            raise ValueError(f"{self.dist} needs mean > 0 and std >= 0")
        if self.low is not None and self.low < 1:
            raise ValueError(f"low ({self.low}) must be >= 1")
        _check_order(self.low, self.high)
        return self

    @property
    def upper(self) -> int:
        """The largest length this distribution can produce (for capacity checks)."""
        if self.dist == "fixed":
            assert self.value is not None
            return self.value
        if self.high is not None:
            return self.high
        assert self.mean is not None and self.std is not None
        return int(self.mean + 6 * self.std) + 1


def _seconds(value: object) -> float:
    seconds = parse_duration(value)
    if not math.isfinite(seconds):
        raise ValueError(f"must be a finite duration such as '2s', got {value!r}")
    return seconds


Seconds = Annotated[float, BeforeValidator(_seconds)]
"""A finite number of seconds >= 0, given as a number or a string such as ``"1.5s"``."""


class PrefixSpec(_Section):
    """Shared-prefix groups: several system prompts, each starting the prompts of its share of requests.

    Each group's length is drawn once per study from ``len`` (the workload seed), or, with ``hit_rate``,
    every group gets the length that makes that share of a (first-turn) prompt's tokens a group prefix.
    A request's group is drawn from the study's stream with ``weights``; the groups' tokens are drawn per
    probe (the probe's number), so a probe's requests share them and no probe is served from another's.
    """

    groups: int = Field(default=1, ge=1, le=1000)
    """How many distinct system prompts."""
    len: LengthDist | None = None
    """Each group's prefix length in tokens (drawn once per group)."""
    hit_rate: float | None = Field(default=None, gt=0, lt=1)
    """Instead of ``len``: the share of a first turn's prompt tokens that are its group's prefix (what a
    cache keeping every prefix could serve): each group's length is ``hit_rate / (1 - hit_rate)`` times
    the mean of ``input_len``."""
    weights: tuple[float, ...] | None = None
    """How often each group is used, relatively (default: equally); one per group, each > 0."""

    @field_validator("weights")
    @classmethod
    def _weights(cls, value: tuple[float, ...] | None, info: ValidationInfo) -> tuple[float, ...] | None:
        if value is None:
            return value
        groups = info.data.get("groups")
        if groups is not None and len(value) != groups:
            raise ValueError(f"needs one weight per group ({groups}), got {len(value)}: {list(value)}")
        if not all(math.isfinite(w) and w > 0 for w in value):
            raise ValueError(f"each weight must be > 0, got {list(value)}")
        return value

    @model_validator(mode="after")
    def _one_length(self) -> PrefixSpec:
        if (self.len is None) == (self.hit_rate is None):
            raise ValueError(
                "give the groups' length as len (tokens) or hit_rate (share of a prompt), exactly one of them"
            )
        return self


class DatasetSpec(_Section):
    """Where prompts come from: synthetic lengths, or a local file (ShareGPT JSON, JSONL, trace)."""

    kind: Literal["synthetic", "sharegpt", "jsonl", "trace"] = "synthetic"
    input_len: LengthDist = LengthDist(dist="fixed", value=256)
    output_len: LengthDist = LengthDist(dist="fixed", value=128)
    prefix_len: int = Field(default=0, ge=0)
    """A shared system-prompt prefix of this many tokens on every request."""
    prefix: PrefixSpec | None = None
    """Shared-prefix groups (several system prompts): synthetic prompts only (kinds synthetic, trace)."""
    path: str | None = None
    time_scale: float | None = Field(default=None, gt=0)
    """A trace's replay speed: 2 replays its timestamps twice as fast (kind trace only). The rate search
    still moves the replay's rate; this sets the rate of the trace as recorded, times ``time_scale``:
    the rate ``autotune bench`` replays it at without ``--rate``, and the speed each probe reports."""

    @field_validator("prefix")
    @classmethod
    def _prefix_needs_synthetic_prompts(
        cls, value: PrefixSpec | None, info: ValidationInfo
    ) -> PrefixSpec | None:
        kind = info.data.get("kind")
        if value is not None and kind in ("sharegpt", "jsonl"):
            raise ValueError(f"needs synthetic prompts (kind 'synthetic' or 'trace'), got kind {kind!r}")
        if value is not None and info.data.get("prefix_len"):
            raise ValueError(f"give prefix or prefix_len ({info.data['prefix_len']}), not both")
        return value

    @field_validator("time_scale")
    @classmethod
    def _scale_needs_trace(cls, value: float | None, info: ValidationInfo) -> float | None:
        kind = info.data.get("kind")
        if value is not None and kind != "trace":
            raise ValueError(f"scales a trace's timestamps: needs kind 'trace', got kind {kind!r}")
        return value

    @model_validator(mode="after")
    def _check(self) -> DatasetSpec:
        if self.kind != "synthetic" and not self.path:
            raise ValueError(f"dataset kind {self.kind!r} needs a path")
        return self


class ArrivalSpec(_Section):
    """The arrival process for a probe at a given rate: Poisson, gamma (burstiness), or fixed concurrency."""

    process: Literal["poisson", "gamma", "concurrency", "trace"] = "poisson"
    burstiness: float = Field(default=1.0, gt=0)


class ThinkTime(_Dist):
    """The pause between a reply's end and the next turn of its conversation: fixed, exponential or
    uniform, in seconds (``2s``, ``500ms``)."""

    dist: Literal["fixed", "exponential", "uniform"] = "fixed"
    value: Seconds | None = None
    """The fixed pause."""
    mean: Seconds | None = None
    """The exponential's mean (clipped to ``high`` when given)."""
    low: Seconds | None = None
    high: Seconds | None = None

    _BARE = (int, float, str)

    @model_validator(mode="after")
    def _check(self) -> ThinkTime:
        if self.dist == "fixed" and self.value is None:
            raise ValueError("a fixed think time needs value (seconds)")
        if self.dist == "exponential" and not self.mean:
            raise ValueError(f"an exponential think time needs mean > 0, got {self.mean}")
        if self.dist == "uniform" and (self.low is None or self.high is None):
            raise ValueError("a uniform think time needs low and high")
        _check_order(self.low, self.high)
        return self


class ConversationSpec(_Section):
    """Multi-turn chat: each conversation is ``turns`` requests; a turn's prompt is the conversation so far
    (the previous prompts and the replies received) plus a new message of ``dataset.input_len`` tokens,
    sent ``think_time`` after the previous reply ended."""

    turns: LengthDist
    """Turns per conversation (>= 1)."""
    think_time: ThinkTime = ThinkTime(dist="fixed", value=0.0)


class WorkloadSpec(_Section):
    """The traffic to tune for."""

    endpoint: Literal["completions", "chat"] = "completions"
    dataset: DatasetSpec = DatasetSpec()
    arrival: ArrivalSpec = ArrivalSpec()
    ignore_eos: bool = True
    seed: int = 0
    temperature: float = Field(default=0.0, ge=0)
    prompt_format: Literal["text", "token_ids"] = "text"
    """Synthetic prompts as words, calibrated to exact token lengths through the server's ``/tokenize``
    (else the model's tokenizer.json), or as token-id lists (completions endpoint only)."""
    tokenizer: str | None = None
    """A tokenizer.json (or a folder holding one) to calibrate text prompts with when the server has no
    ``/tokenize``; relative to the spec's folder. By default the model's own is looked up."""
    headers: dict[str, str] = Field(default_factory=dict)
    """Extra HTTP headers on every request (a gateway's own); ``${NAME}`` in a value is read from the
    environment, so a secret stays out of the spec."""

    @field_validator("headers")
    @classmethod
    def _headers(cls, value: dict[str, str]) -> dict[str, str]:
        return _check_headers(value, _RESERVED_HEADERS, "autotune itself")

    conversation: ConversationSpec | None = None
    """Multi-turn chat (absent: every request is a conversation of its own)."""
    expected_rate: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    """The traffic the deployment expects, in the arrival process's unit (requests per second; streams
    for ``concurrency``). Every config's latency objectives are read at this one load (absent:
    ``measurement.reference_fraction`` of the defaults' SLO rate)."""

    @field_validator("conversation")
    @classmethod
    def _conversation(cls, value: ConversationSpec | None, info: ValidationInfo) -> ConversationSpec | None:
        if value is None:
            return value
        dataset, arrival = info.data.get("dataset"), info.data.get("arrival")
        if dataset is not None and dataset.kind != "synthetic":
            raise ValueError(
                f"needs dataset kind 'synthetic' (each turn's message and reply lengths are drawn from "
                f"input_len and output_len), got {dataset.kind!r}"
            )
        if arrival is not None and arrival.process not in ("poisson", "gamma"):
            raise ValueError(
                f"needs arrival process 'poisson' or 'gamma' (conversations start at the probe's rate), got "
                f"{arrival.process!r}"
            )
        if info.data.get("prompt_format") == "token_ids":
            raise ValueError("needs prompt_format 'text' (a turn sends the replies received, as text)")
        return value

    @model_validator(mode="after")
    def _ids_need_completions(self) -> WorkloadSpec:
        if self.prompt_format == "token_ids" and self.endpoint == "chat":
            raise ValueError("prompt_format 'token_ids' needs endpoint 'completions' (chat sends text)")
        return self


_HEADER_NAME = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")
_RESERVED_HEADERS = {"host", "content-length", "content-type", "accept", "x-request-id", "transfer-encoding"}


def _check_headers(value: dict[str, str], reserved: Collection[str], setter: str) -> dict[str, str]:
    """``value`` unless a header's name is not an HTTP header name or is one of ``reserved`` (which
    ``setter`` sets), or its value is not one line of ASCII."""
    for name, text in value.items():
        if not _HEADER_NAME.match(name):
            raise ValueError(f"{name!r} is not an HTTP header name")
        if name.lower() in reserved:
            raise ValueError(f"{name!r} is set by {setter}: remove it")
        if any(c in text for c in "\r\n") or not text.isascii():
            raise ValueError(f"header {name!r}: its value must be one line of ASCII")
    return value


def _slo_term(value: object) -> SloTerm:
    if isinstance(value, SloTerm):
        return value
    if not isinstance(value, str):
        raise ValueError(f"must be a term such as 'ttft:p95<=500ms', got {value!r}")
    return parse_term(value)


class SloSection(_Section):
    """Latency SLO terms plus the fraction of requests allowed to fail."""

    terms: tuple[Annotated[SloTerm, BeforeValidator(_slo_term)], ...]
    error_budget: float = Field(default=0.0, ge=0, le=1)

    @field_validator("terms", mode="before")
    @classmethod
    def _parse(cls, value: object) -> object:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list | tuple) or not value:
            raise ValueError("must be a non-empty list such as ['ttft:p95<=500ms']")
        return value


def _renamed(data: dict[str, Any], old: str, new: str, new_path: str, old_path: str) -> dict[str, Any]:
    """``data`` with its key ``old``, a former name, spelt ``new``; raises when both are given (the error
    names them ``new_path`` and ``old_path``)."""
    if new in data:
        raise ValueError(f"give {new_path} only ({old_path} is its former name)")
    return {(new if k == old else k): v for k, v in data.items()}


class MeasurementSpec(_Section):
    """How SLO-constrained throughput is searched within one launch (rate probes)."""

    @model_validator(mode="before")
    @classmethod
    def _old_name(cls, data: object) -> object:
        if isinstance(data, dict) and "rate_tolerance" in data:
            tolerance = data["rate_tolerance"]
            data = _renamed(data, "rate_tolerance", "precision", "measurement.precision", "rate_tolerance")
            if isinstance(tolerance, bool) or not isinstance(tolerance, int | float) or not 0 < tolerance < 1:
                raise ValueError(f"rate_tolerance must be a number in (0, 1), got {tolerance!r}")
            data["precision"] = tolerance / 2
        return data

    probe_duration: Duration = 20.0
    """Arrival window of one probe at a given rate."""
    min_requests: int = Field(default=100, ge=10)
    """Fewest completed requests a probe needs to judge its percentiles."""
    min_tail_samples: int = Field(default=5, ge=1)
    """A pN term needs at least this many requests beyond the percentile: n >= k / (1 - N/100)."""
    saturation_requests: int = Field(default=200, ge=10)
    max_probes: int = Field(default=8, ge=2)
    precision: float = Field(default=0.025, gt=0, lt=0.5)
    """The rate search stops when the probes around the estimated boundary are no further than this
    fraction of it on each side (or than its sampling noise). ``rate_tolerance`` (a bisection's bracket,
    the former setting) is read as twice this."""
    warmup_requests: int = Field(default=0, ge=0)
    request_timeout: Duration = 120.0
    max_concurrency: int | None = Field(default=None, ge=1)
    reference_fraction: float = Field(default=0.5, gt=0, le=1)
    """Without ``workload.expected_rate``, the load at which every config's latency objectives are read:
    this fraction of the SLO rate of vLLM's defaults (of the first config measured when the defaults were
    not), one probe per trial after its rate search."""
    invalid_retries: int = Field(default=2, ge=0)
    """How often a probe whose run failed the client's self-check is repeated (the trial then ends as a
    transient fault, see ``faults``)."""
    invalid_pause: Duration = 5.0
    """Pause before such a repeat (lets a neighbour's burst of CPU pass)."""
    client: Literal["raw", "aiohttp"] = "raw"
    """The streaming client's HTTP engine: autotune's own HTTP/1.1 client on asyncio (the default: the
    cheapest per chunk and the most accurate ITL in benchmarks/RESULTS.md), or aiohttp."""
    client_workers: int | Literal["auto"] = "auto"
    """Client processes, each with its own event loop and share of the arrivals; ``auto`` (the default)
    starts with one and adds one after each run the client could not keep up with (voided by its
    self-check, or over 70 % of a core), up to the cores it may use (affinity and CPU quota): one process
    measured every rate up to 38,400 chunks a second validly on one core beside the server
    (benchmarks/RESULTS.md, "How fast a server one client process measures"), so most studies never
    grow; a count fixes it."""

    @field_validator("client_workers", mode="before")
    @classmethod
    def _workers(cls, value: object) -> object:
        if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 64):
            return value
        raise ValueError(f"must be 'auto' or a whole number of processes from 1 to 64, got {value!r}")

    def scaled(self, factor: float) -> MeasurementSpec:
        """These settings with probes ``factor`` times longer, needing as many times ``min_requests`` (a
        finalist's rerun: ``finalists.probe_scale``)."""
        return self.model_copy(
            update={
                "probe_duration": self.probe_duration * factor,
                "min_requests": math.ceil(self.min_requests * factor),
            }
        )


class Objective(_Section):
    """One study objective: a metric at the SLO-constrained operating point and its direction."""

    metric: str
    direction: Literal["maximize", "minimize"]

    @field_validator("metric")
    @classmethod
    def _known(cls, value: str) -> str:
        if value in OBJECTIVE_METRICS:
            return value
        try:
            key = parse_metric_key(value)
        except ValueError as exc:
            raise ValueError(
                f"unknown objective metric {value!r}: use one of {', '.join(OBJECTIVE_METRICS)} "
                "or a latency statistic such as 'ttft:p95'"
            ) from exc
        return key.key  # canonical: 'ttft:median' -> 'ttft:p50'


OBJECTIVE_METRICS = ("slo_throughput", "request_throughput", "goodput")
_OBJECTIVE_UNITS = {"slo_throughput": "tok/s", "request_throughput": "req/s", "goodput": "req/s"}


def objective_unit(metric: str) -> str:
    """The unit of an objective's values: ``tok/s`` (output tokens), ``req/s``, or ``ms`` for a latency
    statistic such as ``ttft:p95`` (the trial stores those in milliseconds); ``""`` when unknown."""
    return _OBJECTIVE_UNITS.get(metric, "ms" if ":" in metric else "")


class CostSpec(_Section):
    """What a GPU costs, to state each config's cost per million output tokens."""

    gpu_hour: float = Field(gt=0, allow_inf_nan=False)
    """The price of one GPU for one hour."""
    currency: str = Field(default="$", min_length=1, max_length=8)
    """How the price is written (``$``, ``EUR``)."""


class BudgetSpec(_Section):
    """When the study stops: server launches and/or wall time."""

    launches: int = Field(default=30, ge=1)
    """Trials that launched a server and ended (measured, or pruned for what the server did); configs
    rejected before a launch (known constraints, repeats of a failed start, the memory model) are
    recorded but do not spend it. Spelt ``trials`` before; that key is still read."""
    wall_time: Duration | None = None
    """Wall time of one run of ``autotune tune``."""
    max_rejected: int | None = Field(default=None, ge=1)
    """Stop when this many configs in all were rejected before a launch (a space that yields almost only
    rejects); default ``max(100, 5 × launches)``."""

    @model_validator(mode="before")
    @classmethod
    def _old_name(cls, data: object) -> object:
        if isinstance(data, dict) and "trials" in data:
            data = _renamed(data, "trials", "launches", "budget.launches", "budget.trials")
        return data

    @property
    def rejected_cap(self) -> int:
        """How many rejected-before-launch configs stop the study."""
        return self.max_rejected if self.max_rejected is not None else max(100, 5 * self.launches)


class FaultSpec(_Section):
    """Faults of the tuner or its environment that may pass (a port taken, a GPU briefly held by another
    process, a probe the client could not measure, storage briefly unreachable): retried with a pause
    that doubles each time, up to ``retries`` times in a row, before the study stops."""

    retries: int = Field(default=3, ge=0)
    pause: Duration = 30.0
    """The first pause; each further retry in a row waits twice as long (at most 10 minutes)."""


class FinalistSpec(_Section):
    """Before the study ends, its leader, the configs its search could not tell from the leader, and
    vLLM's defaults are measured again on fresh requests: the recommendation and its gain come from those
    reruns (autotune/study/finalists.py)."""

    count: int = Field(default=3, ge=0)
    """At most this many configs are measured again besides the defaults: the leader, then those the
    search could not tell from it (compared pair by pair on the stream both met); 0: none."""
    rounds: int = Field(default=1, ge=1)
    """How many times each finalist is measured again (each round on its own fresh stream, the same for
    every finalist of the round)."""
    probe_scale: float = Field(default=1.0, ge=1.0)
    """Rerun probes last this many times ``measurement.probe_duration`` (and need as many times
    ``measurement.min_requests``)."""
    max_share: float = Field(default=0.1, gt=0.0, le=1.0)
    """The reruns of finalists besides the leader and the defaults (which are always measured again) are
    kept only while the stage stays within this share of the study's time: each rerun estimated from its
    config's own trial (its duration, its probes ``probe_scale`` times longer), the study's time from
    every finished trial's duration; 1: no bound but ``count``."""
    target: float | None = Field(default=0.03, gt=0.0, lt=1.0)
    """Race the finalists (``null``: ``rounds`` rounds, no more): after the ``rounds`` rounds, one more
    round at a time, on a fresh stream shared by all, while the pick's gain over the defaults is known less
    precisely than ± this (0.03: ±3 points), the next round fits ``max_share`` of the study's time and
    ``max_rounds`` allows; a config that trails the pick beyond its paired interval drops out."""
    max_rounds: int = Field(default=8, ge=1)
    """The most rounds a race runs."""


class MemoryModelSpec(_Section):
    """Which architecture and device the memory model predicts for (feasibility before launch)."""

    model: str
    """A catalog model (``Llama-3.1-8B``) or a directory with a ``config.json`` (relative to the spec)."""
    gpu: str = "auto"
    """A catalog GPU profile (``RTX-4090-24GB``) or ``auto``: the local GPU through NVML."""
    min_start_probability: float = Field(default=0.005, gt=0, lt=1)
    """A config whose predicted chance to start is below this is pruned without a launch."""

    @field_validator("gpu")
    @classmethod
    def _known_gpu(cls, value: str) -> str:
        if value == "auto":
            return value
        for name in GPUS:
            if name.lower() == value.lower():
                return name
        raise ValueError(f"unknown GPU profile {value!r}: use 'auto' (NVML) or one of {', '.join(GPUS)}")


class SamplerSpec(_Section):
    """The Optuna sampler."""

    name: Literal["tpe", "random", "nsga2", "gp"] = "tpe"
    seed: int | None = 0
    startup_trials: int = Field(default=8, ge=0)
    surrogate: bool = True
    """Let the calibrated surrogate propose the launches (:mod:`autotune.predict.surrogate`) where the memory
    model knows the model and the GPU; the sampler takes over when it predicts badly. Off: the sampler
    draws every config."""


NotifyEvent = Literal["finished", "stopped", "new_best"]
NOTIFY_EVENTS: tuple[NotifyEvent, ...] = ("finished", "stopped", "new_best")
"""What a notification can be sent for: the study finished its budget, it stopped before (a fault that
retries did not mend, or a signal), a trial beat the best feasible result so far."""


class WebhookSpec(_Section):
    """A URL that gets each notification as a JSON POST."""

    url: str
    """``http://`` or ``https://``; ``${NAME}`` in it is read from the environment (a secret token)."""
    headers: dict[str, str] = Field(default_factory=dict)
    """Extra headers; ``${NAME}`` in a value is read from the environment."""

    @field_validator("url")
    @classmethod
    def _url(cls, value: str) -> str:
        scheme, sep, rest = value.partition("://")
        if not sep or scheme.lower() not in ("http", "https") or not rest.strip("/"):
            raise ValueError(f"must be an http:// or https:// URL, got {value!r}")
        if any(c.isspace() for c in value):
            raise ValueError(f"must not hold spaces or line breaks, got {value!r}")
        return value

    @field_validator("headers")
    @classmethod
    def _headers(cls, value: dict[str, str]) -> dict[str, str]:
        return _check_headers(
            value, ("host", "content-length", "transfer-encoding"), "the HTTP client itself"
        )


class NotifySpec(_Section):
    """Notifications: a command (an argv list, never a shell) and/or a webhook, on some study events. A
    notification that fails is logged to the event log and never stops the study."""

    events: tuple[NotifyEvent, ...] = NOTIFY_EVENTS
    command: tuple[str, ...] | None = None
    """Run with the notification as JSON on stdin (and ``AUTOTUNE_EVENT``, ``AUTOTUNE_STUDY``,
    ``AUTOTUNE_TEXT`` in its environment)."""
    webhook: WebhookSpec | None = None
    timeout: Duration = 10.0
    """How long one notification may take (the command is killed, the request dropped, after it)."""

    @field_validator("command", mode="before")
    @classmethod
    def _argv(cls, value: object) -> object:
        if isinstance(value, str):
            raise ValueError(
                f"must be a list of argv items (it is never run by a shell), e.g. [notify-send, autotune], "
                f"got {value!r}"
            )
        if isinstance(value, list | tuple):
            if not value:
                raise ValueError(
                    f"must not be empty, got {list(value)!r}: give the program and its arguments"
                )
            for index, item in enumerate(value):
                if isinstance(item, str) and not item.strip():
                    raise ValueError(
                        f"argv item {index} is {'empty' if not item else 'only whitespace'} ({item!r}) in "
                        f"{list(value)!r}: give the program, then its arguments, e.g. [notify-send, autotune]"
                    )
        return value

    @field_validator("events", mode="before")
    @classmethod
    def _events(cls, value: object) -> object:
        if isinstance(value, str):
            value = [value]
        if isinstance(value, list | tuple) and not value:
            raise ValueError(f"must name at least one of {', '.join(NOTIFY_EVENTS)}")
        return value

    @model_validator(mode="after")
    def _something(self) -> NotifySpec:
        if self.command is None and self.webhook is None:
            raise ValueError("give a command, a webhook, or both")
        return self


class StudySpec(_Section):
    """A whole study spec, with paths resolved against the spec file's directory."""

    study: StudySection
    server: ServerSection
    search_space: str
    workload: WorkloadSpec = WorkloadSpec()
    slo: SloSection
    measurement: MeasurementSpec = MeasurementSpec()
    objectives: tuple[Objective, ...] = (
        Objective(metric="slo_throughput", direction="maximize"),
        Objective(metric="ttft:p95", direction="minimize"),
    )
    budget: BudgetSpec = BudgetSpec()
    faults: FaultSpec = FaultSpec()
    sampler: SamplerSpec = SamplerSpec()
    finalists: FinalistSpec = FinalistSpec()
    memory_model: MemoryModelSpec | None = None
    """Predict memory before each launch (off when absent)."""
    notify: NotifySpec | None = None
    """Notifications on study events (off when absent)."""
    cost: CostSpec | None = None
    """A GPU's price by the hour: ``best`` and the report state each config's cost per million output
    tokens (off when absent)."""

    @property
    def latency_objectives(self) -> tuple[MetricKey, ...]:
        """The objectives that are latency statistics (``ttft:p95``), read from the trial's probes."""
        return tuple(parse_metric_key(o.metric) for o in self.objectives if o.metric not in OBJECTIVE_METRICS)

    @field_validator("objectives")
    @classmethod
    def _objectives(cls, value: tuple[Objective, ...]) -> tuple[Objective, ...]:
        if not value:
            raise ValueError("must name at least one objective")
        metrics = [o.metric for o in value]
        if len(set(metrics)) != len(metrics):
            raise ValueError(f"objectives repeat a metric: {metrics}")
        return value


# ----------------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------------


class _UniqueKeyLoader(yaml.SafeLoader):
    """A safe YAML loader that refuses a mapping with the same key twice (PyYAML keeps the last)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def read_yaml(path: Path, field: str) -> Mapping[str, Any]:
    """The YAML mapping in ``path``; a missing, unreadable or malformed file (a key given twice too) is a
    :class:`SpecError`."""
    if not path.is_file():
        raise SpecError(field, f"file not found: {str(path)!r}")
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or "invalid YAML"
        raise SpecError(field, f"malformed YAML in {str(path)!r}{where}: {problem}") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(field, f"cannot read {str(path)!r}: {exc}") from exc
    if not isinstance(data, dict):
        raise SpecError(field, f"{str(path)!r} must hold a YAML mapping, got {type(data).__name__}")
    return data


def _models_in(annotation: object) -> list[type[BaseModel]]:
    """The models an annotation holds: itself, or those inside ``X | None``, ``tuple[X, ...]``,
    ``dict[str, X]`` and ``Annotated[X, ...]``."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def _keys_at(model: type[BaseModel], loc: Sequence[str]) -> set[str]:
    """The keys valid beside the last part of ``loc`` (a path into ``model``; a tagged union's tag, such
    as a parameter's ``int``, picks its variant; list positions and mapping keys, which name no field,
    are stepped over)."""
    models = [model]
    for part in loc[:-1]:
        inner = [
            m
            for current in models
            if part in current.model_fields
            for m in _models_in(current.model_fields[part].annotation)
        ]
        tagged = [m for m in models if "type" in m.model_fields and _tags(m) == (part,)]
        models = inner or tagged or models
    keys = {name for m in models for name in m.model_fields}
    return keys | {f.alias for m in models for f in m.model_fields.values() if f.alias}


def _tags(model: type[BaseModel]) -> tuple[object, ...]:
    """The values a model's ``type`` field admits (``("int",)`` for ``Literal["int"]``)."""
    return typing.get_args(model.model_fields["type"].annotation)


def _did_you_mean(model: type[BaseModel] | None, loc: Sequence[str]) -> str:
    """``; did you mean 'budget'?`` for an unknown key close to a valid one (else nothing)."""
    if model is None or not loc:
        return ""
    close = difflib.get_close_matches(loc[-1], sorted(_keys_at(model, loc)), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def format_validation(prefix: str, exc: ValidationError, model: type[BaseModel] | None = None) -> SpecError:
    """A pydantic validation error as one :class:`SpecError` naming the field path and the value (and,
    for an unknown key of ``model``, the closest valid one)."""
    errors = exc.errors(include_url=False)
    # An unknown key first: a misspelt required key is both unknown and missing, and the unknown one says
    # what was meant.
    err = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
    tagged = [str(p) for p in err["loc"] if not str(p).startswith(("function-", "tagged-union["))]
    # Discriminated unions add the tag (e.g. 'int') to the path: drop it for readability.
    loc = [p for p in tagged if p not in ("int", "float", "categorical", "bool")]
    path = ".".join([prefix, *loc]) if prefix else ".".join(loc)
    msg = str(err["msg"]).removeprefix("Value error, ")
    value = err.get("input")
    if err["type"] == "extra_forbidden":
        msg = "unknown key" + _did_you_mean(model, tagged)
    elif err["type"] == "missing":
        msg = "required key is missing"
    elif err["type"] == "union_tag_invalid":
        msg = f"type must be one of int, float, categorical, bool (got {value.get('type')!r})"
    elif err["type"] == "union_tag_not_found":
        msg = "type is missing: use one of int, float, categorical, bool"
    # Our own checks of a whole mapping name the values they judge; elsewhere show the value once.
    own_check = err["type"] == "value_error" and isinstance(value, dict | list)
    quiet = ("missing", "union_tag_invalid", "union_tag_not_found")
    if not own_check and err["type"] not in quiet and repr(value) not in msg:
        shown = repr(value)
        msg = f"{msg} (value: {shown if len(shown) <= 80 else shown[:77] + '...'})"
    return SpecError(path, msg)


def load_space(path: Path, field: str = "search_space") -> SearchSpaceSpec:
    """Load and validate a search space file; errors are prefixed with ``field``."""
    data = read_yaml(path, field)
    try:
        return SearchSpaceSpec.model_validate(data)
    except ValidationError as exc:
        raise format_validation(field, exc, SearchSpaceSpec) from exc


def read_spec(path: Path) -> StudySpec:
    """Read and validate one study spec file (its search space and cross-checks:
    :mod:`autotune.inputs.loader`)."""
    data = read_yaml(path, "spec")
    try:
        return StudySpec.model_validate(data)
    except ValidationError as exc:
        raise format_validation("", exc, StudySpec) from exc
