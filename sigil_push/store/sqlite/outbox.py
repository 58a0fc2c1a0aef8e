"""The durable outbox: every (event, registration) wakeup is on disk before the first send attempt.

A row leaves the outbox only on a final outcome, so a crash, SIGKILL or provider outage loses
nothing. A row is *claimed* from the `due` that hands it out until its push is settled (or
`hold` gives it back); at start-up `resume` releases the claims left by a crash so those
wakeups go out again (the only window in which a wakeup can be sent twice: between the
provider accepting it and the row's deletion).

Every statement is a single SQL statement over many rows (`id IN (...)`), because the
connection is shared in autocommit mode and a statement is the unit of atomicity there.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Collection, Iterable, Sequence

import aiosqlite

from sigil_push.nostr.event import Event
from sigil_push.store.records import SIBLINGS, Device, Wakeup, collapse_id, wakeup_rows

_DEVICE_COLUMNS = (
    "d.id, d.pubkey, d.platform, d.token, d.payload, d.relays, d.webpush_p256dh,"
    " d.webpush_auth, d.registered_at, d.device_key"
)
_CHUNK = 500
_SECRET_KEY = "outbox_collapse_secret"


def _chunks(ids: Sequence[int]) -> list[Sequence[int]]:
    return [ids[i : i + _CHUNK] for i in range(0, len(ids), _CHUNK)]


def _id_list(ids: Iterable[int]) -> str:
    """Row ids as the JSON array `json_each` reads (ids are ints: nothing to escape)."""
    return f"[{','.join(map(str, ids))}]"


class Outbox:
    def __init__(self, connection: aiosqlite.Connection) -> None:
        self._db = connection
        self.ready = asyncio.Event()
        self._secret = b""

    async def enqueue(
        self, event: Event, relay: str, first_seen_ms: int, devices: Sequence[Device]
    ) -> int:
        """Queue one wakeup per device (see `enqueue_many`)."""
        return await self.enqueue_many([(event, relay, first_seen_ms, devices)])

    async def enqueue_many(
        self, batch: Sequence[tuple[Event, str, int, Sequence[Device]]]
    ) -> int:
        """Queue the wakeups of many events in one statement (the bridge commits per batch).

        The full event JSON is built only for devices whose payload mode carries it (`event`, `sealed`),
        and goes into `outbox_events` under its row's id (migration 0015), never into the
        outbox row that every claim rewrites. A batch without one inserts into the outbox
        directly; a batch with some inserts into the view `outbox_queue`, whose trigger writes
        each row and its event in one statement, so a claim on this shared connection never
        runs between the two (both ways are one executemany, one trip to the database thread).
        No (device, event) constraint (migration 0014): the one process that owns the file
        hands each event over once, in the transaction that records it in `seen_events`; an
        index keyed by the random event id made every batch rewrite pages all over it.
        """
        rows = wakeup_rows(batch)
        if not rows:
            return 0
        if any(event is not None for _, _, _, event, _ in rows):
            cursor = await self._db.executemany(
                "INSERT INTO outbox_queue (device_id, event_id, relay, event_json, first_seen_ms)"
                " VALUES (?, ?, ?, ?, ?)",
                rows,
            )
            added = len(rows)  # a view's INSTEAD OF writes are not counted: every row went in
        else:
            # ?5 twice: a wakeup is first due when its event was first seen (no row copy per
            # wakeup); ?4 (the absent event) is bound and unused
            cursor = await self._db.executemany(
                "INSERT INTO outbox (device_id, event_id, relay, first_seen_ms, next_attempt_ms)"
                " VALUES (?1, ?2, ?3, ?5, ?5)",
                rows,
            )
            added = cursor.rowcount
        await cursor.close()
        self.ready.set()
        return added

    async def resume(self, now_ms: int) -> int:
        """Release the claims a crash left behind; returns how many wakeups were in doubt."""
        await self._load_secret()
        return await self._run(
            "UPDATE outbox SET claimed_ms = NULL, next_attempt_ms = MIN(next_attempt_ms, ?)"
            " WHERE claimed_ms IS NOT NULL",
            (now_ms,),
        )

    async def _load_secret(self) -> None:
        await self._run(
            "INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT DO NOTHING",
            (_SECRET_KEY, secrets.token_hex(32)),
        )
        [row] = await self._db.execute_fetchall(
            "SELECT value FROM meta WHERE key = ?", (_SECRET_KEY,)
        )
        self._secret = bytes.fromhex(str(row[0]))

    def collapse_id(self, wakeup_id: int) -> str:
        """A stable, unlinkable id for the push that starts with this row.

        Stable so a resend after a crash collapses into the first notification; keyed so the
        provider cannot read a row counter (how busy this instance is) out of it.
        """
        return collapse_id(self._secret, wakeup_id)

    async def due(
        self, now_ms: int, limit: int, platforms: Sequence[str] | None = None
    ) -> list[Wakeup]:
        """Reserve the unclaimed wakeups due by `now_ms`, oldest schedule first, with their
        device; only for devices on `platforms` when given (those with room in their in-flight
        window). Each `Wakeup.attempts` is the count before this reservation.

        The first `limit` rows pick the device tokens; every other due row for those tokens
        (any account registered on the same phone) comes along, up to SIBLINGS x `limit` rows
        in all. So a batch boundary never splits one phone's wakeups into two pushes: rows due
        together are planned together. The picked rows always come first in the answer.
        CROSS JOIN fixes the join order (tokens, then their devices, then their rows): left to
        itself SQLite walks every due row in schedule order, which a backlog makes slow.

        As on PostgreSQL, the rows are claimed and their attempt counted in the statement that
        picks them (an UPDATE ... RETURNING), nothing is written between `due` and the sends,
        and `hold` undoes the count for rows delivery does not send now: one statement, one commit and
        one write of each row per batch instead of two, and the ordering sorts row ids rather
        than whole rows. The UPDATE rewrites small rows: a row's event JSON (`event` and
        `sealed` modes) is in `outbox_events` (migration 0015), read after the claim for the
        flagged rows only, by id (a scalar subquery in the RETURNING cost about 0.7 µs a row
        more: SQLite buffers RETURNING rows, ~2 KB each here). The devices are then read by id; a row whose device was unregistered
        in between went with it (ON DELETE CASCADE) and is left out.
        """
        only = ""
        if platforms is not None:
            only = f" AND d.platform IN ({','.join('?' * len(platforms))})"
        # RETURNING gives the rows in no set order: sorted back into (next_attempt_ms, id)
        rows = sorted(await self._db.execute_fetchall(
            "WITH head AS (SELECT d.platform, d.token FROM outbox o"
            " JOIN devices d ON d.id = o.device_id"
            f" WHERE o.claimed_ms IS NULL AND o.next_attempt_ms <= ?{only}"
            " ORDER BY o.next_attempt_ms, o.id LIMIT ?),"
            " tokens AS (SELECT DISTINCT platform, token FROM head),"
            " picked AS (SELECT o.id FROM tokens t"
            " CROSS JOIN devices d ON d.token = t.token AND d.platform = t.platform"
            " CROSS JOIN outbox o ON o.device_id = d.id"
            " WHERE o.claimed_ms IS NULL AND o.next_attempt_ms <= ?"
            " ORDER BY o.next_attempt_ms, o.id LIMIT ?)"
            " UPDATE outbox SET claimed_ms = ?, attempts = attempts + 1 WHERE id IN picked"
            " RETURNING next_attempt_ms, id, device_id, event_id, relay, has_event,"
            " first_seen_ms, attempts",
            (now_ms, *(platforms or ()), limit, now_ms, SIBLINGS * limit, now_ms),
        ))
        if not rows:
            return []
        devices = {
            r[0]: Device.from_row(r)
            for r in await self._db.execute_fetchall(
                f"SELECT {_DEVICE_COLUMNS} FROM devices d"
                " WHERE d.id IN (SELECT value FROM json_each(?))",
                (_id_list({r[2] for r in rows}),),
            )
        }
        flagged = [r[1] for r in rows if r[5]]
        events: dict[int, str] = {}
        if flagged:
            events = {
                int(r[0]): str(r[1]) for r in await self._db.execute_fetchall(
                    "SELECT wakeup_id, event_json FROM outbox_events"
                    " WHERE wakeup_id IN (SELECT value FROM json_each(?))",
                    (_id_list(flagged),),
                )
            }
        return [
            Wakeup(r[1], device, r[3], r[4], events.get(r[1]), r[6], r[7] - 1)
            for r in rows if (device := devices.get(r[2])) is not None
        ]

    async def next_due_ms(self) -> int | None:
        [(due,)] = await self._db.execute_fetchall(
            "SELECT MIN(next_attempt_ms) FROM outbox WHERE claimed_ms IS NULL"
        )
        return None if due is None else int(due)

    async def complete(self, wakeup_ids: Sequence[int]) -> None:
        """Remove wakeups that reached a final outcome. The ids travel as one JSON array, so
        the statement's text is the same for any count (compiled once, kept in the
        connection's statement cache) and needs no chunking under SQLite's parameter limit."""
        if wakeup_ids:
            await self._write(
                "DELETE FROM outbox WHERE id IN (SELECT value FROM json_each(?))",
                (_id_list(wakeup_ids),),
            )

    async def reschedule(self, wakeup_ids: Sequence[int], next_attempt_ms: int) -> None:
        """Release wakeups (claimed or not) to be due again at `next_attempt_ms`."""
        for chunk in _chunks(wakeup_ids):
            await self._write(
                "UPDATE outbox SET claimed_ms = NULL, next_attempt_ms = ?"
                f" WHERE id IN ({','.join('?' * len(chunk))})",
                (next_attempt_ms, *chunk),
            )

    async def hold(self, wakeup_ids: Sequence[int], next_attempt_ms: int) -> None:
        """Give back rows `due` reserved without sending them, undoing the attempt it counted,
        so a wakeup held back again and again never runs out of attempts."""
        if wakeup_ids:
            await self._write(
                "UPDATE outbox SET claimed_ms = NULL, next_attempt_ms = ?,"
                " attempts = MAX(attempts - 1, 0) WHERE id IN (SELECT value FROM json_each(?))",
                (next_attempt_ms, _id_list(wakeup_ids)),
            )

    async def release_claims(self, claimed_before_ms: int, live: Collection[int]) -> int:
        """Release claims older than `claimed_before_ms` that no push in flight (`live`) holds:
        a claim whose outcome was never written must not keep its wakeup forever."""
        rows = await self._db.execute_fetchall(
            "SELECT id FROM outbox WHERE claimed_ms IS NOT NULL AND claimed_ms < ?",
            (claimed_before_ms,),
        )
        stale = [int(r[0]) for r in rows if int(r[0]) not in live]
        for chunk in _chunks(stale):
            await self._run(
                f"UPDATE outbox SET claimed_ms = NULL WHERE id IN ({','.join('?' * len(chunk))})",
                tuple(chunk),
            )
        return len(stale)

    async def _write(self, sql: str, parameters: Sequence[object]) -> None:
        """Execute one write statement whose row count nobody reads: a single trip to the
        database thread (a cursor's execute and close are two), which the per-push settling
        pays for on every batch."""
        await self._db.execute_fetchall(sql, tuple(parameters))

    async def _run(self, sql: str, parameters: Sequence[object]) -> int:
        """Execute one write statement; returns the number of rows it changed."""
        cursor = await self._db.execute(sql, tuple(parameters))
        changed = cursor.rowcount
        await cursor.close()
        return changed

    async def oldest_first_seen_ms(self) -> int | None:
        """When the event of the oldest waiting wakeup was first seen (None: outbox empty)."""
        [(oldest,)] = await self._db.execute_fetchall("SELECT MIN(first_seen_ms) FROM outbox")
        return None if oldest is None else int(oldest)

    async def depth(self) -> int:
        [(count,)] = await self._db.execute_fetchall("SELECT COUNT(*) FROM outbox")
        return int(count)
