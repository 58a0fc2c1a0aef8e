"""The canary's write path against relays that ask for NIP-42 AUTH the way khatru does
(an `AUTH` challenge with the refusal, an `OK` for the AUTH event, then the write is accepted),
one that refuses without ever sending a challenge, and a real `nostr-relay` process for the
plain case. The khatru-like relay is a thin protocol layer: nostr-relay (the other tests' AUTH
relay) challenges on connect and never acknowledges AUTH."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed

from sigil_push.nostr.event import Event
from sigil_push.nostr.keys import SecretKey
from sigil_push.nostr.nip59 import gift_wrap
from sigil_push.relays.connection import BridgeKeySigner
from sigil_push.relays.publish import publish
from testkit.loopback_relay import LoopbackRelay
from testkit.relay import RelayProcess

TIMEOUT_SECONDS = 20.0


class LazyAuthRelay(LoopbackRelay):
    """Accepts writes only from `allowed` after AUTH; challenges only when it refuses."""

    def __init__(self, allowed: str, send_challenge: bool = True, junk: str = "") -> None:
        """`junk`: a frame sent before each OK (a relay's garbage)."""
        self.allowed = allowed
        self.send_challenge = send_challenge
        self.junk = junk
        self.stored: list[str] = []
        self.auths = 0

    async def _handle(self, ws: ServerConnection) -> None:
        challenge, authed = "c-" + str(id(ws)), None
        try:
            async for frame in ws:
                message: list[Any] = json.loads(frame)
                if message[0] == "AUTH":
                    self.auths += 1
                    auth = Event.from_json(message[1])
                    auth.verify()
                    ok = auth.kind == 22242 and auth.first_tag("challenge") == challenge
                    authed = auth.pubkey if ok else None
                    await ws.send(json.dumps(["OK", auth.id, ok, "" if ok else "invalid: bad"]))
                elif message[0] == "EVENT":
                    event_id = message[1]["id"]
                    if self.junk:
                        await ws.send(self.junk)
                    if authed == self.allowed:
                        self.stored.append(event_id)
                        await ws.send(json.dumps(["OK", event_id, True, ""]))
                        continue
                    if self.send_challenge:
                        await ws.send(json.dumps(["AUTH", challenge]))
                    await ws.send(
                        json.dumps(["OK", event_id, False, "auth-required: who are you?"])
                    )
        except ConnectionClosed:
            return


def probe() -> Event:
    canary = SecretKey.generate()
    return gift_wrap(canary, canary.public_key_hex, "probe", now=int(time.time()))


async def test_a_lazy_auth_relay_gets_an_answer_and_the_event_again() -> None:
    """Refused with `auth-required` and a challenge: AUTH with the bridge key, wait for its OK,
    send the event again; the relay stores it and the result says accepted."""
    bridge = SecretKey.generate()
    event = probe()
    async with LazyAuthRelay(bridge.public_key_hex) as relay:
        result = await publish(relay.url, event, BridgeKeySigner(bridge), TIMEOUT_SECONDS)
        assert result.accepted and result.reason == "accepted" and result.sent_ms is not None
        assert relay.stored == [event.id] and relay.auths == 1


async def test_a_relay_that_refuses_the_authenticated_key_is_a_rejection() -> None:
    """After one AUTH round, a second refusal is final (no loop), with the relay's text."""
    event = probe()
    async with LazyAuthRelay(SecretKey.generate().public_key_hex) as relay:
        result = await publish(
            relay.url, event, BridgeKeySigner(SecretKey.generate()), TIMEOUT_SECONDS
        )
        assert (result.accepted, result.reason) == (False, "rejected")
        assert result.message == "auth-required: who are you?"
        assert relay.auths == 1 and relay.stored == []


async def test_a_refusal_without_a_challenge_ends_as_auth_required() -> None:
    """Asked to authenticate but never challenged: nothing to sign, so the publish gives up
    at its deadline and says why."""
    bridge = SecretKey.generate()
    async with LazyAuthRelay(bridge.public_key_hex, send_challenge=False) as relay:
        result = await publish(relay.url, probe(), BridgeKeySigner(bridge), 2.0)
        assert (result.accepted, result.reason) == (False, "auth_required")
        assert result.message.startswith("auth-required:")


@pytest.mark.slow
async def test_a_plain_relay_accepts_and_serves_the_gift_wrap(tmp_path: Path) -> None:
    """A real nostr-relay (signatures checked) takes the wrap at once; a down relay is
    `connect`."""
    event = probe()
    with RelayProcess(tmp_path / "relay") as relay:
        result = await publish(relay.url, event, BridgeKeySigner(SecretKey.generate()), 20.0)
        assert result.accepted
    down = await publish(relay.url, event, BridgeKeySigner(SecretKey.generate()), 5.0)
    assert (down.accepted, down.reason) == (False, "connect")


async def test_a_frame_nested_past_the_recursion_limit_is_ignored() -> None:
    """A relay's frame nested deeper than Python's recursion limit (json.loads raises
    RecursionError, not ValueError) is junk like any other: the publish still gets its OK,
    instead of the canary probe failing on it."""
    bridge = SecretKey.generate()
    event = probe()
    nested = "[" * 5000 + "]" * 5000
    async with LazyAuthRelay(bridge.public_key_hex, junk=nested) as relay:
        result = await publish(relay.url, event, BridgeKeySigner(bridge), TIMEOUT_SECONDS)
        assert result.accepted and relay.stored == [event.id]
