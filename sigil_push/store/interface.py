"""What the rest of sigil-push uses from its store, whatever engine is underneath.

Two engines implement these protocols: SQLite (one process, the embedded default) and
PostgreSQL (any number of `serve` processes sharing one database). Behaviour is the same on
both; what differs is how it is made safe: SQLite has one writer, PostgreSQL relies on unique
constraints (handled event ids, (event, device) outbox rows, NIP-98 ids) and on claims that
lapse, so that workers never need to trust each other.

Only `sigil_push.store` speaks SQL. Callers get typed repositories, each with one class per
engine written in that engine's own SQL (`store/sqlite/...`, `store/postgres/...`):

- `DeviceStore`, `OutboxStore`: registrations and the durable outbox;
- `UserListStore`: the users' kind 10000/3 lists, the kind 4 author checks and the presence
  lapse marks and claims (issue 20), on the bridge's connection;
- `RelayStateStore`: the bridge's baselines, live cursors and the users' relay lists, plus the
  bookkeeping writes (`BookkeepingOp`) the bridge queues behind its events;
- `SeenRows`, `AuthIdRows`: the rows under `store.seen.SeenEvents` and
  `store.auth_ids.UsedAuthIds` (which keep the engine-free logic: caches, batching);
- `SignerSessionStore`, `AuthModeStore` and `MetaStore` (declared by `identity`, its user):
  delegated-auth sessions, learned NIP-42 modes, and the instance's key/value facts (an old
  bridge key, the instance key);
- `BridgeConnection.transaction()`: the unit of work of the bridge's committer, instead of
  raw BEGIN/COMMIT;
- `Coordination`: how workers of one instance coordinate (one process on SQLite; leases,
  signer-session sync, NOTIFY and the instance-key check on PostgreSQL).
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Iterable, Sequence
from contextlib import AbstractAsyncContextManager, AsyncExitStack
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, TypeVar

if TYPE_CHECKING:
    from sigil_push.identity import MetaStore
    from sigil_push.nostr.event import Event
    from sigil_push.shards import ShardSet
    from sigil_push.store.preferences import AuthorCheck, Deferred, Judge, UserList
    from sigil_push.store.records import (
        Device,
        PreferenceChange,
        Registration,
        RegistrationListener,
        StoredRelayList,
        StoredSession,
        Wakeup,
        WebPushKeys,
    )


class DeviceStore(Protocol):
    """(npub, device token) registrations; listeners learn which pubkey changed."""

    def add_listener(self, listener: RegistrationListener) -> None: ...

    def add_rules_listener(self, listener: RegistrationListener) -> None:
        """Be told which pubkey's pair changed what wakes it (`set_preferences`,
        `set_presence`) and nothing else: no relay, no device came or went."""
        ...

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
    ) -> Registration: ...

    async def unregister(self, pubkey: str, token: str) -> int: ...

    async def set_preferences(
        self, pubkey: str, token: str, change: PreferenceChange
    ) -> Device | None: ...

    async def set_presence(self, pubkey: str, token: str, until: int | None) -> bool: ...

    async def forget(self, device_id: int) -> Device | None: ...

    async def of_pubkey(self, pubkey: str) -> list[Device]: ...

    async def of_pubkeys(self, pubkeys: Sequence[str]) -> list[Device]: ...

    async def by_id(self, device_id: int) -> Device | None: ...

    async def watched_keys(self) -> dict[str, tuple[str, ...]]: ...

    def key_chunks(
        self, shards: Collection[int] | None = None, count: int = ...
    ) -> AsyncIterator[dict[str, tuple[str, ...]]]: ...

    async def notify_masks(
        self, shards: Collection[int] | None = None, count: int = ...
    ) -> dict[str, int]: ...

    async def count(self) -> int: ...

    async def follows_only(self) -> list[str]:
        """The pubkeys with a pair whose `senders` is "follows" (their kind 3 is read)."""
        ...


class OutboxStore(Protocol):
    """The durable outbox: wakeups on disk before the first send, removed on a final outcome."""

    ready: asyncio.Event

    async def enqueue(
        self, event: Event, relay: str, first_seen_ms: int, devices: Sequence[Device]
    ) -> int: ...

    async def enqueue_many(
        self, batch: Sequence[tuple[Event, str, int, Sequence[Device]]]
    ) -> int:
        """Queue one wakeup per (event, device); returns how many rows were added. The
        committer hands an event over once, in the transaction that records it as seen: on
        PostgreSQL a (device, event) already queued (by another worker during a shard's
        hand-over) is skipped; SQLite's one writer needs no such constraint (migration 0014)."""
        ...

    async def resume(self, now_ms: int) -> int: ...

    def collapse_id(self, wakeup_id: int) -> str: ...

    async def due(
        self, now_ms: int, limit: int, platforms: Sequence[str] | None = None
    ) -> list[Wakeup]: ...

    async def next_due_ms(self) -> int | None: ...

    async def hold(self, wakeup_ids: Sequence[int], next_attempt_ms: int) -> None:
        """Give back rows `due` returned that are not sent now (a coalescing window, a rate
        limit, a host cap), due again at `next_attempt_ms`, with no attempt counted."""
        ...

    async def complete(self, wakeup_ids: Sequence[int]) -> None: ...

    async def reschedule(self, wakeup_ids: Sequence[int], next_attempt_ms: int) -> None: ...

    async def release_claims(self, claimed_before_ms: int, live: Collection[int]) -> int: ...

    async def oldest_first_seen_ms(self) -> int | None: ...

    async def depth(self) -> int: ...


F = TypeVar("F")
R = TypeVar("R")


class UserListStore(Protocol):
    """The users' own kind 10000/3 lists, the list checks and deferred wakeups (issues 20
    and 32), on the bridge committer's connection."""

    async def save(self, lists: Sequence[UserList]) -> list[UserList]: ...

    async def blocked(
        self, checks: Sequence[AuthorCheck[F]], judge: Judge[F, R]
    ) -> list[dict[int, R]]: ...

    async def defer(self, rows: Sequence[Deferred], now: int) -> None: ...

    async def claim_deferred(self, now: int) -> list[Deferred]: ...

    async def enqueue_deferred(
        self, wakeups: Sequence[tuple[int, str, str]], now_ms: int
    ) -> None: ...


class AuthIdStore(Protocol):
    """Single use of NIP-98 auth events (across every worker of an instance): an event is
    spent on one request (method, URL, body), and accepted again only for that request."""

    async def claim(self, event_id: str, sig: str, request: str) -> bool: ...

    async def prune(self) -> int: ...


class SeenStore(Protocol):
    """The bridge's memory of handled event ids and the relays that delivered them."""

    async def load(self) -> None: ...

    def delivered_by(self, event_id: str, relay: str) -> bool: ...

    def relays(self, event_id: str) -> tuple[str, ...] | None: ...

    def known(self, event_id: str) -> bool: ...

    async def lookup(self, event_ids: Iterable[str]) -> None: ...

    def first_delivery(
        self, event_id: str, relay: str, pending: dict[str, tuple[str, ...]]
    ) -> tuple[bool, bool]: ...

    def remember(self, pending: dict[str, tuple[str, ...]]) -> None: ...

    def __len__(self) -> int: ...

    async def save(
        self,
        new_events: Sequence[tuple[str, tuple[str, ...], int, int]],
        further: Sequence[tuple[str, str]],
    ) -> None: ...

    async def prune(self, now: int | None = None) -> int: ...


class BookkeepingOp(enum.Enum):
    """A write the bridge queues behind its events (`bridge.pending`) and the committer applies
    in its next transaction (`RelayStateStore.apply`); the rows' shapes are given per member."""

    INSERT_BASELINES = "insert_baselines"
    """(relay, pubkey, baselined_at): the key's first subscription on the relay is past."""
    DELETE_BASELINE = "delete_baseline"
    """(relay, pubkey): the key left that relay."""
    DELETE_BASELINES_OF = "delete_baselines_of"
    """(pubkey,): the key is no longer registered anywhere."""
    DELETE_RELAY_LISTS = "delete_relay_lists"
    """(pubkey,): ditto, its stored relay lists go too."""
    DELETE_USER_LISTS = "delete_user_lists"
    """(pubkey,): ditto, its kind 10000 and 3 (up to 2 x 320 KB), unless it has a device row
    by the time this is written (registered again meanwhile, or an Iris subscription's target,
    whose rules read the lists too)."""


class RelayStateStore(Protocol):
    """The bridge's per-relay memory: baselines, live cursors, and the users' relay lists."""

    async def baseline_page(
        self, after: tuple[str, str], pairs: Sequence[str] | None, limit: int
    ) -> list[tuple[str, str]]:
        """Up to `limit` (relay, pubkey) baselines after `after` in primary-key order; with
        `pairs`, only keys whose `pubkey[6:8]` is one of them."""
        ...

    async def baselines_of_keys(self, pubkeys: Sequence[str]) -> list[tuple[str, str]]:
        """The (relay, pubkey) baselines of these keys (one query: mind the parameter limit)."""
        ...

    async def cursors(self) -> dict[str, int]: ...

    async def save_cursors(self, cursors: Sequence[tuple[str, int]]) -> None:
        """Upsert (relay, live_until) in the order given (callers sort: lock order)."""
        ...

    async def relay_lists(self) -> list[StoredRelayList]: ...

    async def save_relay_lists(self, lists: Sequence[StoredRelayList]) -> None:
        """Upsert the lists in the order given (callers sort: lock order)."""
        ...

    async def apply(self, op: BookkeepingOp, rows: Sequence[tuple[Any, ...]]) -> None:
        """One queued bookkeeping write, its rows in the order given (lock order)."""
        ...


SeenRow = tuple[bytes, str, "str | None"]
"""(event_id, relays of its own row, relays of a legacy `seen_on_relay` row or None)."""


class SeenRows(Protocol):
    """The rows of handled event ids (`seen_events`, legacy `seen_on_relay`). Ids are their
    32 bytes here (half the index of hex text: `store.seen` converts)."""

    sole_writer: bool
    """Whether the rows' only writer is this process (SQLite: one process owns the file), so
    that a cache holding every row it loaded and wrote since needs no lookups."""

    async def recent(self, limit: int) -> list[SeenRow]:
        """The `limit` ids kept longest, oldest first."""
        ...

    async def lookup(self, event_ids: Sequence[bytes]) -> list[SeenRow]:
        """The rows of these ids (the caller pads the list to a few sizes: prepared once)."""
        ...

    async def insert(self, rows: Sequence[tuple[bytes, str, int]]) -> None:
        """New (event_id, relays, keep_until) rows; an id already there is left alone."""
        ...

    async def append_relays(self, rows: Sequence[tuple[str, bytes]]) -> None:
        """(suffix, event_id): append `suffix` to the event's relays."""
        ...

    async def prune(self, cutoff: int) -> int:
        """Drop rows kept until before `cutoff`; returns how many `seen_events` rows went."""
        ...


class IrisTarget(NamedTuple):
    """A push target of an Iris subscription: a `devices` row with payload 'iris'."""

    platform: str
    token: str
    p256dh: str | None
    auth: str | None


class StoredSubscription(NamedTuple):
    """An Iris subscription as stored: its owner, the document as received (JSON text) and
    the device ids of its targets."""

    id: str
    pubkey: str
    document: str
    device_ids: tuple[int, ...]


class IrisSubscriptionStore(Protocol):
    """Iris subscriptions (CONTRACT 3b) and the device rows of their targets.

    Writing a subscription writes its targets as devices (payload 'iris') of the subscriber,
    one per (subscriber, token) whatever the number of subscriptions naming it; the schema's
    trigger removes a device no subscription names any more and a subscription left with no
    target (migration 0018).
    """

    async def of_pubkey(self, pubkey: str) -> list[StoredSubscription]: ...

    async def get(self, subscription_id: str) -> StoredSubscription | None: ...

    async def put(
        self, subscription_id: str, pubkey: str, document: str, targets: Sequence[IrisTarget],
        max_per_pubkey: int,
    ) -> bool:
        """Create or fully replace; True when created. Raises NotYours (the id is another
        pubkey's), TooManySubscriptions, TargetTaken (a target is a registration's token)."""
        ...

    async def delete(self, subscription_id: str, pubkey: str) -> bool: ...

    async def all(self) -> list[StoredSubscription]:
        """Every subscription (the bridge's watches are compiled from them)."""
        ...

    def add_listener(self, listener: RegistrationListener) -> None:
        """Call `listener(pubkey)` after a write to `pubkey`'s subscriptions, through this
        worker or (PostgreSQL, over NOTIFY) any other: every bridge's watches follow."""
        ...


class AuthClaim(NamedTuple):
    """One auth event (`event_id`, `sig`) to be spent on `request` (store.auth_ids)."""

    event_id: str
    sig: str
    request: str


class AuthIdRows(Protocol):
    """The rows of spent NIP-98 auth events."""

    async def claim(self, claims: Sequence[AuthClaim], expires_at: int) -> set[tuple[str, str]]:
        """Record each new (event_id, sig) with its request; returns the (event_id, sig) of
        the claims accepted: new ones, and those already spent on the same request. The
        claims name distinct events."""
        ...

    async def prune(self, now: int) -> int: ...


class SignerSessionStore(Protocol):
    """Delegated-auth signer sessions (`auth_signers`), secrets sealed by the caller."""

    async def all(self) -> list[StoredSession]: ...

    async def get(self, pubkey: str) -> StoredSession | None: ...

    async def put(self, session: StoredSession, updated_at: int) -> None: ...

    async def delete(self, pubkey: str) -> None: ...

    async def set_status(
        self, pubkey: str, status: str, detail: str, updated_at: int | None
    ) -> None:
        """With `updated_at` None, the row's time is left as it was."""
        ...


class AuthModeStore(Protocol):
    """Learned NIP-42 modes of gated relays (`relay_auth_modes`)."""

    async def modes_since(self, since: int) -> dict[str, str]: ...

    async def save_mode(self, relay: str, mode: str, learned_at: int) -> None: ...


Reshard = Callable[["ShardSet"], Awaitable[None]]
"""The bridge's `reshard`: watch only the keys of these shards."""
SessionListener = Callable[[str, str], None]
"""A `DelegatedAuth` listener: (pubkey, status) of a session changed here."""
Adopt = Callable[[str], Awaitable[None]]
"""`DelegatedAuth.adopt`: take the session another worker stored for this pubkey."""


class Shards(Protocol):
    """Which keys this worker's bridge watches: every key (one process), or the shards it
    holds leases on (several workers)."""

    def held(self) -> list[int] | None:
        """The shards watched (None: every key)."""
        ...

    def canary_gate(self) -> Callable[[], bool] | None:
        """Asked before each canary probe, so N workers send one (None: always probe)."""
        ...

    def problems(self) -> dict[str, str]:
        """Why keys this worker should watch may be unwatched (the store unreachable, shards
        held by nobody), by name, for `/health`; empty when none."""
        ...

    async def start(self, stack: AsyncExitStack) -> None:
        """Before the bridge starts: take a first share (given back when `stack` closes)."""
        ...

    def watching(self, stack: AsyncExitStack) -> None:
        """The bridge has started (its keys watched); `stack` stops the heartbeats first."""
        ...


class Coordination(Protocol):
    """How the workers of one instance coordinate, so the service wires one path whatever
    the engine: a no-op on SQLite (one process), leases, signer-session sync over NOTIFY and
    the instance-key check on PostgreSQL (`store.postgres.coordination`)."""

    @property
    def several_workers(self) -> bool:
        """Whether other processes may share the store (their metrics and observation files
        then carry the worker id)."""
        ...

    async def claim(self, stack: AsyncExitStack) -> None:
        """Take this process's place among the store's workers until `stack` closes: the
        only one on SQLite (`StoreInUse` while another process serves the file), one of any
        number on PostgreSQL."""
        ...

    async def check_instance_key(self, pubkey: str) -> None:
        """Refuse to run with a bridge key other than the instance's (`ForeignBridgeKey`)."""
        ...

    async def share_sessions(self, adopt: Adopt, stack: AsyncExitStack) -> SessionListener | None:
        """Have other workers' signer-session changes adopted here; returns the listener that
        announces this worker's changes to them (None: nobody to tell)."""
        ...

    def shards(self, reshard: Reshard, lease_seconds: float) -> Shards: ...


class Store(Protocol):
    """One instance's store, opened (and migrated) by `open_store`."""

    @property
    def engine(self) -> str: ...

    @property
    def worker_id(self) -> str: ...

    @property
    def devices(self) -> DeviceStore: ...

    @property
    def outbox(self) -> OutboxStore: ...

    @property
    def auth_ids(self) -> AuthIdStore: ...

    @property
    def meta(self) -> MetaStore: ...

    @property
    def signer_sessions(self) -> SignerSessionStore: ...

    @property
    def auth_modes(self) -> AuthModeStore: ...

    @property
    def iris(self) -> IrisSubscriptionStore: ...

    @property
    def coordination(self) -> Coordination: ...

    async def close(self) -> None: ...


UNADDRESSED = ""
"""The recipient of a firehose relay's DM for nobody here, in `CatchupItemsStore` rows."""


class CatchupItemsStore(Protocol):
    """Which DMs each relay delivered within the catch-up window (`catchup_items`): what
    negentropy (NIP-77) offers the relay as already had. Rows are (relay, recipient, event id,
    created_at); a row already there is kept. The store keeps one row per (recipient, event
    id) listing its relays (migration 0016): the copies of one DM from several relays are
    one row, and a relay's delivery added later is appended to it."""

    async def add(self, rows: Sequence[tuple[str, str, str, int]]) -> None: ...

    async def items(
        self, relay: str, pubkeys: Sequence[str] | None, since: int
    ) -> dict[str, int]:
        """Event id → created_at of what `relay` delivered since `since`, for `pubkeys`, or
        every DM it delivered (a firehose relay) when None."""
        ...

    async def rows(
        self, relay: str, pubkeys: Sequence[str] | None, since: int
    ) -> list[tuple[str, str, int]]:
        """(recipient, event id, created_at) of what `relay` delivered since `since` for
        `pubkeys` (every recipient when None): what the bridge loads once per process and
        key to keep in memory."""
        ...

    async def noted_since(
        self, relay: str, noted_at: int, since: int
    ) -> list[tuple[str, str, int]]:
        """(recipient, event id, created_at) of what `relay` delivered since `since` whose
        row was written at or after `noted_at` (unix milliseconds, the add's clock): what a
        restart adds on top of the relay's snapshot."""
        ...

    async def snapshot(self, relay: str, scope: str) -> list[tuple[int, int, bytes]]:
        """(part number, cut in unix milliseconds, bytes) of each part of the relay's NIP-77
        snapshot for `scope` (nostr/nip77_snapshot.py), in part order; [] when none."""
        ...

    async def save_snapshot(
        self, relay: str, scope: str, cut: int, parts: Sequence[tuple[int, int, bytes]],
        drop: Sequence[int] = (), replace: bool = False,
    ) -> None:
        """Keep `parts` ((part number, newest created_at, bytes)) in the relay's snapshot for
        `scope` (a part's number already there is replaced), instead of the parts numbered in
        `drop`, or of all its parts when `replace`: with the parts before, it holds every item whose row was written before
        `cut` (unix milliseconds)."""
        ...

    async def prune(self, cutoff: int) -> int:
        """Forget deliveries whose created_at is before `cutoff`, and snapshot parts whose
        newest item is; how many rows went (one per recipient and DM, whatever its relays)."""
        ...


class BridgeConnection(Protocol):
    """The bridge committer's own connection: its repositories all write on it, so one
    `transaction()` holds a batch's outbox rows, seen ids and queued bookkeeping."""

    outbox: OutboxStore
    seen: SeenRows
    state: RelayStateStore
    lists: UserListStore
    catchup: CatchupItemsStore

    def transaction(self) -> AbstractAsyncContextManager[None]:
        """One unit of work: committed on a clean exit, rolled back on an exception (SQLite
        takes the write lock at the start, as `BEGIN IMMEDIATE`)."""
        ...

    async def close(self) -> None: ...
