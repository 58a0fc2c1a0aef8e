"""The canary's pieces on their own: its gift wrap is a real NIP-59 wrap (nostr-sdk unwraps it),
its key file is created private and then reused, and `take` claims only DMs addressed to the
canary key alone (a DM to a user that also tags the canary key still reaches the user)."""

from __future__ import annotations

import asyncio
import json
import logging
import stat
import time
from pathlib import Path

import nostr_sdk
import pytest
from prometheus_client import REGISTRY

from sigil_push.canary import Canary, load_canary_key
from sigil_push.config import CanaryConfig
from sigil_push.nostr.event import sign_event
from sigil_push.nostr.keys import SecretKey
from sigil_push.nostr.nip19 import encode_npub
from sigil_push.nostr.nip59 import MAX_BACKDATE_SECONDS, gift_wrap
from sigil_push.observations import ObservationLog
from sigil_push.relays.connection import BridgeKeySigner
from sigil_push.telemetry.redaction import relay_label
from testkit.bridge_harness import eventually


def test_the_probe_is_a_nip59_gift_wrap_that_nostr_sdk_unwraps() -> None:
    """Kind 1059 signed by a one-time key, `p` = recipient, NIP-40 expiration, `created_at` up
    to two days back; nostr-sdk, holding the recipient's key, finds the kind 14 rumor inside,
    sent by the canary key (so the seal's signature checks out too)."""
    canary = SecretKey.generate()
    now = int(time.time())
    wrap = gift_wrap(canary, canary.public_key_hex, "hello", expiration=now + 600, now=now)
    wrap.verify()
    assert wrap.kind == 1059 and wrap.pubkey != canary.public_key_hex
    assert wrap.tags == (("p", canary.public_key_hex), ("expiration", str(now + 600)))
    assert now - MAX_BACKDATE_SECONDS < wrap.created_at <= now
    keys = nostr_sdk.Keys(nostr_sdk.SecretKey.parse(canary.secret_hex))
    unwrapped = nostr_sdk.UnwrappedGift.from_gift_wrap(
        keys, nostr_sdk.Event.from_json(json.dumps(wrap.to_json()))
    )
    assert unwrapped.sender().to_hex() == canary.public_key_hex
    assert unwrapped.rumor().kind().as_u16() == 14 and unwrapped.rumor().content() == "hello"
    others = {gift_wrap(canary, canary.public_key_hex, "x", now=now).pubkey for _ in range(3)}
    assert len(others) == 3, "every wrap has its own one-time key"


def test_the_key_file_is_created_private_and_then_reused(tmp_path: Path) -> None:
    path = tmp_path / "canary.key"
    first = load_canary_key(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_canary_key(path).public_key_hex == first.public_key_hex


async def test_take_claims_only_what_is_addressed_to_the_canary_alone(tmp_path: Path) -> None:
    canary_key, stranger, user = SecretKey.generate(), SecretKey.generate(), SecretKey.generate()
    canary = Canary(
        CanaryConfig(interval_seconds=60),
        ["ws://a", "ws://b"],
        canary_key,
        BridgeKeySigner(SecretKey.generate()),
        ObservationLog(tmp_path),
    )
    me = canary_key.public_key_hex
    to_canary = sign_event(stranger, 1059, "x", [["p", me]])
    to_both = sign_event(stranger, 1059, "x", [["p", me], ["p", user.public_key_hex]])
    to_user = sign_event(stranger, 4, "x", [["p", user.public_key_hex]])
    note = sign_event(stranger, 1, "x", [["p", me]])
    assert canary.take("ws://a", to_canary)
    assert not canary.take("ws://a", to_both), "a DM to a user too must reach the user"
    assert not canary.take("ws://a", to_user)
    assert not canary.take("ws://a", note)


async def test_a_relay_url_carrying_a_key_is_labelled_in_metrics_and_logs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Canary relays are configured, but a configured URL may still name a user
    (`wss://filter.nostr.wine/npub1…`): the probes' metric series and log lines carry its
    `relay_label`, as every other relay series does, never the key."""
    npub = encode_npub(SecretKey.generate().public_key_hex)
    url = f"ws://127.0.0.1:1/{npub}"  # nothing listens on port 1: each probe fails at once
    canary = Canary(
        CanaryConfig(interval_seconds=0.05), [url], SecretKey.generate(),
        BridgeKeySigner(SecretKey.generate()), ObservationLog(tmp_path / "obs"),
    )
    caplog.set_level(logging.INFO, logger="sigil_push.canary")

    def canary_labels() -> set[str]:
        return {
            sample.labels["relay"]
            for metric in REGISTRY.collect() if metric.name.startswith("sigil_push_canary")
            for sample in metric.samples if "relay" in sample.labels
        }

    def failed() -> bool:
        return "not published" in caplog.text

    canary.start()
    try:
        await eventually(failed, "a probe failed and was logged")
    finally:
        await canary.stop()
    assert relay_label(url) in canary_labels() and "<key-" in relay_label(url)
    assert not any(npub in label for label in canary_labels())
    assert npub not in caplog.text


async def test_a_probe_task_is_named_by_the_relay_label(tmp_path: Path) -> None:
    """asyncio names a task in its own log lines (a task destroyed while pending, a slow
    callback in debug mode): a probe's task carries the relay's label, never its raw URL."""
    npub = encode_npub(SecretKey.generate().public_key_hex)
    held: list[asyncio.StreamWriter] = []

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)  # accepts and never answers: the probe waits in its handshake

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    url = f"ws://127.0.0.1:{port}/{npub}"
    canary = Canary(
        CanaryConfig(interval_seconds=0.05), [url], SecretKey.generate(),
        BridgeKeySigner(SecretKey.generate()), ObservationLog(tmp_path / "obs"),
    )
    names: set[str] = set()

    def probing() -> bool:
        names.update(task.get_name() for task in asyncio.all_tasks())
        return bool(held)

    canary.start()
    try:
        await eventually(probing, "a probe connected")
        names.update(task.get_name() for task in asyncio.all_tasks())
    finally:
        await canary.stop()
        server.close()
        for writer in held:
            writer.close()
    assert f"canary {relay_label(url)}" in names
    assert not any(npub in name for name in names)
