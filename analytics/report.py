"""``report.html``: one self-contained page an operator reads top-down.

Layout, for an instance watching hundreds of relays: a summary first (the window, the five
worst relays by inbox miss rate and by canary delivery, wakeups accepted versus failed per
platform), then one section per output, the canary first (the ground truth), then inbox
misses, latency and the delivery funnel. Each section shows its chart before its table; the
charts show the worst or busiest 20 relays, the tables every relay, collapsed when long and
sortable by any column with a few lines of inline script.

Everything is collected from the (small) job results on the driver; the page references no
external resource (charts are inline PNGs, script and style are inline), so it reads the
same offline, from a mail attachment or an object store. Relay URLs come from the log, i.e.
from the network: they are HTML-escaped.
"""

from __future__ import annotations

import html
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from analytics import canary, charts, delivery, dropped_events, relay_latency

SUMMARY_ROWS = 5
# The summary's worst relays by miss rate are drawn from relays with at least this many
# expected DMs (when there are any), so one miss out of three does not top the list.
SUMMARY_MIN_EXPECTED = 10
# Tables with more rows than this start collapsed.
OPEN_TABLE_ROWS = 12

STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5em auto; max-width: 1100px;
       padding: 0 1em; color: #1f2328; }
h1 { font-size: 1.6em; margin-bottom: 0.2em; }
h2 { margin-top: 1.8em; border-bottom: 1px solid #d0d7de; }
h3 { margin: 1em 0 0.3em; font-size: 1.05em; }
.cards { display: grid; grid-template-columns: repeat(auto-fit, minmax(480px, 1fr)); gap: 1em; }
.card { border: 1px solid #d0d7de; border-radius: 6px; padding: 0 0.8em 0.6em; overflow-x: auto; }
table { border-collapse: collapse; margin: 0.6em 0; font-size: 0.88em; }
th, td { border: 1px solid #d0d7de; padding: 0.2em 0.5em; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
th { background: #f6f8fa; text-align: left; }
table.sortable th { cursor: pointer; position: sticky; top: 0; white-space: nowrap; }
table.sortable th[aria-sort="ascending"]::after { content: " \\25B2"; }
table.sortable th[aria-sort="descending"]::after { content: " \\25BC"; }
.card td.url { white-space: nowrap; }
td.url { max-width: 30em; overflow-wrap: anywhere; }
td.bad { background: #ffebe9; }
details { margin: 0.6em 0; } summary { cursor: pointer; color: #0969da; }
p.note { color: #59636e; margin: 0.3em 0; } img { max-width: 100%; }
"""

# Sorts a table.sortable by the clicked column: numbers by their data-v, text otherwise;
# a second click reverses. Kept tiny and inline: the page must work offline.
SORT_SCRIPT = """
document.querySelectorAll("table.sortable th").forEach(function (th, col) {
  th.addEventListener("click", function () {
    var body = th.closest("table").tBodies[0];
    var up = th.getAttribute("aria-sort") !== "ascending";
    th.parentNode.querySelectorAll("th").forEach(function (h) { h.removeAttribute("aria-sort"); });
    th.setAttribute("aria-sort", up ? "ascending" : "descending");
    var key = function (row) {
      var cell = row.cells[th.cellIndex];
      return cell.hasAttribute("data-v") ? Number(cell.getAttribute("data-v")) : cell.textContent;
    };
    Array.from(body.rows).sort(function (a, b) {
      var x = key(a), y = key(b);
      return (x < y ? -1 : x > y ? 1 : 0) * (up ? 1 : -1);
    }).forEach(function (row) { body.appendChild(row); });
  });
});
"""

NO_DATA = '<p class="note">No data in this window.</p>'
AGE_NOTE = (
    '<p class="note">Includes the sender\'s publishing delay and clock skew. Kind 1059 is left '
    "out: NIP-59 back-dates its created_at by up to two days.</p>"
)
NO_EXPECT = (
    '<p class="note">No <code>expect</code> records in this window (a bridge older than the '
    "inbox-aware log?): inbox columns are 0 and relays are ranked by their overall miss rate, "
    "which counts DMs a relay was never sent.</p>"
)
NO_CANARY = (
    '<p class="note">No canary probes in this window: enable <code>[canary]</code> in the '
    "bridge's configuration to measure real deliveries.</p>"
)

Row = tuple[Any, ...]


def _is_rate(column: str) -> bool:
    return column.endswith(("_rate", "share"))


def _cell(column: str, value: Any, bad: bool = False) -> str:
    css = ' class="num bad"' if bad else ' class="num"'
    if value is None:
        return f'<td{css} data-v="-Infinity">&ndash;</td>'
    if isinstance(value, bool):
        return f"<td>{value}</td>"
    if isinstance(value, float):
        shown = f"{value * 100:.1f}&nbsp;%" if _is_rate(column) else f"{value:.4f}"
        return f'<td{css} data-v="{value!r}">{shown}</td>'
    if isinstance(value, int):
        return f'<td{css} data-v="{value}">{value}</td>'
    return f'<td class="url">{html.escape(str(value))}</td>'


def _table(
    columns: Sequence[str],
    rows: Sequence[Row],
    bad: Callable[[str, Any], bool] | None = None,
    labels: Sequence[str] | None = None,
) -> str:
    """A sortable table; ``bad(column, value)`` marks cells worth an operator's attention,
    ``labels`` replace the column names in the header (the short summary tables)."""
    if not rows:
        return NO_DATA
    head = "".join(f"<th>{html.escape(c)}</th>" for c in labels or columns)
    body = "".join(
        "<tr>"
        + "".join(
            _cell(c, v, bad is not None and v is not None and bad(c, v))
            for c, v in zip(columns, row, strict=True)
        )
        + "</tr>"
        for row in rows
    )
    return f'<table class="sortable"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _collapsible(label: str, table: str, rows: int) -> str:
    """A long table behind a <details>; a short one open, so nothing needs a click."""
    if rows == 0:
        return table
    opened = " open" if rows <= OPEN_TABLE_ROWS else ""
    noun = "row" if rows == 1 else "rows"
    return (
        f"<details{opened}><summary>{html.escape(label)}: all {rows} {noun} "
        f"(click a column to sort)</summary>{table}</details>"
    )


def _image(uri: str, alt: str) -> str:
    return f'<img src="{uri}" alt="{html.escape(alt)}">'


def _collect(df: DataFrame) -> tuple[list[str], list[Row]]:
    return df.columns, [tuple(row) for row in df.collect()]


def _by(columns: Sequence[str], name: str) -> Callable[[Row], Any]:
    index = columns.index(name)
    return lambda row: row[index]


def _bad_miss(column: str, value: Any) -> bool:
    return column.endswith("miss_rate") and value >= 0.1


def _bad_delivery(column: str, value: Any) -> bool:
    return column == "delivery_rate" and value < 0.9


# --- the ranking every part of the page shares -------------------------------------------


def _inbox_ranked(columns: Sequence[str], rows: Sequence[Row]) -> tuple[list[Row], bool]:
    """Relays worst first by inbox miss rate (then missed count); by the overall miss rate
    when the window has no ``expect`` records. Returns the ranking and whether it is inbox."""
    inbox_expected = _by(columns, "inbox_expected")
    has_inbox = any(inbox_expected(r) > 0 for r in rows)
    prefix = "inbox_" if has_inbox else ""
    rate, missed = _by(columns, f"{prefix}miss_rate"), _by(columns, f"{prefix}missed")
    relay = _by(columns, "relay")
    ranked = sorted(rows, key=lambda r: (-rate(r), -missed(r), relay(r)))
    return ranked, has_inbox


def _canary_ranked(columns: Sequence[str], rows: Sequence[Row]) -> list[Row]:
    rate, probes, relay = (
        _by(columns, "delivery_rate"),
        _by(columns, "probes"),
        _by(columns, "relay"),
    )
    return sorted(rows, key=lambda r: (rate(r), -probes(r), relay(r)))


def _pick(columns: Sequence[str], rows: Sequence[Row], names: Sequence[str]) -> list[Row]:
    getters = [_by(columns, n) for n in names]
    return [tuple(get(r) for get in getters) for r in rows]


# --- sections ---------------------------------------------------------------------------


def _summary(facts: Sequence[tuple[str, str]], tables: dict[str, Any]) -> str:
    fact_rows = "".join(
        f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in facts
    )
    d_cols, d_rows = tables["dropped"]
    ranked, has_inbox = _inbox_ranked(d_cols, d_rows)
    if has_inbox:
        names = ["relay", "inbox_expected", "inbox_missed", "inbox_miss_rate"]
        labels = ["relay", "inbox DMs", "missed", "miss rate"]
        inbox_note = ""
    else:
        names = ["relay", "expected", "missed", "miss_rate"]
        labels = ["relay", "expected", "missed", "miss rate"]
        inbox_note = NO_EXPECT
    expected = _by(d_cols, names[1])
    worst = [r for r in ranked if expected(r) >= SUMMARY_MIN_EXPECTED]
    if worst:
        inbox_note += (
            f'<p class="note">Relays with at least {SUMMARY_MIN_EXPECTED} '
            f"{labels[1]}; the table below ranks all.</p>"
        )
    else:
        worst = [r for r in ranked if expected(r) > 0]
    inbox_card = (
        "<h3>Worst relays by inbox miss rate</h3>"
        + inbox_note
        + _table(names, _pick(d_cols, worst[:SUMMARY_ROWS], names), _bad_miss, labels)
    )
    c_cols, c_rows = tables["canary"]
    c_names = ["relay", "probes", "delivered", "delivery_rate", "p99_ms"]
    canary_card = "<h3>Worst relays by canary delivery</h3>" + (
        _table(
            c_names,
            _pick(c_cols, _canary_ranked(c_cols, c_rows)[:SUMMARY_ROWS], c_names),
            _bad_delivery,
            ["relay", "probes", "delivered", "rate", "p99 ms"],
        )
        if c_rows
        else NO_CANARY
    )
    p_cols, p_rows = tables["delivery"]
    wakeups = []
    held_back = 0
    for row in p_rows:
        get = dict(zip(p_cols, row, strict=True))
        if get["platform"] == delivery.NO_PLATFORM:
            held_back = get["suppressed"]
            continue
        failed = sum(get[s] for s in delivery.FINAL_STATUSES[1:])
        done = get["accepted"] + failed
        wakeups.append(
            (get["platform"], get["events"], get["accepted"], failed,
             get["accepted"] / done if done else None)
        )
    push_card = (
        "<h3>Wakeups per platform</h3>"
        + _table(
            ["platform", "wakeups", "accepted", "failed", "accepted_share"],
            wakeups,
            labels=["platform", "wakeups", "accepted", "failed", "accepted"],
        )
        + '<p class="note">failed: unregistered, rejected or failed at the provider; wakeups '
        "still being retried count in neither. "
        f"Suppressed by the recipients' own choices (pause, presence, mutes, follows-only), "
        f"not failures: {held_back} DMs.</p>"
    )
    cards = "".join(f'<div class="card">{c}</div>' for c in (inbox_card, canary_card, push_card))
    return f'<table>{fact_rows}</table>\n<div class="cards">{cards}</div>'


def _canary_section(tables: dict[str, Any]) -> str:
    columns, rows = tables["canary"]
    parts = ['<h2 id="canary">Canary probes</h2>']
    if not rows:
        return "\n".join([*parts, NO_CANARY])
    parts.append(
        '<p class="note">Ground truth: a probe DM the bridge published to each relay and '
        "watched for through its own subscription. Chart: the 20 relays delivering the "
        "fewest.</p>"
    )
    top = _canary_ranked(columns, rows)[: charts.MAX_RELAYS]
    relay, rate, p50, p99 = (_by(columns, n) for n in ("relay", "delivery_rate", "p50_ms", "p99_ms"))
    chart = charts.canary_chart(
        [relay(r) for r in top], [rate(r) for r in top], [p50(r) for r in top],
        [p99(r) for r in top],
    )
    parts.append(_image(chart, "canary delivery rate and time per relay"))
    table = _table(columns, _canary_ranked(columns, rows), _bad_delivery)
    parts.append(_collapsible("Canary per relay", table, len(rows)))
    return "\n".join(parts)


def _dropped_section(results: Mapping[str, DataFrame], tables: dict[str, Any]) -> str:
    columns, rows = tables["dropped"]
    ranked, has_inbox = _inbox_ranked(columns, rows)
    parts = ['<h2 id="misses">Missed DMs</h2>']
    parts.append(
        '<p class="note">inbox_*: DMs whose recipient lists the relay as an inbox relay, first '
        "seen anywhere while the relay was connected, and not delivered by it within the "
        "grace. The overall columns count every DM, also those the relay was never sent.</p>"
    )
    if not has_inbox and rows:
        parts.append(NO_EXPECT)
    expected = _by(columns, "inbox_expected" if has_inbox else "expected")
    watched = [_by(columns, "relay")(r) for r in ranked if expected(r) > 0][: charts.MAX_RELAYS]
    if watched:
        prefix = "inbox_" if has_inbox else ""
        hourly = results[dropped_events.HOURLY_OUTPUT].where(F.col("relay").isin(watched))
        # An hour in which nothing was expected has no rate: blank, not a reassuring 0.
        cells = {
            (r["relay"], r["hour"]): r[f"{prefix}miss_rate"] if r[f"{prefix}expected"] else None
            for r in hourly.collect()
        }
        hours = sorted({hour for _, hour in cells})
        rates = [[cells.get((relay, hour)) for hour in hours] for relay in watched]
        label = "inbox miss rate" if has_inbox else "miss rate"
        parts.append(
            '<p class="note">Chart: the 20 relays with the highest '
            f"{label}, hour by hour.</p>"
        )
        parts.append(
            _image(charts.miss_rate_chart(watched, hours, rates, label), f"{label} per hour")
        )
    parts.append(_collapsible("Misses per relay", _table(columns, ranked, _bad_miss), len(rows)))
    return "\n".join(parts)


def _latency_section(results: Mapping[str, DataFrame]) -> str:
    columns, rows = _collect(results[relay_latency.OUTPUT])
    age_columns, age_rows = _collect(results[relay_latency.CREATED_AT_OUTPUT])
    parts = ['<h2 id="latency">Relay latency</h2>']
    if rows:
        events, relay = _by(columns, "events"), _by(columns, "relay")
        top = sorted(rows, key=lambda r: (-events(r), relay(r)))[: charts.MAX_RELAYS]
        p50, p90, p99 = (_by(columns, f"lag_p{q}_ms") for q in (50, 90, 99))
        chart = charts.latency_chart(
            [relay(r) for r in top], [p50(r) for r in top], [p90(r) for r in top],
            [p99(r) for r in top],
        )
        parts.append('<p class="note">Chart: the 20 relays delivering the most events.</p>')
        parts.append(_image(chart, "lag percentiles per relay"))
    parts.append(_collapsible("Lag per relay", _table(columns, rows), len(rows)))
    parts += ["<h3>Kind 4: arrival minus created_at</h3>", AGE_NOTE]
    parts.append(_collapsible("created_at delay per relay", _table(age_columns, age_rows),
                              len(age_rows)))
    return "\n".join(parts)


def _delivery_section(tables: dict[str, Any]) -> str:
    columns, rows = tables["delivery"]
    parts = ['<h2 id="delivery">Delivery funnel</h2>']
    if rows:
        stages = ["events", *delivery.FINAL_STATUSES, "suppressed"]
        counts = [[row[columns.index(stage)] for stage in stages] for row in rows]
        parts.append(
            _image(charts.funnel_chart([r[0] for r in rows], stages, counts), "delivery funnel")
        )
    parts.append(_table(columns, rows))
    columns, rows = tables["delivery_by_class"]
    parts.append('<h3 id="delivery-by-class">By notification class</h3>')
    if rows:
        stages = ["events", *delivery.FINAL_STATUSES, "suppressed"]
        counts = [[row[columns.index(stage)] for stage in stages] for row in rows]
        parts.append(_image(charts.funnel_chart([r[0] for r in rows], stages, counts),
                            "delivery funnel by notification class"))
    parts.append(_table(columns, rows))
    return "\n".join(parts)


def render(facts: Sequence[tuple[str, str]], results: Mapping[str, DataFrame]) -> str:
    """The whole page: summary, then canary, missed DMs, latency and delivery."""
    tables = {
        "dropped": _collect(results[dropped_events.OUTPUT]),
        "canary": _collect(results[canary.OUTPUT]),
        "delivery": _collect(results[delivery.OUTPUT]),
        "delivery_by_class": _collect(results[delivery.BY_CLASS]),
    }
    sections = [
        _summary(facts, tables),
        _canary_section(tables),
        _dropped_section(results, tables),
        _latency_section(results),
        _delivery_section(tables),
    ]
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        "<title>sigil-push relay health</title>"
        f"<style>{STYLE}</style></head><body>\n<h1>sigil-push relay health</h1>\n"
        + "\n".join(sections)
        + f"\n<script>{SORT_SCRIPT}</script>\n</body></html>\n"
    )
