"""The one hand-off between ingest and the committer: verified arrivals in arrival order, the
database bookkeeping queued behind them (baselines, forgotten keys), and the per-relay
back-pressure that keeps the queue bounded without making the readers wait on the disk."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from sigil_push.bridge.metrics import QUEUE
from sigil_push.nostr.event import Event

COMMIT_BATCH = 2000
CONGESTED_AT = 20_000
DRAINED_AT = 5_000
RELAY_QUEUE_CAP = 2 * COMMIT_BATCH
"""A relay whose events fill this much of the commit queue waits (its reader only)."""

DbOp = tuple[str, list[tuple[Any, ...]]]
"""One statement and its rows, written in the committer's next transaction."""


@dataclass(slots=True)
class Arrival:
    event: Event
    relay: str
    received_ms: int
    push_to: tuple[str, ...]
    since_registration: tuple[str, ...] = ()
    """Of `push_to`, recipients whose devices wake only if the event's `created_at` is not
    before their registration: firehose events that may predate the key's first watch there."""


class Pending:
    """What waits for the committer. `work` is set whenever there is something to commit."""

    def __init__(self) -> None:
        self._arrivals: list[Arrival] = []
        self._by_relay: dict[str, int] = {}
        self._ops: list[DbOp] = []
        self.work = asyncio.Event()
        self._drained = asyncio.Event()

    def enqueue(self, arrival: Arrival) -> None:
        self._arrivals.append(arrival)
        self._by_relay[arrival.relay] = self._by_relay.get(arrival.relay, 0) + 1
        self.work.set()

    def add_op(self, sql: str, rows: list[tuple[Any, ...]]) -> None:
        self._ops.append((sql, rows))
        self.work.set()

    def __bool__(self) -> bool:
        return bool(self._arrivals or self._ops)

    def take(self) -> tuple[list[Arrival], list[DbOp]]:
        """The next batch, and the queued bookkeeping once no arrival is left behind it."""
        batch = self._arrivals[:COMMIT_BATCH]
        self._arrivals = self._arrivals[COMMIT_BATCH:]
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
            ops, self._ops = self._ops, []
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
