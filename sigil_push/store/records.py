"""What the store holds and hands out, the same on every engine: devices (registrations) and
outbox wakeups, and the rules both backends share for building and naming them.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, NamedTuple, TypeVar
from zoneinfo import ZoneInfo

from sigil_push.nostr.kinds import CONTACTS, MUTE_LIST

if TYPE_CHECKING:
    from hashlib import _Hash as Hash

    from sigil_push.nostr.event import Event

PAYLOAD_MODES = ("opaque", "sealed", "event_id", "event")
IRIS_PAYLOAD = "iris"
"""The payload of Iris subscriptions' targets (never a registration's: not in PAYLOAD_MODES);
their pushes are built from the event (iris/payload.py)."""
FULL_EVENT_MODES = frozenset({"event", "sealed", IRIS_PAYLOAD})
"""Payload modes whose wakeups need the event itself in the outbox."""
T = TypeVar("T")
NO_RELAYS: tuple[str, ...] = ()
"""The relays of a key whose devices name none (most keys): one shared tuple for all of them."""


def add_device_relays(watched: dict[str, tuple[str, ...]], pubkey: str, relays_json: str) -> None:
    """Fold one device's `relays` column (JSON text) into `watched[pubkey]`: the sorted union of
    the relays of the key's devices, as `DeviceStore.watched_keys` returns it.

    Called once per row of a million-key load, so the common case (no relays) builds no set,
    list or tuple at all: what a key costs at load is little more than its dict entry.
    """
    relays = NO_RELAYS if relays_json == "[]" else json.loads(relays_json)
    before = watched.get(pubkey)
    if before is None:
        watched[pubkey] = tuple(sorted(set(relays))) if relays else NO_RELAYS
    elif relays:
        watched[pubkey] = tuple(sorted(set(before).union(relays)))


def add_device_relays_tuple(
    watched: dict[str, tuple[str, ...]], pubkey: str, relays: tuple[str, ...]
) -> None:
    """`add_device_relays` for relays already read (a chunk of `DeviceStore.key_chunks`)."""
    before = watched.get(pubkey)
    if before is None:
        watched[pubkey] = relays
    elif relays:
        watched[pubkey] = tuple(sorted(set(before).union(relays)))


IN_LIST_CHUNK = 500
"""Values per `IN (...)` list: SQLite refuses a statement with more than its variable limit
(999 before 3.32) and asyncpg more than 32,767 arguments, and a committer batch or a REQ's keys
can name more; a statement that always fails would be retried as if the database were busy."""


def in_chunks(values: Sequence[T], size: int = IN_LIST_CHUNK) -> Iterator[Sequence[T]]:
    """`values` IN_LIST_CHUNK at a time, for statements that take them as `IN` lists."""
    for start in range(0, len(values), size):
        yield values[start : start + size]


@dataclass(frozen=True, slots=True)
class WebPushKeys:
    """RFC 8291 keys of a UnifiedPush/WebPush subscription (base64url, as clients give them)."""

    p256dh: str
    auth: str


SENDERS = ("anyone", "follows")
KEY_BYTES = 32

RULE_COLUMNS = (
    "pause_until, senders, present_until, muted_count, list_flags, notify, quiet_from, quiet_to,"
    " quiet_tz"
)
"""What a pair's owner chose (issues 20 and 32), read after the device columns. `list_flags`
packs its npub's stored lists (1: a kind 10000 with entries, 2: a kind 3), kept on the pair's
row by whoever writes a list or a pair (`LIST_FLAGS`), so that reading a device asks nothing
more; `notify` is the bit mask of its notification classes (`bridge.watches.notify_mask`, 1:
`["dm"]`); `quiet_*` its quiet hours (seconds of the local day, IANA zone) or NULL."""
DEFAULT_NOTIFY = 1
"""`notify` = `["dm"]` (the mask `bridge.watches.notify_mask` gives it)."""
DAY_SECONDS = 86_400


class QuietHours(NamedTuple):
    """A pair's quiet window: from `start` to `end` (seconds of the local day; the window
    crosses midnight when `end` < `start`; never equal) in the IANA zone `tz`. Daylight-saving
    changes follow the zone: the window is wall-clock time."""

    start: int
    end: int
    tz: str

    def _local(self, now: float) -> datetime:
        return datetime.fromtimestamp(now, ZoneInfo(self.tz))

    def inside(self, now: float) -> bool:
        local = self._local(now)
        second = local.hour * 3600 + local.minute * 60 + local.second
        if self.start < self.end:
            return self.start <= second < self.end
        return second >= self.start or second < self.end

    def end_after(self, now: float) -> int:
        """Unix seconds of the first end of the window after `now` (when a window that is on
        at `now` ends)."""
        local = self._local(now)
        hour, rest = divmod(self.end, 3600)
        minute, second = divmod(rest, 60)
        for days in range(3):
            day = (local + timedelta(days=days)).date()
            candidate = datetime(day.year, day.month, day.day, hour, minute, second,
                                 tzinfo=local.tzinfo)
            stamp = int(candidate.timestamp())
            if stamp > now:
                return stamp
        return int(now) + DAY_SECONDS

    @staticmethod
    def clock(seconds: int) -> str:
        """"HH:MM" (or "HH:MM:SS" when the seconds are not zero), as the API shows it."""
        hour, rest = divmod(seconds, 3600)
        minute, second = divmod(rest, 60)
        return f"{hour:02d}:{minute:02d}" + (f":{second:02d}" if second else "")
LIST_FLAGS = (
    f"(SELECT COALESCE(SUM(CASE WHEN l.kind = {MUTE_LIST} AND l.entry_count > 0 THEN 1"
    f" WHEN l.kind = {CONTACTS} THEN 2 ELSE 0 END), 0) FROM user_lists l"
    " WHERE l.pubkey = {pubkey})"
)
"""`list_flags` as the stored lists of the npub `{pubkey}` (a column or a placeholder) say:
computed when a pair is written and, for every pair of the npub, when one of its lists is."""


class Rules(NamedTuple):
    """What may keep a pair from being woken. A device whose columns are all at their defaults
    carries None instead (nearly every device): the bridge's check then costs one comparison."""

    pause_until: int | None
    senders: str
    present_until: int | None
    muted_count: int
    mute_list: bool
    """The npub has a kind 10000 with at least one key stored."""
    follows_known: bool
    """The npub has a kind 3 stored (`senders = "follows"` filters only then)."""
    notify: int = DEFAULT_NOTIFY
    """The bit mask of the pair's notification classes (`bridge.watches`)."""
    quiet: QuietHours | None = None

    @classmethod
    def from_columns(cls, row: Sequence[object]) -> Rules | None:
        """The nine RULE_COLUMNS as read, or None when none of them can suppress a wakeup or
        says anything `GET /registrations` shows."""
        pause_until, senders, present_until, muted_count, lists, notify, start, end, tz = row
        flags = int(str(lists))
        mask = int(str(notify))
        if (pause_until is None and senders == "anyone" and present_until is None
                and not muted_count and not flags and mask == DEFAULT_NOTIFY and tz is None):
            return None
        quiet = (
            None if tz is None or start is None or end is None
            else QuietHours(int(str(start)), int(str(end)), str(tz))
        )
        return cls(
            None if pause_until is None else int(str(pause_until)), str(senders),
            None if present_until is None else int(str(present_until)), int(str(muted_count)),
            bool(flags & 1), bool(flags & 2), mask, quiet,
        )

    @property
    def checks_author(self) -> bool:
        """A kind 4's author must be looked up for this pair (mute lists, follows-only)."""
        return bool(self.muted_count or self.mute_list
                    or (self.senders == "follows" and self.follows_known))


def pack_keys(keys: Iterable[str]) -> bytes:
    """Hex keys as one sorted blob of 32-byte keys (duplicates dropped): a list costs 32 bytes
    a key in the store and none in memory, and `has_key` finds one by bisection."""
    return b"".join(sorted({bytes.fromhex(key) for key in keys}))


def has_key(packed: bytes, key: bytes) -> bool:
    """Whether the sorted blob `pack_keys` made holds the 32-byte `key`."""
    low, high = 0, len(packed) // KEY_BYTES
    while low < high:
        middle = (low + high) // 2
        at = packed[middle * KEY_BYTES : (middle + 1) * KEY_BYTES]
        if at == key:
            return True
        if at < key:
            low = middle + 1
        else:
            high = middle
    return False


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
    device_key: str | None = None
    """x-only public key that `sealed` wakeups are encrypted to; never shown, never logged."""
    rules: Rules | None = None
    """None when read without RULE_COLUMNS (delivery's rows), or when all are defaults."""

    @property
    def token_suffix(self) -> str:
        """The only part of a token that may appear in logs and API answers."""
        return self.token[-6:]

    @classmethod
    def from_row(cls, row: Sequence[object]) -> Device:
        keys = WebPushKeys(str(row[6]), str(row[7])) if row[6] and row[7] else None
        # most devices name no relays: no JSON parse for them (a due batch makes hundreds)
        relays = NO_RELAYS if row[5] == "[]" else tuple(json.loads(str(row[5])))
        return cls(
            int(str(row[0])), str(row[1]), str(row[2]), str(row[3]), str(row[4]), relays, keys,
            int(str(row[8])), str(row[9]) if row[9] else None,
            Rules.from_columns(row[10:19]) if len(row) > 10 else None,
        )


@dataclass(frozen=True, slots=True)
class PreferenceChange:
    """What one request changes of a pair's preferences (validated; absent keys stay)."""

    sets_pause: bool = False
    pause_until: int | None = None
    """With `sets_pause`: the new value (None clears it)."""
    senders: str | None = None
    muted: bytes | None = None
    """The new private mute list, packed (`pack_keys`; b"" clears it); None: unchanged."""
    muted_count: int = 0
    notify: int | None = None
    """The new `notify` mask; None: unchanged."""
    sets_quiet: bool = False
    quiet: QuietHours | None = None
    """With `sets_quiet`: the new quiet hours (None clears them)."""

    @property
    def empty(self) -> bool:
        return (not self.sets_pause and self.senders is None and self.muted is None
                and self.notify is None and not self.sets_quiet)


@dataclass(frozen=True, slots=True)
class Registration:
    device: Device
    created: bool


RegistrationListener = Callable[[str], None]


SIBLINGS = 2
"""How many times its `limit` a `due` batch may grow by pulling in the other due rows of the
tokens it picked (a flood to one phone must not turn a batch into the whole outbox)."""


class Wakeup(NamedTuple):
    """One outbox row as `due` hands it out. A NamedTuple (immutable) rather than a frozen
    dataclass, whose __init__ sets each field through object.__setattr__: a due batch builds
    up to a thousand of them (0.4 against 1.2 µs each)."""

    id: int
    device: Device
    event_id: str
    relay: str
    event_json: str | None
    first_seen_ms: int
    attempts: int

    @property
    def device_id(self) -> int:
        return self.device.id


WakeupRow = tuple[int, str, str, str | None, int]
"""(device_id, event_id, relay, event_json, first_seen_ms) of one outbox row to insert."""


def wakeup_rows(batch: Sequence[tuple[Event, str, int, Sequence[Device]]]) -> list[WakeupRow]:
    """One row per (event, device); the full event JSON is built once per event, and only
    for devices whose payload mode carries it (`event`, `sealed`)."""
    rows: list[WakeupRow] = []
    for event, relay, first_seen_ms, devices in batch:
        full_event: str | None = None
        for device in devices:
            wants_event = device.payload in FULL_EVENT_MODES
            if wants_event and full_event is None:
                full_event = json.dumps(event.to_json(), separators=(",", ":"), ensure_ascii=False)
            rows.append((device.id, event.id, relay,
                         full_event if wants_event else None, first_seen_ms))
    return rows


_KEYED: dict[bytes, tuple[Hash, Hash]] = {}
"""The HMAC-SHA256 states keyed with each outbox secret in use (one per database; a few in
tests): the inner and outer hashes after their key block."""
_MAX_KEYED = 8
_BLOCK = 64
"""SHA-256's block size, which HMAC pads the key to."""


def _keyed(secret: bytes) -> tuple[Hash, Hash]:
    """HMAC's two keyed hashes (RFC 2104): SHA-256 over the padded key XOR ipad, and XOR opad."""
    key = hashlib.sha256(secret).digest() if len(secret) > _BLOCK else secret
    key = key.ljust(_BLOCK, b"\0")
    return (hashlib.sha256(bytes(b ^ 0x36 for b in key)),
            hashlib.sha256(bytes(b ^ 0x5C for b in key)))


def collapse_id(secret: bytes, wakeup_id: int) -> str:
    """The keyed id of the push that starts with row `wakeup_id` (the same on every engine):
    HMAC-SHA256(secret, str(wakeup_id)) in hex, cut to 32 characters.

    One per push: the two keyed hashes are made once and copied for each id, since the key
    setup (two extra SHA-256 blocks) was most of the cost of a one-shot digest. They are kept
    as hashlib objects, whose copy, update and digest are C calls, rather than an hmac.HMAC,
    whose copy and hexdigest are Python methods (1.9 against 0.9 µs an id).
    """
    keyed = _KEYED.get(secret)
    if keyed is None:
        if not secret:
            raise RuntimeError("Outbox.resume() must run before collapse ids are made")
        if len(_KEYED) >= _MAX_KEYED:
            _KEYED.clear()
        keyed = _KEYED[secret] = _keyed(secret)
    inner = keyed[0].copy()
    inner.update(str(wakeup_id).encode())
    outer = keyed[1].copy()
    outer.update(inner.digest())
    return outer.hexdigest()[:32]


StoredRelayList = tuple[str, int, int, tuple[str, ...]]
"""A user's relay list as stored: (pubkey, kind, created_at, relays)."""


@dataclass(frozen=True)
class StoredSession:
    """A delegated-auth signer session as stored, its secrets sealed (`sigil_push.sealed`)."""

    pubkey: str
    signer_pubkey: str
    relays: tuple[str, ...]
    sealed_secret: str | None
    sealed_client_key: str
    status: str
    detail: str


def stored_session(row: Iterable[object]) -> StoredSession:
    """A `StoredSession` from a row of (pubkey, signer_pubkey, relays JSON, sealed_secret,
    sealed_client_key, status, detail), as either engine reads it."""
    pubkey, signer, relays, sealed_secret, sealed_client, status, detail = row
    return StoredSession(
        str(pubkey), str(signer), tuple(json.loads(str(relays))),
        None if sealed_secret is None else str(sealed_secret), str(sealed_client),
        str(status), str(detail),
    )


BRIDGE_KEY_LEFT = "bridge key left behind"
"""`migrate --from`'s count of old bridge-key rows it did not copy (store/postgres/copy.py)."""
