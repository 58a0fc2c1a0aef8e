"""A hostile NIP-46 bunker relay (issue 34, item 4): when the bridge publishes a request, it
streams answers nobody asked for on the bridge's subscription, as the one measured did: a
validly signed answer of the signer's, replayed over and over, and copies with fresh ids and
a signature that does not match them (forgeries), two replays to one forgery, until the
bridge closes the socket or `limit` frames are sent.

It runs in a thread with its own event loop (`testkit.threaded_relay`), so a `sigil-push serve`
process under test, or the test's own loop, pays for what it sends and the relay does not
share that loop's time."""

from __future__ import annotations

import json
from typing import Any

import nostr_sdk
from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed

from sigil_push.nostr.event import compute_id
from testkit.threaded_relay import ThreadedRelay


def _answer(signer: nostr_sdk.Keys, client_hex: str) -> dict[str, Any]:
    """A signer's answer to `client_hex`, correctly signed, for a request id long gone."""
    requester = nostr_sdk.PublicKey.parse(client_hex)
    content = nostr_sdk.nip44_encrypt(
        signer.secret_key(), requester, json.dumps({"id": "00" * 16, "result": "ack"}),
        nostr_sdk.Nip44Version.V2,
    )
    event = (nostr_sdk.EventBuilder(nostr_sdk.Kind(24133), content)
             .tags([nostr_sdk.Tag.public_key(requester)]).finalize(signer))
    answer: dict[str, Any] = json.loads(event.as_json())
    return answer


def _forgery(answer: dict[str, Any], n: int) -> dict[str, Any]:
    """`answer` with new content and the id that content has, under the old signature."""
    content = f"{answer['content']}{n}"
    tags = [list(tag) for tag in answer["tags"]]
    event_id = compute_id(answer["pubkey"], answer["created_at"], answer["kind"],
                          tuple(tuple(tag) for tag in tags), content)
    return {**answer, "id": event_id, "content": content}


class FloodingBunker(ThreadedRelay):
    def __init__(self, signer: nostr_sdk.Keys, limit: int = 60_000, replays: int = 2,
                 quiet_requests: int = 0) -> None:
        """`replays` replayed answers to each forgery (0: forgeries only); the first
        `quiet_requests` requests are left unanswered, so a link can gather keys first."""
        super().__init__()
        self.signer = signer
        self.limit = limit
        self.replays = replays
        self.quiet_requests = quiet_requests
        self.sent = 0
        """Frames written to the bridge's socket (some may still sit in buffers when it closes)."""
        self.connections = 0
        self.open_now = 0
        self.closed_by_peer = 0
        """Floods that ended because the bridge closed the socket, not at `limit`."""
        self.requests = 0

    @property
    def signer_hex(self) -> str:
        return str(self.signer.public_key().to_hex())

    async def handle(self, ws: ServerConnection) -> None:
        self.connections += 1
        self.open_now += 1
        subscription = "nip46-0"
        try:
            async for raw in ws:
                frame = json.loads(raw)
                if frame[0] == "REQ":
                    subscription = frame[1]
                elif frame[0] == "EVENT":
                    self.requests += 1
                    if self.requests > self.quiet_requests:
                        await self._flood(ws, subscription, frame[1]["pubkey"])
        except ConnectionClosed:
            pass
        finally:
            self.open_now -= 1

    async def _flood(self, ws: ServerConnection, subscription: str, client_hex: str) -> None:
        answer = _answer(self.signer, client_hex)
        replay = json.dumps(["EVENT", subscription, answer])
        try:
            for n in range(self.limit):
                if n % (self.replays + 1) == self.replays:
                    await ws.send(json.dumps(["EVENT", subscription, _forgery(answer, n)]))
                else:
                    await ws.send(replay)
                self.sent += 1
        except ConnectionClosed:
            self.closed_by_peer += 1
