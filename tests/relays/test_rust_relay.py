"""rust-nostr's relay as a test peer (testkit/rust_relay.py): that it behaves as the
fixture says (a silent cap of 500 per filter, no NIP-11, its two NIP-42 modes), and that the
bridge reads a relay that asks AUTH for every read, answering with its own key, on both
store engines."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from websockets.asyncio.client import ClientConnection, connect

from sigil_push.nostr.keys import SecretKey
from sigil_push.nostr.nip42 import auth_event
from sigil_push.relays.nip11 import RelayLimits, fetch_limits
from testkit.bridge_harness import eventually, health, new_token, register, wakeups
from testkit.deadlines import scaled
from testkit.fakes.harness import eventually as poll
from testkit.in_process import in_process_bridge
from testkit.nostr_client import gift_wrap, hex_of, kind4_dm, secret_hex_of, user
from testkit.processes import FAST_RECONNECT
from testkit.relay import RelayProcess
from testkit.remote_signer import RemoteSigner
from testkit.rust_relay import FILTER_CAP, RustRelay
from testkit.service import ServiceProcess
from testkit.stores import Engine


async def _answer(ws: ClientConnection, sub_id: str) -> tuple[list[dict[str, Any]], list[Any]]:
    """The events a REQ returned and the frame that ended it (EOSE or CLOSED); other frames
    (AUTH, NOTICE) are collected alongside."""
    events: list[dict[str, Any]] = []
    others: list[Any] = []
    while True:
        frame = json.loads(await asyncio.wait_for(ws.recv(), scaled(20)))
        if frame[0] == "EVENT" and frame[1] == sub_id:
            events.append(frame[2])
        elif frame[0] in ("EOSE", "CLOSED") and frame[1] == sub_id:
            others.append(frame)
            return events, others
        else:
            others.append(frame)


async def test_it_caps_every_filter_at_500_silently_and_publishes_no_limits() -> None:
    """520 stored DMs for one key, asked for with `limit` 1000: 500 come back, newest first,
    then EOSE, and nothing anywhere says so (no NIP-11 document to read a limit from)."""
    alice, bob = user(), user()
    dms = [kind4_dm(bob, alice, f"n{i}", created_at=1_700_000_000 + i) for i in range(520)]
    async with RustRelay() as relay:
        await relay.publish(*dms)
        async with connect(relay.url, proxy=None, max_size=None) as ws:
            await ws.send(json.dumps(["REQ", "s", {"kinds": [4], "#p": [hex_of(alice)],
                                                   "limit": 1000}]))
            events, end = await _answer(ws, "s")
        assert len(events) == FILTER_CAP
        assert end[-1][0] == "EOSE"
        assert min(e["created_at"] for e in events) == 1_700_000_000 + 20
        assert await fetch_limits(relay.url) == RelayLimits()


async def test_auth_for_reads_refuses_until_any_key_authenticates() -> None:
    """READ mode: a REQ gets AUTH and `CLOSED auth-required:`; after AUTH with any key (here
    one that is neither party), the same REQ is served."""
    alice, bob = user(), user()
    dm = kind4_dm(bob, alice, "hello")
    async with RustRelay(auth_reads=True) as relay:
        await relay.publish(dm)
        async with connect(relay.url, proxy=None) as ws:
            await ws.send(json.dumps(["REQ", "a", {"kinds": [4], "#p": [hex_of(alice)]}]))
            events, frames = await _answer(ws, "a")
            assert events == []
            challenge = next(f[1] for f in frames if f[0] == "AUTH")
            assert frames[-1][0] == "CLOSED" and frames[-1][2].startswith("auth-required:")
            stranger = SecretKey.generate()
            await ws.send(json.dumps(["AUTH", auth_event(stranger, relay.url, challenge).to_json()]))
            await ws.send(json.dumps(["REQ", "b", {"kinds": [4], "#p": [hex_of(alice)]}]))
            events, frames = await _answer(ws, "b")
        assert [e["id"] for e in events] == [dm["id"]]


async def test_recipient_only_dms_refuse_another_users_gift_wraps_with_an_error_prefix() -> None:
    """auth_dm mode: authenticated as someone else, a REQ for alice's gift wraps is refused
    with `error:` (not auth-required); authenticated as alice, they are served."""
    alice, bob = user(), user()
    wrap = gift_wrap(bob, alice, "for alice only")
    async with RustRelay(auth_dm=True) as relay:
        await relay.publish(wrap)
        for as_key, served in ((SecretKey.generate(), False),
                               (SecretKey(secret_hex_of(alice)), True)):
            async with connect(relay.url, proxy=None) as ws:
                query = {"kinds": [1059], "#p": [hex_of(alice)]}
                await ws.send(json.dumps(["REQ", "a", query]))
                _, frames = await _answer(ws, "a")
                challenge = next(f[1] for f in frames if f[0] == "AUTH")
                await ws.send(json.dumps(["AUTH", auth_event(as_key, relay.url, challenge).to_json()]))
                await ws.send(json.dumps(["REQ", "b", query]))
                events, frames = await _answer(ws, "b")
            if served:
                assert [e["id"] for e in events] == [wrap["id"]]
            else:
                assert events == []
                assert frames[-1][0] == "CLOSED" and frames[-1][2].startswith("error:")


async def test_the_bridge_reads_a_relay_that_wants_auth_for_every_read(
    tmp_path: Path, engine: Engine
) -> None:
    """The bridge answers the READ-mode challenge with its own key, sends its REQs again and
    reads on: a DM and a gift wrap published after the registration are each queued once."""
    alice, bob = user(), user()
    async with RustRelay(auth_reads=True) as relay, in_process_bridge(
        tmp_path, engine.database("push.db"), relays=[{"url": relay.url}]
    ) as parts:
        me = hex_of(alice)
        await parts.devices.register(me, "android", "fcm-alice", "opaque", (), None, 0)
        await poll(lambda: me in parts.bridge._registry.keys, what="alice watched", timeout=30)
        await poll(lambda: parts.bridge.health()[relay.url]["live"]
                   and parts.bridge.health()[relay.url]["keys"] == 1,
                   what="her REQ past EOSE after AUTH", timeout=30)
        dm, wrap = kind4_dm(bob, alice, "after auth"), gift_wrap(bob, alice, "wrapped")
        await relay.publish(dm, wrap)

        async def queued(event_id: str) -> int:
            rows = await parts.db.execute_fetchall(
                "SELECT COUNT(*) FROM outbox WHERE event_id = ?", (event_id,)
            )
            return int(next(iter(rows))[0])

        for event in (dm, wrap):
            await poll_async(lambda e=event: queued(e["id"]), 1)


async def poll_async(count: Any, wanted: int, timeout: float = 30.0) -> None:
    """Waits until the coroutine function `count` returns `wanted`, then checks it stays."""
    deadline = asyncio.get_running_loop().time() + scaled(timeout)
    while asyncio.get_running_loop().time() < deadline:
        if await count() == wanted:
            await asyncio.sleep(0.5)
            assert await count() == wanted
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"count never reached {wanted}: {await count()}")


@pytest.mark.slow
async def test_a_recipient_only_inbox_refusing_with_error_starts_delegated_auth(
    tmp_path: Path, engine: Engine
) -> None:
    """rust-nostr's recipient-only inbox (`auth_dm`) refuses the bridge's REQ after its own
    AUTH with `CLOSED "error: you cannot request another user's gift wrap"`. That refusal
    gates the relay for its users: alice, who has a signer and lists the inbox, is read
    through delegated AUTH (one signer request for the one challenge, kind 22242 only) and her
    gift wrap wakes her once; bob, without a signer, is not pushed."""
    open_relay = RelayProcess(tmp_path / "open").start()
    started: list[Any] = [open_relay]
    try:
        async with RustRelay(auth_dm=True) as inbox:
            signer = RemoteSigner(open_relay.url).start()
            started.append(signer)
            service = ServiceProcess(tmp_path / "service", [open_relay.url], FAST_RECONNECT,
                                     database=engine.database())
            started.append(service)
            service.start()
            alice, bob, sender = signer.user, user(), user()
            register(service, alice, new_token(), [inbox.url], signer.bunker_uri)
            register(service, bob, new_token(), [inbox.url])

            def alice_reads() -> bool:
                entry = health(service)["relays"].get(inbox.url, {})
                return bool(entry.get("users_authenticated") == 1)

            await eventually(alice_reads, "alice read through delegated AUTH", 60)
            assert health(service)["relays"][inbox.url]["gated"] == "error"
            to_alice, to_bob = gift_wrap(sender, alice, "hi alice"), gift_wrap(sender, bob, "bob")
            await inbox.publish(to_bob, to_alice)
            await eventually(lambda: wakeups(service)[to_alice["id"]] == 1, "alice pushed", 60)
            assert wakeups(service)[to_bob["id"]] == 0
            assert signer.methods().count("sign_event") == 1, "one request for one challenge"
            assert {r.signed_kind for r in signer.requests if r.method == "sign_event"} == {22242}
    finally:
        for part in reversed(started):
            part.stop()
