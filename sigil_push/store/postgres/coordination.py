"""`Coordination` on PostgreSQL: any number of `serve` workers share one database.

- the bridge key: every worker must hold the instance's (`check_instance_key`);
- signer sessions: a change made through one worker reaches the others over NOTIFY
  (`signers.SignerSessionSync`);
- key shards: each worker's bridge watches the keys of the shards it holds leases on
  (`leases.ShardLeaser`, driven by `sharding.ShardWatch`); a join or give-back is announced and
  heard by the others as a nudge to beat at once.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AsyncExitStack

import asyncpg

from sigil_push.config import ConfigError
from sigil_push.identity import MetaStore
from sigil_push.store.interface import Adopt, Reshard, SessionListener
from sigil_push.store.postgres.devices import PostgresDevices
from sigil_push.store.postgres.leases import SHARDS_CHANNEL, ShardLeaser
from sigil_push.store.postgres.sharding import ShardWatch
from sigil_push.store.postgres.signers import SignerSessionSync

INSTANCE_KEY = "instance_bridge_pubkey"


class ForeignBridgeKey(ConfigError):
    """This worker's bridge key is not the one the instance's other workers use."""

    def __init__(self) -> None:
        super().__init__(
            "server.secret_key_file",
            "this worker's bridge key differs from the one the instance already uses; every"
            " worker needs the same key (copy the first worker's key file, or set secret_key)",
        )


async def check_instance_key(meta: MetaStore, pubkey: str) -> None:
    """Every worker of an instance must share the bridge key: relays see one client key
    (NIP-42), and delegated-auth sessions are sealed under it, so a worker with another key
    would take them for unreadable. The first worker records the key's public half."""
    await meta.put_if_absent(INSTANCE_KEY, pubkey)
    if await meta.get(INSTANCE_KEY) != pubkey:
        raise ForeignBridgeKey


class LeasedShards:
    """`Shards` held on leases (`ShardWatch`), announced to the other workers."""

    def __init__(self, watch: ShardWatch, devices: PostgresDevices) -> None:
        self._watch = watch
        self._devices = devices

    def held(self) -> list[int] | None:
        return self._watch.held()

    def canary_gate(self) -> Callable[[], bool] | None:
        return self._watch.runs_canary

    def problems(self) -> dict[str, str]:
        return self._watch.problems()

    async def start(self, stack: AsyncExitStack) -> None:
        watch = self._watch
        await self._devices.also_listen(SHARDS_CHANNEL, lambda _moved: watch.nudge())
        self._devices.on_missed(watch.reload)
        await watch.start()
        stack.push_async_callback(watch.release)

    def watching(self, stack: AsyncExitStack) -> None:
        self._watch.watching()
        stack.push_async_callback(self._watch.halt)


class WorkerCoordination:
    """`Coordination` of one of several workers on a PostgreSQL database."""

    several_workers = True

    def __init__(
        self, pool: asyncpg.Pool, devices: PostgresDevices, meta: MetaStore, worker_id: str
    ) -> None:
        self._pool = pool
        self._devices = devices
        self._meta = meta
        self._worker_id = worker_id

    async def claim(self, stack: AsyncExitStack) -> None:
        return None

    async def check_instance_key(self, pubkey: str) -> None:
        await check_instance_key(self._meta, pubkey)

    async def share_sessions(self, adopt: Adopt, stack: AsyncExitStack) -> SessionListener | None:
        signers = SignerSessionSync(self._devices, adopt)
        await signers.start()
        stack.push_async_callback(signers.stop)
        return signers.status_changed

    def shards(self, reshard: Reshard, lease_seconds: float) -> LeasedShards:
        devices = self._devices
        watch = ShardWatch(
            ShardLeaser(self._pool, self._worker_id, lease_seconds),
            reshard,
            devices.narrow_to,
            lambda: devices.announce(SHARDS_CHANNEL, "moved"),
        )
        return LeasedShards(watch, devices)
