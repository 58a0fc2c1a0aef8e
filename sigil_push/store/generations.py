"""A bounded map of the most recent keys, kept as a few generations of plain dicts.

Why not an LRU (`OrderedDict` with `popitem(last=False)`): a dict that has one key deleted for
every key inserted keeps the deleted slots as dummies until its entries array is used up, and
then resizes to a table for three times its live entries. For the seen cache's 100,000 ids
that is a table of 2^19 slots instead of 2^18, reached only after ~75,000 inserts past full:
the 30-minute soak (bench/soak.py, 200 DMs/s) saw it as one step of +5.7 MB of RSS near
minute 14.5, long after the cache was full (issue 22). Here a generation only ever grows, and
the oldest is dropped whole, so no table is ever rebuilt for churn and memory stays flat.
"""

from __future__ import annotations

from collections import deque
from typing import Generic, TypeVar

GENERATIONS = 8
"""Few enough that a lookup of an unknown key stays a handful of dict probes, many enough that
dropping one generation frees a small slice (1/8) of the cache at a time. Measured standalone
(`SeenEvents` of 100,000 ids, 800,000 remembered): RSS 38.7 MB when first full, then between
39.8 and 40.6 MB with no step; the LRU went from 45.4 MB when full to 55.1 MB. With two
generations (as `verified.RecentlyVerified` has, for 10,000 events) RSS swings by ~8 MB for
100,000 ids as each half-cache table is freed and allocated again."""

Value = TypeVar("Value")


class GenerationalCache(Generic[Value]):
    """At most `size` keys, and every key whose last `put` is among the newest ~7/8 of that.

    The young generation takes the puts; once it holds a generation's share (`size // 8`) the
    next new key starts a new young one. `put` never evicts: only `trim` drops the oldest
    generations, whole, beyond the eighth, so a caller decides when forgetting is safe (the
    seen cache trims only after a batch is decided, issue 24). A key put again moves to the
    young generation with its new value. Lookups go young to old.

    Precisely, with `n = min(8, size)` generations of `g = size // n` keys: after `trim` it
    holds at most `n * g <= size` keys (`bound`; less than `size` by under 8), and every key
    whose last put is among the newest `(n - 1) * g + 1` puts (`kept`; 87,501 of 100,000).
    """

    def __init__(self, size: int) -> None:
        size = max(1, size)
        self._generations = min(GENERATIONS, size)
        self._generation_size = size // self._generations
        self._young: dict[str, Value] = {}
        self._older: deque[dict[str, Value]] = deque()
        """Newest first; every one of them was full when it stopped being young."""

    @property
    def bound(self) -> int:
        """The most keys held after `trim`."""
        return self._generations * self._generation_size

    @property
    def kept(self) -> int:
        """How many of the newest puts are always kept: their keys are never dropped."""
        return (self._generations - 1) * self._generation_size + 1

    def get(self, key: str) -> Value | None:
        found = self._young.get(key)
        if found is not None:
            return found
        for generation in self._older:
            found = generation.get(key)
            if found is not None:
                return found
        return None

    def __contains__(self, key: str) -> bool:
        if key in self._young:
            return True
        for generation in self._older:  # a loop, not `any`: no generator per miss
            if key in generation:
                return True
        return False

    def put(self, key: str, value: Value) -> None:
        """Make `key` the newest, with `value`. Never evicts (see `trim`)."""
        young = self._young
        if key not in young:
            for generation in self._older:
                # deleting from a generation that takes no more inserts never resizes it
                generation.pop(key, None)
            if len(young) >= self._generation_size:
                self._older.appendleft(young)
                young = self._young = {}
        young[key] = value

    def trim(self) -> bool:
        """Drop the oldest generations beyond the bound, whole; True if any was dropped."""
        dropped = False
        while len(self._older) >= self._generations:
            self._older.pop()
            dropped = True
        return dropped

    def __len__(self) -> int:
        return len(self._young) + sum(len(generation) for generation in self._older)
