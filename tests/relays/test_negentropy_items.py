"""Our NIP-77 client (nostr/nip77.py over relays/nip77.py) against rust-nostr's relay, whose
negentropy is nostr-sdk's: the ids it finds missing are exactly the relay's beyond ours, for
many items, none, all missing, all present, ids of ours the relay lacks, ranges that take
many rounds under a small frame limit, and windows cut in slices; the relay's say is bounded
(ids it can make us fetch, rounds).

Catch-up costs CPU for what is new, not for the window (issue 24): the sorted items and their
prefix sums are kept per relay and filter across catch-ups and reconnects, bounded by the
window and counted in sigil_push_memory_entries."""

from __future__ import annotations

import itertools
import json
import logging
import random
import time
from typing import Any

import nostr_sdk
import pytest
from aiohttp import web
from prometheus_client import REGISTRY
from websockets.asyncio.server import ServerConnection

from sigil_push.nostr.nip19 import encode_npub
from sigil_push.nostr.nip77 import Reconciliation, SortedItems
from sigil_push.nostr.nip77_snapshot import SnapshotItems, encode_snapshot
from sigil_push.relays import nip77
from sigil_push.relays.nip77 import NegentropyFailed, Reconciler
from testkit.loopback_relay import ProxyRelay
from testkit.nostr_client import hex_of, kind4_dm, sdk_dry_run_sync, user
from testkit.rust_relay import RustRelay


def _kept_gauge() -> float:
    value = REGISTRY.get_sample_value(
        "sigil_push_memory_entries", {"structure": "negentropy_items"}
    )
    assert value is not None
    return value


async def test_a_second_reconciliation_adds_only_the_new_items() -> None:
    """Three DMs on the relay, two of them already had: the first catch-up adds two items
    and finds the third missing; the next, with the third now had too, adds only that one
    (the first two are kept, also across the socket closing in between); a keyed filter has
    a set of its own; items that fall out of the window are forgotten, and the gauge follows."""
    sender, recipient = user(), user()
    now = int(time.time())
    dms = [kind4_dm(sender, recipient, f"dm {n}", now - 100 + n) for n in range(3)]
    async with RustRelay() as relay:
        await relay.publish(*dms)
        reconciler = Reconciler(relay.url)
        query = {"kinds": [4, 1059], "since": now - 3600}
        had = {dm["id"]: dm["created_at"] for dm in dms[:2]}
        try:
            assert await reconciler.missing(query, had) == [dms[2]["id"]]
            assert reconciler.added_now == 2
        finally:
            await reconciler.close()
        assert not reconciler.open
        assert _kept_gauge() >= 2

        had[dms[2]["id"]] = dms[2]["created_at"]
        try:
            assert await reconciler.missing(query, had) == []
            assert reconciler.added_now == 1
            assert await reconciler.missing(query, had) == []
            assert reconciler.added_now == 0
            keyed = {**query, "#p": [hex_of(recipient)]}
            assert await reconciler.missing(keyed, had) == []
            assert reconciler.added_now == 3
            assert await reconciler.missing(keyed, had) == []
            assert reconciler.added_now == 0
            assert reconciler.kept_items() == 6

            # the window moves past the first DM: it is forgotten from the kept set
            later = {**query, "since": dms[0]["created_at"] + 1}
            del had[dms[0]["id"]]
            assert await reconciler.missing(later, had) == []
            assert reconciler.added_now == 0
            assert reconciler._kept[None][1].known == set(had)
        finally:
            await reconciler.close()


async def test_many_items_reconcile_exactly_over_rounds_and_slices(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """2,400 DMs over two days on the relay; the smallest frame limit the protocol allows
    and slices of 500 items force many rounds and several reconciliations per window. Every
    case finds exactly the relay's ids beyond ours: none had, all had, a random tenth
    missing, 300 missing from one busy second, and ids of ours the relay never had; and the
    same again with most of ours in a stored snapshot beneath the rest."""
    monkeypatch.setattr(nip77, "FRAME_LIMIT_BYTES", 4096)
    monkeypatch.setattr(nip77, "ITEMS_PER_SYNC", 500)
    senders, recipients = [user() for _ in range(3)], [user() for _ in range(5)]
    now = int(time.time())
    rng = random.Random(24)
    dms = [
        kind4_dm(senders[n % 3], recipients[n % 5], f"dm {n}",
                 now - 300 if n < 300 else now - rng.randrange(0, 2 * 86400))
        for n in range(2_400)
    ]
    relay_ids = {dm["id"] for dm in dms}
    everything = {dm["id"]: dm["created_at"] for dm in dms}
    query: dict[str, Any] = {"kinds": [4, 1059], "since": now - 3 * 86400}
    foreign = {f"{n:064x}": now - n * 60 for n in range(1, 50)}
    cases = {
        "none had": {},
        "all had": everything,
        "a tenth missing": {i: t for i, t in everything.items() if rng.random() > 0.1},
        "one busy second missing": {dm["id"]: dm["created_at"] for dm in dms[300:]},
        "ours beyond the relay's": {**everything, **foreign},
    }
    async with RustRelay() as relay:
        await relay.publish(*dms)
        reconciler = Reconciler(relay.url)
        try:
            for case, had in cases.items():
                missing = await reconciler.missing(query, had)
                assert sorted(missing) == sorted(relay_ids - set(had)), case
                assert len(missing) == len(set(missing)), case
                # the same with most of ours in a stored snapshot beneath the rest (a few
                # in both, as rows written just after a cut are)
                ordered = list(had.items())
                below, above = ordered[: len(ordered) * 4 // 5], ordered[len(ordered) * 4 // 5 - 5 :]
                base = SnapshotItems(encode_snapshot(sorted(
                    (created_at, bytes.fromhex(event_id)) for event_id, created_at in below
                )))
                layered = await reconciler.missing(query, dict(above), base)
                assert sorted(layered) == sorted(missing), case
            # the window moves past a snapshot's oldest items: its lower bound leaves them out
            later = {**query, "since": now - 86400}
            tenth = cases["a tenth missing"]
            base = SnapshotItems(encode_snapshot(sorted(
                (created_at, bytes.fromhex(event_id)) for event_id, created_at in tenth.items()
            )))
            in_window = {dm["id"] for dm in dms if dm["created_at"] >= now - 86400}
            missing = await reconciler.missing(later, {}, base)
            assert sorted(missing) == sorted(in_window - set(tenth))
            # the tenth took more than one round in a slice: allowed only one, it fails
            # (`error`), and its socket is closed
            monkeypatch.setattr(nip77, "MAX_ROUNDS", 1)
            with pytest.raises(NegentropyFailed) as failure:
                await reconciler.missing(query, cases["a tenth missing"])
            assert failure.value.reason == "error"
            assert not reconciler.open
        finally:
            await reconciler.close()


async def test_an_empty_relay_and_an_empty_set_agree_at_once() -> None:
    async with RustRelay() as relay:
        reconciler = Reconciler(relay.url)
        try:
            assert await reconciler.missing({"kinds": [4, 1059], "since": 0}, {}) == []
            assert reconciler.count.frames == 1
        finally:
            await reconciler.close()


async def test_a_relay_claiming_more_missing_ids_than_we_fetch_ends_the_reconciliation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """More ids missing than we would fetch by id: the reconciliation fails (`error`: paged
    REQ this once, whose pages are bounded) and its socket is closed."""
    monkeypatch.setattr(nip77, "MAX_MISSING_IDS", 10)
    sender, recipient = user(), user()
    now = int(time.time())
    dms = [kind4_dm(sender, recipient, f"dm {n}", now - n) for n in range(200)]
    async with RustRelay() as relay:
        await relay.publish(*dms)
        reconciler = Reconciler(relay.url)
        had = {dm["id"]: dm["created_at"] for dm in dms[::2]}
        with pytest.raises(NegentropyFailed) as failure:
            await reconciler.missing({"kinds": [4], "since": now - 3600}, had)
        assert failure.value.reason == "error"
        assert not reconciler.open


class _RecordingProxy(ProxyRelay):
    """Passes frames to `upstream` and back, keeping every NEG-* frame in order, with
    whether the relay sent it."""

    def __init__(self, upstream: str) -> None:
        super().__init__(upstream)
        self.frames: list[tuple[bool, list[Any]]] = []

    async def client_frame(self, ws: ServerConnection, frame: str | bytes) -> bool:
        self._keep(frame, from_relay=False)
        return True

    def relay_frame(self, frame: str | bytes) -> None:
        self._keep(frame, from_relay=True)

    def _keep(self, frame: str | bytes, from_relay: bool) -> None:
        message = json.loads(frame)
        if str(message[0]).startswith("NEG-"):
            self.frames.append((from_relay, message))


async def test_each_answer_is_the_one_nostr_sdk_gives_in_the_same_exchange() -> None:
    """nostr-sdk's client reconciles 3,000 DMs (a tenth of them missing, 40 ids of ours the
    relay lacks) with rust-nostr's relay through a recording proxy; fed the relay's messages
    of that exchange, our side answers each as nostr-sdk did (byte for byte, but for the
    fingerprint deferring the rest of a full frame), ends where it sent NEG-CLOSE, and finds
    the same ids missing."""
    senders, recipients = [user() for _ in range(3)], [user() for _ in range(5)]
    now = int(time.time())
    rng = random.Random(77)
    dms = [kind4_dm(senders[n % 3], recipients[n % 5], f"dm {n}",
                    now - rng.randrange(0, 2 * 86400)) for n in range(3_000)]
    had = {dm["id"]: dm["created_at"] for dm in dms if rng.random() > 0.1}
    had.update({f"{n:064x}": now - n * 60 for n in range(1, 41)})
    query = nostr_sdk.Filter().kinds([nostr_sdk.Kind(4)])
    async with RustRelay() as relay, _RecordingProxy(relay.url) as proxy:
        await relay.publish(*dms)
        summary = await sdk_dry_run_sync(proxy.url, query, had, nostr_sdk.SyncOptions().dry_run())
    sdk_missing = {event_id.to_hex() for event_id in summary.remote}
    assert sdk_missing == {dm["id"] for dm in dms} - set(had)

    ours = SortedItems()
    ours.add(had)
    reconciliation = Reconciliation(ours, 0, len(ours), nip77.FRAME_LIMIT_BYTES, len(dms))
    frames = proxy.frames
    assert [from_relay for from_relay, _ in frames] == [n % 2 == 1 for n in range(len(frames))]
    assert frames[0][1][0] == "NEG-OPEN"
    assert reconciliation.initiate().hex() == frames[0][1][3]
    assert len(frames) >= 5, "more than one round"
    for (from_relay, theirs), (_, sdk_answer) in itertools.pairwise(frames):
        if not from_relay:
            continue
        assert theirs[0] == "NEG-MSG"
        answer = reconciliation.reconcile(bytes.fromhex(theirs[2]))
        if sdk_answer[0] == "NEG-CLOSE":
            assert answer is None
            continue
        expected = bytes.fromhex(sdk_answer[2])
        assert answer is not None
        if answer != expected:
            # a full frame: both defer the rest as one fingerprint to infinity, nostr-sdk's
            # over the items after the last range it processed, ours over those after the
            # last range it sent (what the range really holds)
            assert answer[:-16] == expected[:-16]
            assert answer[-19:-16] == b"\x00\x00\x01"
            assert len(answer) > nip77.FRAME_LIMIT_BYTES - 1_500
    last_from_relay, last = frames[-1]
    if last_from_relay:
        # nostr-sdk's NEG-CLOSE goes out as its sync returns, and the disconnect right after
        # can beat it to the proxy: then its last answer is not recorded, and ours to the
        # relay's last message must be the same end of the exchange
        assert last[0] == "NEG-MSG"
        assert reconciliation.reconcile(bytes.fromhex(last[2])) is None
    else:
        assert last[0] == "NEG-CLOSE"
    assert reconciliation.missing == sdk_missing


async def test_a_failed_exchange_logs_no_key_of_the_relay_url(caplog: pytest.LogCaptureFixture) -> None:
    """A relay URL may carry the user's key (`…/npub1…`), and aiohttp's handshake error
    quotes the URL: the debug line keeps the error, with the key as its digest."""
    npub = encode_npub("cd" * 32)
    app = web.Application()

    async def refuse(request: web.Request) -> web.Response:
        return web.Response(status=403, text="no")

    app.router.add_get("/{tail:.*}", refuse)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        port = runner.addresses[0][1]
        with caplog.at_level(logging.DEBUG, logger="sigil_push.relays.nip77"), pytest.raises(NegentropyFailed):
            await Reconciler(f"ws://127.0.0.1:{port}/{npub}").missing({"kinds": [1059]}, {})
    finally:
        await runner.cleanup()
    assert "WSServerHandshakeError: 403" in caplog.text and "<key-" in caplog.text
    assert npub not in caplog.text
