"""NIP-77's encoding (sigil_push/nostr/nip77.py): varints, bounds, fingerprints and the
prefix sums behind them, against the protocol document's definitions, and our opening message
against nostr-sdk's own (its client's NEG-OPEN for the same items, recorded by a relay that
then says NEG-ERR): byte for byte, for an empty set, an id list and sixteen fingerprints."""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Sequence
from datetime import timedelta

import nostr_sdk
import pytest
from websockets.asyncio.server import ServerConnection

from sigil_push.nostr.nip77 import (
    BUCKETS,
    INFINITY,
    PROTOCOL_VERSION,
    STEP_UNITS,
    Bound,
    Key,
    ProtocolError,
    RangesRefused,
    Reconciliation,
    SortedItems,
    TooManyMissing,
    encode_varint,
    fingerprint,
    minimal_bound,
    read_varint,
)
from testkit.loopback_relay import LoopbackRelay
from testkit.nostr_client import sdk_dry_run_sync
from tests.adversarial.negentropy_flooder import mismatches, skips_then_a_mismatch

VARINTS = [(0, "00"), (1, "01"), (127, "7f"), (128, "8100"), (255, "817f"),
           (16_383, "ff7f"), (16_384, "818000"), (2**64 - 1, "81ffffffffffffffff7f")]


def _ids(count: int, seed: int = 0) -> list[str]:
    return [hashlib.sha256(f"{seed}/{n}".encode()).hexdigest() for n in range(count)]


@pytest.mark.parametrize(("value", "encoded"), VARINTS)
def test_varints_are_base_128_most_significant_digit_first(value: int, encoded: str) -> None:
    assert encode_varint(value).hex() == encoded
    data = bytes.fromhex("ff" + encoded)
    assert read_varint(data, 1) == (value, len(data))


def test_a_varint_cut_short_or_too_long_is_refused() -> None:
    with pytest.raises(ProtocolError):
        read_varint(bytes.fromhex("8181"), 0)
    with pytest.raises(ProtocolError):
        read_varint(b"\x81" * 11 + b"\x01", 0)


def test_a_fingerprint_is_sha256_of_the_id_sum_mod_2_256_and_the_count() -> None:
    """The empty set, and two ids whose little-endian sum wraps past 2^256 to 1."""
    assert fingerprint(0, 0) == hashlib.sha256(bytes(32) + b"\x00").digest()[:16]
    top, two = (1 << 256) - 1, 2
    expected = hashlib.sha256((1).to_bytes(32, "little") + b"\x02").digest()[:16]
    assert fingerprint(top + two, 2) == expected


def test_prefix_sums_give_every_range_the_fingerprint_of_its_ids() -> None:
    """Items added out of order: a set, then small batches summed apart from it, a window
    moved past the oldest, then a batch large enough to fold them all into one base: the
    order is (created_at, id) and every range's fingerprint is the naive one throughout."""
    rng = random.Random(3)
    items = [(event_id, 1_000 + rng.randrange(0, 40)) for event_id in _ids(400)]
    kept = SortedItems()

    def check(held: list[tuple[str, int]]) -> None:
        expected = sorted((t, bytes.fromhex(i), int.from_bytes(bytes.fromhex(i), "little"))
                          for i, t in held)
        assert kept.keys == expected
        assert kept.known == {key[1].hex() for key in expected}
        for _ in range(300):
            lower = rng.randrange(0, len(expected) + 1)
            upper = rng.randrange(lower, len(expected) + 1)
            total = sum(key[2] for key in expected[lower:upper])
            assert kept.fingerprint(lower, upper) == fingerprint(total, upper - lower)

    assert kept.add(dict(items[:300])) == 300
    check(items[:300])
    assert kept.add(dict(items[290:305])) == 5, "only the new ones"
    assert kept.add(dict(items[305:312])) == 7
    assert kept._added, "summed apart from the base"
    check(items[:312])
    kept.drop_before(1_010)
    held = [item for item in items[:312] if item[1] >= 1_010]
    check(held)
    assert kept.add(dict(items[312:])) == 88
    assert not kept._added, "folded into the base"
    check(held + items[312:])


def test_a_minimal_bound_separates_two_neighbours_with_the_shortest_prefix() -> None:
    a, b = bytes.fromhex("aa" * 32), bytes.fromhex("aabb" + "00" * 30)
    assert minimal_bound((5, a), (6, b)) == (6, b"")
    assert minimal_bound((6, a), (6, b)) == (6, bytes.fromhex("aabb"))


def _parse(message: bytes) -> list[tuple[int, bytes, int, bytes]]:
    """(timestamp, prefix, mode, payload) of each range, decoding the delta timestamps."""
    assert message[0] == PROTOCOL_VERSION
    ranges, position, last = [], 1, 0
    while position < len(message):
        encoded, position = read_varint(message, position)
        last = INFINITY if encoded == 0 else last + encoded - 1
        length, position = read_varint(message, position)
        prefix = message[position : position + length]
        position += length
        mode, position = read_varint(message, position)
        size = 16 if mode == 1 else 0
        if mode == 2:
            count, position = read_varint(message, position)
            size = 32 * count
        ranges.append((last, prefix, mode, message[position : position + size]))
        position += size
    return ranges


def test_the_opening_splits_many_items_into_sixteen_fingerprints_with_delta_bounds() -> None:
    items = [(event_id, 2_000 + n // 4) for n, event_id in enumerate(_ids(100))]
    kept = SortedItems()
    kept.add(dict(items))
    ranges = _parse(Reconciliation(kept, 0, 100, 4096, 10).initiate())
    assert len(ranges) == 16 and all(mode == 1 for _, _, mode, _ in ranges)
    assert ranges[-1][0] == INFINITY
    sizes = [7] * 4 + [6] * 12
    start = 0
    for (timestamp, prefix, _, payload), size in zip(ranges, sizes, strict=True):
        assert payload == kept.fingerprint(start, start + size)
        start += size
        if start < 100:
            assert (timestamp, prefix) == minimal_bound(kept.keys[start - 1], kept.keys[start])
    few = SortedItems()
    few.add(dict(items[:5]))
    ((timestamp, _, mode, payload),) = _parse(Reconciliation(few, 0, 5, 4096, 10).initiate())
    assert (timestamp, mode) == (INFINITY, 2)
    assert payload == b"".join(key[1] for key in few.keys)


def test_a_relay_message_we_cannot_accept_is_refused_before_any_work() -> None:
    kept = SortedItems()
    kept.add(dict.fromkeys(_ids(40), 1))
    reconciliation = Reconciliation(kept, 0, 40, 4096, 3)
    for bad in (b"", b"\x62", b"\x61\x00\x00\x07", b"\x61\x00\x00\x01" + bytes(15),
                b"\x61\x00\x21" + bytes(33) + b"\x00", b"\x61\x00\x00\x02\x05" + bytes(64)):
        with pytest.raises(ProtocolError):
            reconciliation.reconcile(bad)
    four_unknown = b"".join(bytes([n]) * 32 for n in range(1, 5))
    with pytest.raises(TooManyMissing):
        reconciliation.reconcile(b"\x61\x00\x00\x02\x04" + four_unknown)


def test_a_relay_listing_what_we_have_and_more_leaves_only_the_rest_missing() -> None:
    kept = SortedItems()
    kept.add(dict.fromkeys(_ids(10), 1))
    reconciliation = Reconciliation(kept, 0, 10, 4096, 100)
    theirs = [key[1] for key in kept.keys[:6]] + [bytes([9]) * 32]
    message = b"\x61\x00\x00\x02" + encode_varint(len(theirs)) + b"".join(theirs)
    assert reconciliation.reconcile(message) is None, "an id list ends the range"
    assert reconciliation.missing == {(bytes([9]) * 32).hex()}


class _RecordsNegOpen(LoopbackRelay):
    """Keeps the first NEG-OPEN and refuses it (NEG-ERR)."""

    def __init__(self) -> None:
        self.opened: list[str] = []

    async def _handle(self, ws: ServerConnection) -> None:
        async for frame in ws:
            message = json.loads(frame)
            if message[0] == "NEG-OPEN":
                self.opened.append(message[3])
                await ws.send(json.dumps(["NEG-ERR", message[1], "blocked: recorded"]))


async def _nostr_sdk_opening(items: list[tuple[str, int]]) -> str:
    async with _RecordsNegOpen() as recorder:
        options = nostr_sdk.SyncOptions().dry_run().initial_timeout(timedelta(seconds=5))
        with pytest.raises(Exception, match="recorded"):
            await sdk_dry_run_sync(
                recorder.url, nostr_sdk.Filter().kinds([nostr_sdk.Kind(4)]), items, options
            )
    assert len(recorder.opened) == 1
    return recorder.opened[0]


@pytest.mark.parametrize("count", [0, 5, 1_000])
async def test_our_opening_message_is_nostr_sdks_byte_for_byte(count: int) -> None:
    rng = random.Random(count)
    items = [(event_id, 1_700_000_000 + rng.randrange(0, 50)) for event_id in _ids(count)]
    kept = SortedItems()
    kept.add(dict(items))
    ours = Reconciliation(kept, 0, len(kept), 50_000, 10).initiate().hex()
    assert await _nostr_sdk_opening(items) == ours


class _Counting:
    """SortedItems behind the `Items` protocol, counting the binary searches and fingerprints
    a reconciliation asks of it: the work a relay's message causes."""

    def __init__(self, kept: SortedItems) -> None:
        self.kept = kept
        self.calls = 0

    @property
    def keys(self) -> Sequence[Key]:
        return self.kept.keys

    def __len__(self) -> int:
        return len(self.kept)

    def position(self, created_at: int) -> int:
        return self.kept.position(created_at)

    def bisect(self, bound: Bound, lower: int, upper: int) -> int:
        self.calls += 1
        return self.kept.bisect(bound, lower, upper)

    def fingerprint(self, lower: int, upper: int) -> bytes:
        self.calls += 1
        return self.kept.fingerprint(lower, upper)

    def lacking(self, ids: list[bytes], lower: int, upper: int) -> list[bytes]:
        return self.kept.lacking(ids, lower, upper)


def _many(count: int = 20_000) -> SortedItems:
    kept = SortedItems()
    kept.add({event_id: 1_700_000_000 + n // 3 for n, event_id in enumerate(_ids(count))})
    return kept


def test_a_message_with_more_ranges_than_ours_could_produce_is_refused_after_bounded_work() -> None:
    """Issue 34, item 1: a relay answered our sixteen fingerprints with 630,000 Skip ranges
    and one mismatch, seconds of CPU in one pass, every round. An honest answer holds at most
    BUCKETS ranges and a skip per range of ours: the message is refused at the first range
    past that, having cost no more than those."""
    counting = _Counting(_many())
    reconciliation = Reconciliation(counting, 0, len(counting), 60_000, 200_000)
    reconciliation.initiate()
    assert reconciliation.max_ranges() == (BUCKETS + 1) * 16 + 2
    counting.calls = 0
    with pytest.raises(RangesRefused):
        reconciliation.reconcile(skips_then_a_mismatch(630_000))
    assert counting.calls <= reconciliation.max_ranges()


def test_bounds_must_rise_and_nothing_follows_the_infinite_one() -> None:
    kept = _many(100)
    one = encode_varint(0) + encode_varint(0)  # a Skip range: empty prefix, mode 0
    for bad in (
        b"\x61" + encode_varint(5) + one + encode_varint(1) + one,  # the same bound twice
        b"\x61" + encode_varint(0) + one + encode_varint(0) + one,  # a range after infinity
        b"\x61" + encode_varint(9) + b"\x01\x07\x00" + encode_varint(1) + b"\x01\x03\x00",  # lower prefix
    ):
        reconciliation = Reconciliation(kept, 0, len(kept), 4096, 10)
        reconciliation.initiate()
        with pytest.raises(RangesRefused):
            reconciliation.reconcile(bad)


def test_the_work_of_a_message_comes_in_steps_of_bounded_size() -> None:
    """The most an honest relay may send to our opening, every range differing: each step
    of the work is at most STEP_UNITS units and one range's split, and the steps add up to
    the same answer as doing it at once."""
    kept = _many()
    bounds = [kept.keys[n * len(kept) // 17][0] for n in range(1, 17)]
    message = mismatches(bounds)
    stepped = Reconciliation(kept, 0, len(kept), 60_000, 10)
    stepped.initiate()
    steps = stepped.steps(message)
    sizes: list[int] = []
    while True:
        try:
            sizes.append(next(steps))
        except StopIteration as done:
            answer = done.value
            break
    assert max(sizes) <= STEP_UNITS + BUCKETS + 1
    assert sum(sizes) >= 17 * BUCKETS
    at_once = Reconciliation(kept, 0, len(kept), 60_000, 10)
    at_once.initiate()
    assert answer == at_once.reconcile(message) is not None
