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
  heartbeat, so a worker seen for one beat (started and crashed) pulls nothing away. That
  confirming beat comes early (`confirming`: `confirm_seconds`, lease_seconds / 15, later, not
  lease_seconds / 3), or confirming alone would cost a join a whole heartbeat.
- steps, once the worker watches its keys (`limit_steps`, when its bridge has started): at
  most shards / 8 (32 of 256) go back per heartbeat, so the keys given back (unwatched until
  the taker has loaded them) are few enough for the taker to load well within a lease. Before
  that, at start-up, the whole excess goes back at once: nothing is watched yet that a step
  would keep watched, and two workers started together settle at once instead of a step per
  heartbeat (four heartbeats plus four loads for 256 shards on two workers).
Taking is not limited: expired shards (a dead worker's) are taken in one beat.

A heartbeat that changed the split for others (this worker's first, which makes it a live
worker others must share with; one that gave shards back; a clean stop) returns `moved`, and
the caller announces it (`ShardWatch`, over NOTIFY): the other workers then beat at once
instead of up to lease_seconds / 3 later, so a join or a give-back is acted on in round
trips, not heartbeats.

After a failed heartbeat (the database gone, for everyone or for this worker alone) a worker
renews its own leases, expired or not, but takes nobody else's for one heartbeat interval: when
the whole database was away, every worker's heartbeat is as old as a dead one's at that moment.

Times come from the database's clock (`now()`), so workers' clocks need not agree. The local
view of what is held lapses a full lease period after the renewal began, never later than the
database's expiry, so two workers never both believe they hold one shard.
"""

from __future__ import annotations

import logging
import time

import asyncpg
from asyncpg.pool import PoolConnectionProxy

from sigil_push.shards import DEFAULT_SHARDS, Lease, StaleLease

log = logging.getLogger(__name__)

GIVE_BACK_STEP_DIVISOR = 8
"""Once `limit_steps`: at most shards / 8 are given back per heartbeat (module docstring)."""

SHARDS_CHANNEL = "sigil_push_shards"
"""NOTIFY channel on which a worker announces a heartbeat that moved shards (see above)."""


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


HEARTBEAT_SQL = """
WITH beat AS (
    INSERT INTO workers (worker_id) VALUES ($1)
    ON CONFLICT (worker_id) DO UPDATE SET heartbeat_at = now()
), renewed AS (
    UPDATE shard_leases SET expires_at = now() + make_interval(secs => $2)
    WHERE owner = $1 AND (expires_at > now() OR shard IN (
        SELECT shard FROM shard_leases WHERE owner = $1 AND expires_at <= now()
        FOR UPDATE SKIP LOCKED))
    RETURNING shard, epoch
), others AS (
    SELECT count(l.shard)::int AS held FROM workers w
    LEFT JOIN shard_leases l ON l.owner = w.worker_id AND l.expires_at > now()
    WHERE w.heartbeat_at > now() - make_interval(secs => $2) AND w.worker_id <> $1
    GROUP BY w.worker_id
), gone AS (
    DELETE FROM workers
    WHERE heartbeat_at < now() - make_interval(secs => $3) AND worker_id <> $1
)
SELECT (SELECT array_agg(shard ORDER BY shard) FROM renewed) AS shards,
       (SELECT array_agg(epoch ORDER BY shard) FROM renewed) AS epochs,
       (SELECT array_agg(held) FROM others) AS others
"""
"""A heartbeat's one statement: this worker's row, its leases renewed (shard and epoch), the
number of live leases of every other live worker, and workers silent for ten leases gone."""


class ShardLeaser:
    """One worker's side of the lease table: acquire, renew, balance and release.

    Each `tick` is one heartbeat; `ShardWatch` (sharding.py) runs them, in a supervised loop."""

    def __init__(
        self,
        pool: asyncpg.Pool,
        worker_id: str,
        lease_seconds: float = 15.0,
        shards: int = DEFAULT_SHARDS,
        confirm_seconds: float | None = None,
    ) -> None:
        """`confirm_seconds`: how soon the beat that confirms a give-back follows the one that
        first found this worker over its share (lease_seconds / 15 unless given)."""
        if lease_seconds <= 0:
            raise ValueError("lease_seconds must be positive")
        self.pool = pool
        self.worker_id = worker_id
        self.lease_seconds = lease_seconds
        self.shards = shards
        self.confirm_seconds = lease_seconds / 15 if confirm_seconds is None else confirm_seconds
        self._held: dict[int, int] = {}
        self._valid_until = 0.0
        self._seeded = False
        self._over_share = False  # at the last heartbeat: held more than the fair share
        self.step = shards  # the whole excess at once, until `limit_steps`
        self.moved = False
        """Whether the last heartbeat changed what the others may take: it was this worker's
        first (a new live worker to share with) or it gave shards back."""
        self.confirming = False
        """Whether the last heartbeat found this worker over its share for the first time: the
        next one, which gives back, is due early."""
        self.unheld = 0
        """Shards held by no live worker after the last heartbeat (unowned or expired): their
        keys are watched by nobody until some worker takes them."""
        self.live_workers = 1
        """Live workers (this one included) at the last heartbeat."""
        self._cut_off = False  # the last heartbeat failed
        self._patient_until = 0.0  # take nothing before this (see `tick`)

    def limit_steps(self) -> None:
        """This worker now watches its keys: give back at most shards / 8 per heartbeat."""
        self.step = max(1, self.shards // GIVE_BACK_STEP_DIVISOR)

    def held(self) -> dict[int, int]:
        """Shard -> epoch currently held; empty once the last renewal is a lease period old."""
        return dict(self._held) if time.monotonic() < self._valid_until else {}

    async def tick(self) -> dict[int, int]:
        """One heartbeat: renew and read the others' counts in one statement, then give back
        the excess or take free or expired shards in a second one only when the split calls
        for it. Returns what is held afterwards.

        One round trip, not a transaction of six: a worker loading a million keys gets a turn
        of its event loop only every chunk, and each round trip of a heartbeat waited for one;
        on a loaded machine six of them outlasted a 3 s lease, the leases expired, the other
        worker (seeing this one's heartbeat just as old) took them, and they bounced back.
        Each statement is atomic on its own; a give or a take decided from the counts just
        read can only be conservative (a take gets free or expired shards only, SKIP LOCKED).
        """
        started = time.monotonic()
        try:
            return await self._tick(started)
        except BaseException:
            # This worker was cut off: maybe alone, maybe with every worker (the database
            # itself went away). In the second case the others' heartbeats are as old as ours
            # when it comes back, so they look dead and their expired shards free: taking them
            # at our first beat would move half the keys for nothing, and back again in steps.
            # So for one heartbeat interval after we are back, renew our own leases only; the
            # others renew theirs meanwhile, and a worker that really died is taken over then.
            self._cut_off = True
            raise

    async def _tick(self, started: float) -> dict[int, int]:
        lease = self.lease_seconds
        if self._cut_off:
            self._cut_off = False
            self._patient_until = started + lease / 2
        async with self.pool.acquire() as connection:
            if not self._seeded:  # every shard needs its row before anyone can take it
                await connection.execute(
                    "INSERT INTO shard_leases (shard) SELECT generate_series(0, $1 - 1)"
                    " ON CONFLICT DO NOTHING",
                    self.shards,
                )
            # a lease of ours that expired may be locked by a worker taking it over right now:
            # it is being lost anyway, so skip it rather than wait for that transaction (whose
            # worker may be stalled, loading keys, with the lock held). A live lease can only
            # be locked by our own `check_lease`, and that one is waited for. The others are
            # counted in the statement's snapshot, which our own changes do not touch.
            row = await connection.fetchrow(HEARTBEAT_SQL, self.worker_id, lease, lease * 10)
            assert row is not None
            held = dict(zip(row["shards"] or [], row["epochs"] or [], strict=True))
            others = list(row["others"] or [])
            give, take = rebalance(len(held), others, self.shards)
            if started < self._patient_until:
                take = 0
            over_share = give > 0
            gave = over_share and self._over_share
            if gave:
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
        took = time.monotonic() - started
        if took > lease / 2:
            log.warning("shard lease heartbeat took %.1f s of a %.1f s lease", took, lease)
        self.moved = gave or not self._seeded
        self.confirming = over_share and not gave
        self._seeded = True
        self._over_share = over_share
        self._held = held
        self._valid_until = started + lease
        self.unheld = max(0, self.shards - len(held) - sum(others))
        self.live_workers = len(others) + 1
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
