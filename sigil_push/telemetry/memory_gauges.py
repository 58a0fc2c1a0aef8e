"""One gauge for the size of every in-memory structure that grows with use.

A public instance runs for months: each cache, queue and per-client table must be bounded, and
its size visible, so growth shows up on a dashboard before it shows up as RSS. The gauge is
read when /metrics is scraped (a callback, nothing on the hot path) and holds its owner weakly,
so tracking an object never keeps it alive.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TypeVar

from prometheus_client import Gauge

ENTRIES = Gauge(
    "sigil_push_memory_entries",
    "Entries held by an in-memory cache, queue or per-client table, by structure",
    ["structure"],
)

Owner = TypeVar("Owner")


def track(structure: str, owner: Owner, size: Callable[[Owner], int]) -> None:
    """Report `size(owner)` as `structure` (the latest owner wins: one per process)."""
    reference = weakref.ref(owner)

    def read() -> float:
        alive = reference()
        return 0.0 if alive is None else float(size(alive))

    ENTRIES.labels(structure).set_function(read)
