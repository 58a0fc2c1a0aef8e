"""The outbox on PostgreSQL, shared by every worker: enqueued once, claimed with SKIP LOCKED.

The same `OutboxStore` as SQLite's, made safe for several workers: the (device_id, event_id)
unique constraint makes enqueueing
exactly-once; `due` reserves the rows it returns for this worker (`FOR UPDATE SKIP LOCKED`, so
concurrent workers never get the same row) until `claimed_until_ms` and counts their attempt
in the same statement, so nothing is written between `due` and the sends; `hold` gives back the rows
delivery does not send now (coalescing, rate limits) with the count undone. One statement and
one new row version per batch instead of two: the second UPDATE was a round trip and a dead
tuple per wakeup, paid on the cores the workers share with PostgreSQL. A killed worker's claims
lapse and any worker takes them again (at-least-once at the provider boundary, made harmless
by the row's collapse id); a worker killed between `due` and its sends has counted an attempt
it never made, which only brings `push.max_attempts` one attempt nearer for those rows.
Completing, holding, rescheduling and releasing touch only this worker's claims, so a slow
worker cannot delete a row another worker has reclaimed and is sending.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Collection, Sequence

from sigil_push.nostr.event import Event
from sigil_push.store.postgres.database import PostgresDatabase
from sigil_push.store.records import SIBLINGS, Device, Wakeup, collapse_id, wakeup_rows

_SECRET_KEY = "outbox_collapse_secret"
_WAKEUP_COLUMNS = (
    "o.id, o.event_id, o.relay, CASE WHEN o.has_event THEN (SELECT e.event_json"
    " FROM outbox_events e WHERE e.wakeup_id = o.id) END, o.first_seen_ms, o.attempts,"
    " d.id, d.pubkey, d.platform, d.token, d.payload, d.relays, d.webpush_p256dh,"
    " d.webpush_auth, d.registered_at, d.device_key"
)
DEFAULT_CLAIM_MS = 120_000
LIVE_WORKER_SECONDS = 60


class PostgresOutbox:
    """`OutboxStore` on PostgreSQL for worker `worker_id`; claims last `claim_ms`."""

    def __init__(
        self, database: PostgresDatabase, worker_id: str, claim_ms: int = DEFAULT_CLAIM_MS
    ) -> None:
        if claim_ms <= 0:
            raise ValueError("claim_ms must be positive")
        self._db = database
        self._worker = worker_id
        self._claim_ms = claim_ms
        self.ready = asyncio.Event()
        self._secret = b""

    async def enqueue(
        self, event: Event, relay: str, first_seen_ms: int, devices: Sequence[Device]
    ) -> int:
        return await self.enqueue_many([(event, relay, first_seen_ms, devices)])

    async def enqueue_many(
        self, batch: Sequence[tuple[Event, str, int, Sequence[Device]]]
    ) -> int:
        """Queue many events' wakeups in one statement; a queued (device, event) is skipped.

        The event JSON of the rows that carry it goes into `outbox_events` under the new row's
        id (migration 0015) in the same statement, matched back by (device, event): the
        outbox row itself, which every claim writes a new version of, stays small. A batch
        without events is the plain INSERT it was before."""
        rows = wakeup_rows(batch)
        if not rows:
            return 0
        columns = [list(column) for column in zip(*rows)]
        if all(event is None for event in columns[3]):
            del columns[3]
            added = len(await self._db.fetch(
                "INSERT INTO outbox (device_id, event_id, relay, first_seen_ms, next_attempt_ms)"
                " SELECT d, e, r, s, s FROM unnest($1::bigint[], $2::text[], $3::text[],"
                " $4::bigint[]) AS u (d, e, r, s)"
                " ON CONFLICT (device_id, event_id) DO NOTHING RETURNING id",
                *columns,
            ))
        else:
            added = await self._added_with_events(columns)
        self.ready.set()
        return added

    async def _added_with_events(self, columns: list[list[object]]) -> int:
        """Insert the rows whose (device_id, event_id, relay, event_json, first_seen_ms)
        are `columns`, and the events of the new ones that carry one; returns how many rows."""
        added = await self._db.fetchval(
            "WITH u AS (SELECT * FROM unnest($1::bigint[], $2::text[], $3::text[], $4::text[],"
            "  $5::bigint[]) AS u (d, e, r, j, s)),"
            " added AS (INSERT INTO outbox (device_id, event_id, relay, has_event, first_seen_ms,"
            "  next_attempt_ms) SELECT d, e, r, j IS NOT NULL, s, s FROM u"
            "  ON CONFLICT (device_id, event_id) DO NOTHING RETURNING id, device_id, event_id,"
            "  has_event),"
            " events AS (INSERT INTO outbox_events (wakeup_id, event_json) SELECT a.id, u.j"
            "  FROM added a JOIN u ON u.d = a.device_id AND u.e = a.event_id WHERE a.has_event)"
            " SELECT count(*) FROM added",
            *columns,
        )
        return int(added)

    async def resume(self, now_ms: int) -> int:
        """Release the claims of workers that are gone (no heartbeat for a minute): their
        wakeups are in doubt and go out again now rather than when the claims lapse."""
        await self._load_secret()
        return await self._db.run(
            "UPDATE outbox SET claimed_ms = NULL, claimed_until_ms = NULL, claimed_by = NULL,"
            " next_attempt_ms = LEAST(next_attempt_ms, $1) WHERE claimed_by IS NOT NULL"
            " AND claimed_by NOT IN (SELECT worker_id FROM workers WHERE worker_id <> $2"
            "  AND heartbeat_at > now() - make_interval(secs => $3))",
            now_ms, self._worker, LIVE_WORKER_SECONDS,
        )

    async def _load_secret(self) -> None:
        await self._db.run(
            "INSERT INTO meta (key, value) VALUES ($1, $2) ON CONFLICT DO NOTHING",
            _SECRET_KEY, secrets.token_hex(32),
        )
        value = await self._db.fetchval("SELECT value FROM meta WHERE key = $1", _SECRET_KEY)
        self._secret = bytes.fromhex(str(value))

    def collapse_id(self, wakeup_id: int) -> str:
        """The same stable, keyed id as on SQLite (the secret is shared through `meta`)."""
        return collapse_id(self._secret, wakeup_id)

    async def due(
        self, now_ms: int, limit: int, platforms: Sequence[str] | None = None
    ) -> list[Wakeup]:
        """Reserve for this worker up to `limit` due rows (unclaimed, or whose claim lapsed),
        oldest schedule first, skipping rows another worker is reserving at this instant.

        As on SQLite, the first `limit` rows pick the phones (platform, token) and every other
        due row for those phones comes along, up to SIBLINGS x `limit` rows: a batch boundary
        never splits the wakeups of a phone's accounts into two pushes. The head rows are
        locked (SKIP LOCKED) as they are picked: otherwise a worker racing another one would
        see the same head, find every row of it locked, and take an empty batch for "nothing
        due".

        The attempt is counted here (`attempts + 1` in the reserving UPDATE), and each
        `Wakeup.attempts` is the count before it, as on SQLite. A row's event JSON is read
        from `outbox_events` for flagged rows only (migration 0015): the reserving UPDATE
        writes a new version of a small row, not of one carrying a ~1.9 KB event.

        The head's phones are read in the same pass that picks the head rows, and their other
        registrations are found through the token index (`token = ANY(...)`): joined on
        (platform, token) alone, the planner hashed the whole `devices` table twice per batch,
        a cost that grows with the registered keys rather than with the batch.
        """
        free = "o.next_attempt_ms <= $1 AND (o.claimed_until_ms IS NULL OR o.claimed_until_ms <= $1)"
        only = "" if platforms is None else " AND d.platform = ANY($6::text[])"
        args: list[object] = [
            now_ms, limit, self._worker, now_ms + self._claim_ms, SIBLINGS * limit
        ]
        if platforms is not None:
            args.append(list(platforms))
        rows = await self._db.fetch(
            "WITH head AS (SELECT DISTINCT platform, token FROM"
            "  (SELECT d.platform, d.token FROM outbox o JOIN devices d ON d.id = o.device_id"
            f"   WHERE {free}{only} ORDER BY o.next_attempt_ms, o.id LIMIT $2"
            "   FOR UPDATE OF o SKIP LOCKED) first),"
            " picked AS (SELECT o.id FROM devices d"
            "  JOIN head h ON h.platform = d.platform AND h.token = d.token"
            "  JOIN outbox o ON o.device_id = d.id"
            f"  WHERE d.token = ANY(ARRAY(SELECT token FROM head)) AND {free}"
            "  ORDER BY o.next_attempt_ms, o.id LIMIT $5 FOR UPDATE OF o SKIP LOCKED),"
            " reserved AS (UPDATE outbox SET claimed_by = $3, claimed_ms = $1,"
            "  claimed_until_ms = $4, attempts = outbox.attempts + 1"
            "  FROM picked WHERE outbox.id = picked.id RETURNING outbox.*)"
            f" SELECT {_WAKEUP_COLUMNS} FROM reserved o JOIN devices d ON d.id = o.device_id"
            " ORDER BY o.next_attempt_ms, o.id",
            *args,
        )
        devices: dict[int, Device] = {}  # a registration's rows share one object
        wakeups = []
        for r in rows:
            device = devices.get(r[6])
            if device is None:
                device = devices[r[6]] = Device.from_row(tuple(r)[6:])
            wakeups.append(
                Wakeup(int(r[0]), device, str(r[1]), str(r[2]),
                       None if r[3] is None else str(r[3]), int(r[4]), int(r[5]) - 1)
            )
        return wakeups

    async def next_due_ms(self) -> int | None:
        """When the next row becomes due, counting lapsing claims as becoming due then."""
        due = await self._db.fetchval(
            "SELECT MIN(GREATEST(next_attempt_ms, COALESCE(claimed_until_ms, 0))) FROM outbox"
        )
        return None if due is None else int(due)

    async def hold(self, wakeup_ids: Sequence[int], next_attempt_ms: int) -> None:
        """Give back reserved rows not sent now, undoing the attempt `due` counted; a row
        another worker took meanwhile (this worker's claim lapsed) is left to it."""
        if wakeup_ids:
            await self._db.run(
                "UPDATE outbox SET claimed_by = NULL, claimed_ms = NULL, claimed_until_ms = NULL,"
                " next_attempt_ms = $3, attempts = GREATEST(attempts - 1, 0)"
                " WHERE id = ANY($1::bigint[]) AND claimed_by = $2",
                list(wakeup_ids), self._worker, next_attempt_ms,
            )

    async def complete(self, wakeup_ids: Sequence[int]) -> None:
        """Remove rows this worker settled (not one another worker has reclaimed since)."""
        if wakeup_ids:
            await self._db.run(
                "DELETE FROM outbox WHERE id = ANY($1::bigint[])"
                " AND (claimed_by IS NULL OR claimed_by = $2)",
                list(wakeup_ids), self._worker,
            )

    async def reschedule(self, wakeup_ids: Sequence[int], next_attempt_ms: int) -> None:
        if wakeup_ids:
            await self._db.run(
                "UPDATE outbox SET claimed_by = NULL, claimed_ms = NULL, claimed_until_ms = NULL,"
                " next_attempt_ms = $3 WHERE id = ANY($1::bigint[])"
                " AND (claimed_by IS NULL OR claimed_by = $2)",
                list(wakeup_ids), self._worker, next_attempt_ms,
            )

    async def release_claims(self, claimed_before_ms: int, live: Collection[int]) -> int:
        """Release this worker's claims older than `claimed_before_ms` no push holds."""
        return await self._db.run(
            "UPDATE outbox SET claimed_by = NULL, claimed_ms = NULL, claimed_until_ms = NULL"
            " WHERE claimed_by = $1 AND claimed_ms < $2 AND NOT (id = ANY($3::bigint[]))",
            self._worker, claimed_before_ms, list(live),
        )

    async def oldest_first_seen_ms(self) -> int | None:
        oldest = await self._db.fetchval("SELECT MIN(first_seen_ms) FROM outbox")
        return None if oldest is None else int(oldest)

    async def depth(self) -> int:
        return int(await self._db.fetchval("SELECT count(*) FROM outbox"))
