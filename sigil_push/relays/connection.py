"""One websocket to one relay: reconnection, keep-alive, NIP-42 AUTH, and frame parsing.

The connection knows the Nostr wire protocol but nothing about keys or shards: it parses each
frame once and hands EVENT/EOSE/CLOSED to its handler (the bridge), which decides what to
subscribe to. Who signs AUTH answers is a parameter (`AuthSigner`, or an `AuthResponder` that
answers for several identities), so a per-user connection (NIP-46 delegated AUTH,
relays/inbox_connection.py) is the same class with `per_user=True`.

NIP-42 may come at any time: on connect, or only in answer to a refused REQ (khatru, strfry),
before or after the CLOSED that refuses it. Every REQ is remembered with the *AUTH epoch* it
was sent in (how many AUTH answers this socket had sent then), so an answer (EOSE, CLOSED, a
`restricted:` NOTICE) is judged against the identity the REQ was sent with: a refusal of a REQ
sent before our AUTH only means "authenticate and ask again", never "gated".

A connection shared by several users (delegated AUTH on a relay that accepts several keys per
connection) answers a challenge with one AUTH per user: its `AuthResponder` signs and sends them
itself (`send_auth`) and is told the relay's `OK` for each, which is how the bridge learns
whether a relay keeps one authenticated key per connection or several.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import hashlib
import json
import logging
import random
import re
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import aiohttp
from aiohttp import WSMsgType
from prometheus_client import Counter, Gauge

from sigil_push.nostr.event import Event
from sigil_push.nostr.keys import SecretKey
from sigil_push.nostr.nip42 import auth_event
from sigil_push.nostr.relay_message import (
    AuthChallenge,
    Closed,
    Eose,
    EventMessage,
    InvalidRelayMessage,
    Notice,
    Ok,
    parse_relay_message,
)
from sigil_push.observations import ObservationLog
from sigil_push.relays.budget import ConnectionBudget
from sigil_push.relays.labels import USER_RELAYS, series_label
from sigil_push.relays.nip11 import RelayLimits, fetch_limits
from sigil_push.relays.reader_socket import ReaderSocket, open_reader
from sigil_push.supervisor import BackgroundTasks, supervise
from sigil_push.telemetry.redaction import relay_label

log = logging.getLogger(__name__)
# websockets logs every frame, truncated, at DEBUG: REQ filters would put pieces of users'
# pubkeys in the service log. Its logger for our connections (signer links) never goes below
# INFO. The relay readers use aiohttp (relays/reader_socket.py), which logs no frames.
wire_log = logging.getLogger("sigil_push.relays.wire")
wire_log.setLevel(logging.INFO)

DEFAULT_MAX_INCOMING_BYTES = 4 * 1024 * 1024
STABLE_AFTER_SECONDS = 30.0
MAX_MALFORMED_PER_CONNECTION = 1000
# a relay may ask for AUTH at any time, but an AUTH storm gets at most this many answers per
# window on one connection (each answer is a signature, and for delegated AUTH a signer request)
AUTH_ANSWERS_PER_WINDOW = 4
AUTH_WINDOW_SECONDS = 60.0
# a REQ refused with auth-required before any challenge: how long to wait for the challenge
# before the refusal counts as final ("the relay never authenticates the key it needs")
AUTH_WAIT_SECONDS = 10.0
# a NIP-42 challenge is a short random string (relays send 16 to 64 characters); a longer one
# is refused unanswered: each answer carries it in a signed tag, and for delegated AUTH it goes
# to the user's remote signer
MAX_CHALLENGE_BYTES = 256
# REQs remembered per socket to attribute late answers (oldest forgotten first)
MAX_TRACKED_REQS = 4096
# AUTH events remembered per socket to match the relay's OK answers
MAX_TRACKED_AUTHS = 256
REFUSALS = ("auth-required", "restricted")
REFUSALS_AFTER_AUTH = ("error",)
"""Prefixes that refuse a REQ only once we are authenticated: rust-nostr's recipient-only inbox
answers a REQ for another key's gift wraps with `CLOSED "error: you cannot request another
user's gift wrap"` after our AUTH (before it, `auth-required:`). Before any AUTH, an `error:`
is a plain closed subscription, not a gate."""

CONNECTED = Gauge(
    "sigil_push_relay_connected_bool", "1 while the relay websocket is open", ["relay"]
)
CONNECTS = Counter(
    "sigil_push_relay_connects_total", "Connection attempts by outcome", ["relay", "outcome"]
)
NOTICES = Counter("sigil_push_relay_notices_total", "NOTICE frames received", ["relay"])
CLOSED_SUBS = Counter(
    "sigil_push_relay_closed_subscriptions_total", "CLOSED frames received", ["relay"]
)
GATED = Gauge(
    "sigil_push_relay_gated_bool",
    "1 while the relay refuses the bridge's subscriptions even after NIP-42 AUTH",
    ["relay"],
)
AUTHS = Counter("sigil_push_relay_auth_answers_total", "NIP-42 challenges answered", ["relay"])
MALFORMED = Counter(
    "sigil_push_relay_malformed_frames_total", "Frames that are not valid Nostr messages", ["relay"]
)
AUTH_THROTTLED = Counter(
    "sigil_push_relay_auth_throttled_total",
    "NIP-42 challenges left unanswered: a repeated challenge, or past the per-connection budget",
    ["relay"],
)
STALE_REFUSALS = Counter(
    "sigil_push_relay_pre_auth_refusals_total",
    "REQs refused before the bridge's AUTH (then re-sent after it), not counted as gated",
    ["relay"],
)
INVALID_DROPS = Counter(
    "sigil_push_relay_invalid_drops_total",
    "Sockets dropped for sending more invalid events than their budget",
    ["relay"],
)
BACKOFF = Gauge(
    "sigil_push_relay_backoff_seconds",
    "The wait before the next connection attempt (0 while connected or connecting)",
    ["relay"],
)
# frames dispatched before the reader gives the event loop a turn (aiohttp hands out buffered
# frames without suspending, so a flooding relay would otherwise run on for a whole buffer).
# 64, not 16: at each turn the committer takes what is queued, so 16 made commit batches of
# about 16-26 DMs and two to three times 43e4a27's thread hand-overs per DM (docs/performance.md,
# the DM path); a turn of 64 DMs is a few ms of the loop
FRAMES_PER_TURN = 64
AUTH_REFUSED = Counter(
    "sigil_push_relay_auth_refused_total",
    f"NIP-42 challenges refused unanswered: longer than {MAX_CHALLENGE_BYTES} bytes",
    ["relay"],
)
URL_METRICS = (
    CONNECTS, NOTICES, CLOSED_SUBS, AUTHS, MALFORMED, AUTH_THROTTLED, STALE_REFUSALS, AUTH_REFUSED
)


@dataclass(slots=True)
class SentReq:
    """A REQ as sent on the current socket: the AUTH epoch it went out in, and whether the
    relay has answered it (EOSE, CLOSED or a refusal NOTICE) yet."""

    epoch: int
    answered: bool = False
    refusal: str | None = None


class State(enum.Enum):
    IDLE = "idle"
    CONNECTING = "connecting"
    CONNECTED = "connected"
    BACKOFF = "backoff"
    STOPPED = "stopped"


class AuthUnavailable(Exception):
    """The signer cannot answer a challenge now (e.g. a remote NIP-46 signer is unreachable)."""


class AuthSigner(Protocol):
    """Signs the kind 22242 answer to a relay's NIP-42 challenge for one identity.

    Raises AuthUnavailable when it cannot; the connection then stays unauthenticated.
    """

    async def sign_auth(self, relay_url: str, challenge: str) -> Event: ...


@runtime_checkable
class AuthResponder(Protocol):
    """Answers a relay's challenge itself, possibly with several AUTH events (one per identity a
    shared per-user connection carries), through `RelayConnection.send_auth`."""

    async def answer_challenge(self, connection: RelayConnection, challenge: str) -> None: ...

    def on_auth_result(
        self, connection: RelayConnection, event_id: str, accepted: bool, reason: str
    ) -> None:
        """The relay's `OK` for an AUTH event this socket sent (`reason`: its prefix only)."""
        ...


class BridgeKeySigner:
    """AUTH as the bridge itself (its own key): enough for relays that only want *some* identity."""

    def __init__(self, key: SecretKey) -> None:
        self._key = key

    async def sign_auth(self, relay_url: str, challenge: str) -> Event:
        return auth_event(self._key, relay_url, challenge)


class ConnectionHandler(Protocol):
    """What a connection reports to; every callback is synchronous and must not block."""

    def on_open(self, connection: RelayConnection) -> None: ...

    def on_authenticated(self, connection: RelayConnection) -> None: ...

    def on_event(
        self, connection: RelayConnection, sub_id: str, raw: Any, received_ms: int
    ) -> None: ...

    def on_eose(self, connection: RelayConnection, sub_id: str) -> None: ...

    def on_closed(self, connection: RelayConnection, sub_id: str) -> None: ...

    def on_down(self, connection: RelayConnection) -> None: ...

    def on_gated(self, connection: RelayConnection) -> None:
        """`connection.gated_reason` changed: the relay refuses (or again accepts) after AUTH."""
        ...

    def on_auth_failed(self, connection: RelayConnection) -> None:
        """The signer could not answer the relay's challenge (AuthUnavailable)."""
        ...

    def congested(self, connection: RelayConnection) -> bool: ...

    async def drained(self, connection: RelayConnection) -> None: ...


_MACHINE_PREFIX = re.compile(r"[a-z]+(?:-[a-z]+)*")
"""NIP-01's machine-readable prefixes are lowercase words joined by hyphens (`auth-required`,
`rate-limited`, `restricted`, …)."""


def _prefix(message: Any) -> str:
    """The machine-readable prefix of a relay message (`auth-required`, `restricted`, …).

    Only this goes to logs and records: the rest is free text chosen by the relay. A head that
    is not such a prefix counts as none, so a relay cannot put other text (a subscribed
    pubkey's hex, say) into our logs by writing it before a colon.
    """
    if not isinstance(message, str):
        return ""
    head, sep, _ = message.partition(":")
    head = head.strip()
    return head if sep and len(head) <= 40 and _MACHINE_PREFIX.fullmatch(head) else ""


class RelayConnection:
    def __init__(
        self,
        url: str,
        handler: ConnectionHandler,
        signer: AuthSigner | AuthResponder,
        observations: ObservationLog,
        reconnect_min_seconds: float = 1.0,
        reconnect_max_seconds: float = 300.0,
        per_user: bool = False,
        max_frame_bytes: int = DEFAULT_MAX_INCOMING_BYTES,
        skip_event: Callable[[str, int], bool] | None = None,
        heartbeat_seconds: float = 30.0,
        open_timeout_seconds: float = 10.0,
    ) -> None:
        """`per_user`: a connection that authenticates as users (delegated AUTH) beside the
        shared connection to the same URL. The URL-labelled gauges and the `relay` records of
        the observation log describe the shared connection, so a per-user one leaves them alone,
        and a refusal `NOTICE` is also reported to its handler as `on_closed` of the REQ it
        answers. `signer` is an AuthSigner (one identity: sign, send, `on_authenticated`) or an
        AuthResponder, which answers each challenge itself (relays/inbox_connection.py).
        `skip_event`: sees each text frame (and when it arrived) before it is parsed; True
        means the handler took it as an EVENT without needing it parsed (a firehose's
        unaddressed DM, a copy of an event it has just verified). `heartbeat_seconds`,
        `open_timeout_seconds`: `bridge.relay_heartbeat_seconds`, `bridge.relay_open_timeout_seconds`."""
        self.url = url
        self.label = relay_label(url)
        """The URL as logs and records show it (no key-carrying path)."""
        self.series = series_label(url)
        """The `relay` label of its metrics: the URL's for a configured relay, USER_RELAYS
        (shared, never removed) for a user's. USER_RELAYS' gauges are the pool's sums over its
        user relays, so such a connection leaves the URL-labelled gauges alone."""
        self._own_gauges = not per_user and self.series != USER_RELAYS
        self._skip_event = skip_event
        self.per_user = per_user
        self._handler = handler
        self._signer = signer
        self.socket_generation = 0
        """Bumped on every open: an answer prepared for one socket is never sent on the next."""
        self._auths_sent: OrderedDict[str, None] = OrderedDict()
        self._observations = observations
        self._reconnect_min = reconnect_min_seconds
        self._reconnect_max = reconnect_max_seconds
        self._heartbeat = heartbeat_seconds
        self._open_timeout = open_timeout_seconds
        self.state = State.IDLE
        self.last_event_at: int | None = None
        self.limits: RelayLimits | None = None
        self.gated_reason: str | None = None
        self._ws: ReaderSocket | None = None
        self._task: asyncio.Task[None] | None = None
        self._max_frame_bytes = max_frame_bytes
        self.auth_epoch = 0
        self.challenged = False
        self._challenges: set[bytes] = set()
        """Digests of the challenges answered on this socket (never the relay's strings)."""
        self._reqs: OrderedDict[str, SentReq] = OrderedDict()
        self._auth_answers: deque[float] = deque()
        self._awaiting_challenge: ReaderSocket | None = None
        self._live_subs = 0
        self._malformed = 0
        self.budget = ConnectionBudget()
        """Invalid events and signature checks this socket may cost (relays/budget.py)."""
        self.invalid_drops = 0
        self.backoff_until: int | None = None
        """Wall-clock time of the next attempt while backing off (for /health)."""
        self._side_tasks = BackgroundTasks("relay-connection")
        if self._own_gauges:
            CONNECTED.labels(self.series).set(0)
            GATED.labels(self.series).set(0)
            BACKOFF.labels(self.series).set(0)
        if not per_user:
            INVALID_DROPS.labels(self.series)
        for outcome in ("opened", "failed"):
            CONNECTS.labels(self.series, outcome)
        NOTICES.labels(self.series)
        for metric in URL_METRICS[1:]:
            metric.labels(self.series)

    @property
    def connected(self) -> bool:
        return self.state is State.CONNECTED

    def start(self) -> None:
        self._task = supervise("relay-reader", self._run, name=f"relay {self.label}")

    async def stop(self) -> None:
        if self.state is State.CONNECTED and not self.per_user:
            self._observations.relay_state(self.label, "disconnected", "bridge stopped")
        self.state = State.STOPPED
        tasks = [t for t in (self._task, *self._side_tasks.running()) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if not self._own_gauges:
            return  # USER_RELAYS' series stay: other user relays share them
        # the relay left the plan: its labelled series go with it (URLs churn)
        for metric in (CONNECTED, GATED, BACKOFF, INVALID_DROPS):
            with contextlib.suppress(KeyError):
                metric.remove(self.series)
        for outcome in ("opened", "failed"):
            with contextlib.suppress(KeyError):
                CONNECTS.remove(self.series, outcome)
        for counter in URL_METRICS[1:]:
            with contextlib.suppress(KeyError):
                counter.remove(self.series)

    def req_epoch(self, sub_id: str) -> int | None:
        """The AUTH epoch a REQ still tracked on this socket was sent in (None if unknown)."""
        sent = self._reqs.get(sub_id)
        return None if sent is None else sent.epoch

    def refusal(self, sub_id: str) -> str | None:
        """The refusal prefix (`auth-required`, `restricted`) with which the relay answered a REQ
        still tracked on this socket, if it refused it for want of (the right) AUTH."""
        sent = self._reqs.get(sub_id)
        return None if sent is None else sent.refusal

    def counts_as_read(self, sub_id: str) -> bool:
        """Whether the relay's answer to `sub_id` reflects the identity it serves us as: the REQ
        went out after an AUTH, or no challenge ever came on this socket."""
        epoch = self.req_epoch(sub_id)
        return epoch is not None and (epoch > 0 or not self.challenged)

    async def send(self, message: list[Any]) -> bool:
        """Send one protocol message; False when not connected (it is resent on reconnect)."""
        ws = self._ws
        if ws is None or self.state is not State.CONNECTED:
            return False
        if message and message[0] == "REQ":
            self._track(str(message[1]))
        elif message and message[0] == "CLOSE":
            sent = self._reqs.get(str(message[1]))
            # an unanswered REQ stays tracked: its late refusal must still find it
            if sent is not None and sent.answered:
                del self._reqs[str(message[1])]
        try:
            await ws.send_str(json.dumps(message, separators=(",", ":")))
        except ConnectionError:
            # aiohttp: the socket is closing or gone
            return False
        return True

    async def _run(self) -> None:
        attempt = 0
        while self.state is not State.STOPPED:
            self.state = State.CONNECTING
            opened_at: float | None = None
            violated = False
            try:
                if self.limits is None:
                    self.limits = await fetch_limits(self.url)
                # our own receive limit: a relay's max_message_length only shrinks our REQs
                max_size = self._max_frame_bytes
                async with open_reader(
                    self.url, purpose="user" if self.per_user else "relay",
                    open_timeout=self._open_timeout,
                    heartbeat=self._heartbeat,
                    max_size=max_size,
                    user_agent="sigil-push",
                ) as ws:
                    opened_at = time.monotonic()
                    self._opened(ws)
                    code = await self._read(ws)
                self._down("disconnected", f"closed code={code or ws.close_code or 1006}")
            except (OSError, TimeoutError, aiohttp.ClientError) as exc:
                CONNECTS.labels(self.series, "failed").inc()
                self._down("error", f"connect failed: {type(exc).__name__}")
            except ProtocolViolation as exc:
                violated = True
                self._down("error", str(exc))
            # a socket dropped for breaking the protocol keeps the backoff growing, however
            # long it stayed open: a relay that answers EOSE and then floods is not "stable"
            if not violated and opened_at is not None and (
                self._live_subs or time.monotonic() - opened_at >= STABLE_AFTER_SECONDS
            ):
                attempt = 0
            delay = min(self._reconnect_max, self._reconnect_min * 2**attempt)
            attempt = min(attempt + 1, 30)
            self.state = State.BACKOFF
            delay *= random.uniform(0.5, 1.0)
            self.backoff_until = int(time.time() + delay)
            if self._own_gauges:
                BACKOFF.labels(self.series).set(delay)
            await asyncio.sleep(delay)
            self.backoff_until = None
            if self._own_gauges:
                BACKOFF.labels(self.series).set(0)

    async def send_auth(self, event: Event, generation: int) -> bool:
        """Send one AUTH answer on socket `generation` (False if that socket is gone): REQs sent
        after it go out in a new AUTH epoch, and the relay's OK for it reaches the responder."""
        if generation != self.socket_generation or self._ws is None:
            return False
        # REQs sent from here on go out after this AUTH (the relay handles frames in order)
        self.auth_epoch += 1
        self._auths_sent[event.id] = None
        while len(self._auths_sent) > MAX_TRACKED_AUTHS:
            self._auths_sent.popitem(last=False)
        if not await self.send(["AUTH", event.to_json()]):
            return False
        AUTHS.labels(self.series).inc()
        return True

    async def drop(self, generation: int) -> None:
        """Close socket `generation` if it is still the current one; the connection reconnects
        with its usual backoff (a per-user socket whose only identity cannot authenticate)."""
        ws = self._ws
        if ws is not None and generation == self.socket_generation:
            await ws.close()

    def _opened(self, ws: ReaderSocket) -> None:
        self._ws = ws
        self.socket_generation += 1
        self._auths_sent.clear()
        self.auth_epoch = 0
        self.challenged = False
        self._challenges.clear()
        self._reqs.clear()
        self._live_subs = 0
        self._malformed = 0
        self.budget.reset()
        self.state = State.CONNECTED
        CONNECTS.labels(self.series, "opened").inc()
        if self._own_gauges:
            CONNECTED.labels(self.series).set(1)
        if not self.per_user:
            self._observations.relay_state(self.label, "connected")
            log.info("relay %s connected", self.label)
        self._handler.on_open(self)

    def _down(self, state: str, detail: str) -> None:
        was_open = self._ws is not None
        self._ws = None
        if self.state is not State.STOPPED:
            self.state = State.BACKOFF
        if self.per_user:
            if was_open:
                self._handler.on_down(self)
            return
        if self._own_gauges:
            CONNECTED.labels(self.series).set(0)
        if was_open or state == "error":
            self._observations.relay_state(self.label, state, detail)
            log.info("relay %s %s: %s", self.label, state, detail)
        if was_open:
            self._handler.on_down(self)

    async def _read(self, ws: ReaderSocket) -> int | None:
        """Dispatch messages until the socket ends; the close code that ended it: the relay's,
        ours when we failed it (1009 too big, 1007 bad UTF-8, 1002 protocol error), 1006 when
        it ended without a close frame, None when we closed it (`drop`, `stop`).

        While the handler is congested nothing is read here; aiohttp then stops reading the
        socket once 128 KiB of messages wait, so a flooding relay is held at the TCP window."""
        handler = self._handler
        receive = ws.receive
        budget = self.budget
        turn = 0
        while True:
            message = await receive()
            kind = message.type
            if kind is WSMsgType.TEXT or kind is WSMsgType.BINARY:
                self._dispatch(message.data, time.time_ns() // 1_000_000)
                if budget.exceeded:
                    self._invalid_budget_spent()
                pause = budget.pause()
                if pause:
                    await asyncio.sleep(pause)
                turn += 1
                if turn >= FRAMES_PER_TURN:
                    turn = 0
                    await asyncio.sleep(0)
                if handler.congested(self):
                    await handler.drained(self)
            elif kind is WSMsgType.CLOSE:
                return int(message.data or 1005)
            elif kind is WSMsgType.ERROR:
                return ws.close_code or 1006
            elif kind is WSMsgType.CLOSING:
                return None
            else:  # CLOSED: the stream ended, no close frame came
                return 1006

    def _track(self, sub_id: str) -> None:
        self._reqs.pop(sub_id, None)
        self._reqs[sub_id] = SentReq(self.auth_epoch)
        while len(self._reqs) > MAX_TRACKED_REQS:
            self._reqs.popitem(last=False)

    def _dispatch(self, frame: str | bytes, received_ms: int) -> None:
        if (
            self._skip_event is not None
            and isinstance(frame, str)
            and self._skip_event(frame, received_ms)
        ):
            self.last_event_at = received_ms // 1000
            return
        if not isinstance(frame, str):
            self._malformed_frame()
            return
        try:
            message = parse_relay_message(frame)
        except InvalidRelayMessage:
            self._malformed_frame()
            return
        if isinstance(message, EventMessage):
            self.last_event_at = received_ms // 1000
            self._handler.on_event(self, message.sub_id, message.event, received_ms)
        elif isinstance(message, Eose):
            self._eose(message.sub_id)
        elif isinstance(message, Closed):
            self._closed(message.sub_id, message.message)
        elif isinstance(message, Notice):
            self._notice(message.message)
        elif isinstance(message, AuthChallenge):
            self._challenge(message.challenge)
        elif isinstance(message, Ok):
            self._ok(message)
        else:  # NEG-MSG, NEG-ERR: the reader opens no negentropy exchange
            self._malformed_frame()

    def _ok(self, message: Ok) -> None:
        """An OK for one of our AUTH events goes to the responder; other OKs mean nothing here."""
        if message.event_id not in self._auths_sent:
            return
        del self._auths_sent[message.event_id]
        if isinstance(self._signer, AuthResponder):
            self._signer.on_auth_result(
                self, message.event_id, message.accepted, _prefix(message.message)
            )

    def _invalid_budget_spent(self) -> None:
        """Too many invalid events on this socket: drop it (the reader backs off)."""
        self.invalid_drops += 1
        if not self.per_user:
            INVALID_DROPS.labels(self.series).inc()
        log.warning("relay %s sent too many invalid events: dropped, backing off", self.label)
        raise ProtocolViolation("protocol: too many invalid events")

    def _malformed_frame(self) -> None:
        MALFORMED.labels(self.series).inc()
        self._malformed += 1
        if self._malformed > MAX_MALFORMED_PER_CONNECTION:
            raise ProtocolViolation("protocol: too many malformed frames")

    def _eose(self, sub_id: str) -> None:
        self._live_subs += 1
        sent = self._reqs.get(sub_id)
        if sent is not None:
            sent.answered = True
            if sent.epoch > 0 and sent.epoch == self.auth_epoch and self.gated_reason is not None:
                self._set_gated(None)
        self._handler.on_eose(self, sub_id)

    def _closed(self, sub_id: str, message: Any) -> None:
        CLOSED_SUBS.labels(self.series).inc()
        reason = _prefix(message)
        log.info("relay %s closed a subscription (%s)", self.label, reason or "no reason")
        sent = self._reqs.get(sub_id)
        if reason in REFUSALS or (
            reason in REFUSALS_AFTER_AUTH and self._after_latest_auth(sent)
        ):
            if sent is not None:
                sent.refusal = reason
            self._refusal(reason, sent.epoch if sent is not None else None)
        self._handler.on_closed(self, sub_id)
        self._reqs.pop(sub_id, None)

    def _after_latest_auth(self, sent: SentReq | None) -> bool:
        return sent is not None and self.auth_epoch > 0 and sent.epoch == self.auth_epoch

    def _named_req(self, message: Any) -> str | None:
        """The unanswered REQ sent after our latest AUTH that a NOTICE names, if any (some
        relays refuse a REQ with a NOTICE quoting its subscription id)."""
        if self.auth_epoch == 0 or not isinstance(message, str):
            return None
        for sub_id, sent in self._reqs.items():
            if (
                not sent.answered
                and sent.epoch == self.auth_epoch
                and re.search(rf"(?<![\w.]){re.escape(sub_id)}(?![\w.])", message)
            ):
                return sub_id
        return None

    def _notice(self, message: Any) -> None:
        NOTICES.labels(self.series).inc()
        reason = _prefix(message)
        log.debug("relay %s notice (%s)", self.label, reason or "free text")
        if reason in REFUSALS:
            # a NOTICE names no subscription (nostr-relay refuses a REQ this way): it answers
            # the oldest REQ still unanswered, the relay handles them in order
            sub_id, pending = next(
                ((i, s) for i, s in self._reqs.items() if not s.answered), (None, None)
            )
            if pending is not None:
                pending.answered = True
                pending.refusal = reason
            self._refusal(reason, pending.epoch if pending is not None else self.auth_epoch)
            if self.per_user and sub_id is not None:
                # a per-user handler judges each user's REQ by its own answer
                self._handler.on_closed(self, sub_id)
                self._reqs.pop(sub_id, None)
            return
        named = self._named_req(message)
        if named is not None:
            # a NOTICE naming a REQ sent after our AUTH refuses it, whatever its prefix
            sent = self._reqs[named]
            sent.answered = True
            sent.refusal = reason or "notice"
            self._refusal(sent.refusal, sent.epoch)
            self._handler.on_closed(self, named)
            self._reqs.pop(named, None)

    def _refusal(self, reason: str, epoch: int | None) -> None:
        """A REQ sent in AUTH epoch `epoch` was refused for want of (the right) AUTH."""
        if epoch is not None and epoch < self.auth_epoch:
            # it answers a REQ from before our latest AUTH: that REQ has been sent again
            STALE_REFUSALS.labels(self.series).inc()
            return
        if self.auth_epoch > 0:
            self._set_gated(reason)
            return
        # not authenticated yet: the challenge may come with or after this refusal
        STALE_REFUSALS.labels(self.series).inc()
        ws = self._ws
        if ws is not None and self._awaiting_challenge is not ws:
            self._awaiting_challenge = ws
            self._spawn(self._await_challenge(ws, reason))

    async def _await_challenge(self, ws: ReaderSocket, reason: str) -> None:
        """A relay that refuses without ever challenging is gated: it never lets us read."""
        await asyncio.sleep(AUTH_WAIT_SECONDS)
        if ws is self._ws and self.auth_epoch == 0 and not self.challenged:
            self._set_gated(reason)

    def _challenge(self, challenge: str) -> None:
        """Answer each distinct challenge once, within the per-connection budget; one longer
        than MAX_CHALLENGE_BYTES is refused before anything is kept or signed."""
        if len(challenge) > MAX_CHALLENGE_BYTES or (
            len(encoded := challenge.encode("utf-8", "surrogatepass")) > MAX_CHALLENGE_BYTES
        ):
            AUTH_REFUSED.labels(self.series).inc()
            return
        self.challenged = True
        now = time.monotonic()
        while self._auth_answers and now - self._auth_answers[0] > AUTH_WINDOW_SECONDS:
            self._auth_answers.popleft()
        digest = hashlib.sha256(encoded).digest()
        if digest in self._challenges or len(self._auth_answers) >= AUTH_ANSWERS_PER_WINDOW:
            AUTH_THROTTLED.labels(self.series).inc()
            return
        if len(self._challenges) < MAX_TRACKED_REQS:
            self._challenges.add(digest)
        self._auth_answers.append(now)
        if isinstance(self._signer, AuthResponder):
            self._spawn(self._signer.answer_challenge(self, challenge))
        else:
            self._spawn(self._answer_auth(self._signer, challenge))

    def _set_gated(self, reason: str | None) -> None:
        if reason == self.gated_reason:
            return
        self.gated_reason = reason
        if self._own_gauges:
            GATED.labels(self.series).set(1 if reason else 0)
        if not self.per_user and reason:
            self._observations.relay_state(self.label, "auth_required", reason)
            log.warning("relay %s refuses the bridge even after AUTH (%s)", self.label, reason)
        self._handler.on_gated(self)

    async def _answer_auth(self, signer: AuthSigner, challenge: str) -> None:
        generation = self.socket_generation
        try:
            event = await signer.sign_auth(self.url, challenge)
        except AuthUnavailable as exc:
            log.warning("relay %s: cannot answer NIP-42 AUTH (%s)", self.label, type(exc).__name__)
            self._handler.on_auth_failed(self)
            if self.per_user:
                await self.drop(generation)
            return
        # a remote signer can take seconds: an answer whose socket is gone is not sent
        if await self.send_auth(event, generation):
            if not self.per_user:
                log.info("relay %s: answered NIP-42 AUTH", self.label)
            self._handler.on_authenticated(self)

    def _spawn(self, coroutine: Coroutine[Any, Any, object]) -> None:
        self._side_tasks.spawn(coroutine)


class ProtocolViolation(Exception):
    """The relay broke the protocol badly enough that the connection is dropped."""
