"""Publishing one event the way a Nostr client does: EVENT, wait for OK, NIP-42 AUTH if refused.

Used by the canary (sigil_push/canary.py). It opens its own short-lived connection rather than
borrowing the bridge's subscription socket: a probe should travel like a DM from some other
client, from a sender's write to the bridge's read.

A relay that wants authentication for writes says so in its OK (`auth-required:`, or
`restricted:` as nostr-relay does when an unauthenticated key lacks a role), with a challenge
sent on connect or just before. The answer is signed with the bridge key, and the event is sent
again once (after the relay's OK to the AUTH, or a short wait for relays that never send one).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any

from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidURI

from sigil_push.nostr.event import Event
from sigil_push.nostr.relay_message import (
    AuthChallenge,
    InvalidRelayMessage,
    Ok,
    parse_relay_message,
)
from sigil_push.outbound import open_relay_socket
from sigil_push.relays.connection import AuthSigner, AuthUnavailable

OPEN_TIMEOUT_SECONDS = 10.0
MAX_FRAME_BYTES = 256 * 1024
MAX_MESSAGE_CHARS = 200
AUTH_OK_WAIT_SECONDS = 1.0
MAX_FRAMES = 200
AUTH_PREFIXES = ("auth-required", "restricted")


@dataclass(frozen=True, slots=True)
class PublishResult:
    """The relay's verdict. `reason` is a fixed label (a metric label), `message` the relay's
    own OK text, bounded; `sent_ms` is when the accepted copy of the event was sent."""

    accepted: bool
    reason: str
    message: str = ""
    sent_ms: int | None = None


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def _prefix(message: str) -> str:
    head, sep, _ = message.partition(":")
    return head.strip() if sep else ""


def _clean(message: Any) -> str:
    """The relay's free text, printable and bounded (it goes into the observation log)."""
    text = message if isinstance(message, str) else ""
    return "".join(c if c.isprintable() else " " for c in text[:MAX_MESSAGE_CHARS])


async def publish(url: str, event: Event, signer: AuthSigner, timeout: float) -> PublishResult:
    """Publish `event` to `url` within `timeout` seconds; never raises for relay behaviour."""
    attempt = _Publication(url, event, signer)
    try:
        async with asyncio.timeout(timeout):
            # through the guard like every other socket: the address checked and pinned, no
            # redirects followed, the host's slot held
            async with open_relay_socket(
                url,
                purpose="canary",
                open_timeout=OPEN_TIMEOUT_SECONDS,
                max_size=MAX_FRAME_BYTES,
                compression=None,
                user_agent_header="sigil-push",
            ) as ws:
                return await attempt.run(ws)
    except TimeoutError:
        if attempt.refusal is not None:
            return PublishResult(False, "auth_required", attempt.refusal)
        return PublishResult(False, "timeout")
    except (OSError, InvalidHandshake, InvalidURI):
        return PublishResult(False, "connect")
    except ConnectionClosed:
        return PublishResult(False, "closed")


class _Publication:
    """One EVENT on one socket, and at most one AUTH round before sending it again."""

    def __init__(self, url: str, event: Event, signer: AuthSigner) -> None:
        self._url = url
        self._event = event
        self._signer = signer
        self._frame = json.dumps(["EVENT", event.to_json()], separators=(",", ":"))
        self._sent_ms = 0
        self._challenge: str | None = None
        self._auth_id: str | None = None
        self._authenticated = False
        # the relay's refusal text while an AUTH round is owed or under way
        self.refusal: str | None = None

    async def run(self, ws: ClientConnection) -> PublishResult:
        await self._send_event(ws)
        for _ in range(MAX_FRAMES):
            waiting_for_auth_ok = self._auth_id is not None and not self._authenticated
            try:
                # asyncio.timeout, not wait_for (on 3.11 it swallows a cancellation that lands
                # as a frame arrives, and a stopped canary round would go on)
                async with asyncio.timeout(AUTH_OK_WAIT_SECONDS if waiting_for_auth_ok else None):
                    raw = await ws.recv()
            except TimeoutError:
                # some relays (nostr-relay) never acknowledge AUTH; it was handled in order
                await self._authenticated_again(ws)
                continue
            result = await self._on_frame(ws, raw)
            if result is not None:
                return result
        return PublishResult(False, "protocol")

    async def _send_event(self, ws: ClientConnection) -> None:
        await ws.send(self._frame)
        self._sent_ms = _now_ms()

    async def _authenticated_again(self, ws: ClientConnection) -> None:
        self._authenticated = True
        self.refusal = None
        await self._send_event(ws)

    async def _on_frame(self, ws: ClientConnection, raw: str | bytes) -> PublishResult | None:
        try:
            message = parse_relay_message(raw)
        except InvalidRelayMessage:
            return None
        if isinstance(message, AuthChallenge):
            self._challenge = message.challenge
        elif not isinstance(message, Ok):
            return None
        elif self._auth_id is not None and message.event_id == self._auth_id:
            if self._authenticated:
                return None
            if not message.accepted:
                return PublishResult(False, "auth_refused", _clean(message.message))
            await self._authenticated_again(ws)
            return None
        elif message.event_id in (self._event.id, ""):
            # nostr-relay answers a refusal with an empty id
            text = _clean(message.message)
            if message.accepted:
                return PublishResult(True, "accepted", text, self._sent_ms)
            if self._auth_id is not None or _prefix(text) not in AUTH_PREFIXES:
                return PublishResult(False, "rejected", text)
            self.refusal = text
        await self._answer_auth(ws)
        return None

    async def _answer_auth(self, ws: ClientConnection) -> None:
        """Once the relay has both refused for lack of AUTH and sent a challenge."""
        if self.refusal is None or self._challenge is None or self._auth_id is not None:
            return
        try:
            auth = await self._signer.sign_auth(self._url, self._challenge)
        except AuthUnavailable:
            return
        self._auth_id = auth.id
        await ws.send(json.dumps(["AUTH", auth.to_json()], separators=(",", ":")))
