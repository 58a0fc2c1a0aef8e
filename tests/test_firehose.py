"""Firehose relays end to end: a real `nostr-relay` process, a real `sigil-push serve` process,
and between them a thin proxy that passes every frame through and keeps what the bridge sent,
so the assertions are on what the relay received.

A firehose relay gets one REQ for every kind 4/1059 (no `#p`, no key anywhere); the bridge
matches recipients locally, wakes registered keys and drops the rest as `unaddressed` before
verifying them. In mode `auto` a relay switches at `bridge.firehose_above_keys`.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from websockets.asyncio.client import connect
from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed

from tests.support.bridge_harness import (
    assert_private,
    eventually,
    health,
    metric,
    new_token,
    register,
    unregister,
    wakeups,
)
from tests.support.loopback_relay import LoopbackRelay
from tests.support.nostr_client import gift_wrap, hex_of, kind4_dm, npub_of, publish, user
from tests.support.relay import RelayProcess
from tests.support.service import ServiceProcess


class RecordingProxy(LoopbackRelay):
    """Forwards each client connection to `upstream`, frame by frame, both ways, and keeps
    every message the client sent (decoded)."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.sent: list[list[Any]] = []

    def _serve_options(self) -> dict[str, Any]:
        return {"max_size": None}

    async def _handle(self, ws: ServerConnection) -> None:
        async with connect(self.upstream, proxy=None, max_size=None) as upstream:

            async def downstream() -> None:
                async for frame in upstream:
                    await ws.send(frame)

            relaying = asyncio.create_task(downstream())
            try:
                async for frame in ws:
                    self.sent.append(json.loads(frame))
                    await upstream.send(frame)
            except ConnectionClosed:
                pass
            finally:
                relaying.cancel()

    def requests(self) -> list[list[Any]]:
        return [message for message in self.sent if message[0] == "REQ"]


def _service(folder: Path, relay_url: str, mode: str, bridge: str = "") -> ServiceProcess:
    toml = (
        "[bridge]\nreconnect_min_seconds = 0.2\nreconnect_max_seconds = 1.0\n"
        f"{bridge}\n[[relay]]\nurl = \"{relay_url}\"\nmode = \"{mode}\"\n"
    )
    return ServiceProcess(folder, [], toml).start()


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
        service = _service(tmp_path / "service", proxy.url, "firehose")
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
            assert len(requests) == 1, "one subscription whatever the number of keys"
            for request in requests:
                for query in request[2:]:
                    assert "#p" not in query and "authors" not in query, query
                    assert set(query["kinds"]) & {4, 1059} or set(query["kinds"]) == {10050, 10002}
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
    start_relay: Callable[..., RelayProcess], tmp_path: Path
) -> None:
    """A DM stored before its recipient registered comes back in the catch-up after a restart
    (the firehose asks for everything since the cursor) and is not pushed; one sent while the
    service was down is pushed once."""
    relay = start_relay("relay")
    async with RecordingProxy(relay.url) as proxy:
        folder = tmp_path / "service"
        service = _service(folder, proxy.url, "firehose")
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
        service = _service(tmp_path / "service", proxy.url, "auto", "firehose_above_keys = 2")
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
