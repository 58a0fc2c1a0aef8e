"""What the bridge keeps per relay beside the pool's live connections: each relay's baselines
(the keys whose first subscription there is past, so older events are not pushed) and live
cursors in the database, the users' relay lists' rows, and which relays are gated (the
per-user connections' side). Its database writes go through `Pending`, so they land in the
committer's transactions behind the events they belong with."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Collection, Iterable

from sigil_push.bridge.pending import (
    DELETE_BASELINE,
    DELETE_BASELINES_OF,
    INSERT_BASELINES,
    Pending,
)
from sigil_push.relays.discovery import RelayLists
from sigil_push.relays.pool import RelayPool
from sigil_push.relays.user_inbox import UserInboxes
from sigil_push.store.interface import Database

BASELINE_PAGE = 10_000
"""Rows of `relay_baselines` per query at start-up: PostgreSQL hands a query's rows over all at
once, and a million rows alive together were the biggest part of a restart's peak."""


ADOPT_BATCH = 10_000
"""Keys per query when a reshard takes the baselines of arriving keys: one `IN` list (within
both engines' parameter limits: 32,767 on PostgreSQL, 32,766 on SQLite since 3.32). At 1,000
per query the round trips took 6x as long."""


async def _baseline_rows(db: Database, turn: asyncio.Lock) -> AsyncIterator[tuple[str, str]]:
    """Every (relay, pubkey) baseline, BASELINE_PAGE rows per query in primary key order (each
    page starts after the last row of the one before, so it is an index range on both engines)."""
    after = ("", "")
    while True:
        async with turn:
            rows = list(await db.execute_fetchall(
                "SELECT relay, pubkey FROM relay_baselines WHERE (relay, pubkey) > (?, ?)"
                " ORDER BY relay, pubkey LIMIT ?",
                (*after, BASELINE_PAGE),
            ))
        for relay, pubkey in rows:
            yield str(relay), str(pubkey)
        if len(rows) < BASELINE_PAGE:
            return
        after = (str(rows[-1][0]), str(rows[-1][1]))


class RelayState:
    """The pool's and the per-user connections' persistent bookkeeping (`baselined`,
    `baselines_of`, `gated_relays`, `relay_gated`), loaded at start and saved as it changes."""

    def __init__(
        self,
        pool: RelayPool,
        pending: Pending,
        inboxes: UserInboxes | None,
        turn: asyncio.Lock | None = None,
    ) -> None:
        """`turn` is held by the committer for each of its transactions on the bridge's one
        connection: the reads here take it too, so none lands inside (or, after a failed
        statement, in the aborted remains of) a committer's transaction."""
        self._pool = pool
        self._pending = pending
        self._inboxes = inboxes
        self._db: Database | None = None
        self._lists: RelayLists
        self._turn = turn if turn is not None else asyncio.Lock()
        self.rows_adopted = 0
        """Baseline rows read by `adopt` (what a reshard costs the database)."""

    async def load(
        self, db: Database, lists: RelayLists, held: Callable[[str], bool]
    ) -> dict[str, str]:
        """The stored baselines of the keys `held` accepts, and every relay's cursor.

        Returns each baselined key's string, for the key registry to use as its own: a key is
        one string shared by its baselines on every relay and the registry, not a copy per
        row (a restart with a million baselines on each of R relays held R million more)."""
        self._db, self._lists = db, lists
        canonical: dict[str, str] = {}
        baselines: dict[str, set[str]] = {}
        async for relay, pubkey in _baseline_rows(db, self._turn):
            # several workers: hold only our shards' baselines (`adopt` loads the others')
            if held(pubkey):
                baselines.setdefault(relay, set()).add(canonical.setdefault(pubkey, pubkey))
        async with self._turn:
            rows = await db.execute_fetchall("SELECT relay, live_until FROM relay_cursors")
        cursors = {str(relay): int(live_until) for relay, live_until in rows}
        self._pool.load(baselines, cursors)
        return canonical

    async def adopt(self, db: Database, arriving: Collection[str]) -> None:
        """Keys another worker watched until now: take the baselines it stored for them (as
        the very strings of `arriving`), reading those keys' rows only (by the pubkey index),
        ADOPT_BATCH keys per query."""
        keys = list(arriving)
        for start in range(0, len(keys), ADOPT_BATCH):
            batch = keys[start : start + ADOPT_BATCH]
            canonical = {key: key for key in batch}
            async with self._turn:
                rows = list(await db.execute_fetchall(
                    "SELECT relay, pubkey FROM relay_baselines WHERE pubkey IN"
                    f" ({', '.join('?' * len(batch))})",
                    batch,
                ))
            self.rows_adopted += len(rows)
            for relay, pubkey in rows:
                self._pool.baselines_of(str(relay)).add(canonical[pubkey])

    def forget_keys(self, removed: list[str]) -> None:
        """Keys no longer registered anywhere: their lists and baselines go."""
        self._lists.forget(removed)
        self._pending.add_op(
            DELETE_BASELINES_OF, [(p,) for p in removed]
        )
        self._pending.add_op(
            "DELETE FROM relay_lists WHERE pubkey = ?", [(p,) for p in sorted(removed)]
        )

    def forget_baselines(self, left: Iterable[tuple[str, str]]) -> None:
        """(relay, key) pairs whose baseline is void: the key left that relay."""
        self._pending.add_op(DELETE_BASELINE, list(left))

    async def save_cursors(self) -> None:
        """In relay order: every worker saves the cursors of the same relays, and in the
        order each connected them two could each lock a row the other waits for."""
        if self._pool.cursors and self._db is not None:
            await self._db.executemany(
                "INSERT INTO relay_cursors (relay, live_until) VALUES (?, ?)"
                " ON CONFLICT (relay) DO UPDATE SET live_until = excluded.live_until",
                sorted(self._pool.cursors.items()),
            )

    # pool and per-user connection callbacks -----------------------------------------------

    def baselined(self, url: str, keys: frozenset[str]) -> None:
        now = int(time.time())
        # in key order: a firehose baselines every key at once, and a million rows inserted in
        # random order into the table's two B-trees took PostgreSQL 107 s, 33 s sorted, all of
        # it with the committer's connection busy
        self._pending.add_op(INSERT_BASELINES, [(url, pubkey, now) for pubkey in sorted(keys)])

    def baselines_of(self, url: str) -> set[str]:
        return self._pool.baselines_of(url)

    def gated_relays(self) -> set[str]:
        return set(self._pool.gated())

    def relay_gated(self, url: str) -> None:
        if self._inboxes is not None:
            self._inboxes.changed()
