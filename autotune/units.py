"""Human-friendly quantities: durations parsed from specs ("500ms", "2s", "10m", "4h"), and durations and
figures written for people ("3m12s", "19,926 tok/s", "0.912 req/s"); lines wrapped to a width for people
(:func:`wrap`)."""

from __future__ import annotations

import math
import re
import textwrap

_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(us|ms|s|m|min|h)?\s*$")
_SCALE = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, None: 1.0}


def parse_duration(value: object) -> float:
    """Return seconds for a number (seconds) or a string such as ``"500ms"``, ``"2s"``, ``"1.5h"``.

    Raises ``ValueError`` with the offending value when it is not a non-negative duration.
    """
    if isinstance(value, bool):
        raise ValueError(f"expected a duration such as '500ms' or '30s', got {value!r}")
    if isinstance(value, int | float):
        if value < 0:
            raise ValueError(f"duration must be >= 0, got {value!r}")
        return float(value)
    if isinstance(value, str):
        match = _DURATION.match(value)
        if match:
            return float(match.group(1)) * _SCALE[match.group(2)]
    raise ValueError(f"expected a duration such as '500ms' or '30s', got {value!r}")


def plural(n: int, noun: str) -> str:
    """``1 rerun``, ``2 reruns``."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def format_duration(seconds: float, *, spaced: bool = False) -> str:
    """Format seconds compactly for progress lines: ``42s``, ``3m12s``, ``1h05m``; ``spaced``, as a report
    writes them: ``42 s``, ``3 min 05 s``, ``2 h 10 min``."""
    h, m, s, sep = (" h", " min", " s", " ") if spaced else ("h", "m", "s", "")
    total = round(seconds)
    if total < 60:
        return f"{total}{s}"
    minutes, secs = divmod(total, 60)
    if minutes < 60:
        return f"{minutes}{m}{sep}{secs:02d}{s}"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}{h}{sep}{minutes:02d}{m}"


FIGURE_DECIMALS = 6
"""The most decimals a figure shows: smaller magnitudes read as ``0``."""


def format_figure(value: float, unit: str = "") -> str:
    """A figure as people read it, never in exponent notation: whole with thousands separators from 1,000
    (``19,926 tok/s``), three significant figures below (``87.4 req/s``, ``0.912``, ``5``: no trailing
    zeros, at most :data:`FIGURE_DECIMALS` decimals); ``0``, negatives with their sign, ``inf``/``-inf``,
    and ``n/a`` (no unit) for nan. ``unit`` follows after a space."""
    if math.isnan(value):
        return "n/a"
    size = abs(value)
    if math.isinf(size):
        digits = "inf"
    else:
        decimals = min(FIGURE_DECIMALS, max(0, 2 - math.floor(math.log10(size)))) if size else 0
        if round(size, decimals) >= 1000:
            digits = f"{size:,.0f}"
        else:
            digits = f"{size:.{decimals}f}"
            digits = digits.rstrip("0").rstrip(".") if "." in digits else digits
    sign = "-" if value < 0 and digits != "0" else ""
    return f"{sign}{digits} {unit}" if unit else f"{sign}{digits}"


SYMMETRY = 0.1
"""An interval reads as ``± half its width`` when its two sides around the value differ by at most this
share of its width; otherwise it reads as a range (a log-scale interval of ±85 % is really [486, 2,261])."""


def _symmetric(value: float, lo: float, hi: float) -> bool:
    width = hi - lo
    return width <= 0 or abs((hi - value) - (value - lo)) <= SYMMETRY * width


def figure_spread(value: float, lo: float, hi: float) -> str:
    """A figure's interval after it: `` ±3.1%`` (half its width, relative to ``value``) where it is about
    symmetric, else the range in the figure's own units, `` [486.0–2261.0]``."""
    if _symmetric(value, lo, hi) and value:
        return f" ±{(hi - lo) / 2 / value:.1%}"
    return f" [{lo:.1f}–{hi:.1f}]"


def gain_spread(value: float, lo: float, hi: float) -> str:
    """A relative gain with its interval: ``+41.5% ±15.8%`` where it is about symmetric, else
    ``+39.7% [-43.6%, +246.0%]``."""
    if _symmetric(value, lo, hi):
        return f"{value:+.1%} ±{(hi - lo) / 2:.1%}"
    return f"{value:+.1%} [{lo:+.1%}, {hi:+.1%}]"


HANG = "  "
"""How much deeper than its first line a wrapped line's continuation lines are indented."""

_LEAD = re.compile(r"(?:# )?[ ]*")
"""A line's own indent: its leading spaces, after a comment's ``# `` (kept on each continuation line)."""


def wrap(text: str, width: int, *, hang: str = HANG) -> str:
    """``text`` with each line longer than ``width`` columns wrapped between words (``width`` 0: unchanged).

    A continuation line takes the line's own indent (leading spaces, or a YAML comment's ``# ``) plus
    ``hang``, so a wrapped line reads as one item. A line breaks only at spaces, never inside a word or at
    a hyphen: a value, a flag, a path or a figure stays whole, on a line of its own when it is longer than
    the width. Shorter lines, blank lines and the line breaks of ``text`` are kept as they are."""
    if width <= 0:
        return text
    out: list[str] = []
    for line in text.split("\n"):
        if len(line) <= width:
            out.append(line)
            continue
        lead = _LEAD.match(line)
        indent = lead.group() if lead is not None else ""
        out += textwrap.wrap(
            line[len(indent) :],
            width=width,
            initial_indent=indent,
            subsequent_indent=indent + hang,
            break_long_words=False,
            break_on_hyphens=False,
        ) or [line]
    return "\n".join(out)
