"""Prometheus metrics of push delivery, module level and pre-bound so every series exists at 0."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Sequence

from prometheus_client import REGISTRY, Counter, Gauge
from prometheus_client.metrics_core import HistogramMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from sigil_push.push.base import Status
from sigil_push.push.registry import PROVIDER_NAMES as PROVIDERS


class BurstHistogram(Collector):
    """A histogram labelled by provider, observed a burst of values at a time.

    prometheus_client's Histogram takes a lock twice and walks its buckets in Python for every
    value, a few microseconds per push; here a burst of answers costs one bisect and one
    integer increment per value, and the cumulative buckets are built only when scraped. The
    exposition is the same as a Histogram's (`_bucket` with `le`, `_count`, `_sum`). Observed
    and scraped on the event loop's thread only.
    """

    def __init__(self, name: str, documentation: str, buckets: Sequence[float],
                 providers: Iterable[str], registry: CollectorRegistry = REGISTRY) -> None:
        self._name, self._documentation = name, documentation
        self._bounds = [float(b) for b in buckets]
        # as prometheus_client writes `le` (repr of a float, "+Inf")
        self._labels = [*map(repr, self._bounds), "+Inf"]
        self._counts = {p: [0] * (len(self._bounds) + 1) for p in providers}
        self._sums = dict.fromkeys(self._counts, 0.0)
        registry.register(self)

    def observe_many(self, provider: str, seconds: Iterable[float]) -> None:
        counts, bounds, total = self._counts[provider], self._bounds, 0.0
        for value in seconds:
            counts[bisect_left(bounds, value)] += 1
            total += value
        self._sums[provider] += total

    def collect(self) -> Iterable[Metric]:
        family = HistogramMetricFamily(self._name, self._documentation, labels=["provider"])
        for provider, counts in self._counts.items():
            running, buckets = 0, []
            for label, count in zip(self._labels, counts, strict=True):
                running += count
                buckets.append((label, running))
            family.add_metric([provider], buckets, self._sums[provider])
        yield family


PUSHES = Counter(
    "sigil_push_pushes_total", "Pushes answered, by provider and outcome", ["provider", "outcome"]
)
LATENCY = BurstHistogram(
    "sigil_push_push_latency_seconds",
    "From the event's first sighting to the provider's answer",
    (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 3600.0),
    PROVIDERS,
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
