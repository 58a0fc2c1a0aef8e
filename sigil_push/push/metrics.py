"""Prometheus metrics of push delivery, module level and pre-bound so every series exists at 0."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

from sigil_push.push.base import Status
from sigil_push.push.registry import PROVIDER_NAMES as PROVIDERS
from sigil_push.telemetry.batch_histogram import BatchHistogram

PUSHES = Counter(
    "sigil_push_pushes_total", "Pushes answered, by provider and outcome", ["provider", "outcome"]
)
LATENCY = BatchHistogram(
    "sigil_push_push_latency_seconds",
    "From the event's first sighting to the provider's answer",
    (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 3600.0),
    "provider", PROVIDERS,
)
PRUNED_TOKENS = Counter(
    "sigil_push_push_pruned_tokens_total", "Devices forgotten because the provider declared the token dead",
    ["provider"],
)
STALE_DROPPED = Counter(
    "sigil_push_push_stale_dropped_total", "Wakeups given up: too old or too many attempts",
    ["provider"],
)
COALESCED = Counter(
    "sigil_push_push_coalesced_wakeups_total",
    "Wakeups that rode along in another wakeup's push (coalescing window or rate limit)",
    ["provider"],
)
OUTBOX_DEPTH = Gauge("sigil_push_outbox_depth", "Wakeups waiting in the outbox")
OUTBOX_AGE = Gauge(
    "sigil_push_outbox_oldest_age_seconds",
    "Age of the oldest wakeup in the outbox (from its event's first sighting); 0 when empty",
)
IN_FLIGHT = Gauge("sigil_push_push_in_flight", "Pushes sent and not yet answered", ["provider"])

for _provider in PROVIDERS:
    for _status in Status:
        PUSHES.labels(_provider, _status.value)
    PRUNED_TOKENS.labels(_provider)
    STALE_DROPPED.labels(_provider)
    COALESCED.labels(_provider)
    IN_FLIGHT.labels(_provider)
