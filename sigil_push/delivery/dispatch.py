"""Dispatch: planned pushes → per-platform queues → sender tasks → `Settlement`.

Each platform has a window of rows in flight (queued or sending), four times its sender's
concurrency, so the next batches wait in the queue while the database round trips for them
run (slow when the event loop keeps the GIL busy); rows waiting there were never sent, so
this does not widen the resend-after-crash window. One window per platform: a slow provider
(or endpoints that never answer) fills its own window, never another provider's. Rows in
flight per UnifiedPush endpoint host are counted here for the planner's per-host caps.

Queued pushes wait for one of at most `max_concurrency` sender tasks, which take one push
after another while there are any: a task per burst of pushes rather than per push, and no
queueing at the sender's semaphore.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict, deque
from collections.abc import Mapping, Sequence

from sigil_push.delivery.plan import BATCH_SIZE, EndpointCaps, Host, Push, endpoint_caps
from sigil_push.delivery.settle import Settlement
from sigil_push.push.base import Outcome, Sender, Status
from sigil_push.store.interface import OutboxStore
from sigil_push.store.records import IRIS_PAYLOAD
from sigil_push.telemetry.tracebacks import withheld

log = logging.getLogger(__name__)

_ACCEPTED = Status.ACCEPTED
"""Looked up once: a module global is cheaper than the enum class' attribute."""


def rows_window(sender: Sender) -> int:
    """The most rows of one platform in flight at once."""
    return 4 * max(1, sender.max_concurrency)


class Dispatcher:
    """Queues planned pushes and runs the sender tasks that send them and settle the answers.

    `live_ids` are the rows claimed by a push in flight (housekeeping releases the claims of
    any other row); `host_rows` the rows in flight per endpoint host, read by the planner.
    """

    def __init__(
        self,
        outbox: OutboxStore,
        senders: Mapping[str, Sender],
        windows: Mapping[str, int],
        per_host: frozenset[str],
        settlement: Settlement,
        caps: EndpointCaps = endpoint_caps,
    ) -> None:
        """`caps`: the per-destination caps a push counts against (the planner's)."""
        self._caps = caps
        self._outbox = outbox
        self._senders = senders
        self._window = dict(windows)
        self._rows_in_flight: dict[str, int] = defaultdict(int)
        # refill in sizeable batches: waking per freed slot would mean one query per push
        self._refill = {p: max(1, min(BATCH_SIZE, w // 2)) for p, w in self._window.items()}
        self._per_host = per_host
        self.host_rows: dict[Host, int] = defaultdict(int)
        self.live_ids: set[int] = set()
        self._queues: dict[str, deque[Push]] = {p: deque() for p in senders}
        self._senders_running: dict[str, int] = defaultdict(int)
        self._tasks: set[asyncio.Task[None]] = set()
        self._settlement = settlement
        # bound once: called per push
        self._accept = settlement.accept
        self._settle = settlement.settle

    def open_platforms(self) -> list[str]:
        """The platforms with room for at least a refill's worth of rows."""
        return [p for p in self._senders if self._room(p) >= self._refill[p]]

    def _room(self, platform: str) -> int:
        return self._window[platform] - self._rows_in_flight[platform]

    def queue(self, pushes: Sequence[Push]) -> None:
        """Queue every push and start its senders. `due` claimed every row it returned: this
        runs before anything else can fail, so no claim is left without a task that settles it."""
        self.live_ids.update([w.id for push in pushes for w in push.wakeups])
        per_host = self._per_host
        for push in pushes:
            platform = push.device.platform
            self._rows_in_flight[platform] += len(push.wakeups)
            if platform in per_host or push.device.payload == IRIS_PAYLOAD:
                for cap in self._caps(push.device):
                    self.host_rows[cap] += len(push.wakeups)
            self._queues[platform].append(push)
        for platform in self._queues:
            self._start_senders(platform)

    def _start_senders(self, platform: str) -> None:
        """Enough sender tasks for the platform's queue, up to its sender's concurrency."""
        queue = self._queues[platform]
        room = self._senders[platform].max_concurrency - self._senders_running[platform]
        for _ in range(min(room, len(queue))):
            self._senders_running[platform] += 1
            task = asyncio.create_task(self._send_queued(platform))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _send_queued(self, platform: str) -> None:
        """One sender task: sends queued pushes until none is left. `_send` catches every
        failure of a push, so only cancellation (stop) ends a task with pushes still queued."""
        queue = self._queues[platform]
        try:
            while queue:
                await self._send(queue.popleft())
        finally:
            self._senders_running[platform] -= 1

    async def _send(self, push: Push) -> None:
        sender = self._senders[push.device.platform]
        try:
            try:
                outcome = await sender.send(push.message, push.device)
            except Exception as exc:
                log.error("%s sender failed unexpectedly", sender.provider, exc_info=withheld(exc))
                outcome = Outcome(Status.RETRY, detail="sender_error")
            try:
                if outcome.status is _ACCEPTED:  # most outcomes: no coroutine for the settling
                    self._accept(push, sender.provider)
                else:
                    await self._settle(push, sender.provider, outcome)
            except Exception as exc:
                log.error(
                    "cannot record a %s outcome; its wakeups will be retried", sender.provider,
                    exc_info=withheld(exc),
                )
                self._settlement.unsettled(push)
        finally:
            platform = push.device.platform
            wakeups = push.wakeups
            self._rows_in_flight[platform] -= len(wakeups)
            if len(wakeups) == 1:
                self.live_ids.discard(wakeups[0].id)
            else:
                self.live_ids.difference_update(w.id for w in wakeups)
            if platform in self._per_host or push.device.payload == IRIS_PAYLOAD:
                for cap in self._caps(push.device):
                    self.host_rows[cap] -= len(wakeups)
                    if not self.host_rows[cap]:
                        del self.host_rows[cap]
            if self._room(platform) >= self._refill[platform]:
                self._outbox.ready.set()

    async def drain(self, grace_seconds: float) -> None:
        """Let the sender tasks finish for up to `grace_seconds`, then cancel the rest."""
        if not self._tasks:
            return
        _, pending = await asyncio.wait(set(self._tasks), timeout=grace_seconds)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending)
