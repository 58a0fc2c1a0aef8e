"""Iris subscriptions on SQLite (`IrisSubscriptionStore`, migration 0018).

A write is a few statements, each leaving a consistent state, rather than a transaction: the
connection is shared with the bridge and the API, and a statement of theirs must never land in
(or be rolled back with) a transaction of ours. The checks that could refuse the write come
first; the subscription row is guarded by the subscriber's count inside its own INSERT.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import aiosqlite

from sigil_push.store.errors import NotYours, TargetTaken, TooManySubscriptions
from sigil_push.store.interface import IrisTarget, StoredSubscription
from sigil_push.store.records import LIST_FLAGS, RegistrationListener

_SELECT = (
    "SELECT s.id, s.pubkey, s.document, group_concat(t.device_id) FROM iris_subscriptions s"
    " LEFT JOIN iris_targets t ON t.subscription_id = s.id {where}"
    " GROUP BY s.id ORDER BY s.created_at, s.id"
)
_WRITE_SUBSCRIPTION = (
    "INSERT INTO iris_subscriptions (id, pubkey, document, created_at, updated_at)"
    " SELECT ?1, ?2, ?3, ?4, ?4 WHERE EXISTS"
    " (SELECT 1 FROM iris_subscriptions WHERE id = ?1 AND pubkey = ?2)"
    " OR (SELECT COUNT(*) FROM iris_subscriptions WHERE pubkey = ?2) < ?5"
    " ON CONFLICT (id) DO UPDATE SET document = excluded.document,"
    " updated_at = excluded.updated_at WHERE iris_subscriptions.pubkey = excluded.pubkey"
    " RETURNING id"
)
_WRITE_TARGET = (
    "INSERT INTO devices (pubkey, platform, token, payload, relays, webpush_p256dh, webpush_auth,"
    " registered_at, updated_at, list_flags)"
    f" VALUES (?1, ?2, ?3, 'iris', '[]', ?4, ?5, ?6, ?6, {LIST_FLAGS.format(pubkey='?1')})"
    " ON CONFLICT (token, pubkey) DO UPDATE SET platform = excluded.platform,"
    " webpush_p256dh = excluded.webpush_p256dh, webpush_auth = excluded.webpush_auth,"
    " updated_at = excluded.updated_at WHERE devices.payload = 'iris'"
    " RETURNING id"
)


def _stored(row: Sequence[object]) -> StoredSubscription:
    ids = str(row[3]) if row[3] is not None else ""
    return StoredSubscription(
        str(row[0]), str(row[1]), str(row[2]),
        tuple(sorted(int(i) for i in ids.split(",") if i)),
    )


class SqliteIrisSubscriptions:
    def __init__(self, db: aiosqlite.Connection) -> None:
        self._db = db
        self._listeners: list[RegistrationListener] = []

    def add_listener(self, listener: RegistrationListener) -> None:
        self._listeners.append(listener)

    def _changed(self, pubkey: str) -> None:
        for listener in self._listeners:
            listener(pubkey)

    async def _select(self, where: str, args: Sequence[object]) -> list[StoredSubscription]:
        rows = await self._db.execute_fetchall(_SELECT.format(where=where), args)
        return [_stored(row) for row in rows]

    async def of_pubkey(self, pubkey: str) -> list[StoredSubscription]:
        return await self._select("WHERE s.pubkey = ?", (pubkey,))

    async def get(self, subscription_id: str) -> StoredSubscription | None:
        found = await self._select("WHERE s.id = ?", (subscription_id,))
        return found[0] if found else None

    async def all(self) -> list[StoredSubscription]:
        return await self._select("", ())

    async def put(
        self, subscription_id: str, pubkey: str, document: str, targets: Sequence[IrisTarget],
        max_per_pubkey: int,
    ) -> bool:
        owners = await self._db.execute_fetchall(
            "SELECT pubkey FROM iris_subscriptions WHERE id = ?", (subscription_id,)
        )
        owner = next((str(row[0]) for row in owners), None)
        if owner is not None and owner != pubkey:
            raise NotYours(subscription_id)
        tokens = [target.token for target in targets]
        taken = await self._db.execute_fetchall(
            f"SELECT 1 FROM devices WHERE pubkey = ? AND payload <> 'iris'"
            f" AND token IN ({','.join('?' * len(tokens))})", (pubkey, *tokens),
        )
        if list(taken):
            raise TargetTaken()
        now = int(time.time())
        written = await self._db.execute_fetchall(
            _WRITE_SUBSCRIPTION, (subscription_id, pubkey, document, now, max_per_pubkey)
        )
        if not list(written):
            if await self._db.execute_fetchall(
                "SELECT 1 FROM iris_subscriptions WHERE id = ?", (subscription_id,)
            ):
                raise NotYours(subscription_id)
            raise TooManySubscriptions(max_per_pubkey)
        device_ids: list[int] = []
        for target in targets:
            rows = await self._db.execute_fetchall(_WRITE_TARGET, (
                pubkey, target.platform, target.token, target.p256dh, target.auth, now,
            ))
            device_ids.extend(int(str(row[0])) for row in rows)
        await self._db.executemany(
            "INSERT INTO iris_targets (subscription_id, device_id) VALUES (?, ?)"
            " ON CONFLICT DO NOTHING", [(subscription_id, device) for device in device_ids],
        )
        # after the new links: the trigger removes only what no subscription names any more
        await self._db.execute(
            "DELETE FROM iris_targets WHERE subscription_id = ?"
            f" AND device_id NOT IN ({','.join('?' * len(device_ids))})",
            (subscription_id, *device_ids),
        )
        self._changed(pubkey)
        return owner is None

    async def delete(self, subscription_id: str, pubkey: str) -> bool:
        deleted = await self._db.execute_fetchall(
            "DELETE FROM iris_subscriptions WHERE id = ? AND pubkey = ? RETURNING id",
            (subscription_id, pubkey),
        )
        if not list(deleted):
            return False
        self._changed(pubkey)
        return True
