"""Shard leases in PostgreSQL: which worker does the bridge work for which shard of keys.

Each worker heartbeats its row in `workers` and renews its leases every lease_seconds / 3.
A lease not renewed for lease_seconds is expired and may be taken by any worker, which
increments its epoch. Balancing is cooperative (`rebalance`): from the number of live workers
N, every worker aims at shards // N or one more; one above that gives shards back (they
become free at once), one below it takes free or expired shards. Nobody takes a live lease
from its owner, so a hand-over never has two owners at one epoch, and a stalled owner's late
writes fail the epoch check (`check_lease`) inside their own transaction.

Giving back is damped so that shards settle instead of flapping:
- a dead band: with 256 shards on 3 workers, 85 and 86 are both fair, so 86/85/85 is a
  resting state; a worker gives back down to 85 only while another holds fewer than 85;
- confirmation: a worker gives back only when it was already over its share at the previous
  heartbeat, so a worker seen for one beat (started and crashed) pulls nothing away;
- steps: at most `shards / 8` shards are given back per heartbeat. The taker loads the keys of
  what it takes, and a step keeps that load (and the stall of its event loop) short enough not
  to outlast its own leases; a load that did would make its shards expire and bounce back.
Taking is not limited: expired shards (a dead worker's) are taken in one beat.

Times come from the database's clock (`now()`), so workers' clocks need not agree. The local
view of what is held lapses a full lease period after the renewal began, never later than the
database's expiry, so two workers never both believe they hold one shard.
"""

from __future__ import annotations

import time

import asyncpg
from asyncpg.pool import PoolConnectionProxy

from sigil_push.shards import DEFAULT_SHARDS, Lease, StaleLease

GIVE_BACK_STEP_DIVISOR = 8
"""At most shards / 8 (32 of 256) are given back per heartbeat; see the module docstring."""


async def check_lease(
    connection: asyncpg.Connection | PoolConnectionProxy, worker_id: str, lease: Lease
) -> None:
    """Fail the current transaction unless `worker_id` still holds `lease` at its epoch.

    Call it inside the transaction that writes on behalf of the shard. The row lock (FOR
    SHARE) keeps any other worker from taking the shard until this transaction ends, so the
    check and the write are one atomic step.
    """
    if not connection.is_in_transaction():
        raise RuntimeError("check_lease must run inside the writing transaction")
    held = await connection.fetchval(
        "SELECT 1 FROM shard_leases WHERE shard = $1 AND owner = $2 AND epoch = $3 FOR SHARE",
        lease.shard,
        worker_id,
        lease.epoch,
    )
    if held is None:
        raise StaleLease(lease.shard, lease.epoch)


def rebalance(held: int, others: list[int], shards: int) -> tuple[int, int]:
    """How many shards a worker holding `held` should give back and how many it may take,
    given what each other live worker holds.

    With N live workers every worker should hold shards // N or one more. A worker above one
    more gives back the excess; one at one more gives back its extra shard only while another
    worker is below shards // N (someone needs it). A worker below shards // N takes up to
    it; one at it takes a free shard only when nobody is below (the extras go to whoever
    beats first). Nobody takes more than is free (unowned or expired). Both numbers are never
    positive together.
    """
    live = len(others) + 1
    least, most = shards // live, -(-shards // live)
    needy = any(count < least for count in others)
    if held > most:
        return held - most, 0
    if needy and held > least:
        return held - least, 0
    free = shards - held - sum(others)  # unowned or expired
    if held < least:
        return 0, min(least - held, free)
    return 0, min(most - held, free) if not needy else 0


class ShardLeaser:
    """One worker's side of the lease table: acquire, renew, balance and release.

    Each `tick` is one heartbeat; `ShardWatch` (sharding.py) runs them, in a supervised loop."""

    def __init__(
        self,
        pool: asyncpg.Pool,
        worker_id: str,
        lease_seconds: float = 15.0,
        shards: int = DEFAULT_SHARDS,
    ) -> None:
        if lease_seconds <= 0:
            raise ValueError("lease_seconds must be positive")
        self.pool = pool
        self.worker_id = worker_id
        self.lease_seconds = lease_seconds
        self.shards = shards
        self._held: dict[int, int] = {}
        self._valid_until = 0.0
        self._seeded = False
        self._over_share = False  # at the last heartbeat: held more than the fair share
        self.step = max(1, shards // GIVE_BACK_STEP_DIVISOR)

    def held(self) -> dict[int, int]:
        """Shard -> epoch currently held; empty once the last renewal is a lease period old."""
        return dict(self._held) if time.monotonic() < self._valid_until else {}

    async def tick(self) -> dict[int, int]:
        """One heartbeat: renew, give back excess, take free or expired shards, in one
        transaction. Returns what is held afterwards."""
        started = time.monotonic()
        lease = self.lease_seconds
        async with self.pool.acquire() as connection, connection.transaction():
            if not self._seeded:  # every shard needs its row before anyone can take it
                await connection.execute(
                    "INSERT INTO shard_leases (shard) SELECT generate_series(0, $1 - 1)"
                    " ON CONFLICT DO NOTHING",
                    self.shards,
                )
            await connection.execute(
                "INSERT INTO workers (worker_id) VALUES ($1) ON CONFLICT (worker_id)"
                " DO UPDATE SET heartbeat_at = now()",
                self.worker_id,
            )
            # a lease of ours that expired may be locked by a worker taking it over right now:
            # it is being lost anyway, so skip it rather than wait for that transaction (whose
            # worker may be stalled, loading keys, with the lock held). A live lease can only
            # be locked by our own `check_lease`, and that one is waited for.
            rows = await connection.fetch(
                "UPDATE shard_leases SET expires_at = now() + make_interval(secs => $2)"
                " WHERE owner = $1 AND (expires_at > now() OR shard IN (SELECT shard"
                "  FROM shard_leases WHERE owner = $1 AND expires_at <= now()"
                "  FOR UPDATE SKIP LOCKED)) RETURNING shard, epoch",
                self.worker_id,
                lease,
            )
            held = {int(row["shard"]): int(row["epoch"]) for row in rows}
            others = await connection.fetch(
                "SELECT w.worker_id, count(l.shard) AS held FROM workers w"
                " LEFT JOIN shard_leases l ON l.owner = w.worker_id AND l.expires_at > now()"
                " WHERE w.heartbeat_at > now() - make_interval(secs => $1) AND w.worker_id <> $2"
                " GROUP BY w.worker_id",
                lease,
                self.worker_id,
            )
            give, take = rebalance(len(held), [int(row["held"]) for row in others], self.shards)
            over_share = give > 0
            if over_share and self._over_share:
                give_back = sorted(held)[-min(give, self.step):]
                await connection.execute(
                    "UPDATE shard_leases SET owner = NULL, expires_at = '-infinity'"
                    " WHERE owner = $1 AND shard = ANY($2::int[])",
                    self.worker_id,
                    give_back,
                )
                for shard in give_back:
                    del held[shard]
            elif take:
                taken = await connection.fetch(
                    "UPDATE shard_leases SET owner = $1, epoch = epoch + 1,"
                    " expires_at = now() + make_interval(secs => $2)"
                    " WHERE shard IN (SELECT shard FROM shard_leases"
                    "  WHERE shard < $4 AND (owner IS NULL OR expires_at <= now())"
                    "  ORDER BY shard LIMIT $3 FOR UPDATE SKIP LOCKED)"
                    " RETURNING shard, epoch",
                    self.worker_id,
                    lease,
                    take,
                    self.shards,
                )
                held.update({int(row["shard"]): int(row["epoch"]) for row in taken})
            await connection.execute(
                "DELETE FROM workers WHERE heartbeat_at < now() - make_interval(secs => $1)",
                lease * 10,
            )
        self._seeded = True
        self._over_share = over_share
        self._held = held
        self._valid_until = started + lease
        return dict(held)

    async def release(self) -> None:
        """Clean shutdown, once heartbeats stopped: give every shard back for others to take."""
        self._held = {}
        async with self.pool.acquire() as connection, connection.transaction():
            await connection.execute(
                "UPDATE shard_leases SET owner = NULL, expires_at = '-infinity' WHERE owner = $1",
                self.worker_id,
            )
            await connection.execute("DELETE FROM workers WHERE worker_id = $1", self.worker_id)
