"""The one hand-off between ingest and the committer: verified arrivals in arrival order, the
database bookkeeping queued behind them (baselines, forgotten keys), and the per-relay
back-pressure that keeps the queue bounded without making the readers wait on the disk."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from operator import itemgetter
from typing import Any

from sigil_push.bridge.metrics import QUEUE
from sigil_push.bridge.watches import Watch
from sigil_push.nostr.event import Event
from sigil_push.store.interface import BookkeepingOp
from sigil_push.store.preferences import UserList

COMMIT_BATCH = 2000
CONGESTED_AT = 20_000
DRAINED_AT = 5_000
OP_ROWS_PER_COMMIT = 20_000
"""Bookkeeping rows per transaction. A firehose baselines every key at its EOSE: a million
rows in one transaction held their row locks for tens of seconds, and a second worker taking
over some of those keys waited past its 5 s lock timeout (retried until granted, its commits
stalled meanwhile). In slices, each transaction holds its locks for about a second."""
RELAY_QUEUE_CAP = 2 * COMMIT_BATCH
"""A relay whose events fill this much of the commit queue waits (its reader only)."""

DbOp = tuple[BookkeepingOp, list[tuple[Any, ...]]]
"""One bookkeeping write and its rows, applied in the committer's next transaction
(`RelayStateStore.apply`)."""

INSERT_BASELINES = BookkeepingOp.INSERT_BASELINES
DELETE_BASELINE = BookkeepingOp.DELETE_BASELINE
DELETE_BASELINES_OF = BookkeepingOp.DELETE_BASELINES_OF
DELETE_RELAY_LISTS = BookkeepingOp.DELETE_RELAY_LISTS
DELETE_USER_LISTS = BookkeepingOp.DELETE_USER_LISTS


def in_lock_order(ops: list[DbOp]) -> list[DbOp]:
    """The same writes, with every `relay_baselines` row written in (pubkey, relay) order.

    Workers that overlap on a key during a hand-over write baselines of the same keys, each
    in its own order (per EOSE, per relay): two transactions that take row locks in opposite
    orders deadlock, and PostgreSQL aborts one of them. In one global order they only wait.
    The other statements (other tables) keep their order, before the baselines.

    A row's outcome is unchanged: writes of one (relay, pubkey) pair keep their order (a
    stable sort), and a key's deletion from every relay comes first for that key, so the
    pair writes queued before it (which it undoes) are dropped.
    """
    if not any(op in _BASELINE_WRITES for op, _ in ops):
        return ops
    others = [op for op in ops if op[0] not in _BASELINE_WRITES]
    inserts = [rows for op, rows in ops if op == INSERT_BASELINES]
    if len(inserts) + len(others) == len(ops):
        # the usual case (EOSEs only): no deletion to keep in place; one EOSE's rows come
        # sorted by key already (`RelayState.baselined`), several are merged
        if len(inserts) == 1:
            return ops
        merged = [row for rows in inserts for row in rows]
        merged.sort(key=itemgetter(1, 0))
        return [*others, (INSERT_BASELINES, merged)]
    forgotten: dict[str, int] = {}
    pairs: list[tuple[str, str, int, BookkeepingOp, tuple[Any, ...]]] = []
    seq = 0
    for op, rows in ops:
        if op == DELETE_BASELINES_OF:
            for row in rows:
                seq += 1
                forgotten[row[0]] = seq
        elif op in _BASELINE_WRITES:
            for row in rows:
                seq += 1
                pairs.append((row[1], row[0], seq, op, row))
    pairs.sort(key=lambda pair: (pair[0], pair[1], pair[2]))
    ordered: list[DbOp] = []

    def write(op: BookkeepingOp, row: tuple[Any, ...]) -> None:
        if ordered and ordered[-1][0] == op:
            ordered[-1][1].append(row)
        else:
            ordered.append((op, [row]))

    # a pubkey sorts before any (pubkey, relay) pair
    deletions = sorted(forgotten.items())
    index = 0
    for pubkey, relay, at, op, row in pairs:
        while index < len(deletions) and deletions[index][0] <= pubkey:
            write(DELETE_BASELINES_OF, (deletions[index][0],))
            index += 1
        if forgotten.get(pubkey, 0) < at:
            write(op, row)
    for pubkey, _ in deletions[index:]:
        write(DELETE_BASELINES_OF, (pubkey,))
    return others + ordered


def _first_rows(ops: list[DbOp], most: int) -> tuple[list[DbOp], list[DbOp]]:
    """The first `most` rows of `ops` (for this transaction), and the rest (for the next)."""
    now: list[DbOp] = []
    for index, (op, rows) in enumerate(ops):
        if len(rows) >= most:
            if most:
                now.append((op, rows[:most]))
            rest = [(op, rows[most:])] if len(rows) > most else []
            return now, rest + ops[index + 1 :]
        now.append((op, rows))
        most -= len(rows)
    return now, []


_BASELINE_WRITES = frozenset((INSERT_BASELINES, DELETE_BASELINE, DELETE_BASELINES_OF))


@dataclass(slots=True)
class Arrival:
    event: Event
    relay: str
    received_ms: int
    push_to: tuple[str, ...]
    since_registration: tuple[str, ...] = ()
    """Of `push_to`, recipients whose devices wake only if the event's `created_at` is not
    before their registration: firehose events that may predate the key's first watch there."""
    copies: list[tuple[str, int]] | None = None
    """Further relays' deliveries (relay, received ms) folded in while this arrival waited in
    the queue (`Pending.fold`): each is only that relay's record, the push is this arrival's."""
    generation: int = 0
    """The queue's `taken` count when it was queued: still queued while they are equal."""
    zap_author: str | None = None
    """A zap receipt's visible author: the pubkey of the verified kind 9734 in its
    `description` (None: anonymous, or not a zap)."""
    iris: tuple[Watch, ...] = ()
    """The Iris subscriptions' watches the verified event matches (whole filters): their
    targets are woken too, under the Iris rules (`bridge.choices.IRIS_RULES`)."""

    def deliveries(self) -> list[tuple[str, int]]:
        """(relay, received ms) of every relay's delivery carried here, this one first."""
        first = (self.relay, self.received_ms)
        return [first] if self.copies is None else [first, *self.copies]


class Pending:
    """What waits for the committer: arrivals, bookkeeping, the users' lists. `work` is set
    whenever there is something to commit."""

    def __init__(self) -> None:
        self._arrivals: list[Arrival] = []
        self._by_relay: dict[str, int] = {}
        self._ops: list[DbOp] = []
        self._unready: list[list[tuple[Any, ...]]] = []  # rows of `reserve`d ops being filled
        self._taken = 0
        """Batches taken so far: an arrival queued since the last take is still queued."""
        self._lists: dict[tuple[str, int], UserList] = {}
        self.work = asyncio.Event()
        self._drained = asyncio.Event()

    def enqueue(self, arrival: Arrival) -> None:
        arrival.generation = self._taken
        self._arrivals.append(arrival)
        self._by_relay[arrival.relay] = self._by_relay.get(arrival.relay, 0) + 1
        self.work.set()

    def fold(self, arrival: Arrival, relay: str, received_ms: int) -> bool:
        """Add a further relay's delivery of `arrival`'s event to it, if it is still queued
        (False: already taken, queue the delivery on its own). A copy then costs no queue
        place and no arrival of its own, and is decided with the event in one batch: one
        `seen_events` row, where a copy that fell into the next batch was a row of its own."""
        if arrival.generation != self._taken:
            return False
        if arrival.copies is None:
            arrival.copies = [(relay, received_ms)]
        else:
            arrival.copies.append((relay, received_ms))
        return True

    def offer_list(self, item: UserList) -> None:
        """Ingest verified a kind 10000 or 3 of a watched key: store it soon (the newest of
        each (key, kind) waiting here wins; the store keeps it only if newer than its own)."""
        slot = (item.pubkey, item.kind)
        waiting = self._lists.get(slot)
        if waiting is None or (item.created_at, waiting.event_id) > (waiting.created_at, item.event_id):
            self._lists[slot] = item
        self.work.set()

    @property
    def lists_waiting(self) -> bool:
        return bool(self._lists)

    def take_lists(self) -> dict[tuple[str, int], UserList]:
        """The users' lists offered since the last take, by (key, kind)."""
        taken, self._lists = self._lists, {}
        return taken

    def return_lists(self, taken: dict[tuple[str, int], UserList]) -> None:
        """Lists taken but not stored (the database refused them): kept for the next turn,
        unless a newer one of the same (key, kind) came meanwhile."""
        self._lists = taken | self._lists

    def add_op(self, op: BookkeepingOp, rows: list[tuple[Any, ...]]) -> None:
        self._ops.append((op, rows))
        self.work.set()

    def reserve(self, op: BookkeepingOp) -> list[tuple[Any, ...]]:
        """Queue `op` now with rows still to come: the caller fills the returned list over
        several turns of the event loop and then calls `ready`. Until then neither it nor any
        op queued after it is taken, so the writes keep the order they were queued in."""
        rows: list[tuple[Any, ...]] = []
        self._ops.append((op, rows))
        self._unready.append(rows)
        return rows

    def ready(self, rows: list[tuple[Any, ...]]) -> None:
        """The rows of a `reserve`d op are complete."""
        self._unready = [other for other in self._unready if other is not rows]
        self.work.set()

    def _ready_ops(self) -> int:
        """How many queued ops come before the first one still being filled."""
        for index, (_, rows) in enumerate(self._ops):
            if any(rows is other for other in self._unready):
                return index
        return len(self._ops)

    def __bool__(self) -> bool:
        return bool(self._arrivals) or self._ready_ops() > 0

    def take(self) -> tuple[list[Arrival], list[DbOp]]:
        """The next batch, and the queued bookkeeping once no arrival is left behind it."""
        batch = self._arrivals[:COMMIT_BATCH]
        self._arrivals = self._arrivals[COMMIT_BATCH:]
        self._taken += 1
        for arrival in batch:
            left = self._by_relay.get(arrival.relay, 0) - 1
            if left > 0:
                self._by_relay[arrival.relay] = left
            else:
                self._by_relay.pop(arrival.relay, None)
        ops: list[DbOp] = []
        if not self._arrivals:
            # a baseline (from an EOSE) is stored only with or after every event the relay sent
            # before that EOSE, or a crash could leave a baseline whose events were never seen
            cut = self._ready_ops()
            ops, rest = _first_rows(in_lock_order(self._ops[:cut]), OP_ROWS_PER_COMMIT)
            self._ops = rest + self._ops[cut:]
        QUEUE.set(len(self._arrivals))
        self._drained.set()
        return batch, ops

    def congested(self, url: str) -> bool:
        """Back-pressure per relay: a relay with many events waiting pauses only its own reader
        (and every reader only when the whole queue is full)."""
        return (
            self._by_relay.get(url, 0) >= RELAY_QUEUE_CAP
            or len(self._arrivals) >= CONGESTED_AT
        )

    async def drained(self, url: str) -> None:
        while (
            self._by_relay.get(url, 0) >= RELAY_QUEUE_CAP // 2
            or len(self._arrivals) >= DRAINED_AT
        ):
            self._drained.clear()
            await self._drained.wait()
