"""How the report writes values: escaped text, flags as on the command line, milliseconds, tokens per
second, intervals, durations and rates (figures as :func:`autotune.units.format_figure` writes them, ``-``
for a value that is missing, ``∞`` for an open end), a tooltip's pair of figures and a link to a trial's
row."""

from __future__ import annotations

import math
from html import escape

from autotune.flags import flag_key
from autotune.units import format_duration, format_figure


def esc(value: object) -> str:
    """``value`` as HTML text."""
    return escape(str(value))


def dashed(name: str) -> str:
    """A flag as on the command line: ``--max-num-seqs``."""
    return "--" + flag_key(name).replace("_", "-")


def ms(value: float | None) -> str:
    """Milliseconds (:func:`autotune.units.format_figure`: ``412``, ``1,250``, ``8.75``)."""
    return "-" if value is None else format_figure(value)


def tok(value: float | None) -> str:
    """Tokens per second (:func:`autotune.units.format_figure`: ``19,926``, ``87.4``)."""
    return "-" if value is None else format_figure(value)


def interval_text(interval: tuple[float, float] | None) -> str:
    """``lo–hi`` (``∞`` for an open upper end), or nothing."""
    if interval is None:
        return ""
    lo, hi = interval
    return f"{tok(lo)}–{tok(hi) if math.isfinite(hi) else '∞'}"


def duration_text(seconds: float | None) -> str:
    """``42 s``, ``3 min 05 s``, ``2 h 10 min`` (:func:`autotune.units.format_duration`)."""
    return "-" if seconds is None else format_duration(seconds, spaced=True)


def rate_text(rate: float | None) -> str:
    """Requests per second (:func:`autotune.units.format_figure`: ``15.4``, ``0.912``), ``∞`` unbounded."""
    if rate is None:
        return "-"
    if not math.isfinite(rate):
        return "∞"
    return format_figure(rate)


def fmt_pair(xlabel: str, x: float, ylabel: str, y: float) -> str:
    """``x label x, y label y`` for a tooltip (the figures as :func:`autotune.units.format_figure` writes
    them)."""
    return f"{xlabel} {format_figure(x)}, {ylabel} {format_figure(y)}"


def trial_link(number: int) -> str:
    """A link to trial ``number``'s row of the trials' table."""
    return f'<a href="#trial-{number}">{number}</a>'
