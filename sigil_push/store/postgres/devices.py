"""Device registrations on PostgreSQL: (npub, device token) pairs shared by every worker.

A token may be registered by several npubs (accounts on one phone), each pair on its own row;
registering never touches another npub's pair, unregistering removes only the caller's, and a
token the provider declared dead removes every pair that carries it. Both limits (devices per
npub, npubs per token: the policy is `store.limits`) are checked on counts taken under
transaction-scoped advisory locks on the npub and the token, so concurrent registrations on
several workers cannot overshoot.

Every worker must learn of a change made through any worker's API (its bridge may watch that
key): a change is announced with NOTIFY on `sigil_push_devices` (worker id and pubkey), and
`listen` turns the other workers' announcements into the same listener calls as local changes.
Other announcements of the same form (`also_listen`, e.g. signer sessions) share that one
listening connection and its reconnection.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Collection, Iterable, Sequence

import asyncpg

from sigil_push.shards import DEFAULT_SHARDS, shard_of
from sigil_push.store.limits import Occupancy, refusal
from sigil_push.store.postgres.database import PostgresDatabase
from sigil_push.store.records import (
    LIST_FLAGS,
    RULE_COLUMNS,
    Device,
    PreferenceChange,
    Registration,
    RegistrationListener,
    WebPushKeys,
    add_device_relays,
    add_device_relays_tuple,
)

_COLUMNS = (
    "id, pubkey, platform, token, payload, relays, webpush_p256dh, webpush_auth, registered_at,"
    " device_key"
)
_WITH_RULES = f"{_COLUMNS}, {RULE_COLUMNS}"
"""A pair's columns with what its owner chose (the bridge's and GET /registrations' reads)."""


def _device(row: asyncpg.Record) -> Device:
    return Device.from_row(tuple(row))


CHANNEL = "sigil_push_devices"
RULES_CHANNEL = "sigil_push_rules"
"""A pair's preferences or presence changed (`add_rules_listener`), nothing else."""
KEY_CHUNK = 10_000
"""Rows per round trip when `watched_keys` reads the registered keys."""
SHARD_GROUP = 16
"""Shards per query when a narrowed worker reads its keys (see `key_chunks`)."""
RELISTEN_SECONDS = 1.0
log = logging.getLogger(__name__)

Heard = Callable[[str], None]


def shard_keys_sql(count: int) -> str:
    """The query for the keys (and relays) of the shards in `$1` out of `count`.

    It is `shard_of` in SQL: the key's leading 32 bits modulo the shard count. The count is a
    literal, not a parameter, so that at 256 shards the expression is exactly the one indexed
    by `devices_by_shard` (migration 0005) and a worker reads its own share of the table only.
    """
    return (
        "SELECT pubkey, relays FROM devices WHERE"
        f" (('x' || substr(pubkey, 1, 8))::bit(32)::bigint % {int(count)})::integer"
        " = ANY($1::int[]) AND payload <> 'iris'"
    )


class PostgresDevices:
    """`DeviceStore` on PostgreSQL for worker `worker_id`."""

    def __init__(self, database: PostgresDatabase, worker_id: str) -> None:
        self._db = database
        self._worker = worker_id
        self._listeners: list[RegistrationListener] = []
        self._rules_listeners: list[RegistrationListener] = []
        self._listening: asyncpg.Connection | None = None
        self._url = ""
        self._relisten: asyncio.Task[None] | None = None
        self._channels: dict[str, Heard] = {
            CHANNEL: self._tell_one, RULES_CHANNEL: self._tell_rules,
        }
        self._missed: list[Callable[[], None]] = []
        self._shards: tuple[list[int], int] | None = None

    def add_listener(self, listener: RegistrationListener) -> None:
        self._listeners.append(listener)

    def add_rules_listener(self, listener: RegistrationListener) -> None:
        self._rules_listeners.append(listener)

    def _tell_rules(self, pubkey: str) -> None:
        for listener in self._rules_listeners:
            listener(pubkey)

    async def _rules_changed(self, pubkey: str) -> None:
        """Told here and, by NOTIFY, on every other worker."""
        self._tell_rules(pubkey)
        await self.announce(RULES_CHANNEL, pubkey)

    async def listen(self, url: str) -> None:
        """Hear the other workers' registration changes (on a connection of its own, opened
        again whenever it breaks; changes announced while it was down are not heard)."""
        self._url = url
        self._listening = await asyncpg.connect(url)
        for channel in self._channels:
            await self._listening.add_listener(channel, self._heard)
        self._listening.add_termination_listener(self._lost)

    def _lost(self, _connection: object) -> None:
        if self._listening is not None and self._relisten is None:
            log.warning("registration notifications lost their connection; reconnecting")
            self._relisten = asyncio.create_task(self._listen_again())

    async def _listen_again(self) -> None:
        while self._listening is not None:
            try:
                await self.listen(self._url)
                break
            except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError):
                await asyncio.sleep(RELISTEN_SECONDS)
        self._relisten = None
        if self._listening is not None:
            log.warning("registration notifications heard again; reloading this worker's keys")
            for missed in self._missed:
                missed()

    def on_missed(self, reload: Callable[[], None]) -> None:
        """Call `reload()` once the listening connection is back after it broke: whatever
        other workers announced meanwhile (a registration just after a database restart, say)
        was not heard, so what they changed must be read again."""
        self._missed.append(reload)

    async def also_listen(self, channel: str, heard: Heard) -> None:
        """Call `heard(pubkey)` for the other workers' `announce(channel, …)`, on the same
        connection (and its reconnections) as registration changes."""
        self._channels[channel] = heard
        if self._listening is not None:
            await self._listening.add_listener(channel, self._heard)

    async def announce(self, channel: str, pubkey: str) -> None:
        """Tell the other workers' `also_listen(channel)` that `pubkey` changed."""
        await self._db.run("SELECT pg_notify($1, $2)", channel, f"{self._worker} {pubkey}")

    def _heard(self, _connection: object, _pid: int, channel: str, payload: object) -> None:
        worker, _, pubkey = str(payload).partition(" ")
        heard = self._channels.get(channel)
        if worker != self._worker and pubkey and heard is not None:
            heard(pubkey)

    def _tell_one(self, pubkey: str) -> None:
        self._tell([pubkey])

    async def close(self) -> None:
        listening, self._listening = self._listening, None
        if self._relisten is not None:
            self._relisten.cancel()
        if listening is not None:
            await listening.close()

    def _tell(self, pubkeys: Iterable[str | None]) -> None:
        for pubkey in {p for p in pubkeys if p}:
            for listener in self._listeners:
                listener(pubkey)

    async def _changed(self, pubkeys: Iterable[str | None]) -> None:
        changed = sorted({p for p in pubkeys if p})
        self._tell(changed)
        if changed:
            await self._db.run(
                "SELECT pg_notify($1, $2 || ' ' || p) FROM unnest($3::text[]) AS p",
                CHANNEL, self._worker, changed,
            )

    async def register(
        self,
        pubkey: str,
        platform: str,
        token: str,
        payload: str,
        relays: Sequence[str],
        webpush_keys: WebPushKeys | None,
        max_devices: int,
        max_accounts: int = 0,
        device_key: str | None = None,
    ) -> Registration:
        """Insert or update this npub's pair with `token` (201 when new, 200 when updated);
        an update replaces the device key too (absent: none), as on SQLite, and keeps the
        preferences, which the returned device carries (the API's answer shows them)."""
        now = int(time.time())
        async with self._db.connection() as connection, connection.transaction():
            # the limits count rows other registrations may be adding right now: lock the npub
            # and the token (always in this order) before counting; the npub's lock also keeps
            # its lists from being stored meanwhile (`PostgresUserLists.save`), so the pair's
            # `list_flags` are those of the lists committed when it is written
            await connection.execute(
                "SELECT pg_advisory_xact_lock(hashtext($1)), pg_advisory_xact_lock(hashtext($2))",
                pubkey, token,
            )
            counts = await connection.fetchrow(
                "SELECT count(*) FILTER (WHERE pubkey = $1 AND token = $2 AND payload <> 'iris')"
                " AS pair, count(*) FILTER (WHERE pubkey = $1 AND payload <> 'iris') AS of_npub,"
                " count(*) FILTER (WHERE token = $2 AND payload <> 'iris') AS of_token,"
                " count(*) FILTER (WHERE pubkey = $1 AND token = $2 AND payload = 'iris') AS iris"
                " FROM devices WHERE pubkey = $1 OR token = $2",
                pubkey, token,
            )
            assert counts is not None
            found = Occupancy(
                counts["pair"] > 0, counts["of_npub"], counts["of_token"], counts["iris"] > 0
            )
            refused = refusal(found, max_devices, max_accounts)
            if refused is not None:
                raise refused
            row = await connection.fetchrow(
                "INSERT INTO devices (pubkey, platform, token, payload, relays, webpush_p256dh,"
                " webpush_auth, registered_at, updated_at, device_key, list_flags) VALUES ($1, $2,"
                f" $3, $4, $5, $6, $7, $8, $8, $9, {LIST_FLAGS.format(pubkey='$1')})"
                " ON CONFLICT (pubkey, token) DO UPDATE SET"
                " platform = excluded.platform, payload = excluded.payload, relays = excluded.relays,"
                " webpush_p256dh = excluded.webpush_p256dh, webpush_auth = excluded.webpush_auth,"
                " updated_at = excluded.updated_at, device_key = excluded.device_key,"
                " list_flags = excluded.list_flags"
                f" RETURNING {_WITH_RULES}",
                pubkey, platform, token, payload, json.dumps(list(relays)),
                webpush_keys.p256dh if webpush_keys else None,
                webpush_keys.auth if webpush_keys else None,
                now, device_key,
            )
        assert row is not None
        await self._changed([pubkey])
        return Registration(_device(row), not found.pair_exists)

    async def unregister(self, pubkey: str, token: str) -> int:
        """Remove the caller's own pair with `token`; other npubs' pairs stay."""
        removed = await self._db.run(
            "DELETE FROM devices WHERE pubkey = $1 AND token = $2 AND payload <> 'iris'",
            pubkey, token,
        )
        if removed:
            await self._changed([pubkey])
        return removed

    async def forget(self, device_id: int) -> Device | None:
        """A dead token: delete every pair carrying it on the platform that answered (as on
        SQLite); returns the pair `device_id` named."""
        rows = await self._db.fetch(
            "DELETE FROM devices WHERE (platform, token) ="
            " (SELECT platform, token FROM devices WHERE id = $1)"
            f" RETURNING {_COLUMNS}",
            device_id,
        )
        devices = [_device(row) for row in rows]
        await self._changed(device.pubkey for device in devices)
        return next((d for d in devices if d.id == device_id), None)

    async def set_preferences(
        self, pubkey: str, token: str, change: PreferenceChange
    ) -> Device | None:
        """Apply `change` to `pubkey`'s own pair with `token` in one UPDATE (as on SQLite);
        None when the caller has no such pair. Every worker hears of it (NOTIFY)."""
        quiet = change.quiet
        rows = await self._db.fetch(
            "UPDATE devices SET pause_until = CASE WHEN $1 THEN $2::bigint ELSE pause_until END,"
            " senders = COALESCE($3, senders),"
            " muted = CASE WHEN $4 THEN $5::bytea ELSE muted END,"
            " muted_count = CASE WHEN $4 THEN $6 ELSE muted_count END,"
            " notify = COALESCE($9::integer, notify),"
            " quiet_from = CASE WHEN $10 THEN $11::integer ELSE quiet_from END,"
            " quiet_to = CASE WHEN $10 THEN $12::integer ELSE quiet_to END,"
            " quiet_tz = CASE WHEN $10 THEN $13::text ELSE quiet_tz END"
            f" WHERE pubkey = $7 AND token = $8 AND payload <> 'iris' RETURNING {_WITH_RULES}",
            change.sets_pause, change.pause_until, change.senders,
            change.muted is not None, change.muted or None, change.muted_count,
            pubkey, token, change.notify, change.sets_quiet,
            None if quiet is None else quiet.start, None if quiet is None else quiet.end,
            None if quiet is None else quiet.tz,
        )
        if not rows:
            return None
        await self._rules_changed(pubkey)
        return _device(rows[0])

    async def set_presence(self, pubkey: str, token: str, until: int | None) -> bool:
        """The app is in the foreground until `until` (None: it left; no lapse wakeup then).
        False when the caller has no pair with `token`."""
        rows = await self._db.fetch(
            "UPDATE devices SET present_until = $1::bigint WHERE pubkey = $2 AND token = $3"
            " AND payload <> 'iris' RETURNING id",
            until, pubkey, token,
        )
        if not rows:
            return False
        if until is None:
            await self._db.run(
                "DELETE FROM deferred_wakeups WHERE device_id = $1 AND reason = 'present'",
                int(rows[0][0]),
            )
        await self._rules_changed(pubkey)
        return True

    async def of_pubkey(self, pubkey: str) -> list[Device]:
        rows = await self._db.fetch(
            f"SELECT {_WITH_RULES} FROM devices WHERE pubkey = $1 AND payload <> 'iris'"
            " ORDER BY id", pubkey,
        )
        return [_device(row) for row in rows]

    async def of_pubkeys(self, pubkeys: Sequence[str]) -> list[Device]:
        if not pubkeys:
            return []
        rows = await self._db.fetch(
            f"SELECT {_WITH_RULES} FROM devices WHERE pubkey = ANY($1::text[])"
            " AND payload <> 'iris' ORDER BY id",
            list(pubkeys),
        )
        return [_device(row) for row in rows]

    async def by_id(self, device_id: int) -> Device | None:
        rows = await self._db.fetch(f"SELECT {_WITH_RULES} FROM devices WHERE id = $1", device_id)
        return _device(rows[0]) if rows else None

    def narrow_to(self, shards: Collection[int], count: int) -> None:
        """From now on `watched_keys` returns only the keys in `shards` (of `count`): this
        worker's, so a worker reads and holds 1/N of the keys, not all of them."""
        self._shards = (sorted(shards), count)

    async def watched_keys(self) -> dict[str, tuple[str, ...]]:
        """Every registered pubkey (of this worker's shards, once narrowed) with the union of
        its devices' own relays."""
        watched: dict[str, tuple[str, ...]] = {}
        async for chunk in self.key_chunks():
            for pubkey, relays in chunk.items():
                add_device_relays_tuple(watched, pubkey, relays)
        return watched

    async def follows_only(self) -> list[str]:
        rows = await self._db.fetch(
            "SELECT DISTINCT pubkey FROM devices WHERE senders = 'follows' AND payload <> 'iris'"
        )
        return [str(row[0]) for row in rows]

    async def key_chunks(
        self, shards: Collection[int] | None = None, count: int = DEFAULT_SHARDS
    ) -> AsyncIterator[dict[str, tuple[str, ...]]]:
        """The registered keys of `shards` (of `count`; None: of this worker's shards once
        narrowed, else all), KEY_CHUNK rows at a time, each key with its devices' relays.

        Read through a server-side cursor on a pool connection: a million rows fetched at once
        were a million records and relay strings alive together, the start-up's memory peak;
        and the caller applies each chunk before the next is read, yielding to the event loop
        in between. A key with several devices may come in more than one chunk (no order is
        asked for: it would cost the server a sort of every row). Narrowed, the shards are read
        SHARD_GROUP at a time, skipping those no longer ours when their turn comes.
        """
        args: tuple[object, ...] = ()
        if shards is not None:
            sql, args = shard_keys_sql(count), (sorted(shards),)
        elif self._shards is not None:
            # a group of shards per query, each only if still ours: a worker that took every
            # shard at start-up and gave half back a second later reads its half, not all
            narrowed, narrowed_count = self._shards
            for start in range(0, len(narrowed), SHARD_GROUP):
                current = self._shards
                held = set(current[0]) if current[1] == narrowed_count else set()
                group = [s for s in narrowed[start : start + SHARD_GROUP] if s in held]
                if group:
                    async for chunk in self._chunks(shard_keys_sql(narrowed_count), (group,)):
                        yield chunk
            return
        else:
            sql = "SELECT pubkey, relays FROM devices WHERE payload <> 'iris'"
        async for chunk in self._chunks(sql, args):
            yield chunk

    async def _chunks(
        self, sql: str, args: tuple[object, ...]
    ) -> AsyncIterator[dict[str, tuple[str, ...]]]:
        async with self._db.connection() as connection, connection.transaction():
            chunk: dict[str, tuple[str, ...]] = {}
            async for row in connection.cursor(sql, *args, prefetch=KEY_CHUNK):
                add_device_relays(chunk, row[0], row[1])
                if len(chunk) >= KEY_CHUNK:
                    yield chunk
                    chunk = {}
            if chunk:
                yield chunk

    async def notify_masks(
        self, shards: Collection[int] | None = None, count: int = DEFAULT_SHARDS
    ) -> dict[str, int]:
        """As on SQLite: the keys whose pairs asked for more than DMs, with the union of
        their masks (of `shards` out of `count`, when given)."""
        masks: dict[str, int] = {}
        for row in await self._db.fetch("SELECT pubkey, notify FROM devices WHERE notify <> 1"):
            key = str(row[0])
            if shards is None or shard_of(key, count) in shards:
                masks[key] = masks.get(key, 0) | int(row[1])
        return masks

    async def count(self) -> int:
        return int(await self._db.fetchval("SELECT count(*) FROM devices"))
