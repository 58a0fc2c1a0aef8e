"""NIP-46 signer sessions against a real relay and an independent (nostr-sdk) remote signer."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest

from sigil_push.db import open_database
from sigil_push.devices import Devices
from sigil_push.delegated_auth import DelegatedAuth, DelegatedAuthUnavailable
from sigil_push.nostr.keys import SecretKey
from sigil_push.nostr.nip46 import BunkerUri, ForbiddenRequest, _request
from tests.support.relay import RelayProcess, free_port
from tests.support.remote_signer import RemoteSigner


@pytest.fixture(scope="module")
def signer_relay(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RelayProcess]:
    with RelayProcess(tmp_path_factory.mktemp("signer-relay")) as relay:
        yield relay


async def wait_for_status(auth: DelegatedAuth, pubkey: str, wanted: str) -> None:
    for _ in range(300):
        if auth.status(pubkey) == wanted:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"status stayed {auth.status(pubkey)!r}, wanted {wanted!r}")


async def delegated(tmp_path: Path) -> tuple[DelegatedAuth, object]:
    db = await open_database(tmp_path / "push.db")
    auth = DelegatedAuth(db, SecretKey.generate(), Devices(db))
    await auth.start()
    return auth, db


async def test_session_becomes_active_and_signs_only_auth(tmp_path: Path, signer_relay: RelayProcess) -> None:
    """connect + get_public_key make the session active; the only signing asked is kind 22242."""
    signer = RemoteSigner(signer_relay.url, secret="s3cret-token").start()
    auth, db = await delegated(tmp_path)
    try:
        await auth.set_signer(signer.user_hex, BunkerUri.parse(signer.bunker_uri, True))
        await wait_for_status(auth, signer.user_hex, "active")
        event = await auth.sign_auth(signer.user_hex, "wss://inbox.example", "challenge-1")
        assert event.kind == 22242
        assert event.pubkey == signer.user_hex
        assert event.first_tag("challenge") == "challenge-1"
        assert signer.methods() == ["connect", "get_public_key", "sign_event"]
        assert [r.signed_kind for r in signer.requests if r.method == "sign_event"] == [22242]
    finally:
        await auth.stop()
        await db.close()  # type: ignore[attr-defined]
        signer.stop()


def test_no_request_for_another_kind_can_be_built() -> None:
    """The client refuses to build any method beyond connect/get_public_key/sign_event(22242)."""
    client, signer = SecretKey.generate(), SecretKey.generate()
    for method in ("nip44_decrypt", "nip04_encrypt", "sign_message", "ping"):
        with pytest.raises(ForbiddenRequest):
            _request(client, signer.public_key_hex, method, [])


async def test_refusing_signer_is_reported_not_retried(tmp_path: Path, signer_relay: RelayProcess) -> None:
    signer = RemoteSigner(signer_relay.url, refuse=True).start()
    auth, db = await delegated(tmp_path)
    try:
        await auth.set_signer(signer.user_hex, BunkerUri.parse(signer.bunker_uri, True))
        await wait_for_status(auth, signer.user_hex, "refused")
        await asyncio.sleep(0.5)
        assert signer.methods() == ["connect"]
        with pytest.raises(DelegatedAuthUnavailable):
            await auth.sign_auth(signer.user_hex, "wss://inbox.example", "c")
    finally:
        await auth.stop()
        await db.close()  # type: ignore[attr-defined]
        signer.stop()


async def test_signer_holding_another_key_is_refused(tmp_path: Path, signer_relay: RelayProcess) -> None:
    import nostr_sdk

    signer = RemoteSigner(signer_relay.url, claims_key=nostr_sdk.Keys.generate()).start()
    auth, db = await delegated(tmp_path)
    try:
        await auth.set_signer(signer.user_hex, BunkerUri.parse(signer.bunker_uri, True))
        await wait_for_status(auth, signer.user_hex, "refused")
    finally:
        await auth.stop()
        await db.close()  # type: ignore[attr-defined]
        signer.stop()


async def test_unreachable_signer_is_reported(tmp_path: Path) -> None:
    dead = f"ws://127.0.0.1:{free_port()}"
    user = SecretKey.generate().public_key_hex
    auth, db = await delegated(tmp_path)
    try:
        await auth.set_signer(user, BunkerUri.parse(f"bunker://{'ab' * 32}?relay={dead}", True))
        await wait_for_status(auth, user, "unreachable")
    finally:
        await auth.stop()
        await db.close()  # type: ignore[attr-defined]


async def test_signer_requests_are_rate_limited_per_user(tmp_path: Path, signer_relay: RelayProcess) -> None:
    """A reconnect storm gets a handful of signatures, then refusals without asking the signer."""
    signer = RemoteSigner(signer_relay.url).start()
    auth, db = await delegated(tmp_path)
    try:
        await auth.set_signer(signer.user_hex, BunkerUri.parse(signer.bunker_uri, True))
        await wait_for_status(auth, signer.user_hex, "active")
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
    finally:
        await auth.stop()
        await db.close()  # type: ignore[attr-defined]
        signer.stop()


async def test_secret_is_sealed_at_rest(tmp_path: Path, signer_relay: RelayProcess) -> None:
    signer = RemoteSigner(signer_relay.url, secret="very-secret-value-123").start()
    auth, db = await delegated(tmp_path)
    try:
        await auth.set_signer(signer.user_hex, BunkerUri.parse(signer.bunker_uri, True))
        await wait_for_status(auth, signer.user_hex, "active")
    finally:
        await auth.stop()
        await db.close()  # type: ignore[attr-defined]
        signer.stop()
    raw = b"".join(p.read_bytes() for p in tmp_path.glob("push.db*"))
    assert b"very-secret-value-123" not in raw
    with sqlite3.connect(tmp_path / "push.db") as plain:
        [(sealed,)] = plain.execute("SELECT sealed_secret FROM auth_signers")
    assert sealed.startswith("v1:")
