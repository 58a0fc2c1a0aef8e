"""The outbound guard against user-chosen destinations (issue 9, items 2 and 6).

Real loopback servers stand in for "internal" services: a strict guard must never reach them,
the permissive one (the test switch) must, and our size limit holds whatever the peer says.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from http import HTTPStatus

import pytest
from aiohttp import web
from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.http11 import Request, Response

from sigil_push import outbound
from sigil_push.nostr.event import sign_event
from sigil_push.nostr.keys import SecretKey
from sigil_push.outbound import BlockedDestination, OutboundGuard, configure, open_relay_socket
from sigil_push.relays.connection import BridgeKeySigner
from sigil_push.relays.discovery import normalize_relay_url
from sigil_push.relays.nip11 import FETCH_TIMEOUT_SECONDS, RelayLimits, fetch_limits
from sigil_push.relays.publish import publish
from tests.adversarial.fake_dns import FakeDns
from tests.adversarial.hostile import eventually, hostile_relay

STRICT = OutboundGuard(allow_private=False)


@pytest.mark.parametrize("host", [
    "127.0.0.1", "127.1", "2130706433", "0x7f000001", "[::1]", "[::ffff:127.0.0.1]", "localhost",
    "10.0.0.1", "192.168.1.1", "169.254.169.254", "[fe80::1]", "0.0.0.0", "intranet",
    "printer.local", "[64:ff9b::7f00:1]",
])
async def test_strict_guard_refuses_non_public_destinations(host: str) -> None:
    with pytest.raises(BlockedDestination) as refused:
        await STRICT.check(f"wss://{host}:7447/", "relay")
    assert str(refused.value) == "blocked"


async def test_strict_guard_refuses_plain_text_even_to_public_addresses() -> None:
    with pytest.raises(BlockedDestination):
        await STRICT.check("ws://1.1.1.1/", "relay")


async def test_loopback_relay_is_never_contacted_without_the_test_switch() -> None:
    async with hostile_relay() as relay:
        for url in (relay.url, relay.url.replace("ws://", "wss://"),
                    f"wss://localhost:{relay.port}", f"wss://127.1:{relay.port}"):
            with pytest.raises(BlockedDestination):
                async with open_relay_socket(url, STRICT):
                    pass
        assert relay.connections == 0
        async with open_relay_socket(relay.url, OutboundGuard(allow_private=True)) as ws:
            await ws.send('["CLOSE","x"]')
        await eventually(lambda: relay.connections == 1, "the test switch lets loopback through")


async def test_trusted_operator_relay_passes_a_strict_guard() -> None:
    async with hostile_relay() as relay:
        guard = OutboundGuard.for_urls(False, [relay.url])
        async with open_relay_socket(relay.url, guard) as ws:
            await ws.send('["CLOSE","x"]')
        await eventually(lambda: relay.connections == 1, "configured relay reached")


async def test_connections_per_host_are_capped_and_released() -> None:
    guard = OutboundGuard(allow_private=True, per_host=2)
    async with hostile_relay() as relay:
        async with open_relay_socket(relay.url + "/a", guard), open_relay_socket(relay.url + "/b", guard):
            with pytest.raises(BlockedDestination):
                async with open_relay_socket(relay.url + "/c", guard):
                    pass
            assert guard.open_count("127.0.0.1", "relay") == 2
        assert guard.open_count("127.0.0.1", "relay") == 0
        async with open_relay_socket(relay.url + "/c", guard):
            pass
        assert relay.connections == 3


def test_query_variants_of_one_relay_are_one_url() -> None:
    variants = {normalize_relay_url(f"wss://relay.example.com/?x={i}", False) for i in range(50)}
    variants |= {normalize_relay_url("wss://RELAY.example.com:443", False),
                 normalize_relay_url("wss://relay.example.com/#frag", False) or "wss://relay.example.com"}
    assert variants == {"wss://relay.example.com"}


async def test_our_frame_limit_holds_whatever_the_peer_advertises() -> None:
    """A relay advertising max_message_length 10^12 in NIP-11 cannot raise what we accept."""

    async def flood(ws: ServerConnection) -> None:
        await ws.send("x" * (64 * 1024))

    guard = OutboundGuard(allow_private=True, max_frame_bytes=16 * 1024)
    async with hostile_relay(on_open=flood) as relay:
        async with open_relay_socket(relay.url, guard, max_size=10**12) as ws:
            with pytest.raises(ConnectionClosed) as closed:
                await ws.recv()
        assert closed.value.sent is not None and closed.value.sent.code == 1009


# -- NIP-11 -------------------------------------------------------------------------------


async def _http_server(app: web.Application) -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, port


async def _nip11_server(path: str) -> tuple[web.AppRunner, int, list[str]]:
    """A server with a NIP-11 document (max_subscriptions 1) at `path`; the list gets the path
    of every request it answers, so a test can assert it was (never) asked."""
    hits: list[str] = []

    async def document(request: web.Request) -> web.Response:
        hits.append(request.path)
        return web.json_response({"limitation": {"max_subscriptions": 1}})

    app = web.Application()
    app.router.add_get(path, document)
    runner, port = await _http_server(app)
    return runner, port, hits


async def test_nip11_redirect_is_not_followed() -> None:
    internal_runner, internal_port, hits = await _nip11_server("/admin")

    async def redirect(request: web.Request) -> web.Response:
        raise web.HTTPFound(f"http://127.0.0.1:{internal_port}/admin")

    relay_app = web.Application()
    relay_app.router.add_get("/", redirect)
    relay_runner, relay_port = await _http_server(relay_app)
    try:
        limits = await fetch_limits(f"ws://127.0.0.1:{relay_port}", OutboundGuard(allow_private=True))
        assert limits == RelayLimits()
        assert hits == []
    finally:
        await relay_runner.cleanup()
        await internal_runner.cleanup()


async def test_nip11_to_a_private_address_is_never_requested() -> None:
    runner, port, hits = await _nip11_server("/")
    try:
        assert await fetch_limits(f"wss://127.0.0.1:{port}", STRICT) == RelayLimits()
        assert await fetch_limits(f"ws://127.0.0.1:{port}", OutboundGuard(allow_private=True)) == RelayLimits(
            max_subscriptions=1
        )
        assert hits == ["/"]
    finally:
        await runner.cleanup()


async def _respond(body: bytes) -> web.Response:
    return web.Response(body=body, headers={"Content-Type": "application/nostr+json"})


@pytest.mark.slow  # waits on the real NIP-11 fetch timeout
async def test_nip11_slow_dribble_and_huge_body_are_cut_off() -> None:
    async def dribble(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "application/nostr+json"})
        await response.prepare(request)
        while True:
            await response.write(b" ")
            await asyncio.sleep(0.5)

    async def huge(request: web.Request) -> web.Response:
        padding = " " * (10 * 1024 * 1024)
        return web.Response(body=json.dumps({"limitation": {"max_subscriptions": 1}, "x": padding}))

    async def nested(request: web.Request) -> web.Response:
        # past Python's recursion limit: json.loads raises RecursionError, not ValueError
        return await _respond(b"[" * 5000 + b"]" * 5000)

    app = web.Application()
    app.router.add_get("/slow", dribble)
    app.router.add_get("/huge", huge)
    app.router.add_get("/nested", nested)
    runner, port = await _http_server(app)
    guard = OutboundGuard(allow_private=True)
    try:
        loop = asyncio.get_running_loop()
        started = loop.time()
        assert await fetch_limits(f"ws://127.0.0.1:{port}/slow", guard) == RelayLimits()
        # one overall deadline, not one per read: a byte every 0.5 s would otherwise go on forever
        assert loop.time() - started < FETCH_TIMEOUT_SECONDS + 5
        assert await fetch_limits(f"ws://127.0.0.1:{port}/huge", guard) == RelayLimits()
        assert await fetch_limits(f"ws://127.0.0.1:{port}/nested", guard) == RelayLimits()
        assert guard.open_count("127.0.0.1", "nip11") == 0
    finally:
        await runner.cleanup()


def test_the_default_guard_is_strict_outside_tests() -> None:
    assert outbound.OutboundGuard().allow_private is False


async def test_names_are_resolved_and_the_checked_address_pinned() -> None:
    """The name's addresses are checked all-or-nothing and the one checked is the one used.
    The guard's resolver asks a name server on 127.0.0.1 (a test cannot own public DNS)."""
    records = {"relay.test": ["93.184.216.34"], "rebind.test": ["93.184.216.34", "127.0.0.1"]}
    async with FakeDns(records) as dns:
        outbound.use_nameservers([dns.server])
        try:
            target, pinned = await STRICT.check("wss://relay.test/", "relay")
            assert (target.host, target.port, pinned) == ("relay.test", 443, "93.184.216.34")
            with pytest.raises(BlockedDestination):
                await STRICT.check("wss://rebind.test/", "relay")
        finally:
            outbound.use_nameservers(None)
        assert dns.queries["relay.test"] >= 1


@pytest.mark.slow  # waits on the real DNS timeout
async def test_a_silent_name_server_stalls_nobody_and_its_lookups_end() -> None:
    """A name server that never answers once held the guard's 8 lookup threads after their
    callers gave up, stalling every new relay connection and UnifiedPush send. Lookups are
    c-ares queries now: a caller that gives up cancels its query, each requester has its own
    bound, and a later lookup of a good name answers at once."""
    async with FakeDns({"good.test": ["93.184.216.34"]}, silent={"slow.test"}) as dns:
        outbound.use_nameservers([dns.server])
        try:
            stuck = [asyncio.create_task(outbound.getaddrinfo("slow.test", 443, requester="relay"))
                     for _ in range(outbound.LOOKUPS_PER_REQUESTER * 3)]
            await eventually(lambda: dns.queries["slow.test"] >= 1, "the slow lookups asked")
            # another requester is not queued behind them
            started = asyncio.get_running_loop().time()
            answer = await outbound.getaddrinfo("good.test", 443, requester="unifiedpush")
            assert answer[0][4][0] == "93.184.216.34"
            assert asyncio.get_running_loop().time() - started < outbound.DNS_TIMEOUT_SECONDS
            # callers giving up cancel their queries, and the requester's bound is free again
            for task in stuck:
                task.cancel()
            await asyncio.gather(*stuck, return_exceptions=True)
            answer = await asyncio.wait_for(
                outbound.getaddrinfo("good.test", 443, requester="relay"),
                outbound.DNS_TIMEOUT_SECONDS,
            )
            assert answer[0][4][0] == "93.184.216.34"
            # a lookup nobody cancels ends by itself, as an OSError its callers survive
            with pytest.raises(OSError):
                await outbound.getaddrinfo("slow.test", 443, requester="relay")
        finally:
            outbound.use_nameservers(None)


@asynccontextmanager
async def redirecting_to(location: str) -> AsyncIterator[int]:
    """A websocket server on a port of its own (yielded) answering every handshake with a 302
    to `location`: a relay trying to send the bridge somewhere else."""

    def redirect(connection: ServerConnection, request: Request) -> Response:
        response = connection.respond(HTTPStatus.FOUND, "")
        response.headers["Location"] = location
        return response

    async with serve(lambda ws: ws.close(), "127.0.0.1", 0, process_request=redirect) as server:
        yield next(iter(server.sockets)).getsockname()[1]


async def test_websocket_redirect_is_not_followed() -> None:
    """Even under the test switch (where nothing is pinned), a relay's 302 ends the attempt."""
    async with hostile_relay() as target:
        async with redirecting_to(target.url) as port:
            with pytest.raises(InvalidStatus):
                async with open_relay_socket(f"ws://127.0.0.1:{port}", OutboundGuard(allow_private=True)):
                    pass
        assert target.connections == 0


async def test_configured_relay_nip11_is_fetched_under_a_strict_guard() -> None:
    async def document(request: web.Request) -> web.Response:
        return web.json_response({"limitation": {"max_filters": 3}})

    app = web.Application()
    app.router.add_get("/", document)
    runner, port = await _http_server(app)
    try:
        guard = OutboundGuard.for_urls(False, [f"ws://127.0.0.1:{port}"])
        assert await fetch_limits(f"ws://127.0.0.1:{port}", guard) == RelayLimits(max_filters=3)
    finally:
        await runner.cleanup()


async def test_canary_publishing_goes_through_the_guard() -> None:
    """The canary once opened a plain websockets connection, which followed a relay's redirect
    (up to 10 of them) wherever it pointed; now a redirect ends the publish as `connect`, and
    the strict guard refuses a loopback relay outright."""
    async with hostile_relay() as target:
        async with redirecting_to(target.url) as port:
            key = SecretKey.generate()
            event = sign_event(key, 4, "probe", [["p", key.public_key_hex]])
            result = await publish(f"ws://127.0.0.1:{port}", event, BridgeKeySigner(key), 10.0)
        assert result.reason == "connect"
        assert target.connections == 0
        configure(STRICT)
        result = await publish(target.url, event, BridgeKeySigner(key), 10.0)
        assert result.reason == "connect" and target.connections == 0
