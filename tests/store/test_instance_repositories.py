"""The instance's small repositories on each engine (signer sessions, `meta`), through the
store's typed methods, and what `DelegatedAuth` and the bridge key make of them."""

from __future__ import annotations

from pathlib import Path

from sigil_push.identity import META_KEY, bridge_key
from sigil_push.nostr.keys import SecretKey
from sigil_push.relays.delegated_auth import DelegatedAuth
from sigil_push.sealed import Sealer
from sigil_push.store.factory import PostgresStore, SqliteStore
from sigil_push.store.records import StoredSession
from testkit.stores import sql_of

USER = "ab" * 32


def _session(status: str = "pending", sealed_secret: str | None = "sealed") -> StoredSession:
    return StoredSession(
        USER, "cd" * 32, ("wss://signer.example",), sealed_secret, "client", status, ""
    )


async def test_signer_sessions_round_trip_and_keep_their_time_unless_told(
    store: SqliteStore | PostgresStore,
) -> None:
    """A session comes back as stored (relays, a missing secret); a status change without a
    time leaves the row's time as it was, one with a time sets it; delete removes it."""
    sessions = store.signer_sessions
    assert await sessions.get(USER) is None
    await sessions.put(_session(sealed_secret=None), 100)
    assert await sessions.all() == [_session(sealed_secret=None)]
    await sessions.put(_session(), 150)  # a new signer for the same user replaces the row
    await sessions.set_status(USER, "refused", "no", None)
    assert await sessions.get(USER) == StoredSession(
        USER, "cd" * 32, ("wss://signer.example",), "sealed", "client", "refused", "no"
    )
    time_of = "SELECT updated_at FROM auth_signers WHERE pubkey = ?"
    assert await sql_of(store).execute_fetchall(time_of, (USER,)) == [(150,)]
    await sessions.set_status(USER, "active", "", 200)
    assert await sql_of(store).execute_fetchall(time_of, (USER,)) == [(200,)]
    await sessions.delete(USER)
    assert await sessions.all() == []


async def test_a_session_sealed_under_another_bridge_key_is_marked_refused_at_start(
    store: SqliteStore | PostgresStore,
) -> None:
    """Sessions sealed under a key this instance no longer holds cannot be used: the start
    marks them refused with a reason the user can act on, not retried."""
    old, new = SecretKey.generate(), SecretKey.generate()
    sealer = Sealer(old, "nip46-sessions")
    await store.signer_sessions.put(
        StoredSession(USER, "cd" * 32, ("wss://signer.example",), None,
                      sealer.seal(SecretKey.generate().secret_hex), "active", ""),
        100,
    )
    auth = DelegatedAuth(store.signer_sessions, store.auth_modes, new, store.devices)
    await auth.start()
    try:
        assert auth.status(USER) is None
        stored = await store.signer_sessions.get(USER)
        assert stored is not None and stored.status == "refused"
        assert "another bridge key" in stored.detail
    finally:
        await auth.stop()


async def test_meta_keeps_the_first_value_and_an_old_stored_key_moves_to_the_file(
    store: SqliteStore | PostgresStore, tmp_path: Path
) -> None:
    """`put_if_absent` never overwrites (the instance key is the first worker's); a bridge key
    an older version kept in `meta` moves to the key file and its row goes."""
    await store.meta.put_if_absent("instance_bridge_pubkey", "first")
    await store.meta.put_if_absent("instance_bridge_pubkey", "second")
    assert await store.meta.get("instance_bridge_pubkey") == "first"
    old = SecretKey.generate()
    await store.meta.put_if_absent(META_KEY, old.secret_hex)
    key = await bridge_key(store.meta, "", tmp_path / "bridge.key")
    assert key.secret_hex == old.secret_hex
    assert await store.meta.get(META_KEY) is None
    assert (tmp_path / "bridge.key").read_text().strip() == old.secret_hex
