"""Inline SVG charts drawn in Python: scales, ticks and one small chart builder (no JavaScript, no fonts
or files fetched: the report opens with no network).

Colours and strokes come from CSS classes the page defines (``.pt``, ``.ln``, ``.c-<name>``), so a chart
is markup only. Every mark may carry a ``<title>`` (the browser's tooltip) and a link to a trial's row.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from html import escape

from autotune.units import format_figure


def fmt(value: float) -> str:
    """A tick label: short, no binary noise, no exponent (``1,500``, ``0.25``, ``120``; thousands from
    10,000: ``20k``, ``12.5k``)."""
    if abs(value) >= 10_000:
        return f"{format_figure(value / 1000)}k"
    return format_figure(value)


def nice_step(span: float, count: int) -> float:
    """The round step (1, 2 or 5 × 10^k) nearest to cutting ``span`` into ``count`` parts."""
    raw = span / max(count, 1)
    magnitude = 10.0 ** math.floor(math.log10(raw))
    steps = [f * magnitude for f in (1.0, 2.0, 5.0, 10.0)]
    return min(steps, key=lambda step: abs(math.log(step / raw)))


@dataclass(frozen=True)
class Scale:
    """Maps a data interval onto pixels, linearly or on a log scale."""

    lo: float
    hi: float
    start: float
    end: float
    log: bool = False

    @classmethod
    def fit(
        cls,
        values: Iterable[float],
        start: float,
        end: float,
        *,
        log: bool = False,
        zero: bool = False,
        pad: float = 0.05,
    ) -> Scale:
        """A scale over ``values`` (padded by ``pad`` of the span; from 0 with ``zero``)."""
        finite = [v for v in values if math.isfinite(v) and (v > 0 or not log)]
        if not finite:
            return cls(0.0 if not log else 1.0, 1.0 if not log else 10.0, start, end, log)
        lo, hi = min(finite), max(finite)
        if log:
            if lo == hi:
                lo, hi = lo / 2, hi * 2
            ratio = (hi / lo) ** pad
            return cls(lo / ratio, hi * ratio, start, end, True)
        if zero:
            lo = min(lo, 0.0)
        if lo == hi:
            lo, hi = (lo - 1, hi + 1) if lo == 0 else (lo - abs(lo) * 0.1, hi + abs(hi) * 0.1)
        span = hi - lo
        return cls(lo if zero and lo == 0 else lo - span * pad, hi + span * pad, start, end)

    def __call__(self, value: float) -> float:
        """The pixel position of ``value`` (clamped to the scale's ends)."""
        if self.log:
            value = max(value, self.lo)
            frac = math.log(value / self.lo) / math.log(self.hi / self.lo)
        else:
            frac = (value - self.lo) / (self.hi - self.lo)
        frac = min(max(frac, -0.02), 1.02)
        return self.start + frac * (self.end - self.start)

    def ticks(self, count: int = 5) -> list[float]:
        """Round values inside the scale to label."""
        if self.log:
            out = []
            exponent = math.floor(math.log10(self.lo))
            while 10**exponent <= self.hi:
                for factor in (1, 2, 5):
                    value = factor * 10**exponent
                    if self.lo <= value <= self.hi:
                        out.append(float(value))
                exponent += 1
            if len(out) > count + 2:
                out = [v for v in out if math.log10(v).is_integer()] or out[:: max(1, len(out) // count)]
            return out
        step = nice_step(self.hi - self.lo, count)
        first = math.ceil(self.lo / step) * step
        out = []
        value = first
        while value <= self.hi + step * 1e-9:
            out.append(round(value, 10))
            value += step
        return out


def _attrs(**attrs: object) -> str:
    parts = []
    for key, value in attrs.items():
        if value is None:
            continue
        name = key.rstrip("_").replace("_", "-")
        shown = f"{value:.1f}" if isinstance(value, float) else str(value)
        parts.append(f'{name}="{escape(shown, quote=True)}"')
    return " ".join(parts)


def _titled(element: str, title: str | None, href: str | None) -> str:
    if title:
        element = element.replace(
            "/>", f"><title>{escape(title)}</title></{element[1 : element.index(' ')]}>", 1
        )
    if href:
        element = f'<a href="{escape(href, quote=True)}">{element}</a>'
    return element


@dataclass
class Chart:
    """One chart: axes with ticks and labels, then marks added in data coordinates."""

    width: int
    height: int
    x: Scale
    y: Scale
    xlabel: str = ""
    ylabel: str = ""
    label: str = ""
    """What the chart shows, for screen readers."""
    marks: list[str] = field(default_factory=list)

    LEFT = 58
    RIGHT = 14
    TOP = 12
    BOTTOM = 40

    @classmethod
    def over(
        cls,
        width: int,
        height: int,
        xs: Iterable[float],
        ys: Iterable[float],
        *,
        xlog: bool = False,
        ylog: bool = False,
        xzero: bool = False,
        yzero: bool = False,
        xlabel: str = "",
        ylabel: str = "",
        label: str = "",
    ) -> Chart:
        """A chart whose scales fit ``xs`` and ``ys``."""
        x = Scale.fit(xs, cls.LEFT, width - cls.RIGHT, log=xlog, zero=xzero)
        y = Scale.fit(ys, height - cls.BOTTOM, cls.TOP, log=ylog, zero=yzero)
        return cls(width, height, x, y, xlabel, ylabel, label)

    def point(
        self,
        x: float,
        y: float,
        cls: str,
        *,
        r: float = 4.0,
        shape: str = "circle",
        title: str | None = None,
        href: str | None = None,
    ) -> None:
        """A marker: ``circle``, ``square``, ``diamond``, ``triangle``, ``cross`` or ``star``."""
        px, py = self.x(x), self.y(y)
        self.marks.append(_titled(marker(px, py, shape, r, cls), title, href))

    def line(self, points: Sequence[tuple[float, float]], cls: str, *, step: bool = False) -> None:
        """A polyline through ``points`` (a staircase with ``step``: each value holds until the next x)."""
        if not points:
            return
        coords: list[tuple[float, float]] = []
        for i, (x, y) in enumerate(points):
            if step and i:
                coords.append((self.x(x), coords[-1][1]))
            coords.append((self.x(x), self.y(y)))
        text = " ".join(f"{px:.1f},{py:.1f}" for px, py in coords)
        self.marks.append(f'<polyline class="ln {cls}" points="{text}"/>')

    def vline(self, x: float, cls: str, text: str = "") -> None:
        """A vertical rule at ``x`` across the plot, labelled at its top."""
        px = self.x(x)
        self.marks.append(self._vrule(px, cls))
        if text:
            right = px > self.width - self.RIGHT - 110  # near the right edge: label on the line's left
            where = f'x="{px - 3:.1f}" text-anchor="end"' if right else f'x="{px + 3:.1f}"'
            self.marks.append(f'<text class="note" {where} y="{self.TOP + 10}">{escape(text)}</text>')

    def hline(self, y: float, cls: str, text: str = "") -> None:
        """A horizontal rule at ``y`` across the plot, labelled at its left end."""
        py = self.y(y)
        self.marks.append(self._hrule(py, cls))
        if text:
            self.marks.append(
                f'<text class="note" x="{self.LEFT + 4}" y="{py - 3:.1f}">{escape(text)}</text>'
            )

    def _vrule(self, px: float, cls: str) -> str:
        """A vertical ``<line>`` of class ``cls`` at pixel ``px``, from the plot's top to its bottom."""
        bottom = self.height - self.BOTTOM
        return f'<line class="{cls}" x1="{px:.1f}" x2="{px:.1f}" y1="{self.TOP}" y2="{bottom}"/>'

    def _hrule(self, py: float, cls: str) -> str:
        """A horizontal ``<line>`` of class ``cls`` at pixel ``py``, from the plot's left to its right."""
        right = self.width - self.RIGHT
        return f'<line class="{cls}" x1="{self.LEFT}" x2="{right}" y1="{py:.1f}" y2="{py:.1f}"/>'

    def span(self, x: float, lo: float, hi: float, cls: str, *, title: str | None = None) -> None:
        """A vertical error bar at ``x`` from ``lo`` to ``hi`` (an infinite end is drawn to the edge)."""
        px = self.x(x)
        top = self.y(hi) if math.isfinite(hi) else self.TOP
        element = f'<line class="{cls}" x1="{px:.1f}" x2="{px:.1f}" y1="{self.y(lo):.1f}" y2="{top:.1f}"/>'
        self.marks.append(_titled(element, title, None))

    def hspan(self, lo: float, hi: float, y: float, cls: str, *, title: str | None = None) -> None:
        """A horizontal bar at ``y`` from ``lo`` to ``hi`` (an infinite end is drawn to the edge)."""
        right = self.x(hi) if math.isfinite(hi) else self.width - self.RIGHT
        py = self.y(y)
        element = f'<line class="{cls}" x1="{self.x(lo):.1f}" x2="{right:.1f}" y1="{py:.1f}" y2="{py:.1f}"/>'
        self.marks.append(_titled(element, title, None))

    def render(self, *, xticks: int = 6, yticks: int = 5, axes: bool = True) -> str:
        """The ``<svg>`` element."""
        w, h = self.width, self.height
        parts = [
            f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {w} {h}" width="{w}" height="{h}" '
            f'role="img" aria-label="{escape(self.label, quote=True)}">'
        ]
        if axes:
            parts.extend(self._axes(xticks, yticks))
        parts.extend(self.marks)
        parts.append("</svg>")
        return "".join(parts)

    def _axes(self, xticks: int, yticks: int) -> list[str]:
        w, h = self.width, self.height
        bottom, right = h - self.BOTTOM, w - self.RIGHT
        out = [
            f'<rect class="plot" x="{self.LEFT}" y="{self.TOP}" width="{right - self.LEFT}" '
            f'height="{bottom - self.TOP}"/>'
        ]
        for value in self.x.ticks(xticks):
            px = self.x(value)
            out.append(self._vrule(px, "grid"))
            out.append(
                f'<text class="tick" x="{px:.1f}" y="{bottom + 14}" text-anchor="middle">{fmt(value)}</text>'
            )
        for value in self.y.ticks(yticks):
            py = self.y(value)
            out.append(self._hrule(py, "grid"))
            out.append(
                f'<text class="tick" x="{self.LEFT - 5}" y="{py + 4:.1f}" '
                f'text-anchor="end">{fmt(value)}</text>'
            )
        if self.xlabel:
            out.append(
                f'<text class="axis" x="{(self.LEFT + right) / 2:.1f}" y="{h - 6}" text-anchor="middle">'
                f"{escape(self.xlabel)}</text>"
            )
        if self.ylabel:
            mid = (self.TOP + bottom) / 2
            out.append(
                f'<text class="axis" transform="translate(13 {mid:.1f}) rotate(-90)" text-anchor="middle">'
                f"{escape(self.ylabel)}</text>"
            )
        return out


def marker(px: float, py: float, shape: str, r: float, cls: str) -> str:
    """One marker's SVG element at pixel ``(px, py)``."""
    c = f'class="pt {cls}"'
    if shape == "square":
        return f'<rect {c} x="{px - r:.1f}" y="{py - r:.1f}" width="{2 * r:.1f}" height="{2 * r:.1f}"/>'
    if shape in ("diamond", "triangle", "star", "cross"):
        return f'<polygon {c} points="{_polygon(px, py, shape, r)}"/>'
    return f'<circle {c} cx="{px:.1f}" cy="{py:.1f}" r="{r:.1f}"/>'


def _polygon(px: float, py: float, shape: str, r: float) -> str:
    if shape == "diamond":
        pts = [(0, -r * 1.25), (r * 1.25, 0), (0, r * 1.25), (-r * 1.25, 0)]
    elif shape == "triangle":
        pts = [(0, -r * 1.3), (r * 1.2, r * 0.9), (-r * 1.2, r * 0.9)]
    elif shape == "cross":
        a, b = r * 0.35, r * 1.2
        pts = [
            (-b, -a),
            (-a, -a),
            (-a, -b),
            (a, -b),
            (a, -a),
            (b, -a),
            (b, a),
            (a, a),
            (a, b),
            (-a, b),
            (-a, a),
            (-b, a),
        ]
    else:  # a five-pointed star
        pts = []
        for i in range(10):
            radius = r * 1.8 if i % 2 == 0 else r * 0.75
            angle = math.pi / 2 + i * math.pi / 5
            pts.append((radius * math.cos(angle), -radius * math.sin(angle)))
    return " ".join(f"{px + dx:.1f},{py + dy:.1f}" for dx, dy in pts)


def swatch(shape: str, cls: str, size: int = 12) -> str:
    """A legend marker: a tiny ``<svg>`` holding one marker."""
    half = size / 2
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" class="sw" width="{size}" height="{size}" '
        f'viewBox="0 0 {size} {size}" aria-hidden="true">{marker(half, half, shape, size / 3.2, cls)}</svg>'
    )


def ecdf(values: Sequence[float]) -> list[tuple[float, float]]:
    """The empirical CDF of ``values`` as staircase points (value, fraction at or below)."""
    ordered = sorted(v for v in values if math.isfinite(v))
    n = len(ordered)
    return [(v, (i + 1) / n) for i, v in enumerate(ordered)]


def quantile(values: Sequence[float], q: float) -> float | None:
    """The ``q`` quantile (linear interpolation, as numpy's default, which ``vllm bench serve`` uses)."""
    ordered = sorted(values)
    if not ordered:
        return None
    pos = q * (len(ordered) - 1)
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)
