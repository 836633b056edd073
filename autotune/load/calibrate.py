"""Prompt-length calibration: synthetic text prompts that tokenize to exactly the intended length.

Synthetic text prompts are made of words from :data:`autotune.load.words.WORDS`, joined by spaces. A
word is kept when the tokenizer gives it a fixed cost ``k`` wherever it stands: ``k`` tokens first in the
prompt and ``2k`` for the word written twice (``"w w"``). Tokenizers that split on whitespace before
merging (GPT-2/Llama-3/Qwen-style byte-level BPE, SentencePiece with its ``▁`` prefix) never merge across
the space, so a prompt of kept words costs the sum of their costs plus what the tokenizer adds around any
prompt (a BOS token, or the chat template around one user message). Two sample prompts of different
lengths verify that sum before the calibration is used; every probe then checks the achieved prompt tokens
from ``usage.prompt_tokens`` (``prompt_tokens_per_intended`` in its results).

Tokens are counted by the server's ``POST /tokenize`` when it answers (vLLM's, and the simulated
server's), else by the model's ``tokenizer.json`` through the ``tokenizers`` package (the ``tokenizer``
extra), which cannot count a chat template's tokens.
"""

from __future__ import annotations

import os
import random
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import httpx

from autotune.errors import LoadError, SpecError
from autotune.hardware.hub import model_file
from autotune.inputs.spec import WorkloadSpec
from autotune.load.words import WORDS

#: Calibration needs at least one one-token word (to hit every length exactly) and this many kept words
#: in all (below it, prompts would repeat a handful of words).
MIN_WORDS = 8
#: Token lengths of the two verification prompts (different, so a per-word error cannot hide).
VERIFY_LENGTHS = (97, 31)


class UncalibratableError(LoadError):
    """Nothing here can make text prompts of exact token lengths (no /tokenize and no tokenizer file, or
    a tokenizer whose word costs do not add up): every probe would measure another workload."""


class TokenCounter(Protocol):
    """Counts the tokens a server would see for a completions prompt or one chat user message."""

    @property
    def source(self) -> str:
        """Where the counts come from, for the record (``"server /tokenize"``, a tokenizer file)."""
        ...

    def count(self, text: str, *, chat: bool) -> int | None:
        """Tokens of ``text`` as a completions prompt, or (``chat``) as one user message with the chat
        template around it; ``None`` when this counter cannot count chat templates."""
        ...


@dataclass(frozen=True)
class PromptCalibration:
    """What a tokenizer makes of the prompt words: each kept word's token cost, and the tokens added."""

    words: tuple[tuple[str, int], ...]
    """Kept words with their token cost (each costs the same wherever it stands in a prompt)."""
    added: int
    """Tokens the tokenizer adds to a prompt of the calibrated endpoint (BOS, the chat template)."""
    source: str
    chat_template_counted: bool = True
    """False when the endpoint is chat but the counter could not count the template (local tokenizer)."""

    def as_dict(self) -> dict[str, Any]:
        """The record kept with a trial or a bench run."""
        return {
            "source": self.source,
            "words": len(self.words),
            "one_token_words": sum(1 for _, k in self.words if k == 1),
            "added_tokens": self.added,
            "chat_template_counted": self.chat_template_counted,
        }

    def text(self, rng: random.Random, tokens: int) -> str:
        """Seeded words that tokenize to exactly ``tokens`` tokens (before :attr:`added`)."""
        out: list[str] = []
        left = tokens
        while left > 0:
            word, cost = rng.choice(self.words)
            if cost > left:  # near the end: only words that still fit (one-token words always do)
                word, cost = rng.choice([w for w in self.words if w[1] <= left])
            out.append(word)
            left -= cost
        return " ".join(out)


# ----------------------------------------------------------------------------------------------
# Counters
# ----------------------------------------------------------------------------------------------


class ServerCounter:
    """Counts through the server's ``POST /tokenize`` (vLLM's request and response shape)."""

    source = "server /tokenize"

    def __init__(self, client: httpx.Client, base_url: str, model: str) -> None:
        self._client = client
        self._url = base_url.rstrip("/").removesuffix("/v1") + "/tokenize"
        self._model = model

    def count(self, text: str, *, chat: bool) -> int | None:
        body: dict[str, Any] = {"model": self._model}
        if chat:
            body["messages"] = [{"role": "user", "content": text}]
        else:
            body["prompt"] = text
        try:
            resp = self._client.post(self._url, json=body)
        except httpx.HTTPError as exc:
            raise LoadError(f"cannot reach {self._url}: {exc}") from exc
        if resp.status_code != 200:
            raise LoadError(f"{self._url} answered HTTP {resp.status_code}: {resp.text[:200]}")
        try:
            count = resp.json()["count"]
        except (ValueError, KeyError, TypeError) as exc:
            raise LoadError(f"{self._url} answered without a token count: {resp.text[:200]}") from exc
        if not isinstance(count, int) or isinstance(count, bool):
            raise LoadError(f"{self._url} answered a count that is not an integer: {count!r}")
        return count

    def available(self) -> bool:
        """Whether the server has a /tokenize endpoint at all (404/405 mean it has not); :class:`LoadError`
        when the server cannot be reached (that says nothing about the endpoint)."""
        try:
            resp = self._client.post(self._url, json={"model": self._model, "prompt": "the"})
        except httpx.HTTPError as exc:
            raise LoadError(f"cannot reach {self._url}: {exc}") from exc
        return resp.status_code not in (404, 405)


class LocalCounter:
    """Counts with a ``tokenizer.json`` through the ``tokenizers`` package (no chat template)."""

    def __init__(self, path: Path) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError as exc:
            raise UncalibratableError(
                f"counting tokens with {str(path)!r} needs the 'tokenizers' package: "
                "pip install 'autotune[tokenizer]'"
            ) from exc
        try:
            self._tok = Tokenizer.from_file(str(path))
        except Exception as exc:  # the Rust side raises a bare Exception for a malformed file
            raise UncalibratableError(f"cannot load tokenizer {str(path)!r}: {exc}") from exc
        self.source = f"tokenizer {path}"

    def count(self, text: str, *, chat: bool) -> int | None:
        if chat:
            return None
        return len(self._tok.encode(text).ids)


def find_tokenizer_file(model: str, explicit: Path | None) -> Path | None:
    """The model's ``tokenizer.json``: ``explicit`` (a file or a folder holding one), else ``model`` as a
    local folder, else the newest snapshot of ``model`` in the Hugging Face cache (read offline)."""
    if explicit is not None:
        return explicit / "tokenizer.json" if explicit.is_dir() else explicit
    return model_file(model, "tokenizer.json", os.environ)


# ----------------------------------------------------------------------------------------------
# Calibration
# ----------------------------------------------------------------------------------------------


def calibrate(counter: TokenCounter, words: tuple[str, ...], *, chat: bool) -> PromptCalibration:
    """Measure each word's cost and the added tokens with ``counter``, then verify on two sample prompts.

    Raises :class:`LoadError` when too few words have a fixed cost or the samples do not add up.
    """
    first: dict[str, int] = {}
    twice: dict[str, int] = {}
    for word in dict.fromkeys(words):
        first[word] = _count(counter, word, chat=False)
        twice[word] = _count(counter, f"{word} {word}", chat=False)
    # Each word costs at least one token, so the fewest tokens of any "w w" is 2 + what is added.
    added = min(twice.values()) - 2
    costs = {w: twice[w] - first[w] for w in first}
    kept = tuple((w, k) for w, k in costs.items() if k >= 1 and first[w] - added == k)
    ones = sum(1 for _, k in kept if k == 1)
    if ones == 0 or len(kept) < MIN_WORDS:
        raise UncalibratableError(
            f"only {len(kept)} of {len(first)} prompt words have a fixed token cost ({ones} of one token) "
            f"for {counter.source}: need {MIN_WORDS}, with one of one token"
        )
    calibration = PromptCalibration(words=kept, added=added, source=counter.source)
    rng = random.Random("calibration")
    samples = [(calibration.text(rng, n), n) for n in VERIFY_LENGTHS]
    for text, n in samples:
        got = _count(counter, text, chat=False)
        if got != n + added:
            raise UncalibratableError(
                f"a {n}-token sample prompt counts {got} tokens with {counter.source}, not {n + added}: "
                "this tokenizer merges across spaces, so word costs do not add up"
            )
    if not chat:
        return calibration
    chat_counts = [(counter.count(text, chat=True), n) for text, n in samples]
    if any(c is None for c, _ in chat_counts):
        return PromptCalibration(kept, 0, counter.source, chat_template_counted=False)
    overheads = {c - n for c, n in chat_counts if c is not None}
    if len(overheads) != 1:
        raise UncalibratableError(
            f"the chat template adds a different number of tokens to prompts of {VERIFY_LENGTHS[0]} and "
            f"{VERIFY_LENGTHS[1]} tokens with {counter.source}: {sorted(overheads)}"
        )
    return PromptCalibration(kept, overheads.pop(), counter.source)


def _count(counter: TokenCounter, text: str, *, chat: bool) -> int:
    count = counter.count(text, chat=chat)
    assert count is not None  # completions prompts are always countable
    return count


# ----------------------------------------------------------------------------------------------
# For a workload
# ----------------------------------------------------------------------------------------------


def needs_calibration(workload: WorkloadSpec) -> bool:
    """Whether ``workload`` sends synthetic text (synthetic or trace prompts, or a shared prefix)."""
    if workload.prompt_format != "text":
        return False
    return workload.dataset.kind in ("synthetic", "trace") or workload.dataset.prefix_len > 0


def calibrate_workload(
    base_url: str,
    model: str,
    workload: WorkloadSpec,
    tokenizer: Path | None,
    headers: Mapping[str, str] | None = None,
) -> PromptCalibration | None:
    """The calibration ``workload``'s prompts need against the server at ``base_url`` (``None`` when it
    sends no synthetic text): counted by the server's ``/tokenize``, else by the model's tokenizer file
    (``tokenizer``, else found from ``model``). Raises :class:`LoadError` when neither can count, or the
    calibration fails."""
    if not needs_calibration(workload):
        return None
    chat = workload.endpoint == "chat"
    with httpx.Client(timeout=30.0, trust_env=False, headers=dict(headers or {})) as client:
        server = ServerCounter(client, base_url, model)
        if server.available():
            return calibrate(server, WORDS, chat=chat)
    path = find_tokenizer_file(model, tokenizer)
    if path is None:
        raise UncalibratableError(
            f"cannot calibrate prompt lengths: {base_url} has no /tokenize and no tokenizer.json was found "
            f"for {model!r} (set workload.tokenizer)"
        )
    if not path.is_file():
        raise UncalibratableError(f"cannot calibrate prompt lengths: tokenizer file {str(path)!r} not found")
    return calibrate(LocalCounter(path), WORDS, chat=chat)


def calibrate_or_explain(
    base_url: str,
    model: str,
    workload: WorkloadSpec,
    tokenizer: Path | None,
    headers: Mapping[str, str] | None = None,
) -> tuple[PromptCalibration | None, dict[str, Any] | None]:
    """:func:`calibrate_workload` and its record. A passing failure (the server did not answer) is not
    raised but recorded as ``{"source": None, "error": why}`` (the caller measures with uncalibrated
    prompts, says so, and tries again at the next server). When nothing can count tokens at all the
    study must not go on measuring another workload than the one asked for: :class:`SpecError` naming
    ``workload.prompt_format`` and ``workload.tokenizer``."""
    try:
        calibration = calibrate_workload(base_url, model, workload, tokenizer, headers)
    except UncalibratableError as exc:
        raise SpecError(
            "workload.prompt_format",
            f"text prompts cannot be sized to their token lengths ({exc}); set workload.tokenizer to the "
            "model's tokenizer.json, or use workload.prompt_format: token_ids (completions endpoint)",
        ) from exc
    except LoadError as exc:
        return None, {"source": None, "error": str(exc)}
    return calibration, calibration.as_dict() if calibration is not None else None
