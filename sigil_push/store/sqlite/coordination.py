"""`Coordination` on SQLite: one process owns the file, so there is nobody to coordinate with.

Every key is watched, every canary probe is sent, signer sessions need no sync and the bridge
key cannot differ from another worker's.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AsyncExitStack

from sigil_push.store.interface import Adopt, Reshard, SessionListener


class EveryKey:
    """`Shards` of the only worker: every key, no leases."""

    def held(self) -> list[int] | None:
        return None

    def canary_gate(self) -> Callable[[], bool] | None:
        return None

    async def start(self, stack: AsyncExitStack) -> None:
        return None

    def watching(self, stack: AsyncExitStack) -> None:
        return None


class SingleProcess:
    """`Coordination` of a store only this process opens."""

    several_workers = False

    async def check_instance_key(self, pubkey: str) -> None:
        return None

    async def share_sessions(self, adopt: Adopt, stack: AsyncExitStack) -> SessionListener | None:
        return None

    def shards(self, reshard: Reshard, lease_seconds: float) -> EveryKey:
        return EveryKey()
