"""Iris watches' catch-up (issue 33): what an Iris subscription's REQs ask for after a restart
reaches back to where the relay was last read in full, and no further forward, however slowly
the relay answers those REQs; and a relay that caps its answers is paged, filter by filter.

A real `nostr-relay` process behind a thin layer (testkit.holding_relay) that can leave the
Iris watch REQs (`iw…`) unanswered, or a relay that caps each filter's answer and says so in
NIP-11 (testkit.paging_relay); a real `sigil-push serve` in dry-run on SQLite and on
PostgreSQL, subscriptions made through the Iris API as Iris makes them, events signed by
nostr-sdk.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import httpx
import nostr_sdk
import pytest

from testkit.bridge_harness import (
    eventually,
    health,
    metric,
    new_token,
    register,
    relay_live,
    wakeups,
)
from testkit.holding_relay import HoldingRelay
from testkit.iris_client import IrisClient
from testkit.nip98 import SdkUser
from testkit.nostr_client import hex_of, publish, signed_event
from testkit.paging_relay import PagingRelay
from testkit.processes import FAST_RECONNECT
from testkit.relay import RelayProcess
from testkit.service import ServiceProcess
from testkit.stores import Engine, fetch

pytestmark = pytest.mark.slow  # starts its own processes

DAY = 24 * 3600
CURSOR = "SELECT live_until FROM relay_cursors WHERE relay = ?"
PAGED_ONLY = FAST_RECONNECT + "negentropy = false\n"
"""The registration's shard is caught up by REQ alone: its EOSE is its catch-up's end."""


def _stored_cursor(service: ServiceProcess, url: str) -> int | None:
    rows = fetch(service.database, CURSOR, (url,))
    return int(rows[0][0]) if rows else None


def _watch_live(service: ServiceProcess, url: str) -> bool:
    try:
        state = health(service)["relays"].get(url)
    except (httpx.HTTPError, ValueError, KeyError):
        return False
    return bool(state and state.get("live"))


async def test_a_restart_while_a_watch_req_is_unanswered_skips_nothing(
    engine: Engine,
    start_relay: Callable[..., RelayProcess],
    start_service: Callable[..., ServiceProcess],
    http_of: Callable[[ServiceProcess], httpx.Client],
) -> None:
    """A 2.5-day outage, shrunk: the service is stopped and the state it saved set back as a
    service stopped 2.5 days ago would have left it (the relay's cursor, the target's
    registration time). A session key's kind 1060 dated 2.2 days ago lies in the catch-up
    window the watch REQ asks for on return. The service comes back and the relay leaves that
    REQ unanswered while it answers a registration's REQ (another user's DMs) in full; the relay
    must not count as read meanwhile, so the service stopped again keeps the old cursor, and
    its next start asks from there and pushes the message once. Before the cursor waited for
    the watch REQs' EOSE, the registration's EOSE made it "now", the next start asked only two
    days back, and the message was never pushed."""
    relay = start_relay("r")
    async with HoldingRelay(relay.url, prefix="iw") as proxy:
        service = await asyncio.to_thread(start_service, [proxy.url], PAGED_ONLY)
        register(service, nostr_sdk.Keys.generate(), new_token())
        me = SdkUser()
        iris = IrisClient(http_of(service), me, service.url)
        token, session = new_token(), nostr_sdk.Keys.generate()
        subscription = {"filter": {"kinds": [1060], "authors": [hex_of(session)]},
                        "fcm_tokens": [token]}
        assert iris.request("POST", "subscriptions/", subscription).status_code == 201
        await eventually(lambda: bool(proxy.passed), "the watch REQ sent")
        await eventually(lambda: relay_live(service, proxy.url), "the watch REQ answered")
        await asyncio.to_thread(service.stop)

        now = int(time.time())
        outage_began = now - 5 * DAY // 2
        fetch(service.database, "UPDATE relay_cursors SET live_until = ? WHERE relay = ?",
              (outage_began, proxy.url))
        fetch(service.database, "UPDATE devices SET registered_at = ? WHERE pubkey = ?",
              (outage_began - 3600, me.hex))
        message = signed_event(session, 1060, [["p", "ab" * 32]], "sent during the outage",
                               created_at=now - 11 * DAY // 5)
        await publish(relay.url, message)

        proxy.holding = True
        await asyncio.to_thread(service.start)
        await eventually(lambda: bool(proxy.held), "the watch REQ sent again, and held")
        await eventually(
            lambda: metric(service, "sigil_push_catchup_runs_total", method="req") >= 1,
            "the registration's REQ answered in full",
        )
        assert not _watch_live(service, proxy.url), "a watch REQ short of EOSE is not live"
        await asyncio.to_thread(service.stop)
        assert _stored_cursor(service, proxy.url) == outage_began, (
            "the cursor kept while the watch REQ had not reached EOSE"
        )
        assert wakeups(service)[message["id"]] == 0

        proxy.holding = False
        await asyncio.to_thread(service.start)
        await eventually(lambda: wakeups(service)[message["id"]] == 1,
                         "the outage's message pushed after the second start")
        await eventually(lambda: relay_live(service, proxy.url), "the watch REQ answered")
        await asyncio.to_thread(service.stop)
        cursor = _stored_cursor(service, proxy.url)
        assert cursor is not None and cursor >= now, "the cursor moves on once all are answered"
        assert wakeups(service)[message["id"]] == 1


async def test_a_long_outage_behind_a_capping_relay_is_paged_filter_by_filter(
    engine: Engine,
    start_service: Callable[..., ServiceProcess],
    http_of: Callable[[ServiceProcess], httpx.Client],
) -> None:
    """A relay answering at most 5 events per filter (NIP-11 `max_limit`, as strfry's 500):
    during an outage a session key sends 18 kind 1060 and strangers 18 kind 4 DMs `#p`-tagged
    to the subscriber, spread over the last hour (the subscriptions were made two hours
    before: their targets' registration time set back). After the restart every one of the 36
    is pushed exactly once: each filter is paged on its own (`until` = its oldest so far, one
    filter per page), where one REQ's answer used to stop at the newest 5 of each."""
    async with PagingRelay([], max_limit=5) as relay:
        service = await asyncio.to_thread(start_service, [relay.url])
        me = SdkUser()
        iris = IrisClient(http_of(service), me, service.url)
        session = nostr_sdk.Keys.generate()
        for subscription in (
            {"filter": {"kinds": [1060], "authors": [hex_of(session)]}, "fcm_tokens": [new_token()]},
            {"filter": {"kinds": [4], "#p": [me.hex]}, "fcm_tokens": [new_token()]},
        ):
            assert iris.request("POST", "subscriptions/", subscription).status_code == 201
        await eventually(lambda: len(relay.requests) >= 1, "the watch REQ sent")
        await eventually(lambda: relay_live(service, relay.url), "the watch REQs answered")
        await asyncio.to_thread(service.stop)

        now = int(time.time())
        fetch(service.database, "UPDATE devices SET registered_at = ? WHERE pubkey = ?",
              (now - 7200, me.hex))
        messages = [signed_event(session, 1060, [["p", "ab" * 32]], f"message {n}",
                                 created_at=now - 3500 + n * 190) for n in range(18)]
        strangers = [nostr_sdk.Keys.generate() for _ in range(3)]
        dms = [signed_event(strangers[n % 3], 4, [["p", me.hex]], f"dm {n}",
                            created_at=now - 3400 + n * 180) for n in range(18)]
        relay.events.extend(messages + dms)
        asked = len(relay.requests)

        await asyncio.to_thread(service.start)
        await eventually(
            lambda: all(wakeups(service)[e["id"]] >= 1 for e in messages + dms),
            "every event of the outage pushed",
        )
        await eventually(lambda: relay_live(service, relay.url), "the catch-up finished")
        pushed = wakeups(service)
        assert all(pushed[e["id"]] == 1 for e in messages + dms)
        pages = [filters for filters in relay.requests[asked:]
                 if len(filters) == 1 and "until" in filters[0]]
        assert any("authors" in f[0] for f in pages) and any("#p" in f[0] for f in pages), (
            "each filter paged on its own"
        )
        assert metric(service, "sigil_push_catchup_pages_total") >= 6
