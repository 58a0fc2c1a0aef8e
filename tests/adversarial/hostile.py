"""Hostile peers on 127.0.0.1 for the adversarial suite: a websocket "relay" that records what
it receives and answers as a test tells it to, and an HTTP server for NIP-11 tricks."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from websockets.asyncio.server import ServerConnection, serve

from sigil_push.nostr.keys import SecretKey
from sigil_push.observations import ObservationLog
from sigil_push.relays.connection import BridgeKeySigner, RelayConnection
from testkit import deadlines
from tests.relays.test_relay_auth import Recorder


@dataclass
class HostileRelay:
    """Every frame received (decoded), and every connection seen, for assertions."""

    port: int = 0
    frames: list[Any] = field(default_factory=list)
    connections: int = 0
    open_now: int = 0
    sockets: list[ServerConnection] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}"

    def sent(self, verb: str) -> list[list[Any]]:
        return [f for f in self.frames if isinstance(f, list) and f[:1] == [verb]]


OnFrame = Callable[[HostileRelay, ServerConnection, Any], Awaitable[None]]


async def _ignore(relay: HostileRelay, ws: ServerConnection, frame: Any) -> None:
    return None


@asynccontextmanager
async def hostile_relay(on_frame: OnFrame = _ignore, on_open: Callable[[ServerConnection], Awaitable[None]] | None = None,
                        ) -> AsyncIterator[HostileRelay]:
    relay = HostileRelay()

    async def handler(ws: ServerConnection) -> None:
        relay.connections += 1
        relay.open_now += 1
        relay.sockets.append(ws)
        try:
            if on_open is not None:
                await on_open(ws)
            async for raw in ws:
                frame = json.loads(raw)
                relay.frames.append(frame)
                await on_frame(relay, ws, frame)
        except Exception as exc:  # noqa: BLE001 - a hostile peer just stops, noting why
            relay.errors.append(repr(exc))
        finally:
            relay.open_now -= 1

    async with serve(handler, "127.0.0.1", 0, max_size=None) as server:
        relay.port = next(iter(server.sockets)).getsockname()[1]
        yield relay


async def eventually(
    check: Callable[[], bool], what: str, timeout: float = deadlines.CONDITION_SECONDS
) -> None:
    """Polls `check` until it holds; `timeout` is scaled (testkit.deadlines)."""
    await deadlines.eventually(check, what, timeout)


@asynccontextmanager
async def bridge_connection(relay: HostileRelay, folder: Path) -> AsyncIterator[RelayConnection]:
    """A real `RelayConnection` of the bridge to `relay` (its own key answering AUTH, its
    records in `folder`), started and stopped around the block; no store."""
    connection = RelayConnection(
        relay.url, Recorder(), BridgeKeySigner(SecretKey.generate()), ObservationLog(folder / "obs")
    )
    connection.start()
    try:
        yield connection
    finally:
        await connection.stop()
