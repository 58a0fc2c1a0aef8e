"""What the rest of sigil-push uses from its store, whatever engine is underneath.

Two engines implement these protocols: SQLite (one process, the embedded default) and
PostgreSQL (any number of `serve` processes sharing one database). Behaviour is the same on
both; what differs is how it is made safe: SQLite has one writer, PostgreSQL relies on unique
constraints (handled event ids, (event, device) outbox rows, NIP-98 ids) and on claims that
lapse, so that workers never need to trust each other.

`Database` is the handle for portable SQL written with `?` placeholders (the bridge's
bookkeeping, relay lists, delegated-auth sessions, the bridge key, seen ids, NIP-98 ids): on
SQLite it is the aiosqlite connection itself, on PostgreSQL an adapter that numbers the
placeholders. Whatever needs engine-specific SQL (device pairs, outbox claims) has a class per
engine behind `DeviceStore` / `OutboxStore`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Collection, Iterable, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from sigil_push.nostr.event import Event
    from sigil_push.store.preferences import AuthorCheck, UserList
    from sigil_push.store.records import (
        Device,
        PreferenceChange,
        Registration,
        RegistrationListener,
        Wakeup,
        WebPushKeys,
    )


class Cursor(Protocol):
    """The part of a DB-API cursor the store's callers read."""

    @property
    def rowcount(self) -> int: ...

    async def fetchone(self) -> Any: ...

    async def fetchall(self) -> Iterable[Any]: ...

    async def close(self) -> None: ...

    def __aiter__(self) -> AsyncIterator[Any]: ...


class CursorContext(Protocol):
    """What `Database.execute` returns: awaited for a cursor, or entered with `async with`."""

    def __await__(self) -> Any: ...

    async def __aenter__(self) -> Cursor: ...

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> Any: ...


class Database(Protocol):
    """A handle for portable SQL with `?` placeholders (the aiosqlite subset in use)."""

    def execute(self, sql: str, parameters: Iterable[Any] | None = None) -> Any: ...

    async def execute_fetchall(
        self, sql: str, parameters: Iterable[Any] | None = None
    ) -> Iterable[Any]: ...

    async def executemany(self, sql: str, parameters: Iterable[Iterable[Any]]) -> Any: ...

    async def close(self) -> None: ...


class DeviceStore(Protocol):
    """(npub, device token) registrations; listeners learn which pubkey changed."""

    def add_listener(self, listener: RegistrationListener) -> None: ...

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

    async def count(self) -> int: ...


class OutboxStore(Protocol):
    """The durable outbox: wakeups on disk before the first send, removed on a final outcome."""

    ready: asyncio.Event

    async def enqueue(
        self, event: Event, relay: str, first_seen_ms: int, devices: Sequence[Device]
    ) -> int: ...

    async def enqueue_many(
        self, batch: Sequence[tuple[Event, str, int, Sequence[Device]]]
    ) -> int: ...

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


class UserListStore(Protocol):
    """The users' own kind 10000/3 lists, the kind 4 author checks and presence lapses
    (issue 20), on the bridge committer's connection."""

    async def save(self, lists: Sequence[UserList]) -> list[UserList]: ...

    async def blocked(self, checks: Sequence[AuthorCheck]) -> list[dict[int, str]]: ...

    async def mark_lapses(self, marks: Sequence[tuple[str, str, int]], now: int) -> None: ...

    async def claim_lapses(self, now: int, now_ms: int) -> int: ...


class AuthIdStore(Protocol):
    """Single use of NIP-98 auth event ids (across every worker of an instance)."""

    async def claim(self, event_id: str) -> bool: ...

    async def prune(self) -> int: ...


class SeenStore(Protocol):
    """The bridge's memory of handled event ids and the relays that delivered them."""

    async def load(self) -> None: ...

    def delivered_by(self, event_id: str, relay: str) -> bool: ...

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


class Store(Protocol):
    """One instance's store, opened (and migrated) by `open_store`."""

    @property
    def engine(self) -> str: ...

    @property
    def worker_id(self) -> str: ...

    @property
    def db(self) -> Database: ...

    @property
    def devices(self) -> DeviceStore: ...

    @property
    def outbox(self) -> OutboxStore: ...

    @property
    def auth_ids(self) -> AuthIdStore: ...

    async def close(self) -> None: ...


class BridgeConnection(Protocol):
    """The bridge committer's own connection, so each batch is one transaction
    (`BEGIN IMMEDIATE` ... `COMMIT` on `db`), with an outbox writer on that connection."""

    db: Database
    outbox: OutboxStore

    async def close(self) -> None: ...
