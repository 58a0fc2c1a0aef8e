"""Test-side Nostr users: real NIP-04 DMs and NIP-17 gift wraps built with nostr-sdk, and a
plain websocket publisher that waits for the relay's OK (so a test knows the event is stored).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Sequence
from typing import Any

import nostr_sdk
from websockets.asyncio.client import connect


class PublishRefused(Exception):
    """The relay answered OK false."""


def user() -> nostr_sdk.Keys:
    return nostr_sdk.Keys.generate()


def hex_of(keys: nostr_sdk.Keys) -> str:
    return str(keys.public_key().to_hex())


def npub_of(keys: nostr_sdk.Keys) -> str:
    return str(keys.public_key().to_bech32())


def secret_hex_of(keys: nostr_sdk.Keys) -> str:
    return str(keys.secret_key().to_hex())


def signed_event(
    author: nostr_sdk.Keys,
    kind: int,
    tags: Sequence[Sequence[str]] = (),
    content: str = "",
    created_at: int | None = None,
) -> dict[str, Any]:
    """An event of any kind signed by its author, as a relay frame's JSON object."""
    builder = nostr_sdk.EventBuilder(nostr_sdk.Kind(kind), content).tags(
        [nostr_sdk.Tag.parse(list(tag)) for tag in tags]
    )
    if created_at is not None:
        builder = builder.custom_created_at(nostr_sdk.Timestamp.from_secs(created_at))
    return dict(json.loads(builder.finalize(author).as_json()))


def kind4_dm(
    sender: nostr_sdk.Keys, recipient: nostr_sdk.Keys, text: str, created_at: int | None = None
) -> dict[str, Any]:
    """A NIP-04 direct message, encrypted for the recipient and `p`-tagged to them."""
    content = nostr_sdk.nip04_encrypt(sender.secret_key(), recipient.public_key(), text)
    return signed_event(sender, 4, [["p", recipient.public_key().to_hex()]], content, created_at)


def gift_wrap(sender: nostr_sdk.Keys, recipient: nostr_sdk.Keys, text: str) -> dict[str, Any]:
    """A NIP-17 private message: kind 1059 wrap with a back-dated created_at."""
    wrap = nostr_sdk.nip17_make_private_msg(sender, recipient.public_key(), text)
    return dict(json.loads(wrap.as_json()))


def relay_list(
    owner: nostr_sdk.Keys, kind: int, urls: list[str], created_at: int | None = None
) -> dict[str, Any]:
    """A kind 10050 (`relay` tags) or kind 10002 (`r` tags) list signed by its owner."""
    tag_name = "relay" if kind == 10050 else "r"
    return signed_event(owner, kind, [[tag_name, url] for url in urls], created_at=created_at)


async def publish(relay_url: str, *events: dict[str, Any]) -> None:
    """Send events to a relay and wait until it has accepted every one.

    An event whose OK does not come within `OK_WAIT_SECONDS` is sent again (a relay answers a
    repeat with a `duplicate:` OK), as real clients do, so a lost answer under load fails
    loudly after `PUBLISH_ATTEMPTS` instead of hanging the suite."""
    async with connect(relay_url, proxy=None) as ws:
        for event in events:
            for _ in range(PUBLISH_ATTEMPTS):
                await ws.send(json.dumps(["EVENT", event]))
                try:
                    await asyncio.wait_for(_accepted(ws, event["id"]), OK_WAIT_SECONDS)
                    break
                except TimeoutError:
                    continue
            else:
                raise PublishRefused(f"no OK for an event after {PUBLISH_ATTEMPTS} attempts")


OK_WAIT_SECONDS = 30.0
PUBLISH_ATTEMPTS = 3


async def _accepted(ws: Any, event_id: str) -> None:
    while True:
        answer = json.loads(await ws.recv())
        if answer[0] == "OK" and answer[1] == event_id:
            if not answer[2] and not str(answer[3]).startswith("duplicate"):
                raise PublishRefused(str(answer[3]))
            return


async def sdk_dry_run_sync(
    relay_url: str, query: nostr_sdk.Filter, items: dict[str, int] | list[tuple[str, int]],
    options: nostr_sdk.SyncOptions,
) -> nostr_sdk.Reconciliation:
    """nostr-sdk's own NIP-77 client reconciling `items` (id → created_at) against
    `relay_url`: the independent side our negentropy client is checked against."""
    pairs = items.items() if isinstance(items, dict) else items
    nostr_sdk.uniffi_set_event_loop(asyncio.get_running_loop())
    client = nostr_sdk.Client()
    try:
        url = nostr_sdk.RelayUrl.parse(relay_url)
        await client.add_relay(url)
        await client.connect()
        relay = await client.relay(url)
        negentropy_items = [
            nostr_sdk.NegentropyItem(
                id=nostr_sdk.EventId.parse(event_id),
                timestamp=nostr_sdk.Timestamp.from_secs(created_at),
            )
            for event_id, created_at in pairs
        ]
        return await relay.sync(query, negentropy_items, options)
    finally:
        await client.disconnect()
        nostr_sdk.uniffi_set_event_loop(None)


async def publish_steadily(
    relay_url: str, recipients: list[nostr_sdk.Keys], rate: float, stop: asyncio.Event,
    sent: list[str],
) -> None:
    """Publish kind 4 DMs to `recipients` in turn, `rate` a second, until `stop` is set; each
    id joins `sent` as it goes out. Returns once the relay has accepted every one (a steady
    stream of messages for stories about what happens meanwhile, such as a database outage)."""
    sender = user()
    accepted: set[str] = set()
    async with connect(relay_url, proxy=None) as ws:

        async def read_answers() -> None:
            async for frame in ws:
                answer = json.loads(frame)
                if answer[0] == "OK":
                    if not answer[2] and not str(answer[3]).startswith("duplicate"):
                        raise PublishRefused(str(answer[3]))
                    accepted.add(answer[1])

        reader = asyncio.create_task(read_answers())
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            while not stop.is_set():
                dm = kind4_dm(sender, recipients[len(sent) % len(recipients)], f"dm {len(sent)}")
                await ws.send(json.dumps(["EVENT", dm]))
                sent.append(dm["id"])
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), started + len(sent) / rate - loop.time())
            async with asyncio.timeout(OK_WAIT_SECONDS):
                while not accepted.issuperset(sent):
                    if reader.done():
                        reader.result()  # a refusal, or the relay closed the connection
                        raise PublishRefused("the relay closed the connection")
                    await asyncio.sleep(0.05)
        finally:
            reader.cancel()
