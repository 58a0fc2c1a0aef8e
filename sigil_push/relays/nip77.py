"""NIP-77 (negentropy set reconciliation) through nostr-sdk, over a socket of our own.

Catch-up on a relay that answers NIP-77 offers the relay the (id, created_at) items the bridge
already has for a filter and learns which ids the relay has beyond them, without downloading
any event (`Relay.sync` with `SyncOptions().dry_run()`); the missing events are then fetched by
id on the bridge's own connection, through the usual verification, dedupe and commit.

The protocol is nostr-sdk's (`Relay.sync`), not ours. nostr-sdk would open its own websocket;
it is handed instead a `CustomWebSocketTransport` that opens the socket with the relay reader's
`open_reader`, so the outbound guard's rules hold as for every relay socket (address checked
and pinned, per-host slot, deadline, frame ceiling, no proxy, no redirect). The transport also
counts the bytes and frames the relay sends, for the catch-up metrics and benchmark.

nostr-sdk calls the transport from its Rust threads; uniffi runs those Python coroutines on
the event loop set with `uniffi_set_event_loop`, which `Reconciler` sets to the running loop.
Support is found by trying (never from NIP-11): a NEG-ERR, a CLOSED/NOTICE refusal, an error
or no answer within INITIAL_TIMEOUT_SECONDS raises `NegentropyFailed` with a bounded reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import weakref
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import aiohttp
import nostr_sdk

from sigil_push.memory_gauges import track
from sigil_push.relays.labels import relay_label
from sigil_push.relays.reader_socket import ReaderSocket, open_reader

log = logging.getLogger(__name__)

INITIAL_TIMEOUT_SECONDS = 4.0
"""How long a relay has to answer NEG-OPEN before it counts as not supporting NIP-77."""
SYNC_TIMEOUT_SECONDS = 120.0
"""The whole reconciliation of one filter, however many rounds it takes."""
OPEN_TIMEOUT_SECONDS = 10.0
MAX_FRAME_BYTES = 4 * 1024 * 1024
CLOSE_WAIT_SECONDS = 5.0
ITEMS_PER_SYNC = 20_000
"""Our items per reconciliation: a larger window is reconciled in time slices."""
MAX_CONVERTED_ITEMS = 250_000
"""nostr-sdk items kept per relay between reconciliations (about 630 bytes each, Python and
Rust together, measured: about 160 MB at the bound): when full, the kept set is dropped and
refilled, so a larger window costs CPU as before, never unbounded memory."""


def _slices(
    query: dict[str, Any], items: dict[str, int], per_slice: int
) -> list[tuple[dict[str, Any], dict[str, int]]]:
    """`query`'s window cut at whole seconds into slices of about `per_slice` of `items`
    each (every item in exactly one: slice k asks [since_k, since_k+1 - 1], the last has no
    `until`); one slice when they are few. One sort, then each item is placed once."""
    if len(items) <= per_slice:
        return [(query, items)]
    ordered = sorted(items.items(), key=lambda item: item[1])
    cuts = sorted(
        {ordered[i][1] for i in range(per_slice, len(ordered), per_slice)} - {ordered[0][1]}
    )
    bounds = [query.get("since"), *cuts]
    slices = []
    position = 0
    for k, since in enumerate(bounds):
        until = cuts[k] - 1 if k < len(cuts) else None
        window = dict(query)
        if since is not None:
            window["since"] = since
        if until is not None:
            window["until"] = until
        part: dict[str, int] = {}
        while position < len(ordered) and (until is None or ordered[position][1] <= until):
            event_id, created_at = ordered[position]
            if since is None or created_at >= since:
                part[event_id] = created_at
            position += 1
        slices.append((window, part))
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
    sent_bytes: int = 0
    refusal: str | None = None
    """`neg_err` or `refused` (CLOSED, NOTICE) when the relay said no on this socket."""


class _Adapter(nostr_sdk.WebSocketAdapter):  # type: ignore[misc]
    """One guarded aiohttp websocket, as nostr-sdk's transport adapter."""

    def __init__(
        self, ws: ReaderSocket, stack: contextlib.AsyncExitStack, count: WireCount,
        closed: asyncio.Event,
    ) -> None:
        self._ws = ws
        self._stack = stack
        self._count = count
        self._closed = closed

    async def send(self, msg: Any) -> None:
        if msg.is_TEXT():
            self._count.sent_bytes += len(msg.text)
            await self._ws.send_str(msg.text)

    async def recv(self) -> Any:
        message = await self._ws.receive()
        if message.type is aiohttp.WSMsgType.TEXT:
            text: str = message.data
            self._count.frames += 1
            self._count.bytes += len(text)
            if text.startswith('["NEG-ERR"'):
                self._count.refusal = "neg_err"
            elif text.startswith(('["CLOSED"', '["NOTICE"')):
                self._count.refusal = "refused"
            return nostr_sdk.WebSocketMessage.TEXT(text)
        return None  # closed, error or binary: the stream ends

    async def close_connection(self) -> None:
        try:
            await self._stack.aclose()
        finally:
            self._closed.set()


class _GuardedTransport(nostr_sdk.CustomWebSocketTransport):  # type: ignore[misc]
    def __init__(self, count: WireCount) -> None:
        self._count = count
        self.closed: list[asyncio.Event] = []
        """One per socket opened, set once nostr-sdk has closed it."""

    def support_ping(self) -> bool:
        return False

    async def connect(self, url: str, proxy: Any) -> Any:
        stack = contextlib.AsyncExitStack()
        try:
            ws = await stack.enter_async_context(open_reader(
                url, purpose="relay", max_size=MAX_FRAME_BYTES,
                open_timeout=OPEN_TIMEOUT_SECONDS, heartbeat=30.0, user_agent="sigil-push",
            ))
        except BaseException:
            await stack.aclose()
            raise
        closed = asyncio.Event()
        self.closed.append(closed)
        return nostr_sdk.WebSocketAdapterWrapper(_Adapter(ws, stack, self._count, closed))


def _reason(error: BaseException) -> str:
    text = str(error).lower()
    if "timeout" in text or "timed out" in text:
        return "timeout"
    if "neg-err" in text or "negentropy" in text or "neg_err" in text:
        return "neg_err"
    if "closed" in text or "notice" in text or "auth" in text or "restricted" in text:
        return "refused"
    return "error"


class _Reconcilers:
    """Every live Reconciler, for the memory gauge (one series for all relays)."""

    def __init__(self) -> None:
        self.live: weakref.WeakSet[Reconciler] = weakref.WeakSet()

    def add(self, reconciler: Reconciler) -> None:
        self.live.add(reconciler)

    def kept_items(self) -> int:
        return sum(len(reconciler._converted) for reconciler in list(self.live))


_ALL = _Reconcilers()
track("negentropy_items", _ALL, _Reconcilers.kept_items)

_clients_open = 0
"""Reconcilers with a client open: uniffi's event loop is set while any is (process-wide, so
it is cleared again after the last, and nostr-sdk calls made from other loops still work)."""


def _loop_needed() -> None:
    global _clients_open
    if _clients_open == 0:
        nostr_sdk.uniffi_set_event_loop(asyncio.get_running_loop())
    _clients_open += 1


def _loop_released() -> None:
    global _clients_open
    _clients_open -= 1
    if _clients_open == 0:
        nostr_sdk.uniffi_set_event_loop(None)


class Reconciler:
    """Negentropy with one relay: a nostr-sdk client on a guarded socket, opened on demand
    and closed after each catch-up (`close`), so an idle bridge holds no extra socket."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.count = WireCount()
        self._client: nostr_sdk.Client | None = None
        self._relay: nostr_sdk.Relay | None = None
        self._transport: _GuardedTransport | None = None
        self._converted: dict[str, tuple[int, nostr_sdk.NegentropyItem]] = {}
        """Event id → (created_at, its nostr-sdk item), kept across catch-ups and reconnects:
        building an item (hex parsing through uniffi) was most of a reconciliation's CPU, paid
        again for the whole window each time; now only for the items new since the last."""
        self.converted_now = 0
        """Items built by the last `missing` call (the rest came from the kept set)."""
        _ALL.add(self)

    def _items(self, items: dict[str, int], since: int | None) -> list[nostr_sdk.NegentropyItem]:
        """`items` as nostr-sdk items, built only for ids not kept from before; kept items
        older than `since` (out of every later window) are forgotten."""
        converted = self._converted
        if since is not None:
            stale = [event_id for event_id, (at, _) in converted.items() if at < since]
            for event_id in stale:
                del converted[event_id]
        result = []
        for event_id, created_at in items.items():
            kept = converted.get(event_id)
            if kept is None or kept[0] != created_at:
                item = nostr_sdk.NegentropyItem(
                    id=nostr_sdk.EventId.parse(event_id),
                    timestamp=nostr_sdk.Timestamp.from_secs(created_at),
                )
                if len(converted) >= MAX_CONVERTED_ITEMS:
                    converted.clear()
                converted[event_id] = (created_at, item)
                self.converted_now += 1
            else:
                item = kept[1]
            result.append(item)
        return result

    async def _open(self) -> nostr_sdk.Relay:
        if self._relay is not None:
            return self._relay
        _loop_needed()
        self._transport = _GuardedTransport(self.count)
        client = nostr_sdk.ClientBuilder().websocket_transport(self._transport).build()
        self._client = client
        relay_url = nostr_sdk.RelayUrl.parse(self.url)
        # one attempt: a reconciliation cut short falls back or is redone by the caller
        await client.add_relay(relay_url, opts=nostr_sdk.RelayOptions().reconnect(False))
        await client.try_connect(timedelta(seconds=OPEN_TIMEOUT_SECONDS))
        relay = await client.relay(relay_url)
        if relay is None:
            raise NegentropyFailed("error")
        self._relay = relay
        return relay

    async def missing(self, query: dict[str, Any], items: dict[str, int]) -> list[str]:
        """The ids the relay holds for `query` that are not among `items` (id → created_at).

        A window holding more than ITEMS_PER_SYNC of our items is reconciled in time slices
        of about that many, one after the other: relays bound the set one reconciliation
        may cover (rust-nostr's relay refuses some tens of thousands with `NEG-ERR
        "rate-limited: too many negentropy items"`, strfry a million by default)."""
        missing: list[str] = []
        self.converted_now = 0
        if "#p" not in query:  # a firehose window: every kept item older is out of it
            self._items({}, query.get("since"))
        for window, part in _slices(query, items, ITEMS_PER_SYNC):
            missing.extend(await self._missing(window, part))
        return missing

    async def _missing(self, query: dict[str, Any], items: dict[str, int]) -> list[str]:
        started = time.monotonic()
        self.count.refusal = None
        try:
            relay = await self._open()
            negentropy_items = self._items(items, None)
            options = (
                nostr_sdk.SyncOptions()
                .dry_run()
                .initial_timeout(timedelta(seconds=INITIAL_TIMEOUT_SECONDS))
            )
            async with asyncio.timeout(SYNC_TIMEOUT_SECONDS):
                summary = await relay.sync(
                    nostr_sdk.Filter.from_json(json.dumps(query)), negentropy_items, options
                )
        except NegentropyFailed:
            raise
        except TimeoutError as error:
            raise NegentropyFailed("timeout") from error
        except Exception as error:  # nostr-sdk raises its own error type, by message
            reason = self.count.refusal or _reason(error)
            log.info("relay %s: negentropy failed (%s: %s)", relay_label(self.url), reason,
                     type(error).__name__)
            log.debug("negentropy error text: %s", str(error)[:200])
            if reason == "error" and time.monotonic() - started >= INITIAL_TIMEOUT_SECONDS:
                reason = "timeout"
            raise NegentropyFailed(reason) from error
        return [event_id.to_hex() for event_id in summary.remote]

    async def close(self) -> None:
        client, self._client, self._relay = self._client, None, None
        transport, self._transport = self._transport, None
        if client is None:
            return
        try:
            with contextlib.suppress(Exception):
                await client.disconnect()
            if transport is not None:
                # nostr-sdk closes the socket from its own thread, after `disconnect` returns:
                # the loop stays set until it has
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(CLOSE_WAIT_SECONDS):
                        for closed in transport.closed:
                            await closed.wait()
        finally:
            _loop_released()
