"""Recipient keys split into shards, the unit of bridge work that moves between workers.

Backend-neutral: which shard a key belongs to, each worker's fair share, and the error a write
raises when its lease's epoch (fencing token) is no longer current. The PostgreSQL lease table
that hands shards out lives in sigil_push.store.postgres.leases.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_SHARDS = 256


class StaleLease(Exception):
    """A write on behalf of a shard whose lease this worker no longer holds at that epoch.

    Raised inside the write's transaction, so the write is rolled back: a worker that stalled
    past its lease and wakes up cannot act on work that has moved to another worker.
    """

    def __init__(self, shard: int, epoch: int) -> None:
        super().__init__(f"lease on shard {shard} at epoch {epoch} is no longer held")
        self.shard = shard
        self.epoch = epoch


@dataclass(frozen=True)
class Lease:
    """A shard held by this worker; `epoch` grows each time the shard changes owner."""

    shard: int
    epoch: int


def shard_of(pubkey_hex: str, shards: int = DEFAULT_SHARDS) -> int:
    """The shard of a 32-byte hex public key.

    Public keys are uniformly distributed already (x-coordinates of random points), so their
    leading 32 bits are a stable, even hash; no salt, so every worker and every release agrees.
    """
    if len(pubkey_hex) != 64:
        raise ValueError("expected a 64-character hex public key")
    return int(pubkey_hex[:8], 16) % shards


@dataclass(frozen=True)
class ShardSet:
    """A worker's shards after a lease change, as the test of which keys are its own
    (`owns(pubkey)`), with the shards `gained` by that change: a reshard reads the keys and
    baselines of those only, not of every shard it holds."""

    held: frozenset[int]
    count: int
    gained: frozenset[int]

    def __call__(self, pubkey_hex: str) -> bool:
        return shard_of(pubkey_hex, self.count) in self.held

    def hex_pairs(self) -> list[str] | None:
        """The 7th and 8th hex digits (`pubkey[6:8]`) of the keys in these shards, for a query
        to select them by with plain SQL on either engine; None when the shard count does not
        divide 256 (the shard then depends on more than those two digits)."""
        if 256 % self.count:
            return None
        return [f"{low:02x}" for low in range(256) if low % self.count in self.held]


def fair_share(shards: int, workers: int) -> int:
    """The most shards one of `workers` live workers should hold (rounded up, so all are held)."""
    return -(-shards // max(workers, 1))
