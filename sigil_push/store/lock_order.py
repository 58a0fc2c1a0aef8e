"""The order in which every worker writes a commit batch's rows, so that two PostgreSQL
workers overlapping on a shard during a hand-over wait for each other instead of deadlocking.

Two workers may handle the same events in different arrival orders; each row a transaction
inserts holds its unique key until commit, so in arrival order each could hold a row the
other waits for, and PostgreSQL aborts one as a deadlock. In one order the later one waits,
then skips the rows the first wrote. (The tables are written in one order too: outbox,
`seen_events` (its new rows, then the further relays appended to rows already there), then
the queued bookkeeping, already in its own lock order.) The rest of the commit keeps arrival
order; only the outbox ids of one batch follow this order.
"""

from __future__ import annotations

from collections.abc import Callable
from operator import attrgetter, itemgetter
from typing import TypeVar

from sigil_push.store.records import Device

A = TypeVar("A")
NewEvent = tuple[str, tuple[str, ...], int, int]
"""(event id, relays, first received ms, created_at) of a `seen_events` row to insert."""


def in_lock_order(
    writes: list[tuple[A, list[Device]]],
    new_events: list[NewEvent],
    further: list[tuple[str, str]],
    event_id: Callable[[A], str],
) -> tuple[list[tuple[A, list[Device]]], list[NewEvent], list[tuple[str, str]]]:
    """A batch's rows in the order every worker writes them: by event id (`event_id` of each
    write's arrival; an event's devices by id), `seen_events` rows by id, further relays'
    deliveries by id."""
    return (
        sorted(((a, sorted(ds, key=attrgetter("id"))) for a, ds in writes),
               key=lambda write: event_id(write[0])),
        sorted(new_events, key=itemgetter(0)),
        sorted(further, key=itemgetter(0)),
    )
