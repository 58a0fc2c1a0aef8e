"""The instance's small tables on SQLite: used NIP-98 ids (`AuthIdRows`), delegated-auth
signer sessions (`SignerSessionStore`), learned NIP-42 modes (`AuthModeStore`) and `meta`."""

from __future__ import annotations

import json
from collections.abc import Sequence

import aiosqlite

from sigil_push.store.interface import AuthClaim
from sigil_push.store.records import StoredSession, stored_session
from sigil_push.store.sqlite.database import ORDINARY_SECURE_DELETE

_SESSION_COLUMNS = (
    "pubkey, signer_pubkey, relays, sealed_secret, sealed_client_key, status, detail"
)


class SqliteAuthIdRows:
    def __init__(self, db: aiosqlite.Connection) -> None:
        self._db = db

    async def claim(self, claims: Sequence[AuthClaim], expires_at: int) -> set[tuple[str, str]]:
        # a spent event's row is "updated" (to itself) only when its request is the same, so
        # RETURNING names exactly the claims accepted: new rows and idempotent retries
        accepted = await self._db.execute_fetchall(
            "INSERT INTO nip98_used (event_id, sig, request, expires_at) VALUES "
            + ",".join("(?, ?, ?, ?)" for _ in claims)
            + " ON CONFLICT (event_id, sig) DO UPDATE SET expires_at = nip98_used.expires_at"
            " WHERE nip98_used.request = excluded.request RETURNING event_id, sig",
            [value for claim in claims for value in (*claim, expires_at)],
        )
        return {(str(row[0]), str(row[1])) for row in accepted}

    async def prune(self, now: int) -> int:
        removed = await self._db.execute_fetchall(
            "DELETE FROM nip98_used WHERE expires_at < ? RETURNING event_id", (now,)
        )
        return len(list(removed))


class SqliteSignerSessions:
    def __init__(self, db: aiosqlite.Connection) -> None:
        self._db = db

    async def all(self) -> list[StoredSession]:
        rows = await self._db.execute_fetchall(f"SELECT {_SESSION_COLUMNS} FROM auth_signers")
        return [stored_session(row) for row in rows]

    async def get(self, pubkey: str) -> StoredSession | None:
        rows = await self._db.execute_fetchall(
            f"SELECT {_SESSION_COLUMNS} FROM auth_signers WHERE pubkey = ?", (pubkey,)
        )
        row = next(iter(rows), None)
        return None if row is None else stored_session(row)

    async def put(self, session: StoredSession, updated_at: int) -> None:
        await self._db.execute(
            f"INSERT INTO auth_signers ({_SESSION_COLUMNS}, updated_at)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
            " ON CONFLICT (pubkey) DO UPDATE SET signer_pubkey = excluded.signer_pubkey,"
            " relays = excluded.relays, sealed_secret = excluded.sealed_secret,"
            " sealed_client_key = excluded.sealed_client_key, status = excluded.status,"
            " detail = excluded.detail, updated_at = excluded.updated_at",
            (
                session.pubkey, session.signer_pubkey, json.dumps(list(session.relays)),
                session.sealed_secret, session.sealed_client_key, session.status,
                session.detail, updated_at,
            ),
        )

    async def delete(self, pubkey: str) -> None:
        await self._db.execute("DELETE FROM auth_signers WHERE pubkey = ?", (pubkey,))

    async def set_status(
        self, pubkey: str, status: str, detail: str, updated_at: int | None
    ) -> None:
        if updated_at is None:
            await self._db.execute(
                "UPDATE auth_signers SET status = ?, detail = ? WHERE pubkey = ?",
                (status, detail, pubkey),
            )
        else:
            await self._db.execute(
                "UPDATE auth_signers SET status = ?, detail = ?, updated_at = ? WHERE pubkey = ?",
                (status, detail, updated_at, pubkey),
            )


class SqliteAuthModes:
    def __init__(self, db: aiosqlite.Connection) -> None:
        self._db = db

    async def modes_since(self, since: int) -> dict[str, str]:
        rows = await self._db.execute_fetchall(
            "SELECT relay, mode FROM relay_auth_modes WHERE learned_at >= ?", (since,)
        )
        return {str(relay): str(mode) for relay, mode in rows}

    async def save_mode(self, relay: str, mode: str, learned_at: int) -> None:
        await self._db.execute(
            "INSERT INTO relay_auth_modes (relay, mode, learned_at) VALUES (?, ?, ?)"
            " ON CONFLICT (relay) DO UPDATE SET mode = excluded.mode,"
            " learned_at = excluded.learned_at",
            (relay, mode, learned_at),
        )


class SqliteMeta:
    def __init__(self, db: aiosqlite.Connection) -> None:
        self._db = db

    async def get(self, key: str) -> str | None:
        rows = await self._db.execute_fetchall("SELECT value FROM meta WHERE key = ?", (key,))
        row = next(iter(rows), None)
        return None if row is None else str(row[0])

    async def put_if_absent(self, key: str, value: str) -> None:
        await self._db.execute(
            "INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT DO NOTHING", (key, value)
        )

    async def delete_securely(self, key: str) -> None:
        """`secure_delete` ON for this one statement (freed pages zeroed on disk too), then
        back to ordinary deletes (`ORDINARY_SECURE_DELETE`): zeroing every freed page of later
        deletes (outbox, seen ids) would cost I/O for nothing."""
        await self._db.execute("PRAGMA secure_delete = ON")
        try:
            await self._db.execute("DELETE FROM meta WHERE key = ?", (key,))
        finally:
            await self._db.execute(f"PRAGMA secure_delete = {ORDINARY_SECURE_DELETE}")
