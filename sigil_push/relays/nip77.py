"""NIP-77 (negentropy) catch-up with one relay: our protocol (nostr/nip77.py) over a guarded socket.

Catch-up on a relay that answers NIP-77 offers the relay the (id, created_at) items the bridge
already has for a filter and learns which ids the relay has beyond them, without downloading
any event; the missing events are then fetched by id on the bridge's own connection, through
the usual verification, dedupe and commit.

The socket is the relay reader's (`open_reader`), so the outbound guard's rules hold as for
every relay socket (address checked and pinned, per-host slot, deadline, frame ceiling, no
proxy, no redirect); it is opened on demand and closed after each catch-up (`close`), and it
counts the bytes and frames the relay sends, for the catch-up metrics and benchmark.

Per relay the items stay sorted with their prefix sums between reconciliations (one set per
filter: a firehose window, or one shard's keys), so a reconnect adds only what was noted since
and its CPU follows the differences, not the window. The kept items are bounded
(MAX_KEPT_ITEMS per relay) and counted in sigil_push_memory_entries (`negentropy_items`).

Support is found by trying (never from NIP-11): a NEG-ERR, a CLOSED/NOTICE refusal, an error
or no answer within INITIAL_TIMEOUT_SECONDS raises `NegentropyFailed` with a bounded reason.
What the relay says is bounded: frame size (MAX_FRAME_BYTES, well under the guard's 4 MiB),
rounds, time, the ids it can make us fetch, the ranges one message may hold (no more than our
previous message could produce, bounds rising: nostr/nip77.py), and the work all of its
messages cause, charged to the relay's `RangeBudget` (relays/budget.py) across exchanges and
reconnects. A message is worked through in steps, yielding to the event loop every
YIELD_AFTER_SECONDS, so no relay holds the loop for long. A relay that breaks those bounds
(`violation`) or spends its budget (`budget`) falls back to paged REQ and is not asked for
NIP-77 again for a while (relays/pool.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import weakref
from dataclasses import dataclass
from typing import Any

import aiohttp

from sigil_push.nostr.nip77 import Items, ProtocolError, Reconciliation, SortedItems, TooManyMissing
from sigil_push.nostr.nip77_snapshot import LayeredItems, SnapshotItems
from sigil_push.nostr.relay_message import Closed, NegErr, NegMsg, Notice, parse_relay_message
from sigil_push.relays import catchup_metrics
from sigil_push.relays.budget import RangeBudget
from sigil_push.relays.labels import series_label
from sigil_push.relays.reader_socket import ReaderSocket, open_reader
from sigil_push.telemetry.memory_gauges import track
from sigil_push.telemetry.redaction import redact_keys, relay_label

log = logging.getLogger(__name__)

INITIAL_TIMEOUT_SECONDS = 4.0
"""How long a relay has to answer NEG-OPEN before it counts as not supporting NIP-77."""
SYNC_TIMEOUT_SECONDS = 120.0
"""The whole reconciliation of one filter, however many rounds it takes."""
OPEN_TIMEOUT_SECONDS = 10.0
MAX_MESSAGE_BYTES = 540_000
"""A relay's NEG-MSG before hex: strfry answers in frames of up to 500,000 bytes; a longer one
is not an honest answer to ours, and it would cost milliseconds just to decode."""
MAX_FRAME_BYTES = 2 * MAX_MESSAGE_BYTES + 1024
"""The reconciliation socket's largest frame (the message as hex, in its JSON array): a
bigger one closes the socket (1009) and counts as a `violation`."""
YIELD_AFTER_SECONDS = 0.002
"""Loop time one relay message may take before its work yields to the event loop."""
FRAME_LIMIT_BYTES = 60_000
"""Our messages' size before hex (120 kB on the wire, under strfry's default 128 KiB frame;
nostr-sdk's choice too); a longer answer leaves the rest of the range for the next round."""
MAX_ROUNDS = 500
"""Messages a relay may answer in one reconciliation: an honest one needs about log16 of the
set (each round splits a differing range in 16) plus one per frame of answers deferred."""
MAX_MISSING_IDS = 200_000
"""Ids one reconciliation may find missing: more falls back to paged REQ, whose pages are
bounded per relay, rather than fetching whatever a relay claims by id."""
ITEMS_PER_SYNC = 20_000
"""Our items per reconciliation: a larger window is reconciled in time slices."""
MAX_KEPT_ITEMS = 500_000
"""Items kept per relay between reconciliations (about 310 bytes each, measured, with the id
as bytes and integer, its prefix sum and set entry; the hex id is the ledger's: about 155 MB
at the bound, what nostr-sdk's 250,000 items took). The sets used least recently go first; a
set larger than the bound is rebuilt each time, so a larger window costs CPU, never memory."""


def _slices(
    kept: Items, query: dict[str, Any], per_slice: int
) -> list[tuple[dict[str, Any], int, int]]:
    """`query`'s window cut at whole seconds into slices of about `per_slice` of the kept
    items each, as (filter, first index, end index): every item in exactly one, slice k asks
    [since_k, since_k+1 - 1], the last has no `until`; one slice when they are few."""
    since = query.get("since")
    first = 0 if since is None else kept.position(since)
    end = len(kept)
    cuts: list[int] = []
    for index in range(first + per_slice, end, per_slice):
        created_at = kept.keys[index][0]
        if created_at > kept.keys[first][0] and (not cuts or created_at > cuts[-1]):
            cuts.append(created_at)
    if not cuts:
        return [(query, first, end)]
    slices = []
    lower = first
    for k, start in enumerate([since, *cuts]):
        window = dict(query)
        if start is not None:
            window["since"] = start
        upper = end
        if k < len(cuts):
            window["until"] = cuts[k] - 1
            upper = kept.position(cuts[k])
        slices.append((window, lower, upper))
        lower = upper
    return slices


class NegentropyFailed(Exception):
    """Reconciliation did not complete; `reason` is one of catchup_metrics.FALLBACK_REASONS."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass
class WireCount:
    """What the relay sent on the reconciliation socket (text frames and their bytes)."""

    frames: int = 0
    bytes: int = 0


class _Reconcilers:
    """Every live Reconciler, for the memory gauge (one series for all relays)."""

    def __init__(self) -> None:
        self.live: weakref.WeakSet[Reconciler] = weakref.WeakSet()

    def add(self, reconciler: Reconciler) -> None:
        self.live.add(reconciler)

    def kept_items(self) -> int:
        return sum(reconciler.kept_items() for reconciler in list(self.live))


_ALL = _Reconcilers()
track("negentropy_items", _ALL, _Reconcilers.kept_items)


class Reconciler:
    """Negentropy with one relay: a guarded socket opened on demand and closed after each
    catch-up (`close`), so an idle bridge holds no extra socket; the sorted items kept."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.count = WireCount()
        self._socket: ReaderSocket | None = None
        self._stack: contextlib.AsyncExitStack | None = None
        self._kept: dict[tuple[str, ...] | None, tuple[SnapshotItems | None, SortedItems]] = {}
        """Per filter (a shard's keys; None for a firehose window), least recently used
        first: the items of its last reconciliation, sorted, with their prefix sums (those
        noted since its snapshot, when a stored snapshot lies beneath them)."""
        self._next_sub = 0
        self.added_now = 0
        """Items the last `missing` call added to a kept set (the rest were kept from before)."""
        self.budget = RangeBudget()
        """The work this relay's messages may cause, kept across exchanges and reconnects."""
        self.work = 0
        """Units of work (`Reconciliation.steps`) its messages have caused, in all."""
        _ALL.add(self)

    def kept_items(self) -> int:
        return sum(len(kept) + (len(base) if base is not None else 0)
                   for base, kept in self._kept.values())

    def _items(
        self, query: dict[str, Any], items: dict[str, int], base: SnapshotItems | None
    ) -> Items:
        """The kept set for `query`, brought to exactly `items` (id → created_at, all within
        the window) on top of `base`: older items dropped, new ones added; rebuilt if it
        held others or lay on another snapshot. Items the snapshot holds are left to it."""
        keys = query.get("#p")
        name = None if keys is None else tuple(keys)
        under, kept = self._kept.pop(name, (None, None))
        if kept is None or under is not base:
            kept = SortedItems()
        if base is not None:  # only ids new to the kept set are looked up in the snapshot
            held = {event_id for event_id in items.keys() - kept.known
                    if base.holds(items[event_id], bytes.fromhex(event_id))}
            if held:
                items = {event_id: at for event_id, at in items.items() if event_id not in held}
        since = query.get("since")
        if since is not None:
            kept.drop_before(since)
        self.added_now = kept.add(items)
        if len(kept) != len(items):  # it held items `items` lacks (the store was pruned)
            kept = SortedItems()
            self.added_now = kept.add(items)
        self._kept[name] = (base, kept)
        total = self.kept_items()
        while total > MAX_KEPT_ITEMS and self._kept:
            oldest_base, oldest = self._kept.pop(next(iter(self._kept)))
            total -= len(oldest) + (len(oldest_base) if oldest_base is not None else 0)
        return kept if base is None else LayeredItems(base, kept)

    async def missing(
        self, query: dict[str, Any], items: dict[str, int], base: SnapshotItems | None = None
    ) -> list[str]:
        """The ids the relay holds for `query` that are not among `items` (id → created_at)
        or in `base` (a stored snapshot of the window's items, older ones left out by the
        window's lower bound).

        A window holding more than ITEMS_PER_SYNC of our items is reconciled in time slices
        of about that many, one after the other: relays bound the set one reconciliation
        may cover (rust-nostr's relay refuses some tens of thousands with `NEG-ERR
        "rate-limited: too many negentropy items"`, strfry a million by default)."""
        kept = self._items(query, items, base)
        missing: list[str] = []
        for window, lower, upper in _slices(kept, query, ITEMS_PER_SYNC):
            missing.extend(await self._reconcile(window, kept, lower, upper))
        return missing

    async def _reconcile(
        self, query: dict[str, Any], kept: Items, lower: int, upper: int
    ) -> list[str]:
        try:
            async with asyncio.timeout(SYNC_TIMEOUT_SECONDS):
                return await self._exchange(query, kept, lower, upper)
        except NegentropyFailed as failure:
            reason = failure.reason
        except TimeoutError:
            reason = "timeout"
        except TooManyMissing:
            reason = "error"  # honest when far behind: paged REQ this once
        except ProtocolError as error:
            # a message no honest peer sends (too many ranges, bounds not rising, malformed)
            reason = "violation"
            log.debug("negentropy violation: %s", error)
        except (ValueError, OSError, aiohttp.ClientError) as error:
            # a closed exchange, bad JSON or hex, or no socket: `error` falls back this once,
            # without marking the relay
            reason = "error"
            # aiohttp's message names the URL, which may carry the user's key
            log.debug("negentropy error: %s: %s", type(error).__name__, redact_keys(str(error))[:200])
        log.info("relay %s: negentropy failed (%s)", relay_label(self.url), reason)
        await self.close()  # a socket left mid-exchange is of no use to the next one
        raise NegentropyFailed(reason)

    async def _exchange(
        self, query: dict[str, Any], kept: Items, lower: int, upper: int
    ) -> list[str]:
        ws = await self._open()
        self._next_sub += 1
        sub_id = f"neg{self._next_sub}"
        reconciliation = Reconciliation(kept, lower, upper, FRAME_LIMIT_BYTES, MAX_MISSING_IDS)
        opening = ["NEG-OPEN", sub_id, query, reconciliation.initiate().hex()]
        await ws.send_str(json.dumps(opening, separators=(",", ":")))
        for round_number in range(MAX_ROUNDS):
            wait = INITIAL_TIMEOUT_SECONDS if round_number == 0 else None
            message = await self._next_message(ws, sub_id, wait)
            answer = await self._answer(reconciliation, message)
            if answer is None:
                await ws.send_str(json.dumps(["NEG-CLOSE", sub_id]))
                return sorted(reconciliation.missing)
            await ws.send_str(json.dumps(["NEG-MSG", sub_id, answer.hex()]))
        # an honest relay with a set we cannot cover in time: this once, without marking it
        # (a dishonest one that keeps rounds going pays for them from its budget)
        raise NegentropyFailed("error")

    async def _answer(self, reconciliation: Reconciliation, message: bytes) -> bytes | None:
        """Our answer to `message`, worked out in steps: each step's work is charged to the
        relay's budget (spent: `budget`), and the loop gets a turn every YIELD_AFTER_SECONDS."""
        steps = reconciliation.steps(message)
        label = series_label(self.url)
        turn = time.perf_counter()
        while True:
            try:
                units = next(steps)
            except StopIteration as done:
                answer: bytes | None = done.value
                return answer
            self.work += units
            catchup_metrics.NEGENTROPY_WORK.labels(label).inc(units)
            if not self.budget.charge(units):
                raise NegentropyFailed("budget")
            if time.perf_counter() - turn >= YIELD_AFTER_SECONDS:
                await asyncio.sleep(0)
                turn = time.perf_counter()

    async def _next_message(self, ws: ReaderSocket, sub_id: str, wait: float | None) -> bytes:
        """The next NEG-MSG payload for `sub_id`; a refusal raises, other frames are passed."""
        async with asyncio.timeout(wait):
            while True:
                frame = await ws.receive()
                if (frame.type is aiohttp.WSMsgType.ERROR
                        and isinstance(frame.data, aiohttp.WebSocketError)
                        and frame.data.code == aiohttp.WSCloseCode.MESSAGE_TOO_BIG):
                    raise NegentropyFailed("violation")
                if frame.type is not aiohttp.WSMsgType.TEXT:
                    raise ConnectionError("socket closed")
                text: str = frame.data
                self.count.frames += 1
                self.count.bytes += len(text)
                # a frame that is no relay message ends the exchange (InvalidRelayMessage
                # is a ValueError, as bad JSON was)
                message = parse_relay_message(text)
                if isinstance(message, Closed | Notice):
                    raise NegentropyFailed("refused")
                if isinstance(message, NegErr) and message.sub_id == sub_id:
                    raise NegentropyFailed("neg_err")
                if isinstance(message, NegMsg) and message.sub_id == sub_id:
                    return bytes.fromhex(message.payload)
                # AUTH, an event, or an answer to an exchange closed before: passed over

    async def _open(self) -> ReaderSocket:
        if self._socket is not None:
            return self._socket
        stack = contextlib.AsyncExitStack()
        try:
            self._socket = await stack.enter_async_context(open_reader(
                self.url, purpose="relay", max_size=MAX_FRAME_BYTES,
                open_timeout=OPEN_TIMEOUT_SECONDS, heartbeat=30.0, user_agent="sigil-push",
            ))
        except BaseException:
            await stack.aclose()
            raise
        self._stack = stack
        return self._socket

    @property
    def open(self) -> bool:
        """Whether a reconciliation socket is open."""
        return self._socket is not None

    async def close(self) -> None:
        stack, self._stack, self._socket = self._stack, None, None
        if stack is not None:
            with contextlib.suppress(Exception):
                await stack.aclose()
