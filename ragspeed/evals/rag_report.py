"""The `ragspeed eval rag` page: one self-contained HTML file (inline SVG and CSS, no script,
nothing fetched) with accuracy against TTFT per configuration, accuracy by gold position, and
the tables of the text report."""

from __future__ import annotations

import html
import math
from collections.abc import Mapping, Sequence
from typing import Any

from ragspeed.evals.rag import SUMMARY_HEADER, position_rows, summary_rows

WIDTH, HEIGHT = 760, 440
MARGIN = {"left": 64, "right": 170, "top": 20, "bottom": 48}
PALETTE = (
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
)


def _family(name: str) -> str:
    return name.split("@", 1)[0]


def _colours(names: Sequence[str]) -> dict[str, str]:
    """One colour per family (full, each method, retrieval), so the rates of a method match."""
    families = list(dict.fromkeys(_family(n) for n in names))
    return {n: PALETTE[families.index(_family(n)) % len(PALETTE)] for n in names}


def _y_top(values: Sequence[float]) -> float:
    """The accuracy axis' top: the next tenth above the largest value, within [0.1, 1]."""
    return min(1.0, max(0.1, math.ceil(max(values, default=0.0) * 10 + 1e-9) / 10))


def _y_axis(top: float, plot_w: float, plot_h: float) -> list[str]:
    parts = []
    steps = max(1, round(top * 10))  # a line every 0.1 (`top` is a tenth, at most 1)
    for k in range(steps + 1):
        value = top * k / steps
        y = MARGIN["top"] + plot_h * (1 - k / steps)
        parts.append(
            f'<line x1="{MARGIN["left"]}" x2="{MARGIN["left"] + plot_w}" y1="{y:.1f}" y2="{y:.1f}" class="grid"/>'
            f'<text x="{MARGIN["left"] - 8}" y="{y + 4:.1f}" text-anchor="end">{value:.2f}</text>'
        )
    parts.append(
        f'<text transform="translate(16 {MARGIN["top"] + plot_h / 2:.1f}) rotate(-90)" text-anchor="middle">accuracy</text>'
    )
    return parts


def scatter_svg(points: Sequence[tuple[str, float, float]]) -> str:
    """Accuracy (y) against TTFT p50 in ms (x, log scale), one labelled point per configuration."""
    plot_w = WIDTH - MARGIN["left"] - MARGIN["right"]
    plot_h = HEIGHT - MARGIN["top"] - MARGIN["bottom"]
    lo = math.floor(math.log10(max(min(p[1] for p in points), 1e-3)))
    hi = math.ceil(math.log10(max(max(p[1] for p in points), 1e-3)))
    hi = max(hi, lo + 1)
    top = _y_top([p[2] for p in points])
    colours = _colours([p[0] for p in points])

    def x(ms: float) -> float:
        return MARGIN["left"] + plot_w * (math.log10(max(ms, 1e-3)) - lo) / (hi - lo)

    def y(acc: float) -> float:
        return MARGIN["top"] + plot_h * (1 - acc / top)

    parts = _y_axis(top, plot_w, plot_h)
    for decade in range(lo, hi + 1):
        for mult in (1, 2, 5):
            value = mult * 10**decade
            if not 10**lo <= value <= 10**hi:
                continue
            xv = x(value)
            label = f"{value:g}"
            parts.append(
                f'<line x1="{xv:.1f}" x2="{xv:.1f}" y1="{MARGIN["top"]}" y2="{MARGIN["top"] + plot_h}" class="grid"/>'
                f'<text x="{xv:.1f}" y="{MARGIN["top"] + plot_h + 16}" text-anchor="middle">{label}</text>'
            )
    parts.append(
        f'<text x="{MARGIN["left"] + plot_w / 2:.1f}" y="{HEIGHT - 8}" text-anchor="middle">TTFT p50 (ms, log scale)</text>'
    )
    for name, ttft, acc in points:
        cx, cy = x(ttft), y(acc)
        parts.append(
            f'<circle class="point" cx="{cx:.1f}" cy="{cy:.1f}" r="5" fill="{colours[name]}">'
            f"<title>{html.escape(name)}: accuracy {acc:.3f}, TTFT p50 {ttft:.0f} ms</title></circle>"
            f'<text x="{cx + 7:.1f}" y="{cy - 6:.1f}" class="label">{html.escape(name)}</text>'
        )
    return _svg("accuracy against TTFT", parts)


def position_svg(positions: Sequence[int], series: Sequence[tuple[str, Sequence[float | None]]]) -> str:
    """Accuracy (y) by gold document position (x), one line per configuration, with a legend."""
    plot_w = WIDTH - MARGIN["left"] - MARGIN["right"]
    plot_h = HEIGHT - MARGIN["top"] - MARGIN["bottom"]
    top = _y_top([v for _, values in series for v in values if v is not None])
    colours = _colours([name for name, _ in series])
    span = max(positions[-1] - positions[0], 1)

    def x(position: int) -> float:
        return MARGIN["left"] + plot_w * (position - positions[0]) / span

    def y(acc: float) -> float:
        return MARGIN["top"] + plot_h * (1 - acc / top)

    parts = _y_axis(top, plot_w, plot_h)
    for position in positions:
        parts.append(
            f'<text x="{x(position):.1f}" y="{MARGIN["top"] + plot_h + 16}" text-anchor="middle">{position}</text>'
        )
    parts.append(
        f'<text x="{MARGIN["left"] + plot_w / 2:.1f}" y="{HEIGHT - 8}" text-anchor="middle">position of the gold document</text>'
    )
    for k, (name, values) in enumerate(series):
        colour = colours[name]
        dashed = ' stroke-dasharray="5 3"' if k % 2 else ""
        points = [(x(p), y(v)) for p, v in zip(positions, values) if v is not None]
        if len(points) > 1:
            path = " ".join(f"{px:.1f},{py:.1f}" for px, py in points)
            parts.append(
                f'<polyline class="series" points="{path}" fill="none" stroke="{colour}" stroke-width="2"{dashed}/>'
            )
        for px, py in points:
            parts.append(f'<circle class="point" cx="{px:.1f}" cy="{py:.1f}" r="3" fill="{colour}"/>')
        ly = MARGIN["top"] + 14 * k + 6
        lx = WIDTH - MARGIN["right"] + 14
        parts.append(
            f'<line x1="{lx}" x2="{lx + 18}" y1="{ly}" y2="{ly}" stroke="{colour}" stroke-width="2"{dashed}/>'
            f'<text x="{lx + 24}" y="{ly + 4}" class="label">{html.escape(name)}</text>'
        )
    return _svg("accuracy by gold position", parts)


def _svg(title: str, parts: Sequence[str]) -> str:
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
        f'viewBox="0 0 {WIDTH} {HEIGHT}" role="img" aria-label="{html.escape(title)}">'
        f'<rect x="0" y="0" width="{WIDTH}" height="{HEIGHT}" fill="white"/>' + "".join(parts) + "</svg>"
    )


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def render_html(report: Mapping[str, Any], machine: str = "") -> str:
    ok = {n: s for n, s in report["configs"].items() if s["status"] == "ok"}
    points = [
        (n, s["ttft_ms_p50"], s["accuracy"])
        for n, s in ok.items()
        if s["ttft_ms_p50"] is not None and s["accuracy"] is not None
    ]
    scatter = scatter_svg(points) if points else "<p>No configuration answered.</p>"
    positions = report["gold_positions"]
    if positions and ok:
        series = [
            (n, [s["accuracy_by_gold_index"][str(p)]["accuracy"] for p in positions]) for n, s in ok.items()
        ]
        by_position = position_svg(positions, series)
        position_table = _table(("configuration", *(str(p) for p in positions)), position_rows(report))
    else:
        by_position, position_table = "<p>The data gives no gold positions.</p>", ""
    setup = report.get("setup") or {}
    failed = "".join(
        f"<li><b>{html.escape(n)}</b>: {html.escape(e)}</li>" for n, e in report["failed"].items()
    )
    skipped = "".join(
        f"<li>line {s['line']}: {html.escape(s['reason'])}</li>" for s in report.get("skipped_lines") or []
    )
    setup_rows = [(k, str(v)) for k, v in setup.items()]
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>ragspeed eval rag</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 24px; color: #222; }}
table {{ border-collapse: collapse; margin: 8px 0 24px; }}
th, td {{ border: 1px solid #ccc; padding: 4px 8px; text-align: right; font-size: 13px; white-space: nowrap; }}
th:first-child, td:first-child {{ text-align: left; }}
svg text {{ font-size: 12px; fill: #333; }}
svg .label {{ font-size: 11px; }}
svg .grid {{ stroke: #e5e5e5; }}
</style></head><body>
<h1>ragspeed eval rag</h1>
<p>{html.escape(machine)}</p>
<h2>Summary</h2>
{_table(SUMMARY_HEADER, summary_rows(report))}
<h2>Accuracy against TTFT</h2>
{scatter}
<h2>Accuracy by gold position</h2>
{by_position}
{position_table}
{"<h2>Failed configurations</h2><ul>" + failed + "</ul>" if failed else ""}
{"<h2>Skipped lines</h2><ul>" + skipped + "</ul>" if skipped else ""}
<h2>Setup</h2>
{_table(("setting", "value"), setup_rows)}
</body></html>
"""
