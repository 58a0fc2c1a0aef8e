"""The bridge's Prometheus metrics, shared by ingest (what arrives and is dropped) and the
committer (what reaches the outbox), and each relay's counters bound once."""

from __future__ import annotations

import contextlib

from prometheus_client import Counter, Gauge

from sigil_push.bridge.choices import SUPPRESS_REASONS
from sigil_push.bridge.watches import CLASSES
from sigil_push.nostr.nip57 import OUTCOMES as ZAP_OUTCOMES
from sigil_push.relays.budget import ConnectionBudget
from sigil_push.relays.labels import USER_RELAYS, series_label
from sigil_push.telemetry.batch_histogram import BatchHistogram
from sigil_push.telemetry.suppressed import SUPPRESSED, SUPPRESSED_CLASS

DROP_REASONS = (
    "malformed", "wrong_kind", "unknown_recipient", "wrong_id", "forged", "no_device",
    "too_old", "too_new", "recipient_quota", "poison", "unaddressed",
)

RECEIVED = Counter("sigil_push_bridge_events_received_total", "EVENT frames received", ["relay"])
DROPPED = Counter(
    "sigil_push_bridge_events_dropped_total", "Events dropped, by reason", ["relay", "reason"]
)
DUPLICATES = Counter(
    "sigil_push_bridge_events_duplicate_total", "Events this relay had already delivered", ["relay"]
)
BASELINED = Counter(
    "sigil_push_bridge_events_baselined_total", "Pre-registration events remembered, not pushed"
)
PUSHED = Counter("sigil_push_bridge_events_pushed_total", "Events handed to the outbox")


LATENCY = BatchHistogram(
    "sigil_push_bridge_frame_to_outbox_seconds",
    "From frame received to its wakeups on disk in the outbox",
    (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0),
)
KEYS = Gauge("sigil_push_bridge_watched_keys", "Registered keys the bridge subscribes for")
IRIS_WATCHES = Gauge(
    "sigil_push_bridge_iris_watches",
    "Iris subscription filters the bridge matches events against (changes applied)",
)
COMMIT_RETRIES = Counter(
    "sigil_push_bridge_commit_retries_total",
    "Bridge commits the database refused (busy, locked, unreachable), each retried",
)
QUEUE = Gauge("sigil_push_bridge_commit_queue_events", "Verified events waiting for the committer")
POISON = Counter(
    "sigil_push_bridge_poison_events_total", "Events skipped after failing to commit twice"
)


INVALID_REASONS = frozenset(
    {"malformed", "unknown_recipient", "wrong_id", "forged", "too_old", "too_new"}
)
"""Drops that charge the delivering socket's invalid-event budget (relays/budget.py)."""


class RelayCounters:
    """One relay's counters, bound once: label lookups per event would cost more than parsing.

    `budget`: the shared connection's, charged for each invalid event it delivers (None for
    counters of per-user connections, which are not the shared socket)."""

    __slots__ = ("budget", "dropped", "duplicates", "received")

    def __init__(self, url: str, budget: ConnectionBudget | None = None) -> None:
        label = series_label(url)
        self.received = RECEIVED.labels(label)
        self.duplicates = DUPLICATES.labels(label)
        self.dropped = {reason: DROPPED.labels(label, reason) for reason in DROP_REASONS}
        self.budget = budget

    def invalid(self, reason: str) -> None:
        """An invalid event (one of INVALID_REASONS): counted, and charged to its socket."""
        self.dropped[reason].inc()
        if self.budget is not None:
            self.budget.invalid()


def remove_relay_series(url: str) -> None:
    """The relay left the bridge's plan: its labelled series go with it, so /metrics holds
    the relays in use (at most `bridge.max_relays`), not every URL ever named. User relays'
    share USER_RELAYS, which stays."""
    label = series_label(url)
    if label == USER_RELAYS:
        return
    for counter in (RECEIVED, DUPLICATES):
        with contextlib.suppress(KeyError):
            counter.remove(label)
    for reason in DROP_REASONS:
        with contextlib.suppress(KeyError):
            DROPPED.remove(label, reason)


SUPPRESSED_BY = {reason: SUPPRESSED.labels(reason) for reason in SUPPRESS_REASONS}
SUPPRESSED_BY_CLASS = {
    (cls, reason): SUPPRESSED_CLASS.labels(cls, reason)
    for cls in CLASSES for reason in SUPPRESS_REASONS
}
PUSHED_CLASS = Counter(
    "sigil_push_bridge_events_pushed_by_class_total",
    "Events handed to the outbox, by notification class",
    ["class"],
)
PUSHED_BY_CLASS = {cls: PUSHED_CLASS.labels(cls) for cls in CLASSES}
USER_LIST_OUTCOMES = ("stored", "stale", "truncated")
USER_LISTS = Counter(
    "sigil_push_bridge_user_lists_total",
    "Users' kind 10000/3 lists taken: stored (newest), stale (an older or equal one), truncated"
    " (stored with only the first 10,000 keys)",
    ["outcome"],
)
USER_LISTS_BY = {outcome: USER_LISTS.labels(outcome) for outcome in USER_LIST_OUTCOMES}
DEFERRED_WAKEUPS = Counter(
    "sigil_push_presence_lapse_wakeups_total",
    "Deferred wakeups sent: a presence lapsed by time, or a quiet window ended, after holding"
    " back an event that would still wake the pair",
)
ZAP_REQUESTS = Counter(
    "sigil_push_bridge_zap_requests_total",
    "Zap receipts to a watched key, by what their description's zap request (kind 9734) was:"
    " valid (its author is the zapper), or missing, not_json, invalid, forged (anonymous)",
    ["outcome"],
)
ZAP_REQUESTS_BY = {outcome: ZAP_REQUESTS.labels(outcome) for outcome in ZAP_OUTCOMES}
