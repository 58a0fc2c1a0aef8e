"""NIP-77: the client (initiator) side of Negentropy protocol v1, as pure functions and values.

The bridge learns which event ids a relay holds beyond the (id, created_at) items it already
has, without downloading any event. This module holds the protocol only; relays/nip77.py
drives it over a guarded relay socket (NEG-OPEN, NEG-MSG, NEG-ERR, NEG-CLOSE).

Why our own and not nostr-sdk's: through its Python binding every item crossed as a
`NegentropyItem` built by uniffi (about 12 us each, measured), so a 200,000-item window cost
seconds of CPU per relay per reconnect, whatever was new. Here the items stay Python values
sorted once by (created_at, id) with prefix sums of the ids, kept per relay between
reconciliations (`SortedItems`): a reconnect adds only the new items, and a range's
fingerprint is two list reads and one SHA-256, so a reconciliation costs O(differences x log n)
beyond what it adds. nostr-sdk's own implementation (its client and rust-nostr's relay) checks
this one in the tests.

The wire format (hoytech's negentropy-protocol-v1.md): a message is the version byte 0x61 then
ranges; each range is an exclusive upper bound (a timestamp encoded as 1 + the offset from the
previous bound in the message, 0 for infinity, then an id prefix), a mode (Skip, Fingerprint,
IdList) and its payload. A fingerprint is the first 16 bytes of SHA-256 over the sum of the
ids (32-byte little-endian integers, mod 2^256) followed by the count as a varint.

Everything a relay sends is untrusted: varints are bounded, lengths are checked against what
is left of the message before anything is allocated, the ids a relay can make us want are
capped (`TooManyMissing`), and one message costs at most its own length plus one frame of
our answer (`frame_limit`), after which the rest of the range is deferred to the next round.
A message may hold no more ranges than our previous one could have produced (an honest peer
answers each of our ranges with at most BUCKETS sub-ranges and a skip), and its bounds must
rise strictly (`RangesRefused`): a relay once sent 630,000 skip ranges per message, each one
a binary search and a range of our answer, seconds of CPU a round. And the work is done in
steps (`steps`): a generator that yields after every STEP_UNITS units of work (a range read
or written, or a batch of listed ids), so the caller can yield to its event loop and charge
the relay for what it caused.
"""

from __future__ import annotations

import hashlib
from bisect import bisect_left
from collections.abc import Generator, Sequence
from itertools import accumulate
from operator import itemgetter
from typing import Protocol

PROTOCOL_VERSION = 0x61
ID_SIZE = 32
FINGERPRINT_SIZE = 16
BUCKETS = 16
"""Fingerprints a differing range is split into (the reference implementations' choice)."""
INFINITY = 1 << 64
"""The upper bound past every timestamp (encoded as 0)."""
MAX_VARINT_BYTES = 10
"""Enough for any 64-bit value; a longer varint is an attack, not a number."""
MIN_FRAME_LIMIT = 4096
STEP_UNITS = 32
"""Units of work (see `Reconciliation.steps`) between two yields of a step."""
IDS_PER_UNIT = 16
"""Listed ids (theirs looked up, or ours in the range they cover) that count as one unit."""
_FRAME_MARGIN = 200
"""Room kept under `frame_limit` for the range that defers the rest to the next round."""
_MODE_SKIP, _MODE_FINGERPRINT, _MODE_ID_LIST = 0, 1, 2
_MOD = 1 << 256

Bound = tuple[int, bytes]
"""(timestamp, id prefix): items below it sort before it."""
Key = tuple[int, bytes, int]
"""(created_at, id bytes, id as a little-endian integer): the protocol's order is the first
two (ids are unique, so the integer is never compared)."""


class ProtocolError(ValueError):
    """A message we cannot accept: wrong version, truncated, or malformed."""


class TooManyMissing(ProtocolError):
    """The relay claims more missing ids than the caller allows."""


class RangesRefused(ProtocolError):
    """The relay's message holds more ranges than our previous one could have produced, or
    bounds that do not rise strictly: not an honest peer's answer."""


def encode_varint(value: int) -> bytes:
    """Base-128 digits, most significant first, the high bit set on all but the last."""
    if value < 0:
        raise ValueError("varints are unsigned")
    digits = [value & 0x7F]
    value >>= 7
    while value:
        digits.append(0x80 | (value & 0x7F))
        value >>= 7
    return bytes(reversed(digits))


def read_varint(data: bytes, position: int) -> tuple[int, int]:
    """The varint at `position` and the position after it."""
    value = 0
    for length in range(MAX_VARINT_BYTES):
        if position + length >= len(data):
            raise ProtocolError("message ends inside a varint")
        byte = data[position + length]
        value = (value << 7) | (byte & 0x7F)
        if not byte & 0x80:
            return value, position + length + 1
    raise ProtocolError("varint too long")


def fingerprint(id_sum: int, count: int) -> bytes:
    """The fingerprint of `count` ids whose sum (any multiple of 2^256 apart) is `id_sum`."""
    payload = (id_sum % _MOD).to_bytes(ID_SIZE, "little") + encode_varint(count)
    return hashlib.sha256(payload).digest()[:FINGERPRINT_SIZE]


def minimal_bound(previous: tuple[int, bytes, int], current: tuple[int, bytes, int]) -> Bound:
    """The shortest bound with `previous` below it and `current` at or above it."""
    if previous[0] != current[0]:
        return current[0], b""
    shared = 0
    for a, b in zip(previous[1], current[1], strict=True):
        if a != b:
            break
        shared += 1
    return current[0], current[1][: shared + 1]


def _splice(
    keys: list[tuple[int, bytes, int]], new: list[tuple[int, bytes, int]]
) -> tuple[list[tuple[int, bytes, int]], int]:
    """`keys` with the sorted `new` (none among them) in place, and the first changed index:
    a binary search per new item, the runs between them copied as slices (in C)."""
    positions = [bisect_left(keys, key) for key in new]
    start = positions[0]
    if start == len(keys):
        return keys + new, start
    merged = keys[:start]
    for position, following, key in zip(
        positions, [*positions[1:], len(keys)], new, strict=True
    ):
        merged.append(key)
        merged.extend(keys[position:following])
    return merged, start


class SortedItems:
    """One set of (created_at, id) items, sorted, with prefix sums of the ids.

    Kept between reconciliations so that a reconnect pays for what is new, not for the set:
    `add` finds the new ids with one set difference (in C) and splices them into place, but
    leaves the prefix sums of the items held before (the base) as they are: the items added
    since are summed apart (`_added`), and the sum of the first i items is the base's sum of
    its first i - c plus the added ones' of their first c (c by a binary search). The two are
    folded into one base once the added ones pass a sixteenth of the set, so the sums cost
    about 16 additions per new item over time, never a pass over the set per reconnect.
    `drop_before` forgets the items a moved window left behind.
    """

    __slots__ = ("_added", "_added_sums", "_base_sums", "keys", "known")

    FOLD_FRACTION = 16

    def __init__(self) -> None:
        self.keys: list[tuple[int, bytes, int]] = []
        """(created_at, id bytes, id as a little-endian integer), ascending by the first two:
        the protocol's order (ids are unique, so the integer is never compared)."""
        self.known: set[str] = set()
        """The hex ids held, to tell new items and ids we already have in O(1)."""
        self._base_sums: list[int] = [0]
        """[i]: the first i base items' ids added up (not reduced: only differences count)."""
        self._added: list[tuple[int, bytes, int]] = []
        self._added_sums: list[int] = [0]

    def __len__(self) -> int:
        return len(self.keys)

    def add(self, items: dict[str, int]) -> int:
        """Add the items (hex id → created_at) not held yet; how many were new."""
        fresh = items.keys() - self.known
        if not fresh:
            return 0
        self.known |= fresh
        new = []
        for event_id in fresh:
            raw = bytes.fromhex(event_id)
            new.append((items[event_id], raw, int.from_bytes(raw, "little")))
        new.sort()
        self.keys = _splice(self.keys, new)[0]
        if (len(self._added) + len(new)) * self.FOLD_FRACTION > len(self.keys):
            self._base_sums = list(accumulate(map(itemgetter(2), self.keys), initial=0))
            self._added, self._added_sums = [], [0]
        else:
            self._added, start = _splice(self._added, new)
            base = self._added_sums[start]
            del self._added_sums[start:]
            self._added_sums.extend(accumulate(map(itemgetter(2), self._added[start:]),
                                               initial=base))
        return len(new)

    def _added_before(self, index: int) -> int:
        """How many of the first `index` items were added since the last fold."""
        if index >= len(self.keys):
            return len(self._added)
        return bisect_left(self._added, self.keys[index])

    def sum_before(self, index: int) -> int:
        """The first `index` items' ids added up (any multiple of 2^256 apart)."""
        added = self._added_before(index)
        return self._base_sums[index - added] + self._added_sums[added]

    def position(self, created_at: int) -> int:
        """Index of the first item not older than `created_at`."""
        return bisect_left(self.keys, (created_at, b""))

    def bisect(self, bound: Bound, lower: int, upper: int) -> int:
        """Index of the first item in [lower, upper) not below `bound` (upper: none)."""
        return bisect_left(self.keys, bound, lower, upper)

    def drop_before(self, created_at: int) -> None:
        """Forget the items older than `created_at` (out of every later window)."""
        cut = self.position(created_at)
        if cut:
            added = self._added_before(cut)
            self.known.difference_update(key[1].hex() for key in self.keys[:cut])
            del self.keys[:cut]
            del self._base_sums[: cut - added]
            del self._added[:added]
            del self._added_sums[:added]

    def fingerprint(self, lower: int, upper: int) -> bytes:
        return fingerprint(self.sum_before(upper) - self.sum_before(lower), upper - lower)

    def lacking(self, ids: list[bytes], lower: int, upper: int) -> list[bytes]:
        """Which of `ids` (a relay's, for the range [lower, upper)) are not held."""
        known = self.known
        return [raw for raw in ids if raw.hex() not in known]


class Items(Protocol):
    """What a reconciliation reads: sorted items by index, range fingerprints, membership.
    `SortedItems` in memory, or `LayeredItems` (a stored snapshot beneath them)."""

    @property
    def keys(self) -> Sequence[Key]: ...

    def __len__(self) -> int: ...

    def position(self, created_at: int) -> int: ...

    def bisect(self, bound: Bound, lower: int, upper: int) -> int: ...

    def fingerprint(self, lower: int, upper: int) -> bytes: ...

    def lacking(self, ids: list[bytes], lower: int, upper: int) -> list[bytes]: ...


class Reconciliation:
    """Our side of one reconciliation over `items.keys[lower:upper]` (the items of one filter).

    `initiate` gives the NEG-OPEN message; each relay message goes to `reconcile` (or
    `steps`, the same work in steps), whose answer is the next NEG-MSG, or None once every
    range agrees or was listed: then `missing` holds the ids the relay has beyond ours (we
    never send the relay ids it lacks: catch-up only fetches). The items must not change
    while it runs.
    """

    def __init__(
        self, items: Items, lower: int, upper: int, frame_limit: int, max_missing: int
    ) -> None:
        if frame_limit < MIN_FRAME_LIMIT:
            raise ValueError("frame limit too small")
        self._items = items
        self._lower, self._upper = lower, upper
        self._frame_limit = frame_limit
        self._max_missing = max_missing
        self.missing: set[str] = set()
        self._last_out = 0
        self._ranges_out = 1
        """Ranges of our last message (before the first: our whole range, as one)."""
        self._emitting = 0

    def initiate(self) -> bytes:
        self._last_out = 0
        self._emitting = 0
        out = bytearray([PROTOCOL_VERSION])
        self._split(self._lower, self._upper, (INFINITY, b""), out)
        self._ranges_out = self._emitting
        return bytes(out)

    def max_ranges(self) -> int:
        """The most ranges an honest answer to our last message holds: each of our ranges
        answered by at most BUCKETS sub-ranges (or an id list and the fingerprint of what a
        frame left out) after a skip, and one range deferring the rest to the next round."""
        return (BUCKETS + 1) * self._ranges_out + 2

    def reconcile(self, message: bytes) -> bytes | None:
        """Our answer to one relay message (None: reconciled), all at once."""
        steps = self.steps(message)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                answer: bytes | None = done.value
                return answer

    def steps(self, message: bytes) -> Generator[int, None, bytes | None]:
        """`reconcile`'s work in steps: yields the units of work done since the last yield
        (about STEP_UNITS each: a range read, a range of our answer written, IDS_PER_UNIT ids
        listed), and returns the answer. A message an honest peer would not send raises
        (`RangesRefused`) as soon as its range count passes `max_ranges` or a bound fails to
        rise, so a hostile one costs at most what an honest one could."""
        if not message:
            raise ProtocolError("empty message")
        if message[0] != PROTOCOL_VERSION:
            raise ProtocolError(f"protocol version {message[0]:#x}")
        items = self._items
        allowed = self.max_ranges()
        self._last_out = 0
        self._emitting = 0
        last_in = 0
        position = 1
        out = bytearray([PROTOCOL_VERSION])
        lower = emitted = self._lower
        previous_bound: Bound = (0, b"")
        ranges = units = 0
        skipping = False
        while position < len(message):
            ranges += 1
            emitted_before = self._emitting
            if ranges > allowed:
                raise RangesRefused(f"more than {allowed} ranges in answer to our {self._ranges_out}")
            if last_in == INFINITY:
                raise RangesRefused("a range after the infinite bound")
            encoded, position = read_varint(message, position)
            last_in = INFINITY if encoded == 0 else min(last_in + encoded - 1, INFINITY)
            length, position = read_varint(message, position)
            if length > ID_SIZE or position + length > len(message):
                raise ProtocolError("bad bound")
            bound: Bound = (last_in, message[position : position + length])
            if ranges > 1 and bound <= previous_bound:
                raise RangesRefused("bounds do not rise")
            position += length
            mode, position = read_varint(message, position)
            upper = (self._upper if last_in == INFINITY
                     else items.bisect(bound, lower, self._upper))
            answer = bytearray()
            units += 1
            if mode == _MODE_SKIP:
                skipping = True
            elif mode == _MODE_FINGERPRINT:
                theirs = message[position : position + FINGERPRINT_SIZE]
                position += FINGERPRINT_SIZE
                if len(theirs) != FINGERPRINT_SIZE:
                    raise ProtocolError("message ends inside a fingerprint")
                if theirs == items.fingerprint(lower, upper):
                    skipping = True
                else:
                    before = self._emitting
                    if skipping:
                        skipping = False
                        answer += self._bound(previous_bound) + encode_varint(_MODE_SKIP)
                        self._emitting += 1
                    self._split(lower, upper, bound, answer)
                    units += self._emitting - before
            elif mode == _MODE_ID_LIST:
                count, position = read_varint(message, position)
                if count * ID_SIZE > len(message) - position:
                    raise ProtocolError("message ends inside an id list")
                self._note_theirs(message, position, count, lower, upper)
                position += count * ID_SIZE
                skipping = True
                units += (count + upper - lower) // IDS_PER_UNIT
            else:
                raise ProtocolError(f"unknown mode {mode}")
            if len(out) + len(answer) > self._frame_limit - _FRAME_MARGIN:
                # everything after what `out` holds is left for the next round, as one
                # fingerprint from there to the end
                out += self._bound((INFINITY, b"")) + encode_varint(_MODE_FINGERPRINT)
                out += items.fingerprint(emitted, self._upper)
                self._emitting = emitted_before + 1
                break
            if answer:
                out += answer
                emitted = upper
            lower, previous_bound = upper, bound
            if units >= STEP_UNITS:
                yield units
                units = 0
        if units:
            yield units
        self._ranges_out = max(self._emitting, 1)
        return None if len(out) == 1 else bytes(out)

    def _note_theirs(
        self, message: bytes, position: int, count: int, lower: int, upper: int
    ) -> None:
        """The relay's ids for our range [lower, upper): those we lack are missing (the same
        event falls in the same range on both sides, as both order by (created_at, id))."""
        if not count:
            return
        theirs = [message[start : start + ID_SIZE]
                  for start in range(position, position + count * ID_SIZE, ID_SIZE)]
        missing = self.missing
        missing.update(raw.hex() for raw in self._items.lacking(theirs, lower, upper))
        if len(missing) > self._max_missing:
            raise TooManyMissing(f"more than {self._max_missing} ids missing")

    def _split(self, lower: int, upper: int, upper_bound: Bound, out: bytearray) -> None:
        """Our view of [lower, upper): its ids when few, else BUCKETS fingerprints."""
        keys, count = self._items.keys, upper - lower
        if count < 2 * BUCKETS:
            out += self._bound(upper_bound) + encode_varint(_MODE_ID_LIST) + encode_varint(count)
            out += b"".join(key[1] for key in keys[lower:upper])
            self._emitting += 1
            return
        self._emitting += BUCKETS
        per_bucket, with_extra = divmod(count, BUCKETS)
        start = lower
        for bucket in range(BUCKETS):
            end = start + per_bucket + (1 if bucket < with_extra else 0)
            bound = upper_bound if end == upper else minimal_bound(keys[end - 1], keys[end])
            out += self._bound(bound) + encode_varint(_MODE_FINGERPRINT)
            out += self._items.fingerprint(start, end)
            start = end

    def _bound(self, bound: Bound) -> bytes:
        timestamp, prefix = bound
        if timestamp == INFINITY:
            self._last_out = INFINITY
            encoded = encode_varint(0)
        else:
            encoded = encode_varint(timestamp - self._last_out + 1)
            self._last_out = timestamp
        return encoded + encode_varint(len(prefix)) + prefix
