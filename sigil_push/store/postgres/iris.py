"""Iris subscriptions on PostgreSQL (`IrisSubscriptionStore`, migration 0018): the SQLite
module's statements in PostgreSQL's SQL (see sigil_push/store/sqlite/iris.py), in one
transaction on a borrowed connection."""

from __future__ import annotations

import time
from collections.abc import Sequence

import asyncpg

from sigil_push.store.errors import NotYours, TargetTaken, TooManySubscriptions
from sigil_push.store.interface import IrisTarget, StoredSubscription
from sigil_push.store.postgres.database import PostgresDatabase
from sigil_push.store.postgres.devices import PostgresDevices
from sigil_push.store.records import LIST_FLAGS, RegistrationListener

_SELECT = (
    "SELECT s.id, s.pubkey, s.document,"
    " COALESCE(array_agg(t.device_id ORDER BY t.device_id)"
    " FILTER (WHERE t.device_id IS NOT NULL), '{{}}') FROM iris_subscriptions s"
    " LEFT JOIN iris_targets t ON t.subscription_id = s.id {where}"
    " GROUP BY s.id ORDER BY s.created_at, s.id"
)
_WRITE_SUBSCRIPTION = (
    "INSERT INTO iris_subscriptions (id, pubkey, document, created_at, updated_at)"
    " SELECT $1, $2, $3, $4, $4 WHERE EXISTS"
    " (SELECT 1 FROM iris_subscriptions WHERE id = $1 AND pubkey = $2)"
    " OR (SELECT COUNT(*) FROM iris_subscriptions WHERE pubkey = $2) < $5"
    " ON CONFLICT (id) DO UPDATE SET document = excluded.document,"
    " updated_at = excluded.updated_at WHERE iris_subscriptions.pubkey = excluded.pubkey"
    " RETURNING id"
)
_WRITE_TARGET = (
    "INSERT INTO devices (pubkey, platform, token, payload, relays, webpush_p256dh, webpush_auth,"
    " registered_at, updated_at, list_flags)"
    f" VALUES ($1, $2, $3, 'iris', '[]', $4, $5, $6, $6, {LIST_FLAGS.format(pubkey='$1')})"
    " ON CONFLICT (pubkey, token) DO UPDATE SET platform = excluded.platform,"
    " webpush_p256dh = excluded.webpush_p256dh, webpush_auth = excluded.webpush_auth,"
    " updated_at = excluded.updated_at WHERE devices.payload = 'iris'"
    " RETURNING id"
)


def _stored(row: asyncpg.Record) -> StoredSubscription:
    return StoredSubscription(str(row[0]), str(row[1]), str(row[2]), tuple(int(i) for i in row[3]))


IRIS_CHANNEL = "sigil_push_iris"
"""NOTIFY channel on which a worker announces a subscriber whose subscriptions it changed."""


class PostgresIrisSubscriptions:
    """`devices` carries the announcements: its listening connection hears the other workers'
    (`listen`), and `announce` tells them."""

    def __init__(self, db: PostgresDatabase, devices: PostgresDevices | None = None) -> None:
        self._db = db
        self._devices = devices
        self._listeners: list[RegistrationListener] = []

    def add_listener(self, listener: RegistrationListener) -> None:
        self._listeners.append(listener)

    async def listen(self) -> None:
        """Hear the other workers' subscription changes."""
        if self._devices is not None:
            await self._devices.also_listen(IRIS_CHANNEL, self._tell)

    def _tell(self, pubkey: str) -> None:
        for listener in self._listeners:
            listener(pubkey)

    async def _changed(self, pubkey: str) -> None:
        self._tell(pubkey)
        if self._devices is not None:
            await self._devices.announce(IRIS_CHANNEL, pubkey)

    async def _select(self, where: str, *args: object) -> list[StoredSubscription]:
        return [_stored(row) for row in await self._db.fetch(_SELECT.format(where=where), *args)]

    async def of_pubkey(self, pubkey: str) -> list[StoredSubscription]:
        return await self._select("WHERE s.pubkey = $1", pubkey)

    async def get(self, subscription_id: str) -> StoredSubscription | None:
        found = await self._select("WHERE s.id = $1", subscription_id)
        return found[0] if found else None

    async def all(self) -> list[StoredSubscription]:
        return await self._select("")

    async def put(
        self, subscription_id: str, pubkey: str, document: str, targets: Sequence[IrisTarget],
        max_per_pubkey: int,
    ) -> bool:
        now = int(time.time())
        async with self._db.connection() as connection, connection.transaction():
            owner = await connection.fetchval(
                "SELECT pubkey FROM iris_subscriptions WHERE id = $1", subscription_id
            )
            if owner is not None and owner != pubkey:
                raise NotYours(subscription_id)
            if await connection.fetchval(
                "SELECT EXISTS (SELECT 1 FROM devices WHERE pubkey = $1 AND payload <> 'iris'"
                " AND token = ANY($2::text[]))", pubkey, [t.token for t in targets],
            ):
                raise TargetTaken()
            written = await connection.fetch(
                _WRITE_SUBSCRIPTION, subscription_id, pubkey, document, now, max_per_pubkey
            )
            if not written:
                if owner is None and await connection.fetchval(
                    "SELECT EXISTS (SELECT 1 FROM iris_subscriptions WHERE id = $1)",
                    subscription_id,
                ):
                    raise NotYours(subscription_id)
                raise TooManySubscriptions(max_per_pubkey)
            device_ids: list[int] = []
            for target in targets:
                rows = await connection.fetch(
                    _WRITE_TARGET, pubkey, target.platform, target.token, target.p256dh,
                    target.auth, now,
                )
                device_ids.extend(int(row[0]) for row in rows)
            await connection.execute(
                "INSERT INTO iris_targets (subscription_id, device_id)"
                " SELECT $1, unnest($2::bigint[]) ON CONFLICT DO NOTHING",
                subscription_id, device_ids,
            )
            await connection.execute(
                "DELETE FROM iris_targets WHERE subscription_id = $1"
                " AND NOT (device_id = ANY($2::bigint[]))", subscription_id, device_ids,
            )
        await self._changed(pubkey)
        return owner is None

    async def delete(self, subscription_id: str, pubkey: str) -> bool:
        deleted = await self._db.fetch(
            "DELETE FROM iris_subscriptions WHERE id = $1 AND pubkey = $2 RETURNING id",
            subscription_id, pubkey,
        )
        if not deleted:
            return False
        await self._changed(pubkey)
        return True
