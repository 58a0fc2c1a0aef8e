"""Hostile NIP-46 bunker relays (issue 9, item 3): never answers, answers garbage, answers for
another key; links are capped, compacted and closed when unused. The bunker relay is a real
websocket server on 127.0.0.1 that records every frame the bridge sends it."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from contextlib import AsyncExitStack
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import nostr_sdk
import pytest
from prometheus_client import REGISTRY
from websockets.asyncio.server import ServerConnection

from sigil_push.nostr.keys import SecretKey
from sigil_push.nostr.nip46 import (
    BunkerUri,
    Response,
    SignerError,
    get_public_key_request,
    signed_auth_event,
)
from sigil_push.relays.budget import INVALID_BURST
from sigil_push.relays.delegated_auth import DelegatedAuth
from sigil_push.relays.signer_link import (
    BASE_FRAMES,
    FRAME_OUTCOMES,
    FRAMES_PER_KEY,
    FRAMES_PER_REQUEST,
    SignerLinks,
    SignerRelayLink,
    SignerUnreachable,
)
from sigil_push.store.factory import PostgresStore, SqliteStore
from testkit.bridge_harness import metric
from testkit.deadlines import REQUEST_SECONDS, scaled
from testkit.nip98 import SdkUser
from testkit.relay import RelayProcess
from testkit.remote_signer import RemoteSigner
from testkit.service import ServiceProcess
from tests.adversarial.flooding_bunker import FloodingBunker
from tests.adversarial.hostile import HostileRelay, eventually, hostile_relay
from tests.conftest import ApiCaller


def frames_counted(outcome: str) -> float:
    return REGISTRY.get_sample_value("sigil_push_signer_link_frames_total", {"outcome": outcome}) or 0.0


async def test_bunker_that_never_answers_is_bounded() -> None:
    async with hostile_relay() as relay:
        link = SignerRelayLink(relay.url)
        client = SecretKey.generate()
        request_id, message = get_public_key_request(client, SecretKey.generate().public_key_hex)
        with pytest.raises(SignerUnreachable):
            await link.request(client, request_id, message, timeout=0.5)
        assert link.idle is False  # the key stays subscribed until its session goes
        await link.forget(client.public_key_hex)
        assert link.idle
        await link.close()


async def test_garbage_frames_are_counted_and_survived() -> None:
    async def spew(relay: HostileRelay, ws: ServerConnection, frame: Any) -> None:
        if frame[0] == "EVENT":
            for junk in ('{"not": "a list"}', '["EVENT","s",{"id":"zz"}]', "[" * 5000 + "]" * 5000,
                         '["EVENT","s",{"kind":24133}]', "not json"):
                await ws.send(junk)

    garbage_before = frames_counted("garbage")
    async with hostile_relay(spew) as relay:
        link = SignerRelayLink(relay.url)
        client = SecretKey.generate()
        request_id, message = get_public_key_request(client, SecretKey.generate().public_key_hex)
        with pytest.raises(SignerUnreachable):
            await link.request(client, request_id, message, timeout=1.0)
        assert frames_counted("garbage") >= garbage_before + 3
        # the link still works after the garbage: a second request is sent on the same socket
        request_id, message = get_public_key_request(client, SecretKey.generate().public_key_hex)
        with pytest.raises(SignerUnreachable):
            await link.request(client, request_id, message, timeout=0.3)
        assert relay.connections == 1 and len(relay.sent("EVENT")) == 2
        await link.close()


async def test_answer_from_another_key_is_not_taken() -> None:
    """Whoever learns a request id and signs an answer with another key than the bunker's
    cannot answer for the bunker."""
    impostor = nostr_sdk.Keys.generate()
    signer = SecretKey.generate()
    client = SecretKey.generate()
    request_id, message = get_public_key_request(client, signer.public_key_hex)

    async def impersonate(relay: HostileRelay, ws: ServerConnection, frame: Any) -> None:
        if frame[0] != "EVENT":
            return
        requester = nostr_sdk.PublicKey.parse(client.public_key_hex)
        content = nostr_sdk.nip44_encrypt(
            impostor.secret_key(), requester, json.dumps({"id": request_id, "result": "ab" * 32}),
            nostr_sdk.Nip44Version.V2,
        )
        answer = (
            nostr_sdk.EventBuilder(nostr_sdk.Kind(24133), content)
            .tags([nostr_sdk.Tag.public_key(requester)]).finalize(impostor)
        )
        await ws.send(json.dumps(["EVENT", "nip46-0", json.loads(answer.as_json())]))

    foreign_before = frames_counted("foreign")
    async with hostile_relay(impersonate) as relay:
        link = SignerRelayLink(relay.url)
        with pytest.raises(SignerUnreachable):
            await link.request(client, request_id, message, timeout=1.5)
        assert frames_counted("foreign") == foreign_before + 1
        await link.close()


async def test_subscriptions_shrink_and_close_as_keys_leave_and_idle_links_close() -> None:
    async with hostile_relay() as relay:
        links = SignerLinks()
        signer = SecretKey.generate().public_key_hex
        clients = [SecretKey.generate() for _ in range(3)]
        for client in clients:
            link = await links.get(relay.url)
            request_id, message = get_public_key_request(client, signer)
            with pytest.raises(SignerUnreachable):
                await link.request(client, request_id, message, timeout=0.1)
        reqs = relay.sent("REQ")
        assert reqs[-1][2]["#p"] == [c.public_key_hex for c in clients]

        await links.release(relay.url, clients[0].public_key_hex)
        await eventually(lambda: relay.sent("REQ")[-1][2]["#p"] == [c.public_key_hex for c in clients[1:]],
                         "the chunk's filter shrinks at once")
        await links.release(relay.url, clients[1].public_key_hex)
        await links.release(relay.url, clients[2].public_key_hex)
        await eventually(lambda: relay.sent("CLOSE") == [["CLOSE", "nip46-0"]], "the empty chunk is CLOSEd")
        await eventually(lambda: relay.open_now == 0, "the unused link is closed")
        assert len(links) == 0
        await links.close()


async def test_links_are_capped_in_total() -> None:
    async with hostile_relay() as first, hostile_relay() as second, hostile_relay() as third:
        links = SignerLinks(max_links=2)
        busy = SecretKey.generate()
        for relay in (first, second):
            link = await links.get(relay.url)
            request_id, message = get_public_key_request(busy, SecretKey.generate().public_key_hex)
            with pytest.raises(SignerUnreachable):
                await link.request(busy, request_id, message, timeout=0.1)
        with pytest.raises(SignerUnreachable):
            await links.get(third.url)
        # once a link is unused it makes room
        await links.release(first.url, busy.public_key_hex)
        assert (await links.get(third.url)).url == third.url
        await links.close()


def _asked(relay: HostileRelay) -> Callable[[], bool]:
    return lambda: bool(relay.sent("EVENT"))


async def test_a_user_cycling_bunker_relays_leaves_no_sockets_behind(
    store: SqliteStore | PostgresStore,
) -> None:
    """One npub re-registers its auth_signer over and over, each time naming five fresh (silent)
    bunker relays: the previous session's links close, so the server holds at most five. The
    sessions are kept in the store of each engine."""
    delegated = DelegatedAuth(
        store.signer_sessions, store.auth_modes, SecretKey.generate(), store.devices
    )
    await delegated.start()
    user = SecretKey.generate().public_key_hex
    signer = SecretKey.generate().public_key_hex
    try:
        async with AsyncExitStack() as stack:
            relays = [await stack.enter_async_context(hostile_relay()) for _ in range(15)]
            for round_ in range(3):
                batch = relays[round_ * 5:(round_ + 1) * 5]
                query = "&".join(f"relay={r.url}" for r in batch)
                await delegated.set_signer(user, BunkerUri.parse(f"bunker://{signer}?{query}", True))
                await eventually(_asked(batch[0]), "connect request sent to the new bunker relays")
            await delegated.remove(user)
            await eventually(lambda: sum(r.open_now for r in relays) == 0, "every bunker socket closed")
            assert len(delegated._links) == 0
    finally:
        await delegated.stop()


def test_a_signed_event_nested_past_the_recursion_limit_is_a_signer_error() -> None:
    """A bunker's `sign_event` result is JSON inside the answer's JSON, parsed again: nested
    deeper than Python's recursion limit it raised RecursionError, which ended the per-user
    connection's AUTH task with an exception nobody handles (the user neither reading nor
    counted as failed) instead of counting the signer as refusing."""
    with pytest.raises(SignerError):
        signed_auth_event("[" * 5000, "ab" * 32, "wss://relay.example", "challenge")


async def test_links_that_never_connect_are_dropped_and_one_npub_is_capped() -> None:
    """Throwaway registrations naming unreachable bunker relays once used up every link: a link
    that never connected kept its sessions' keys, so it was never idle. A failed link now
    leaves the table at once; and one npub opens at most its own share of links."""
    async with hostile_relay() as reachable:
        links = SignerLinks(max_links=2, max_per_npub=2)
        for port in (1, 9):  # closed loopback ports: connection refused
            url = f"ws://127.0.0.1:{port}"
            client = SecretKey.generate()
            link = await links.get(url, f"throwaway-{port}")
            request_id, message = get_public_key_request(client, SecretKey.generate().public_key_hex)
            with pytest.raises(SignerUnreachable):
                await link.request(client, request_id, message, timeout=5)
        assert len(links) == 0
        assert (await links.get(reachable.url, "real")).url == reachable.url
        await links.get("ws://127.0.0.1:2", "real")
        with pytest.raises(SignerUnreachable):
            await links.get("ws://127.0.0.1:3", "real")
        await links.close()


def _outcomes() -> dict[str, float]:
    return {outcome: frames_counted(outcome) for outcome in FRAME_OUTCOMES}


def _links(outcome: str) -> float:
    return REGISTRY.get_sample_value("sigil_push_signer_links_total", {"outcome": outcome}) or 0.0


async def _honest_answer(relay: HostileRelay, ws: ServerConnection, frame: Any, signer: nostr_sdk.Keys) -> None:
    """A bunker relay with its signer behind it: answers each request on the subscription."""
    if frame[0] != "EVENT":
        return
    requester = nostr_sdk.PublicKey.parse(frame[1]["pubkey"])
    request = json.loads(nostr_sdk.nip44_decrypt(signer.secret_key(), requester, frame[1]["content"]))
    content = nostr_sdk.nip44_encrypt(
        signer.secret_key(), requester, json.dumps({"id": request["id"], "result": "ack"}),
        nostr_sdk.Nip44Version.V2,
    )
    answer = (nostr_sdk.EventBuilder(nostr_sdk.Kind(24133), content)
              .tags([nostr_sdk.Tag.public_key(requester)]).finalize(signer))
    await ws.send(json.dumps(["EVENT", "nip46-0", json.loads(answer.as_json())]))


async def test_a_bunker_relay_streaming_unasked_answers_is_dropped_after_bounded_work() -> None:
    """Issue 34, item 4: a bunker relay answered one request with a stream of replayed valid
    frames and forgeries; every one was verified (95% of a core) and the link stayed. Now a
    frame is matched (subscription, `p`, a signer we wait on, an id not seen) before its
    signature is checked, and the link is closed once it has sent far more than was asked:
    the work done is bounded by the frame budget whatever the relay sends, the request fails
    at once (not at its timeout), the link is not reopened during its backoff, and another
    user's signer on another relay is answered meanwhile."""
    flooding = FloodingBunker(nostr_sdk.Keys.generate()).start()
    honest_signer = nostr_sdk.Keys.generate()
    try:
        async with hostile_relay(partial(_honest_answer, signer=honest_signer)) as honest:
            flooded, other = SignerRelayLink(flooding.url), SignerRelayLink(honest.url)
            before, dropped = _outcomes(), _links("dropped_flood")
            victim, bystander = SecretKey.generate(), SecretKey.generate()
            flood_request = get_public_key_request(victim, flooding.signer_hex)
            honest_request = get_public_key_request(bystander, honest_signer.public_key().to_hex())
            flood_result, honest_result = await asyncio.gather(
                flooded.request(victim, *flood_request, timeout=30),
                other.request(bystander, *honest_request, timeout=30),
                return_exceptions=True,
            )
            assert isinstance(flood_result, SignerUnreachable), flood_result
            assert "far more" in str(flood_result)
            assert isinstance(honest_result, Response) and honest_result.result == "ack"
            processed = {k: v - before[k] for k, v in _outcomes().items()}
            # one request and one key's worth of frames, a refill's few more: the bunker had
            # tens of thousands queued behind them
            budget = BASE_FRAMES + FRAMES_PER_REQUEST + FRAMES_PER_KEY
            assert sum(processed.values()) <= budget + 20, processed
            assert processed["replayed"] > 0 and processed["forged"] > 0, processed
            assert processed["answer"] == 1  # the bystander's
            assert _links("dropped_flood") == dropped + 1
            await eventually(lambda: flooding.open_now == 0, "the flooding socket closed")
            assert flooding.closed_by_peer == 1
            with pytest.raises(SignerUnreachable, match="backing off"):
                await flooded.request(victim, *get_public_key_request(victim, flooding.signer_hex), timeout=5)
            assert flooding.connections == 1
            await flooded.close()
            await other.close()
    finally:
        flooding.stop()


async def test_forgeries_on_a_busy_link_spend_the_invalid_event_budget() -> None:
    """A link carrying many keys has frame credit to match; forgeries that pass the cheap
    checks are verified, and each failed one spends the relay readers' invalid-event budget:
    the link is dropped after INVALID_BURST of them, not after the relay's last."""
    keys = 30
    flooding = FloodingBunker(nostr_sdk.Keys.generate(), replays=0, quiet_requests=keys - 1).start()
    try:
        link = SignerRelayLink(flooding.url)
        clients = [SecretKey.generate() for _ in range(keys)]
        for client in clients[:-1]:
            with pytest.raises(SignerUnreachable):
                await link.request(client, *get_public_key_request(client, flooding.signer_hex), timeout=0.05)
        before, dropped = _outcomes(), _links("dropped_invalid")
        with pytest.raises(SignerUnreachable, match="invalid events"):
            await link.request(clients[-1], *get_public_key_request(clients[-1], flooding.signer_hex), timeout=30)
        forged = frames_counted("forged") - before["forged"]
        assert INVALID_BURST <= forged <= INVALID_BURST + 20
        assert _links("dropped_invalid") == dropped + 1
        await link.close()
    finally:
        flooding.stop()


def _registration(api: ApiCaller, user: SdkUser, wanted: str) -> dict[str, Any]:
    """The owner's view once its signer status is `wanted` (one request a second: the same
    NIP-98 event within a second is a replay)."""
    deadline = time.monotonic() + scaled(60)
    devices: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        time.sleep(1.05)
        devices = api.call("GET", "/registrations", user).json()["devices"]
        if devices and devices[0]["auth_signer_status"] == wanted:
            return devices[0]
    raise AssertionError(f"signer status never became {wanted}: {devices}")


@pytest.mark.slow
def test_a_flooding_bunker_relay_costs_the_service_bounded_work(
    tmp_path: Path, module_relay: RelayProcess
) -> None:
    """Against `sigil-push serve`: one npub names a bunker relay that floods (replays and
    forgeries, 60,000 frames queued), another a well-behaved signer. The service drops the
    flooding link after its frame budget, its owner sees the session `unreachable` with the
    reason, and the other user's session becomes active; the frames the service handled
    stay within one request's and one key's budget."""
    flooding = FloodingBunker(nostr_sdk.Keys.generate()).start()
    honest = RemoteSigner(module_relay.url).start()
    try:
        with ServiceProcess(tmp_path / "svc") as service, httpx.Client(
            base_url=service.url, timeout=scaled(REQUEST_SECONDS)
        ) as http:
            api = ApiCaller(http, service.url)
            mallory, bystander = SdkUser(), SdkUser(keys=honest.user)
            flooding_uri = f"bunker://{flooding.signer_hex}?relay={flooding.url}"
            assert api.register(mallory, auth_signer=flooding_uri).status_code == 201
            assert api.register(bystander, auth_signer=honest.bunker_uri).status_code == 201
            deadline = time.monotonic() + scaled(60)
            while metric(service, "sigil_push_signer_links_total", outcome="dropped_flood") < 1:
                assert time.monotonic() < deadline, "the flooding link was never dropped"
                time.sleep(0.2)
            while flooding.open_now:
                assert time.monotonic() < deadline, "the flooding socket stayed open"
                time.sleep(0.05)
            assert flooding.closed_by_peer == 1  # cut off mid-flood, not at its end
            detail = _registration(api, mallory, "unreachable")["auth_signer_detail"]
            assert "far more" in detail
            assert _registration(api, bystander, "active")["delegated_auth"] is True
            handled = metric(service, "sigil_push_signer_link_frames_total")
            # the flood's share, plus the honest signer's answers and the relays' OKs and EOSEs
            assert handled <= BASE_FRAMES + FRAMES_PER_REQUEST + FRAMES_PER_KEY + 40, handled
            assert http.get("/health").status_code == 200
    finally:
        honest.stop()
        flooding.stop()
