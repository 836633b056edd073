"""One request of a probe as planned: prompt, system prompt, intended lengths, place in a conversation."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RequestSpec:
    """One request of a probe: the prompt (text or token ids) and its intended input and output lengths.

    ``system`` is a shared-prefix group's system prompt, sent before ``prompt`` (``prefix_len`` tokens of
    ``input_len``). A later turn of a conversation ``follows`` another request (its index in the run): it is
    sent ``think`` seconds after that one ended, with the conversation so far (every earlier prompt and the
    reply received to it) before its own ``prompt``; ``input_len`` then counts that history too.
    """

    prompt: str | list[int]
    input_len: int
    output_len: int
    system: str | list[int] | None = None
    group: int | None = None
    """The shared-prefix group of ``system`` (``None``: none)."""
    prefix_len: int = 0
    """Tokens of ``system`` (0 without one)."""
    follows: int | None = None
    think: float = 0.0
    turn: int = 1
    """The turn of its conversation (1: the first, or a single-turn request)."""
