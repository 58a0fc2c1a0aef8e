"""A Prometheus histogram observed a batch of values at a time, for the hot loops (the bridge's
commit batches, delivery's bursts of provider answers).

prometheus_client's Histogram takes its lock twice and walks its buckets in Python for every
value, about 1 µs each; here a batch costs one bisect and one integer increment per value, and
the cumulative buckets are built only when scraped. The exposition is a Histogram's (`_bucket`
with `le`, `_count`, `_sum`; no `_created`), every observation counted. Observed and scraped on
the event loop's thread only.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Sequence

from prometheus_client import REGISTRY
from prometheus_client.metrics_core import HistogramMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

UNLABELLED = ""
"""The one series of a histogram made without a label."""


class BatchHistogram(Collector):
    """One series, or one per value of a single label (`label`, its values bound up front so
    every series exists at 0)."""

    def __init__(self, name: str, documentation: str, buckets: Sequence[float],
                 label: str | None = None, values: Iterable[str] = (UNLABELLED,),
                 registry: CollectorRegistry = REGISTRY) -> None:
        self._name, self._documentation, self._label = name, documentation, label
        self._bounds = [float(b) for b in buckets]
        # as prometheus_client writes `le` (repr of a float, "+Inf")
        self._le = [*map(repr, self._bounds), "+Inf"]
        self._counts = {value: [0] * (len(self._bounds) + 1) for value in values}
        self._sums = dict.fromkeys(self._counts, 0.0)
        registry.register(self)

    def observe_many(self, values: Iterable[float], series: str = UNLABELLED) -> None:
        counts, bounds, total = self._counts[series], self._bounds, 0.0
        for value in values:
            counts[bisect_left(bounds, value)] += 1
            total += value
        self._sums[series] += total

    def collect(self) -> Iterable[Metric]:
        labels = [] if self._label is None else [self._label]
        family = HistogramMetricFamily(self._name, self._documentation, labels=labels)
        for series, counts in self._counts.items():
            running, buckets = 0, []
            for le, count in zip(self._le, counts, strict=True):
                running += count
                buckets.append((le, running))
            family.add_metric([] if self._label is None else [series], buckets,
                              self._sums[series])
        yield family
