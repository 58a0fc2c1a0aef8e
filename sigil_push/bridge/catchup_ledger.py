"""Which DMs each relay delivered, for negentropy catch-ups (relays/nip77.py): noted on the
readers' tasks, written to the store in bulk (`CatchupItemsStore`), and kept in memory per
relay: loaded from the store once per process (a firehose relay's whole window in one query;
a keyed relay's rows per key, the first time a shard asks for that key: a key that moved here
from another worker brings what that worker saw), then appended to as DMs are noted, so a
reconnect's catch-up reads nothing from the store (reading the window back per shard was a
cost that grew with the window, not the news).
Memory is bounded like the table, by the window (pruned with it), and by MAX_KEPT_ITEMS per
relay, past which that relay is read from the store as before; its size is the
`catchup_items` series of sigil_push_memory_entries.

A firehose relay's events that name nobody here (`note_unaddressed`) are kept in memory and in
the snapshots, not as rows (on a firehose nearly every event is one, and its row was most of
the cost of reading the relay): a crash costs a refetch of those noted since the last snapshot.

A firehose relay's items are also kept as a snapshot in the store (sorted records with their
prefix sums, nostr/nip77_snapshot.py), in parts: when the items noted since the last part pass
a sixteenth of the snapshot (off the event loop) and at a clean shutdown, those newer than the
snapshot's sorted run are appended to it as a new part (encoded once, the run's bytes copied,
never re-encoded), and the few that sort before its end (late, or dated ahead of now) go into
a late part of their own; the whole is rewritten as one part only once the late ones pass a
quarter of the run (or the parts MAX_PARTS), so an item costs about one encoding, not the
sixteen a whole re-cut per sixteenth cost. A restart reads the parts as bytes and only the
rows written since the newest part's cut (`noted_at`, in milliseconds), and the reconciliation
reads both as one set: a restart's CPU follows what is new, not the window. A snapshot that is
missing, corrupt, too large or cut before the window falls back to reading the window's rows,
counted in sigil_push_catchup_snapshot_loads_total by outcome.

Noting costs a tuple append per delivery; the rows reach the store with the housekeeping (or
as soon as MAX_PENDING_ROWS wait), never in the committer's transaction, and only once the
committer has decided their event (`confirm`, after its batch is on disk): a row on disk for
a DM whose commit a crash lost would make the next process's reconciliation skip that DM,
while a row lost to a crash only makes it fetch the event again, which the seen ids then drop. Every
store call takes the bridge connection's `turn`, as the committer's transactions do. Rows
older than the catch-up window (plus the dedupe slack) are pruned, so memory and table stay
bounded by the window.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from bisect import bisect_left, bisect_right
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from prometheus_client import Counter

from sigil_push.nostr.nip77_snapshot import (
    DIGEST_SIZE,
    HEADER_SIZE,
    RECORD_SIZE,
    SnapshotInvalid,
    SnapshotItems,
    SnapshotPart,
    encode_keys,
    seal_part,
)
from sigil_push.store.errors import STORE_UNAVAILABLE
from sigil_push.store.interface import UNADDRESSED, BridgeConnection
from sigil_push.telemetry.memory_gauges import track

log = logging.getLogger(__name__)

MAX_PENDING_ROWS = 20_000
MAX_UNCONFIRMED_EVENTS = 200_000
UNCONFIRMED_SECONDS = 900.0
"""How long a noted DM's rows wait for the committer's decision before they are let go."""
MAX_KEPT_ITEMS = 2_000_000
"""(recipient, event id) pairs kept in memory per relay (about 100 bytes each beyond the id
strings, which the seen cache and nostr-sdk's kept items share)."""
FIREHOSE_SCOPE = ""
"""The snapshot scope of a relay's whole window (a firehose relay's, read with no `#p`)."""
MAX_SNAPSHOT_ITEMS = 500_000
"""Items one snapshot may hold (72 bytes each: 36 MB), the reconciler's bound per relay; a
larger window is read from the store's rows, as before snapshots."""
RECUT_MIN_ITEMS = 2_000
RECUT_FRACTION = 16
"""A new part is written once the items noted since the last pass a sixteenth of the snapshot
(and RECUT_MIN_ITEMS): a crash then loses at most about that many (fetched again), and a
restart reads at most about that many rows beyond the snapshot."""
LATE_FRACTION = 4
"""The snapshot is rewritten as one part once its late items pass a quarter of its run."""
MAX_PARTS = 64
"""... or once it has this many parts."""
SNAPSHOT_LOADS = Counter(
    "sigil_push_catchup_snapshot_loads_total",
    "Restarts' first catch-up item reads of a firehose relay, by how its stored snapshot"
    " served: loaded, or none/corrupt/oversized/stale/keyed (the window's rows read instead)",
    ["outcome"],
)
SNAPSHOT_OUTCOMES = ("loaded", "none", "corrupt", "oversized", "stale", "keyed")
SNAPSHOT_WRITES = Counter(
    "sigil_push_catchup_snapshot_writes_total",
    "NIP-77 snapshots of a relay's catch-up items written, by outcome (written, failed)",
    ["outcome"],
)
for _outcome in SNAPSHOT_OUTCOMES:
    SNAPSHOT_LOADS.labels(_outcome)
for _outcome in ("written", "failed"):
    SNAPSHOT_WRITES.labels(_outcome)
_EVENT_ID = re.compile(r'"id"\s*:\s*"([0-9a-f]{64})"')
_CREATED_AT = re.compile(r'"created_at"\s*:\s*(\d{1,12})\b')


@dataclass
class _Cut:
    """A snapshot's new parts, and what memory holds of it once they are saved."""

    parts: list[tuple[int, int, bytes]]
    """(part number, newest created_at, bytes)"""
    drop: list[int]
    """Part numbers the new parts replace."""
    replace: bool
    """The new parts replace all the others."""
    base: SnapshotItems
    run_parts: list[tuple[int, int]]
    late: dict[str, int]
    next_part: int


def _newest(keys: list[bytes]) -> int:
    return int.from_bytes(keys[-1][:8], "big") if keys else 0


def _late_part(number: int, keys: list[bytes]) -> list[tuple[int, int, bytes]]:
    if not keys:
        return []
    return [(number, _newest(keys), seal_part(encode_keys(keys)[0], 0, late=True))]


def _items_from(run_parts: list[tuple[int, int]], run_size: int, start: int) -> int:
    """How many of the run's items are in the parts from the one holding item `start` on
    (what replacing those parts writes again)."""
    part_first = run_size
    for _, count in reversed(run_parts):
        if part_first <= start:
            break
        part_first -= count
    return run_size - min(part_first, start)


def _cut(
    base: SnapshotItems | None, run_parts: list[tuple[int, int]], late: dict[str, int],
    next_part: int, groups: list[dict[str, int]], since: int, now: int,
    undecided: frozenset[str],
) -> _Cut:
    """The parts that save `groups`' items (id → created_at) since `since` but for the
    `undecided` (not committed yet: a crash must not leave them looking had) on top of `base`
    (the run, stored as `run_parts`: (part number, items) in order) and `late` (the late
    parts' items). Those not dated after `now` that sort after all but the run's last items
    (at most twice as many as the new ones) go into the run: the part holding the first of
    them is replaced by one part with its items before it as they were, then the rest merged
    with the new ones; the others go into a late part. The parts replaced are written again
    whole, so when they hold more than LATE_FRACTION times as many items as the new ones
    that sort among them, those go into the late part instead (a late item costs about
    LATE_FRACTION writes, in the rewrite it brings closer), and the rest is a new part. When
    the late items are many (or the parts), everything is written as one part, replacing
    the others."""
    fresh: dict[str, int] = {}
    for ids in groups:
        fresh.update(ids)
    new = sorted(at.to_bytes(8, "big") + bytes.fromhex(event_id) for event_id, at in fresh.items()
                 if at >= since and event_id not in undecided)
    ahead = bisect_left(new, (now + 1).to_bytes(8, "big"))
    if base is not None and next_part + 2 <= MAX_PARTS:
        first = base.position(since)
        # the run's items from `start` on are encoded again with the new ones that sort among
        # them: from the first new one, but never more than twice as many as there are new
        limit = max(first, len(base) - 2 * ahead)
        behind = bisect_right(new, base.raw[limit - 1]) if limit > 0 else 0
        start = len(base)
        if behind < ahead:
            start = max(limit, min(start, base.bisect_raw(new[behind])))
        if start < len(base):
            among = bisect_right(new, base.raw[len(base) - 1], behind, ahead)
            if _items_from(run_parts, len(base), start) > LATE_FRACTION * (among - behind):
                # the parts holding the few new items that sort among the run's last ones
                # are large: those items go into the late part rather than have those parts
                # written again whole (on a live firehose, each new part was rewritten with
                # the next one's items: the same items saved again and again)
                behind, start = among, len(base)
        # what the run already holds (noted again: a relay's replay) is not late
        late_new = [key for key in new[:behind] if not base.holds_raw(key)] + new[ahead:]
        if len(late) + len(late_new) <= max(RECUT_MIN_ITEMS, (len(base) - first) // LATE_FRACTION):
            # the parts from the one holding `start` on are replaced by one part: that part's
            # items before `start` as they are (bytes, not encoded), then the rest, encoded
            kept_parts, drop = list(run_parts), []
            part_first = len(base)
            while start < part_first and kept_parts:
                number, count = kept_parts.pop()
                drop.append(number)
                part_first -= count
            if part_first < first:  # the parts before it left the window: they go too
                drop += [number for number, _ in kept_parts]
                kept_parts, part_first = [], first
            moving = new[behind:ahead]
            if start < len(base):  # two sorted runs: merged by the sort, repeats dropped
                moving = list(dict.fromkeys(sorted(base.keys_from(start) + moving)))
            records, _ = encode_keys(moving, base.sum_before(start))
            body = b"".join((base.records_from(part_first)[: (start - part_first) * RECORD_SIZE],
                             records))
            parts = []
            if body:
                parts.append((next_part, _newest(moving),
                              seal_part(body, base.sum_before(part_first))))
            parts += _late_part(next_part + len(parts), late_new)
            dropped = first
            while kept_parts and dropped >= kept_parts[0][1]:  # left the window (in memory)
                dropped -= kept_parts.pop(0)[1]
            if kept_parts:
                kept_parts[0] = (kept_parts[0][0], kept_parts[0][1] - dropped)
            if body:
                kept_parts.append((next_part, len(body) // RECORD_SIZE))
            kept_late = dict(late)  # what left the window goes with the prune
            kept_late.update((key[8:].hex(), int.from_bytes(key[:8], "big")) for key in late_new)
            joined = SnapshotItems.of_records(
                b"".join((base.records_from(first)[: (start - first) * RECORD_SIZE], records)),
                base.sum_before(first),
            )
            return _Cut(parts, drop, False, joined, kept_parts, kept_late, next_part + len(parts))
    everything = set(new)
    if base is not None:
        everything.update(base.keys_from(base.position(since)))
    everything.update(at.to_bytes(8, "big") + bytes.fromhex(event_id)
                      for event_id, at in late.items() if at >= since)
    ordered = sorted(everything)
    ahead = bisect_left(ordered, (now + 1).to_bytes(8, "big"))
    run = ordered[:ahead]
    records, _ = encode_keys(run)
    parts = [(0, _newest(run), seal_part(records, 0)), *_late_part(1, ordered[ahead:])]
    kept_late = {key[8:].hex(): int.from_bytes(key[:8], "big") for key in ordered[ahead:]}
    return _Cut(parts, [], True, SnapshotItems.of_records(records, 0), [(0, len(run))],
                kept_late, len(parts))


class _Kept:
    """One relay's deliveries in memory: recipient → event id → created_at; for a firehose
    relay with a snapshot (`base`), those noted since it was cut."""

    def __init__(self) -> None:
        self.by_key: dict[str, dict[str, int]] = {}
        self.size = 0
        self.loaded_keys: set[str] = set()
        self.all_loaded = False
        self.base: SnapshotItems | None = None
        """The stored snapshot's run."""
        self.run_parts: list[tuple[int, int]] = []
        """The stored parts of `base`, in order: (part number, its items in `base`)."""
        self.late: dict[str, int] = {}
        """Its late parts' items (not in `base`)."""
        self.next_part = 0
        self.recutting: dict[str, dict[str, int]] | None = None
        """What a snapshot part being cut takes in (still read until it is saved)."""

    def unloaded(self, keys: list[str] | None) -> list[str] | None:
        """Which of `keys` still need reading from the store ([] none; None all of them)."""
        if self.all_loaded:
            return []
        if keys is None:
            return None
        return [key for key in keys if key not in self.loaded_keys]

    def add(self, recipient: str, event_id: str, created_at: int) -> None:
        ids = self.by_key.get(recipient)
        if ids is None:
            ids = self.by_key[recipient] = {}
        if event_id not in ids:
            ids[event_id] = created_at
            self.size += 1

    def items(self, keys: list[str] | None, since: int) -> dict[str, int]:
        """Beyond the snapshot, when there is one."""
        found: dict[str, int] = {}
        layers = [self.by_key] if self.recutting is None else [self.recutting, self.by_key]
        groups = [ids for layer in layers for ids in (
            layer.values() if keys is None else (layer[key] for key in keys if key in layer)
        )]
        if keys is None:
            groups.append(self.late)
        for ids in groups:
            for event_id, created_at in ids.items():
                if created_at >= since:
                    found[event_id] = created_at
        return found

    def prune(self, cutoff: int) -> None:
        for recipient in list(self.by_key):
            ids = self.by_key[recipient]
            stale = [event_id for event_id, created_at in ids.items() if created_at < cutoff]
            for event_id in stale:
                del ids[event_id]
            self.size -= len(stale)
            if not ids:
                del self.by_key[recipient]
        self.late = {event_id: at for event_id, at in self.late.items() if at >= cutoff}


def _flushed(task: asyncio.Task[None]) -> None:
    """An early flush's failure, by its type: its message may name the rows' relay URLs and
    keys (asyncpg's DETAIL), and unread it would reach asyncio's "Task exception was never
    retrieved" traceback."""
    error = None if task.cancelled() else task.exception()
    if error is not None:
        log.warning("catch-up items not saved: %s", type(error).__name__)


class CatchupLedger:
    def __init__(self, window_seconds: int, link: BridgeConnection, turn: asyncio.Lock) -> None:
        """`link` is the bridge's connection, `turn` the lock the committer holds for each of
        its transactions on it (the ledger's reads and writes take it too)."""
        self._window = window_seconds
        self._rows: list[tuple[str, str, str, int]] = []
        self._unconfirmed: dict[str, tuple[float, list[tuple[str, str, str, int]]]] = {}
        """Event id → (noted at, rows) of DMs the committer has not decided yet, oldest first."""
        self._link = link
        self._turn = turn
        self._flushing: asyncio.Task[None] | None = None
        self._kept: dict[str, _Kept] = {}
        """Relays held in memory (absent: not reconciled yet in this process)."""
        self._too_large: set[str] = set()
        """Relays past MAX_KEPT_ITEMS: read from the store per reconciliation instead."""
        self.store_reads = 0
        """Catch-up item reads that went to the store (a load, or a relay too large)."""
        track("catchup_items", self, CatchupLedger.kept_items)

    def kept_items(self) -> int:
        return sum(kept.size + len(kept.late) + (len(kept.base) if kept.base is not None else 0)
                   for kept in self._kept.values())

    def _keep(self, url: str, recipient: str, event_id: str, created_at: int) -> None:
        kept = self._kept.get(url)
        if kept is not None:
            kept.add(recipient, event_id, created_at)
            if kept.size > MAX_KEPT_ITEMS:
                del self._kept[url]
                self._too_large.add(url)

    def note(self, url: str, event_id: str, created_at: int, recipients: tuple[str, ...]) -> None:
        """`url` delivered a verified DM for `recipients` (keys subscribed there). Kept in
        memory at once; written to the store (and into a snapshot) only once the committer
        has decided the event (`confirm`): a row on disk tells the next process's
        reconciliation not to fetch that DM again, so it must not outlive a crash that lost
        the DM's commit."""
        waiting = self._unconfirmed.get(event_id)
        if waiting is None:
            waiting = self._unconfirmed[event_id] = (time.monotonic(), [])
            if len(self._unconfirmed) > MAX_UNCONFIRMED_EVENTS:
                del self._unconfirmed[next(iter(self._unconfirmed))]
        for recipient in recipients:
            waiting[1].append((url, recipient, event_id, created_at))
        if url in self._kept:
            for recipient in recipients:
                self._keep(url, recipient, event_id, created_at)

    def confirm(self, event_ids: Iterable[str]) -> None:
        """The committer decided these events (pushed, baselined or known), durably: their
        noted rows may go to the store."""
        unconfirmed, rows = self._unconfirmed, self._rows
        for event_id in event_ids:
            waiting = unconfirmed.pop(event_id, None)
            if waiting is not None:
                rows.extend(waiting[1])
        if len(rows) >= MAX_PENDING_ROWS:
            self._flush_soon()

    def _expire_unconfirmed(self) -> None:
        """Rows of events the committer never decided (dropped before it: a quota, a relay
        gone) are not written: a later reconciliation fetches those DMs again."""
        oldest = time.monotonic() - UNCONFIRMED_SECONDS
        unconfirmed = self._unconfirmed
        while unconfirmed:
            event_id = next(iter(unconfirmed))
            if unconfirmed[event_id][0] >= oldest:
                break
            del unconfirmed[event_id]

    def note_unaddressed(self, url: str, frame: str) -> None:
        """A firehose relay's event for nobody here, dropped before any parse: its id and time
        from the raw frame (unverified: it only ever spares fetching it from that relay)."""
        found, when = _EVENT_ID.search(frame), _CREATED_AT.search(frame)
        if found is not None and when is not None:
            self._note_unaddressed(url, found.group(1), int(when.group(1)))

    def note_unaddressed_event(self, url: str, raw: Any) -> None:
        """The same for a parsed frame (a firehose answer before its EOSE)."""
        if not isinstance(raw, dict):
            return
        event_id, created_at = raw.get("id"), raw.get("created_at")
        if type(event_id) is str and len(event_id) == 64 and type(created_at) is int:
            self._note_unaddressed(url, event_id, created_at)

    def _note_unaddressed(self, url: str, event_id: str, created_at: int) -> None:
        """Held in memory (and so in the relay's next snapshot), not a row: on a firehose of
        public kinds nearly every event names nobody, and a `catchup_items` row each was most
        of what reading the relay cost (bench/ingest.py --only public). A relay not loaded
        yet starts its `_Kept` here, which its first reconciliation fills with the rest; a
        clean stop writes what such a relay holds as rows (`save_snapshots`). What a crash
        loses (noted since the last snapshot) a later reconciliation fetches again, and the
        same scan drops again, unparsed. A relay too large to hold gets rows, as before."""
        kept = self._kept.get(url)
        if kept is None:
            if url in self._too_large:
                self._rows.append((url, UNADDRESSED, event_id, created_at))
                if len(self._rows) >= MAX_PENDING_ROWS:
                    self._flush_soon()
                return
            kept = self._kept[url] = _Kept()
        kept.add(UNADDRESSED, event_id, created_at)
        if kept.size > MAX_KEPT_ITEMS:
            del self._kept[url]
            self._too_large.add(url)

    def _flush_soon(self) -> None:
        if self._flushing is None or self._flushing.done():
            self._flushing = asyncio.get_running_loop().create_task(self.flush())
            self._flushing.add_done_callback(_flushed)

    async def flush(self) -> None:
        """Write the noted rows (a store outage keeps them for the next try, up to a cap).
        A flush started early (MAX_PENDING_ROWS) is waited for first, so the last flush
        before the connection closes leaves nothing in flight."""
        running = self._flushing
        if running is not None and running is not asyncio.current_task():
            await asyncio.wait({running})
        self._expire_unconfirmed()
        link = self._link
        if not self._rows:
            return
        # the store merges each DM's copies into one row and writes in key order
        # (`bridge_rows.merged_catchup_rows`)
        rows, self._rows = self._rows, []
        try:
            async with self._turn, link.transaction():
                await link.catchup.add(rows)
        except STORE_UNAVAILABLE as error:
            log.warning("catch-up items not saved: %s", type(error).__name__)
            self._rows = (rows + self._rows)[-MAX_PENDING_ROWS * 5 :]

    async def items(self, url: str, keys: list[str] | None, since: int) -> dict[str, int]:
        """Event id → created_at of the DMs `url` delivered since `since` (for `keys`, or
        all), the snapshot's among them."""
        base, items = await self.held(url, keys, since)
        if base is not None:
            items.update((raw.hex(), at) for at, raw in base.pairs(since))
        return items

    async def held(
        self, url: str, keys: list[str] | None, since: int
    ) -> tuple[SnapshotItems | None, dict[str, int]]:
        """What `url` delivered since `since` (for `keys`, or all) as a stored snapshot (for
        the whole window only; its older items are the caller's to leave out) and event id →
        created_at of the rest: from memory, loaded from the store the first time."""
        kept = self._kept.get(url)
        if kept is not None and kept.base is not None and keys is not None:
            # the snapshot has no recipients: a keyed read of a relay once read whole
            del self._kept[url]
            kept = None
            SNAPSHOT_LOADS.labels("keyed").inc()
        unloaded = [] if kept is None else kept.unloaded(keys)
        if kept is not None and unloaded == []:
            return kept.base, kept.items(keys, since)
        await self.flush()
        self.store_reads += 1
        if url in self._too_large:
            async with self._turn:
                return None, await self._link.catchup.items(url, keys, since)
        if kept is None:
            kept = self._kept[url] = _Kept()
            unloaded = keys
        if unloaded is None:
            rows = await self._load_whole(url, kept)
        else:
            async with self._turn:
                rows = await self._link.catchup.rows(url, unloaded, self._cutoff(0))
        if unloaded is None:
            kept.all_loaded = True
        else:
            kept.loaded_keys.update(unloaded)
        for recipient, event_id, created_at in rows:
            kept.add(recipient, event_id, created_at)
        # noted but not in the store yet (a store outage keeps them back): in memory too
        waiting = [row for _, rows in self._unconfirmed.values() for row in rows]
        for relay, recipient, event_id, created_at in [*self._rows, *waiting]:
            if relay == url:
                kept.add(recipient, event_id, created_at)
        if kept.size > MAX_KEPT_ITEMS:
            del self._kept[url]
            self._too_large.add(url)
            async with self._turn:
                return None, await self._link.catchup.items(url, keys, since)
        return kept.base, kept.items(keys, since)

    async def _load_whole(self, url: str, kept: _Kept) -> list[tuple[str, str, int]]:
        """A relay's rows for the whole window: those written since its snapshot's newest
        part, when the snapshot serves (`kept.base`), else all of them."""
        cutoff = self._cutoff(0)
        async with self._turn:
            stored = await self._link.catchup.snapshot(url, FIREHOSE_SCOPE)
        outcome = "none"
        cut = max((part_cut for _, part_cut, _ in stored), default=0)
        if stored:
            outcome = "stale" if cut < cutoff * 1000 else "loaded"
            most = MAX_SNAPSHOT_ITEMS * RECORD_SIZE + len(stored) * (HEADER_SIZE + DIGEST_SIZE)
            if sum(len(data) for _, _, data in stored) > most:
                outcome = "oversized"
            elif outcome == "loaded":
                try:
                    parts = [SnapshotPart(data) for _, _, data in stored]
                    kept.base = SnapshotItems.of_run([part for part in parts if not part.late])
                    kept.run_parts = [(number, part.count) for (number, _, _), part
                                      in zip(stored, parts, strict=True) if not part.late]
                except SnapshotInvalid as error:
                    log.warning("catch-up snapshot refused: %s", error)
                    outcome = "corrupt"
                else:
                    kept.late = {raw.hex(): at for part in parts if part.late for at, raw in
                                 SnapshotItems.of_records(bytes(part.records), 0).pairs(cutoff)}
                    kept.next_part = stored[-1][0] + 1
        SNAPSHOT_LOADS.labels(outcome).inc()
        async with self._turn:
            if stored and kept.base is not None:
                return await self._link.catchup.noted_since(url, cut, cutoff)
            return await self._link.catchup.rows(url, None, cutoff)

    async def save_snapshots(self, final: bool = False) -> None:
        """Save a new snapshot part of each relay held whole whose items noted since the last
        are many enough (any, when `final`: at a clean shutdown).

        A firehose relay held since its first unaddressed event but not loaded in this
        process (no reconciliation yet: a first start, a connection that never dropped) is
        loaded here once it holds RECUT_MIN_ITEMS, so its unaddressed items go into its
        snapshots like a reconciled relay's; at a clean shutdown, one still not loaded (no
        snapshot can hold it) has them written as rows instead."""
        for url, kept in list(self._kept.items()):
            unaddressed = kept.by_key.get(UNADDRESSED) if not kept.all_loaded else None
            if not unaddressed:
                continue
            if final:
                self._rows.extend(
                    (url, UNADDRESSED, event_id, at) for event_id, at in unaddressed.items()
                )
            elif kept.size >= RECUT_MIN_ITEMS and kept.recutting is None:
                try:
                    await self.held(url, None, int(time.time()))
                except STORE_UNAVAILABLE as error:
                    log.warning("catch-up items not loaded: %s", type(error).__name__)
        if final:
            await self.flush()
        for url, kept in list(self._kept.items()):
            if not kept.all_loaded or kept.recutting is not None:
                continue
            base_size = len(kept.base) if kept.base is not None else 0
            if base_size + len(kept.late) + kept.size > MAX_SNAPSHOT_ITEMS or not kept.size:
                continue
            if final or kept.size >= max(RECUT_MIN_ITEMS, base_size // RECUT_FRACTION):
                await self._save_snapshot(url, kept)

    async def _save_snapshot(self, url: str, kept: _Kept) -> None:
        link, turn = self._link, self._turn
        await self.flush()
        # every row written before `cut` is in memory now and goes into this part; a row not
        # in it is noted after, so written after (the store's add takes the time)
        cut = int(time.time() * 1000)
        captured = kept.recutting = kept.by_key
        kept.by_key, kept.size = {}, 0
        undecided = frozenset(self._unconfirmed)
        try:
            cutting = await asyncio.to_thread(
                _cut, kept.base, kept.run_parts, kept.late, kept.next_part,
                list(captured.values()), self._cutoff(0), cut // 1000, undecided,
            )
            async with turn, link.transaction():
                await link.catchup.save_snapshot(
                    url, FIREHOSE_SCOPE, cut, cutting.parts, cutting.drop, cutting.replace
                )
        except STORE_UNAVAILABLE as error:
            SNAPSHOT_WRITES.labels("failed").inc()
            log.warning("catch-up snapshot not saved: %s", type(error).__name__)
            for recipient, ids in captured.items():
                for event_id, created_at in ids.items():
                    kept.add(recipient, event_id, created_at)
        else:
            SNAPSHOT_WRITES.labels("written").inc()
            kept.base, kept.run_parts = cutting.base, cutting.run_parts
            kept.late, kept.next_part = cutting.late, cutting.next_part
            for recipient, ids in captured.items():  # still in memory, above the snapshot
                for event_id, created_at in ids.items():
                    if event_id in undecided:
                        kept.add(recipient, event_id, created_at)
        finally:
            kept.recutting = None

    def _cutoff(self, slack_seconds: int) -> int:
        return int(time.time()) - self._window - slack_seconds

    async def prune(self, slack_seconds: int) -> int:
        cutoff = self._cutoff(slack_seconds)
        for kept in self._kept.values():
            kept.prune(cutoff)
        async with self._turn, self._link.transaction():
            return await self._link.catchup.prune(cutoff)
