"""The /metrics exposition of one worker: every series labelled `worker="<id>"`.

With several workers on one PostgreSQL database, each worker exposes its own counters and
gauges, and the worker id is what ties a series to that worker's `/health` (its shards) and
its observation-log files. The label is added once, at exposition, to every sample of the
process's registry, so the metrics themselves are declared without it and a new metric needs
nothing to be labelled. A series that already names its worker (`sigil_push_worker_info`,
`sigil_push_worker_shards`) is left as it is.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable

from prometheus_client import REGISTRY
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

WORKER_LABEL = "worker"


class WorkerLabelled(Collector):
    """`registry`'s metrics with `worker` added to every sample while `worker_id()` is set.

    `worker_id` is read at each scrape: the id exists only once the service opened its store,
    and it is empty for one process on SQLite, which is the whole instance (a label that
    changed at every restart would only multiply its series).
    """

    def __init__(self, worker_id: Callable[[], str], registry: Collector = REGISTRY) -> None:
        self._worker_id = worker_id
        self._registry = registry

    def collect(self) -> Iterable[Metric]:
        worker = self._worker_id()
        for family in self._registry.collect():
            if worker:
                family = copy.copy(family)
                family.samples = [
                    sample if WORKER_LABEL in sample.labels
                    else sample._replace(labels={**sample.labels, WORKER_LABEL: worker})
                    for sample in family.samples
                ]
            yield family
