"""NIP-46 signer sessions against a real relay and an independent (nostr-sdk) remote signer,
the sessions kept in a real store of each engine."""

from __future__ import annotations

import asyncio
import gc
import logging
import secrets
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import nostr_sdk
import pytest
from prometheus_client import REGISTRY

from sigil_push.nostr.keys import SecretKey
from sigil_push.nostr.nip46 import (
    BunkerUri,
    ForbiddenRequest,
    InvalidBunkerUri,
    Response,
    _request,
    connect_request,
)
from sigil_push.relays.delegated_auth import DelegatedAuth, DelegatedAuthUnavailable
from sigil_push.relays.signer_link import SignerRelayLink
from sigil_push.store.factory import PostgresStore, SqliteStore
from testkit.relay import RelayProcess, free_port
from testkit.remote_signer import RemoteSigner
from testkit.stores import Engine, fetch, open_test_store


@pytest.fixture
def start_signer(module_relay: RelayProcess) -> Iterator[Callable[..., RemoteSigner]]:
    started: list[RemoteSigner] = []

    def start(**options: Any) -> RemoteSigner:
        signer = RemoteSigner(module_relay.url, **options).start()
        started.append(signer)
        return signer

    yield start
    for signer in started:
        signer.stop()


@pytest.fixture
async def auth(store: SqliteStore | PostgresStore) -> AsyncIterator[DelegatedAuth]:
    """DelegatedAuth over the test's store (each engine), stopped after the test."""
    delegated = DelegatedAuth(
        store.signer_sessions, store.auth_modes, SecretKey.generate(), store.devices
    )
    await delegated.start()
    yield delegated
    await delegated.stop()


async def wait_for_status(auth: DelegatedAuth, pubkey: str, wanted: str) -> None:
    for _ in range(300):
        if auth.status(pubkey) == wanted:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"status stayed {auth.status(pubkey)!r}, wanted {wanted!r}")


async def connect(auth: DelegatedAuth, signer: RemoteSigner, wanted: str) -> None:
    await auth.set_signer(signer.user_hex, BunkerUri.parse(signer.bunker_uri, True))
    await wait_for_status(auth, signer.user_hex, wanted)


async def test_session_becomes_active_and_signs_only_auth(
    auth: DelegatedAuth, start_signer: Callable[..., RemoteSigner]
) -> None:
    """connect + get_public_key make the session active; the only signing asked is kind 22242."""
    signer = start_signer(secret="s3cret-token")
    await connect(auth, signer, "active")
    event = await auth.sign_auth(signer.user_hex, "wss://inbox.example", "challenge-1")
    assert event.kind == 22242
    assert event.pubkey == signer.user_hex
    assert event.first_tag("challenge") == "challenge-1"
    assert signer.methods() == ["connect", "get_public_key", "sign_event"]
    assert [r.signed_kind for r in signer.requests if r.method == "sign_event"] == [22242]


def test_no_request_for_another_kind_can_be_built() -> None:
    """The client refuses to build any method beyond connect/get_public_key/sign_event(22242)."""
    client, signer = SecretKey.generate(), SecretKey.generate()
    for method in ("nip44_decrypt", "nip04_encrypt", "sign_message", "ping"):
        with pytest.raises(ForbiddenRequest):
            _request(client, signer.public_key_hex, method, [])


async def test_refusing_signer_is_reported_not_retried(
    auth: DelegatedAuth, start_signer: Callable[..., RemoteSigner]
) -> None:
    signer = start_signer(refuse=True)
    await connect(auth, signer, "refused")
    await asyncio.sleep(0.5)
    assert signer.methods() == ["connect"]
    with pytest.raises(DelegatedAuthUnavailable):
        await auth.sign_auth(signer.user_hex, "wss://inbox.example", "c")


async def test_signer_holding_another_key_is_refused(
    auth: DelegatedAuth, start_signer: Callable[..., RemoteSigner]
) -> None:
    await connect(auth, start_signer(claims_key=nostr_sdk.Keys.generate()), "refused")


async def test_unreachable_signer_is_reported(auth: DelegatedAuth) -> None:
    dead = f"ws://127.0.0.1:{free_port()}"
    user = SecretKey.generate().public_key_hex
    await auth.set_signer(user, BunkerUri.parse(f"bunker://{'ab' * 32}?relay={dead}", True))
    await wait_for_status(auth, user, "unreachable")


async def test_a_signer_key_off_the_curve_is_refused_not_left_pending(auth: DelegatedAuth) -> None:
    """Hex that is no curve point (as registration accepted before it checked, so rows of it
    may be stored): the session's task died in the NIP-44 encryption with the status stuck at
    `pending` and nothing logged. Registration now refuses it (BunkerUri.parse, and
    test_api_errors.py against the service); a stored one is `refused` with a reason."""
    off_curve = "0" * 64
    with pytest.raises(InvalidBunkerUri):
        BunkerUri.parse(f"bunker://{off_curve}?relay=ws://127.0.0.1:1", True)
    user = SecretKey.generate().public_key_hex
    await auth.set_signer(user, BunkerUri(off_curve, (f"ws://127.0.0.1:{free_port()}",), None))
    await wait_for_status(auth, user, "refused")
    assert "not a public key" in auth.detail(user)


async def test_an_unexpected_exception_in_a_session_is_a_visible_status(
    auth: DelegatedAuth, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever a handshake raises, the session is not left `pending` with its task gone: it
    is `failed` with the exception's type in its detail, logged by type (the message, which
    may quote keys, withheld), counted, and retried with the unreachable pauses."""
    marker = secrets.token_hex(8)

    def broken(*args: Any) -> Any:
        raise KeyError(marker)

    monkeypatch.setattr("sigil_push.relays.delegated_auth.connect_request", broken)
    failures = REGISTRY.get_sample_value("sigil_push_delegated_auth_session_failures_total") or 0.0
    user = SecretKey.generate().public_key_hex
    with caplog.at_level(logging.ERROR, logger="sigil_push.relays.delegated_auth"):
        await auth.set_signer(user, BunkerUri.parse(f"bunker://{'ab' * 32}?relay=ws://127.0.0.1:1", True))
        await wait_for_status(auth, user, "failed")
    assert "KeyError" in auth.detail(user)
    assert REGISTRY.get_sample_value("sigil_push_delegated_auth_session_failures_total") == failures + 1
    assert "signer session failed (KeyError)" in caplog.text and marker not in caplog.text


async def test_signer_requests_are_rate_limited_per_user(
    auth: DelegatedAuth, start_signer: Callable[..., RemoteSigner]
) -> None:
    """A reconnect storm gets a handful of signatures, then refusals without asking the signer."""
    signer = start_signer()
    await connect(auth, signer, "active")
    outcomes = []
    for attempt in range(20):
        try:
            await auth.sign_auth(signer.user_hex, "wss://inbox.example", f"c{attempt}")
            outcomes.append("signed")
        except DelegatedAuthUnavailable:
            outcomes.append("refused")
    signs_asked = sum(1 for m in signer.methods() if m == "sign_event")
    assert signs_asked == outcomes.count("signed") < 20
    assert outcomes.count("refused") > 0


async def test_secret_is_sealed_at_rest(
    auth: DelegatedAuth,
    start_signer: Callable[..., RemoteSigner],
    database: str,
    engine: Engine,
) -> None:
    """The connection secret is in no byte the engine writes to disk, nor in a dump."""
    secret = f"very-secret-value-{secrets.token_hex(8)}"
    await connect(auth, start_signer(secret=secret), "active")
    assert secret.encode() not in engine.at_rest(database)
    assert secret not in engine.dump(database)
    [(sealed,)] = fetch(database, "SELECT sealed_secret FROM auth_signers")
    assert sealed.startswith("v1:")


async def test_sessions_beyond_one_subscription_chunk_are_answered(
    auth: DelegatedAuth, start_signer: Callable[..., RemoteSigner], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Client keys spread over several subscriptions on one signer relay all get their answers."""
    from sigil_push.relays import signer_link

    monkeypatch.setattr(signer_link, "KEYS_PER_SUBSCRIPTION", 1)
    signers = [start_signer() for _ in range(3)]
    for signer in signers:
        await connect(auth, signer, "active")
    for signer in signers:
        event = await auth.sign_auth(signer.user_hex, "wss://inbox.example", "c")
        assert event.pubkey == signer.user_hex


async def test_a_request_cancelled_as_its_answer_lands_stays_cancelled(
    module_relay: RelayProcess,
) -> None:
    """A session's handshake is stopped by cancelling it; on Python 3.11 `asyncio.wait_for`
    returned the answer instead when the cancellation landed in the turn the answer arrived,
    and a retrying session went on after its stop. Here the answer is set and the request
    cancelled in one turn, as the link's reader and a stop would: the request ends cancelled.
    The relay is real; the answer is the test's (a signer cannot be timed to the turn)."""
    link = SignerRelayLink(module_relay.url)
    client, signer = SecretKey.generate(), SecretKey.generate()
    request_id, message = connect_request(client, BunkerUri(signer.public_key_hex, (), None))
    task = asyncio.create_task(link.request(client, request_id, message, 60))
    try:
        for _ in range(6000):  # until the request waits on its answer
            entry = link._pending.get(request_id)
            if entry is not None and entry[1]._callbacks:
                break
            await asyncio.sleep(0.01)
        else:
            raise AssertionError("the request never waited for its answer")
        entry[1].set_result(Response(request_id, "ack", None))
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    finally:
        await link.close()


async def test_a_failed_session_clean_up_is_logged_by_its_type(
    store: SqliteStore | PostgresStore, database: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The clean-up a device change starts (the session ends with the npub's last device)
    can fail, here on a closed device store: it is logged by the exception's type, never
    left to asyncio's "Task exception was never retrieved", whose traceback quotes the
    exception's message (asyncpg's DETAIL names the row's values)."""
    closed = await open_test_store(database)
    await closed.close()
    delegated = DelegatedAuth(store.signer_sessions, store.auth_modes, SecretKey.generate(), closed.devices)
    await delegated.start()
    user = SecretKey.generate().public_key_hex
    dead = f"ws://127.0.0.1:{free_port()}"
    try:
        await delegated.set_signer(user, BunkerUri.parse(f"bunker://{'ab' * 32}?relay={dead}", True))
        with caplog.at_level(logging.ERROR):
            delegated.registration_changed(user)
            for _ in range(300):
                if "signer-sessions" in caplog.text:
                    break
                await asyncio.sleep(0.02)
            gc.collect()  # where asyncio reports an exception nobody retrieved
    finally:
        await delegated.stop()
    assert "background task signer-sessions failed" in caplog.text
    assert "never retrieved" not in caplog.text and "Traceback" not in caplog.text
