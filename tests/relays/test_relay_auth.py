"""NIP-42 as real relays do it, on the shared bridge-key connection, and connection hardening.

The hostile relay here is a websockets server on 127.0.0.1 in the test's loop, talking to a real
`RelayConnection`; the end-to-end test runs `sigil-push serve` against a khatru-style lazy-AUTH
layer over a real `nostr-relay` (testkit/auth_relay.py), once on each engine. The
connection tests open no store.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY
from websockets.asyncio.server import ServerConnection
from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

from sigil_push.nostr.keys import SecretKey
from sigil_push.nostr.nip42 import auth_event
from sigil_push.observations import ObservationLog
from sigil_push.relays import connection as relay_connection
from sigil_push.relays.connection import BridgeKeySigner, RelayConnection
from sigil_push.relays.labels import configure_relays
from testkit.auth_relay import AuthRelay
from testkit.bridge_harness import (
    assert_private,
    eventually,
    health,
    metric,
    new_token,
    register,
    wakeups,
)
from testkit.loopback_relay import LoopbackRelay
from testkit.nostr_client import hex_of, kind4_dm, npub_of, publish, user
from testkit.processes import FAST_RECONNECT
from testkit.service import ServiceProcess
from testkit.stores import Engine


def counter(name: str, relay: str) -> float:
    return REGISTRY.get_sample_value(name, {"relay": relay}) or 0.0


class Recorder:
    """A connection handler that records what the connection reports (the bridge's role)."""

    def __init__(self) -> None:
        self.opened = 0
        self.eosed: list[str] = []
        self.gated = 0

    def on_open(self, connection: RelayConnection) -> None:
        self.opened += 1
        asyncio.get_running_loop().create_task(connection.send(["REQ", "s1", {"kinds": [4]}]))

    def on_authenticated(self, connection: RelayConnection) -> None: ...

    def on_event(self, connection: RelayConnection, sub_id: str, raw: Any, ms: int) -> None: ...

    def on_eose(self, connection: RelayConnection, sub_id: str) -> None:
        self.eosed.append(sub_id)

    def on_closed(self, connection: RelayConnection, sub_id: str) -> None: ...

    def on_down(self, connection: RelayConnection) -> None: ...

    def on_gated(self, connection: RelayConnection) -> None:
        self.gated += 1

    def on_auth_failed(self, connection: RelayConnection) -> None: ...

    def congested(self, connection: RelayConnection) -> bool:
        return False

    async def drained(self, connection: RelayConnection) -> None: ...


class HostileRelay(LoopbackRelay):
    """Advertises a huge max_message_length; on the first REQ sends a deeply nested frame, an
    AUTH storm of distinct challenges, EOSE, and then (if asked) a frame of `big` bytes."""

    def __init__(self, big: int = 0) -> None:
        self.big = big
        self.auth_frames = 0
        self.close_codes: list[int | None] = []

    def _serve_options(self) -> dict[str, Any]:
        def nip11(connection: ServerConnection, request: Request) -> Response | None:
            if request.headers.get("Accept") == "application/nostr+json":
                document = {"limitation": {"max_message_length": 10**12}}
                return Response(200, "OK", Headers(), json.dumps(document).encode())
            return None

        return {"max_size": None, "process_request": nip11}

    async def _handle(self, ws: ServerConnection) -> None:
        try:
            async for text in ws:
                message = json.loads(text)
                if message[0] == "AUTH":
                    self.auth_frames += 1
                elif message[0] == "REQ":
                    await ws.send("[" * 200_000 + "]" * 200_000)
                    for number in range(50):
                        await ws.send(json.dumps(["AUTH", f"challenge-{number}"]))
                    await ws.send(json.dumps(["EOSE", message[1]]))
                    if self.big:
                        await ws.send(json.dumps(["NOTICE", "x" * self.big]))
        except ConnectionClosed:
            pass
        self.close_codes.append(ws.close_code)


@pytest.fixture
def observations(tmp_path: Path) -> Iterator[ObservationLog]:
    yield ObservationLog(tmp_path / "obs")


async def test_nested_json_and_an_auth_storm_are_survived_and_bounded(
    observations: ObservationLog,
) -> None:
    async with HostileRelay() as relay:
        handler = Recorder()
        configure_relays([relay.url])  # a configured relay: series of its own
        connection = RelayConnection(
            relay.url, handler, BridgeKeySigner(SecretKey.generate()), observations
        )
        malformed_before = counter("sigil_push_relay_malformed_frames_total", relay.url)
        connection.start()
        try:
            for _ in range(400):
                if handler.eosed and relay.auth_frames >= 1:
                    break
                await asyncio.sleep(0.05)
            assert handler.eosed == ["s1"], "the read loop survived the nested frame"
            assert connection.connected
            assert counter("sigil_push_relay_malformed_frames_total", relay.url) == (
                malformed_before + 1
            )
            answered = relay.auth_frames
            assert 1 <= answered <= relay_connection.AUTH_ANSWERS_PER_WINDOW
            assert counter("sigil_push_relay_auth_throttled_total", relay.url) == 50 - answered
        finally:
            await connection.stop()


async def test_the_relays_nip11_never_raises_our_frame_limit(
    observations: ObservationLog,
) -> None:
    """The relay advertises 10^12 bytes; a frame above our own limit still closes with 1009."""
    async with HostileRelay(big=2 * 1024 * 1024) as relay:
        handler = Recorder()
        connection = RelayConnection(
            relay.url,
            handler,
            BridgeKeySigner(SecretKey.generate()),
            observations,
            max_frame_bytes=1024 * 1024,
        )
        connection.start()
        try:
            for _ in range(400):
                if relay.close_codes:
                    break
                await asyncio.sleep(0.05)
            assert relay.close_codes and relay.close_codes[0] == 1009
            assert connection.limits is not None
            assert connection.limits.max_message_length == 10**12
        finally:
            await connection.stop()


async def test_per_relay_series_are_dropped_when_the_relay_leaves(
    observations: ObservationLog,
) -> None:
    async with HostileRelay() as relay:
        configure_relays([relay.url])  # a configured relay: series of its own
        connection = RelayConnection(
            relay.url, Recorder(), BridgeKeySigner(SecretKey.generate()), observations
        )
        connection.start()
        for _ in range(400):
            if connection.connected:
                break
            await asyncio.sleep(0.05)
        assert REGISTRY.get_sample_value("sigil_push_relay_connected_bool", {"relay": relay.url})
        await connection.stop()
    for name in ("sigil_push_relay_connected_bool", "sigil_push_relay_auth_answers_total"):
        assert REGISTRY.get_sample_value(name, {"relay": relay.url}) is None


@pytest.fixture
def lazy_relay(tmp_path: Path) -> Iterator[AuthRelay]:
    relay = AuthRelay(tmp_path / "lazy", "lazy", late_closed=True, any_key_reads=True).start()
    yield relay
    relay.stop()


@pytest.mark.slow
async def test_a_lazy_auth_relay_is_read_after_auth_and_its_late_closed_is_not_a_refusal(
    lazy_relay: AuthRelay, tmp_path: Path, engine: Engine
) -> None:
    """khatru-style: no challenge until a DM REQ is refused (AUTH, and the CLOSED of that REQ
    only after our AUTH went out). The bridge authenticates, sends the REQ again, reads, and
    does not count the late CLOSED as the relay refusing it."""
    with ServiceProcess(
        tmp_path / "service", [], FAST_RECONNECT, database=engine.database()
    ) as service:
        alice, sender = user(), user()
        register(service, alice, new_token(), [lazy_relay.url])
        await eventually(
            lambda: health(service)["relays"].get(lazy_relay.url, {}).get("live") is True,
            "REQ sent again after AUTH and past EOSE",
            45,
        )
        assert len(lazy_relay.authenticated) == 1, "the bridge authenticated once"
        assert lazy_relay.refused_reqs >= 1 and lazy_relay.served_reqs >= 1
        dm = kind4_dm(sender, alice, "read after lazy AUTH")
        await publish(lazy_relay.upstream.url, dm)
        await eventually(lambda: wakeups(service)[dm["id"]] == 1, "the DM woke alice")

        report = health(service)["relays"][lazy_relay.url]
        assert report["gated"] is None
        assert metric(service, "sigil_push_relay_gated_bool", relay="user") == 0  # a user relay
        assert metric(service, "sigil_push_relay_pre_auth_refusals_total", relay="user") >= 1
        states = [
            r["state"]
            for r in service.observation_records()
            if r["type"] == "relay" and r["relay"] == lazy_relay.url
        ]
        assert "auth_required" not in states
    assert_private(service, [hex_of(alice), npub_of(alice)])


class NeverChallenges(LoopbackRelay):
    """Refuses every REQ with CLOSED auth-required and never sends a challenge."""

    async def _handle(self, ws: ServerConnection) -> None:
        with contextlib.suppress(ConnectionClosed):
            async for text in ws:
                message = json.loads(text)
                if message[0] == "REQ":
                    await ws.send(json.dumps(["CLOSED", message[1], "auth-required: no"]))


async def _until_gated(connection: RelayConnection) -> None:
    """Until `connection` says why it is gated, or 20 s (the assertions after it then fail)."""
    for _ in range(400):
        if connection.gated_reason:
            break
        await asyncio.sleep(0.05)


async def test_a_relay_that_refuses_and_never_challenges_is_gated(
    observations: ObservationLog, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(relay_connection, "AUTH_WAIT_SECONDS", 0.5)
    async with NeverChallenges() as relay:
        handler = Recorder()
        connection = RelayConnection(
            relay.url, handler, BridgeKeySigner(SecretKey.generate()), observations
        )
        connection.start()
        try:
            await _until_gated(connection)
            assert connection.gated_reason == "auth-required"
            assert handler.gated == 1
        finally:
            await connection.stop()


class OneKeyPerConnection(LoopbackRelay):
    """Challenges on connect; the first AUTH gets OK true, every later one OK false (strfry)."""

    async def _handle(self, ws: ServerConnection) -> None:
        authenticated = False
        with contextlib.suppress(ConnectionClosed):
            await ws.send(json.dumps(["AUTH", "challenge-1"]))
            async for text in ws:
                message = json.loads(text)
                if message[0] == "AUTH":
                    ok = not authenticated
                    authenticated = True
                    reason = "" if ok else "error: already authenticated"
                    await ws.send(json.dumps(["OK", message[1]["id"], ok, reason]))


class TwoIdentities(Recorder):
    """An AuthResponder answering one challenge with two AUTH events (two keys), recording the
    relay's OK for each, as a connection shared by two users does."""

    def __init__(self) -> None:
        super().__init__()
        self.keys = [SecretKey.generate(), SecretKey.generate()]
        self.sent: dict[str, int] = {}
        self.results: dict[int, tuple[bool, str]] = {}

    async def answer_challenge(self, connection: RelayConnection, challenge: str) -> None:
        for number, key in enumerate(self.keys):
            event = auth_event(key, connection.url, challenge)
            self.sent[event.id] = number
            assert await connection.send_auth(event, connection.socket_generation)

    def on_auth_result(
        self, connection: RelayConnection, event_id: str, accepted: bool, reason: str
    ) -> None:
        self.results[self.sent[event_id]] = (accepted, reason)


async def test_an_auth_responder_hears_the_relays_answer_to_each_key(
    observations: ObservationLog,
) -> None:
    """A connection answered by an AuthResponder sends one AUTH per identity and reports the
    relay's OK for each (only the prefix of the reason): how a one-key relay is recognised."""
    async with OneKeyPerConnection() as relay:
        responder = TwoIdentities()
        connection = RelayConnection(
            relay.url, responder, responder, observations, per_user=True
        )
        connection.start()
        try:
            for _ in range(400):
                if len(responder.results) == 2:
                    break
                await asyncio.sleep(0.05)
            assert responder.results == {0: (True, ""), 1: (False, "error")}
            assert connection.auth_epoch == 2
        finally:
            await connection.stop()


class RefusesInPlainWords(LoopbackRelay):
    """Challenges on connect. Before AUTH it closes a REQ with `error:`; after AUTH it
    refuses with a NOTICE that names the subscription and has no machine-readable prefix."""

    async def _handle(self, ws: ServerConnection) -> None:
        authed = False
        await ws.send(json.dumps(["AUTH", "c1"]))
        with contextlib.suppress(ConnectionClosed):
            async for text in ws:
                message = json.loads(text)
                if message[0] == "AUTH":
                    authed = True
                elif message[0] == "REQ" and not authed:
                    await ws.send(json.dumps(["CLOSED", message[1], "error: not yet"]))
                elif message[0] == "REQ":
                    await ws.send(json.dumps(["NOTICE", f"could not serve {message[1]} to you"]))


class ReqAfterAuth(Recorder):
    def __init__(self) -> None:
        super().__init__()
        self.closed: list[str] = []

    def on_authenticated(self, connection: RelayConnection) -> None:
        asyncio.get_running_loop().create_task(connection.send(["REQ", "s2", {"kinds": [4]}]))

    def on_closed(self, connection: RelayConnection, sub_id: str) -> None:
        self.closed.append(sub_id)


async def test_an_error_closed_before_auth_is_no_gate_but_a_notice_naming_a_req_after_it_is(
    observations: ObservationLog,
) -> None:
    """Issue 24: refusals after AUTH come in other words than `auth-required:`/`restricted:`
    (rust-nostr's inbox says `error:`; some relays answer with a NOTICE quoting the
    subscription). Before AUTH an `error:` CLOSED gates nothing; after AUTH a NOTICE naming the
    REQ is that REQ's refusal: the relay is gated (delegated AUTH then reads its users)."""
    async with RefusesInPlainWords() as relay:
        handler = ReqAfterAuth()
        connection = RelayConnection(
            relay.url, handler, BridgeKeySigner(SecretKey.generate()), observations
        )
        connection.start()
        try:
            await _until_gated(connection)
            assert connection.gated_reason == "notice"
            assert handler.closed == ["s1", "s2"], "both REQs reported closed, s1 not as a gate"
            assert handler.gated == 1
        finally:
            await connection.stop()
