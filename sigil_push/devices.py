"""Registered devices: who gets woken up, and how.

Only what delivery needs is stored (the recipient's pubkey, the device token, the payload mode,
the user's DM relays). Whoever must react to a change of registrations (the bridge's
subscriptions) registers a listener instead of being called by the API directly.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import aiosqlite

PLATFORMS = ("ios", "android", "unifiedpush")
PAYLOAD_MODES = ("opaque", "event_id", "event")

_COLUMNS = (
    "id, pubkey, platform, token, payload, relays, webpush_p256dh, webpush_auth, registered_at"
)


class TooManyDevices(Exception):
    """The npub already has the maximum number of devices."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"at most {limit} devices per npub")
        self.limit = limit


@dataclass(frozen=True, slots=True)
class WebPushKeys:
    """RFC 8291 keys of a UnifiedPush/WebPush subscription (base64url, as clients give them)."""

    p256dh: str
    auth: str


@dataclass(frozen=True, slots=True)
class Device:
    id: int
    pubkey: str
    platform: str
    token: str
    payload: str
    relays: tuple[str, ...]
    webpush_keys: WebPushKeys | None
    registered_at: int

    @property
    def token_suffix(self) -> str:
        """The only part of a token that may appear in logs and API answers."""
        return self.token[-6:]

    @classmethod
    def from_row(cls, row: Sequence[object]) -> Device:
        keys = WebPushKeys(str(row[6]), str(row[7])) if row[6] and row[7] else None
        relays = tuple(json.loads(str(row[5])))
        return cls(
            int(str(row[0])), str(row[1]), str(row[2]), str(row[3]), str(row[4]), relays, keys,
            int(str(row[8])),
        )


@dataclass(frozen=True, slots=True)
class Registration:
    device: Device
    created: bool
    previous_pubkey: str | None


RegistrationListener = Callable[[str], None]


class Devices:
    """Device registrations in SQLite, with listeners told which pubkey changed."""

    def __init__(self, connection: aiosqlite.Connection) -> None:
        self._db = connection
        self._listeners: list[RegistrationListener] = []

    def add_listener(self, listener: RegistrationListener) -> None:
        self._listeners.append(listener)

    def _changed(self, pubkeys: Iterable[str | None]) -> None:
        for pubkey in {p for p in pubkeys if p}:
            for listener in self._listeners:
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
    ) -> Registration:
        """Insert or update the device with this token; a token registered by another npub moves.

        The device limit is enforced inside the writing statement itself, so registrations need
        no lock and concurrent ones pipeline through SQLite instead of queueing behind each other.
        The preceding read only tells 201 from 200 and which previous owner to notify.
        """
        now = int(time.time())
        [(previous_pubkey,)] = await self._db.execute_fetchall(
            "SELECT (SELECT pubkey FROM devices WHERE token = ?)", (token,)
        )
        rows = await self._db.execute_fetchall(
            "INSERT INTO devices (pubkey, platform, token, payload, relays, webpush_p256dh,"
            " webpush_auth, registered_at, updated_at) SELECT ?, ?, ?, ?, ?, ?, ?, ?, ?"
            " WHERE ? = 0 OR (SELECT COUNT(*) FROM devices WHERE pubkey = ? AND token != ?) < ?"
            " ON CONFLICT (token) DO UPDATE SET pubkey = excluded.pubkey,"
            " platform = excluded.platform, payload = excluded.payload,"
            " relays = excluded.relays, webpush_p256dh = excluded.webpush_p256dh,"
            " webpush_auth = excluded.webpush_auth, updated_at = excluded.updated_at,"
            " registered_at = CASE WHEN devices.pubkey = excluded.pubkey"
            " THEN devices.registered_at ELSE excluded.registered_at END"
            f" RETURNING {_COLUMNS}",
            (
                pubkey, platform, token, payload, json.dumps(list(relays)),
                webpush_keys.p256dh if webpush_keys else None,
                webpush_keys.auth if webpush_keys else None,
                now, now,
                max_devices, pubkey, token, max_devices,
            ),
        )
        if not rows:
            raise TooManyDevices(max_devices)
        row = next(iter(rows))
        moved_from = previous_pubkey if previous_pubkey not in (None, pubkey) else None
        self._changed([pubkey, moved_from])
        return Registration(Device.from_row(row), previous_pubkey is None, moved_from)

    async def unregister(self, pubkey: str, token: str) -> int:
        """Remove the device with `token` if `pubkey` owns it; returns how many were removed."""
        removed = len(list(
            await self._db.execute_fetchall(
                "DELETE FROM devices WHERE pubkey = ? AND token = ? RETURNING id", (pubkey, token)
            )
        ))
        if removed:
            self._changed([pubkey])
        return removed

    async def forget(self, device_id: int) -> Device | None:
        """Delete a device whose token the provider declared dead."""
        rows = await self._db.execute_fetchall(
            f"DELETE FROM devices WHERE id = ? RETURNING {_COLUMNS}", (device_id,)
        )
        if not rows:
            return None
        device = Device.from_row(next(iter(rows)))
        self._changed([device.pubkey])
        return device

    async def of_pubkey(self, pubkey: str) -> list[Device]:
        rows = await self._db.execute_fetchall(
            f"SELECT {_COLUMNS} FROM devices WHERE pubkey = ? ORDER BY id", (pubkey,)
        )
        return [Device.from_row(row) for row in rows]

    async def of_pubkeys(self, pubkeys: Sequence[str]) -> list[Device]:
        """Devices of any of `pubkeys` (the recipients named by one event's `p` tags)."""
        if not pubkeys:
            return []
        marks = ",".join("?" * len(pubkeys))
        rows = await self._db.execute_fetchall(
            f"SELECT {_COLUMNS} FROM devices WHERE pubkey IN ({marks}) ORDER BY id", tuple(pubkeys)
        )
        return [Device.from_row(row) for row in rows]

    async def by_id(self, device_id: int) -> Device | None:
        rows = await self._db.execute_fetchall(
            f"SELECT {_COLUMNS} FROM devices WHERE id = ?", (device_id,)
        )
        return Device.from_row(next(iter(rows))) if rows else None

    async def watched_keys(self) -> dict[str, tuple[str, ...]]:
        """Every registered pubkey with the union of its devices' own relays."""
        watched: dict[str, set[str]] = {}
        # one call, not a cursor iterated across awaits: an open SELECT on the shared connection
        # makes writes queued meanwhile fail with SQLITE_BUSY without waiting (see Outbox.due)
        for pubkey, relays in await self._db.execute_fetchall("SELECT pubkey, relays FROM devices"):
            watched.setdefault(str(pubkey), set()).update(json.loads(str(relays)))
        return {pubkey: tuple(sorted(relays)) for pubkey, relays in watched.items()}

    async def count(self) -> int:
        [(count,)] = await self._db.execute_fetchall("SELECT COUNT(*) FROM devices")
        return int(count)
