"""`Coordination` on SQLite: one process owns the file, so there is nobody to coordinate with.

Every key is watched, every canary probe is sent, signer sessions need no sync and the bridge
key cannot differ from another worker's. That one owner is enforced, not assumed: the store
writes each event's wakeups once without a (device, event) constraint (migration 0014), so a
second `serve` on the same file would push twice.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable
from contextlib import AsyncExitStack
from pathlib import Path

from sigil_push.config import ConfigError
from sigil_push.store.interface import Adopt, Reshard, SessionListener


class StoreInUse(ConfigError):
    """Another process already serves this SQLite file."""

    def __init__(self, path: Path) -> None:
        super().__init__(
            "server.database",
            f"{path.name} is already served by another process (one `serve` per SQLite file;"
            " several workers need PostgreSQL)",
        )


class EveryKey:
    """`Shards` of the only worker: every key, no leases."""

    def held(self) -> list[int] | None:
        return None

    def canary_gate(self) -> Callable[[], bool] | None:
        return None

    def problems(self) -> dict[str, str]:
        return {}

    async def start(self, stack: AsyncExitStack) -> None:
        return None

    def watching(self, stack: AsyncExitStack) -> None:
        return None


class SingleProcess:
    """`Coordination` of a store only this process opens."""

    several_workers = False

    def __init__(self, path: Path) -> None:
        self._lock_path = path.with_name(path.name + ".serving")

    async def claim(self, stack: AsyncExitStack) -> None:
        """An exclusive lock on a file beside the database for the service's life (a lock on
        the database file itself would be dropped by SQLite's own closing of descriptors).
        The kernel releases it when the process dies, so a killed `serve` never blocks the
        next one."""
        descriptor = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(descriptor)
            raise StoreInUse(self._lock_path.with_name(self._lock_path.stem)) from None
        stack.callback(os.close, descriptor)

    async def check_instance_key(self, pubkey: str) -> None:
        return None

    async def share_sessions(self, adopt: Adopt, stack: AsyncExitStack) -> SessionListener | None:
        return None

    def shards(self, reshard: Reshard, lease_seconds: float) -> EveryKey:
        return EveryKey()
