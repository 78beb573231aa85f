"""Line charts written as SVG text, for the run report and the tune plot. No torch here: ``hf-gpu-train tune``'s
parent process draws with it and must not import torch.

Why not matplotlib: the report is drawn when training ends, on the path of every run that finishes, and importing
matplotlib costs ~0.7-1 s per process (its fonts, its backends) before the first line is drawn: about 1% of a short
fine-tune, spent on four small charts. These charts need lines, points, a dashed reference line, a second y axis,
ticks and a legend; SVG is text, opens in every browser and renders inline in Markdown viewers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#17becf", "#7f7f7f")
FONT = 'font-family="sans-serif"'
DASHES = {"solid": "", "dashed": "6 4", "dotted": "2 3"}


def escape(text: str) -> str:
    """``&``, ``<`` and ``>`` as XML entities (what ``xml.sax.saxutils.escape`` does, without its imports of urllib,
    http and ssl: the CLI starts faster)."""
    return str(text).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


@dataclass
class _Series:
    xs: list[float]
    ys: list[float]
    label: str
    color: str
    points: bool  # markers only, no line
    dash: str  # a DASHES key
    right: bool  # on the second y axis
    marker: str | None = None  # "circle", "cross" or "star" at each point
    size: float = 3.0


def nice_ticks(low: float, high: float, count: int = 5) -> list[float]:
    """Round tick values (1, 2, 2.5 or 5 times a power of ten) that cover [low, high] with about ``count`` steps."""
    if not (math.isfinite(low) and math.isfinite(high)):
        raise ValueError(f"tick range must be finite, got {low}..{high}")
    if high < low:
        low, high = high, low
    if high == low:
        pad = abs(low) * 0.1 or 1.0
        low, high = low - pad, high + pad
    raw = (high - low) / max(1, count)
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw * (1 - 1e-9))
    first = math.floor(low / step + 1e-9) * step
    last = math.ceil(high / step - 1e-9) * step
    return [round(first + i * step, 12) for i in range(int(round((last - first) / step)) + 1)]


def log2_ticks(low: float, high: float) -> list[float]:
    """Powers of two that cover [low, high] (both > 0): the ticks of a base-2 logarithmic axis."""
    if low <= 0 or high <= 0:
        raise ValueError(f"a logarithmic axis needs positive values, got {low}..{high}")
    first, last = math.floor(math.log2(min(low, high))), math.ceil(math.log2(max(low, high)))
    return [2.0 ** e for e in range(first, max(last, first + 1) + 1)]


def _finite(xs, ys, positive_x: bool) -> tuple[list[float], list[float]]:
    """The points that can be drawn: a NaN or an infinity (a reading that failed, a division by a zero time) is left
    out, as a gap, instead of breaking the chart; on a logarithmic x axis so are x <= 0."""
    kept = [(float(x), float(y)) for x, y in zip(xs, ys)
            if math.isfinite(float(x)) and math.isfinite(float(y)) and (float(x) > 0 or not positive_x)]
    return [x for x, _ in kept], [y for _, y in kept]


def _label(value: float) -> str:
    return f"{value:.6g}"


def _marker(kind: str, x: float, y: float, color: str, size: float) -> str:
    if kind == "cross":
        d = f"M{x - size:.1f},{y - size:.1f} L{x + size:.1f},{y + size:.1f} M{x - size:.1f},{y + size:.1f} L{x + size:.1f},{y - size:.1f}"
        return f'<path d="{d}" stroke="{color}" stroke-width="2" fill="none"/>'
    if kind == "star":
        corners = []
        for i in range(10):
            radius = size if i % 2 == 0 else size * 0.45
            angle = math.pi / 2 + i * math.pi / 5
            corners.append(f"{x + radius * math.cos(angle):.1f},{y - radius * math.sin(angle):.1f}")
        return f'<polygon points="{" ".join(corners)}" fill="{color}" stroke="black" stroke-width="0.8"/>'
    return f'<circle cx="{x:.1f}" cy="{y:.1f}" r="{size:.1f}" fill="{color}"/>'


class Chart:
    def __init__(self, title: str, xlabel: str = "", ylabel: str = "", right_label: str | None = None,
                 width: int = 800, height: int = 300, xlog2: bool = False):
        self.title, self.xlabel, self.ylabel, self.right_label = title, xlabel, ylabel, right_label
        self.width, self.height = width, height
        self.xlog2 = xlog2  # x on a base-2 logarithmic axis (micro-batch sizes)
        self.series: list[_Series] = []
        self.hlines: list[tuple[float, str, str, str]] = []  # (y, label, color, dash)
        self.ymax: float | None = None
        self.note: str | None = None  # a sentence in the middle of the plot area (nothing to draw, and why)

    def _color(self, color: str | None) -> str:
        return color or PALETTE[len(self.series) % len(PALETTE)]

    def line(self, xs, ys, label: str, color: str | None = None, dash: str = "solid", right: bool = False,
             marker: str | None = None) -> Chart:
        self.series.append(_Series(*_finite(xs, ys, self.xlog2), label, self._color(color), False, dash, right, marker))
        return self

    def points(self, xs, ys, label: str, color: str | None = None, marker: str = "circle", size: float = 3.0) -> Chart:
        self.series.append(_Series(*_finite(xs, ys, self.xlog2), label, self._color(color), True, "solid", False, marker, size))
        return self

    def hline(self, y: float, label: str, color: str = "gray", dash: str = "dashed") -> Chart:
        if math.isfinite(float(y)):
            self.hlines.append((float(y), label, color, dash))
        return self

    # -- rendering -------------------------------------------------------------------------------
    def _ticks(self, values: list[float]) -> list[float]:
        return nice_ticks(min(values), max(values)) if values else [0.0, 1.0]

    def render(self) -> str:
        left, right = 64, 64 if self.right_label else 20
        top, bottom = 30, 44
        plot_w, plot_h = self.width - left - right, self.height - top - bottom
        xs = [x for s in self.series for x in s.xs]
        x_ticks = (log2_ticks(min(xs), max(xs)) if xs else [1.0, 2.0]) if self.xlog2 else self._ticks(xs)
        y_values = [y for s in self.series if not s.right for y in s.ys] + [y for y, *_ in self.hlines]
        y_ticks = self._ticks(y_values + ([self.ymax] if self.ymax is not None else []))
        r_ticks = self._ticks([y for s in self.series if s.right for y in s.ys])

        def sx(x: float) -> float:
            if self.xlog2:
                return left + plot_w * (math.log2(x) - math.log2(x_ticks[0])) / (math.log2(x_ticks[-1]) - math.log2(x_ticks[0]))
            return left + plot_w * (x - x_ticks[0]) / ((x_ticks[-1] - x_ticks[0]) or 1.0)

        def sy(y: float, ticks: list[float]) -> float:
            return top + plot_h * (1 - (y - ticks[0]) / ((ticks[-1] - ticks[0]) or 1.0))

        out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{self.width}" height="{self.height}" '
               f'viewBox="0 0 {self.width} {self.height}">',
               f'<rect width="{self.width}" height="{self.height}" fill="white"/>',
               f'<text x="{self.width / 2:.1f}" y="18" text-anchor="middle" font-size="14" {FONT}>{escape(self.title)}</text>',
               f'<rect x="{left}" y="{top}" width="{plot_w}" height="{plot_h}" fill="none" stroke="black"/>']
        for t in x_ticks:
            x = sx(t)
            out.append(f'<line x1="{x:.1f}" y1="{top + plot_h}" x2="{x:.1f}" y2="{top + plot_h + 4}" stroke="black"/>')
            out.append(f'<text x="{x:.1f}" y="{top + plot_h + 16}" text-anchor="middle" font-size="10" {FONT}>{_label(t)}</text>')
        for t in y_ticks:
            y = sy(t, y_ticks)
            out.append(f'<line x1="{left - 4}" y1="{y:.1f}" x2="{left}" y2="{y:.1f}" stroke="black"/>')
            out.append(f'<text x="{left - 6}" y="{y + 3:.1f}" text-anchor="end" font-size="10" {FONT}>{_label(t)}</text>')
        if self.right_label:
            for t in r_ticks:
                y = sy(t, r_ticks)
                out.append(f'<line x1="{left + plot_w}" y1="{y:.1f}" x2="{left + plot_w + 4}" y2="{y:.1f}" stroke="black"/>')
                out.append(f'<text x="{left + plot_w + 6}" y="{y + 3:.1f}" font-size="10" {FONT}>{_label(t)}</text>')
            out.append(_vertical_text(self.width - 10, top + plot_h / 2, self.right_label))
        out.append(f'<text x="{left + plot_w / 2:.1f}" y="{self.height - 8}" text-anchor="middle" font-size="11" {FONT}>'
                   f'{escape(self.xlabel)}</text>')
        out.append(_vertical_text(14, top + plot_h / 2, self.ylabel))
        for y, _, color, dash in self.hlines:
            out.append(f'<line x1="{left}" y1="{sy(y, y_ticks):.1f}" x2="{left + plot_w}" y2="{sy(y, y_ticks):.1f}" '
                       f'stroke="{color}"{_dash(dash)}/>')
        for s in self.series:
            ticks = r_ticks if s.right else y_ticks
            coords = [(sx(x), sy(y, ticks)) for x, y in zip(s.xs, s.ys)]
            if not s.points and coords:
                path = " ".join(f"{x:.1f},{y:.1f}" for x, y in coords)
                out.append(f'<polyline points="{path}" fill="none" stroke="{s.color}" stroke-width="1.5"{_dash(s.dash)}/>')
            if s.marker:
                out += [_marker(s.marker, x, y, s.color, s.size) for x, y in coords]
        if self.note:
            out.append(f'<text x="{left + plot_w / 2:.1f}" y="{top + plot_h / 2:.1f}" text-anchor="middle" font-size="12" '
                       f'{FONT}>{escape(self.note)}</text>')
        out += self._legend(left + plot_w - 8, top + 8)
        out.append("</svg>")
        return "\n".join(out) + "\n"

    def _legend(self, right_edge: float, top: float) -> list[str]:
        entries = [(s.label, s.color, s.points, s.dash, s.marker) for s in self.series if s.label]
        entries += [(label, color, False, dash, None) for _, label, color, dash in self.hlines if label]
        if not entries:
            return []
        width = 30 + 6 * max(len(label) for label, *_ in entries)
        x0 = right_edge - width
        out = [f'<rect x="{x0:.1f}" y="{top:.1f}" width="{width}" height="{14 * len(entries) + 6}" fill="white" '
               f'fill-opacity="0.85" stroke="#cccccc"/>']
        for i, (label, color, points, dash, marker) in enumerate(entries):
            y = top + 12 + 14 * i
            if not points:
                out.append(f'<line x1="{x0 + 4:.1f}" y1="{y - 3:.1f}" x2="{x0 + 20:.1f}" y2="{y - 3:.1f}" stroke="{color}" '
                           f'stroke-width="1.5"{_dash(dash)}/>')
            if marker:
                out.append(_marker(marker, x0 + 12, y - 3, color, 3.0 if marker != "star" else 5.0))
            out.append(f'<text x="{x0 + 24:.1f}" y="{y:.1f}" font-size="10" {FONT}>{escape(label)}</text>')
        return out

    def save(self, path: Path) -> Path:
        Path(path).write_text(self.render(), encoding="utf-8")
        return Path(path)


def side_by_side(charts: list[Chart]) -> str:
    """Several charts in one SVG, left to right."""
    width, height = sum(c.width for c in charts), max(c.height for c in charts)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}">']
    offset = 0
    for chart in charts:
        inner = chart.render().replace('<svg xmlns="http://www.w3.org/2000/svg" ', f'<svg x="{offset}" y="0" ', 1)
        out.append(inner.rstrip("\n"))
        offset += chart.width
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _dash(kind: str) -> str:
    pattern = DASHES[kind]
    return f' stroke-dasharray="{pattern}"' if pattern else ""


def _vertical_text(x: float, y: float, text: str) -> str:
    return (f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="middle" font-size="11" transform="rotate(-90 {x:.1f} {y:.1f})" '
            f'{FONT}>{escape(text)}</text>')
