"""A NIP-46 remote signer ("bunker") built only on nostr-sdk, independent of sigil-push.

It runs in its own thread and event loop, listens for kind 24133 requests on one relay,
answers `connect`, `get_public_key` and `sign_event` with the user's keys, and records every
request it receives so tests can prove what the bridge asked for. `hold()` keeps its
`sign_event` answers back until `release()`, so a test decides the order in which several
users' AUTHs reach a relay (as a loaded machine may order them), not the scheduler.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import nostr_sdk

from testkit.deadlines import REQUEST_SECONDS, STOP_SECONDS, scaled


async def listen_as_signer(
    relay_url: str, signer_keys: list[nostr_sdk.PublicKey]
) -> tuple[nostr_sdk.Client, nostr_sdk.ClientNotificationStream]:
    """A nostr-sdk client subscribed to the NIP-46 requests addressed to `signer_keys`."""
    client = nostr_sdk.Client()
    await client.add_relay(nostr_sdk.RelayUrl.parse(relay_url))
    await client.connect()
    await client.try_connect(timedelta(seconds=5))
    notifications = client.notifications()
    listen = (
        nostr_sdk.Filter()
        .kind(nostr_sdk.Kind(24133))
        .pubkeys(signer_keys)
        .since(nostr_sdk.Timestamp.from_secs(nostr_sdk.Timestamp.now().as_secs() - 60))
    )
    await client.subscribe(nostr_sdk.ReqTarget.auto([listen]))
    return client, notifications


def sign_template(template: dict[str, Any], user: nostr_sdk.Keys) -> str:
    """What a signer returns for `sign_event`: the template signed by the user, as JSON."""
    return str(
        nostr_sdk.EventBuilder(nostr_sdk.Kind(template["kind"]), template["content"])
        .tags([nostr_sdk.Tag.parse(tag) for tag in template["tags"]])
        .custom_created_at(nostr_sdk.Timestamp.from_secs(template["created_at"]))
        .finalize(user)
        .as_json()
    )


async def send_answer(
    client: nostr_sdk.Client,
    signer: nostr_sdk.Keys,
    requester: nostr_sdk.PublicKey,
    answer: dict[str, Any],
) -> None:
    """Encrypt (NIP-44) and publish a NIP-46 answer to the requesting client key."""
    content = nostr_sdk.nip44_encrypt(
        signer.secret_key(), requester, json.dumps(answer), nostr_sdk.Nip44Version.V2
    )
    response = (
        nostr_sdk.EventBuilder(nostr_sdk.Kind(24133), content)
        .tags([nostr_sdk.Tag.public_key(requester)])
        .finalize(signer)
    )
    await client.send_event(response)


@dataclass
class Request:
    method: str
    params: list[Any]
    signed_kind: int | None = None


@dataclass
class RemoteSigner:
    relay_url: str
    user: nostr_sdk.Keys = field(default_factory=nostr_sdk.Keys.generate)
    secret: str | None = None
    refuse: bool = False
    refuse_signing: bool = False
    claims_key: nostr_sdk.Keys | None = None
    requests: list[Request] = field(default_factory=list)
    signer_keys: nostr_sdk.Keys = field(default_factory=nostr_sdk.Keys.generate)

    def __post_init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._serving: concurrent.futures.Future[None] | None = None
        self._signing = asyncio.Event()
        """Set while `sign_event` is answered; cleared by `hold()` (used on the signer's loop)."""
        self._signing.set()

    @property
    def bunker_uri(self) -> str:
        query = f"relay={self.relay_url}" + (f"&secret={self.secret}" if self.secret else "")
        return f"bunker://{self.signer_keys.public_key().to_hex()}?{query}"

    @property
    def user_hex(self) -> str:
        return str(self.user.public_key().to_hex())

    def start(self) -> RemoteSigner:
        self._thread.start()
        self._serving = asyncio.run_coroutine_threadsafe(self._serve(), self._loop)
        if not self._ready.wait(15):
            raise TimeoutError(f"remote signer did not subscribe in time: {self._serving!r}")
        return self

    def hold(self) -> None:
        """Answer no `sign_event` until `release()` (the requests are still recorded)."""
        self._on_loop(self._signing.clear)

    def release(self) -> None:
        self._on_loop(self._signing.set)

    def _on_loop(self, action: Any) -> None:
        async def run() -> None:
            action()

        asyncio.run_coroutine_threadsafe(run(), self._loop).result(scaled(REQUEST_SECONDS))

    def stop(self) -> None:
        """Ends the serving loop as soon as it sees the stop (not after a fixed pause: a story
        stops several signers one after another), then the thread."""
        self._loop.call_soon_threadsafe(self._signing.set)
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._serving is not None:
            concurrent.futures.wait([self._serving], timeout=scaled(STOP_SECONDS))
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=scaled(STOP_SECONDS))

    def methods(self) -> list[str]:
        return [request.method for request in list(self.requests)]

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        client, notifications = await listen_as_signer(
            self.relay_url, [self.signer_keys.public_key()]
        )
        self._ready.set()
        # One `next()` stays pending across the stop checks and is never cancelled: cancelling
        # it (as `wait_for` does on its timeout) can drop the notification nostr-sdk was just
        # handing over, and a request lost that way looks to the bridge like an unreachable
        # signer (15 s timeout, then a minute's pause).
        pending: asyncio.Future[Any] = asyncio.ensure_future(notifications.next())
        stopping = asyncio.ensure_future(self._stop.wait())
        while True:
            await asyncio.wait({pending, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if stopping.done():
                break
            notification = pending.result()
            pending = asyncio.ensure_future(notifications.next())
            if notification is None or not notification.is_new_event():
                continue
            await self._answer(client, notification.event)
        pending.cancel()
        await client.shutdown()

    async def _answer(self, client: nostr_sdk.Client, event: nostr_sdk.Event) -> None:
        if event.kind().as_u16() != 24133:
            return
        requester = event.author()
        plaintext = nostr_sdk.nip44_decrypt(
            self.signer_keys.secret_key(), requester, event.content()
        )
        request = json.loads(plaintext)
        method, params = request["method"], request.get("params", [])
        record = Request(method, params)
        self.requests.append(record)
        result: str | None = None
        error: str | None = None
        if self.refuse:
            error = "denied by the user"
        elif method == "connect":
            result = "ack"
            if self.secret and (len(params) < 2 or params[1] != self.secret):
                result, error = None, "wrong secret"
        elif method == "get_public_key":
            result = str((self.claims_key or self.user).public_key().to_hex())
        elif method == "sign_event" and self.refuse_signing:
            record.signed_kind = int(json.loads(params[0])["kind"])
            error = "signing denied by the user"
        elif method == "sign_event":
            template = json.loads(params[0])
            record.signed_kind = int(template["kind"])
            await self._signing.wait()
            result = sign_template(template, self.user)
        else:
            error = f"unsupported method {method}"
        answer = {"id": request["id"], "result": result, "error": error}
        await send_answer(client, self.signer_keys, requester, answer)
