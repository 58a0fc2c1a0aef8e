"""The websocket to a NIP-46 signer's relay, shared by every session whose signer listens there.

A few subscriptions carry the answers for all of our client keys on that relay, each for a
chunk of keys: adding a key re-requests only its chunk, so a burst of new sessions does not make
the relay replay every recent answer for every key each time. Answers are matched to pending
requests by their JSON-RPC id. A dropped connection fails what is pending
(the caller decides about retrying) and the next request reconnects.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from functools import partial
from typing import Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidURI

from sigil_push.nostr.event import Event, InvalidEvent
from sigil_push.nostr.keys import SecretKey
from sigil_push.nostr.nip46 import REQUEST_KIND, Response, SignerError, read_response
from sigil_push.relays.connection import wire_log
from sigil_push.supervisor import supervise

log = logging.getLogger(__name__)

SUBSCRIPTION_PREFIX = "nip46-"
KEYS_PER_SUBSCRIPTION = 100
OPEN_TIMEOUT_SECONDS = 10.0
LOOKBACK_SECONDS = 60
MAX_FRAME_BYTES = 256 * 1024


class SignerUnreachable(Exception):
    """The signer's relay could not be reached or dropped the connection mid-request."""


class SignerRelayLink:
    def __init__(self, url: str) -> None:
        self.url = url
        self._clients: dict[str, SecretKey] = {}
        self._chunks: list[list[str]] = []
        self._pending: dict[str, asyncio.Future[Response]] = {}
        self._socket: ClientConnection | None = None
        self._reader: asyncio.Task[None] | None = None
        self._connecting = asyncio.Lock()

    async def request(self, client: SecretKey, request_id: str, message: Event, timeout: float) -> Response:
        """Publish `message` and wait for the answer to `request_id`."""
        socket = await self._ensure_open()
        if client.public_key_hex not in self._clients:
            self._clients[client.public_key_hex] = client
            if not self._chunks or len(self._chunks[-1]) >= KEYS_PER_SUBSCRIPTION:
                self._chunks.append([])
            self._chunks[-1].append(client.public_key_hex)
            await self._subscribe(socket, len(self._chunks) - 1)
        future: asyncio.Future[Response] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = future
        try:
            await socket.send(json.dumps(["EVENT", message.to_json()]))
            return await asyncio.wait_for(future, timeout)
        except (ConnectionClosed, OSError) as exc:
            raise SignerUnreachable(f"connection to the signer relay broke: {type(exc).__name__}") from None
        except TimeoutError:
            raise SignerUnreachable("the signer did not answer in time") from None
        finally:
            self._pending.pop(request_id, None)

    def forget(self, client_pubkey: str) -> None:
        """Stop routing answers to this key; its chunk's filter shrinks at the next re-request."""
        if self._clients.pop(client_pubkey, None) is not None:
            for chunk in self._chunks:
                if client_pubkey in chunk:
                    chunk.remove(client_pubkey)

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        if self._socket is not None:
            await self._socket.close()
        self._socket = None

    async def _ensure_open(self) -> ClientConnection:
        async with self._connecting:
            if self._socket is not None and self._reader is not None and not self._reader.done():
                return self._socket
            try:
                self._socket = await asyncio.wait_for(
                    connect(
                        self.url, max_size=MAX_FRAME_BYTES, open_timeout=OPEN_TIMEOUT_SECONDS,
                        logger=wire_log, proxy=None,
                    ),
                    OPEN_TIMEOUT_SECONDS,
                )
            except (OSError, TimeoutError, InvalidHandshake, InvalidURI) as exc:
                raise SignerUnreachable(f"cannot connect to the signer relay: {type(exc).__name__}") from None
            self._reader = supervise("signer-link", partial(self._read, self._socket))
            for index, chunk in enumerate(self._chunks):
                if chunk:
                    await self._subscribe(self._socket, index)
            return self._socket

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
            for future in self._pending.values():
                if not future.done():
                    future.set_exception(SignerUnreachable("the signer relay closed the connection"))

    def _handle(self, frame: str | bytes) -> None:
        try:
            message: Any = json.loads(frame)
            if not (isinstance(message, list) and message[:1] == ["EVENT"] and len(message) == 3):
                return
            event = Event.from_json(message[2])
            event.verify()
        except (ValueError, InvalidEvent):
            return
        client = next((self._clients[p] for p in event.tag_values("p") if p in self._clients), None)
        if client is None:
            return
        try:
            response = read_response(client, event)
        except SignerError:
            return
        future = self._pending.get(response.request_id)
        if future is not None and not future.done():
            future.set_result(response)
