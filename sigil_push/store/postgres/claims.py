"""The outbox on PostgreSQL, shared by every worker: enqueue once, claim with SKIP LOCKED.

Exactly-once enqueueing comes from the (device_id, event_id) unique constraint: two workers
that both handle an event (say, during a shard hand-over) both try to insert, and one insert
is a no-op. Delivery is claimed, not locked for its whole duration: `claim_due` marks due rows
as claimed by one worker until `claimed_until_ms`, skipping rows another claimer has locked at
that instant, so concurrent claimers never get the same row. A worker killed mid-delivery
leaves claims that lapse; then any worker claims them again (at-least-once at the provider
boundary, made harmless by the collapse id derived from the row). Finishing or rescheduling a
row checks that the claim is still this one, so a slow worker cannot delete a row that was
reclaimed and is being sent by someone else.

Times are milliseconds since the epoch, from the database's clock unless given (tests pass
them explicitly to move time without sleeping).
"""

from __future__ import annotations

from dataclasses import dataclass

import asyncpg
from asyncpg.pool import PoolConnectionProxy

Connection = asyncpg.Connection | PoolConnectionProxy

_DB_NOW_MS = "(extract(epoch FROM clock_timestamp()) * 1000)::bigint"


@dataclass(frozen=True)
class Claim:
    """One claimed outbox row; (id, claimed_ms) identifies this claim for finish/reschedule."""

    id: int
    device_id: int
    event_id: str
    relay: str
    event_json: str | None
    first_seen_ms: int
    attempts: int
    claimed_ms: int


async def enqueue(
    connection: Connection,
    device_id: int,
    event_id: str,
    relay: str,
    event_json: str | None,
    now_ms: int,
) -> bool:
    """Add a wakeup; False when that (device, event) is already queued (by anyone)."""
    inserted = await connection.fetchval(
        "INSERT INTO outbox (device_id, event_id, relay, event_json, first_seen_ms,"
        " next_attempt_ms) VALUES ($1, $2, $3, $4, $5, $5)"
        " ON CONFLICT (device_id, event_id) DO NOTHING RETURNING id",
        device_id,
        event_id,
        relay,
        event_json,
        now_ms,
    )
    return inserted is not None


async def claim_due(
    connection: Connection,
    worker_id: str,
    limit: int,
    claim_ms: int,
    now_ms: int | None = None,
) -> list[Claim]:
    """Claim up to `limit` due rows for `claim_ms`: unclaimed or with a lapsed claim."""
    if limit <= 0 or claim_ms <= 0:
        raise ValueError("limit and claim_ms must be positive")
    now = _DB_NOW_MS if now_ms is None else "$4::bigint"
    args: list[object] = [worker_id, limit, claim_ms]
    if now_ms is not None:
        args.append(now_ms)
    rows = await connection.fetch(
        f"WITH now AS (SELECT {now} AS ms),"
        " due AS (SELECT id FROM outbox, now"
        "  WHERE next_attempt_ms <= now.ms"
        "  AND (claimed_until_ms IS NULL OR claimed_until_ms <= now.ms)"
        "  ORDER BY next_attempt_ms, id LIMIT $2 FOR UPDATE OF outbox SKIP LOCKED)"
        " UPDATE outbox SET claimed_ms = now.ms, claimed_until_ms = now.ms + $3,"
        "  claimed_by = $1, attempts = attempts + 1"
        " FROM due, now WHERE outbox.id = due.id"
        " RETURNING outbox.id, device_id, event_id, relay, event_json, first_seen_ms,"
        "  attempts, claimed_ms",
        *args,
    )
    return sorted(
        (
            Claim(
                id=int(row["id"]),
                device_id=int(row["device_id"]),
                event_id=str(row["event_id"]),
                relay=str(row["relay"]),
                event_json=row["event_json"],
                first_seen_ms=int(row["first_seen_ms"]),
                attempts=int(row["attempts"]),
                claimed_ms=int(row["claimed_ms"]),
            )
            for row in rows
        ),
        key=lambda claim: claim.id,
    )


async def finish(connection: Connection, worker_id: str, claim: Claim) -> bool:
    """Delete a row the provider answered for good; False if the claim was lost meanwhile."""
    deleted = await connection.fetchval(
        "DELETE FROM outbox WHERE id = $1 AND claimed_by = $2 AND claimed_ms = $3 RETURNING id",
        claim.id,
        worker_id,
        claim.claimed_ms,
    )
    return deleted is not None


async def reschedule(
    connection: Connection, worker_id: str, claim: Claim, next_attempt_ms: int
) -> bool:
    """Release a claim and retry at `next_attempt_ms`; False if the claim was lost meanwhile."""
    updated = await connection.fetchval(
        "UPDATE outbox SET claimed_ms = NULL, claimed_until_ms = NULL, claimed_by = NULL,"
        " next_attempt_ms = $4 WHERE id = $1 AND claimed_by = $2 AND claimed_ms = $3"
        " RETURNING id",
        claim.id,
        worker_id,
        claim.claimed_ms,
        next_attempt_ms,
    )
    return updated is not None
