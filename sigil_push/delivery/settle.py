"""Settling: what each provider answer does to the outbox.

- accepted: the rows are deleted with their answer burst (`accept`, no coroutine per push);
- retry: rescheduled with exponential backoff and jitter, never before the provider's
  Retry-After, or given up when out of attempts or too old by then;
- unregistered: every account's registration of the dead token is forgotten, rows deleted;
- rejected: logged (token suffix only) and deleted.

Deletions are grouped (`complete_forever`): one statement per burst of answers, so the
database is never the bottleneck. Rows whose outcome could not be written are rescheduled by
the delivery loop's housekeeping (`reschedule_unsettled`).
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Sequence

from sigil_push.config import PushConfig
from sigil_push.delivery.plan import BATCH_SIZE, Push
from sigil_push.delivery.record import Answer, Recorder
from sigil_push.observations import now_ms
from sigil_push.push.base import Outcome, Status
from sigil_push.store.interface import DeviceStore, OutboxStore
from sigil_push.store.records import Wakeup
from sigil_push.telemetry.tracebacks import withheld

log = logging.getLogger(__name__)

ERROR_PAUSE_SECONDS = 1.0
COMPLETE_WITHIN_SECONDS = 0.02
"""How long an answered wakeup's row may wait for its DELETE, so one statement deletes a burst
of answers rather than the few that came back during the previous DELETE's round trip (at a
few thousand answers a second that was a statement, and a trip to the database thread, per
two or three pushes). A crash resends at most the rows answered in this time plus those of
the one DELETE in flight (which itself holds at most this time's answers). BATCH_SIZE rows
already waiting are deleted without the wait."""

_ACCEPTED_VALUE = Status.ACCEPTED.value
"""Looked up once: an enum member's attribute is a descriptor call in Python 3.11."""


class Settlement:
    """Applies provider answers to the outbox and the devices, and records them."""

    def __init__(
        self, outbox: OutboxStore, devices: DeviceStore, push: PushConfig, recorder: Recorder
    ) -> None:
        self._outbox = outbox
        self._devices = devices
        self._push = push
        self._recorder = recorder
        self._to_complete: list[int] = []
        # accepted pushes whose metrics and records wait for their burst's deletion
        self._accepted: list[Answer] = []
        self._completion_due = asyncio.Event()
        self._unsettled: list[int] = []

    def accept(self, push: Push, provider: str) -> None:
        """An accepted push is recorded and deleted with its answer burst."""
        self._accepted.append((push, provider, _ACCEPTED_VALUE, now_ms()))
        wakeups = push.wakeups
        if len(wakeups) == 1:
            self._to_complete.append(wakeups[0].id)
        else:
            self._to_complete.extend([w.id for w in wakeups])
        self._completion_due.set()

    async def settle(self, push: Push, provider: str, outcome: Outcome) -> None:
        """A push the provider did not accept: retried later, given up, or its token forgotten."""
        answered = now_ms()
        status = outcome.status
        ids = [w.id for w in push.wakeups]
        if status is Status.RETRY:
            next_ms = self._retry_at(push, outcome, answered)
            if next_ms is None:
                self._recorder.answered(push, provider, Status.RETRY, answered)
                await self.give_up(push.wakeups, outcome.detail or "retries exhausted")
                return
            self._recorder.answered(push, provider, status, answered)
            await self._outbox.reschedule(ids, next_ms)
            log.debug("%s push to …%s deferred: %s", provider, push.device.token_suffix, outcome.detail)
            return
        self._recorder.answered(push, provider, status, answered)
        if status is Status.UNREGISTERED:
            if await self._forget_token(push):
                self._recorder.pruned_token(provider)
                log.info("%s token …%s is dead (%s); its registrations are forgotten", provider,
                         push.device.token_suffix, outcome.detail)
        else:
            log.warning("%s refused push to …%s: %s", provider, push.device.token_suffix,
                        outcome.detail)
        self._to_complete.extend(ids)
        self._completion_due.set()

    def unsettled(self, push: Push) -> None:
        """A push whose outcome could not be written: its rows are rescheduled by housekeeping."""
        self._unsettled.extend(w.id for w in push.wakeups)

    async def reschedule_unsettled(self, now: int) -> None:
        if not self._unsettled:
            return
        ids, self._unsettled = self._unsettled, []
        try:
            await self._outbox.reschedule(ids, now + int(self._push.retry_base_seconds * 1000))
        except BaseException:
            self._unsettled.extend(ids)
            raise

    async def _forget_token(self, push: Push) -> bool:
        """Forget every account's registration of the push's dead token. Any registration the
        push carries names the token; one that was unregistered meanwhile names nothing, so
        the next is tried (the others on the phone must not outlive the token)."""
        for device_id in dict.fromkeys(w.device_id for w in push.wakeups):
            if await self._devices.forget(device_id) is not None:
                return True
        return False

    def _retry_at(self, push: Push, outcome: Outcome, now: int) -> int | None:
        """When to try again (backoff with jitter, never before Retry-After), or None to give up."""
        attempts = max(w.attempts for w in push.wakeups) + 1
        if attempts >= self._push.max_attempts:
            return None
        backoff = min(
            self._push.retry_max_seconds, self._push.retry_base_seconds * 2 ** (attempts - 1)
        )
        delay = backoff * random.uniform(0.5, 1.0)
        if outcome.retry_after_seconds is not None:
            delay = max(delay, outcome.retry_after_seconds)
        next_ms = now + int(delay * 1000)
        oldest = min(w.first_seen_ms for w in push.wakeups)
        if next_ms - oldest > self._push.max_wakeup_age_seconds * 1000:
            return None
        return next_ms

    async def give_up(self, wakeups: Sequence[Wakeup], reason: str) -> None:
        """Drop wakeups that are stale, out of attempts or without a provider: status failed."""
        self._recorder.gave_up(wakeups, now_ms())
        log.warning("gave up %d wakeups (%s)", len(wakeups), reason)
        await self._outbox.complete([w.id for w in wakeups])

    async def complete_forever(self) -> None:
        """Delete answered rows in bursts: at most COMPLETE_WITHIN_SECONDS after an answer."""
        while True:
            await self._completion_due.wait()
            if len(self._to_complete) < BATCH_SIZE:
                await asyncio.sleep(COMPLETE_WITHIN_SECONDS)
            self._completion_due.clear()
            try:
                await self.flush()
            except Exception as exc:
                log.error(
                    "cannot delete answered wakeups; retrying in %.0f s", ERROR_PAUSE_SECONDS,
                    exc_info=withheld(exc),
                )
                await asyncio.sleep(ERROR_PAUSE_SECONDS)
                self._completion_due.set()

    async def flush(self) -> None:
        """Record the accepted answers waiting, and delete every answered row waiting."""
        if self._accepted:
            accepted, self._accepted = self._accepted, []
            self._recorder.answered_many(accepted)
        ids, self._to_complete = self._to_complete, []
        if not ids:
            return
        try:
            await self._outbox.complete(ids)
        except BaseException:
            self._to_complete.extend(ids)
            raise
