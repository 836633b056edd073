"""Workloads: the requests of a probe (prompts with intended lengths) and their arrival times.

Synthetic prompts are built from a fixed list of common English words, each written with a leading
space, so that a server counting one token per whitespace-separated word (the simulated vLLM) sees exactly
the intended length and BPE tokenizers see close to it. ``prompt_format="token_ids"`` builds
``/v1/completions`` prompts as lists of token ids instead, which gives exact lengths on real vLLM.

A shared prefix of ``prefix_len`` tokens (seeded by the workload seed only, so every probe of a study shares
it) is prepended to every prompt; a request's ``input_len`` counts the prefix, as ``vllm bench serve``'s
random dataset does (``prefix_len + input_len``).

Shared-prefix groups (``dataset.prefix``, :mod:`autotune.load.prefixes`) put one of several system prompts
before a request's own tokens instead: the chat endpoint sends it as a ``system`` message, completions as
the prompt's head (:attr:`RequestSpec.system`). Multi-turn conversations are built by
:mod:`autotune.load.conversation` from the same pieces.
"""

from __future__ import annotations

import itertools
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from autotune.errors import LoadError
from autotune.inputs.spec import ArrivalSpec, DatasetSpec, LengthDist, WorkloadSpec
from autotune.load.lengths import clip_length, expected_length, sample_length
from autotune.load.prefixes import PrefixGroups
from autotune.load.request import RequestSpec
from autotune.load.words import WORDS

if TYPE_CHECKING:
    from autotune.load.calibrate import PromptCalibration

PromptFormat = Literal["text", "token_ids"]

# Token ids used for ``token_ids`` prompts: a range that is ordinary text in common vocabularies
# (well past special and byte tokens) and inside even a tiny test vocabulary of 2048.
_TOKEN_ID_RANGE = (300, 2000)


def _words(rng: random.Random, n: int) -> list[str]:
    return rng.choices(WORDS, k=n)


def _ids(rng: random.Random, n: int) -> list[int]:
    lo, hi = _TOKEN_ID_RANGE
    return [rng.randrange(lo, hi) for _ in range(n)]


def build_requests(
    workload: WorkloadSpec,
    n: int,
    seed: int,
    base_dir: Path,
    *,
    prompt_format: PromptFormat = "text",
    calibration: PromptCalibration | None = None,
    shapes_seed: int | None = None,
    prompts: bool = True,
    prefix_seed: int | None = None,
) -> list[RequestSpec]:
    """Build ``n`` requests for ``workload``, deterministically from ``seed``.

    Synthetic datasets draw lengths from the dataset's distributions; file datasets (``sharegpt``,
    ``jsonl``, ``trace``; paths relative to ``base_dir``) are cycled in a seeded order when they hold
    fewer than ``n`` entries. ``prompt_format="token_ids"`` is only valid for the completions endpoint.
    With a ``calibration`` (of the server's tokenizer), synthetic text prompts are made of its words and
    tokenize to exactly their intended length, the tokens the tokenizer adds included. Raises
    :class:`LoadError` for an unreadable or malformed dataset file.

    With ``shapes_seed`` the lengths (and a file's order) are drawn from ``shapes_seed`` and only the
    synthetic prompts' contents from ``seed``: requests with the same ``shapes_seed`` have the same lengths
    in the same order (the first ``n`` of one stream, whatever ``n``) and different tokens for different
    ``seed`` (so a server's prefix cache never answers one from another). ``prompts=False`` leaves the
    synthetic prompts empty (their lengths are all the in-process simulator needs).

    With shared-prefix groups each request's group is drawn from ``shapes_seed`` (else ``seed``) on a
    stream of its own (the lengths are those of the same workload without groups), and each group's tokens
    from ``prefix_seed`` (else ``seed``): a probe gives its warm-up requests its own ``prefix_seed``.
    """
    if n < 0:
        raise LoadError(f"request count must be >= 0, got {n}")
    if prompt_format == "token_ids" and workload.endpoint == "chat":
        raise LoadError("prompt_format 'token_ids' needs endpoint 'completions' (chat needs text)")
    ds = workload.dataset
    rng = random.Random(f"{workload.seed}:{seed}:requests")
    lengths = rng if shapes_seed is None else random.Random(f"{workload.seed}:{shapes_seed}:shapes")
    make = prompt_maker(workload, prompt_format, calibration, seed if prefix_seed is None else prefix_seed)
    groups = (
        make.groups.draw(n, workload.seed, seed if shapes_seed is None else shapes_seed)
        if make.groups
        else None
    )

    def sized(k: int, input_len: int, output_len: int) -> RequestSpec:
        """Request ``k`` of these lengths: in its shared-prefix group, lengths only, or a synthetic prompt."""
        if groups is not None:
            return make.grouped(groups[k], input_len, output_len, rng, prompts)
        if not prompts:
            return RequestSpec("", ds.prefix_len + input_len, output_len)
        return make.synthetic(input_len, output_len, rng)

    if ds.kind == "synthetic":
        shapes = [
            (sample_length(ds.input_len, lengths), sample_length(ds.output_len, lengths)) for _ in range(n)
        ]
        return [sized(k, i, o) for k, (i, o) in enumerate(shapes)]
    entries = load_dataset(ds, base_dir)
    if not entries:
        raise LoadError(f"dataset {ds.path!r} holds no usable entries")
    if ds.kind == "trace":  # time order, as the trace's timestamps
        order = [i % len(entries) for i in range(n)]
    else:
        order = _cycled_order(len(entries), n, lengths)
    out: list[RequestSpec] = []
    for k, idx in enumerate(order):
        entry = entries[idx]
        output_len = (
            entry.output_len if entry.output_len is not None else sample_length(ds.output_len, lengths)
        )
        if entry.prompt is None:
            assert entry.input_len is not None
            out.append(sized(k, entry.input_len, output_len))
            continue
        if prompt_format == "token_ids":
            raise LoadError(f"dataset {ds.path!r} holds text prompts: use prompt_format 'text'")
        text = f"{make.prefix} {entry.prompt}" if make.prefix else entry.prompt
        out.append(RequestSpec(prompt=text, input_len=len(text.split()), output_len=output_len))
    return out


def prompt_maker(
    workload: WorkloadSpec,
    prompt_format: PromptFormat,
    calibration: PromptCalibration | None,
    prefix_seed: int,
) -> _PromptMaker:
    """The prompt maker of ``workload``: its shared prefix (``prefix_len``) or prefix groups, the groups'
    tokens drawn from ``prefix_seed``."""
    ds = workload.dataset
    return _PromptMaker(
        prompt_format,
        calibration,
        random.Random(f"{workload.seed}:prefix"),
        ds.prefix_len,
        PrefixGroups.of(workload, expected_length(ds.input_len)),
        f"{workload.seed}:{prefix_seed}",
    )


class _PromptMaker:
    """Synthetic prompts of one format: token ids, calibrated words, or plain words (one per token).

    The shared prefix (``prefix_len`` tokens, drawn once from ``prefix_rng``) starts every prompt; a
    request's intended ``input_len`` counts it and, with a calibration, the tokens the tokenizer adds.
    With prefix ``groups`` a request gets its group's system prompt instead, whose tokens are drawn once
    per maker from ``group_seed`` and the group's number.
    """

    def __init__(
        self,
        prompt_format: PromptFormat,
        calibration: PromptCalibration | None,
        prefix_rng: random.Random,
        prefix_len: int,
        groups: PrefixGroups | None = None,
        group_seed: str = "",
    ) -> None:
        self.as_ids = prompt_format == "token_ids"
        self.calibration = None if self.as_ids else calibration
        self.added = self.calibration.added if self.calibration is not None else 0
        self.prefix_len = prefix_len
        self.prefix = self.body(prefix_rng, prefix_len) if prefix_len else None
        self.groups = groups
        self._group_seed = group_seed
        self._systems: dict[int, str | list[int]] = {}

    def system(self, group: int) -> str | list[int]:
        """The system prompt of ``group`` (drawn at its first use, the same for every later one)."""
        text = self._systems.get(group)
        if text is None:
            assert self.groups is not None
            rng = random.Random(f"{self._group_seed}:group:{group}")
            text = self._systems[group] = self.body(rng, self.groups.lengths[group])
        return text

    def grouped(
        self, group: int, input_len: int, output_len: int, rng: random.Random, prompts: bool = True
    ) -> RequestSpec:
        """A request of ``group``: its system prompt, then ``input_len`` tokens of its own (the tokens the
        tokenizer adds counted in them)."""
        assert self.groups is not None
        length = self.groups.lengths[group]
        if not prompts:
            return RequestSpec("", length + input_len, output_len, None, group, length)
        body = self.body(rng, max(1, input_len - self.added))
        return RequestSpec(body, length + input_len, output_len, self.system(group), group, length)

    def body(self, rng: random.Random, tokens: int) -> str | list[int]:
        if self.as_ids:
            return _ids(rng, tokens)
        if self.calibration is not None:
            return self.calibration.text(rng, tokens)
        return " ".join(_words(rng, tokens))

    def synthetic(self, input_len: int, output_len: int, rng: random.Random) -> RequestSpec:
        body = self.body(rng, max(1, input_len - self.added))
        total = self.prefix_len + input_len
        if self.prefix is None:
            prompt = body
        elif isinstance(self.prefix, list) and isinstance(body, list):
            prompt = self.prefix + body
        else:
            prompt = f"{self.prefix} {body}"
        return RequestSpec(prompt=prompt, input_len=total, output_len=output_len)


def _cycled_order(size: int, n: int, rng: random.Random) -> list[int]:
    order: list[int] = []
    while len(order) < n:
        block = list(range(size))
        rng.shuffle(block)
        order.extend(block)
    return order[:n]


@dataclass(frozen=True)
class DatasetEntry:
    """One entry of a file dataset: a text prompt or a length (trace), an output length, a timestamp."""

    prompt: str | None
    input_len: int | None
    output_len: int | None
    timestamp: float | None = None


def load_dataset(ds: DatasetSpec, base_dir: Path) -> list[DatasetEntry]:
    """Read a file dataset.

    - ``sharegpt``: a JSON list of ``{"conversations": [{"from": "human", "value": ...}, {"from": "gpt",
      "value": ...}, ...]}``; the first human turn is the prompt and the following reply's word count the
      output length (clipped to the spec's ``output_len`` low/high when given).
    - ``jsonl``: one object per line with ``prompt`` (or ``text``) and optional ``output_len``
      (or ``max_tokens``).
    - ``trace``: one object per line with ``input_len``, ``output_len`` and ``timestamp`` (seconds),
      returned in time order.
    """
    assert ds.path is not None
    path = (base_dir / ds.path) if not Path(ds.path).is_absolute() else Path(ds.path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise LoadError(f"cannot read dataset {str(path)!r}: {exc}") from exc
    if ds.kind == "sharegpt":
        return _sharegpt(text, path, ds.output_len)
    rows = _jsonl(text, path)
    if ds.kind == "jsonl":
        return [_jsonl_entry(row, path, i) for i, row in enumerate(rows, 1)]
    # in time order (stable): a request's lengths stay with its own arrival when the file is not sorted
    entries = [_trace_entry(row, path, i) for i, row in enumerate(rows, 1)]
    return sorted(entries, key=lambda e: e.timestamp or 0.0)


def _sharegpt(text: str, path: Path, output_len: LengthDist) -> list[DatasetEntry]:
    data = _loads(text, path)
    if not isinstance(data, list):
        raise LoadError(f"ShareGPT dataset {str(path)!r} must hold a JSON list")
    out: list[DatasetEntry] = []
    for item in data:
        turns = item.get("conversations") if isinstance(item, dict) else None
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        first, second = turns[0], turns[1]
        if not (isinstance(first, dict) and isinstance(second, dict)):
            continue
        prompt, reply = first.get("value"), second.get("value")
        if not isinstance(prompt, str) or not isinstance(reply, str) or not prompt.split():
            continue
        out.append(
            DatasetEntry(
                prompt=prompt, input_len=None, output_len=clip_length(len(reply.split()), output_len)
            )
        )
    return out


def _loads(text: str, path: Path, lineno: int | None = None) -> Any:
    """``text`` (the dataset at ``path``, or its line ``lineno``) as JSON; else a LoadError saying so."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        where = " is not valid JSON" if lineno is None else f" line {lineno}: invalid JSON"
        raise LoadError(f"dataset {str(path)!r}{where}: {exc}") from exc


def _jsonl(text: str, path: Path) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        row = _loads(line, path, lineno)
        if not isinstance(row, dict):
            raise LoadError(f"dataset {str(path)!r} line {lineno}: expected a JSON object")
        rows.append(row)
    return rows


def _jsonl_entry(row: dict[str, Any], path: Path, lineno: int) -> DatasetEntry:
    prompt = row.get("prompt", row.get("text"))
    if not isinstance(prompt, str) or not prompt.strip():
        raise LoadError(f"dataset {str(path)!r} line {lineno}: needs a non-empty 'prompt' string")
    out = row.get("output_len", row.get("max_tokens"))
    if out is not None and (not isinstance(out, int) or out < 1):
        raise LoadError(f"dataset {str(path)!r} line {lineno}: output_len must be an int >= 1, got {out!r}")
    return DatasetEntry(prompt=prompt, input_len=None, output_len=out)


def _trace_entry(row: dict[str, Any], path: Path, lineno: int) -> DatasetEntry:
    values: dict[str, float] = {}
    for key in ("timestamp", "input_len", "output_len"):
        value = row.get(key)
        if not isinstance(value, int | float) or isinstance(value, bool) or value < 0:
            raise LoadError(
                f"dataset {str(path)!r} line {lineno}: {key} must be a number >= 0, got {value!r}"
            )
        values[key] = float(value)
    return DatasetEntry(
        prompt=None,
        input_len=max(1, int(values["input_len"])),
        output_len=max(1, int(values["output_len"])),
        timestamp=values["timestamp"],
    )


def trace_timestamps(ds: DatasetSpec, base_dir: Path) -> list[float]:
    """The timestamps of a ``trace`` dataset, in time order (input to :func:`arrival_times`)."""
    return [e.timestamp for e in load_dataset(ds, base_dir) if e.timestamp is not None]


def trace_rate(timestamps: list[float]) -> float | None:
    """A trace's mean rate as recorded (requests/s over its span), or ``None`` for a trace without one (fewer
    than two requests, or all at one instant)."""
    if len(timestamps) < 2:
        return None
    span = max(timestamps) - min(timestamps)
    return (len(timestamps) - 1) / span if span > 0 else None


def arrival_times(
    arrival: ArrivalSpec,
    rate: float,
    n: int,
    seed: int,
    *,
    trace: list[float] | None = None,
) -> list[float]:
    """Send offsets (seconds from the start) of ``n`` requests at mean ``rate`` requests/s.

    ``poisson`` draws exponential gaps; ``gamma`` draws gamma gaps of shape ``burstiness`` (1 = Poisson,
    < 1 burstier) with mean ``1/rate``, like ``vllm bench serve --burstiness``. Both are then rescaled so
    that the last request is sent at exactly ``(n - 1) / rate``: the offered load is the nominal rate for
    every seed (for Poisson this is the process conditioned on its count, n arrivals in the window), as
    ``vllm bench serve`` rescales its draws to end at ``n / rate``. ``concurrency`` sends
    everything at 0 (the concurrency limit paces it). ``trace`` replays ``trace`` timestamps (cycled, in
    order) rescaled to mean ``rate``. ``rate = inf`` puts every request at 0. The first request is at 0.
    """
    if n <= 0:
        return []
    if not rate > 0:
        raise LoadError(f"arrival rate must be > 0, got {rate}")
    if math.isinf(rate) or arrival.process == "concurrency":
        return [0.0] * n
    if arrival.process == "trace":
        return _trace_arrivals(trace, rate, n)
    shape = 1.0 if arrival.process == "poisson" else arrival.burstiness
    rng = random.Random(f"{seed}:arrivals")
    scale = 1.0 / (rate * shape)
    out = [0.0]
    t = 0.0
    for _ in range(n - 1):
        t += rng.gammavariate(shape, scale)
        out.append(t)
    if t > 0:
        factor = (n - 1) / rate / t
        out = [x * factor for x in out]
    return out


def unit_arrivals(
    arrival: ArrivalSpec, n: int, seed: int, *, trace: list[float] | None = None
) -> list[float]:
    """Send offsets of ``n`` requests at one request per second on average, drawn with ``seed``: a probe at
    rate ``r`` sends them at ``offset / r`` (the same pattern at every rate, and the first ``n`` of one
    stream whatever ``n``). ``poisson`` and ``gamma`` draw gaps as :func:`arrival_times` does, without its
    rescaling; ``trace`` replays the trace's gaps (cycled) scaled to a mean of 1 s; ``concurrency`` sends
    everything at 0. The first request is at 0."""
    if n <= 0:
        return []
    if arrival.process == "concurrency":
        return [0.0] * n
    if arrival.process == "trace":
        return _trace_arrivals(trace, 1.0, n)
    shape = 1.0 if arrival.process == "poisson" else arrival.burstiness
    rng = random.Random(f"{seed}:arrivals")
    out = [0.0]
    t = 0.0
    for _ in range(n - 1):
        t += rng.gammavariate(shape, 1.0 / shape)
        out.append(t)
    return out


def _trace_arrivals(trace: list[float] | None, rate: float, n: int) -> list[float]:
    if not trace:
        raise LoadError("arrival process 'trace' needs the trace's timestamps (a 'trace' dataset)")
    ts = sorted(trace)
    gaps = [b - a for a, b in itertools.pairwise(ts)] or [1.0]
    mean_gap = sum(gaps) / len(gaps)
    if mean_gap <= 0:
        raise LoadError("the trace's timestamps are all equal: it has no arrival pattern to replay")
    factor = (1.0 / rate) / mean_gap
    out = [0.0]
    for i in range(n - 1):
        out.append(out[-1] + gaps[i % len(gaps)] * factor)
    return out
