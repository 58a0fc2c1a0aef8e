"""Registered devices: who gets woken up, and how.

A registration is an (npub, device token) pair: one phone with several accounts holds one
token registered by several npubs, each having proven its own key. Registering never takes a
token away from another npub (anyone who learns a token could otherwise take it over), and
each npub removes only its own pair. Only a provider saying the token is dead removes every
pair with it.

The targets of Iris subscriptions are rows here too (payload 'iris', written by the Iris store,
sigil_push/store/sqlite/iris.py) so that delivery treats them as any device; the registration
paths (limits, lookups by pubkey, the watched keys, preferences) leave them out.

Only what delivery needs is stored (the recipient's pubkey, the device token, the payload mode,
the user's DM relays). Whoever must react to a change of registrations (the bridge's
subscriptions) registers a listener instead of being called by the API directly.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Collection, Iterable, Sequence
from operator import attrgetter

import aiosqlite

from sigil_push.shards import DEFAULT_SHARDS, shard_of
from sigil_push.store.limits import Occupancy, refusal
from sigil_push.store.records import (
    LIST_FLAGS,
    RULE_COLUMNS,
    Device,
    PreferenceChange,
    Registration,
    RegistrationListener,
    WebPushKeys,
    add_device_relays,
    in_chunks,
)

KEY_CHUNK = 10_000
"""Keys per chunk of `key_chunks`, as on PostgreSQL."""
_COLUMNS = (
    "id, pubkey, platform, token, payload, relays, webpush_p256dh, webpush_auth, registered_at,"
    " device_key"
)
_WITH_RULES = f"{_COLUMNS}, {RULE_COLUMNS}"
"""A pair's columns with what its owner chose (the bridge's and GET /registrations' reads)."""


_OCCUPANCY = (
    "SELECT COALESCE(SUM(pubkey = ?1 AND token = ?2 AND payload <> 'iris'), 0),"
    " COALESCE(SUM(pubkey = ?1 AND payload <> 'iris'), 0),"
    " COALESCE(SUM(token = ?2 AND payload <> 'iris'), 0),"
    " COALESCE(SUM(pubkey = ?1 AND token = ?2 AND payload = 'iris'), 0)"
    " FROM devices WHERE pubkey = ?1 OR token = ?2"
)
"""The `Occupancy` a registration of (pubkey, token) finds (Iris targets apart)."""
_WRITE_PAIR = (
    "INSERT INTO devices (pubkey, platform, token, payload, relays, webpush_p256dh,"
    " webpush_auth, registered_at, updated_at, device_key, list_flags)"
    " SELECT ?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, {flags} WHERE {{guard}}"
    " ON CONFLICT (token, pubkey) DO UPDATE SET platform = excluded.platform,"
    " payload = excluded.payload, relays = excluded.relays,"
    " webpush_p256dh = excluded.webpush_p256dh, webpush_auth = excluded.webpush_auth,"
    " updated_at = excluded.updated_at, device_key = excluded.device_key,"
    " list_flags = excluded.list_flags"
    f" RETURNING {_WITH_RULES}"
).format(flags=LIST_FLAGS.format(pubkey="?1"))
"""A pair written with the `list_flags` its npub's stored lists give (the lists' writer sets
them on pairs already there; SQLite runs one write at a time, so no pair misses both)."""
_UPSERT_IF_PAIR = _WRITE_PAIR.format(
    guard="EXISTS (SELECT 1 FROM devices WHERE token = ?11 AND pubkey = ?12)"
)
"""Update the pair read as existing, if it still does."""
_INSERT_IF_UNCHANGED = _WRITE_PAIR.format(
    guard="NOT EXISTS (SELECT 1 FROM devices WHERE token = ?11 AND pubkey = ?12)"
    " AND (SELECT COUNT(*) FROM devices WHERE pubkey = ?13 AND payload <> 'iris') = ?14"
    " AND (SELECT COUNT(*) FROM devices WHERE token = ?15 AND payload <> 'iris') = ?16"
)
"""Insert the new pair if the counts its limits were decided on still hold."""


class Devices:
    """Device registrations in SQLite, with listeners told which pubkey changed."""

    def __init__(self, connection: aiosqlite.Connection) -> None:
        self._db = connection
        self._listeners: list[RegistrationListener] = []
        self._rules_listeners: list[RegistrationListener] = []

    def add_listener(self, listener: RegistrationListener) -> None:
        self._listeners.append(listener)

    def add_rules_listener(self, listener: RegistrationListener) -> None:
        self._rules_listeners.append(listener)

    def _changed(self, pubkeys: Iterable[str | None]) -> None:
        for pubkey in {p for p in pubkeys if p}:
            for listener in self._listeners:
                listener(pubkey)

    def _rules_changed(self, pubkey: str) -> None:
        for listener in self._rules_listeners:
            listener(pubkey)

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
        """Insert or update the (pubkey, token) pair; other npubs' pairs are never touched.
        An update replaces everything the client sends, the device key included (absent: none),
        and keeps the preferences, which the returned device carries (the API's answer shows them).

        The limits (`store.limits`) are decided on the counts read first; the write then goes
        only if they still hold, checked inside the inserting statement itself, so
        registrations need no lock and concurrent ones pipeline through SQLite instead of
        queueing behind each other. When another registration of the same npub or token
        moved the counts in between, they are read again and the decision taken anew (each
        such round lets at least that other registration through, so it ends).
        """
        now = int(time.time())
        values = (
            pubkey, platform, token, payload, json.dumps(list(relays)),
            webpush_keys.p256dh if webpush_keys else None,
            webpush_keys.auth if webpush_keys else None,
            now, now, device_key,
        )
        while True:
            [(pair, of_npub, of_token, iris)] = await self._db.execute_fetchall(
                _OCCUPANCY, (pubkey, token)
            )
            found = Occupancy(bool(pair), int(of_npub or 0), int(of_token or 0), bool(iris))
            refused = refusal(found, max_devices, max_accounts)
            if refused is not None:
                raise refused
            if found.pair_exists:
                rows = await self._db.execute_fetchall(
                    _UPSERT_IF_PAIR, (*values, token, pubkey)
                )
            else:
                rows = await self._db.execute_fetchall(_INSERT_IF_UNCHANGED, (
                    *values, token, pubkey, pubkey, found.of_npub, token, found.of_token,
                ))
            if rows:
                break
        self._changed([pubkey])
        return Registration(Device.from_row(next(iter(rows))), not found.pair_exists)

    async def unregister(self, pubkey: str, token: str) -> int:
        """Remove `pubkey`'s own pair with `token`; returns how many were removed (0 or 1).
        Other npubs' registrations of the same token stay."""
        removed = len(list(
            await self._db.execute_fetchall(
                "DELETE FROM devices WHERE pubkey = ? AND token = ? AND payload <> 'iris'"
                " RETURNING id", (pubkey, token)
            )
        ))
        if removed:
            self._changed([pubkey])
        return removed

    async def forget(self, device_id: int) -> Device | None:
        """The provider declared this registration's token dead: delete every pair with that
        token (all accounts on the phone); returns the named registration, if still there.

        Only pairs on the platform that answered: a token string registered under another
        platform was never asked, and must not be removable by whoever registered it there.
        """
        rows = await self._db.execute_fetchall(
            "DELETE FROM devices WHERE (platform, token) ="
            f" (SELECT platform, token FROM devices WHERE id = ?) RETURNING {_COLUMNS}",
            (device_id,),
        )
        forgotten = [Device.from_row(row) for row in rows]
        self._changed(device.pubkey for device in forgotten)
        return next((device for device in forgotten if device.id == device_id), None)

    async def set_preferences(
        self, pubkey: str, token: str, change: PreferenceChange
    ) -> Device | None:
        """Apply `change` to `pubkey`'s own pair with `token`, all of it in one UPDATE (a new
        private mute list replaces the old one whole); None when the caller has no such pair.
        Other npubs' pairs with the same token are never touched."""
        quiet = change.quiet
        rows = await self._db.execute_fetchall(
            "UPDATE devices SET pause_until = CASE WHEN ? THEN ? ELSE pause_until END,"
            " senders = COALESCE(?, senders), muted = CASE WHEN ? THEN ? ELSE muted END,"
            " muted_count = CASE WHEN ? THEN ? ELSE muted_count END,"
            " notify = COALESCE(?, notify),"
            " quiet_from = CASE WHEN ? THEN ? ELSE quiet_from END,"
            " quiet_to = CASE WHEN ? THEN ? ELSE quiet_to END,"
            " quiet_tz = CASE WHEN ? THEN ? ELSE quiet_tz END"
            f" WHERE pubkey = ? AND token = ? AND payload <> 'iris' RETURNING {_WITH_RULES}",
            (
                change.sets_pause, change.pause_until, change.senders,
                change.muted is not None, change.muted or None,
                change.muted is not None, change.muted_count, change.notify,
                change.sets_quiet, None if quiet is None else quiet.start,
                change.sets_quiet, None if quiet is None else quiet.end,
                change.sets_quiet, None if quiet is None else quiet.tz,
                pubkey, token,
            ),
        )
        if not rows:
            return None
        self._rules_changed(pubkey)
        return Device.from_row(next(iter(rows)))

    async def set_presence(self, pubkey: str, token: str, until: int | None) -> bool:
        """The app is in the foreground until `until` (None: it left, ending the presence
        without a lapse wakeup). False when the caller has no pair with `token`."""
        rows = await self._db.execute_fetchall(
            "UPDATE devices SET present_until = ? WHERE pubkey = ? AND token = ?"
            " AND payload <> 'iris' RETURNING id",
            (until, pubkey, token),
        )
        if not rows:
            return False
        if until is None:
            await self._db.execute(
                "DELETE FROM deferred_wakeups WHERE device_id = ? AND reason = 'present'",
                (int(next(iter(rows))[0]),),
            )
        self._rules_changed(pubkey)
        return True

    async def of_pubkey(self, pubkey: str) -> list[Device]:
        rows = await self._db.execute_fetchall(
            f"SELECT {_WITH_RULES} FROM devices WHERE pubkey = ? AND payload <> 'iris' ORDER BY id",
            (pubkey,),
        )
        return [Device.from_row(row) for row in rows]

    async def of_pubkeys(self, pubkeys: Sequence[str]) -> list[Device]:
        """Devices of any of `pubkeys` (the recipients named by one event's `p` tags)."""
        found: list[Device] = []
        for chunk in in_chunks(pubkeys):
            rows = await self._db.execute_fetchall(
                f"SELECT {_WITH_RULES} FROM devices WHERE pubkey IN"
                f" ({','.join('?' * len(chunk))}) AND payload <> 'iris'", tuple(chunk),
            )
            found.extend(Device.from_row(row) for row in rows)
        return sorted(found, key=attrgetter("id"))

    async def by_id(self, device_id: int) -> Device | None:
        rows = await self._db.execute_fetchall(
            f"SELECT {_WITH_RULES} FROM devices WHERE id = ?", (device_id,)
        )
        return Device.from_row(next(iter(rows))) if rows else None

    async def watched_keys(self) -> dict[str, tuple[str, ...]]:
        """Every registered pubkey with the union of its devices' own relays."""
        watched: dict[str, tuple[str, ...]] = {}
        # one call, not a cursor iterated across awaits: an open SELECT on the shared connection
        # makes writes queued meanwhile fail with SQLITE_BUSY without waiting (see Outbox.due)
        for pubkey, relays in await self._db.execute_fetchall(
            "SELECT pubkey, relays FROM devices WHERE payload <> 'iris'"
        ):
            add_device_relays(watched, str(pubkey), str(relays))
        return watched

    async def key_chunks(
        self, shards: Collection[int] | None = None, count: int = DEFAULT_SHARDS
    ) -> AsyncIterator[dict[str, tuple[str, ...]]]:
        """`watched_keys` (of `shards` out of `count` only, when given) in chunks, as
        `PostgresDevices.key_chunks` gives them: one worker on SQLite holds every shard, so
        this is one read, handed over in pieces."""
        watched = await self.watched_keys()
        if shards is not None:
            wanted = frozenset(shards)
            watched = {k: r for k, r in watched.items() if shard_of(k, count) in wanted}
        keys = list(watched)
        for start in range(0, len(keys), KEY_CHUNK):
            yield {k: watched[k] for k in keys[start : start + KEY_CHUNK]}

    async def notify_masks(
        self, shards: Collection[int] | None = None, count: int = DEFAULT_SHARDS
    ) -> dict[str, int]:
        """The keys (of `shards` out of `count`, when given) whose pairs asked for more than
        DMs, each with the union of its pairs' `notify` masks (`devices_notify` index: the
        rare rows only)."""
        masks: dict[str, int] = {}
        for pubkey, mask in await self._db.execute_fetchall(
            "SELECT pubkey, notify FROM devices WHERE notify != 1"
        ):
            key = str(pubkey)
            if shards is None or shard_of(key, count) in shards:
                masks[key] = masks.get(key, 0) | int(mask)
        return masks

    async def count(self) -> int:
        [(count,)] = await self._db.execute_fetchall("SELECT COUNT(*) FROM devices")
        return int(count)

    async def follows_only(self) -> list[str]:
        rows = await self._db.execute_fetchall(
            "SELECT DISTINCT pubkey FROM devices WHERE senders = 'follows' AND payload <> 'iris'"
        )
        return [str(pubkey) for (pubkey,) in rows]
