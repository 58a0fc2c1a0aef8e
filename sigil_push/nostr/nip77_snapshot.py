"""NIP-77 items as a stored snapshot beneath the in-memory ones, so a restart pays for what is
new, not for the window.

A relay's sorted (created_at, id) items with their prefix sums are written as fixed-size
binary records (`encode_snapshot`) and read back as bytes (`SnapshotItems`): no per-item work
when loaded, a record decoded only when a binary search or a fingerprint reads it. Id sums
are additive, so a range's fingerprint over the snapshot and the items noted since it
(`LayeredItems`: the snapshot beneath a `SortedItems`) is the snapshot's sum of the range plus
the overlay's, and the merged order is found by binary search, never materialized.

A snapshot is stored in parts (bridge/catchup_ledger.py): the parts of one sorted run, each
starting its prefix sums where the one before ended (`start_sum`), so items newer than the run
are appended as a new part without re-encoding the run, and parts of items that came out of
the run's order (`late`), each sorted on its own. Only differences of prefix sums are ever
read, so the run's leading parts may be pruned away.

Layout: MAGIC (NEG2 for a run's part, NEGL for a late part), the record count (8 bytes,
big-endian), the sum before the first record (32 bytes, little-endian), the records, then a
BLAKE2b digest of everything before it. A record is created_at (8 bytes, big-endian), the id
(32 bytes), and the sum of the ids up to and including this record, plus the start sum, mod
2^256 (32 bytes, little-endian). The first layout (NEG1: no start sum, read as 0) is still
read. Everything is checked before use (`SnapshotInvalid`): magic, length, digest, order.
"""

from __future__ import annotations

import hashlib
from abc import abstractmethod
from bisect import bisect_left
from collections.abc import Iterable, Sequence
from itertools import pairwise
from typing import TypeVar, overload

from sigil_push.nostr.nip77 import ID_SIZE, INFINITY, Bound, Key, SortedItems, fingerprint

MAGIC = b"NEG2"
LATE_MAGIC = b"NEGL"
FIRST_MAGIC = b"NEG1"
RECORD_SIZE = 8 + ID_SIZE + ID_SIZE
DIGEST_SIZE = 16
HEADER_SIZE = len(MAGIC) + 8 + ID_SIZE
_FIRST_HEADER_SIZE = len(FIRST_MAGIC) + 8
_KEY_SIZE = 8 + ID_SIZE
_MASK = (1 << 256) - 1
_Item = TypeVar("_Item")


class SnapshotInvalid(ValueError):
    """Stored snapshot bytes that are not one this module wrote (corrupt or foreign)."""


def _digest(payload: bytes | memoryview) -> bytes:
    return hashlib.blake2b(payload, digest_size=DIGEST_SIZE).digest()


def encode_records(items: Iterable[tuple[int, bytes]], start_sum: int = 0) -> tuple[bytes, int]:
    """The records of (created_at, id bytes) items given in (created_at, id) order, their
    prefix sums starting after `start_sum`; and the sum after the last."""
    records = []
    total = start_sum
    from_bytes = int.from_bytes
    for created_at, raw in items:
        total = (total + from_bytes(raw, "little")) & _MASK
        records.append(created_at.to_bytes(8, "big") + raw + total.to_bytes(ID_SIZE, "little"))
    return b"".join(records), total


def encode_keys(keys: Sequence[bytes], start_sum: int = 0) -> tuple[bytes, int]:
    """`encode_records` for items given as sorted raw keys (`raw_key`: 40 bytes each)."""
    records = []
    total = start_sum
    from_bytes = int.from_bytes
    for key in keys:
        total = (total + from_bytes(key[8:], "little")) & _MASK
        records.append(key + total.to_bytes(ID_SIZE, "little"))
    return b"".join(records), total


def encode_snapshot(
    items: Iterable[tuple[int, bytes]], start_sum: int = 0, late: bool = False
) -> bytes:
    """The stored snapshot (or part: see the module's doc) of (created_at, id bytes) items
    given in (created_at, id) order."""
    records, _ = encode_records(items, start_sum)
    return seal_part(records, start_sum, late)


def seal_part(records: bytes | memoryview, start_sum: int, late: bool = False) -> bytes:
    """Encoded records as a stored part: header and digest."""
    body = b"".join((LATE_MAGIC if late else MAGIC, (len(records) // RECORD_SIZE).to_bytes(8, "big"),
                     start_sum.to_bytes(ID_SIZE, "little"), records))
    return body + _digest(body)


class SnapshotPart:
    """One stored part, checked (`SnapshotInvalid`): a run's or a late one, its sum before
    the first record, and the records."""

    __slots__ = ("count", "late", "records", "start_sum")

    def __init__(self, data: bytes) -> None:
        magic = data[: len(MAGIC)]
        header = _FIRST_HEADER_SIZE if magic == FIRST_MAGIC else HEADER_SIZE
        if len(data) < header + DIGEST_SIZE or magic not in (MAGIC, LATE_MAGIC, FIRST_MAGIC):
            raise SnapshotInvalid("not a snapshot")
        count = int.from_bytes(data[len(MAGIC) : len(MAGIC) + 8], "big")
        if len(data) != header + count * RECORD_SIZE + DIGEST_SIZE:
            raise SnapshotInvalid("length does not match the record count")
        if _digest(memoryview(data)[:-DIGEST_SIZE]) != data[-DIGEST_SIZE:]:
            raise SnapshotInvalid("digest does not match")
        self.late = magic == LATE_MAGIC
        self.count = count
        self.start_sum = int.from_bytes(data[len(MAGIC) + 8 : header], "little")
        self.records = memoryview(data)[header : header + count * RECORD_SIZE]
        if count > 1 and self.first_key() > self.last_key():
            raise SnapshotInvalid("records out of order")

    def first_key(self) -> bytes:
        return bytes(self.records[:_KEY_SIZE])

    def last_key(self) -> bytes:
        start = (self.count - 1) * RECORD_SIZE
        return bytes(self.records[start : start + _KEY_SIZE])

    def end_sum(self) -> int:
        if not self.count:
            return self.start_sum
        return int.from_bytes(self.records[-ID_SIZE:], "little")


class _Records(Sequence[_Item]):
    """A snapshot's records as a sequence, each decoded (`_record`) only when read."""

    __slots__ = ("_count", "_data")

    def __init__(self, data: bytes, count: int) -> None:
        """`data`: the records, one after the other, and nothing else."""
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
        return self._record(index * RECORD_SIZE)

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

    __slots__ = ("raw", "start_sum")

    def __init__(self, data: bytes) -> None:
        """Stored bytes (one part), checked whole (length, digest: C speed, no per-item
        Python work)."""
        part = SnapshotPart(data)
        self._set(bytes(part.records), part.count, part.start_sum)

    def _set(self, records: bytes, count: int, start_sum: int) -> None:
        super().__init__(records, count)
        self.start_sum = start_sum
        self.raw = _RawKeys(records, count)

    @classmethod
    def of_records(cls, records: bytes, start_sum: int) -> SnapshotItems:
        """Records this process made or checked (`SnapshotPart`), joined: not checked again."""
        items = cls.__new__(cls)
        items._set(records, len(records) // RECORD_SIZE, start_sum)
        return items

    @classmethod
    def of_run(cls, parts: Sequence[SnapshotPart]) -> SnapshotItems:
        """A run's parts, in order, as one: each must start its sums where the one before
        ended, and its items after the other's."""
        for before, after in pairwise(parts):
            if after.start_sum != before.end_sum():
                raise SnapshotInvalid("a part's sums do not follow the part before")
            if before.count and after.count and after.first_key() <= before.last_key():
                raise SnapshotInvalid("parts out of order")
        start = parts[0].start_sum if parts else 0
        return cls.of_records(b"".join(part.records for part in parts), start)

    def records_from(self, index: int) -> memoryview:
        """The records from item `index` on, as stored."""
        return memoryview(self._data)[index * RECORD_SIZE :]

    def end_sum(self) -> int:
        return self.sum_before(self._count)

    def keys_from(self, index: int) -> list[bytes]:
        """The raw keys (`raw_key`) of the items from `index` on."""
        data = self._data
        return [data[start : start + _KEY_SIZE]
                for start in range(index * RECORD_SIZE, self._count * RECORD_SIZE, RECORD_SIZE)]

    def last_key(self) -> bytes | None:
        return self.raw[self._count - 1] if self._count else None

    def _record(self, start: int) -> Key:
        raw = self._data[start + 8 : start + _KEY_SIZE]
        created_at = int.from_bytes(self._data[start : start + 8], "big")
        return created_at, raw, int.from_bytes(raw, "little")

    @property
    def data(self) -> bytes:
        """As stored: one run part."""
        return seal_part(self._data, self.start_sum)

    def sum_before(self, index: int) -> int:
        """The first `index` ids added up, mod 2^256, plus the start sum."""
        if index <= 0:
            return self.start_sum
        end = index * RECORD_SIZE
        return int.from_bytes(self._data[end - ID_SIZE : end], "little")

    def bisect_raw(self, key: bytes) -> int:
        """Index of the first item not below `key` (see `raw_key`)."""
        return bisect_left(self.raw, key)

    def position(self, created_at: int) -> int:
        return self.bisect_raw(created_at.to_bytes(8, "big"))

    def holds(self, created_at: int, raw: bytes) -> bool:
        return self.holds_raw(raw_key(created_at, raw))

    def holds_raw(self, key: bytes) -> bool:
        """Whether the item `key` (see `raw_key`) is one of these."""
        at = self.bisect_raw(key)
        return at < self._count and self.raw[at] == key

    def ids(self, lower: int, upper: int) -> set[bytes]:
        """The ids of items [lower, upper), as bytes."""
        data = self._data
        return {data[start : start + ID_SIZE] for start in range(
            8 + lower * RECORD_SIZE, 8 + upper * RECORD_SIZE, RECORD_SIZE
        )}

    def pairs(self, since: int) -> list[tuple[int, bytes]]:
        """(created_at, id) of every item not older than `since`, in order (for a re-cut)."""
        data = self._data
        return [(int.from_bytes(data[start : start + 8], "big"), data[start + 8 : start + _KEY_SIZE])
                for start in range(self.position(since) * RECORD_SIZE,
                                   self._count * RECORD_SIZE, RECORD_SIZE)]


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
