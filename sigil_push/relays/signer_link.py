"""The websocket to a NIP-46 signer's relay, shared by every session whose signer listens there.

A few subscriptions carry the answers for all of our client keys on that relay, each for a
chunk of keys: adding a key re-requests only its chunk, so a burst of new sessions does not make
the relay replay every recent answer for every key each time. Answers are matched to pending
requests by their JSON-RPC id and must come from the signer the request was addressed to. A
dropped connection fails what is pending (the caller decides about retrying) and the next
request reconnects.

Bunker relays are user-chosen addresses: every link is opened through the outbound guard
(sigil_push/outbound.py), `SignerLinks` caps links in total (and the guard per host), and a
link whose last client key leaves is closed, so user churn never accumulates sockets. When a key
leaves, its chunk's subscription is replaced by the smaller filter, or CLOSEd once empty, so a
shared bunker relay never accumulates our subscriptions.

What a bunker relay sends is bounded like a relay reader's (relays/budget.py), cheap refusals
first: an EVENT must arrive on one of our subscriptions, name one of that chunk's keys in `p`,
come from a signer we are waiting on, and not repeat an event already checked, before its
signature is verified; failed checks spend the same invalid-event budget as a relay reader's.
And a link has a frame budget (`FrameBudget`) that grows with what we asked for: requests
published and keys subscribed. A link that exhausts either is closed, what it had pending
fails (`SignerUnreachable`: the sessions retry with their pauses), and it is not reopened
before a backoff that doubles with each drop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from prometheus_client import Counter
from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidURI

from sigil_push.nostr.event import Event, InvalidEvent
from sigil_push.nostr.keys import SecretKey
from sigil_push.nostr.kinds import NOSTR_CONNECT
from sigil_push.nostr.nip46 import Response, SignerError, read_response
from sigil_push.nostr.relay_message import EventMessage, InvalidRelayMessage, relay_message
from sigil_push.outbound import GuardedSocket, open_relay_socket
from sigil_push.relays.budget import ConnectionBudget
from sigil_push.relays.connection import wire_log
from sigil_push.supervisor import supervise
from sigil_push.telemetry.memory_gauges import track

log = logging.getLogger(__name__)

SUBSCRIPTION_PREFIX = "nip46-"
KEYS_PER_SUBSCRIPTION = 100
OPEN_TIMEOUT_SECONDS = 10.0
LOOKBACK_SECONDS = 60
MAX_FRAME_BYTES = 256 * 1024
MAX_IN_FLIGHT = 200
"""Requests published on one signer relay and not yet answered; the rest queue, and each one's
timeout starts when it is sent. A cold start of a relay shared by many users (one challenge,
one AUTH per user) would otherwise publish a thousand requests at once, and a busy bunker relay
or signer would time most of them out (measured: 427 of 1,000 in bench/gated.py)."""
MAX_LINKS = 500
"""Bunker relay sockets in total; with MAX_SIGNER_RELAYS per bunker and the guard's per-host cap
this bounds what registrations can make the server hold open."""
MAX_LINKS_PER_NPUB = 5
"""Links one npub's session may have opened (a bunker names at most MAX_SIGNER_RELAYS relays):
however many sessions come and go, one npub never holds more of the total."""

BASE_FRAMES = 100.0
"""Frames a link may receive beyond what its requests explain (NOTICEs, AUTH, an odd extra)."""
FRAMES_PER_REQUEST = 4.0
"""An answer and the relay's OK, twice over (a signer may answer on each of its relays)."""
FRAMES_PER_KEY = 12.0
"""A subscription replays the last LOOKBACK_SECONDS of answers to its keys: at most a connect,
a get_public_key and SIGNS_PER_MINUTE_PER_USER signatures each, plus its EOSE."""
FRAMES_PER_SECOND = 2.0
"""The budget's slow refill, for a link that keeps its sockets open for days."""
SEEN_IDS = 4096
"""Event ids already checked on a link: a replayed answer is dropped without verifying again."""
BACKOFF_FIRST_SECONDS = 30.0
BACKOFF_MAX_SECONDS = 1800.0

FRAMES = Counter(
    "sigil_push_signer_link_frames_total",
    "Frames from signer relays by outcome (answer, ignored, garbage, foreign, unmatched,"
    " replayed, forged, over_budget)",
    ["outcome"],
)
FRAME_OUTCOMES = ("answer", "ignored", "garbage", "foreign", "unmatched", "replayed", "forged",
                  "over_budget")
LINKS = Counter(
    "sigil_push_signer_links_total",
    "Signer relay links opened, closed idle, dropped after a failed connect, refused at a cap,"
    " dropped for flooding or for invalid events, or refused while backing off",
    ["outcome"],
)
LINK_OUTCOMES = ("opened", "closed_idle", "failed", "refused", "dropped_flood", "dropped_invalid",
                 "backing_off")
for _outcome in FRAME_OUTCOMES:
    FRAMES.labels(_outcome)
for _outcome in LINK_OUTCOMES:
    LINKS.labels(_outcome)


class FrameBudget:
    """Frames one link's socket may still receive: BASE_FRAMES to start, more for each request
    published and each key subscribed, a slow refill, and never more than what the link's
    current load explains (so credit does not pile up over a long life). A relay that streams
    far more frames than we have asked for runs it dry within a bounded number of frames."""

    __slots__ = ("_stamp", "_tokens")

    def __init__(self) -> None:
        self._tokens = BASE_FRAMES
        self._stamp = time.monotonic()

    def grant(self, frames: float, ceiling: float) -> None:
        self._tokens = min(self._tokens + frames, max(ceiling, BASE_FRAMES))

    def spend(self, ceiling: float) -> bool:
        """One frame received; False once the budget is exhausted."""
        now = time.monotonic()
        refill = (now - self._stamp) * FRAMES_PER_SECOND
        self._stamp = now
        self._tokens = min(self._tokens + refill, max(ceiling, self._tokens)) - 1.0
        return self._tokens >= 0.0


class SignerUnreachable(Exception):
    """The signer's relay could not be reached or dropped the connection mid-request."""


class SignerRelayLink:
    def __init__(self, url: str, on_failed: Callable[[SignerRelayLink], None] | None = None) -> None:
        """`on_failed`: told when a connection attempt fails, so the owner can drop the link
        (a link that never connected is not "idle": its sessions keep their keys on it)."""
        self.url = url
        self._on_failed = on_failed
        self._clients: dict[str, SecretKey] = {}
        self._chunks: list[list[str]] = []
        self._pending: dict[str, tuple[str, asyncio.Future[Response]]] = {}
        self._opener: GuardedSocket | None = None
        self._socket: ClientConnection | None = None
        self._reader: asyncio.Task[None] | None = None
        self._connecting = asyncio.Lock()
        self._in_flight = asyncio.Semaphore(MAX_IN_FLIGHT)
        self._frames = FrameBudget()
        self._invalid = ConnectionBudget()
        self._seen: dict[str, None] = {}
        """Ids of events verified on this link, oldest first (at most SEEN_IDS)."""
        self._closed_for: str | None = None
        """Why the reader closed the socket (a budget ran dry), for the pending requests."""
        self._backoff = 0.0
        self._reopen_at = 0.0

    async def request(self, client: SecretKey, request_id: str, message: Event, timeout: float) -> Response:
        """Publish `message` and wait for the answer to `request_id`."""
        # the key is registered before connecting, so a link is never "unused" while a
        # session is still opening it (SignerLinks closes links without clients)
        new_key = client.public_key_hex not in self._clients
        if new_key:
            self._clients[client.public_key_hex] = client
            if not self._chunks or len(self._chunks[-1]) >= KEYS_PER_SUBSCRIPTION:
                self._chunks.append([])
            self._chunks[-1].append(client.public_key_hex)
        async with self._in_flight:
            socket, opened = await self._ensure_open()
            if new_key and not opened and client.public_key_hex in self._clients:
                # a socket opened just now already asked for every chunk, this key's included
                chunk = next(
                    i for i, keys in enumerate(self._chunks) if client.public_key_hex in keys
                )
                await self._subscribe(socket, chunk)
            future: asyncio.Future[Response] = asyncio.get_running_loop().create_future()
            signer = next(iter(message.tag_values("p")), "")
            self._pending[request_id] = (signer, future)
            self._frames.grant(FRAMES_PER_REQUEST, self._frame_ceiling())
            try:
                await socket.send(json.dumps(["EVENT", message.to_json()]))
                # asyncio.timeout, not wait_for: on Python 3.11 wait_for returns the answer
                # when a cancellation lands as it arrives, and the session's loop goes on
                async with asyncio.timeout(timeout):
                    return await future
            except TimeoutError:
                # before OSError, of which TimeoutError is a subclass
                raise SignerUnreachable("the signer did not answer in time") from None
            except (ConnectionClosed, OSError) as exc:
                raise SignerUnreachable(
                    f"connection to the signer relay broke: {type(exc).__name__}"
                ) from None
            finally:
                self._pending.pop(request_id, None)

    @property
    def idle(self) -> bool:
        """No session uses the link (a request still pending belongs to a session that left)."""
        return not self._clients

    def subscription_count(self) -> int:
        return sum(1 for chunk in self._chunks if chunk)

    async def forget(self, client_pubkey: str) -> None:
        """Stop routing answers to this key and shrink (or CLOSE) its chunk's subscription now."""
        if self._clients.pop(client_pubkey, None) is None:
            return
        for index, chunk in enumerate(self._chunks):
            if client_pubkey not in chunk:
                continue
            chunk.remove(client_pubkey)
            socket = self._socket
            if socket is None or self._reader is None or self._reader.done():
                break
            with contextlib.suppress(ConnectionClosed, OSError):
                if chunk:
                    await self._subscribe(socket, index)
                else:
                    await socket.send(json.dumps(["CLOSE", f"{SUBSCRIPTION_PREFIX}{index}"]))
            break
        while self._chunks and not self._chunks[-1]:
            self._chunks.pop()

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        if self._opener is not None:
            with contextlib.suppress(ConnectionClosed, OSError):
                await self._opener.__aexit__(None, None, None)
        self._opener = None
        self._socket = None

    def _frame_ceiling(self) -> float:
        """The most frame credit the link's current load explains."""
        return (BASE_FRAMES + FRAMES_PER_REQUEST * len(self._pending)
                + FRAMES_PER_KEY * len(self._clients))

    async def _ensure_open(self) -> tuple[ClientConnection, bool]:
        """The open socket, and whether it was opened by this call (then every chunk has just
        been subscribed). SignerUnreachable while the link backs off after a drop."""
        async with self._connecting:
            if self._socket is not None and self._reader is not None and not self._reader.done():
                return self._socket, False
            if self._opener is not None:
                await self.close()
            if time.monotonic() < self._reopen_at:
                LINKS.labels("backing_off").inc()
                raise SignerUnreachable("the signer relay flooded the link; backing off")
            self._frames = FrameBudget()
            self._invalid.reset()
            self._closed_for = None
            opener = open_relay_socket(
                self.url, purpose="signer", max_size=MAX_FRAME_BYTES,
                open_timeout=OPEN_TIMEOUT_SECONDS, logger=wire_log,
            )
            try:
                self._socket = await opener.__aenter__()
                self._opener = opener
            except (OSError, TimeoutError, InvalidHandshake, InvalidURI) as exc:
                if self._on_failed is not None:
                    self._on_failed(self)
                raise SignerUnreachable(f"cannot connect to the signer relay: {type(exc).__name__}") from None
            self._reader = supervise("signer-link", partial(self._read, self._socket))
            for index, chunk in enumerate(self._chunks):
                if chunk:
                    await self._subscribe(self._socket, index)
            return self._socket, True

    async def _subscribe(self, socket: ClientConnection, index: int) -> None:
        """(Re)place one chunk's subscription (NIP-01: a REQ replaces the one with its id).

        The look-back tolerates a signer whose clock runs behind ours.
        """
        chunk = self._chunks[index]
        subscription = {
            "kinds": [NOSTR_CONNECT],
            "#p": chunk,
            "since": int(time.time()) - LOOKBACK_SECONDS,
        }
        self._frames.grant(FRAMES_PER_KEY * len(chunk), self._frame_ceiling())
        await socket.send(json.dumps(["REQ", f"{SUBSCRIPTION_PREFIX}{index}", subscription]))

    async def _read(self, socket: ClientConnection) -> None:
        try:
            async for frame in socket:
                if not self._frames.spend(self._frame_ceiling()):
                    FRAMES.labels("over_budget").inc()
                    self._drop("dropped_flood", "the signer relay sent far more than was asked")
                    break
                self._handle(frame)
                if self._invalid.exceeded:
                    self._drop("dropped_invalid", "the signer relay sent too many invalid events")
                    break
        except ConnectionClosed:
            pass
        finally:
            why = self._closed_for or "the signer relay closed the connection"
            for _, future in self._pending.values():
                if not future.done():
                    future.set_exception(SignerUnreachable(why))
        if self._closed_for is not None:
            # no closing handshake: that would read (and discard) whatever the relay still
            # streams until its own close frame came through, up to the close timeout
            socket.transport.abort()

    def _drop(self, outcome: str, why: str) -> None:
        """Close the socket for `why` and keep the link from reopening before its backoff."""
        LINKS.labels(outcome).inc()
        log.warning("signer link dropped: %s", why)
        self._closed_for = why
        self._backoff = min(BACKOFF_MAX_SECONDS, self._backoff * 2 or BACKOFF_FIRST_SECONDS)
        self._reopen_at = time.monotonic() + self._backoff

    def _subscribed_keys(self, subscription: Any) -> list[str] | None:
        """The keys of the chunk a subscription id names, if it is one of ours."""
        if not isinstance(subscription, str) or not subscription.startswith(SUBSCRIPTION_PREFIX):
            return None
        index = subscription[len(SUBSCRIPTION_PREFIX):]
        if not index.isdecimal() or int(index) >= len(self._chunks):
            return None
        return self._chunks[int(index)]

    def _handle(self, frame: str | bytes) -> None:
        """One frame: the cheap refusals (our subscription, its key in `p`, a signer we wait
        on, an id not checked before) come before the signature check and the decryption."""
        try:
            message = relay_message(json.loads(frame))
        except InvalidRelayMessage:
            message = None
        except (ValueError, RecursionError):
            FRAMES.labels("garbage").inc()
            self._invalid.invalid()
            return
        if not isinstance(message, EventMessage):
            FRAMES.labels("ignored").inc()
            return
        try:
            event = Event.from_json(message.event)
        except (ValueError, InvalidEvent):
            FRAMES.labels("garbage").inc()
            self._invalid.invalid()
            return
        keys = self._subscribed_keys(message.sub_id)
        client = None if keys is None or event.kind != NOSTR_CONNECT else next(
            (self._clients[p] for p in event.tag_values("p") if p in keys and p in self._clients),
            None,
        )
        if client is None:
            FRAMES.labels("unmatched").inc()
            self._invalid.invalid()
            return
        if all(signer != event.pubkey for signer, _ in self._pending.values()):
            FRAMES.labels("foreign").inc()
            return
        if event.id in self._seen:
            FRAMES.labels("replayed").inc()
            return
        try:
            event.verify()
        except InvalidEvent:
            FRAMES.labels("forged").inc()
            self._invalid.invalid()
            return
        self._seen[event.id] = None
        if len(self._seen) > SEEN_IDS:
            del self._seen[next(iter(self._seen))]
        try:
            response = read_response(client, event)
        except SignerError:
            FRAMES.labels("garbage").inc()
            self._invalid.invalid()
            return
        pending = self._pending.get(response.request_id)
        if pending is None or pending[1].done():
            FRAMES.labels("unmatched").inc()
            return
        if event.pubkey != pending[0]:
            FRAMES.labels("foreign").inc()
            return
        FRAMES.labels("answer").inc()
        pending[1].set_result(response)


class SignerLinks:
    """Every signer relay link, capped in total and per npub, closed when no session uses it,
    and dropped when it fails to connect (the next request makes a new one): registrations
    naming unreachable bunker relays cannot use up the links."""

    def __init__(
        self, max_links: int = MAX_LINKS, max_per_npub: int = MAX_LINKS_PER_NPUB
    ) -> None:
        self._links: dict[str, SignerRelayLink] = {}
        self._max = max_links
        self._max_per_npub = max_per_npub
        self._opened_by: dict[str, str] = {}
        """URL -> the npub whose request created the link."""
        self._per_npub: dict[str, int] = {}
        track("signer_links", self, len)

    def __len__(self) -> int:
        return len(self._links)

    async def get(self, url: str, npub: str = "") -> SignerRelayLink:
        """The link to `url`, created for `npub`'s session if there is room; SignerUnreachable
        at the total cap or `npub`'s own."""
        link = self._links.get(url)
        if link is None:
            if npub and self._per_npub.get(npub, 0) >= self._max_per_npub:
                LINKS.labels("refused").inc()
                raise SignerUnreachable("too many signer relays for this npub")
            if len(self._links) >= self._max:
                await self._drop_idle()
            if len(self._links) >= self._max:
                LINKS.labels("refused").inc()
                raise SignerUnreachable("too many signer relays on this instance")
            link = self._links[url] = SignerRelayLink(url, self._failed)
            self._opened_by[url] = npub
            self._per_npub[npub] = self._per_npub.get(npub, 0) + 1
            LINKS.labels("opened").inc()
        return link

    def _forget(self, url: str) -> None:
        npub = self._opened_by.pop(url, "")
        left = self._per_npub.get(npub, 0) - 1
        if left > 0:
            self._per_npub[npub] = left
        else:
            self._per_npub.pop(npub, None)

    def _failed(self, link: SignerRelayLink) -> None:
        """A link that could not connect leaves the table at once (its socket never opened)."""
        if self._links.get(link.url) is link:
            del self._links[link.url]
            self._forget(link.url)
            LINKS.labels("failed").inc()

    async def release(self, url: str, client_pubkey: str) -> None:
        """A session stopped using `url`: forget its key there and close the link if idle."""
        link = self._links.get(url)
        if link is None:
            return
        await link.forget(client_pubkey)
        if link.idle and self._links.get(url) is link:
            del self._links[url]
            self._forget(url)
            LINKS.labels("closed_idle").inc()
            await link.close()

    async def _drop_idle(self) -> None:
        for url in [u for u, link in self._links.items() if link.idle]:
            link = self._links.pop(url)
            self._forget(url)
            LINKS.labels("closed_idle").inc()
            await link.close()

    async def close(self) -> None:
        links, self._links = list(self._links.values()), {}
        self._opened_by.clear()
        self._per_npub.clear()
        await asyncio.gather(*(link.close() for link in links))
