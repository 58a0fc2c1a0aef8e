"""A routing relay for the benches that stream DMs through whole `serve` processes
(bench/dm_path.py, bench/scale.py): a `websockets` server in a process of its own that answers
every REQ with EOSE and, on a control message, streams pre-signed DMs to every subscription
whose `#p` filter names the recipient, as a real relay matches every open subscription (events
for no subscriber are dropped). While a key moves between workers both may hold it for a
moment: routing it to the latest REQ alone lost it when the giver's later REQ, dropping the
key, removed the route the taker had made.

Control messages, each answered on the same connection:
- `["ROUTES"]` → `["ROUTES", n]`: how many keys some subscription names;
- `["LOAD", path]` → `["LOADED", n]`: read and parse a file of events (one JSON event a line,
  the recipient in its first tag) ahead of the measurement, so that streaming only looks up
  each recipient and sends (a cheap load generator);
- `["BENCH", path]` → `["DONE", n]`: stream the loaded file (then forget it), `n` being how
  many of its events had a subscriber.

Usage (as `RoutingRelay` starts it): python bench/routing_relay.py PORT_FILE
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

START_SECONDS = 30.0


async def run_relay(port_file: Path) -> None:
    """Serve on a free loopback port, written to `port_file`, until killed."""
    from websockets.asyncio.server import ServerConnection, serve
    from websockets.exceptions import ConnectionClosed

    routes: dict[str, dict[tuple[ServerConnection, str], None]] = {}
    subs: dict[tuple[ServerConnection, str], list[str]] = {}
    loaded: dict[str, list[tuple[str, str]]] = {}

    def forget(key: tuple[ServerConnection, str]) -> None:
        for pubkey in subs.pop(key, []):
            holders = routes.get(pubkey)
            if holders is not None:
                holders.pop(key, None)
                if not holders:
                    del routes[pubkey]

    def load(path: str) -> int:
        if path not in loaded:
            lines = Path(path).read_text().splitlines()
            loaded[path] = [(json.loads(line)["tags"][0][1], line) for line in lines]
        return len(loaded[path])

    async def stream(path: str) -> int:
        routed = 0
        for recipient, line in loaded.pop(path, []):
            holders = routes.get(recipient)
            if holders:
                for connection, sub_id in list(holders):
                    await connection.send(f'["EVENT","{sub_id}",{line}]')
                routed += 1
        return routed

    async def handler(ws: ServerConnection) -> None:
        try:
            async for text in ws:
                message = json.loads(text)
                if message[0] == "REQ":
                    key = (ws, message[1])
                    forget(key)
                    subs[key] = [p for f in message[2:] for p in f.get("#p", [])]
                    for pubkey in subs[key]:
                        routes.setdefault(pubkey, {})[key] = None
                    await ws.send(json.dumps(["EOSE", message[1]]))
                elif message[0] == "CLOSE":
                    forget((ws, message[1]))
                elif message[0] == "ROUTES":
                    await ws.send(json.dumps(["ROUTES", len(routes)]))
                elif message[0] == "LOAD":
                    await ws.send(json.dumps(["LOADED", load(message[1])]))
                elif message[0] == "BENCH":
                    await ws.send(json.dumps(["DONE", await stream(message[1])]))
        except ConnectionClosed:
            pass  # a SIGKILLed worker
        finally:
            for key in [k for k in subs if k[0] is ws]:
                forget(key)

    # no keepalive pings: a service far behind on a burst reads a ping's frame only after
    # everything sent before it, and a missed pong closed its connection mid-burst
    async with serve(handler, "127.0.0.1", 0, max_size=None, compression=None,
                     ping_interval=None) as server:
        port_file.write_text(str(next(iter(server.sockets)).getsockname()[1]))
        await asyncio.Future()


class RoutingRelay:
    """The relay process, started in `folder`, and the control messages a bench sends it."""

    def __init__(self, folder: Path) -> None:
        port_file = folder / "relay.port"
        self._process = subprocess.Popen(
            [sys.executable, __file__, str(port_file)], start_new_session=True
        )
        deadline = time.monotonic() + START_SECONDS
        while not port_file.exists() or not port_file.read_text():
            if time.monotonic() > deadline:
                raise TimeoutError("routing relay did not start")
            time.sleep(0.05)
        self.url = f"ws://127.0.0.1:{port_file.read_text()}"

    async def ask(self, *message: Any) -> Any:
        """Send one control message; returns the answer's value."""
        from websockets.asyncio.client import connect

        async with connect(self.url, proxy=None, max_size=None, ping_interval=None) as ws:
            await ws.send(json.dumps(list(message)))
            return json.loads(await ws.recv())[1]

    async def routes(self) -> int:
        """How many keys some subscription names."""
        return int(await self.ask("ROUTES"))

    async def load(self, events_file: Path) -> int:
        """Have the relay read and parse the file now, outside any measured window."""
        return int(await self.ask("LOAD", str(events_file)))

    async def stream(self, events_file: Path) -> int:
        """Send the file's events (loaded first if not yet); returns how many had a
        subscriber."""
        await self.load(events_file)
        return int(await self.ask("BENCH", str(events_file)))

    @property
    def pid(self) -> int:
        return self._process.pid

    def stop(self) -> None:
        os.killpg(self._process.pid, signal.SIGTERM)
        self._process.wait(10)


if __name__ == "__main__":
    import uvloop

    uvloop.run(run_relay(Path(sys.argv[1])))
