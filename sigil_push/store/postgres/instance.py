"""The instance's small tables on PostgreSQL: used NIP-98 ids (`AuthIdRows`), delegated-auth
signer sessions (`SignerSessionStore`), learned NIP-42 modes (`AuthModeStore`) and `meta`."""

from __future__ import annotations

import json
from collections.abc import Sequence

from sigil_push.store.interface import AuthClaim
from sigil_push.store.postgres.database import PostgresDatabase
from sigil_push.store.records import StoredSession, stored_session

_SESSION_COLUMNS = (
    "pubkey, signer_pubkey, relays, sealed_secret, sealed_client_key, status, detail"
)


class PostgresAuthIdRows:
    def __init__(self, db: PostgresDatabase) -> None:
        self._db = db

    async def claim(self, claims: Sequence[AuthClaim], expires_at: int) -> set[tuple[str, str]]:
        # as SqliteAuthIdRows.claim: RETURNING names the new rows and the idempotent retries
        rows = await self._db.fetch(
            "INSERT INTO nip98_used (event_id, sig, request, expires_at)"
            " SELECT e, s, r, $4::bigint FROM unnest($1::text[], $2::text[], $3::text[])"
            " AS c (e, s, r)"
            " ON CONFLICT (event_id, sig) DO UPDATE SET expires_at = nip98_used.expires_at"
            " WHERE nip98_used.request = excluded.request RETURNING event_id, sig",
            [c.event_id for c in claims], [c.sig for c in claims], [c.request for c in claims],
            expires_at,
        )
        return {(str(row[0]), str(row[1])) for row in rows}

    async def prune(self, now: int) -> int:
        return await self._db.run("DELETE FROM nip98_used WHERE expires_at < $1", now)


class PostgresSignerSessions:
    def __init__(self, db: PostgresDatabase) -> None:
        self._db = db

    async def all(self) -> list[StoredSession]:
        rows = await self._db.fetch(f"SELECT {_SESSION_COLUMNS} FROM auth_signers")
        return [stored_session(row) for row in rows]

    async def get(self, pubkey: str) -> StoredSession | None:
        rows = await self._db.fetch(
            f"SELECT {_SESSION_COLUMNS} FROM auth_signers WHERE pubkey = $1", pubkey
        )
        return stored_session(rows[0]) if rows else None

    async def put(self, session: StoredSession, updated_at: int) -> None:
        await self._db.run(
            f"INSERT INTO auth_signers ({_SESSION_COLUMNS}, updated_at)"
            " VALUES ($1, $2, $3, $4, $5, $6, $7, $8)"
            " ON CONFLICT (pubkey) DO UPDATE SET signer_pubkey = excluded.signer_pubkey,"
            " relays = excluded.relays, sealed_secret = excluded.sealed_secret,"
            " sealed_client_key = excluded.sealed_client_key, status = excluded.status,"
            " detail = excluded.detail, updated_at = excluded.updated_at",
            session.pubkey, session.signer_pubkey, json.dumps(list(session.relays)),
            session.sealed_secret, session.sealed_client_key, session.status, session.detail,
            updated_at,
        )

    async def delete(self, pubkey: str) -> None:
        await self._db.run("DELETE FROM auth_signers WHERE pubkey = $1", pubkey)

    async def set_status(
        self, pubkey: str, status: str, detail: str, updated_at: int | None
    ) -> None:
        await self._db.run(
            "UPDATE auth_signers SET status = $1, detail = $2,"
            " updated_at = coalesce($3, updated_at) WHERE pubkey = $4",
            status, detail, updated_at, pubkey,
        )


class PostgresAuthModes:
    def __init__(self, db: PostgresDatabase) -> None:
        self._db = db

    async def modes_since(self, since: int) -> dict[str, str]:
        rows = await self._db.fetch(
            "SELECT relay, mode FROM relay_auth_modes WHERE learned_at >= $1", since
        )
        return {str(relay): str(mode) for relay, mode in rows}

    async def save_mode(self, relay: str, mode: str, learned_at: int) -> None:
        await self._db.run(
            "INSERT INTO relay_auth_modes (relay, mode, learned_at) VALUES ($1, $2, $3)"
            " ON CONFLICT (relay) DO UPDATE SET mode = excluded.mode,"
            " learned_at = excluded.learned_at",
            relay, mode, learned_at,
        )


class PostgresMeta:
    def __init__(self, db: PostgresDatabase) -> None:
        self._db = db

    async def get(self, key: str) -> str | None:
        value = await self._db.fetchval("SELECT value FROM meta WHERE key = $1", key)
        return None if value is None else str(value)

    async def put_if_absent(self, key: str, value: str) -> None:
        await self._db.run(
            "INSERT INTO meta (key, value) VALUES ($1, $2) ON CONFLICT DO NOTHING", key, value
        )

    async def delete_securely(self, key: str) -> None:
        """A plain delete: PostgreSQL has no per-statement overwrite (VACUUM reclaims the
        tuple); the key is only ever an old version's, moved to its key file."""
        await self._db.run("DELETE FROM meta WHERE key = $1", key)
