"""The relay reader's socket (relays/reader_socket.py, aiohttp) keeps what the websockets reader
did: no redirects, verified TLS, a heartbeat that drops a relay that stops answering, messages
assembled from fragments in order, bad UTF-8 closed with 1007, and a congested handler that
stops the reading (the relay is then held at the TCP window, not buffered without bound)."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import ssl
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from websockets.asyncio.server import ServerConnection
from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

from sigil_push.nostr.keys import SecretKey
from sigil_push.observations import ObservationLog
from sigil_push.relays.connection import BridgeKeySigner, RelayConnection
from testkit.deadlines import scaled
from testkit.fakes.credentials import make_tls
from testkit.loopback_relay import LoopbackRelay


class Recorder:
    """A connection handler that records events; `congested` is set by the test."""

    def __init__(self) -> None:
        self.events: list[Any] = []
        self.downs = 0
        self.is_congested = False
        self.released = asyncio.Event()

    def on_open(self, connection: RelayConnection) -> None:
        asyncio.get_running_loop().create_task(connection.send(["REQ", "s1", {"kinds": [4]}]))

    def on_authenticated(self, connection: RelayConnection) -> None: ...

    def on_event(self, connection: RelayConnection, sub_id: str, raw: Any, ms: int) -> None:
        self.events.append(raw)

    def on_eose(self, connection: RelayConnection, sub_id: str) -> None: ...

    def on_closed(self, connection: RelayConnection, sub_id: str) -> None: ...

    def on_down(self, connection: RelayConnection) -> None:
        self.downs += 1

    def on_gated(self, connection: RelayConnection) -> None: ...

    def on_auth_failed(self, connection: RelayConnection) -> None: ...

    def congested(self, connection: RelayConnection) -> bool:
        return self.is_congested

    async def drained(self, connection: RelayConnection) -> None:
        await self.released.wait()
        self.is_congested = False


class ScriptedRelay(LoopbackRelay):
    """On the first REQ runs `script(ws)`; records the close code of every connection."""

    def __init__(
        self, script: Callable[[ServerConnection], Awaitable[None]],
        options: dict[str, Any] | None = None,
    ) -> None:
        self.script = script
        self.options = options or {}
        self.connections = 0
        self.close_codes: list[int | None] = []

    def _serve_options(self) -> dict[str, Any]:
        return {"max_size": None, **self.options}

    async def _handle(self, ws: ServerConnection) -> None:
        self.connections += 1
        try:
            async for text in ws:
                if json.loads(text)[0] == "REQ":
                    await self.script(ws)
        except ConnectionClosed:
            pass
        self.close_codes.append(ws.close_code)


def event_frame(number: int, padding: int = 0) -> str:
    return json.dumps(["EVENT", "s1", {"kind": 4, "n": number, "pad": "x" * padding}])


async def until(condition: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + scaled(timeout)
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


class RelayStates(ObservationLog):
    """The observation log, also keeping the `relay` records' details for the test to read."""

    def __init__(self, folder: Path) -> None:
        super().__init__(folder)
        self.details: list[str] = []

    def relay_state(self, relay: str, state: str, detail: str = "") -> None:
        self.details.append(detail)
        super().relay_state(relay, state, detail)


@pytest.fixture
def observations(tmp_path: Path) -> Iterator[RelayStates]:
    yield RelayStates(tmp_path / "obs")


def connect(
    url: str, handler: Recorder, observations: RelayStates, heartbeat_seconds: float = 30.0
) -> RelayConnection:
    connection = RelayConnection(url, handler, BridgeKeySigner(SecretKey.generate()),
                                 observations, reconnect_min_seconds=60,
                                 heartbeat_seconds=heartbeat_seconds)
    connection.start()
    return connection


async def test_a_redirect_is_refused_not_followed(observations: RelayStates) -> None:
    """The guard checked this URL; a 3xx to another relay ends the attempt."""

    async def events(ws: ServerConnection) -> None:
        await ws.send(event_frame(1))

    async with ScriptedRelay(events) as target:

        def redirect(connection: ServerConnection, request: Request) -> Response | None:
            if request.headers.get("Accept") == "application/nostr+json":
                return None
            return Response(302, "Found", Headers({"Location": target.url}), b"")

        async with ScriptedRelay(events, {"process_request": redirect}) as redirecting:
            handler = Recorder()
            connection = connect(redirecting.url, handler, observations)
            try:
                await until(lambda: 
                    "connect failed: WSServerHandshakeError" in observations.details
                )
                assert not connection.connected
                assert target.connections == 0 and handler.events == []
            finally:
                await connection.stop()


async def test_wss_verifies_the_relays_certificate(
    observations: RelayStates, tmp_path: Path
) -> None:
    """TLS is on for wss:// and checked: a certificate from an unknown CA is refused."""

    async def nothing(ws: ServerConnection) -> None: ...

    tls = make_tls(tmp_path)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(tls.cert_file, tls.key_file)
    async with ScriptedRelay(nothing, {"ssl": context}) as relay:
        url = relay.url.replace("ws://", "wss://")
        handler = Recorder()
        connection = connect(url, handler, observations)
        try:
            await until(lambda: 
                "connect failed: ClientConnectorCertificateError" in observations.details
            )
            assert relay.connections == 0 and not connection.connected
        finally:
            await connection.stop()


async def test_fragments_are_assembled_in_order_and_bad_utf8_closes_with_1007(
    observations: RelayStates,
) -> None:
    async def script(ws: ServerConnection) -> None:
        await ws.send(event_frame(1))
        text = event_frame(2, padding=3000)
        await ws.send([text[i:i + 1000] for i in range(0, len(text), 1000)])
        await ws.send(event_frame(3))
        # a text frame whose payload is not UTF-8, written raw
        ws.protocol.send_text(b'["NOTICE","\xff\xfe"]')
        ws.send_data()

    async with ScriptedRelay(script) as relay:
        handler = Recorder()
        connection = connect(relay.url, handler, observations)
        try:
            await until(lambda: bool(relay.close_codes))
            assert [e["n"] for e in handler.events] == [1, 2, 3]
            assert len(handler.events[1]["pad"]) == 3000
            assert relay.close_codes == [1007]
            await until(lambda: "closed code=1007" in observations.details)
        finally:
            await connection.stop()


async def test_a_relay_that_stops_answering_pings_is_dropped(observations: RelayStates) -> None:
    """A raw relay that completes the handshake and then goes silent, pongs included: with
    `bridge.relay_heartbeat_seconds` at 0.5 the socket is dropped."""
    silent: list[asyncio.StreamWriter] = []

    async def handshake_then_silence(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        request = await reader.readuntil(b"\r\n\r\n")
        headers = dict(
            line.split(": ", 1) for line in request.decode().split("\r\n")[1:] if ": " in line
        )
        if headers.get("Accept") == "application/nostr+json":
            writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
            writer.close()
            return
        accept = base64.b64encode(hashlib.sha1(
            headers["Sec-WebSocket-Key"].encode() + b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
        ).digest()).decode()
        writer.write(
            b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            + f"Sec-WebSocket-Accept: {accept}\r\n\r\n".encode()
        )
        silent.append(writer)
        await reader.read()  # reads (and ignores) whatever comes until the client hangs up

    server = await asyncio.start_server(handshake_then_silence, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    handler = Recorder()
    connection = connect(f"ws://127.0.0.1:{port}", handler, observations, heartbeat_seconds=0.5)
    try:
        await until(lambda: bool(silent) and connection.connected)
        await until(lambda: handler.downs == 1)
        assert "closed code=1006" in observations.details
    finally:
        await connection.stop()
        server.close()
        await server.wait_closed()


async def test_a_congested_handler_stops_the_reading(observations: RelayStates) -> None:
    """While the handler is congested nothing is dispatched past the congesting frame and the
    relay's backlog stops draining (well above what kernel buffers and aiohttp's 128 KiB queue
    hold: nothing is buffered without bound); once drained, every frame arrives in order."""
    frames = 16_000
    writers: list[ServerConnection] = []

    async def flood(ws: ServerConnection) -> None:
        for number in range(frames):
            ws.protocol.send_text(event_frame(number, padding=1000).encode())
        ws.send_data()  # about 17 MB handed to the transport at once: no flow control here
        writers.append(ws)

    async with ScriptedRelay(flood) as relay:
        handler = Recorder()
        handler.is_congested = True
        connection = connect(relay.url, handler, observations)
        try:
            await until(lambda: bool(writers))
            backlog = writers[0].transport.get_write_buffer_size
            stable_since, last = time.monotonic(), backlog()
            while time.monotonic() - stable_since < 1.0:  # a pace, not a deadline
                await asyncio.sleep(0.05)
                if backlog() != last:
                    stable_since, last = time.monotonic(), backlog()
            assert last > 4 << 20, "the relay's frames are not read while congested"
            assert len(handler.events) == 1
            handler.released.set()
            await until(lambda: len(handler.events) == frames)
            assert [e["n"] for e in handler.events] == list(range(frames))
        finally:
            await connection.stop()
