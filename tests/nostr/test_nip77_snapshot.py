"""A stored snapshot (in parts) beneath the in-memory NIP-77 items (sigil_push/nostr/nip77_snapshot.py):
its bytes round-trip, every range of snapshot + overlay has the fingerprint, bounds and id
list of one `SortedItems` over the union, so our messages are the same bytes (and those are
nostr-sdk's, by tests/nostr/test_nip77.py), and bytes that are not a snapshot are refused."""

from __future__ import annotations

import hashlib
import random

import pytest

from sigil_push.nostr.nip77 import Reconciliation, SortedItems, encode_varint, fingerprint
from sigil_push.nostr.nip77_snapshot import (
    DIGEST_SIZE,
    FIRST_MAGIC,
    RECORD_SIZE,
    LayeredItems,
    SnapshotInvalid,
    SnapshotItems,
    SnapshotPart,
    encode_snapshot,
)
from tests.nostr.test_nip77 import _nostr_sdk_opening


def _items(count: int, seed: int, spread: int = 60) -> dict[str, int]:
    rng = random.Random(seed)
    return {hashlib.sha256(f"{seed}/{n}".encode()).hexdigest(): 1_700_000_000 + rng.randrange(spread)
            for n in range(count)}


def _snapshot(items: dict[str, int]) -> SnapshotItems:
    pairs = sorted((at, bytes.fromhex(event_id)) for event_id, at in items.items())
    return SnapshotItems(encode_snapshot(pairs))


def _layered(base: dict[str, int], overlay: dict[str, int]) -> LayeredItems:
    top = SortedItems()
    top.add(overlay)
    return LayeredItems(_snapshot(base), top)


def test_a_snapshot_round_trips_its_items_and_prefix_sums() -> None:
    items = _items(500, 1)
    snapshot = _snapshot(items)
    plain = SortedItems()
    plain.add(items)
    assert len(snapshot) == 500
    assert list(snapshot) == plain.keys
    assert all(snapshot.sum_before(i) == plain.sum_before(i) % (1 << 256) for i in range(501))
    assert SnapshotItems(snapshot.data).pairs(0) == [key[:2] for key in plain.keys]
    empty = SnapshotItems(encode_snapshot([]))
    assert len(empty) == 0 and empty.position(5) == 0


@pytest.mark.parametrize(("base_count", "overlay_count"), [(0, 40), (300, 0), (300, 7), (50, 200)])
def test_snapshot_and_overlay_read_as_one_sorted_set(base_count: int, overlay_count: int) -> None:
    """Every index, every range's fingerprint, position and id list, and a whole opening."""
    base, overlay = _items(base_count, 2), _items(overlay_count, 3)
    layered = _layered(base, overlay)
    union = SortedItems()
    union.add({**base, **overlay})
    assert len(layered) == len(union)
    assert list(layered.keys) == union.keys
    rng = random.Random(4)
    for _ in range(400):
        lower = rng.randrange(0, len(union) + 1)
        upper = rng.randrange(lower, len(union) + 1)
        assert layered.fingerprint(lower, upper) == union.fingerprint(lower, upper)
        assert layered.keys[lower:upper] == union.keys[lower:upper]
    for created_at in range(1_700_000_000 - 1, 1_700_000_000 + 62):
        assert layered.position(created_at) == union.position(created_at)
        for prefix in (b"", bytes([rng.randrange(256)]), rng.randbytes(32)):
            lower = rng.randrange(0, len(union) + 1)
            upper = rng.randrange(lower, len(union) + 1)
            bound = (created_at, prefix)
            assert layered.bisect(bound, lower, upper) == union.bisect(bound, lower, upper)
    assert layered.bisect((1 << 64, b""), 0, len(union)) == len(union)
    for frame_limit in (4096, 60_000):
        ours = Reconciliation(layered, 0, len(layered), frame_limit, 10).initiate()
        plain = Reconciliation(union, 0, len(union), frame_limit, 10).initiate()
        assert ours == plain


def test_a_relay_id_list_over_both_layers_leaves_only_what_neither_holds() -> None:
    base, overlay = _items(20, 5), _items(5, 6)
    layered = _layered(base, overlay)
    reconciliation = Reconciliation(layered, 0, len(layered), 4096, 100)
    stranger = bytes([7]) * 32
    theirs = [key[1] for key in layered.keys[3:22]] + [stranger]
    message = b"\x61\x00\x00\x02" + encode_varint(len(theirs)) + b"".join(theirs)
    assert reconciliation.reconcile(message) is None
    assert reconciliation.missing == {stranger.hex()}


async def test_our_opening_over_a_snapshot_is_nostr_sdks_byte_for_byte() -> None:
    """Against the recorded NEG-OPEN of nostr-sdk's own client for the union's items."""
    base, overlay = _items(900, 8, spread=50), _items(100, 9, spread=50)
    layered = _layered(base, overlay)
    ours = Reconciliation(layered, 0, len(layered), 50_000, 10).initiate().hex()
    assert await _nostr_sdk_opening(list({**base, **overlay}.items())) == ours


def test_a_moved_window_leaves_the_snapshots_older_items_out_by_the_lower_bound() -> None:
    base = _items(200, 10)
    layered = _layered(base, _items(30, 11))
    since = 1_700_000_030
    union = SortedItems()
    union.add({**base, **_items(30, 11)})
    union.drop_before(since)
    first = layered.position(since)
    assert len(layered) - first == len(union)
    assert list(layered.keys[first:]) == union.keys
    assert layered.fingerprint(first, len(layered)) == union.fingerprint(0, len(union))
    opening = Reconciliation(layered, first, len(layered), 60_000, 10).initiate()
    assert opening == Reconciliation(union, 0, len(union), 60_000, 10).initiate()


def test_bytes_that_are_not_a_snapshot_are_refused() -> None:
    good = encode_snapshot(sorted((at, bytes.fromhex(i)) for i, at in _items(10, 12).items()))
    flipped = bytearray(good)
    flipped[20] ^= 1
    shuffled = encode_snapshot([(2, bytes(32)), (1, bytes([1]) * 32)])
    for bad in (b"", b"NEG1", good[:-1], good + b"x", bytes(flipped), b"XXXX" + good[4:],
                good[:12] + good[12 + RECORD_SIZE :], shuffled):
        with pytest.raises(SnapshotInvalid):
            SnapshotItems(bad)


def test_a_snapshots_sums_wrap_mod_2_256() -> None:
    top = (1 << 256) - 1
    pairs = [(1, top.to_bytes(32, "little")), (2, (2).to_bytes(32, "little"))]
    snapshot = SnapshotItems(encode_snapshot(pairs))
    assert snapshot.sum_before(2) == 1
    layered = LayeredItems(snapshot, SortedItems())
    assert layered.fingerprint(0, 2) == fingerprint(1, 2)


def test_a_runs_parts_read_as_one_snapshot_and_the_first_layout_still_reads() -> None:
    """A run stored in parts (each starting its sums where the one before ended) reads as the
    snapshot of all its items: same keys, same fingerprints over any range, with its leading
    part gone too (only differences of sums are read). Parts whose sums or order do not
    follow are refused; a snapshot in the first layout (NEG1, no start sum) reads as before."""
    pairs = sorted((at, bytes.fromhex(i)) for i, at in _items(300, 21, spread=100_000).items())
    plain = SortedItems()
    plain.add({raw.hex(): at for at, raw in pairs})
    first = encode_snapshot(pairs[:100])
    second = encode_snapshot(pairs[100:250], SnapshotPart(first).end_sum())
    third = encode_snapshot(pairs[250:], SnapshotPart(second).end_sum())
    run = SnapshotItems.of_run([SnapshotPart(data) for data in (first, second, third)])
    assert list(run) == plain.keys
    layered = LayeredItems(run, SortedItems())
    for lower, upper in ((0, 300), (5, 120), (99, 101), (250, 300)):
        assert layered.fingerprint(lower, upper) == plain.fingerprint(lower, upper)
    tail = LayeredItems(SnapshotItems.of_run([SnapshotPart(second), SnapshotPart(third)]),
                        SortedItems())
    assert tail.fingerprint(10, 200) == plain.fingerprint(110, 300)
    for bad in ([SnapshotPart(first), SnapshotPart(third)],
                [SnapshotPart(second), SnapshotPart(encode_snapshot(pairs[:100]))]):
        with pytest.raises(SnapshotInvalid):
            SnapshotItems.of_run(bad)
    records = SnapshotPart(first).records
    body = FIRST_MAGIC + (100).to_bytes(8, "big") + bytes(records)
    old = SnapshotItems(body + hashlib.blake2b(body, digest_size=DIGEST_SIZE).digest())
    assert list(old) == plain.keys[:100] and old.sum_before(0) == 0
    late = SnapshotPart(encode_snapshot(pairs[:5], late=True))
    assert late.late and late.count == 5
