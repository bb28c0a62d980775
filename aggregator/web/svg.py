"""Inline SVG pictures for the status page: sparklines, stacked state bars, the link heat map.

Colours come from the stylesheet's classes (static/status.css), never from inline styles: the
page's Content-Security-Policy allows no inline style, and one palette serves cells and legends.
Every text that reaches the SVG is escaped by the caller's ``esc``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from html import escape
from typing import Final

__all__ = ["BANDS", "band", "heatmap", "sparkline", "stacked_bar"]

# Bandwidth over the pool's typical pair, lower edges of bands r1..r4 (r0 below the first).
BANDS: Final = (0.5, 0.7, 0.85, 0.95)


def _esc(text: str) -> str:
    return escape(text, quote=True)


def sparkline(values: Sequence[float | None], *, width: int = 180, height: int = 32, label: str) -> str:
    """A line through ``values`` (None: no sample), scaled to its own range, its last point marked."""
    pts = [(i, v) for i, v in enumerate(values) if v is not None and math.isfinite(v)]
    if not pts:
        return f'<svg width="{width}" height="{height}" role="img" aria-label="{_esc(label)}: no data"></svg>'
    lo = min(v for _, v in pts)
    hi = max(v for _, v in pts)
    span = hi - lo or 1.0
    step = (width - 4) / max(len(values) - 1, 1)

    def xy(i: int, v: float) -> tuple[float, float]:
        return 2 + i * step, height - 3 - (v - lo) / span * (height - 6)

    coords = " ".join(f"{x:.1f},{y:.1f}" for x, y in (xy(i, v) for i, v in pts))
    lx, ly = xy(*pts[-1])
    return (
        f'<svg width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img" '
        f'aria-label="{_esc(label)}"><title>{_esc(label)}</title>'
        f'<polyline class="spark" points="{coords}"/>'
        f'<circle class="spark-dot" cx="{lx:.1f}" cy="{ly:.1f}" r="2.5"/></svg>'
    )


def stacked_bar(parts: Sequence[tuple[str, int]], *, width: int = 220, height: int = 12) -> str:
    """One bar split by state (class ``f-<state>``), widths proportional to the counts."""
    total = sum(n for _, n in parts)
    out = [f'<svg width="{width}" height="{height}" role="img" aria-label="states">']
    out.append(f'<rect class="f-bg" width="{width}" height="{height}"/>')
    x = 0.0
    for state, n in parts:
        if n <= 0 or total == 0:
            continue
        w = n / total * width
        out.append(
            f'<rect class="f-{_esc(state)}" x="{x:.2f}" width="{max(w, 1.0):.2f}" height="{height}">'
            f"<title>{_esc(state)}: {n}</title></rect>"
        )
        x += w
    out.append("</svg>")
    return "".join(out)


def band(ratio: float | None) -> str:
    """The stylesheet class of a bandwidth ratio (``none``: no probe of the pair)."""
    if ratio is None or not math.isfinite(ratio):
        return "none"
    return f"r{sum(1 for edge in BANDS if ratio >= edge)}"


def heatmap(
    names: Sequence[str],
    cells: Mapping[tuple[int, int], tuple[float, str]],
    *,
    cell: int = 16,
    label_width: int = 72,
) -> str:
    """A symmetric matrix of ``names``: cell (i, j) coloured by its ratio, with a hover title.

    ``cells`` holds (ratio, title) for i < j; the lower triangle mirrors it. Titles show on hover
    in every browser without script.
    """
    n = len(names)
    size = label_width + n * cell + 2
    out = [
        f'<svg width="{size}" height="{size}" viewBox="0 0 {size} {size}" role="img" '
        f'aria-label="pair bandwidth heat map of {n} nodes">'
    ]
    out.append(
        f'<rect class="none" x="{label_width}" y="{label_width}" width="{n * cell}" height="{n * cell}"/>'
    )
    for i, name in enumerate(names):
        y = label_width + i * cell + cell - 2
        out.append(
            f'<text class="grid-label" x="{label_width - 4}" y="{y}" text-anchor="end">{_esc(name)}</text>'
        )
        x = label_width + i * cell + cell - 2
        out.append(
            f'<text class="grid-label" x="{x}" y="{label_width - 4}" '
            f'transform="rotate(-90 {x} {label_width - 4})">{_esc(name)}</text>'
        )
    for (i, j), (ratio, title) in cells.items():
        for r, c in ((i, j), (j, i)):
            out.append(
                f'<rect class="{band(ratio)}" x="{label_width + c * cell}" y="{label_width + r * cell}" '
                f'width="{cell - 1}" height="{cell - 1}"><title>{_esc(title)}</title></rect>'
            )
    out.append("</svg>")
    return "".join(out)
