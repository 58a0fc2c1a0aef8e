"""`expect` records end to end: when the bridge handles a DM it writes which of the recipient's
inbox relays were connected (kind 10050, else NIP-65 read relays, else the registration's
`relays`), with no recipient or sender in the record. Real `nostr-relay` processes, a real
`sigil-push serve` process; every wait polls with a generous deadline.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from testkit.bridge_harness import (
    assert_private,
    eventually,
    new_token,
    register,
    relay_live,
    wakeups,
)
from testkit.nostr_client import (
    gift_wrap,
    hex_of,
    kind4_dm,
    npub_of,
    publish,
    relay_list,
    user,
)
from testkit.processes import FAST_RECONNECT
from testkit.relay import RelayProcess, free_port
from testkit.service import ServiceProcess
from testkit.stores import Engine

pytestmark = pytest.mark.slow  # every story here starts its own processes


def expects(service: ServiceProcess, event_id: str) -> list[dict[str, Any]]:
    return [
        r
        for r in service.observation_records()
        if r["type"] == "expect" and r["event_id"] == event_id
    ]


async def test_expect_lists_the_connected_inbox_relays_in_nip17_order(
    start_relay: Callable[..., RelayProcess], tmp_path: Path, engine: Engine
) -> None:
    """Alice's kind 10050 list wins over her registration relays, and its relay that is down is
    left out; Carol has only a kind 10002 list, whose read relay counts; Dave has no list, so
    his registration relay counts. A configured relay that is nobody's inbox is never listed,
    and a DM delivered by two relays gets one record."""
    configured, inbox, general, registered = (
        start_relay("configured"), start_relay("inbox"), start_relay("general"), start_relay("registered")
    )
    down = f"ws://127.0.0.1:{free_port()}"
    alice, carol, dave, bob = user(), user(), user(), user()
    await publish(
        configured.url,
        relay_list(alice, 10050, [inbox.url, down]),
        relay_list(carol, 10002, [general.url]),
    )
    with ServiceProcess(
        tmp_path / "service", [configured.url], FAST_RECONNECT, database=engine.database()
    ) as service:
        tokens = [new_token() for _ in range(3)]
        register(service, alice, tokens[0], relays=[registered.url])
        register(service, carol, tokens[1])
        register(service, dave, tokens[2], relays=[registered.url])
        await eventually(
            lambda: relay_live(service, inbox.url, 1)
            and relay_live(service, general.url, 1)
            and relay_live(service, registered.url, 2)
            and relay_live(service, configured.url, 3),
            "every inbox relay subscribed",
        )

        to_alice = gift_wrap(bob, alice, "to alice's inbox")
        to_carol = kind4_dm(bob, carol, "to carol's read relay")
        to_dave = gift_wrap(bob, dave, "to dave's registration relay")
        await publish(inbox.url, to_alice)
        await publish(configured.url, to_alice)
        await publish(general.url, to_carol)
        await publish(registered.url, to_dave)
        ids = [to_alice["id"], to_carol["id"], to_dave["id"]]
        await eventually(
            lambda: all(wakeups(service)[i] == 1 and expects(service, i) for i in ids),
            "the three DMs pushed and their expect records written",
        )

        assert [r["relays"] for r in expects(service, to_alice["id"])] == [[inbox.url]]
        assert [r["relays"] for r in expects(service, to_carol["id"])] == [[general.url]]
        assert [r["relays"] for r in expects(service, to_dave["id"])] == [[registered.url]]
        first_seen = {
            r["event_id"]: r["ts"]
            for r in reversed(service.observation_records())
            if r["type"] == "seen"
        }
        for event_id in ids:
            assert expects(service, event_id)[0]["ts"] == first_seen[event_id]
        assert_private(
            service,
            [hex_of(k) for k in (alice, carol, dave, bob)]
            + [npub_of(k) for k in (alice, carol, dave, bob)]
            + tokens,
        )
