"""Line charts written as SVG text, for the run report.

Why not matplotlib: the report is drawn when training ends, on the path of every run that finishes, and importing
matplotlib costs ~0.7-1 s per process (its fonts, its backends) before the first line is drawn: about 1% of a short
fine-tune, spent on four small charts. These charts need lines, points, a dashed reference line, a second y axis,
ticks and a legend; SVG is text, opens in every browser and renders inline in Markdown viewers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from xml.sax.saxutils import escape

PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#17becf", "#7f7f7f")
FONT = 'font-family="sans-serif"'


@dataclass
class _Series:
    xs: list[float]
    ys: list[float]
    label: str
    color: str
    points: bool  # markers only, no line
    dashed: bool
    right: bool  # on the second y axis


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


def _label(value: float) -> str:
    return f"{value:.6g}"


class Chart:
    def __init__(self, title: str, xlabel: str = "", ylabel: str = "", right_label: str | None = None,
                 width: int = 800, height: int = 300):
        self.title, self.xlabel, self.ylabel, self.right_label = title, xlabel, ylabel, right_label
        self.width, self.height = width, height
        self.series: list[_Series] = []
        self.hlines: list[tuple[float, str, str]] = []
        self.ymax: float | None = None

    def _color(self, color: str | None) -> str:
        return color or PALETTE[len(self.series) % len(PALETTE)]

    def line(self, xs, ys, label: str, color: str | None = None, dashed: bool = False, right: bool = False) -> Chart:
        self.series.append(_Series(list(map(float, xs)), list(map(float, ys)), label, self._color(color), False, dashed, right))
        return self

    def points(self, xs, ys, label: str, color: str | None = None) -> Chart:
        self.series.append(_Series(list(map(float, xs)), list(map(float, ys)), label, self._color(color), True, False, False))
        return self

    def hline(self, y: float, label: str, color: str = "gray") -> Chart:
        self.hlines.append((float(y), label, color))
        return self

    # -- rendering -------------------------------------------------------------------------------
    def _ticks(self, values: list[float]) -> list[float]:
        return nice_ticks(min(values), max(values)) if values else [0.0, 1.0]

    def render(self) -> str:
        left, right = 64, 64 if self.right_label else 20
        top, bottom = 30, 44
        plot_w, plot_h = self.width - left - right, self.height - top - bottom
        xs = [x for s in self.series for x in s.xs]
        x_ticks = self._ticks(xs)
        y_values = [y for s in self.series if not s.right for y in s.ys] + [y for y, _, _ in self.hlines]
        y_ticks = self._ticks(y_values + ([self.ymax] if self.ymax is not None else []))
        r_ticks = self._ticks([y for s in self.series if s.right for y in s.ys])

        def sx(x: float) -> float:
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
        for y, _, color in self.hlines:
            out.append(f'<line x1="{left}" y1="{sy(y, y_ticks):.1f}" x2="{left + plot_w}" y2="{sy(y, y_ticks):.1f}" '
                       f'stroke="{color}" stroke-dasharray="6 4"/>')
        for s in self.series:
            ticks = r_ticks if s.right else y_ticks
            coords = [(sx(x), sy(y, ticks)) for x, y in zip(s.xs, s.ys)]
            if s.points:
                out += [f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{s.color}"/>' for x, y in coords]
            elif coords:
                dash = ' stroke-dasharray="6 4"' if s.dashed else ""
                path = " ".join(f"{x:.1f},{y:.1f}" for x, y in coords)
                out.append(f'<polyline points="{path}" fill="none" stroke="{s.color}" stroke-width="1.5"{dash}/>')
        out += self._legend(left + plot_w - 8, top + 8)
        out.append("</svg>")
        return "\n".join(out) + "\n"

    def _legend(self, right_edge: float, top: float) -> list[str]:
        entries = [(s.label, s.color, s.points, s.dashed) for s in self.series if s.label]
        entries += [(label, color, False, True) for _, label, color in self.hlines if label]
        if not entries:
            return []
        width = 30 + 6 * max(len(label) for label, *_ in entries)
        x0 = right_edge - width
        out = [f'<rect x="{x0:.1f}" y="{top:.1f}" width="{width}" height="{14 * len(entries) + 6}" fill="white" '
               f'fill-opacity="0.85" stroke="#cccccc"/>']
        for i, (label, color, points, dashed) in enumerate(entries):
            y = top + 12 + 14 * i
            if points:
                out.append(f'<circle cx="{x0 + 12:.1f}" cy="{y - 3:.1f}" r="3" fill="{color}"/>')
            else:
                dash = ' stroke-dasharray="6 4"' if dashed else ""
                out.append(f'<line x1="{x0 + 4:.1f}" y1="{y - 3:.1f}" x2="{x0 + 20:.1f}" y2="{y - 3:.1f}" stroke="{color}" '
                           f'stroke-width="1.5"{dash}/>')
            out.append(f'<text x="{x0 + 24:.1f}" y="{y:.1f}" font-size="10" {FONT}>{escape(label)}</text>')
        return out

    def save(self, path: Path) -> Path:
        Path(path).write_text(self.render())
        return Path(path)


def _vertical_text(x: float, y: float, text: str) -> str:
    return (f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="middle" font-size="11" transform="rotate(-90 {x:.1f} {y:.1f})" '
            f'{FONT}>{escape(text)}</text>')
