"""The bridge's own parse of EVENT frames (`raw_event`, orjson) keeps every check of the
connection's path: a frame it takes is verified like any other, a frame it refuses goes back to
the connection's parser unchanged, and a relay repeating a verified id gains nothing from the
body it wraps around it."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from prometheus_client import REGISTRY

from sigil_push.bridge.pending import Pending
from sigil_push.bridge.verified import RecentlyVerified
from sigil_push.nostr.event import compute_id, sign_event
from sigil_push.nostr.keys import SecretKey
from testkit.fakes.harness import eventually as poll
from testkit.in_process import InProcessBridge, in_process_bridge
from testkit.stores import Engine

RELAY = "ws://127.0.0.1:9"  # nothing listens: frames are fed to the bridge directly


def dropped(reason: str) -> float:
    return REGISTRY.get_sample_value(
        "sigil_push_bridge_events_dropped_total", {"relay": RELAY, "reason": reason}
    ) or 0.0


def frame(event: dict[str, Any]) -> str:
    return json.dumps(["EVENT", "sp0.1", event], separators=(",", ":"))


async def test_frames_parsed_by_the_bridge_are_verified_like_any_other(
    tmp_path: Path, engine: Engine
) -> None:
    """An altered body and a forged signature are taken (True) and dropped as `wrong_id` and
    `forged`; frames orjson refuses or of another shape go back to the connection (False),
    and a lone surrogate there is an id mismatch, never an exception in the reader. (Every
    frame names alice: on a firehose, frames naming no watched key never get this far.)"""
    async with in_process_bridge(
        tmp_path, engine.database("push.db"), [{"url": RELAY, "mode": "firehose"}]
    ) as parts:
        sender, me = SecretKey.generate(), await _alice_on_the_firehose(parts)
        genuine = sign_event(sender, 4, "hello", [["p", me]]).to_json()
        altered = {**genuine, "content": "hellp"}
        forged = dict(genuine)
        forged["content"] = "other"
        forged["id"] = compute_id(
            forged["pubkey"], forged["created_at"], 4, (("p", me),), forged["content"]
        )
        wrong_id, bad_sig = dropped("wrong_id"), dropped("forged")
        assert parts.bridge.pool.deliver_text(RELAY, frame(altered), 0)
        assert parts.bridge.pool.deliver_text(RELAY, frame(forged), 0)
        assert dropped("wrong_id") == wrong_id + 1
        assert dropped("forged") == bad_sig + 1

        text = frame(genuine)
        surrogate = text.replace('"hello"', '"\\ud800"')
        for refused in (text[:-1], text.replace('"sp0.1"', "5"), surrogate,
                        text.replace('"hello"', "NaN")):
            assert not parts.bridge.pool.deliver_text(RELAY, refused, 0), refused
        parts.bridge.pool.deliver(RELAY, "sp0.1", json.loads(surrogate)[2], 0)
        assert dropped("wrong_id") == wrong_id + 2


async def test_a_verified_id_in_another_body_routes_only_the_original(
    tmp_path: Path, engine: Engine
) -> None:
    """A second relay repeats a verified id with its own body naming another registered key:
    that relay's delivery of the original is recorded, and nothing wakes the other key."""
    second = "ws://127.0.0.1:10"
    relays = [{"url": RELAY, "mode": "firehose"}, {"url": second, "mode": "firehose"}]
    async with in_process_bridge(tmp_path, engine.database("push.db"), relays) as parts:
        alice, bob, sender = SecretKey.generate(), SecretKey.generate(), SecretKey.generate()
        for key, token in ((alice, "fcm-alice"), (bob, "fcm-bob")):
            await parts.devices.register(key.public_key_hex, "android", token, "opaque", (), None, 0)
        await poll(
            lambda: all(bob.public_key_hex in parts.bridge._pool.subs[url].keys
                        for url in (RELAY, second)),
            what="both keys watched on both relays",
        )
        original = sign_event(sender, 4, "hello", [["p", alice.public_key_hex]])
        now_ms = time.time_ns() // 1_000_000
        assert parts.bridge.pool.deliver_text(RELAY, frame(original.to_json()), now_ms)
        wrapped = {**original.to_json(), "tags": [["p", bob.public_key_hex]], "content": "x"}
        assert parts.bridge.pool.deliver_text(second, frame(wrapped), now_ms)

        def recorded() -> set[str]:
            return {
                record["relay"]
                for path in (tmp_path / "observations").glob("*.jsonl")
                for record in map(json.loads, path.read_text().splitlines())
                if record["type"] == "seen"
            }

        # `seen` records are logged after their batch is on disk
        await poll(lambda: recorded() == {RELAY, second}, what="both deliveries recorded")
        rows = await parts.db.execute_fetchall(
            "SELECT d.token, o.event_id FROM outbox o JOIN devices d ON d.id = o.device_id"
        )
        assert list(rows) == [("fcm-alice", original.id)]


async def test_a_copy_is_recognised_in_any_layout_and_recorded_per_relay(
    tmp_path: Path, engine: Engine
) -> None:
    """The same verified event from three relays: compact with the id first (the one-match
    path), spaced with the id last (the search path), and spaced with the id last around
    another body naming another key. Each relay's delivery is recorded once, the event wakes
    its recipient once, the altered body wakes nobody, and no copy counts as a drop."""
    relays = [RELAY, "ws://127.0.0.1:10", "ws://127.0.0.1:11"]
    async with in_process_bridge(
        tmp_path, engine.database("push.db"), [{"url": url, "mode": "firehose"} for url in relays]
    ) as parts:
        alice, bob, sender = SecretKey.generate(), SecretKey.generate(), SecretKey.generate()
        for key, token in ((alice, "fcm-alice"), (bob, "fcm-bob")):
            await parts.devices.register(key.public_key_hex, "android", token, "opaque", (), None, 0)
        await poll(
            lambda: all(bob.public_key_hex in parts.bridge._pool.subs[url].keys for url in relays),
            what="both keys watched on every relay",
        )
        original = sign_event(sender, 4, "hello", [["p", alice.public_key_hex]]).to_json()
        id_last = {**{k: v for k, v in original.items() if k != "id"}, "id": original["id"]}
        altered = {**id_last, "tags": [["p", bob.public_key_hex]], "content": "x"}
        def drops() -> list[float]:
            return [
                REGISTRY.get_sample_value(
                    "sigil_push_bridge_events_dropped_total", {"relay": url, "reason": reason}
                ) or 0.0
                for url in relays for reason in ("forged", "wrong_id", "malformed")
            ]

        before = drops()  # the counters live as long as the test process
        now_ms = time.time_ns() // 1_000_000
        assert parts.bridge.pool.deliver_text(relays[0], frame(original), now_ms)
        assert parts.bridge.pool.deliver_text(relays[1], json.dumps(["EVENT", "sp0.1", id_last]), now_ms)
        assert parts.bridge.pool.deliver_text(relays[2], json.dumps(["EVENT", "sp0.1", altered]), now_ms)

        def recorded() -> list[str]:
            return sorted(
                record["relay"]
                for path in (tmp_path / "observations").glob("*.jsonl")
                for record in map(json.loads, path.read_text().splitlines())
                if record["type"] == "seen" and record["event_id"] == original["id"]
            )

        await poll(lambda: recorded() == sorted(relays), what="each relay's delivery recorded")
        rows = await parts.db.execute_fetchall(
            "SELECT d.token, o.event_id FROM outbox o JOIN devices d ON d.id = o.device_id"
        )
        assert list(rows) == [("fcm-alice", original["id"])]
        assert drops() == before


async def test_a_frame_that_only_looks_like_a_copy_takes_the_full_path(
    tmp_path: Path, engine: Engine
) -> None:
    """A verified id quoted inside another event's content is not that event's id: the frame
    is parsed and checked in full, so a forged signature behind it is refused as `forged` and
    nothing is recorded for the quoted id. Only a frame whose own `id` is the verified one is
    taken as a copy."""
    async with in_process_bridge(
        tmp_path, engine.database("push.db"), [{"url": RELAY, "mode": "firehose"}]
    ) as parts:
        sender, me = SecretKey.generate(), await _alice_on_the_firehose(parts)
        known = sign_event(sender, 4, "verified first", [["p", me]])
        now_ms = time.time_ns() // 1_000_000
        assert parts.bridge.pool.deliver_text(RELAY, frame(known.to_json()), now_ms)

        lookalike = sign_event(sender, 4, f'{{"id":"{known.id}"}}', [["p", me]]).to_json()
        lookalike["sig"] = known.sig  # a signature that was verified, but for another id
        text = json.dumps(
            ["EVENT", "sp0.1", {"content": lookalike["content"],
                                **{k: v for k, v in lookalike.items() if k != "content"}}],
            separators=(",", ":"),
        )
        assert text.index(known.id) < text.index(lookalike["id"]), "the quoted id comes first"
        forged = dropped("forged")
        assert parts.bridge.pool.deliver_text(RELAY, text, now_ms)
        assert dropped("forged") == forged + 1


async def _alice_on_the_firehose(parts: InProcessBridge) -> str:
    """Register alice on one Android phone; her key once the firehose relay matches it."""
    me = SecretKey.generate().public_key_hex
    await parts.devices.register(me, "android", "fcm-alice", "opaque", (), None, 0)
    await poll(lambda: me in parts.bridge._pool.subs[RELAY].keys, what="alice watched")
    return me


async def test_a_copy_is_folded_into_its_still_queued_arrival(
    tmp_path: Path, engine: Engine
) -> None:
    """Copies of an event that still waits for the committer join its arrival (one queue
    place, decided in the same batch, one `seen_events` row); a copy after the committer took
    it is an arrival of its own. Each relay's delivery is recorded once, the event pushed once."""
    relays = [RELAY, "ws://127.0.0.1:10", "ws://127.0.0.1:11"]
    async with in_process_bridge(
        tmp_path, engine.database("push.db"), [{"url": url, "mode": "firehose"} for url in relays]
    ) as parts:
        alice, sender = SecretKey.generate(), SecretKey.generate()
        await parts.devices.register(alice.public_key_hex, "android", "fcm-a", "opaque", (), None, 0)
        await poll(
            lambda: all(alice.public_key_hex in parts.bridge._pool.subs[url].keys for url in relays),
            what="alice watched on every relay",
        )
        pending = parts.bridge.port.flow
        assert isinstance(pending, Pending)
        text = frame(sign_event(sender, 4, "hello", [["p", alice.public_key_hex]]).to_json())
        # no await between the frames: the committer cannot take the arrival meanwhile
        for at, url in enumerate(relays[:2]):
            assert parts.bridge.pool.deliver_text(url, text, 1000 + at)
        batch, _ = pending.take()
        assert len(batch) == 1
        assert batch[0].deliveries() == [(RELAY, 1000), (relays[1], 1001)]
        assert parts.bridge.pool.deliver_text(relays[2], text, 1002)
        late, _ = pending.take()
        assert [a.deliveries() for a in late] == [[(relays[2], 1002)]], "taken: not folded"


async def test_a_repeat_of_a_delivered_id_is_a_duplicate_before_any_parse(
    tmp_path: Path, engine: Engine
) -> None:
    """A relay replaying an event it delivered before (a reconnect's catch-up), once the event
    has left the recently verified: a duplicate from its id alone, the rest of the frame never
    parsed (a body orjson would refuse is taken all the same), and nobody is woken again."""
    async with in_process_bridge(
        tmp_path, engine.database("push.db"), [{"url": RELAY, "mode": "firehose"}]
    ) as parts:
        me = await _alice_on_the_firehose(parts)
        event = sign_event(SecretKey.generate(), 4, "hello", [["p", me]])
        text = frame(event.to_json())
        assert parts.bridge.pool.deliver_text(RELAY, text, time.time_ns() // 1_000_000)

        def recorded() -> bool:
            return any(
                json.loads(line).get("event_id") == event.id
                for path in (tmp_path / "observations").glob("*.jsonl")
                for line in path.read_text().splitlines()
            )

        # the `seen` record is logged once the delivery is remembered
        await poll(recorded, what="the delivery recorded")
        parts.bridge._ingest._recent = RecentlyVerified(1)  # as if replayed long after
        duplicates = REGISTRY.get_sample_value(
            "sigil_push_bridge_events_duplicate_total", {"relay": RELAY}
        ) or 0.0
        assert parts.bridge.pool.deliver_text(RELAY, text[:-1], 0), "taken before any parse"
        assert REGISTRY.get_sample_value(
            "sigil_push_bridge_events_duplicate_total", {"relay": RELAY}
        ) == duplicates + 1
        rows = await parts.db.execute_fetchall(
            "SELECT event_id FROM outbox WHERE event_id = ?", (event.id,)
        )
        assert len(rows) == 1


async def test_the_id_read_off_the_text_stands_in_only_for_that_same_id(
    tmp_path: Path, engine: Engine
) -> None:
    """`text` looks up the id it reads at the head of the frame once and hands what it found
    to the parsed path. A frame whose head names an event already handled (by another relay)
    while its parsed body is another, genuine event (JSON's last duplicate key wins) must be
    decided by its parsed id: the new event is verified and pushed, not recorded as a copy of
    the handled one."""
    second = "ws://127.0.0.1:10"
    relays = [{"url": RELAY, "mode": "firehose"}, {"url": second, "mode": "firehose"}]
    async with in_process_bridge(tmp_path, engine.database("push.db"), relays) as parts:
        alice, sender = SecretKey.generate(), SecretKey.generate()
        me = alice.public_key_hex
        await parts.devices.register(me, "android", "fcm-alice", "opaque", (), None, 0)
        await poll(
            lambda: all(me in parts.bridge._pool.subs[r["url"]].keys for r in relays),
            what="alice watched on both relays",
        )
        handled = sign_event(sender, 4, "first", [["p", me]])
        assert parts.bridge.pool.deliver_text(RELAY, frame(handled.to_json()),
                                              time.time_ns() // 1_000_000)
        await poll(lambda: parts.bridge._seen.known(handled.id), what="the first one handled")
        parts.bridge._ingest._recent = RecentlyVerified(1)  # out of the recently verified

        fresh = sign_event(sender, 4, "second", [["p", me]])
        body = json.dumps(fresh.to_json(), separators=(",", ":"))
        text = f'["EVENT","sp0.1",{{"id":"{handled.id}",{body[1:]}]'
        assert parts.bridge.pool.deliver_text(second, text, time.time_ns() // 1_000_000)

        async def pushed() -> list[Any]:
            return list(await parts.db.execute_fetchall(
                "SELECT event_id FROM outbox ORDER BY event_id"
            ))

        await poll(lambda: parts.bridge._seen.known(fresh.id), what="the second one handled")
        assert sorted(row[0] for row in await pushed()) == sorted([handled.id, fresh.id])
        assert not parts.bridge._seen.delivered_by(handled.id, second)
