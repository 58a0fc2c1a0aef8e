"""The report's charts: matplotlib figures rendered to inline PNG data URIs.

PNG data URIs keep ``report.html`` a single file that renders without any network access
(an inline SVG would carry namespace and DTD URLs). ``Figure`` is used directly, not pyplot,
so no GUI backend or global figure state is involved.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Sequence

from matplotlib.figure import Figure

DPI = 100
MAX_RELAYS = 20
MAX_LABEL = 48


def relay_labels(relays: Sequence[str]) -> list[str]:
    """Relay URLs as axis labels. They come from the network: a ``$`` would switch matplotlib
    to math mode (and a malformed formula would fail the whole report), and a very long URL
    would squeeze the chart, so dollars are escaped and long URLs shortened."""
    shortened = [r if len(r) <= MAX_LABEL else r[: MAX_LABEL - 1] + "\u2026" for r in relays]
    return [r.replace("$", r"\$") for r in shortened]


def to_data_uri(figure: Figure) -> str:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=DPI, bbox_inches="tight")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def latency_chart(
    relays: Sequence[str], p50: Sequence[int], p90: Sequence[int], p99: Sequence[int]
) -> str:
    """Lag percentiles per relay as a range from p50 to p99, p90 marked (symlog: lags can be 0)."""
    figure = Figure(figsize=(9, 0.35 * len(relays) + 1.5))
    axes = figure.subplots()
    rows = range(len(relays))
    axes.hlines(rows, p50, p99, color="#9aa7b8", linewidth=4)
    axes.scatter(p50, rows, color="#1f6feb", label="p50", zorder=3)
    axes.scatter(p90, rows, color="#d29922", label="p90", zorder=3)
    axes.scatter(p99, rows, color="#cf222e", label="p99", zorder=3)
    axes.set_yticks(list(rows), labels=relay_labels(relays))
    axes.invert_yaxis()
    axes.set_xscale("symlog", linthresh=10)
    axes.set_xlim(left=0)
    axes.set_xlabel("lag behind the first arrival (ms)")
    axes.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), ncols=3, frameon=False)
    axes.grid(axis="x", alpha=0.3)
    return to_data_uri(figure)


def miss_rate_chart(
    relays: Sequence[str],
    hours: Sequence[str],
    rates: Sequence[Sequence[float | None]],
    label: str = "miss rate",
) -> str:
    """Heat map of the hourly miss rate, one row per relay, so a degrading relay stands out."""
    figure = Figure(figsize=(min(3 + 0.25 * len(hours), 16), 0.35 * len(relays) + 1.8))
    axes = figure.subplots()
    values = [[float("nan") if rate is None else rate for rate in row] for row in rates]
    image = axes.imshow(
        values, aspect="auto", cmap="Reds", vmin=0.0, vmax=1.0, interpolation="nearest"
    )
    axes.set_yticks(range(len(relays)), labels=relay_labels(relays))
    step = max(1, len(hours) // 12)
    ticks = list(range(0, len(hours), step))
    # "2026-11-21T10:00:00Z" -> "11-21 10h": the year and minutes only crowd the axis.
    labels = [f"{hours[i][5:10]} {hours[i][11:13]}h" for i in ticks]
    axes.set_xticks(ticks, labels=labels, rotation=45, ha="right")
    figure.colorbar(image, ax=axes, label=label)
    return to_data_uri(figure)


def canary_chart(
    relays: Sequence[str],
    rates: Sequence[float],
    p50: Sequence[int | None],
    p99: Sequence[int | None],
) -> str:
    """Per relay: the canary delivery rate (bars, red under 0.9) and the p50-p99 range of
    publish -> receive times, side by side so a slow relay and a losing one read apart."""
    figure = Figure(figsize=(10, 0.3 * len(relays) + 1.5))
    rate_axes, time_axes = figure.subplots(1, 2, sharey=True, width_ratios=(1, 1.4))
    rows = range(len(relays))
    colours = ["#cf222e" if rate < 0.9 else "#2da44e" for rate in rates]
    rate_axes.barh(list(rows), rates, color=colours)
    rate_axes.set_xlim(0, 1)
    rate_axes.set_yticks(list(rows), labels=relay_labels(relays))
    rate_axes.invert_yaxis()
    rate_axes.set_xlabel("delivery rate")
    rate_axes.axvline(0.9, color="#59636e", linestyle="--", linewidth=1)
    rate_axes.grid(axis="x", alpha=0.3)
    timed = [(row, lo, hi) for row, lo, hi in zip(rows, p50, p99, strict=True) if lo is not None]
    if timed:
        ys, lows, highs = zip(*timed, strict=True)
        time_axes.hlines(ys, lows, highs, color="#9aa7b8", linewidth=4)
        time_axes.scatter(lows, ys, color="#1f6feb", label="p50", zorder=3)
        time_axes.scatter(highs, ys, color="#cf222e", label="p99", zorder=3)
        time_axes.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), ncols=2, frameon=False)
    time_axes.set_xscale("symlog", linthresh=100)
    time_axes.set_xlim(left=0)
    time_axes.set_xlabel("publish -> received (ms)")
    time_axes.grid(axis="x", alpha=0.3)
    return to_data_uri(figure)


def funnel_chart(
    platforms: Sequence[str], stages: Sequence[str], counts: Sequence[Sequence[int]]
) -> str:
    """Grouped bars per platform: events, then how many ended in each final status."""
    figure = Figure(figsize=(9, 4))
    axes = figure.subplots()
    width = 0.8 / len(stages)
    for index, stage in enumerate(stages):
        positions = [p + index * width for p in range(len(platforms))]
        axes.bar(positions, [row[index] for row in counts], width=width, label=stage)
    axes.set_xticks([p + 0.4 - width / 2 for p in range(len(platforms))], labels=list(platforms))
    axes.set_ylabel("events")
    axes.legend()
    axes.grid(axis="y", alpha=0.3)
    return to_data_uri(figure)
