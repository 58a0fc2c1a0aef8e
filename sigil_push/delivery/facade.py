"""Delivery: takes due wakeups from the outbox to the providers and acts on their outcomes.

`Delivery` wires its parts and runs the loop and their life cycle; each step is its module:

- `plan`: a due batch + the phones' rate budgets and coalescing windows + rows in flight per
  endpoint host → pushes (with their payloads) and rows held until a time (pure, no I/O);
- `dispatch`: per-platform windows of rows in flight, queues and sender tasks, each push's
  outcome handed to the settlement;
- `settle`: outcomes → outbox: deletions in bursts, retries with backoff and Retry-After,
  dead tokens forgotten, stale wakeups given up;
- `record`: the delivery metrics and the `push` observation records.

One loop plans, many tasks send. The loop reads due wakeups (only for platforms with room in
their window), plans them, queues the pushes, and writes the holds back to the outbox (so the
held wakeups are on disk and travel together later).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from sigil_push.config import STOP_GRACE_SECONDS, IrisConfig, LimitsConfig, PushConfig
from sigil_push.delivery.dispatch import Dispatcher, rows_window
from sigil_push.delivery.plan import BATCH_SIZE, EndpointCaps, Planner, platform_policies
from sigil_push.delivery.record import Recorder
from sigil_push.delivery.settle import ERROR_PAUSE_SECONDS, Settlement
from sigil_push.observations import ObservationLog, now_ms
from sigil_push.push.base import Sender
from sigil_push.push.registry import BrowserPushServices
from sigil_push.store.errors import STORE_UNAVAILABLE
from sigil_push.store.interface import DeviceStore, OutboxStore
from sigil_push.store.records import Wakeup
from sigil_push.supervisor import Supervisor
from sigil_push.telemetry.tracebacks import withheld

log = logging.getLogger(__name__)

IDLE_POLL_SECONDS = 1.0
"""Also picks up wakeups written by another process (e.g. `sigil-push` tools) without a signal."""
HOUSEKEEPING_SECONDS = 1.0


class Delivery:
    """The delivery loop over the outbox `outbox` to `senders` (one per enabled platform)."""

    def __init__(
        self,
        outbox: OutboxStore,
        devices: DeviceStore,
        senders: dict[str, Sender],
        observations: ObservationLog,
        record_outcomes: bool,
        push: PushConfig | None = None,
        limits: LimitsConfig | None = None,
        supervisor: Supervisor | None = None,
        iris: IrisConfig | None = None,
    ) -> None:
        self._supervisor = supervisor if supervisor is not None else Supervisor()
        self._outbox = outbox
        self._senders = senders
        self._push = push or PushConfig()
        windows = {platform: rows_window(sender) for platform, sender in senders.items()}
        platforms = platform_policies(senders, windows)
        iris = iris or IrisConfig()
        caps = EndpointCaps(BrowserPushServices.of(iris.browser_push_services))
        self._planner = Planner(
            platforms, self._push, limits or LimitsConfig(), outbox.collapse_id,
            iris.notification_url, caps,
        )
        self._recorder = Recorder(senders, observations, record_outcomes)
        self._settlement = Settlement(outbox, devices, self._push, self._recorder)
        per_host = frozenset(p for p, policy in platforms.items() if policy.host_cap is not None)
        self._dispatcher = Dispatcher(outbox, senders, windows, per_host, self._settlement, caps)
        self._loop_task: asyncio.Task[None] | None = None
        self._completer_task: asyncio.Task[None] | None = None
        self._housekeeping_at = 0.0

    async def start(self) -> None:
        """Resume what a previous run left in the outbox, then start sending."""
        released = await self._outbox.resume(now_ms())
        if released:
            log.warning(
                "%d wakeups were in flight when the service last stopped; sending them again",
                released,
            )
        self._recorder.outbox_depth(await self._outbox.depth())
        await self._measure_outbox_age()
        self._completer_task = self._supervisor.spawn(
            "outbox-completer", self._settlement.complete_forever, core=True
        )
        self._loop_task = self._supervisor.spawn("delivery", self._run, core=True)

    async def stop(self) -> None:
        """Stop taking wakeups, let pushes in flight finish briefly, keep the rest on disk."""
        await _cancel(self._loop_task)
        self._loop_task = None
        await self._dispatcher.drain(STOP_GRACE_SECONDS)
        await _cancel(self._completer_task)
        self._completer_task = None
        await self._settlement.flush()
        for sender in self._senders.values():
            await sender.close()

    async def _run(self) -> None:
        while True:
            try:
                await self._step()
            except STORE_UNAVAILABLE as exc:
                # a locked or unreachable database is its state, not a bug: no traceback
                log.warning("delivery paused: storage busy (%s); retrying in %.0f s",
                            type(exc).__name__, ERROR_PAUSE_SECONDS)
                await asyncio.sleep(ERROR_PAUSE_SECONDS)
            except Exception as exc:
                log.error(
                    "delivery loop error; retrying in %.0f s", ERROR_PAUSE_SECONDS, exc_info=withheld(exc)
                )
                await asyncio.sleep(ERROR_PAUSE_SECONDS)

    async def _step(self) -> None:
        """One round: dispatch a batch of due wakeups, or sleep until there may be some."""
        self._outbox.ready.clear()
        await self._housekeeping()
        open_platforms = self._dispatcher.open_platforms()
        # a platform with no room is left out of the query, so its due rows can never stand
        # in front of another platform's
        if open_platforms and len(open_platforms) == len(self._senders):
            due = await self._outbox.due(now_ms(), BATCH_SIZE)
        elif open_platforms:
            due = await self._outbox.due(now_ms(), BATCH_SIZE, open_platforms)
        else:
            due = []
        if due:
            await self._deliver(due)
            return
        await self._idle(bool(open_platforms))

    async def _deliver(self, due: list[Wakeup]) -> None:
        """Plan a due batch, queue its pushes, then write its holds and give up the stale."""
        plan = self._planner.plan(due, now_ms(), self._dispatcher.host_rows)
        self._dispatcher.queue(plan.pushes)
        self._recorder.coalesced(plan.coalesced)
        for at_ms, ids in plan.held.items():
            await self._outbox.hold(ids, at_ms)
        if plan.expired:
            await self._settlement.give_up(plan.expired, "too old or too many attempts")
        if plan.unsendable:
            await self._settlement.give_up(plan.unsendable, "platform no longer enabled")
        if plan.rate_limited:
            self._recorder.rate_limited(plan.rate_limited, now_ms())
            await self._outbox.complete([w.id for w in plan.rate_limited])

    async def _idle(self, has_room: bool) -> None:
        """Sleep until new wakeups, a freed slot, the next due wakeup or the poll interval."""
        timeout = IDLE_POLL_SECONDS
        if has_room:
            next_due = await self._outbox.next_due_ms()
            if next_due is not None:
                timeout = min(timeout, max(0.0, (next_due - now_ms()) / 1000))
        # asyncio.timeout, not wait_for: on Python 3.11 wait_for swallows a cancellation that
        # lands as the event is set, and stop() then waits for ever on a loop that goes on
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self._outbox.ready.wait()

    async def _measure_outbox_age(self) -> None:
        self._recorder.outbox_age(await self._outbox.oldest_first_seen_ms(), now_ms())

    async def _housekeeping(self) -> None:
        loop_time = asyncio.get_running_loop().time()
        if loop_time < self._housekeeping_at:
            return
        self._housekeeping_at = loop_time + HOUSEKEEPING_SECONDS
        now = now_ms()
        self._planner.prune(now)
        self._recorder.outbox_depth(await self._outbox.depth())
        # a claim no push task holds any more (its outcome could not be written, or a
        # reschedule failed) comes back once it is older than a send could take
        claim_horizon = now - int((2 * self._push.send_timeout_seconds + STOP_GRACE_SECONDS) * 1000)
        released = await self._outbox.release_claims(claim_horizon, self._dispatcher.live_ids)
        if released:
            log.warning("%d wakeups had stale claims; they are due again", released)
        await self._measure_outbox_age()
        await self._settlement.reschedule_unsettled(now)


async def _cancel(task: asyncio.Task[None] | None) -> None:
    if task is None:
        return
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
