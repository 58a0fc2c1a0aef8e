"""Firehose relays end to end: a real `nostr-relay` process, a real `sigil-push serve` process,
and between them a thin proxy that passes every frame through and keeps what the bridge sent,
so the assertions are on what the relay received.

A firehose relay gets one REQ for every kind 4/1059 (no `#p`, no key anywhere); the bridge
matches recipients locally, wakes registered keys and drops the rest as `unaddressed` before
verifying them. In mode `auto` a relay switches at `bridge.firehose_above_keys`.

Only the catch-up story is about what the store keeps across a restart, so only it runs on both
engines; the others are about the wire and run on SQLite (the store's side of firehose
matching is checked on both engines in process).
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY
from websockets.asyncio.server import ServerConnection

from sigil_push.bridge import committer
from sigil_push.bridge.verified import RecentlyVerified
from sigil_push.nostr.event import sign_event
from sigil_push.nostr.keys import SecretKey
from sigil_push.relays.labels import series_label
from sigil_push.store.seen import SeenEvents
from testkit.bridge_harness import (
    assert_private,
    eventually,
    health,
    metric,
    new_token,
    register,
    unregister,
    wakeups,
)
from testkit.deadlines import COMMAND_SECONDS, scaled
from testkit.fakes.harness import eventually as poll
from testkit.in_process import InProcessBridge, in_process_bridge
from testkit.loopback_relay import ProxyRelay
from testkit.nostr_client import gift_wrap, hex_of, kind4_dm, npub_of, publish, user
from testkit.relay import RelayProcess
from testkit.service import ServiceProcess
from testkit.stores import Engine, seen_rows

SQLITE = Engine("sqlite", None)


class RecordingProxy(ProxyRelay):
    """Forwards each client connection to `upstream` and keeps every message the client sent
    (decoded)."""

    def __init__(self, upstream: str) -> None:
        super().__init__(upstream)
        self.sent: list[list[Any]] = []

    def _serve_options(self) -> dict[str, Any]:
        return {"max_size": None}

    async def client_frame(self, ws: ServerConnection, frame: str | bytes) -> bool:
        self.sent.append(json.loads(frame))
        return True

    def requests(self) -> list[list[Any]]:
        return [message for message in self.sent if message[0] == "REQ"]


def dropped(relay: str, reason: str) -> float:
    return REGISTRY.get_sample_value(
        "sigil_push_bridge_events_dropped_total",
        {"relay": series_label(relay), "reason": reason},
    ) or 0.0


def seen_records(folder: Path) -> list[dict[str, Any]]:
    """The `seen` records (one per relay delivery) of the observation log in `folder`."""
    return [
        json.loads(line)
        for path in sorted((folder / "observations").glob("*.jsonl"))
        for line in path.read_text().splitlines()
        if line and json.loads(line)["type"] == "seen"
    ]


def _service(
    folder: Path, relay_url: str, mode: str, engine: Engine, bridge: str = ""
) -> ServiceProcess:
    toml = (
        "[bridge]\nreconnect_min_seconds = 0.2\nreconnect_max_seconds = 1.0\n"
        f"{bridge}\n[[relay]]\nurl = \"{relay_url}\"\nmode = \"{mode}\"\n"
    )
    return ServiceProcess(folder, [], toml, database=engine.database()).start()


def _relay_state(service: ServiceProcess, url: str) -> dict[str, Any]:
    try:
        return dict(health(service)["relays"].get(url) or {})
    except (OSError, ValueError, KeyError):
        return {}


def _live(service: ServiceProcess, url: str, keys: int, mode: str) -> bool:
    state = _relay_state(service, url)
    return bool(state.get("live")) and state.get("keys") == keys and state.get("mode") == mode


async def test_a_firehose_relay_is_asked_for_every_dm_and_wakes_only_registered_keys(
    start_relay: Callable[..., RelayProcess], tmp_path: Path
) -> None:
    """The relay receives one REQ, with no `#p` and no key in it, however many keys register;
    DMs and gift wraps to registered keys wake their devices once, DMs to anyone else wake
    nobody and are counted as `unaddressed`, and nothing private reaches the logs."""
    relay = start_relay("relay")
    async with RecordingProxy(relay.url) as proxy:
        service = _service(tmp_path / "service", proxy.url, "firehose", SQLITE)
        try:
            await eventually(lambda: _live(service, proxy.url, 0, "firehose"), "firehose live")
            alice, bob, carol, sender = user(), user(), user(), user()
            tokens = {npub_of(k): new_token() for k in (alice, bob, carol)}
            for keys in (alice, bob, carol):
                register(service, keys, tokens[npub_of(keys)])
            await eventually(lambda: _live(service, proxy.url, 3, "firehose"), "3 keys there")

            strangers = [user() for _ in range(10)]
            unaddressed = [kind4_dm(sender, s, f"not for us {i}") for i, s in enumerate(strangers)]
            to_alice = kind4_dm(sender, alice, "hello alice")
            to_bob = gift_wrap(sender, bob, "hello bob")
            await publish(relay.url, *unaddressed, to_alice, to_bob)

            await eventually(
                lambda: wakeups(service)[to_alice["id"]] >= 1 and wakeups(service)[to_bob["id"]] >= 1,
                "the registered recipients woken",
            )
            await eventually(
                lambda: metric(
                    service, "sigil_push_bridge_events_dropped_total", reason="unaddressed"
                ) >= len(unaddressed),
                "unaddressed DMs counted",
            )
            pushed = wakeups(service)
            assert pushed[to_alice["id"]] == 1 and pushed[to_bob["id"]] == 1
            assert not any(pushed[event["id"]] for event in unaddressed)
            assert metric(service, "sigil_push_bridge_events_dropped_total", reason="forged") == 0

            requests = proxy.requests()
            # besides one-shot catch-up pages ("…p": the relay has no NIP-77 to reconcile with)
            live = [r for r in requests if not str(r[1]).endswith(("p", "n"))]
            assert len(live) == 1, "one subscription whatever the number of keys"
            for request in requests:
                for query in request[2:]:
                    assert "#p" not in query and "authors" not in query, query
                    assert set(query["kinds"]) & {4, 1059} or set(query["kinds"]) == {10050, 10002, 10000, 3}
            sent_text = json.dumps(proxy.sent)
            for keys in (alice, bob, carol):
                assert hex_of(keys) not in sent_text, "the relay learnt a registered key"
            assert_private(
                service,
                [hex_of(alice), hex_of(bob), hex_of(carol), npub_of(alice), *tokens.values()],
            )
        finally:
            service.stop()


async def test_a_firehose_catch_up_pushes_what_was_missed_but_nothing_from_before_registration(
    start_relay: Callable[..., RelayProcess], tmp_path: Path, engine: Engine
) -> None:
    """A DM stored before its recipient registered comes back in the catch-up after a restart
    (the firehose asks for everything since the cursor) and is not pushed; one sent while the
    service was down is pushed once."""
    relay = start_relay("relay")
    async with RecordingProxy(relay.url) as proxy:
        folder = tmp_path / "service"
        service = _service(folder, proxy.url, "firehose", engine)
        try:
            await eventually(lambda: _live(service, proxy.url, 0, "firehose"), "firehose live")
            alice, sender = user(), user()
            before = kind4_dm(sender, alice, "before you joined", created_at=int(time.time()) - 120)
            await publish(relay.url, before)
            await eventually(
                lambda: metric(
                    service, "sigil_push_bridge_events_dropped_total", reason="unaddressed"
                ) >= 1,
                "the early DM streamed by, unaddressed",
            )
            register(service, alice, new_token())
            await eventually(lambda: _live(service, proxy.url, 1, "firehose"), "alice there")
            service.stop()

            missed = kind4_dm(sender, alice, "while you were away")
            await publish(relay.url, missed)
            service.start()
            await eventually(lambda: wakeups(service)[missed["id"]] >= 1, "missed DM pushed")
            await eventually(lambda: _live(service, proxy.url, 1, "firehose"), "caught up")
            assert wakeups(service)[missed["id"]] == 1
            assert wakeups(service)[before["id"]] == 0, "a DM from before registration pushed"
            assert metric(service, "sigil_push_bridge_events_baselined_total") >= 1
            assert all("#p" not in q for r in proxy.requests() for q in r[2:])
        finally:
            service.stop()


async def test_auto_switches_to_the_firehose_above_the_threshold_and_back(
    start_relay: Callable[..., RelayProcess], tmp_path: Path
) -> None:
    """With `firehose_above_keys = 2`, two keys are asked by `#p`; a third switches the relay
    to one REQ without `#p` (sent before the filtered one is closed), and DMs keep waking
    every key; going back to two keys returns to `#p` and wakes the rest."""
    relay = start_relay("relay")
    async with RecordingProxy(relay.url) as proxy:
        service = _service(
            tmp_path / "service", proxy.url, "auto", SQLITE, "firehose_above_keys = 2"
        )
        try:
            people = [user() for _ in range(3)]
            tokens = [new_token() for _ in people]
            sender = user()
            for keys, token in zip(people[:2], tokens[:2], strict=True):
                register(service, keys, token)
            await eventually(lambda: _live(service, proxy.url, 2, "filtered"), "two, filtered")
            assert any("#p" in q for r in proxy.requests() for q in r[2:])

            seen_before = len(proxy.sent)
            register(service, people[2], tokens[2])
            await eventually(lambda: _live(service, proxy.url, 3, "firehose"), "three: firehose")
            after = proxy.sent[seen_before:]
            first_req = next(i for i, m in enumerate(after) if m[0] == "REQ")
            assert all("#p" not in q for q in after[first_req][2:]), after[first_req]
            closes = [i for i, m in enumerate(after) if m[0] == "CLOSE"]
            assert closes and min(closes) > first_req, "the filtered REQ closed before its successor"

            dms = [kind4_dm(sender, keys, f"hi {i}") for i, keys in enumerate(people)]
            await publish(relay.url, *dms)
            await eventually(
                lambda: all(wakeups(service)[dm["id"]] >= 1 for dm in dms), "all three woken"
            )

            unregister(service, people[2], tokens[2])
            await eventually(lambda: _live(service, proxy.url, 2, "filtered"), "back to filtered")
            later = [kind4_dm(sender, keys, f"again {i}") for i, keys in enumerate(people[:2])]
            await publish(relay.url, *later)
            await eventually(
                lambda: all(wakeups(service)[dm["id"]] >= 1 for dm in later), "still woken"
            )
            pushed = wakeups(service)
            assert all(pushed[dm["id"]] == 1 for dm in [*dms, *later])
        finally:
            service.stop()


async def test_a_copy_reuses_the_verified_original_and_a_forged_body_gains_nothing(
    tmp_path: Path, engine: Engine
) -> None:
    """A second relay's copy of a just-verified id is taken as that relay's delivery of the
    verified original: its own body (altered content and time) is never used. Once the id is
    only known as handled, a copy's id is recomputed: an altered body is dropped as `wrong_id`,
    a genuine body with a bad signature is recorded as a delivery (that id was verified
    before). The relays of the batch that first handled the event share its `seen_events` row,
    a later batch's copy is appended to that row, and a restart reads them back in full.
    One wakeup in all."""
    # fresh names: the drop counters are per relay and live as long as the test process
    relays = [f"wss://copy{i}-{secrets.token_hex(4)}.example" for i in range(5)]
    async with in_process_bridge(tmp_path, engine.database("push.db")) as parts:
        db, bridge = parts.db, parts.bridge
        sender, me = SecretKey.generate(), await _alice_watched(parts)
        now_ms = int(time.time() * 1000)
        original = sign_event(sender, 4, "the real one", [["p", me]])
        altered = {**original.to_json(), "content": "injected", "created_at": 12345}
        bad_sig = {**original.to_json(), "sig": sign_event(sender, 4, "x").sig}
        # user relays share one series label: count from here
        forged_before, wrong_before = dropped(relays[1], "forged"), dropped(relays[1], "wrong_id")

        bridge.port.ingest.user_event(relays[0], me, original.to_json(), now_ms, False)
        bridge.port.ingest.user_event(relays[1], me, altered, now_ms, False)
        bridge.port.ingest.user_event(relays[2], me, bad_sig, now_ms, False)
        await poll(lambda: len(seen_records(tmp_path)) == 3, what="three deliveries recorded")
        assert {r["created_at"] for r in seen_records(tmp_path)} == {original.created_at}
        assert dropped(relays[1], "forged") - forged_before == 0
        assert dropped(relays[1], "wrong_id") - wrong_before == 0

        bridge._ingest._recent = RecentlyVerified(1)  # as if the copies came long after the original
        bridge.port.ingest.user_event(relays[3], me, altered, now_ms, False)
        bridge.port.ingest.user_event(relays[4], me, bad_sig, now_ms, False)
        await poll(lambda: len(seen_records(tmp_path)) == 4, what="the genuine late copy recorded")
        await poll(lambda: dropped(relays[3], "wrong_id") - wrong_before == 1,
                   what="altered body dropped")
        assert {r["relay"] for r in seen_records(tmp_path)} == {relays[0], relays[1], relays[2], relays[4]}

        first_batch = await db.execute_fetchall(
            "SELECT relay FROM seen_events WHERE event_id = ?", (bytes.fromhex(original.id),)
        )
        assert list(first_batch) == [(" ".join((*relays[:3], relays[4])),)], (
            "copies of its first batch, then a later batch's copy appended"
        )
        restarted = SeenEvents(seen_rows(parts.store), 3600, 100)
        await restarted.lookup([original.id])
        assert all(restarted.delivered_by(original.id, r) for r in (*relays[:3], relays[4]))
        assert not restarted.delivered_by(original.id, relays[3])
        wakeups_queued = await db.execute_fetchall(
            "SELECT COUNT(*) FROM outbox WHERE event_id = ?", (original.id,)
        )
        assert list(wakeups_queued) == [(1,)]


async def test_copies_in_later_batches_share_one_row_and_are_recorded_once_on_disk(
    tmp_path: Path, engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Copies of an already committed event that arrive in two later batches are held and
    written together by a later commit: appended to the event's row in one update, each
    delivery's `seen` record logged only with its row, a repeat from one of those relays
    counted as a duplicate even while held, and no second wakeup."""
    monkeypatch.setattr(committer, "FURTHER_HOLD_SECONDS", 3600.0)
    relays = [f"wss://held{i}-{secrets.token_hex(4)}.example" for i in range(3)]
    async with in_process_bridge(tmp_path, engine.database("push.db")) as parts:
        db, bridge = parts.db, parts.bridge
        sender, me = SecretKey.generate(), await _alice_watched(parts)
        original = sign_event(sender, 4, "one event, three relays", [["p", me]])
        now_ms = int(time.time() * 1000)
        bridge.port.ingest.user_event(relays[0], me, original.to_json(), now_ms, False)
        await poll(lambda: len(seen_records(tmp_path)) == 1, what="the first delivery committed")
        seen = bridge._ingest._seen
        for relay in relays[1:]:
            bridge.port.ingest.user_event(relay, me, original.to_json(), now_ms, False)
            await poll(lambda r=relay: seen.delivered_by(original.id, r),
                       what="the copy decided in a batch of its own")

        def duplicates() -> float:
            return REGISTRY.get_sample_value(
                "sigil_push_bridge_events_duplicate_total", {"relay": series_label(relays[1])}
            ) or 0.0

        duplicates_before = duplicates()  # user relays share one series label
        bridge.port.ingest.user_event(relays[1], me, original.to_json(), now_ms, False)
        assert duplicates() - duplicates_before == 1, "a held delivery is known at once"
        assert len(seen_records(tmp_path)) == 1, "held: not logged before its row is written"
        rows = await db.execute_fetchall(
            "SELECT relay FROM seen_events WHERE event_id = ?", (bytes.fromhex(original.id),)
        )
        assert list(rows) == [(relays[0],)], "held: not written yet"

        monkeypatch.setattr(committer, "FURTHER_HOLD_SECONDS", 0.0)
        another = sign_event(sender, 4, "the next one carries them", [["p", me]])
        bridge.port.ingest.user_event(relays[0], me, another.to_json(), now_ms, False)
        await poll(lambda: len(seen_records(tmp_path)) == 4, what="the held copies recorded")
        assert sorted(r["relay"] for r in seen_records(tmp_path) if r["event_id"] == original.id
                      ) == sorted(relays)
        rows = await db.execute_fetchall(
            "SELECT relay FROM seen_events WHERE event_id = ?", (bytes.fromhex(original.id),)
        )
        assert list(rows) == [(" ".join(relays),)], "both later copies appended to its row"
        wakeups = await db.execute_fetchall(
            "SELECT COUNT(*) FROM outbox WHERE event_id = ?", (original.id,)
        )
        assert list(wakeups) == [(1,)]


async def test_the_raw_frame_scan_never_drops_an_addressed_event(
    tmp_path: Path, engine: Engine
) -> None:
    """On a live firehose, frames are scanned before parsing: one naming a registered key in
    any `p` tag (whatever the spacing) or carrying a relay list goes on to the full checks;
    one naming only strangers (even with a registered key inside its escaped content) is
    dropped and counted as `unaddressed`."""
    relay = "ws://127.0.0.1:9"  # nothing listens: the subscription is never sent
    async with in_process_bridge(
        tmp_path, engine.database("push.db"), [{"url": relay, "mode": "firehose"}]
    ) as parts:
        devices, bridge = parts.devices, parts.bridge
        alice, sender = SecretKey.generate(), SecretKey.generate()
        me, stranger = alice.public_key_hex, SecretKey.generate().public_key_hex
        await devices.register(me, "android", "fcm-alice", "opaque", (), None, 0)
        await poll(lambda: me in bridge._pool.subs[relay].keys, what="alice on the firehose")
        assert bridge.health()[relay]["mode"] == "firehose"

        def frame(event: dict[str, Any], spaced: bool = False) -> str:
            return json.dumps(["EVENT", "sp0.1", event], separators=None if spaced else (",", ":"))

        addressed = [
            frame(sign_event(sender, 4, "x", [["p", me]]).to_json(), spaced=True),
            frame(sign_event(sender, 1059, "x", [["p", stranger], ["p", me]]).to_json()),
            # alice's own list: the full checks then take it (a stranger's list would be
            # dropped there as unaddressed, as every frame now reaches them)
            frame(sign_event(alice, 10050, "", [["relay", "wss://a.example"]]).to_json()),
        ]
        strangers_only = [
            frame(sign_event(sender, 4, f'["p","{me}"]', [["p", stranger]]).to_json()),
            frame(sign_event(sender, 1059, "x", [["e", me], ["p", stranger]]).to_json()),
        ]
        before = dropped(relay, "unaddressed")
        for text in addressed:  # taken on to the full checks (parsed by the bridge itself)
            bridge.pool.deliver_text(relay, text, 0)
        assert all(bridge.pool.deliver_text(relay, text, 0) for text in strangers_only)
        await poll(
            lambda: dropped(relay, "unaddressed") - before == len(strangers_only),
            what="the unaddressed frames counted",
        )


async def test_a_raw_copy_of_a_verified_id_is_recorded_as_the_original(
    tmp_path: Path, engine: Engine
) -> None:
    """A copy recognised in the raw frame (never parsed) counts as the second relay's delivery
    of the verified original: its altered content and time are not used, and the event is
    queued for one wakeup only."""
    first, second = "ws://127.0.0.1:9/a", "ws://127.0.0.1:9/b"
    async with in_process_bridge(
        tmp_path,
        engine.database("push.db"),
        [{"url": first, "mode": "firehose"}, {"url": second, "mode": "firehose"}],
    ) as parts:
        db, devices, bridge = parts.db, parts.devices, parts.bridge
        alice, sender = SecretKey.generate(), SecretKey.generate()
        me = alice.public_key_hex
        await devices.register(me, "android", "fcm-alice", "opaque", (), None, 0)
        await poll(lambda: me in bridge._pool.subs[second].keys, what="alice on both relays")
        original = sign_event(sender, 4, "the real one", [["p", me]], int(time.time()) + 5)
        altered = {**original.to_json(), "content": "injected", "created_at": 12345}
        now_ms = int(time.time() * 1000)
        bridge.pool.deliver(first, "sp0.1", original.to_json(), now_ms)
        assert bridge.pool.deliver_text(second, json.dumps(["EVENT", "sp0.1", altered]), now_ms)

        await poll(lambda: len(seen_records(tmp_path)) == 2, what="both deliveries recorded")
        assert {(r["relay"], r["created_at"]) for r in seen_records(tmp_path)} == {
            (first, original.created_at), (second, original.created_at)
        }
        queued = await db.execute_fetchall(
            "SELECT COUNT(*) FROM outbox WHERE event_id = ?", (original.id,)
        )
        assert list(queued) == [(1,)]


def test_firehose_subscriptions_switch_without_a_gap_and_baseline_live_joiners() -> None:
    """The bookkeeping alone: one key-less REQ; a key joining the live firehose sends nothing
    and is baselined at once; switching to shards sends every new REQ before closing the
    firehose, asking from the cursor since every key is baselined."""
    from sigil_push.relays.subscriptions import RelaySubscriptions

    keys = [f"{i:064x}" for i in range(1, 6)]
    subs = RelaySubscriptions(keys_per_filter=2, with_lists=True)
    subs.set_firehose(True)
    for key in keys[:3]:
        subs.add(key)
    (fire,) = subs.due(100, 200)
    assert fire.fresh and all("#p" not in f and "authors" not in f for f in fire.filters)
    assert fire.filters[0] == {"kinds": [4, 1059], "since": 100}
    assert subs.catching_up(fire.sub_id, keys[0])
    assert subs.eose(fire.sub_id)[0] == frozenset(keys[:3])
    assert not subs.catching_up(fire.sub_id, keys[0])

    subs.add(keys[3])
    assert subs.due(100, 200) == [], "a new key sends nothing on a firehose"
    assert subs.take_newly_baselined() == {keys[3]}

    assert subs.set_firehose(False)
    requests = subs.due(100, 200)
    assert [r.close for r in requests[-1:]] == [fire.sub_id] and requests[-1].sub_id is None
    shards = requests[:-1]
    assert len(shards) == 2 and all(r.close is None and not r.fresh for r in shards)
    assert all(r.filters[0]["since"] == 200 for r in shards), "from the cursor, not fresh"
    assert sorted(k for r in shards for k in r.filters[0]["#p"]) == keys[:4]


def test_a_bad_relay_mode_or_threshold_stops_the_service_with_exit_2(tmp_path: Path) -> None:
    """`[[relay]] mode` other than filtered/firehose/auto, or a negative threshold, is a
    config error naming the key: `serve` exits 2 with one line, before opening anything."""
    import subprocess
    import sys

    for table, key in (
        ('[[relay]]\nurl = "wss://relay.example"\nmode = "everything"\n', "relay[0].mode"),
        ('[bridge]\nfirehose_above_keys = -1\n', "bridge.firehose_above_keys"),
    ):
        config = tmp_path / "relays.toml"
        config.write_text(table)
        done = subprocess.run(
            [sys.executable, "-m", "sigil_push", "serve", "--config", str(config)],
            check=False, capture_output=True, text=True, timeout=scaled(COMMAND_SECONDS),
        )
        assert done.returncode == 2, done.stderr
        assert key in done.stderr


async def _alice_watched(parts: InProcessBridge) -> str:
    """Register alice on one Android phone; her key once the bridge watches it."""
    me = SecretKey.generate().public_key_hex
    await parts.devices.register(me, "android", "fcm-alice", "opaque", (), None, 0)
    await poll(lambda: me in parts.bridge._registry.keys, what="alice watched")
    return me
