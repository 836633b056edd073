"""The simulated server's toy tokenizer: prompts to token ids, and the text and ids of output tokens.

A prompt string has one token per whitespace-separated word, the word's id being its CRC-32 modulo the
vocabulary; a list of ints is taken as token ids; a chat request is ``1 2 3 4`` + the message's words for
each message, then ``5 6 7`` (so each message costs its words + 4, plus 3). Output token ``i`` of every
request is the word ``OUTPUT_WORDS[i % len(OUTPUT_WORDS)]``, and its id is that word's id: a client that
sends a reply back inside its next prompt (a multi-turn chat) sends the same ids, so the prefix cache
can hit on them.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

_VOCAB = (
    "the of and to in is that for it as was with be by on not he this are or his from at "
    "which but have an they you were her she there one all we their has been would more"
)
OUTPUT_WORDS: tuple[bytes, ...] = tuple(f" {w}".encode() for w in _VOCAB.split())
"""The text of output tokens, in order (each with its leading space)."""

_CHAT_HEAD = (1, 2, 3, 4)
_CHAT_TAIL = (5, 6, 7)


def word_id(word: str, vocab_size: int) -> int:
    """The token id of one word."""
    return zlib.crc32(word.encode()) % vocab_size


def prompt_ids(prompt: object, vocab_size: int) -> list[int] | None:
    """Token ids of a completions ``prompt`` (a string, token ids, or a one-element list of either)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return [word_id(w, vocab_size) for w in prompt.split()]
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    return None


def chat_ids(messages: object, vocab_size: int) -> list[int] | None:
    """Token ids of chat ``messages`` (OpenAI format; content parts are joined by spaces)."""
    if not isinstance(messages, list):
        return None
    ids: list[int] = []
    for message in messages:
        if not isinstance(message, dict):
            return None
        content = message.get("content", "")
        if isinstance(content, list):  # OpenAI content parts
            content = " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
        ids += [*_CHAT_HEAD, *(word_id(w, vocab_size) for w in str(content or "").split())]
    return [*ids, *_CHAT_TAIL]


class OutputIds:
    """Token ids of output tokens (the same for every request), cached per vocabulary size."""

    def __init__(self, vocab_size: int) -> None:
        self._ids = tuple(word_id(w.decode().strip(), vocab_size) for w in OUTPUT_WORDS)

    def __getitem__(self, index: int) -> int:
        return self._ids[index % len(self._ids)]

    def slice(self, start: int, end: int) -> Sequence[int]:
        """Ids of output tokens ``start`` .. ``end - 1``."""
        ids, n = self._ids, len(self._ids)
        return [ids[i % n] for i in range(start, end)]


def output_text(first: int, end: int) -> bytes:
    """The text of output tokens ``first`` .. ``end - 1`` (one word per token)."""
    words = OUTPUT_WORDS
    n = len(words)
    return b"".join(words[i % n] for i in range(first, end))
