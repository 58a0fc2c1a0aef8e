"""Delegated-AUTH sessions across workers: a signer registered through worker A is used, at
once and without a restart, by worker B that owns the user's key shard.

Real parts: two `sigil-push serve` workers on a real PostgreSQL server, an open relay (the
operator's relay and the signer's), a gated inbox (`nostr-relay` serving reads only to keys
granted role `r`) and an independent nostr-sdk remote signer. A push is what the dry-run
sender logs.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from sigil_push.shards import DEFAULT_SHARDS, shard_of
from testkit.bridge_harness import (
    assert_private,
    eventually,
    new_token,
    register,
    unregister,
    wakeups,
)
from testkit.deadlines import REQUEST_SECONDS, scaled
from testkit.nostr_client import gift_wrap, npub_of, publish, user
from testkit.processes import FAST_RECONNECT
from testkit.relay import RelayProcess
from testkit.remote_signer import RemoteSigner
from testkit.service import ServiceProcess
from testkit.stores import on_database
from tests.stories.test_bridge_gated import GATED, registrations, users_on

WORKER_TOML = FAST_RECONNECT + "lease_seconds = 3\n"


@pytest.fixture
def started() -> Iterator[list[Any]]:
    parts: list[Any] = []
    yield parts
    for part in reversed(parts):
        part.stop()


def _shards(service: ServiceProcess) -> set[int]:
    try:
        return set(httpx.get(service.admin_url + "/health", timeout=scaled(REQUEST_SECONDS)).json().get("shards", []))
    except (httpx.HTTPError, ValueError):
        return set()


@pytest.mark.slow
async def test_a_signer_set_through_one_worker_is_used_by_the_keys_owner(
    tmp_path: Path, postgres_url: str, started: list[Any]
) -> None:
    open_relay = RelayProcess(tmp_path / "open").start()
    started.append(open_relay)
    gated = RelayProcess(tmp_path / "gated", auth_actions=GATED).start()
    started.append(gated)
    a, b = (
        on_database(
            ServiceProcess(tmp_path / name, [open_relay.url], WORKER_TOML), postgres_url,
            key_file=tmp_path / "bridge.key",
        )
        for name in ("a", "b")
    )
    started.append(a.start())
    started.append(b.start())
    await eventually(
        lambda: len(_shards(a)) + len(_shards(b)) == DEFAULT_SHARDS
        and bool(_shards(a)) and bool(_shards(b)),
        "the two workers split the shards", timeout=60,
    )
    # alice's key falls in one of B's shards: B's bridge watches her, A's does not
    owned_by_b = _shards(b)
    signer = RemoteSigner(open_relay.url)
    while shard_of(signer.user_hex) not in owned_by_b:
        signer = RemoteSigner(open_relay.url)
    started.append(signer.start())
    alice = signer.user
    gated.grant_role(signer.user_hex, "r")

    token = new_token()
    register(a, alice, token, [gated.url], signer.bunker_uri)
    await eventually(
        lambda: users_on(b, gated.url) == (1, 0), "B reads alice's gated inbox as alice", 60
    )
    assert users_on(a, gated.url) == (0, 0), "A does not watch alice's key"
    assert registrations(b, alice)[0]["auth_signer_status"] == "active"
    # A established the session once; B only asked for the AUTH signature
    assert signer.methods() == ["connect", "get_public_key", "sign_event"]

    wrap = gift_wrap(user(), alice, "through the gated inbox, via worker B")
    await publish(gated.url, wrap)
    await eventually(lambda: wakeups(b)[wrap["id"]] == 1, "B pushes alice's gated DM", 45)
    assert wakeups(a)[wrap["id"]] == 0
    for worker in (a, b):
        assert_private(worker, [signer.user_hex, npub_of(alice), "through the gated inbox"])

    # her last device unregistered through A: B ends the session and closes her connection
    unregister(a, alice, token)
    await eventually(lambda: users_on(b, gated.url) == (0, 0), "B let go of alice's inbox", 45)
