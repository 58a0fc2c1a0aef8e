"""The committer: pending arrivals → the devices they wake → outbox rows and seen ids, written
in one transaction per batch, in arrival order, so the readers never wait on the disk.

It has its own store connection (`store.interface.BridgeConnection`), so each batch's outbox
rows, seen ids and queued bookkeeping are one `transaction()`: after a crash either both are on disk or neither is, and a catch-up then pushes
exactly what had not been handed to the outbox. It also makes ingest fast (one commit per
batch instead of one per event). The shared outbox's `ready` is set after each commit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import NamedTuple

from sigil_push.bridge.choices import (
    ASK,
    QUIET,
    Effect,
    Facts,
    Rule,
    facts_of,
    iris_device,
    iris_facts,
    judge,
    strongest,
)
from sigil_push.bridge.metrics import (
    BASELINED,
    COMMIT_RETRIES,
    DEFERRED_WAKEUPS,
    LATENCY,
    POISON,
    PUSHED,
    PUSHED_BY_CLASS,
    SUPPRESSED_BY,
    SUPPRESSED_BY_CLASS,
    USER_LISTS_BY,
    RelayCounters,
)
from sigil_push.bridge.pending import Arrival, DbOp, Pending
from sigil_push.bridge.watches import CLASS_OF_KIND, DEFAULT_MASK, DM_KINDS, IRIS, wants_kind
from sigil_push.config import STOP_GRACE_SECONDS, BridgeConfig
from sigil_push.nostr.kinds import GIFT_WRAP
from sigil_push.observations import ObservationLog, SeenRecord
from sigil_push.relays.discovery import RelayLists
from sigil_push.relays.inbox import connected_inboxes
from sigil_push.relays.pool import GIFT_WRAP_SKEW_SECONDS, RelayPool
from sigil_push.store.errors import TRANSIENT_ERRORS, error_name, transient
from sigil_push.store.interface import BridgeConnection, DeviceStore, OutboxStore, SeenStore
from sigil_push.store.lock_order import NewEvent, in_lock_order
from sigil_push.store.preferences import AuthorCheck, Deferred, Listed
from sigil_push.store.records import Device

log = logging.getLogger(__name__)

RETRY_FIRST_SECONDS = 0.1
RETRY_MAX_SECONDS = 5.0
"""A write the database refuses (busy, locked, connection lost) is retried after 0.1 s,
doubling to at most this, for as long as it takes: a batch is never given up while the
service runs. Meanwhile the pending queue fills to its bound and the readers wait."""
POISON_ATTEMPTS = 2
DEVICE_CACHE_SIZE = 50_000
FURTHER_HOLD_SECONDS = 1.0
"""How long a further relay's delivery of an already committed event waits, so the copies of
one event that land in several batches are appended to its `seen_events` row in one update."""
FURTHER_HOLD_EVENTS = 10_000
BATCH_WRITER = "batch"
CLAIM_WRITER = "claim"

CommitListener = Callable[[Sequence[tuple[str, int]]], None]
Suppressed = tuple[str, str, str]
"""(event id, reason, class) of an event that woke none of its targets by their choice."""


def _any_rules(devices: list[Device]) -> bool:
    """Whether any device carries rules (a plain loop: no generator per event)."""
    for device in devices:
        if device.rules is not None:
            return True
    return False


class Choice:
    """What one event's targets chose (`bridge.choices.judge`): `kept` are the devices it
    wakes, first without the stored lists (the targets whose lists could decide are queued
    in `checks`, answered for the whole batch at once), then, by `settle`, with them.

    A rule that defers (`present`, `quiet`) stores the event for the device's deferred wakeup
    (`deferred_row`).
    """

    __slots__ = ("_asking", "_event", "_facts", "_first", "_marks", "_now", "_reasons", "kept")

    def __init__(
        self,
        arrival: Arrival,
        facts: Facts,
        targets: list[Device],
        now: int,
        marks: list[Deferred],
        checks: list[AuthorCheck[Facts]],
    ) -> None:
        self._event = arrival
        self._facts = facts
        self._now = now
        self._marks = marks
        self.kept: list[Device] = []
        self._reasons: list[Rule] = []
        asking: dict[str, list[Device]] = {}
        for device in targets:
            verdict = judge(facts, device, now, None)
            if verdict is None:
                self.kept.append(device)
            elif verdict is ASK:
                asking.setdefault(device.pubkey, []).append(device)
            else:
                self._note(device, verdict)
        self._first = len(checks)
        self._asking = list(asking.values())
        checks.extend(AuthorCheck(facts, devices) for devices in self._asking)

    def _note(self, device: Device, rule: Rule) -> None:
        if rule.effect is Effect.IGNORE:
            return
        self._reasons.append(rule)
        if rule.effect is Effect.DEFER:
            event = self._event.event
            self._marks.append(deferred_row(
                device, rule, event.id, self._event.relay, self._facts.author_hex,
                event.created_at, self._now,
            ))

    def settle(self, answers: list[dict[int, Rule]]) -> Rule | None:
        """Add the devices the list checks let through to `kept` (judged again with their
        lists, so presence and quiet hours still apply); returns the rule that names the
        event's suppression (`choices.strongest`), None if nothing suppressed it."""
        for offset, devices in enumerate(self._asking):
            blocked = answers[self._first + offset]
            for device in devices:
                rule = blocked.get(device.id)
                if rule is None:
                    self.kept.append(device)
                else:
                    self._note(device, rule)
        reasons = self._reasons
        return strongest(reasons) if reasons else None


def _event_id_of(arrival: Arrival) -> str:
    return arrival.event.id


def _deferred_facts(row: Deferred) -> Facts:
    """What the rules can still read of a held event: its visible author only (thread and
    word mutes were judged when it arrived)."""
    author = row[4]
    return Facts("", None if author is None else bytes.fromhex(author), author, (), None,
                 False, False, "dm")


def deferred_row(
    device: Device, rule: Rule, event_id: str, relay: str, author: str | None,
    created_at: int, now: int,
) -> Deferred:
    """The `deferred_wakeups` row of an event `rule` (`present`, `quiet`) held back from
    `device`: a quiet window's row is due at the window's end, a presence's when it lapses."""
    rules = device.rules
    due = (
        rules.quiet.end_after(now) if rule is QUIET and rules is not None and rules.quiet
        else None
    )
    return (device.id, rule.reason, event_id, relay, author, due, created_at)


def _with_iris(
    kept: list[Device], rule: Rule | None, iris: list[Choice], answers: list[dict[int, Rule]]
) -> tuple[list[Device], Rule | None]:
    """The registrations' woken devices plus the Iris targets any of their matches woke (each
    device once), and the rule that names the suppression when none woke."""
    reasons = [rule] if rule is not None else []
    woken = list(kept)
    ids = {device.id for device in kept}
    for choice in iris:
        reason = choice.settle(answers)
        if reason is not None:
            reasons.append(reason)
        for device in choice.kept:
            if device.id not in ids:
                ids.add(device.id)
                woken.append(device)
    return woken, strongest(reasons) if reasons else None


class _Decision(NamedTuple):
    """One pass over a batch (`Committer._decide`)."""

    new_events: list[NewEvent]
    further: list[tuple[str, str]]
    further_seen: list[SeenRecord]
    to_push: list[Arrival]
    decided: dict[str, tuple[str, ...]]
    delivered: list[SeenRecord]
    duplicates: dict[str, int]
    """Repeats of an event by a relay that had delivered it before, per relay."""
    baselined: int
    """New events that wake nobody: history from before their recipients' registration."""


class DatabaseUnavailable(Exception):
    """The service is stopping and the database still refuses writes past the stop grace (not
    the batch's fault): what is not stored is left to the next start's catch-up."""

    events = 0
    """How many events of the batch being committed were not stored."""


ReportImpaired = Callable[[str | None], None]
"""Told why the committer cannot write (once per outage), and None once it writes again."""


class Committer:
    """Drains `Pending` into the database (`run`, one supervised task).

    `counters` are ingest's per-relay counters; `registration_relays` is the key registry's
    map of each key's registration relays (both the same objects, kept current by their
    owners), read for the counters and the observation log only.
    """

    def __init__(
        self,
        link: BridgeConnection,
        seen: SeenStore,
        lists: RelayLists,
        pending: Pending,
        devices: DeviceStore,
        outbox: OutboxStore,
        observations: ObservationLog,
        pool: RelayPool,
        counters: dict[str, RelayCounters],
        registration_relays: Mapping[str, tuple[str, ...]],
        insecure: bool,
        turn: asyncio.Lock | None = None,
        report: ReportImpaired | None = None,
        settings: BridgeConfig | None = None,
    ) -> None:
        """`link` is the committer's own connection (with its outbox writer, bookkeeping and
        the users' own lists and presence lapses); `seen` the dedupe, `lists` the relay lists.
        `turn` is held for each transaction: the bridge's other readers of the connection
        (`RelayState`) take it too, so their statements never run inside one. `report` is
        told when the database refuses the committer's writes and when it takes them again
        (the supervisor's `impaired`, for `/health`). `settings` gives `max_p_tags` and
        `stale_after`, which the wake rules read."""
        self._pending = pending
        settings = settings if settings is not None else BridgeConfig()
        self._max_p_tags = settings.max_p_tags
        self._stale_after = settings.stale_after_seconds
        self._report = report
        self.retry_first_seconds = RETRY_FIRST_SECONDS
        self.retry_max_seconds = RETRY_MAX_SECONDS
        self.stop_grace_seconds = STOP_GRACE_SECONDS
        """How long a stop waits for a refusing database before it leaves the rest unstored."""
        self._stop_deadline = 0.0
        self._stop_requested = asyncio.Event()
        self._outage: tuple[float, int] | None = None
        """(monotonic start, retries) of the current outage; None while writes succeed."""
        self._refusing: set[str] = set()
        """The writers the database refuses now (`BATCH_WRITER`, `CLAIM_WRITER`): on
        PostgreSQL one table can be locked while others take writes, so the outage ends only
        when each writer it refused has written again."""
        self._turn = turn if turn is not None else asyncio.Lock()
        self._devices = devices
        self._outbox = outbox
        self._observations = observations
        self._pool = pool
        self.counters = counters
        self._registration_relays = registration_relays
        self._insecure = insecure
        self._link = link
        self._seen = seen
        self._lists = lists
        self._listeners: list[CommitListener] = []
        self._decided_listeners: list[Callable[[Iterable[str]], None]] = []
        self._device_cache: dict[str, list[Device]] = {}
        self._device_generation = 0
        self._iris_devices: dict[int, Device | None] = {}
        """Iris targets by device id (read by id: they are no registration's devices)."""
        self._stopping = False
        self._held: dict[str, list[str]] = {}
        self._held_records: list[SeenRecord] = []
        self._held_since = 0.0

    def add_listener(self, listener: CommitListener) -> None:
        """Be told (event id, frame received ms) of every event whose wakeups reached the outbox."""
        self._listeners.append(listener)

    def add_decided_listener(self, listener: Callable[[Iterable[str]], None]) -> None:
        """Be told the ids of every batch's events once their decision is on disk (pushed,
        baselined, or another relay's copy recorded)."""
        self._decided_listeners.append(listener)

    def devices_changed(self, pubkey: str) -> None:
        """The key's devices changed: read them again before its next wakeup."""
        self._device_cache.pop(pubkey, None)
        self._device_generation += 1
        if self._iris_devices:
            self._iris_devices = {
                i: d for i, d in self._iris_devices.items() if d is not None and d.pubkey != pubkey
            }

    def iris_changed(self) -> None:
        """Some Iris subscription changed: its targets are read again when next matched."""
        self._iris_devices = {}

    def stop(self) -> None:
        """Finish what is pending, then let `run` return. While the database refuses writes,
        `run` gives up after `stop_grace_seconds` (plus the one attempt then waiting on its
        lock): what is not stored is not in `seen_events`, so the next start's catch-up
        brings it again, as after a crash."""
        if not self._stopping:
            self._stop_deadline = time.monotonic() + self.stop_grace_seconds
        self._stopping = True
        self._stop_requested.set()
        self._pending.work.set()

    async def run(self) -> None:
        try:
            await self._run()
        except DatabaseUnavailable as gave_up:
            left = gave_up.events
            while self._pending:
                left += len(self._pending.take()[0])
            log.error(
                "stopping with the database unavailable: %d events not stored; the next"
                " start's catch-up brings them again", left,
            )

    async def _run(self) -> None:
        work = self._pending.work
        while True:
            if self._held:
                wait = self._held_since + FURTHER_HOLD_SECONDS - time.monotonic()
                # asyncio.timeout, not wait_for (3.11 swallows a cancellation that lands as
                # the event is set, and the loop would outlive stop())
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(max(0.0, wait)):
                        await work.wait()
            else:
                await work.wait()
            work.clear()
            while self._pending:
                await self._commit_pending()
            if self._pending.lists_waiting:
                await self._save_user_lists()
            if self._held and (self._stopping or self._hold_expired()):
                # no batch came to carry the held deliveries: a commit of their own
                await self._commit_pending()
            if self._stopping:
                return

    async def _save_user_lists(self) -> None:
        """Store the users' lists offered since the last time (`Pending.offer_list`); the keys
        whose list replaced the stored one have their devices (and the flags read with them)
        read again."""
        waiting = self._pending.take_lists()
        link = self._link
        try:
            async with self._turn, link.transaction():
                taken = await link.lists.save(list(waiting.values()))
        except TRANSIENT_ERRORS as exc:
            if transient(exc):
                log.warning("storing %d user lists failed (%s); kept for the next turn",
                            len(waiting), type(exc).__name__)
                self._pending.return_lists(waiting)
            else:  # the lists' own fault: kept, they would fail every turn
                POISON.inc()
                log.error("storing %d user lists failed (%s); dropped", len(waiting),
                          type(exc).__name__)
            return
        USER_LISTS_BY["stored"].inc(len(taken))
        USER_LISTS_BY["stale"].inc(len(waiting) - len(taken))
        for item in taken:
            self.devices_changed(item.pubkey)

    async def claim_deferred(self) -> int:
        """`_claim_deferred`, each second: a write transaction even when nothing is due, so a
        database that refuses writes (SQLite locked by another connection) is reported to
        `/health` within seconds even while no event arrives to commit, and cleared once a
        claim goes through again."""
        try:
            claimed = await self._claim_deferred()
        except TRANSIENT_ERRORS as exc:
            if transient(exc):
                self._refused(exc, "the deferred wakeups' claim", CLAIM_WRITER)
            raise
        self._accepted(CLAIM_WRITER)
        return claimed

    async def _claim_deferred(self) -> int:
        """Deferred wakeups now due (a quiet window ended, a presence lapsed by time): claimed,
        judged again and written in one transaction (see `UserListStore.claim_deferred`). A
        pair gets one wakeup, for the newest of its held events that would wake it now (not
        paused since, author not muted since); events another deferring rule now holds are
        deferred again under it; the rest are dropped. Returns the wakeups written."""
        link = self._link
        now_ms = int(time.time() * 1000)
        now = now_ms // 1000
        async with self._turn, link.transaction():
            rows = await link.lists.claim_deferred(now)
            if not rows:
                return 0
            by_device: dict[int, list[Deferred]] = {}
            for row in rows:
                by_device.setdefault(row[0], []).append(row)
            devices = [d for d in [await self._devices.by_id(i) for i in by_device] if d]
            facts = {row: _deferred_facts(row) for row in rows}
            verdicts: dict[tuple[int, str], Rule | None] = {}
            checks: list[AuthorCheck[Facts]] = []
            asked: list[tuple[Device, Deferred]] = []
            for device in devices:
                for row in by_device[device.id]:
                    verdict = judge(facts[row], device, now, None)
                    if verdict is ASK:
                        checks.append(AuthorCheck(facts[row], [device]))
                        asked.append((device, row))
                    else:
                        verdicts[(device.id, row[2])] = verdict
            if checks:
                def with_lists(f: Facts, device: Device, listed: Listed) -> Rule | None:
                    verdict = judge(f, device, now, listed)
                    return verdict if isinstance(verdict, Rule) else None

                answers = await link.lists.blocked(checks, with_lists)
                for (device, row), answer in zip(asked, answers, strict=True):
                    verdicts[(device.id, row[2])] = answer.get(device.id)
            wakeups: list[tuple[int, str, str]] = []
            again: list[Deferred] = []
            for device in devices:
                waking = [row for row in by_device[device.id]
                          if verdicts.get((device.id, row[2])) is None]
                if waking:
                    newest = max(waking, key=lambda row: (row[6], row[2]))
                    wakeups.append((device.id, newest[2], newest[3]))
                    continue
                for row in by_device[device.id]:
                    rule = verdicts.get((device.id, row[2]))
                    if rule is not None and rule.effect is Effect.DEFER:
                        again.append(deferred_row(device, rule, row[2], row[3], row[4], row[6],
                                                  now))
            if again:
                await link.lists.defer(again, now)
            if wakeups:
                await link.lists.enqueue_deferred(wakeups, now_ms)
        if wakeups:
            DEFERRED_WAKEUPS.inc(len(wakeups))
            self._outbox.ready.set()
        return len(wakeups)

    def _hold_expired(self) -> bool:
        return (
            time.monotonic() - self._held_since >= FURTHER_HOLD_SECONDS
            or len(self._held) >= FURTHER_HOLD_EVENTS
        )

    async def _commit_pending(self) -> None:
        """The next batch, committed. A batch that raises is retried once, then committed event
        by event, and an event that fails twice on its own is skipped and counted (`poison`):
        one bad input never stops the loop nor comes back forever. The database refusing the
        write is no fault of the batch: that is retried until it succeeds (`_commit_retrying`)."""
        batch, ops = self._pending.take()
        try:
            for attempt in range(POISON_ATTEMPTS):
                try:
                    await self._commit_retrying(batch, ops)
                    return
                except DatabaseUnavailable:
                    raise
                except Exception as exc:  # noqa: BLE001 - a poison input: find and skip it
                    log.warning("bridge commit of %d events failed (%s), attempt %d",
                                len(batch), error_name(exc), attempt + 1)
            for arrival in batch:
                await self._commit_alone(arrival)
            if ops:
                await self._commit_retrying([], ops)
        except DatabaseUnavailable as gave_up:
            gave_up.events = len(batch)
            raise

    async def _commit_alone(self, arrival: Arrival) -> None:
        failure = ""
        for _ in range(POISON_ATTEMPTS):
            try:
                await self._commit_retrying([arrival], [])
                return
            except DatabaseUnavailable:
                raise
            except Exception as exc:  # noqa: BLE001 - counted below once it failed twice
                failure = error_name(exc)
        POISON.inc()
        counters = self.counters.get(arrival.relay)
        if counters is not None:  # None: the relay left the plan meanwhile (no series now)
            counters.dropped["poison"].inc()
        log.error("skipped an event that failed to commit %d times (%s)", POISON_ATTEMPTS, failure)

    async def _commit_retrying(self, batch: list[Arrival], ops: list[DbOp]) -> None:
        """`_commit`, retried with capped exponential backoff for as long as the database is
        busy, locked or unreachable (`TRANSIENT_ERRORS`); while stopping, only until the stop
        grace has passed (then `DatabaseUnavailable`)."""
        delay = self.retry_first_seconds
        while True:
            try:
                await self._commit(batch, ops)
            except TRANSIENT_ERRORS as exc:
                if not transient(exc):
                    # the batch's own fault ("too many SQL variables"): the poison path; the
                    # database answered, so it no longer refuses this writer
                    self._accepted(BATCH_WRITER)
                    raise
                self._refused(exc, f"a batch of {len(batch)} events", BATCH_WRITER)
                if self._stopping:
                    remaining = self._stop_deadline - time.monotonic()
                    if remaining <= 0:
                        raise DatabaseUnavailable from exc
                    await asyncio.sleep(min(delay, remaining))
                else:
                    # a stop meanwhile cuts the wait short: its grace starts counting now
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(delay):
                            await self._stop_requested.wait()
                delay = min(self.retry_max_seconds, delay * 2)
            else:
                self._accepted(BATCH_WRITER)
                return

    def _refused(self, exc: BaseException, what: str, writer: str) -> None:
        """The database refused a write: counted each time, logged and reported once."""
        COMMIT_RETRIES.inc()
        self._refusing.add(writer)
        if self._outage is not None:
            started, retries = self._outage
            self._outage = (started, retries + 1)
            return
        self._outage = (time.monotonic(), 1)
        # the exception's type only: its message may name a row's values
        reason = f"database unavailable ({type(exc).__name__}); commits retried"
        log.error("bridge commits refused by the database (%s); retrying %s until it takes"
                  " them", type(exc).__name__, what)
        if self._report is not None:
            self._report(reason)

    def _accepted(self, writer: str) -> None:
        """A writer's commit succeeded: the end of an outage, if there was one and no other
        writer is still refused (the deferred wakeups' claim goes through each second while a
        lock on `seen_events` holds the batch back)."""
        self._refusing.discard(writer)
        if self._outage is None or self._refusing:
            return
        started, retries = self._outage
        self._outage = None
        log.warning("bridge commits stored again after %.1f s and %d retries",
                    time.monotonic() - started, retries)
        if self._report is not None:
            self._report(None)

    async def _commit(self, batch: list[Arrival], ops: list[DbOp]) -> None:
        """Decide, write, and only then remember the batch's ids as seen and log what the
        relays delivered (a batch retried after a failed write is logged once).

        A further relay's delivery of an event committed in an earlier batch is held back
        (`FURTHER_HOLD_SECONDS`) and written, with its `seen` record logged, together with the
        other relays' copies of that event held meanwhile: one row per event, not one per
        batch its copies happen to fall in. It is remembered at once, so a repeat counts as a
        duplicate. A crash loses a held delivery's row and its record alike, so a relay's
        replay after the restart is recorded once, as it would have been."""
        (new_events, further, further_seen, to_push, decided, delivered, duplicates,
         baselined) = await self._decide(batch)
        writes, suppressed, marks = await self._targets(to_push)
        flush = bool(self._held) and (self._stopping or self._hold_expired())
        held_rows = [
            (event_id, relay) for event_id, relays in self._held.items() for relay in relays
        ] if flush else []
        await self._write(writes, new_events, held_rows, ops, marks)
        self._count(duplicates, baselined)
        if suppressed:
            self._suppressed(suppressed)
        self._seen.remember(decided)
        for decided_listener in self._decided_listeners:
            decided_listener(decided.keys())
        if flush:
            delivered.extend(self._held_records)
            self._held, self._held_records = {}, []
        self._hold(further, further_seen)
        self._observations.seen_many(delivered)
        written = {id(arrival) for arrival, _ in writes}
        for arrival in to_push:
            # a fresh key's history (woken only from its registration on) that woke nobody was
            # not handed to the outbox: no `expect` for it
            late = arrival.since_registration
            if not arrival.push_to:
                continue  # matched Iris watches only: nobody's DM inbox to expect it
            if not late or id(arrival) in written or any(r not in late for r in arrival.push_to):
                self._expect(arrival)
        await self._lists.save()
        if writes:
            self._outbox.ready.set()
            now_ms = time.time() * 1000
            committed = [(arrival.event.id, arrival.received_ms) for arrival, _ in writes]
            LATENCY.observe_many(
                [max(0.0, now_ms - received_ms) / 1000 for _, received_ms in committed]
            )
            PUSHED.inc(len(writes))
            self._count_classes(writes)
            for listener in self._listeners:
                listener(committed)

    @staticmethod
    def _count_classes(writes: list[tuple[Arrival, list[Device]]]) -> None:
        """Pushed events by class, counted once per batch and class (a plain loop)."""
        counts: dict[str, int] = {}
        for arrival, targets in writes:
            if arrival.iris:
                cls = IRIS if all(d.payload == IRIS for d in targets) else CLASS_OF_KIND.get(
                    arrival.event.kind
                )
            else:
                cls = CLASS_OF_KIND.get(arrival.event.kind)
            if cls is not None:
                counts[cls] = counts.get(cls, 0) + 1
        for cls, count in counts.items():
            PUSHED_BY_CLASS[cls].inc(count)

    def _hold(self, further: list[tuple[str, str]], records: list[SeenRecord]) -> None:
        """Add this batch's further deliveries, and their `seen` records, to the held ones."""
        if not further:
            return
        if not self._held:
            self._held_since = time.monotonic()
        held = self._held
        for event_id, relay in further:
            relays = held.get(event_id)
            if relays is None:
                held[event_id] = [relay]
            else:
                relays.append(relay)
        self._held_records.extend(records)

    def _count(self, duplicates: dict[str, int], baselined: int) -> None:
        """A written batch's repeats per relay and pre-registration events, counted once: a
        batch the database refused is decided again on each retry."""
        for relay, repeats in duplicates.items():
            counters = self.counters.get(relay)
            if counters is not None:  # None: the relay left the plan meanwhile (no series now)
                counters.duplicates.inc(repeats)
        if baselined:
            BASELINED.inc(baselined)

    async def _decide(self, batch: list[Arrival]) -> _Decision:
        """Which arrivals are new events, deliveries by a further relay (with their `seen`
        records apart: they are held, see `_commit`), and wanted pushes; the deliveries to
        remember once they are on disk (not before: a failed write must not make them look
        handled), the `seen` records of the rest, and what to count once written. One pass,
        once per event.

        A further relay's copy of an event that is new in this same batch is no row of its
        own: it is among the relays of the event's `seen_events` row (`decided` holds them
        all, in arrival order, once the pass is done)."""
        await self._seen.lookup([a.event.id for a in batch])
        first_delivery = self._seen.first_delivery
        new_here: dict[str, tuple[int, int]] = {}
        further: list[tuple[str, str]] = []
        further_seen: list[SeenRecord] = []
        to_push: list[Arrival] = []
        decided: dict[str, tuple[str, ...]] = {}
        delivered: list[SeenRecord] = []
        duplicates: dict[str, int] = {}
        baselined = 0
        for arrival in batch:
            event = arrival.event
            event_id, created_at = event.id, event.created_at
            is_new, first_here = first_delivery(event_id, arrival.relay, decided)
            if not first_here:
                duplicates[arrival.relay] = duplicates.get(arrival.relay, 0) + 1
            else:
                record = (arrival.relay, event_id, event.kind, created_at, arrival.received_ms)
                if is_new:
                    new_here[event_id] = (arrival.received_ms, created_at)
                    delivered.append(record)
                    if arrival.push_to or arrival.iris:
                        to_push.append(arrival)
                    else:
                        baselined += 1
                elif event_id in new_here:
                    delivered.append(record)
                else:
                    further.append((event_id, arrival.relay))
                    further_seen.append(record)
            if arrival.copies is None:
                continue
            # further relays' copies folded in while it was queued: records, never pushes
            for relay, received_ms in arrival.copies:
                if not first_delivery(event_id, relay, decided)[1]:
                    duplicates[relay] = duplicates.get(relay, 0) + 1
                    continue
                record = (relay, event_id, event.kind, created_at, received_ms)
                if event_id in new_here:
                    delivered.append(record)
                else:
                    further.append((event_id, relay))
                    further_seen.append(record)
        new_events = [
            (event_id, decided[event_id], received_ms, created_at)
            for event_id, (received_ms, created_at) in new_here.items()
        ]
        return _Decision(new_events, further, further_seen, to_push, decided, delivered,
                         duplicates, baselined)

    def _expect(self, arrival: Arrival) -> None:
        """Observation: the recipients' inbox relays that were connected as their DM arrived."""
        relays = connected_inboxes(
            arrival.push_to, self._lists, self._registration_relays, self._insecure,
            self._pool.connected,
        )
        self._observations.expect(arrival.received_ms, arrival.event.id, relays)

    def _suppressed(self, suppressed: list[Suppressed]) -> None:
        """Count and log the events that woke nobody by their recipients' choice (once
        written)."""
        ts_ms = int(time.time() * 1000)
        for event_id, reason, cls in suppressed:
            SUPPRESSED_BY[reason].inc()
            SUPPRESSED_BY_CLASS[(cls, reason)].inc()
            self._observations.suppressed(ts_ms, event_id, reason, cls)

    def _facts(self, arrival: Arrival, now: int) -> Facts:
        event = arrival.event
        p_count = 0
        for tag in event.tags:
            if len(tag) >= 2 and tag[0] == "p":
                p_count += 1
        return facts_of(
            event.kind, event.pubkey, event.created_at, event.tags, event.content, p_count,
            arrival.zap_author, now, self._max_p_tags, self._stale_after,
        )

    async def _targets(self, arrivals: list[Arrival]) -> tuple[
        list[tuple[Arrival, list[Device]]], list[Suppressed], list[Deferred]
    ]:
        """The devices each event wakes: its recipients' devices registered before it arrived
        that asked for its kind (`notify`), less those the wake rules keep asleep (`Choice`);
        with the events that woke nobody for that reason, and the presences that held one
        back. The list checks of the whole batch are one call to the store, after the first
        pass."""
        if not arrivals:
            return [], [], []
        by_key = await self._devices_of(dict.fromkeys(r for a in arrivals for r in a.push_to))
        iris_targets = await self._iris_targets(arrivals)
        decided: list[
            tuple[Arrival, list[Device], Choice | None, Facts | None, list[Choice] | None]
        ] = []
        marks: list[Deferred] = []
        checks: list[AuthorCheck[Facts]] = []
        now = int(time.time())
        for arrival in arrivals:
            late = arrival.since_registration
            event = arrival.event
            kind = event.kind
            targets = [
                device
                for recipient in arrival.push_to
                for device in by_key.get(recipient, ())
                if device.registered_at * 1000 <= arrival.received_ms
                and (recipient not in late or device.registered_at <= event.created_at)
                and wants_kind(
                    DEFAULT_MASK if device.rules is None else device.rules.notify, kind
                )
            ]
            choice = facts = None
            iris: list[Choice] | None = None
            # someone chose something, or the event is not a plain DM to others: the rare path
            if (kind not in DM_KINDS or _any_rules(targets)
                    or event.pubkey in arrival.push_to or arrival.iris):
                facts = self._facts(arrival, now)
                choice = Choice(arrival, facts, targets, now, marks, checks)
                if arrival.iris:
                    iris = self._iris_choices(arrival, facts, iris_targets, now, marks, checks)
            decided.append((arrival, targets, choice, facts, iris))
        link = self._link

        def with_lists(facts: Facts, device: Device, listed: Listed) -> Rule | None:
            verdict = judge(facts, device, now, listed)
            return verdict if isinstance(verdict, Rule) else None

        answers = await link.lists.blocked(checks, with_lists) if checks else []
        writes = []
        suppressed: list[Suppressed] = []
        for arrival, targets, choice, facts, iris in decided:
            if choice is not None and facts is not None:
                rule = choice.settle(answers)
                targets = choice.kept
                cls = facts.cls
                if iris is not None:
                    targets, rule = _with_iris(targets, rule, iris, answers)
                    cls = facts.cls if arrival.push_to else IRIS
                if not targets and rule is not None:
                    suppressed.append((arrival.event.id, rule.reason, cls))
                    continue
            if targets:
                writes.append((arrival, targets))
            elif arrival.since_registration:
                BASELINED.inc()
            else:
                counters = self.counters.get(arrival.relay)
                if counters is not None:
                    counters.dropped["no_device"].inc()
        return writes, suppressed, marks

    async def _iris_targets(self, arrivals: list[Arrival]) -> dict[int, Device]:
        """The devices the batch's Iris matches name, from a cache subscription changes
        clear (a target gone meanwhile is simply absent)."""
        cache = self._iris_devices
        found: dict[int, Device] = {}
        for arrival in arrivals:
            for watch in arrival.iris:
                for device_id in watch.devices:
                    if device_id in found:
                        continue
                    if device_id not in cache:
                        cache[device_id] = await self._devices.by_id(device_id)
                    device = cache[device_id]
                    if device is not None:
                        found[device_id] = device
        return found

    def _iris_choices(
        self, arrival: Arrival, facts: Facts, devices: Mapping[int, Device], now: int,
        marks: list[Deferred], checks: list[AuthorCheck[Facts]],
    ) -> list[Choice]:
        """The Iris targets of an event's matched watches, judged by the Iris rules: one
        `Choice` per (matched through `#p` or not, follows-only or not), each target once per
        such kind of match (one device in two subscriptions wakes if either lets it). A
        target wakes only for events made since it was added (what a relay returns of the
        time before is history, as a registration's baseline); a gift wrap, whose `created_at`
        NIP-59 lets lag up to two days, counts as made since then when it is dated at most two
        days before (and arrived after it was added)."""
        event = arrival.event
        made = event.created_at + (GIFT_WRAP_SKEW_SECONDS if event.kind == GIFT_WRAP else 0)
        variants: dict[tuple[bool, bool], dict[int, Device]] = {}
        for watch in arrival.iris:
            slot = variants.setdefault((watch.index == "#p", watch.follows_only), {})
            for device_id in watch.devices:
                device = devices.get(device_id)
                if (device is not None and device.registered_at <= made
                        and device.registered_at * 1000 <= arrival.received_ms):
                    slot[device_id] = device
        p_count = 0
        for tag in event.tags:
            if len(tag) >= 2 and tag[0] == "p":
                p_count += 1
        return [
            Choice(
                arrival, iris_facts(facts, by_p, p_count, self._max_p_tags),
                [iris_device(device, follows_only) for device in found.values()],
                now, marks, checks,
            )
            for (by_p, follows_only), found in variants.items() if found
        ]

    async def _devices_of(self, recipients: Iterable[str]) -> dict[str, list[Device]]:
        """Devices by recipient, from a cache that registration changes invalidate."""
        cache = self._device_cache
        missing = [r for r in recipients if r not in cache]
        if missing:
            generation = self._device_generation
            found: dict[str, list[Device]] = {r: [] for r in missing}
            for device in await self._devices.of_pubkeys(missing):
                found[device.pubkey].append(device)
            if generation == self._device_generation:
                if len(cache) + len(found) > DEVICE_CACHE_SIZE:
                    cache.clear()
                cache.update(found)
            else:
                return found | {r: cache[r] for r in recipients if r in cache}
        return cache

    async def _write(
        self,
        writes: list[tuple[Arrival, list[Device]]],
        new_events: list[NewEvent],
        further: list[tuple[str, str]],
        ops: list[DbOp],
        marks: list[Deferred],
    ) -> None:
        """One transaction: the batch's wakeups, its seen ids, the queued bookkeeping and the
        events deferring rules held back, each in lock order (`in_lock_order`)."""
        link = self._link
        writes, new_events, further = in_lock_order(
            writes, new_events, further, _event_id_of
        )
        async with self._turn, link.transaction():
            await link.outbox.enqueue_many(
                [(a.event, a.relay, a.received_ms, targets) for a, targets in writes]
            )
            await self._seen.save(new_events, further)
            for op, rows in ops:
                await link.state.apply(op, rows)
            if marks:
                await link.lists.defer(marks, int(time.time()))
