"""APNs through aioapns: token (.p8) auth over a pool of HTTP/2 connections.

aioapns has no host option, so `endpoint` (tests, gateways) is honoured by a protocol subclass
carrying the host and port, and `ca_file` is added to the trusted roots. aioapns waits forever
for an answer that lacks an `apns-id` header, so every send runs under a timeout.

`apns_client` builds the client exactly as the sender uses it, so bench/push.py's bare loop
measures the same client (same protocol class, same pool) without the delivery pipeline.
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
import ssl
import time
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit
from uuid import uuid4

import orjson
from aioapns import APNs, NotificationRequest, PushType
from aioapns.common import NotificationResult
from aioapns.connection import (
    APNsDevelopmentClientProtocol,
    APNsProductionClientProtocol,
    APNsTLSClientProtocol,
)
from aioapns.exceptions import ConnectionClosed, ConnectionError, MaxAttemptsExceeded
from cryptography.hazmat.primitives.serialization import load_pem_private_key
from h2.connection import H2Connection
from hpack import Encoder, HeaderTuple
from hpack.hpack import encode_integer

from sigil_push.config import ConfigError
from sigil_push.push.base import Outcome, Status, WakeupMessage
from sigil_push.push.provider import Provider
from sigil_push.store.records import Device

APS: dict[str, Any] = {
    "alert": {"title": "Sigil", "body": "New message"},
    "mutable-content": 1,
    "sound": "default",
}


def apns_body(data: dict[str, str]) -> dict[str, Any]:
    """The APNs JSON body: the fixed alert plus the mode's extras (never `type`)."""
    body: dict[str, Any] = {"aps": APS, **data}
    body.pop("type", None)
    return body


def apns_json(body: dict[str, Any]) -> bytes:
    """An APNs body as it goes on the wire: compact JSON by orjson (the connection below
    encodes with this instead of aioapns' `json.dumps`, whose escaping scan of a sealed
    payload's 3 KB cost about as much as the NIP-44 encryption itself)."""
    return orjson.dumps(body)


def apns_size(data: dict[str, str]) -> int:
    return len(apns_json(apns_body(data)))


PRIORITY_IMMEDIATE = 10
_COUNTER_MASK = (1 << 48) - 1
_APS_BYTES = apns_size({})
"""The body with no extras: the fixed alert alone."""
_JSON_BYTES_PER_CHAR = 6
"""The most one character can take in the body: `\\u001f` (escapes) or 4 UTF-8 bytes."""
_ENTRY_OVERHEAD = 6
"""`,"k":"v"` around one extra key and value: comma, four quotes, colon (compact JSON)."""

DEAD_TOKEN_REASONS = frozenset({"BadDeviceToken", "Unregistered", "DeviceTokenNotForTopic"})
"""The token will never work for this app again: forget the device."""

RETRY_STATUSES = frozenset({"403", "429", "500", "503"})
"""403 is a provider-token problem (expired or bad key): fixable by the operator, so retried."""


_ACCEPTED = Outcome(Status.ACCEPTED)
"""Nearly every answer: one immutable value for all of them."""


def _outcome(result: NotificationResult) -> Outcome:
    if result.is_successful:
        return _ACCEPTED
    reason = result.description or f"status {result.status}"
    if result.status == "410" or reason in DEAD_TOKEN_REASONS:
        return Outcome(Status.UNREGISTERED, detail=reason)
    if result.status in RETRY_STATUSES:
        return Outcome(Status.RETRY, detail=reason)
    return Outcome(Status.REJECTED, detail=reason)


async def _ignore_error(request: NotificationRequest, result: NotificationResult) -> None:
    """aioapns logs failures itself unless given this; the delivery loop logs them instead."""


def _ssl_context(ca_file: Path | None) -> ssl.SSLContext:
    context = ssl.create_default_context()
    if ca_file is not None:
        context.load_verify_locations(cafile=str(ca_file))
    context.set_alpn_protocols(["h2"])
    return context


_UNINDEXED_NAMES = {
    b":path": b"\x04",  # the static table's name 4
    b"apns-id": b"\x00\x07apns-id",
    b"apns-collapse-id": b"\x00\x10apns-collapse-id",
    b"apns-expiration": b"\x00\x0fapns-expiration",
}
"""The headers whose value is new in (nearly) every push, as the start of an HPACK "literal
without indexing" (RFC 7541 6.2.2) with the name as the static index or the literal name."""


class _HeaderEncoder(Encoder):
    """HPACK for APNs requests: what changes per push is sent as a plain literal.

    h2's encoder adds every header it has not seen to the dynamic table and Huffman-codes it
    in Python, byte by byte. A push's path (the device token), apns-id, collapse id and
    expiration are new almost every time, so each push added three or four entries that
    pushed the constant headers out of the 4 KiB table (which then came back as literals
    too), and Huffman coding them, with the provider token that h2 never indexes, was most of
    a push's HPACK time. Here those values go out as literals without indexing and without
    Huffman coding (a few more bytes on the wire, no table churn); the constant headers are
    indexed as before, and a never-indexed header (h2 marks `authorization` so) stays never
    indexed, just not Huffman-coded, since it is sent in full with every push anyway.
    """

    def encode(self, headers: Any, huffman: bool = True) -> bytes:
        block = []
        if self.header_table.resized:
            block.append(self._encode_table_size_change())
            self.header_table.resized = False
        for header in headers:
            name, value = header[0], header[1]
            if not isinstance(name, bytes):
                name, value = str(name).encode(), str(value).encode()
            prefix = _UNINDEXED_NAMES.get(name)
            if prefix is not None:
                block += (prefix, bytes(encode_integer(len(value), 7)), value)
            elif isinstance(header, HeaderTuple) and not header.indexable:
                block.append(self.add((name, value), True, False))
            else:
                block.append(self.add((name, value), False, huffman))
        return b"".join(block)


_PRUNE_SLACK = 64
"""Streams held beyond twice the open ones before closed ones are dropped (see below)."""


class _Http2Connection(H2Connection):
    """h2's client connection with the header encoder above, and without a walk of every
    stream on every push.

    Before opening a stream h2 checks the peer's MAX_CONCURRENT_STREAMS against the number of
    open outbound streams, which it counts by walking every stream it holds (hundreds per
    APNs connection under load), dropping the closed ones as it goes. Here the number of
    streams held stands in for the count while it is below the peer's limit: it is an upper
    bound on the open streams, so the check passes exactly when h2's would. The walk runs
    when the bound reaches the limit (then the exact count decides, as in h2) or twice the
    open streams the last walk found (plus some slack), so closed streams are still dropped,
    in batches, and a push pays for about two streams of walking instead of all of them.
    """

    MAX_CLOSED_STREAMS = 1024
    """How many closed streams h2 remembers (to tell a late frame on a reset stream from one
    on a stream that ended cleanly). h2 keeps 65,536 per connection, about 6 MB once a busy
    APNs connection has made that many pushes, and each pooled connection fills its own; an
    APNs answer arrives within its stream's life, so the last thousand are plenty."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = _HeaderEncoder()
        self._walk_at = 0

    @property
    def open_outbound_streams(self) -> int:
        """Exact when it reaches the peer's limit; below it, the streams held (see above)."""
        held = len(self.streams)
        if held < self._walk_at and held < self.remote_settings.max_concurrent_streams:
            return held
        count: int = super().open_outbound_streams
        self._walk_at = 2 * count + _PRUNE_SLACK
        return count


class _FlushOncePerTick(APNsTLSClientProtocol):
    """aioapns writes to the socket after every request; this writes once per event-loop tick.

    Under load many requests are framed in the same tick, so they share one TLS record and one
    system call instead of one each, which is most of a push's cost on a busy host. Mixed in
    before the protocol class aioapns would pick (production or sandbox). It also gives the
    connection the HTTP/2 state above (no connection exists yet: it is made at connect).
    """

    _flush_pending = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.conn = _Http2Connection()

    async def send_notification(self, request: NotificationRequest) -> NotificationResult:
        """aioapns' send with the body encoded by `apns_json` (orjson) instead of `json.dumps`:
        the same request on the same stream, headers in the same order, the answer matched by
        apns-id as aioapns matches it."""
        stream_id = await self.free_channels.acquire()
        headers = [
            (":method", "POST"),
            (":scheme", "https"),
            (":path", f"/3/device/{request.device_token}"),
            ("host", self.APNS_SERVER),
            ("apns-id", request.notification_id),
            ("apns-topic", request.apns_topic or self.apns_topic),
        ]
        if request.time_to_live is not None:
            headers.append(("apns-expiration", str(int(time.time()) + request.time_to_live)))
        if request.priority is not None:
            headers.append(("apns-priority", str(request.priority)))
        if request.collapse_key is not None:
            headers.append(("apns-collapse-id", request.collapse_key))
        if request.push_type is not None:
            headers.append(("apns-push-type", request.push_type.value))
        if self.auth_provider:
            headers.append(("authorization", self.auth_provider.get_header()))
        self.conn.send_headers(stream_id=stream_id, headers=headers)
        self.conn.send_data(stream_id=stream_id, data=apns_json(request.message), end_stream=True)
        self.flush()
        answer: asyncio.Future[NotificationResult] = asyncio.Future()
        self.requests[request.notification_id] = answer
        self.request_streams[stream_id] = request.notification_id
        return await answer

    def on_stream_ended(self, stream_id: int) -> None:
        """Forget the finished stream's request. aioapns drops a stream's apns-id only when an
        error body names a reason, so every accepted push left its (stream id, apns-id) pair
        in `request_streams` for the connection's whole life: about 150 bytes a push, tens of
        megabytes a day on a busy connection that never idles out. An error answer without a
        reason (its status kept in `request_statuses`) is settled here with that status
        instead of waiting for the send timeout."""
        notification_id = self.request_streams.pop(stream_id, None)
        if notification_id is not None:
            status = self.request_statuses.pop(notification_id, None)
            answer = self.requests.get(notification_id)
            if answer is not None and status is not None:
                del self.requests[notification_id]
                if not answer.done():
                    answer.set_result(NotificationResult(notification_id, status))
        super().on_stream_ended(stream_id)

    def flush(self) -> None:
        if not self._flush_pending:
            self._flush_pending = True
            self.loop.call_soon(self._flush_now)

    def _flush_now(self) -> None:
        self._flush_pending = False
        if self.transport is not None and not self.transport.is_closing():
            super().flush()


class NotificationIds:
    """apns-id values (Apple wants the 8-4-4-4-12 hex form of a UUID), one per push.

    A random prefix per client and a 48-bit counter from a random start: unique for this
    client's life, and one string format per push instead of a urandom call and a UUID object.
    """

    def __init__(self) -> None:
        self._prefix = str(uuid4())[:24]
        self._counter = itertools.count(secrets.randbits(48))

    def next(self) -> str:
        return f"{self._prefix}{next(self._counter) & _COUNTER_MASK:012x}"


class ApnsTable(Protocol):
    """What the sender reads of the `[apns]` table (`apns.ApnsConfig`), declared here so the
    sender imports nothing of its declaration."""

    @property
    def team_id(self) -> str: ...
    @property
    def key_id(self) -> str: ...
    @property
    def topic(self) -> str: ...
    @property
    def environment(self) -> str: ...
    @property
    def endpoint(self) -> str: ...


def apns_client(config: ApnsTable, key: str, ca_file: Path | None) -> APNs:
    """The aioapns client the sender sends with: `key` is the .p8 PEM text (already checked)."""
    sandbox = config.environment == "sandbox"
    client = APNs(
        key=key,
        key_id=config.key_id,
        team_id=config.team_id,
        topic=config.topic,
        use_sandbox=sandbox,
        ssl_context=_ssl_context(ca_file),
        max_connection_attempts=2,
        err_func=_ignore_error,
    )
    base = APNsDevelopmentClientProtocol if sandbox else APNsProductionClientProtocol
    attributes: dict[str, object] = {}
    if config.endpoint:
        parts = urlsplit(config.endpoint)
        if parts.scheme != "https" or not parts.hostname:
            raise ConfigError("apns.endpoint", "must be an https:// URL (APNs is HTTP/2 over TLS)")
        attributes = {"APNS_SERVER": parts.hostname, "APNS_PORT": parts.port or 443}
    client.pool.protocol_class = type("ApnsProtocol", (_FlushOncePerTick, base), attributes)
    return client


class ApnsSender:

    def __init__(self, client: APNs, timeout_seconds: float, declared: Provider[Any]) -> None:
        self.platform = declared.platform
        self.provider = declared.name
        self.max_concurrency = declared.policy.max_concurrency
        self._max_payload = declared.policy.max_payload_bytes
        self._client = client
        self._timeout = timeout_seconds
        self._ids = NotificationIds()
        # the send timeout: one deadline per send in start order (the timeout is fixed and the
        # loop clock monotonic, so that is deadline order too) and one timer for the earliest,
        # instead of a timer armed and cancelled per push
        self._deadlines: dict[asyncio.Task[Any], float] = {}
        self._timed_out: set[asyncio.Task[Any]] = set()
        self._timer: asyncio.TimerHandle | None = None

    @classmethod
    async def create(
        cls,
        config: ApnsTable,
        key_file: Path,
        ca_file: Path | None,
        timeout_seconds: float,
        declared: Provider[Any],
    ) -> ApnsSender:
        """`declared`: the provider's declaration, whose name, platform and limits the sender
        takes (handed over, so the sender imports nothing back)."""
        key = await asyncio.to_thread(key_file.read_text, encoding="utf-8")
        try:
            load_pem_private_key(key.encode(), password=None)
        except (ValueError, TypeError):
            raise ConfigError("apns.key_file", "is not a PEM private key (.p8)") from None
        return cls(apns_client(config, key, ca_file), timeout_seconds, declared)

    def fits(self, data: dict[str, str]) -> bool:
        """Within APNs' limit. An upper bound on the size decides most bodies (an id and a
        relay URL) without serialising them; only a body near the limit is measured."""
        bound = _APS_BYTES
        for key, value in data.items():
            if key != "type":
                bound += _ENTRY_OVERHEAD + _JSON_BYTES_PER_CHAR * (len(key) + len(value))
        return bound <= self._max_payload or apns_size(data) <= self._max_payload

    async def send(self, message: WakeupMessage, device: Device) -> Outcome:
        request = NotificationRequest(
            device.token, apns_body(message.data), self._ids.next(), message.ttl_seconds,
            PRIORITY_IMMEDIATE, message.collapse_id, PushType.ALERT,
        )
        task = asyncio.current_task()
        assert task is not None
        self._deadlines[task] = deadline = task.get_loop().time() + self._timeout
        if self._timer is None:
            self._timer = task.get_loop().call_at(deadline, self._expire)
        try:
            result = await self._client.send_notification(request)
        except asyncio.CancelledError:
            if task not in self._timed_out:
                raise
            self._timed_out.discard(task)
            if task.uncancel():  # also cancelled by someone else: that cancellation wins
                raise
            self._forget(request.notification_id)
            return Outcome(Status.RETRY, detail="timeout")
        except (ConnectionError, ConnectionClosed, MaxAttemptsExceeded, OSError):
            return Outcome(Status.RETRY, detail="connection failed")
        finally:
            self._deadlines.pop(task, None)
        return _outcome(result)

    def _expire(self) -> None:
        """Cancel the sends whose deadline has come, and arm the timer for the next one."""
        self._timer = None
        loop = asyncio.get_running_loop()
        now = loop.time()
        expired = []
        for task, deadline in self._deadlines.items():
            if deadline > now:
                self._timer = loop.call_at(deadline, self._expire)
                break
            expired.append(task)
        for task in expired:
            del self._deadlines[task]
            self._timed_out.add(task)
            task.cancel()

    def _forget(self, notification_id: str) -> None:
        """Drop a timed-out request's pending future, which aioapns would keep (and later fail
        with InvalidStateError when the connection closes)."""
        for connection in self._client.pool.connections:
            connection.requests.pop(notification_id, None)

    async def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._client.pool.close()
