"""Iris subscriptions at the bridge's head (ingest and committer, in process, each engine):
an event that matches no watch never pays for a signature check, one that may match does,
a match becomes one outbox row per target device however many of the subscriber's filters
and relays it comes through, and a subscription written to the store reaches the bridge's
watches through the store's listeners."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from prometheus_client import REGISTRY

from sigil_push.bridge.iris_watches import IrisWatches
from sigil_push.nostr.event import compute_id, sign_event
from sigil_push.nostr.keys import SecretKey
from sigil_push.store.interface import IrisTarget
from testkit.fakes.harness import eventually as poll
from testkit.in_process import in_process_bridge
from testkit.stores import Engine

RELAY = "ws://127.0.0.1:9"  # nothing listens: frames are fed to the bridge directly
SECOND = "ws://127.0.0.1:10"


def dropped(reason: str, relay: str = RELAY) -> float:
    return REGISTRY.get_sample_value(
        "sigil_push_bridge_events_dropped_total", {"relay": relay, "reason": reason}
    ) or 0.0


def invalid(reason: str) -> float:
    """Invalid events are drops with their own reasons (`forged`, `wrong_id`, ...)."""
    return dropped(reason)


def stored_lists() -> float:
    return REGISTRY.get_sample_value(
        "sigil_push_bridge_user_lists_total", {"outcome": "stored"}
    ) or 0.0


def frame(event: dict[str, Any]) -> str:
    return json.dumps(["EVENT", "iw0.1", event], separators=(",", ":"))


def forged(event: dict[str, Any]) -> dict[str, Any]:
    """The same event with other content, its id recomputed: only the signature is wrong."""
    copy = {**event, "content": event["content"] + "!"}
    tags = tuple(tuple(tag) for tag in copy["tags"])
    copy["id"] = compute_id(copy["pubkey"], copy["created_at"], copy["kind"], tags,
                            copy["content"])
    return copy


async def test_only_events_a_watch_may_match_are_verified_and_each_target_wakes_once(
    tmp_path: Path, engine: Engine
) -> None:
    relays = [{"url": RELAY, "mode": "firehose"}, {"url": SECOND}]
    async with in_process_bridge(tmp_path, engine.database("push.db"), relays) as parts:
        owner, session, stranger = (SecretKey.generate() for _ in range(3))
        me = owner.public_key_hex
        document = {
            "filter": {"#p": [me], "kinds": [1, 7]},
            "filters": [{"kinds": [1060], "authors": [session.public_key_hex]},
                        {"kinds": [1], "authors": [stranger.public_key_hex]}],
        }
        target = IrisTarget("android", "fcm-iris-target", None, None)
        await parts.store.iris.put("sub-1", me, json.dumps(document), [target], 20)
        # a second subscription on the same target
        await parts.store.iris.put(
            "sub-2", me, json.dumps({"filter": {"#p": [me], "kinds": [1]}}), [target], 20
        )
        watches: IrisWatches = parts.bridge._iris
        await poll(lambda: watches.index.has_owner(me) and len(watches.index.p_keys()) == 1
                   and parts.bridge.pool.watch_plan.authors.keys() >= {session.public_key_hex},
                   what="the subscriptions watched")
        # its own mute list (no follows-only subscription: not its kind 3)
        assert parts.bridge.pool.watch_plan.lists == {me: False} and me not in parts.bridge.pool.watch_plan.authors
        # ... which a firehose relay delivers unasked, and which are kept for the Iris rules
        lists_before = stored_lists()
        mute_list = sign_event(owner, 10000, "", [["p", "dd" * 32]]).to_json()
        assert parts.bridge.pool.deliver_text(RELAY, frame(mute_list), 0)
        await poll(lambda: stored_lists() == lists_before + 1, what="the mute list stored")

        nobody = sign_event(stranger, 1, "hi", [["p", "ee" * 32]]).to_json()
        odd = sign_event(stranger, 30078, "app data", []).to_json()
        before = dropped("unaddressed"), dropped("wrong_kind", SECOND), dropped(
            "unaddressed", SECOND
        )
        forged_before = invalid("forged")
        # naming nobody, of a kind nobody watches: dropped unverified, never counted forged
        # (the firehose before any parse of its fields, the filtered relay after)
        assert parts.bridge.pool.deliver_text(RELAY, frame(forged(odd)), 0)
        parts.bridge.pool.deliver(SECOND, "iw0.1", forged(odd), 0)
        reaction = forged({**nobody, "kind": 7})
        assert parts.bridge.pool.deliver_text(RELAY, frame(reaction), 0)
        parts.bridge.pool.deliver(SECOND, "iw0.1", reaction, 0)
        assert dropped("unaddressed") == before[0] + 2
        assert dropped("wrong_kind", SECOND) == before[1] + 1
        assert dropped("unaddressed", SECOND) == before[2] + 1
        assert invalid("forged") == forged_before
        # one that a watch may match pays for its check, and a forgery is caught
        message = sign_event(session, 1060, "ciphertext", [["p", "ee" * 32]]).to_json()
        assert parts.bridge.pool.deliver_text(RELAY, frame(forged(message)), 0)
        assert invalid("forged") == forged_before + 1

        now_ms = time.time_ns() // 1_000_000
        mention = sign_event(stranger, 1, "hello", [["p", me]]).to_json()  # three filters
        for event in (message, mention):
            assert parts.bridge.pool.deliver_text(RELAY, frame(event), now_ms)
            parts.bridge.pool.deliver(SECOND, "iw0.1", event, now_ms)

        async def rows() -> list[tuple[str, str]]:
            found = await parts.db.execute_fetchall(
                "SELECT d.token, o.event_id FROM outbox o JOIN devices d ON d.id = o.device_id"
                " ORDER BY o.event_id"
            )
            return [(str(token), str(event_id)) for token, event_id in found]

        expected = sorted([("fcm-iris-target", message["id"]), ("fcm-iris-target", mention["id"])],
                          key=lambda row: row[1])

        async def settled() -> bool:
            return await rows() == expected

        await poll(settled, what="one outbox row per (event, target device)")
        assert await rows() == expected

        # deleting the subscriptions stops the watching: nothing more is verified for them
        assert await parts.store.iris.delete("sub-1", me)
        assert await parts.store.iris.delete("sub-2", me)
        await poll(lambda: not watches.active, what="no watch left")
        assert not parts.bridge.pool.watch_plan
        late = sign_event(session, 1060, "later", []).to_json()
        forged_now = invalid("forged")
        assert parts.bridge.pool.deliver_text(RELAY, frame(forged(late)), 0)
        assert invalid("forged") == forged_now
