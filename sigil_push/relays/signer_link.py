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
from sigil_push.nostr.nip46 import REQUEST_KIND, Response, SignerError, read_response
from sigil_push.outbound import GuardedSocket, open_relay_socket
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

FRAMES = Counter(
    "sigil_push_signer_link_frames_total",
    "Frames from signer relays by outcome (answer, ignored, garbage, foreign, unmatched)",
    ["outcome"],
)
LINKS = Counter(
    "sigil_push_signer_links_total",
    "Signer relay links opened, closed idle, dropped after a failed connect, or refused at a cap",
    ["outcome"],
)


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

    async def _ensure_open(self) -> tuple[ClientConnection, bool]:
        """The open socket, and whether it was opened by this call (then every chunk has just
        been subscribed)."""
        async with self._connecting:
            if self._socket is not None and self._reader is not None and not self._reader.done():
                return self._socket, False
            if self._opener is not None:
                await self.close()
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
        subscription = {
            "kinds": [REQUEST_KIND],
            "#p": self._chunks[index],
            "since": int(time.time()) - LOOKBACK_SECONDS,
        }
        await socket.send(json.dumps(["REQ", f"{SUBSCRIPTION_PREFIX}{index}", subscription]))

    async def _read(self, socket: ClientConnection) -> None:
        try:
            async for frame in socket:
                self._handle(frame)
        except ConnectionClosed:
            pass
        finally:
            for _, future in self._pending.values():
                if not future.done():
                    future.set_exception(SignerUnreachable("the signer relay closed the connection"))

    def _handle(self, frame: str | bytes) -> None:
        try:
            message: Any = json.loads(frame)
            if not (isinstance(message, list) and message[:1] == ["EVENT"] and len(message) == 3):
                FRAMES.labels("ignored").inc()
                return
            event = Event.from_json(message[2])
            event.verify()
        except (ValueError, InvalidEvent, RecursionError):
            FRAMES.labels("garbage").inc()
            return
        client = next((self._clients[p] for p in event.tag_values("p") if p in self._clients), None)
        if client is None:
            FRAMES.labels("unmatched").inc()
            return
        try:
            response = read_response(client, event)
        except SignerError:
            FRAMES.labels("garbage").inc()
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
