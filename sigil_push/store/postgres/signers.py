"""Delegated-auth signer sessions across workers: a session set through one worker's API reaches
the others at once, not at their next restart.

Sessions live in `auth_signers`; each worker keeps the ones it uses in memory
(`DelegatedAuth`). The worker that sets a signer establishes the session (the NIP-46 handshake)
and stores its status; every status change there is announced with NOTIFY on
`sigil_push_auth_signers` (worker id and pubkey, on the registration listener's connection).
The other workers then take the stored session as it is (`DelegatedAuth.adopt`), so the signer
is asked to connect once, and the worker that owns the key's shard opens the user's inbox
connections with it. A change a worker adopts is not announced again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from sigil_push.store.errors import POSTGRES_FAILURES
from sigil_push.store.postgres.devices import PostgresDevices

CHANNEL = "sigil_push_auth_signers"
log = logging.getLogger(__name__)

Adopt = Callable[[str], Awaitable[None]]


class SignerSessionSync:
    """Announces this worker's session changes and adopts the other workers'."""

    def __init__(self, devices: PostgresDevices, adopt: Adopt) -> None:
        self._devices = devices
        self._adopt = adopt
        self._adopting: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        await self._devices.also_listen(CHANNEL, self._heard)

    def status_changed(self, pubkey: str, _status: str) -> None:
        """`DelegatedAuth` listener: announce a change made here (not one adopted from
        another worker, which would echo back and forth)."""
        if pubkey not in self._adopting:
            self._spawn(self._announce(pubkey))

    def _heard(self, pubkey: str) -> None:
        self._spawn(self._take(pubkey))

    async def _announce(self, pubkey: str) -> None:
        try:
            await self._devices.announce(CHANNEL, pubkey)
        except POSTGRES_FAILURES as exc:
            # the other workers then see this session only at their next start
            log.warning("could not announce a signer session change: %s", type(exc).__name__)

    async def _take(self, pubkey: str) -> None:
        self._adopting.add(pubkey)
        try:
            await self._adopt(pubkey)
        except POSTGRES_FAILURES as exc:
            log.warning("could not read a signer session another worker changed: %s",
                        type(exc).__name__)
        finally:
            self._adopting.discard(pubkey)

    def _spawn(self, work: Awaitable[None]) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def stop(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
