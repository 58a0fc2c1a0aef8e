"""Catch-up metrics, per relay: how each relay's stored DMs were caught up (negentropy or
paged REQ), what it cost (events fetched, bytes, pages) and when negentropy fell back.

Labels are bounded: `relay` is a watched relay (at most `bridge.max_relays`, removed with the
relay), `method` is `negentropy` or `req`, `reason` one of FALLBACK_REASONS.
"""

from __future__ import annotations

import contextlib

from prometheus_client import Counter, Gauge

METHODS = ("negentropy", "req")
FALLBACK_REASONS = ("neg_err", "refused", "timeout", "error", "violation", "budget")
UNANSWERED_REASONS = ("no_eose", "closed")

RUNS = Counter(
    "sigil_push_catchup_runs_total",
    "Catch-ups of one shard (or a firehose) finished, by method",
    ["relay", "method"],
)
EVENTS = Counter(
    "sigil_push_catchup_events_fetched_total",
    "Stored DMs (and Iris watch filters' events) a catch-up fetched from the relay, by method",
    ["relay", "method"],
)
BYTES = Counter(
    "sigil_push_catchup_bytes_total",
    "Bytes a catch-up received from the relay, by method",
    ["relay", "method"],
)
PAGES = Counter(
    "sigil_push_catchup_pages_total",
    "Page REQs (until = oldest so far) sent after a catch-up answer",
    ["relay"],
)
PAGES_WAITING = Gauge(
    "sigil_push_catchup_pages_waiting",
    "Pages waiting for room (pages in flight are bounded per relay)",
    ["relay"],
)
PAGE_CAP = Counter(
    "sigil_push_catchup_page_cap_total",
    "Catch-ups that stopped paging at the page cap (per shard; per Iris watch filter)",
    ["relay"],
)
NEGENTROPY_WORK = Counter(
    "sigil_push_catchup_negentropy_work_total",
    "NIP-77 work a relay's messages caused (ranges read and written, ids listed by 16s),"
    " charged to its budget",
    ["relay"],
)
FALLBACKS = Counter(
    "sigil_push_catchup_fallbacks_total",
    "Negentropy attempts that fell back to paged REQ, by reason",
    ["relay", "reason"],
)

WATCHES_UNANSWERED = Counter(
    "sigil_push_catchup_watches_unanswered_total",
    "Iris watch REQs given up on: no EOSE (or still refused) within the EOSE timeout, so they"
    " stopped holding the relay's cursor, by reason",
    ["relay", "reason"],
)


def bind(url: str) -> None:
    """Create the relay's series at zero, so they exist before the first catch-up."""
    for method in METHODS:
        RUNS.labels(url, method)
        EVENTS.labels(url, method)
        BYTES.labels(url, method)
    PAGES.labels(url)
    NEGENTROPY_WORK.labels(url)
    PAGES_WAITING.labels(url).set(0)
    PAGE_CAP.labels(url)
    for reason in FALLBACK_REASONS:
        FALLBACKS.labels(url, reason)
    for reason in UNANSWERED_REASONS:
        WATCHES_UNANSWERED.labels(url, reason)


def unbind(url: str) -> None:
    """The relay left the plan: its series go with it (URLs churn)."""
    for method in METHODS:
        for metric in (RUNS, EVENTS, BYTES):
            with contextlib.suppress(KeyError):
                metric.remove(url, method)
    for gauge_or_counter in (PAGES, PAGES_WAITING, PAGE_CAP, NEGENTROPY_WORK):
        with contextlib.suppress(KeyError):
            gauge_or_counter.remove(url)
    for reason in FALLBACK_REASONS:
        with contextlib.suppress(KeyError):
            FALLBACKS.remove(url, reason)
    for reason in UNANSWERED_REASONS:
        with contextlib.suppress(KeyError):
            WATCHES_UNANSWERED.remove(url, reason)
