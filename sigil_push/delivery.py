"""Delivery: takes due wakeups from the outbox to the providers and acts on their outcomes.

One loop plans, many tasks send. The loop reads due wakeups, drops the stale, holds back what
a device's coalescing window or rate limit does not allow yet (by rescheduling it in the
outbox, so the held wakeups are on disk and travel together later), claims the rest and
queues them for the platform's sender tasks (at most its sender's concurrency), which send one
push after another and settle each outcome: complete, retry with backoff, or forget a dead
token. Deletions are grouped into one statement per round trip to SQLite,
so the database is never the bottleneck.

A device here is the phone, named by its (platform, token): several accounts (npubs) may be
registered on it, each its own row. Coalescing windows and rate budgets belong to the phone,
so opaque wakeups for all its accounts become one push. `event_id` and `event` pushes stay
per registration, since each names one account's event.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections import defaultdict, deque
from collections.abc import Sequence
from typing import NamedTuple
from urllib.parse import urlsplit

from sigil_push.config import STOP_GRACE_SECONDS, LimitsConfig, PushConfig
from sigil_push.observations import ObservationLog, PushRecord, now_ms
from sigil_push.push import metrics
from sigil_push.push.base import Outcome, Sender, Status, WakeupMessage
from sigil_push.push.limits import DeviceRateLimiter
from sigil_push.push.payload import fallback, opaque_data, wakeup_data
from sigil_push.store.interface import DeviceStore, OutboxStore
from sigil_push.store.records import Device, Wakeup, WebPushKeys
from sigil_push.supervisor import Supervisor

log = logging.getLogger(__name__)

BATCH_SIZE = 500
IDLE_POLL_SECONDS = 1.0
"""Also picks up wakeups written by another process (e.g. `sigil-push` tools) without a signal."""
HOUSEKEEPING_SECONDS = 1.0
ERROR_PAUSE_SECONDS = 1.0
COMPLETE_WITHIN_SECONDS = 0.02
"""How long an answered wakeup's row may wait for its DELETE, so one statement deletes a burst
of answers rather than the few that came back during the previous DELETE's round trip (at a
few thousand answers a second that was a statement, and a trip to the database thread, per
two or three pushes). A crash resends at most the rows answered in this time plus those of
the one DELETE in flight (which itself holds at most this time's answers). BATCH_SIZE rows
already waiting are deleted without the wait."""
HOST_SHARE = 8
"""A UnifiedPush endpoint host may hold at most 1/HOST_SHARE of its platform's window (a push
to a host with nothing in flight always may go, however many wakeups it carries)."""
HOST_HOLD_SECONDS = 1.0
"""How long a wakeup for a host at its cap waits on disk before it is looked at again, at
least: a quarter of the send timeout, so a tarpit's backlog is not re-read (in front of
everyone else's due wakeups) every second while its pushes hang."""


PhoneKey = tuple[str, str]
"""(platform, token): one physical device, whichever accounts are registered on it."""
PushKey = tuple[str, str, WebPushKeys | None]
"""What wakeups must share to travel in one push: the phone, and for UnifiedPush the WebPush
keys the body is encrypted to (two registrations of one endpoint could give different ones)."""


def _phone(device: Device) -> PhoneKey:
    return device.platform, device.token


class Push(NamedTuple):
    """One push to one device, standing for one or more outbox rows (of one or more of the
    accounts registered on it); `device` is the registration whose token and keys it uses.
    A NamedTuple: immutable, and built per push without a frozen dataclass' setattr calls."""

    device: Device
    wakeups: tuple[Wakeup, ...]
    message: WakeupMessage


_ACCEPTED, _ACCEPTED_VALUE = Status.ACCEPTED, Status.ACCEPTED.value
"""Looked up once: an enum member's attribute is a descriptor call in Python 3.11."""

Answer = tuple[Push, str, str, int]
"""(push, provider, status, answered_ms): one provider answer to record."""


class Delivery:
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
    ) -> None:
        self._supervisor = supervisor if supervisor is not None else Supervisor()
        self._outbox = outbox
        self._devices = devices
        self._senders = senders
        self._observations = observations
        self._record_outcomes = record_outcomes
        self._push = push or PushConfig()
        limits = limits or LimitsConfig()
        self._coalesce_ms = limits.coalesce_window_ms
        self._rate = DeviceRateLimiter(limits.wakeups_per_minute_per_device)
        # per phone: when it last got an opaque push, which opens its coalescing window
        self._last_push_ms: dict[PhoneKey, int] = {}
        # per platform, four times its sender's slots, so the next batches wait in the queue
        # while the database round trips for them run (slow when the event loop keeps the GIL
        # busy); rows waiting there were never sent, so this does not widen the
        # resend-after-crash window. One window per platform: a slow provider (or endpoints
        # that never answer) fills its own window, never another provider's.
        self._max_rows_in_flight = {p: 4 * max(1, s.max_concurrency) for p, s in senders.items()}
        self._rows_in_flight: dict[str, int] = defaultdict(int)
        # refill in sizeable batches: waking per freed slot would mean one query per push
        self._refill = {p: max(1, min(BATCH_SIZE, w // 2)) for p, w in self._max_rows_in_flight.items()}
        # UnifiedPush endpoints are user-chosen hosts: each may hold only a share of the window
        self._host_cap = {p: max(1, w // HOST_SHARE) for p, w in self._max_rows_in_flight.items()}
        self._host_rows: dict[tuple[str, str], int] = defaultdict(int)
        self._per_host = frozenset(p for p, s in senders.items() if s.provider == "unifiedpush")
        self._host_hold_ms = int(
            1000 * max(HOST_HOLD_SECONDS, self._push.send_timeout_seconds / 4)
        )
        self._live_ids: set[int] = set()
        # claimed pushes wait in their platform's queue for one of at most max_concurrency
        # senders, which take one push after another while there are any: a task per burst
        # of pushes rather than per push, and no queueing at the sender's semaphore
        self._queues: dict[str, deque[Push]] = {p: deque() for p in senders}
        self._senders_running: dict[str, int] = defaultdict(int)
        self._tasks: set[asyncio.Task[None]] = set()
        self._to_complete: list[int] = []
        # accepted pushes whose metrics and records wait for their burst's deletion
        self._accepted: list[Answer] = []
        self._completion_due = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._completer_task: asyncio.Task[None] | None = None
        self._housekeeping_at = 0.0
        self._unsettled: list[int] = []
        # metric series bound once: a labels() lookup per push is a measurable share of a push;
        # keyed by the status' string, since hashing an enum member runs Python code
        self._pushes = {
            (s.provider, status.value): metrics.PUSHES.labels(s.provider, status.value)
            for s in senders.values() for status in Status
        }

    async def start(self) -> None:
        """Resume what a previous run left in the outbox, then start sending."""
        released = await self._outbox.resume(now_ms())
        if released:
            log.warning(
                "%d wakeups were in flight when the service last stopped; sending them again",
                released,
            )
        metrics.OUTBOX_DEPTH.set(await self._outbox.depth())
        await self._measure_outbox_age()
        self._completer_task = self._supervisor.spawn(
            "outbox-completer", self._complete_forever, core=True
        )
        self._loop_task = self._supervisor.spawn("delivery", self._run, core=True)

    async def stop(self) -> None:
        """Stop taking wakeups, let pushes in flight finish briefly, keep the rest on disk."""
        await _cancel(self._loop_task)
        self._loop_task = None
        if self._tasks:
            _, pending = await asyncio.wait(set(self._tasks), timeout=STOP_GRACE_SECONDS)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending)
        await _cancel(self._completer_task)
        self._completer_task = None
        await self._flush_completions()
        for sender in self._senders.values():
            await sender.close()

    async def _run(self) -> None:
        while True:
            try:
                await self._step()
            except Exception:
                log.exception("delivery loop error; retrying in %.0f s", ERROR_PAUSE_SECONDS)
                await asyncio.sleep(ERROR_PAUSE_SECONDS)

    async def _step(self) -> None:
        """One round: dispatch a batch of due wakeups, or sleep until there may be some."""
        self._outbox.ready.clear()
        await self._housekeeping()
        open_platforms = [p for p in self._senders if self._room(p) >= self._refill[p]]
        # a platform with no room is left out of the query, so its due rows can never stand
        # in front of another platform's
        if open_platforms and len(open_platforms) == len(self._senders):
            due = await self._outbox.due(now_ms(), BATCH_SIZE)
        elif open_platforms:
            due = await self._outbox.due(now_ms(), BATCH_SIZE, open_platforms)
        else:
            due = []
        if due:
            await self._dispatch(due)
            return
        await self._idle(bool(open_platforms))

    def _room(self, platform: str) -> int:
        return self._max_rows_in_flight[platform] - self._rows_in_flight[platform]

    def _host_of(self, device: Device) -> tuple[str, str] | None:
        """The endpoint host a UnifiedPush push goes to (None for the big providers)."""
        if device.platform not in self._per_host:
            return None
        try:
            return device.platform, urlsplit(device.token).hostname or ""
        except ValueError:
            return device.platform, ""

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
        """A stuck outbox shows as age, not depth: a quiet instance may have few rows."""
        oldest = await self._outbox.oldest_first_seen_ms()
        metrics.OUTBOX_AGE.set(0.0 if oldest is None else max(0, now_ms() - oldest) / 1000)

    async def _housekeeping(self) -> None:
        loop_time = asyncio.get_running_loop().time()
        if loop_time < self._housekeeping_at:
            return
        self._housekeeping_at = loop_time + HOUSEKEEPING_SECONDS
        now = now_ms()
        self._rate.prune(now)
        horizon = now - max(self._coalesce_ms, 1)
        self._last_push_ms = {d: t for d, t in self._last_push_ms.items() if t > horizon}
        metrics.OUTBOX_DEPTH.set(await self._outbox.depth())
        # a claim no push task holds any more (its outcome could not be written, or a
        # reschedule failed) comes back once it is older than a send could take
        claim_horizon = now - int((2 * self._push.send_timeout_seconds + STOP_GRACE_SECONDS) * 1000)
        released = await self._outbox.release_claims(claim_horizon, self._live_ids)
        if released:
            log.warning("%d wakeups had stale claims; they are due again", released)
        await self._measure_outbox_age()
        if self._unsettled:
            ids, self._unsettled = self._unsettled, []
            try:
                await self._outbox.reschedule(ids, now + int(self._push.retry_base_seconds * 1000))
            except BaseException:
                self._unsettled.extend(ids)
                raise

    async def _dispatch(self, due: Sequence[Wakeup]) -> None:
        now = now_ms()
        by_push_key: dict[PushKey, list[Wakeup]] = defaultdict(list)
        expired: list[Wakeup] = []
        unsendable: list[Wakeup] = []
        seen_after = now - self._push.max_wakeup_age_seconds * 1000
        max_attempts = self._push.max_attempts
        senders = self._senders
        for wakeup in due:
            device = wakeup.device
            if wakeup.first_seen_ms < seen_after or wakeup.attempts >= max_attempts:
                expired.append(wakeup)
            elif device.platform not in senders:
                unsendable.append(wakeup)
            else:  # its PushKey
                by_push_key[device.platform, device.token, device.webpush_keys].append(wakeup)
        pushes: list[Push] = []
        held: dict[int, list[int]] = defaultdict(list)
        planned_per_host: dict[tuple[str, str], int] = defaultdict(int)
        for wakeups in by_push_key.values():
            device = wakeups[0].device
            host = self._host_of(device)
            if host is not None:
                busy = self._host_rows[host] + planned_per_host[host]
                if busy and busy + len(wakeups) > self._host_cap[device.platform]:
                    held[now + self._host_hold_ms].extend(w.id for w in wakeups)
                    continue
            planned, waiting = self._plan(wakeups, now)
            for at_ms, ids in waiting.items():
                held[at_ms].extend(ids)
            if host is not None:
                planned_per_host[host] += sum(len(p.wakeups) for p in planned)
            pushes.extend(planned)
        # `due` claimed every row it returned (`hold` gives back those not sent now): queue
        # every push and start its senders before anything else can fail, so no claim is
        # left without a task that settles it
        claimed = [w.id for push in pushes for w in push.wakeups]
        self._live_ids.update(claimed)
        for push in pushes:
            self._rows_in_flight[push.device.platform] += len(push.wakeups)
            host = self._host_of(push.device)
            if host is not None:
                self._host_rows[host] += len(push.wakeups)
            self._queues[push.device.platform].append(push)
        for platform in self._queues:
            self._start_senders(platform)
        for at_ms, ids in held.items():
            await self._outbox.hold(ids, at_ms)
        if expired:
            await self._give_up(expired, "too old or too many attempts")
        if unsendable:
            await self._give_up(unsendable, "platform no longer enabled")

    def _plan(self, wakeups: list[Wakeup], now: int) -> tuple[list[Push], dict[int, list[int]]]:
        """The pushes one phone gets now for `wakeups` (all for one push key), and the rows
        held back by when they may go.

        Within the phone's rate budget, each `event_id`/`event` wakeup is its own push; all
        the rest (every account's opaque wakeups, and what exceeds the budget) is one opaque
        push, which waits for the end of the coalescing window if an opaque push went out
        less than a window ago. Nothing goes while the budget is spent.
        """
        phone = _phone(wakeups[0].device)
        rate_gate = self._rate.next_allowed_ms(phone, now)
        if rate_gate > now:
            return [], {rate_gate: [w.id for w in wakeups]}
        if len(wakeups) == 1 and wakeups[0].device.payload != "opaque":
            # most pushes: one specific wakeup, and a gate that is open has room for one push
            self._rate.spend(phone, now)
            return [Push(wakeups[0].device, (wakeups[0],), self._message(wakeups, now))], {}
        wakeups.sort(key=lambda w: w.id)
        opaque: list[Wakeup] = []
        specific: list[Wakeup] = []
        for wakeup in wakeups:
            (opaque if wakeup.device.payload == "opaque" else specific).append(wakeup)
        window_gate = now
        last = self._last_push_ms.get(phone)
        if self._coalesce_ms and last is not None:
            window_gate = last + self._coalesce_ms
        window_open = window_gate <= now
        budget = max(1, self._rate.available(phone, now))
        slots = budget - 1 if opaque and window_open else budget
        if len(specific) <= slots:
            singles, excess = specific, []
        else:
            # one slot is left for the opaque push the excess rides in
            keep = slots if opaque and window_open else slots - 1
            singles, excess = specific[:keep], specific[keep:]
        pushes = [Push(w.device, (w,), self._message((w,), now)) for w in singles]
        held: dict[int, list[int]] = {}
        together = opaque + excess
        if together and not window_open:
            held[window_gate] = [w.id for w in together]
        elif together:
            together.sort(key=lambda w: w.id)
            pushes.append(Push(together[0].device, tuple(together), self._message(together, now)))
            provider = self._senders[together[0].device.platform].provider
            metrics.COALESCED.labels(provider).inc(len(together) - 1)
            self._last_push_ms[phone] = now
        self._rate.spend(phone, now, len(pushes))
        return pushes, held

    def _message(self, wakeups: Sequence[Wakeup], now: int) -> WakeupMessage:
        """Opaque for several wakeups; one wakeup carries what its registration asked for."""
        first = wakeups[0]
        device = first.device
        event_ids: tuple[str, ...]
        if len(wakeups) == 1:  # most pushes: spared the generators below
            oldest_ms, event_ids = first.first_seen_ms, (first.event_id,)
            opaque = device.payload == "opaque"
        else:
            oldest_ms = min(w.first_seen_ms for w in wakeups)
            event_ids, opaque = tuple(w.event_id for w in wakeups), True
        ttl = max(1, (self._push.max_wakeup_age_seconds * 1000 - (now - oldest_ms)) // 1000)
        if opaque:
            data = opaque_data()
        else:
            data = wakeup_data(device.payload, first.event_id, first.relay, first.event_json)
            fits = self._senders[device.platform].fits
            if not fits(data):
                data = fallback(data, first.event_id, first.relay)
                if not fits(data):
                    data = opaque_data()
        return WakeupMessage(
            event_ids=event_ids,
            data=data,
            collapse_id=self._outbox.collapse_id(first.id),
            ttl_seconds=int(ttl),
            opaque=opaque,
        )

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
            except Exception:
                log.exception("%s sender failed unexpectedly", sender.provider)
                outcome = Outcome(Status.RETRY, detail="sender_error")
            try:
                if outcome.status is _ACCEPTED:  # most outcomes: no coroutine for the settling
                    self._accept(push, sender.provider)
                else:
                    await self._settle(push, sender.provider, outcome)
            except Exception:
                log.exception("cannot record a %s outcome; its wakeups will be retried", sender.provider)
                self._unsettled.extend(w.id for w in push.wakeups)
        finally:
            platform = push.device.platform
            wakeups = push.wakeups
            self._rows_in_flight[platform] -= len(wakeups)
            if len(wakeups) == 1:
                self._live_ids.discard(wakeups[0].id)
            else:
                self._live_ids.difference_update(w.id for w in wakeups)
            if platform in self._per_host:
                host = self._host_of(push.device)
                assert host is not None
                self._host_rows[host] -= len(wakeups)
                if not self._host_rows[host]:
                    del self._host_rows[host]
            if self._room(platform) >= self._refill[platform]:
                self._outbox.ready.set()

    def _accept(self, push: Push, provider: str) -> None:
        """An accepted push is recorded and deleted with its answer burst."""
        self._accepted.append((push, provider, _ACCEPTED_VALUE, now_ms()))
        wakeups = push.wakeups
        if len(wakeups) == 1:
            self._to_complete.append(wakeups[0].id)
        else:
            self._to_complete.extend([w.id for w in wakeups])
        self._completion_due.set()

    async def _settle(self, push: Push, provider: str, outcome: Outcome) -> None:
        """A push the provider did not accept: retried later, given up, or its token forgotten."""
        answered = now_ms()
        status = outcome.status
        ids = [w.id for w in push.wakeups]
        if status is Status.RETRY:
            next_ms = self._retry_at(push, outcome, answered)
            if next_ms is None:
                self._record(push, provider, Status.RETRY, answered)
                await self._give_up(push.wakeups, outcome.detail or "retries exhausted")
                return
            self._record(push, provider, status, answered)
            await self._outbox.reschedule(ids, next_ms)
            log.debug("%s push to …%s deferred: %s", provider, push.device.token_suffix, outcome.detail)
            return
        self._record(push, provider, status, answered)
        if status is Status.UNREGISTERED:
            if await self._forget_token(push):
                metrics.PRUNED_TOKENS.labels(provider).inc()
                log.info("%s token …%s is dead (%s); its registrations are forgotten", provider,
                         push.device.token_suffix, outcome.detail)
        else:
            log.warning("%s refused push to …%s: %s", provider, push.device.token_suffix,
                        outcome.detail)
        self._to_complete.extend(ids)
        self._completion_due.set()

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

    async def _give_up(self, wakeups: Sequence[Wakeup], reason: str) -> None:
        """Drop wakeups that are stale, out of attempts or without a provider: status failed."""
        answered = now_ms()
        for wakeup in wakeups:
            sender = self._senders.get(wakeup.device.platform)
            provider = sender.provider if sender else "none"
            if self._record_outcomes:
                self._observations.push(
                    wakeup.event_id, wakeup.device.platform, Status.FAILED.value,
                    answered - wakeup.first_seen_ms,
                )
            if sender is not None:
                self._pushes[provider, Status.FAILED.value].inc()
                metrics.STALE_DROPPED.labels(provider).inc()
        log.warning("gave up %d wakeups (%s)", len(wakeups), reason)
        await self._outbox.complete([w.id for w in wakeups])

    def _record(self, push: Push, provider: str, status: Status, answered_ms: int) -> None:
        self._record_many([(push, provider, status.value, answered_ms)])

    def _record_many(self, answers: list[Answer]) -> None:
        """Metrics and observation records of answered pushes: per burst one counter increment
        per outcome, one histogram call and one batch of records (stamped with the burst's
        last answer), instead of a lock, a dict and a JSON encoding per push."""
        counts: dict[tuple[str, str], int] = defaultdict(int)
        latencies: dict[str, list[float]] = defaultdict(list)
        records: list[PushRecord] = []
        for push, provider, status, answered_ms in answers:
            counts[provider, status] += 1
            wakeups = push.wakeups
            platform = push.device.platform
            if len(wakeups) == 1:  # most pushes: no generators
                wakeup = wakeups[0]
                oldest = wakeup.first_seen_ms
                records.append((wakeup.event_id, platform, status, answered_ms - oldest))
            else:
                oldest = min(w.first_seen_ms for w in wakeups)
                records.extend(
                    (w.event_id, platform, status, answered_ms - w.first_seen_ms) for w in wakeups
                )
            latencies[provider].append(max(0, answered_ms - oldest) / 1000)
        for key, count in counts.items():
            self._pushes[key].inc(count)
        for provider, seconds in latencies.items():
            metrics.LATENCY.observe_many(provider, seconds)
        if self._record_outcomes:
            self._observations.push_many(records, max(a[3] for a in answers))

    async def _complete_forever(self) -> None:
        while True:
            await self._completion_due.wait()
            if len(self._to_complete) < BATCH_SIZE:
                await asyncio.sleep(COMPLETE_WITHIN_SECONDS)
            self._completion_due.clear()
            try:
                await self._flush_completions()
            except Exception:
                log.exception("cannot delete answered wakeups; retrying in %.0f s", ERROR_PAUSE_SECONDS)
                await asyncio.sleep(ERROR_PAUSE_SECONDS)
                self._completion_due.set()

    async def _flush_completions(self) -> None:
        if self._accepted:
            accepted, self._accepted = self._accepted, []
            self._record_many(accepted)
        ids, self._to_complete = self._to_complete, []
        if not ids:
            return
        try:
            await self._outbox.complete(ids)
        except BaseException:
            self._to_complete.extend(ids)
            raise


async def _cancel(task: asyncio.Task[None] | None) -> None:
    if task is None:
        return
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
