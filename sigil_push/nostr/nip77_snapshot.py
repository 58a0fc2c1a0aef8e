"""NIP-77 items as a stored snapshot beneath the in-memory ones, so a restart pays for what is
new, not for the window.

A relay's sorted (created_at, id) items with their prefix sums are written as fixed-size
binary records (`encode_snapshot`) and read back as bytes (`SnapshotItems`): no per-item work
when loaded, a record decoded only when a binary search or a fingerprint reads it. Id sums
are additive, so a range's fingerprint over the snapshot and the items noted since it
(`LayeredItems`: the snapshot beneath a `SortedItems`) is the snapshot's sum of the range plus
the overlay's, and the merged order is found by binary search, never materialized.

Layout: MAGIC, the record count (8 bytes, big-endian), the records, then a BLAKE2b digest of
everything before it. A record is created_at (8 bytes, big-endian), the id (32 bytes), and the
sum of the ids up to and including this record mod 2^256 (32 bytes, little-endian).
Everything is checked before use (`SnapshotInvalid`): magic, length, digest, order.
"""

from __future__ import annotations

import hashlib
from abc import abstractmethod
from bisect import bisect_left
from collections.abc import Iterable, Sequence
from typing import TypeVar, overload

from sigil_push.nostr.nip77 import ID_SIZE, INFINITY, Bound, Key, SortedItems, fingerprint

MAGIC = b"NEG1"
RECORD_SIZE = 8 + ID_SIZE + ID_SIZE
DIGEST_SIZE = 16
_HEADER_SIZE = len(MAGIC) + 8
_KEY_SIZE = 8 + ID_SIZE
_MASK = (1 << 256) - 1
_Item = TypeVar("_Item")


class SnapshotInvalid(ValueError):
    """Stored snapshot bytes that are not one this module wrote (corrupt or foreign)."""


def _digest(payload: bytes | memoryview) -> bytes:
    return hashlib.blake2b(payload, digest_size=DIGEST_SIZE).digest()


def encode_snapshot(items: Iterable[tuple[int, bytes]]) -> bytes:
    """The snapshot of (created_at, id bytes) items given in (created_at, id) order."""
    records = []
    total = 0
    for created_at, raw in items:
        total = (total + int.from_bytes(raw, "little")) & _MASK
        records.append(created_at.to_bytes(8, "big") + raw + total.to_bytes(ID_SIZE, "little"))
    body = MAGIC + len(records).to_bytes(8, "big") + b"".join(records)
    return body + _digest(body)


class _Records(Sequence[_Item]):
    """A snapshot's records as a sequence, each decoded (`_record`) only when read."""

    __slots__ = ("_count", "_data")

    def __init__(self, data: bytes, count: int) -> None:
        self._data, self._count = data, count

    def __len__(self) -> int:
        return self._count

    @overload
    def __getitem__(self, index: int) -> _Item: ...

    @overload
    def __getitem__(self, index: slice) -> list[_Item]: ...

    def __getitem__(self, index: int | slice) -> _Item | list[_Item]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self._count))]
        if not 0 <= index < self._count:
            raise IndexError(index)
        return self._record(_HEADER_SIZE + index * RECORD_SIZE)

    @abstractmethod
    def _record(self, start: int) -> _Item:
        """The record that begins at byte `start`."""


class _RawKeys(_Records[bytes]):
    """A snapshot's records cut to created_at and id (40 bytes): compared as bytes they
    order as the protocol's (created_at, id), so a binary search decodes nothing."""

    __slots__ = ()

    def _record(self, start: int) -> bytes:
        return self._data[start : start + _KEY_SIZE]


def raw_key(created_at: int, prefix: bytes) -> bytes:
    """A key or bound as bytes that order as (created_at, id): the time big-endian first."""
    return created_at.to_bytes(8, "big") + prefix


class SnapshotItems(_Records[Key]):
    """A snapshot's items, read in place: item i is decoded when read (O(1)), binary
    searches compare raw bytes, and the sum of the first i ids is one record's field, so a
    range's id sum is two reads."""

    __slots__ = ("raw",)

    def __init__(self, data: bytes) -> None:
        """Checks the bytes whole (length, digest: C speed, no per-item Python work)."""
        if len(data) < _HEADER_SIZE + DIGEST_SIZE or data[: len(MAGIC)] != MAGIC:
            raise SnapshotInvalid("not a snapshot")
        count = int.from_bytes(data[len(MAGIC) : _HEADER_SIZE], "big")
        if len(data) != _HEADER_SIZE + count * RECORD_SIZE + DIGEST_SIZE:
            raise SnapshotInvalid("length does not match the record count")
        body = memoryview(data)[:-DIGEST_SIZE]
        if _digest(body) != data[-DIGEST_SIZE:]:
            raise SnapshotInvalid("digest does not match")
        super().__init__(data, count)
        self.raw = _RawKeys(data, count)
        if count > 1 and self.raw[0] > self.raw[count - 1]:
            raise SnapshotInvalid("records out of order")

    def _record(self, start: int) -> Key:
        raw = self._data[start + 8 : start + _KEY_SIZE]
        created_at = int.from_bytes(self._data[start : start + 8], "big")
        return created_at, raw, int.from_bytes(raw, "little")

    @property
    def data(self) -> bytes:
        return self._data

    def sum_before(self, index: int) -> int:
        """The first `index` ids added up, mod 2^256."""
        if index <= 0:
            return 0
        end = _HEADER_SIZE + index * RECORD_SIZE
        return int.from_bytes(self._data[end - ID_SIZE : end], "little")

    def bisect_raw(self, key: bytes) -> int:
        """Index of the first item not below `key` (see `raw_key`)."""
        return bisect_left(self.raw, key)

    def position(self, created_at: int) -> int:
        return self.bisect_raw(created_at.to_bytes(8, "big"))

    def holds(self, created_at: int, raw: bytes) -> bool:
        key = raw_key(created_at, raw)
        at = self.bisect_raw(key)
        return at < self._count and self.raw[at] == key

    def ids(self, lower: int, upper: int) -> set[bytes]:
        """The ids of items [lower, upper), as bytes."""
        data, first = self._data, _HEADER_SIZE + 8
        return {data[start : start + ID_SIZE] for start in range(
            first + lower * RECORD_SIZE, first + upper * RECORD_SIZE, RECORD_SIZE
        )}

    def pairs(self, since: int) -> list[tuple[int, bytes]]:
        """(created_at, id) of every item not older than `since`, in order (for a re-cut)."""
        data = self._data
        return [(int.from_bytes(data[start : start + 8], "big"), data[start + 8 : start + _KEY_SIZE])
                for start in range(_HEADER_SIZE + self.position(since) * RECORD_SIZE,
                                   _HEADER_SIZE + self._count * RECORD_SIZE, RECORD_SIZE)]


class _MergedKeys(Sequence[Key]):
    """The base's and the overlay's keys as one sorted sequence, by index."""

    __slots__ = ("_layers",)

    def __init__(self, layers: LayeredItems) -> None:
        self._layers = layers

    def __len__(self) -> int:
        return len(self._layers)

    @overload
    def __getitem__(self, index: int) -> Key: ...

    @overload
    def __getitem__(self, index: slice) -> list[Key]: ...

    def __getitem__(self, index: int | slice) -> Key | list[Key]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if not 0 <= index < len(self):
            raise IndexError(index)
        layers = self._layers
        added = layers.overlay_before(index)
        base, overlay = layers.base, layers.overlay_raw
        if added < len(overlay) and (index - added >= len(base)
                                     or overlay[added] < base.raw[index - added]):
            return layers.overlay.keys[added]
        return base[index - added]


class LayeredItems:
    """A snapshot (`base`) with the items noted since it (`overlay`, none of them in the
    base) on top: what `Reconciliation` reads, as if one `SortedItems` held both. A bound's
    index is the sum of its index in each; item i of the union is found by a binary search
    for how many overlay items precede it (remembered for the indices bounds gave)."""

    __slots__ = ("_overlay_at", "base", "keys", "overlay", "overlay_raw")

    def __init__(self, base: SnapshotItems, overlay: SortedItems) -> None:
        self.base = base
        self.overlay = overlay
        self.overlay_raw = [raw_key(key[0], key[1]) for key in overlay.keys]
        self.keys: Sequence[Key] = _MergedKeys(self)
        self._overlay_at: dict[int, int] = {0: 0, len(self): len(overlay)}

    def __len__(self) -> int:
        return len(self.base) + len(self.overlay)

    def overlay_before(self, index: int) -> int:
        """How many of the union's first `index` items are overlay items."""
        overlay = self.overlay_raw
        if not overlay:
            return 0
        known = self._overlay_at.get(index)
        if known is not None:
            return known
        base = self.base.raw
        lower, upper = max(0, index - len(base)), min(index, len(overlay))
        while lower < upper:
            middle = (lower + upper) // 2
            if overlay[middle] < base[index - middle - 1]:
                lower = middle + 1
            else:
                upper = middle
        return lower

    def _at(self, key: bytes) -> int:
        """The union's index of the first item not below `key`."""
        added = bisect_left(self.overlay_raw, key)
        index = self.base.bisect_raw(key) + added
        self._overlay_at[index] = added
        return index

    def bisect(self, bound: Bound, lower: int, upper: int) -> int:
        if bound[0] >= INFINITY:
            return upper
        return min(max(self._at(raw_key(*bound)), lower), upper)

    def position(self, created_at: int) -> int:
        return self._at(created_at.to_bytes(8, "big"))

    def _sum_before(self, index: int) -> int:
        added = self.overlay_before(index)
        return self.base.sum_before(index - added) + self.overlay.sum_before(added)

    def fingerprint(self, lower: int, upper: int) -> bytes:
        return fingerprint(self._sum_before(upper) - self._sum_before(lower), upper - lower)

    def lacking(self, ids: list[bytes], lower: int, upper: int) -> list[bytes]:
        """The overlay's by its id set; the base's by the ids of its part of the range."""
        rest = self.overlay.lacking(ids, 0, 0)
        if not rest:
            return rest
        base_lower = lower - self.overlay_before(lower)
        base_upper = upper - self.overlay_before(upper)
        held = self.base.ids(base_lower, base_upper)
        return [raw for raw in rest if raw not in held]
