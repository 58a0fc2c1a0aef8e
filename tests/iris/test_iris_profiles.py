"""Authors' names for Iris pushes, asked of a real relay (nostr-relay): the verified kind 0 is
shown and cached, a forged one is ignored, and a relay that never answers costs the push its
name after the wait, not its delivery."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import nostr_sdk
import pytest
from prometheus_client import REGISTRY

from sigil_push.iris.payload import UNKNOWN_PROFILE, Profile
from sigil_push.iris.profiles import Profiles
from testkit.deadlines import scaled
from testkit.nostr_client import publish
from testkit.relay import RelayProcess

pytestmark = pytest.mark.slow  # starts relays


def lookups(result: str) -> float:
    return REGISTRY.get_sample_value("sigil_push_iris_profile_lookups_total", {"result": result}) or 0.0


def kind0(keys: nostr_sdk.Keys, fields: dict[str, str]) -> dict[str, Any]:
    event = nostr_sdk.EventBuilder(nostr_sdk.Kind(0), json.dumps(fields)).finalize(keys)
    return dict(json.loads(event.as_json()))


async def test_the_authors_verified_kind_0_is_shown_and_cached(tmp_path: Path) -> None:
    author, stranger = nostr_sdk.Keys.generate(), nostr_sdk.Keys.generate()
    with RelayProcess(tmp_path / "relay") as relay:
        await publish(relay.url, kind0(author, {"name": "alice", "picture": "https://p.example/a.png"}))
        profiles = Profiles(wait_seconds=scaled(5))
        try:
            found = await profiles.lookup(author.public_key().to_hex(), relay.url)
            assert found == Profile("alice", "https://p.example/a.png")
            cached = lookups("cached")
            assert await profiles.lookup(author.public_key().to_hex(), "") == found
            assert lookups("cached") == cached + 1
            assert await profiles.lookup(stranger.public_key().to_hex(), relay.url) == UNKNOWN_PROFILE
        finally:
            await profiles.close()


async def test_a_forged_kind_0_is_not_shown(tmp_path: Path) -> None:
    """A relay that stores anything serves a kind 0 claiming the author's key, signed by
    another: it is read, fails verification and is ignored."""
    author = nostr_sdk.Keys.generate()
    genuine = kind0(nostr_sdk.Keys.generate(), {"name": "mallory"})
    forged = {**genuine, "pubkey": author.public_key().to_hex()}
    with RelayProcess(tmp_path / "relay", verify_signatures=False) as relay:
        await publish(relay.url, forged)
        profiles = Profiles(wait_seconds=scaled(5))
        try:
            assert await profiles.lookup(author.public_key().to_hex(), relay.url) == UNKNOWN_PROFILE
        finally:
            await profiles.close()


async def test_a_relay_that_never_answers_costs_the_name_within_the_wait() -> None:
    """A tarpit accepts the connection and says nothing: the push goes on without a name after
    the wait (1 s in production; 0.5 s here), counted `late`."""
    held: list[asyncio.StreamWriter] = []

    async def tarpit(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    server = await asyncio.start_server(tarpit, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    profiles = Profiles(wait_seconds=0.5, fetch_seconds=scaled(10))
    late = lookups("late")
    try:
        started = time.monotonic()
        found = await profiles.lookup("c" * 64, f"ws://127.0.0.1:{port}")
        elapsed = time.monotonic() - started
    finally:
        await profiles.close()
        for writer in held:
            writer.close()
        server.close()
        await server.wait_closed()
    assert found == UNKNOWN_PROFILE and lookups("late") == late + 1
    assert 0.5 <= elapsed < 0.5 + scaled(1)
