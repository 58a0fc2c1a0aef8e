"""Delivery: takes due wakeups from the outbox to the providers and acts on their outcomes."""

from __future__ import annotations

import asyncio
import logging
import random

from sigil_push.devices import Devices
from sigil_push.observations import ObservationLog, now_ms
from sigil_push.outbox import Outbox, Wakeup
from sigil_push.push.base import Outcome, Sender, Status, WakeupMessage

log = logging.getLogger(__name__)

BATCH_SIZE = 500
IDLE_POLL_SECONDS = 1.0
BASE_RETRY_SECONDS = 2.0
MAX_RETRY_SECONDS = 300.0


class Delivery:
    def __init__(
        self,
        outbox: Outbox,
        devices: Devices,
        senders: dict[str, Sender],
        observations: ObservationLog,
        record_outcomes: bool,
    ) -> None:
        self._outbox = outbox
        self._devices = devices
        self._senders = senders
        self._observations = observations
        self._record_outcomes = record_outcomes
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="delivery")

    async def stop(self) -> None:
        """Stop sending; whatever is still pending stays on disk for the next start."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        for sender in self._senders.values():
            await sender.close()

    async def _run(self) -> None:
        while True:
            self._outbox.ready.clear()
            due = await self._outbox.due(now_ms(), BATCH_SIZE)
            if due:
                await asyncio.gather(*(self._deliver(wakeup) for wakeup in due))
                continue
            try:
                await asyncio.wait_for(self._outbox.ready.wait(), IDLE_POLL_SECONDS)
            except TimeoutError:
                pass

    async def _deliver(self, wakeup: Wakeup) -> None:
        device = await self._devices.by_id(wakeup.device_id)
        if device is None:
            await self._outbox.complete([wakeup.id])
            return
        sender = self._senders.get(device.platform)
        if sender is None:
            await self._outbox.complete([wakeup.id])
            return
        message = WakeupMessage(event_ids=(wakeup.event_id,), data={"type": "wakeup"})
        try:
            outcome = await sender.send(message, device)
        except Exception:  # noqa: BLE001 - a provider bug must not stop delivery
            log.exception("sender %s crashed", device.platform)
            outcome = Outcome(Status.RETRY, detail="sender error")
        await self._settle(wakeup, device.platform, outcome)

    async def _settle(self, wakeup: Wakeup, platform: str, outcome: Outcome) -> None:
        if self._record_outcomes:
            self._observations.push(
                wakeup.event_id, platform, outcome.status.value, now_ms() - wakeup.first_seen_ms
            )
        if outcome.status is Status.RETRY:
            delay = outcome.retry_after_seconds or min(
                MAX_RETRY_SECONDS, BASE_RETRY_SECONDS * 2**wakeup.attempts
            )
            await self._outbox.reschedule([wakeup.id], now_ms() + int(delay * random.uniform(1, 1.5) * 1000))
            return
        if outcome.status is Status.UNREGISTERED:
            await self._devices.forget(wakeup.device_id)
        await self._outbox.complete([wakeup.id])
