"""What the bridge keeps per relay beside the pool's live connections: each relay's baselines
(the keys whose first subscription there is past, so older events are not pushed) and live
cursors in the database, the users' relay lists' rows, and which relays are gated (the
per-user connections' side). Its database writes go through `Pending`, so they land in the
committer's transactions behind the events they belong with."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Collection, Iterable, Sequence
from dataclasses import dataclass

from sigil_push.bridge.pending import (
    DELETE_BASELINE,
    DELETE_BASELINES_OF,
    DELETE_RELAY_LISTS,
    DELETE_USER_LISTS,
    INSERT_BASELINES,
    Pending,
)
from sigil_push.relays.discovery import RelayLists
from sigil_push.store.interface import RelayStateStore

BASELINE_PAGE = 10_000
"""Rows of `relay_baselines` per query at start-up: PostgreSQL hands a query's rows over all at
once, and a million rows alive together were the biggest part of a restart's peak."""


SORT_CHUNK = 20_000
"""Baselined keys sorted per turn of the event loop (see `RelayState.baselined`)."""


ADOPT_BATCH = 10_000
"""Keys per query when a reshard takes the baselines of arriving keys: one `IN` list (within
both engines' parameter limits: 32,767 on PostgreSQL, 32,766 on SQLite since 3.32). At 1,000
per query the round trips took 6x as long."""


async def _baseline_rows(
    state: RelayStateStore, turn: asyncio.Lock, held_pairs: Callable[[], Sequence[str] | None]
) -> AsyncIterator[tuple[str, str]]:
    """Every (relay, pubkey) baseline, BASELINE_PAGE rows per query in primary key order (each
    page starts after the last row of the one before, so it is an index range on both engines);
    with `held_pairs()` (asked again for every page: shards given back meanwhile drop out),
    only keys whose `pubkey[6:8]` is one of them (a worker's shards): the server skips the
    other workers' rows instead of sending them all to be dropped here."""
    after = ("", "")
    while True:
        pairs = held_pairs()
        if pairs is not None and not pairs:  # no shards (left): none of the rows is ours
            return
        async with turn:
            rows = await state.baseline_page(after, pairs, BASELINE_PAGE)
        for row in rows:
            yield row
        if len(rows) < BASELINE_PAGE:
            return
        after = rows[-1]


@dataclass
class Loaded:
    """What a start reads of the relay state (`RelayState.load`)."""

    keys: dict[str, str]
    """Each baselined key's string, for the key registry to use as its own: a key is one
    string shared by its baselines on every relay and the registry, not a copy per row (a
    restart with a million baselines on each of R relays held R million more)."""
    baselines: dict[str, set[str]]
    """Per relay, the keys baselined there (the pool's live sets from then on)."""
    cursors: dict[str, int]
    """Per relay, the time up to which it was read."""


class RelayState:
    """The pool's and the per-user connections' persistent bookkeeping (`baselined`,
    `relay_gated`), read at start and saved as it changes. The live sets are the pool's: this
    reads and writes their rows."""

    def __init__(
        self,
        state: RelayStateStore,
        lists: RelayLists,
        pending: Pending,
        inboxes_wake: asyncio.Event,
        turn: asyncio.Lock | None = None,
    ) -> None:
        """`state` is the stored relay state, `lists` the users' relay lists (forgotten with
        their keys). `inboxes_wake` is set when a relay turns out gated (the per-user
        connections reconcile). `turn` is held by the committer for each of its transactions on the bridge's one
        connection: the reads here take it too, so none lands inside (or, after a failed
        statement, in the aborted remains of) a committer's transaction."""
        self._pending = pending
        self._inboxes_wake = inboxes_wake
        self._state = state
        self._lists = lists
        self._turn = turn if turn is not None else asyncio.Lock()
        self.rows_adopted = 0
        """Baseline rows read by `adopt` (what a reshard costs the database)."""
        self._sorting: set[asyncio.Task[None]] = set()
        self.rows_loaded = 0
        """Baseline rows read by `load` (what a start costs the database)."""

    async def load(
        self,
        held: Callable[[str], bool],
        held_pairs: Callable[[], Sequence[str] | None] = lambda: None,
    ) -> Loaded:
        """The stored baselines of the keys `held` accepts (read narrowed to the keys whose
        `pubkey[6:8]` is in `held_pairs()`, unless None: see `KeyRegistry.held_pairs`), and
        every relay's cursor."""
        state = self._state
        canonical: dict[str, str] = {}
        baselines: dict[str, set[str]] = {}
        async for relay, pubkey in _baseline_rows(state, self._turn, held_pairs):
            self.rows_loaded += 1
            # several workers: hold only our shards' baselines (`adopt` loads the others')
            if held(pubkey):
                baselines.setdefault(relay, set()).add(canonical.setdefault(pubkey, pubkey))
        async with self._turn:
            cursors = await state.cursors()
        return Loaded(canonical, baselines, cursors)

    async def adopt(
        self, arriving: Collection[str], baselines_of: Callable[[str], set[str]]
    ) -> None:
        """Keys another worker watched until now: take the baselines it stored for them (as
        the very strings of `arriving`) into the live sets `baselines_of` gives per relay (the
        pool's), reading those keys' rows only (by the pubkey index), ADOPT_BATCH keys per
        query."""
        keys = list(arriving)
        for start in range(0, len(keys), ADOPT_BATCH):
            batch = keys[start : start + ADOPT_BATCH]
            canonical = {key: key for key in batch}
            async with self._turn:
                rows = await self._state.baselines_of_keys(batch)
            self.rows_adopted += len(rows)
            for relay, pubkey in rows:
                baselines_of(str(relay)).add(canonical[pubkey])

    def forget_keys(self, removed: list[str]) -> None:
        """Keys no longer registered anywhere: their lists (relay lists, kind 10000 and 3: up
        to 2 x 320 KB a key) and baselines go. A user list is kept if its key has a device row
        by the time this is written (registered again meanwhile, or an Iris subscription's
        target, whose rules read it too)."""
        self._lists.forget(removed)
        self._pending.add_op(
            DELETE_BASELINES_OF, [(p,) for p in removed]
        )
        self._pending.add_op(DELETE_RELAY_LISTS, [(p,) for p in sorted(removed)])
        self._pending.add_op(DELETE_USER_LISTS, [(p,) for p in sorted(removed)])

    def forget_user_lists(self, keys: list[str]) -> None:
        """Iris subscribers left without subscriptions: their kind 10000 and 3 go unless the
        key still has a device row when this is written (a registration's pair)."""
        self._pending.add_op(DELETE_USER_LISTS, [(p,) for p in sorted(keys)])

    def forget_baselines(self, left: Iterable[tuple[str, str]]) -> None:
        """(relay, key) pairs whose baseline is void: the key left that relay."""
        self._pending.add_op(DELETE_BASELINE, list(left))

    async def save_cursors(self, rows: list[tuple[str, int]]) -> None:
        """The pool's cursors (`RelayPool.cursors_to_save`), in relay order: every worker
        saves the cursors of the same relays, and in the order each connected them two could
        each lock a row the other waits for."""
        if rows:
            await self._state.save_cursors(rows)

    async def stored_relay_state(
        self, url: str, keys: Sequence[str]
    ) -> tuple[set[str], int | None]:
        """What the store holds for a relay the pool opens again (its state was freed when it
        was dropped): which of `keys` are baselined there, and its cursor."""
        baselined: set[str] = set()
        for start in range(0, len(keys), ADOPT_BATCH):
            async with self._turn:
                rows = await self._state.baselines_of_keys(keys[start : start + ADOPT_BATCH])
            baselined.update(pubkey for relay, pubkey in rows if relay == url)
        async with self._turn:
            cursors = await self._state.cursors()
        return baselined, cursors.get(url)

    # pool and per-user connection callbacks -----------------------------------------------

    def baselined(self, url: str, keys: frozenset[str]) -> None:
        """Store these keys as baselined on `url`, in key order: a firehose baselines every key
        at once, and a million rows inserted in random order into the table's two B-trees took
        PostgreSQL 107 s, 33 s sorted, all of it with the committer's connection busy.

        Many keys are sorted over several turns of the event loop (`_sort_into`): sorting a
        million in one piece took 1.75 s of CPU, seconds on a loaded machine, and the lease
        heartbeat waiting behind it let a 3 s lease expire. The write keeps its place in the
        queue meanwhile (`Pending.reserve`)."""
        now = int(time.time())
        if len(keys) <= SORT_CHUNK:
            self._pending.add_op(INSERT_BASELINES, [(url, key, now) for key in sorted(keys)])
            return
        rows = self._pending.reserve(INSERT_BASELINES)
        task = asyncio.create_task(self._sort_into(rows, url, keys, now), name="baselines-sort")
        self._sorting.add(task)
        task.add_done_callback(self._sorting.discard)

    async def sorting_done(self) -> None:
        """Wait for the baselines being sorted to be queued (before the last commit)."""
        while self._sorting:
            await asyncio.gather(*self._sorting)

    async def _sort_into(
        self, rows: list[tuple[str, str, int]], url: str, keys: frozenset[str], now: int
    ) -> None:
        """Fill `rows` with `keys` in order, SORT_CHUNK keys per turn of the event loop: split
        by their first two hex digits, then each part sorted in turn (in digit order, so the
        whole is sorted). Cancelled part-way, the rows so far (a sorted prefix) still go."""
        try:
            parts: dict[str, list[str]] = {}
            for index, key in enumerate(keys, 1):
                parts.setdefault(key[:2], []).append(key)
                if index % SORT_CHUNK == 0:
                    await asyncio.sleep(0)
            done = 0
            for prefix in sorted(parts):
                part = parts.pop(prefix)
                part.sort()
                rows.extend((url, key, now) for key in part)
                done += len(part)
                if done >= SORT_CHUNK:
                    done = 0
                    await asyncio.sleep(0)
        finally:
            self._pending.ready(rows)

    def relay_gated(self, url: str) -> None:
        self._inboxes_wake.set()
