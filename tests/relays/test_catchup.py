"""Catch-up after a restart loses nothing on relays that cap their answers (issue 24).

The story of the issue, shrunk to run in seconds: users hold 1,500 DMs on a relay that answers
at most 500 events per filter, half of them NIP-17 gift wraps back-dated by up to two days;
the bridge stops, 30 new DMs arrive (half gift wraps: their `created_at` lies among the old
ones), the bridge starts again. Every one of the 30 must be queued exactly once, none of the
1,500 again, whether or not the relay publishes its limit in NIP-11:

- rust-nostr's relay caps silently and serves no NIP-11 (testkit/rust_relay.py);
- the paging relay publishes `max_limit` 500 and honours it (testkit/paging_relay.py).

Before paging followed each filter on its own until a page added nothing new, only 25-27 of
the 30 were pushed: the gift wraps back-dated below the first page's oldest kind 4 fell off.
The bridge runs in process on both store engines; its seen-id cache is kept tiny, so the
replayed history is decided by the database, and the 150 history DMs per user are far past
the per-recipient burst: a catch-up that spent quota on history would drop new DMs.
"""

from __future__ import annotations

import asyncio
import json
import random
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import nostr_sdk
import pytest
from prometheus_client import REGISTRY
from websockets.asyncio.server import ServerConnection
from websockets.datastructures import Headers
from websockets.http11 import Request, Response

from sigil_push.relays import nip77
from testkit.bridge_harness import eventually, new_token, register, relay_live, wakeups
from testkit.deadlines import scaled
from testkit.fakes.harness import eventually as poll
from testkit.in_process import InProcessBridge, in_process_bridge
from testkit.loopback_relay import ProxyRelay
from testkit.nostr_client import gift_wrap, hex_of, kind4_dm, user
from testkit.paging_relay import PagingRelay
from testkit.processes import FAST_RECONNECT, SHORT_LEASES
from testkit.rust_relay import FILTER_CAP, RustRelay
from testkit.service import ServiceProcess
from testkit.stores import Engine, new_postgres_database

USERS = 10
HISTORY = 1_500
NEW = 30
BRIDGE = {"seen_cache_size": 10}
"""Decide replayed history in the database, not in the cache warmed at start-up."""

Publish = Callable[[list[dict[str, Any]]], Awaitable[None]]


class NegentropyProxy(ProxyRelay):
    """rust-nostr's relay behind a proxy that advertises NIP-77 in NIP-11 (and no limits).
    `refuse`: every NEG-OPEN gets NEG-ERR, as several public relays do. Otherwise the first
    NEG-OPEN sets `reconciling` and is held there until `release` (the test then cuts every
    connection or stops the bridge); later ones pass. Everything else passes frame by frame."""

    def __init__(self, upstream: str, refuse: bool = True) -> None:
        super().__init__(upstream)
        self.refuse = refuse
        self.neg_opens = 0
        self.reconciling = asyncio.Event()
        self.release = asyncio.Event()

    def _serve_options(self) -> dict[str, Any]:
        def nip11(connection: ServerConnection, request: Request) -> Response | None:
            if request.headers.get("Upgrade", "").lower() == "websocket":
                return None
            body = json.dumps({"name": "says 77", "supported_nips": [1, 11, 42, 77]})
            return Response(200, "OK", Headers([("Content-Type", "application/nostr+json")]),
                            body.encode())

        return {"max_size": None, "process_request": nip11}

    async def client_frame(self, ws: ServerConnection, frame: str | bytes) -> bool:
        message = json.loads(frame)
        if message[0] == "NEG-OPEN":
            self.neg_opens += 1
            if self.refuse:
                await ws.send(json.dumps(["NEG-ERR", message[1], "blocked: no"]))
                return False
            if self.neg_opens == 1:
                self.reconciling.set()
                await self.release.wait()
        return not (self.refuse and message[0] == "NEG-CLOSE")


@asynccontextmanager
async def capping_relay(kind: str) -> AsyncIterator[tuple[str, Publish]]:
    """A relay answering at most 500 per filter: silently (rust-nostr's, with NIP-77 or
    behind a proxy refusing it), or saying so in NIP-11 (no NIP-77 at all)."""
    if kind.startswith("rust"):
        async with RustRelay() as rust:

            async def publish_rust(events: list[dict[str, Any]]) -> None:
                await rust.publish(*events)

            if kind == "rust_negentropy":
                yield rust.url, publish_rust
                return
            async with NegentropyProxy(rust.url) as proxy:
                yield proxy.url, publish_rust
        return
    async with PagingRelay([], max_limit=FILTER_CAP) as paging:

        async def publish_paging(events: list[dict[str, Any]]) -> None:
            paging.events.extend(events)

        yield paging.url, publish_paging


def direct_messages(
    senders: list[nostr_sdk.Keys], recipients: list[nostr_sdk.Keys], count: int, now: int
) -> list[dict[str, Any]]:
    """`count` DMs, half kind 4 spread over the last day, half gift wraps (back-dated up to
    two days by NIP-59 itself), round-robin over the recipients."""
    rng = random.Random(count)
    events = []
    for n in range(count):
        sender, recipient = senders[n % len(senders)], recipients[n % len(recipients)]
        if n % 2:
            events.append(gift_wrap(sender, recipient, f"wrap {n}"))
        else:
            created_at = now - rng.randrange(0, 24 * 3600)
            events.append(kind4_dm(sender, recipient, f"dm {n}", created_at=created_at))
    return events


async def queued_per_event(parts: InProcessBridge) -> dict[str, int]:
    rows = await parts.db.execute_fetchall(
        "SELECT event_id, COUNT(*) FROM outbox GROUP BY event_id", ()
    )
    return {str(event_id): int(count) for event_id, count in rows}


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def until_caught_up(parts: InProcessBridge, url: str, keys: int) -> None:
    await poll(
        lambda: parts.bridge.health()[url]["live"] and parts.bridge.health()[url]["keys"] == keys,
        timeout=60, what="every REQ and page past EOSE",
    )


@pytest.mark.parametrize("relay_kind", ["rust_negentropy", "rust_refuses_77", "nip11_limit"])
async def test_a_restart_catches_up_every_dm_behind_a_capped_answer_exactly_once(
    tmp_path: Path, engine: Engine, relay_kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`rust_negentropy`: the restart reconciles with NIP-77 and fetches just the 30 by id.
    `rust_refuses_77` (NEG-ERR, though NIP-11 lists 77) and `nip11_limit` (no answer to
    NEG-OPEN at all) fall back to paged REQ, which must find the 30 behind the caps."""
    monkeypatch.setattr(nip77, "INITIAL_TIMEOUT_SECONDS", 1.5)
    recipients, senders = [user() for _ in range(USERS)], [user() for _ in range(3)]
    now = int(time.time())
    history = direct_messages(senders, recipients, HISTORY, now)
    database = engine.database("push.db")
    async with capping_relay(relay_kind) as (url, publish):
        await publish(history)
        async with in_process_bridge(tmp_path, database, [{"url": url}], BRIDGE) as parts:
            for n, recipient in enumerate(recipients):
                await parts.devices.register(
                    hex_of(recipient), "android", f"fcm-{n}", "opaque", (), None, 0
                )
            await poll(lambda: len(parts.bridge._registry.keys) == USERS, what="keys watched")
            await until_caught_up(parts, url, USERS)
            assert await queued_per_event(parts) == {}, "history predates the registrations"

        fresh = direct_messages(senders, recipients, NEW, now)
        await publish(fresh)
        pages_before = metric("sigil_push_catchup_pages_total", relay=url)

        async with in_process_bridge(tmp_path, database, [{"url": url}], BRIDGE) as parts:
            fresh_ids = {event["id"] for event in fresh}

            async def all_queued() -> bool:
                return set(await queued_per_event(parts)) >= fresh_ids

            await poll(all_queued, timeout=60, what="every new DM queued")
            await until_caught_up(parts, url, USERS)
            queued = await queued_per_event(parts)
            assert queued == dict.fromkeys(fresh_ids, 1), (
                "the 30 new DMs once each, none of the 1,500 seen before"
            )
            assert metric("sigil_push_bridge_events_dropped_total", relay=url,
                          reason="recipient_quota") == 0, "history spent no quota"
            fetched = {method: metric("sigil_push_catchup_events_fetched_total", relay=url,
                                      method=method) for method in ("negentropy", "req")}
            if relay_kind == "rust_negentropy":
                assert metric("sigil_push_catchup_runs_total", relay=url,
                              method="negentropy") >= 1
                assert fetched["negentropy"] == NEW, "only the missing events, by id"
                assert parts.bridge._pool.negentropy_support[url] is True
            else:
                assert metric("sigil_push_catchup_pages_total", relay=url) > pages_before
                assert metric("sigil_push_catchup_runs_total", relay=url, method="req") >= 1
                # the paging relay ignores `limit` 0 and pages the window itself, while its
                # silence to NEG-OPEN runs out (1.5 s here) in the background
                reason = "neg_err" if relay_kind == "rust_refuses_77" else "timeout"
                await poll(lambda: metric("sigil_push_catchup_fallbacks_total", relay=url,
                                          reason=reason) >= 1, what="the fallback counted")
                assert parts.bridge._pool.negentropy_support[url] is False


async def _story(
    tmp_path: Path, engine: Engine,
    interrupt: Callable[[NegentropyProxy, InProcessBridge], Awaitable[None]],
) -> tuple[str, NegentropyProxy]:
    """History, a bridge stop, new DMs, a restart whose first reconciliation is held at the
    relay and `interrupt`ed; then (on the same bridge or a new one) every new DM must be
    queued exactly once. Returns the relay URL and proxy for further checks."""
    recipients, senders = [user() for _ in range(USERS)], [user() for _ in range(3)]
    now = int(time.time())
    history = direct_messages(senders, recipients, 600, now)
    fresh = direct_messages(senders, recipients, NEW, now)
    database = engine.database("push.db")
    async with RustRelay() as rust, NegentropyProxy(rust.url, refuse=False) as proxy:
        url = proxy.url
        await rust.publish(*history)
        async with in_process_bridge(tmp_path, database, [{"url": url}], BRIDGE) as parts:
            for n, recipient in enumerate(recipients):
                await parts.devices.register(
                    hex_of(recipient), "android", f"fcm-{n}", "opaque", (), None, 0
                )
            await poll(lambda: len(parts.bridge._registry.keys) == USERS, what="keys watched")
            await until_caught_up(parts, url, USERS)
        await rust.publish(*fresh)
        fresh_ids = {event["id"] for event in fresh}
        async with in_process_bridge(tmp_path, database, [{"url": url}], BRIDGE) as parts:
            await asyncio.wait_for(proxy.reconciling.wait(), scaled(30))
            await interrupt(proxy, parts)
            proxy.release.set()
        async with in_process_bridge(tmp_path, database, [{"url": url}], BRIDGE) as parts:

            async def all_queued() -> bool:
                return set(await queued_per_event(parts)) >= fresh_ids

            await poll(all_queued, timeout=60, what="every new DM queued")
            await until_caught_up(parts, url, USERS)
            assert await queued_per_event(parts) == dict.fromkeys(fresh_ids, 1)
            assert parts.bridge._pool.negentropy_support.get(url) is True
        return url, proxy


async def test_a_reconnect_in_the_middle_of_reconciliation_loses_nothing(
    tmp_path: Path, engine: Engine
) -> None:
    """Both the shared connection and the reconciliation's socket drop while the relay holds
    the first NEG-OPEN: the half-done catch-up is dropped (its REQ is gone), the reconnect
    reconciles again, and the 30 new DMs are queued exactly once."""

    async def cut(proxy: NegentropyProxy, parts: InProcessBridge) -> None:
        await proxy.cut()
        proxy.release.set()
        await poll(lambda: proxy.neg_opens >= 2, timeout=60, what="a second reconciliation")
        await until_caught_up(parts, proxy.url, USERS)

    await _story(tmp_path, engine, cut)


async def test_a_restart_while_catching_up_loses_nothing(tmp_path: Path, engine: Engine) -> None:
    """The bridge stops while its first reconciliation after a restart is held at the relay:
    nothing of it was committed, so the next start reconciles again and queues each new DM
    once; a stopped reconciliation leaves no socket behind."""

    async def stop_now(proxy: NegentropyProxy, parts: InProcessBridge) -> None:
        return None

    await _story(tmp_path, engine, stop_now)
    assert not any(reconciler.open for reconciler in nip77._ALL.live)


@pytest.mark.slow
async def test_a_sigkilled_worker_while_reconciling_loses_nothing_on_postgres(
    tmp_path: Path, postgres_server: Any
) -> None:
    """PostgreSQL only (a worker's shards and their leases are that engine's story): a
    `serve` worker is SIGKILLed while the relay holds its first reconciliation after a
    restart; started again once its leases lapse, it reconciles anew and each DM of the outage
    wakes its device exactly once, none of the history."""
    database = new_postgres_database(postgres_server)
    recipients, senders = [user() for _ in range(3)], [user() for _ in range(2)]
    now = int(time.time())
    history = direct_messages(senders, recipients, 60, now)
    fresh = direct_messages(senders, recipients, 10, now)
    async with RustRelay() as rust, NegentropyProxy(rust.url, refuse=False) as proxy:
        await rust.publish(*history)
        service = ServiceProcess(tmp_path / "worker", [proxy.url],
                                 FAST_RECONNECT + SHORT_LEASES, database=database)
        try:
            await asyncio.to_thread(service.start)
            for recipient in recipients:
                await asyncio.to_thread(register, service, recipient, new_token())
            await eventually(lambda: relay_live(service, proxy.url, len(recipients)),
                             "baselined", 60)
            await asyncio.to_thread(service.stop)
            await rust.publish(*fresh)
            await asyncio.to_thread(service.start)
            await asyncio.wait_for(proxy.reconciling.wait(), scaled(60))
            assert await asyncio.to_thread(service.stop, signal.SIGKILL) == -9
            proxy.release.set()
            await asyncio.to_thread(service.start)
            await eventually(
                lambda: all(wakeups(service)[event["id"]] >= 1 for event in fresh),
                "every DM of the outage pushed", 90,
            )
            await eventually(lambda: relay_live(service, proxy.url, len(recipients)),
                             "caught up", 60)
            pushed = wakeups(service)
            assert all(pushed[event["id"]] == 1 for event in fresh)
            assert not any(pushed[event["id"]] for event in history)
            assert proxy.neg_opens >= 2, "the killed reconciliation was done again"
        finally:
            await asyncio.to_thread(service.stop)
