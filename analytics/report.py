"""``report.html``: the tables and a chart of each job, in one self-contained page.

Everything the page shows is collected from the (small) job results on the driver; the page
references no external resource, so it reads the same offline, from a mail attachment or an
object store. Relay URLs come from the log, i.e. from the network: they are HTML-escaped.
"""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence
from typing import Any

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from analytics import charts, delivery, dropped_events, relay_latency

STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #1f2328; }
h1 { font-size: 1.6em; } h2 { margin-top: 2em; border-bottom: 1px solid #d0d7de; }
table { border-collapse: collapse; margin: 1em 0; font-size: 0.9em; }
th, td { border: 1px solid #d0d7de; padding: 0.25em 0.6em; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
th { background: #f6f8fa; } p.note { color: #59636e; } img { max-width: 100%; }
"""

NO_DATA = '<p class="note">No data in this window.</p>'
AGE_NOTE = (
    '<p class="note">Includes the sender\'s publishing delay and clock skew. Kind 1059 is left '
    "out: NIP-59 back-dates its created_at by up to two days.</p>"
)


def _cell(value: Any) -> str:
    if value is None:
        return "<td>&ndash;</td>"
    if isinstance(value, float):
        return f'<td class="num">{value:.4f}</td>'
    if isinstance(value, int):
        return f'<td class="num">{value}</td>'
    return f"<td>{html.escape(str(value))}</td>"


def _table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    if not rows:
        return NO_DATA
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(_cell(v) for v in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _image(uri: str, alt: str) -> str:
    return f'<img src="{uri}" alt="{html.escape(alt)}">'


def _collect(df: DataFrame) -> tuple[list[str], list[tuple[Any, ...]]]:
    return df.columns, [tuple(row) for row in df.collect()]


def _latency_section(results: Mapping[str, DataFrame]) -> str:
    columns, rows = _collect(results[relay_latency.OUTPUT])
    age_columns, age_rows = _collect(results[relay_latency.CREATED_AT_OUTPUT])
    parts = ["<h2>Relay latency</h2>", _table(columns, rows)]
    if rows:
        top = sorted(rows, key=lambda r: (-r[1], r[0]))[: charts.MAX_RELAYS]
        chart = charts.latency_chart(
            [r[0] for r in top], [r[2] for r in top], [r[3] for r in top], [r[4] for r in top]
        )
        parts.append(_image(chart, "lag percentiles per relay"))
    parts += ["<h3>Kind 4: arrival minus created_at</h3>", AGE_NOTE, _table(age_columns, age_rows)]
    return "\n".join(parts)


def _dropped_section(results: Mapping[str, DataFrame]) -> str:
    columns, rows = _collect(results[dropped_events.OUTPUT])
    parts = ["<h2>Dropped events</h2>", _table(columns, rows)]
    # The relays that matter most are those delivering the most: chart their hours.
    watched = [r[0] for r in sorted(rows, key=lambda r: (-r[2], -r[1], r[0])) if r[1] > 0][
        : charts.MAX_RELAYS
    ]
    if watched:
        hourly = results[dropped_events.HOURLY_OUTPUT].where(F.col("relay").isin(watched))
        cells = {(r["relay"], r["hour"]): r["miss_rate"] for r in hourly.collect()}
        hours = sorted({hour for _, hour in cells})
        rates = [[cells.get((relay, hour)) for hour in hours] for relay in watched]
        parts.append(
            _image(charts.miss_rate_chart(watched, hours, rates), "miss rate per relay and hour")
        )
    return "\n".join(parts)


def _delivery_section(results: Mapping[str, DataFrame]) -> str:
    columns, rows = _collect(results[delivery.OUTPUT])
    parts = ["<h2>Delivery funnel</h2>", _table(columns, rows)]
    if rows:
        stages = ["events", *delivery.FINAL_STATUSES]
        counts = [[row[columns.index(stage)] for stage in stages] for row in rows]
        parts.append(
            _image(charts.funnel_chart([r[0] for r in rows], stages, counts), "delivery funnel")
        )
    return "\n".join(parts)


def render(summary: Sequence[tuple[str, str]], results: Mapping[str, DataFrame]) -> str:
    """The whole page: a summary of the run, then latency, dropped events and delivery."""
    facts = "".join(
        f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in summary
    )
    sections = [_latency_section(results), _dropped_section(results), _delivery_section(results)]
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        "<title>sigil-push relay health</title>"
        f"<style>{STYLE}</style></head><body>\n<h1>sigil-push relay health</h1>\n"
        f"<table>{facts}</table>\n" + "\n".join(sections) + "\n</body></html>\n"
    )
