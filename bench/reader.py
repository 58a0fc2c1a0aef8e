"""Per-frame CPU of the relay reader: what one text frame costs before the bridge sees it.

A sender process (pinned to its own core) opens a websocket server on loopback and, once a
client is connected, writes `--frames` pre-encoded text frames (firehose kind 4 EVENT frames,
about 560 bytes each) as fast as the socket takes them. The client, in a fresh process pinned
to the other core and running uvloop as `serve` does, reads them with one of these readers and
hands each frame's text to a no-op callback; its CPU time (`time.process_time`, so the other
engineers' load does not count) from the first frame to the last is divided by the frames:

  websockets — `async for frame in ws` on websockets' asyncio ClientConnection (the reader
               before this benchmark);
  aiohttp    — the bridge's reader now: relays/reader_socket.py (aiohttp's ws_connect, C frame
               reader) and the `receive()` loop of RelayConnection;
  picows     — picows (Cython), WSListener.on_ws_frame: the fastest, not a dependency.

`--scan` also runs the bridge's firehose scan (the registered-key regex and its lookups) on
each frame, so the reader's share and the scan's share can be told apart.

Usage: python bench/reader.py [--frames 200000] [--repeat 5] [--only websockets,aiohttp,picows]
Writes bench/results/reader.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

RESULTS = ROOT / "bench" / "results" / "reader.json"
CLIENT_CORE, SENDER_CORE = 0, 1
READERS = ("websockets", "aiohttp", "picows")


def pin(core: int) -> None:
    if hasattr(os, "sched_setaffinity") and core < (os.cpu_count() or 1):
        os.sched_setaffinity(0, {core})


def sample_frames(count: int) -> list[str]:
    """Realistic firehose frames: signed kind 4 DMs to keys that are not registered."""
    from sigil_push.nostr.event import sign_event
    from sigil_push.nostr.keys import SecretKey

    keys = [SecretKey.generate() for _ in range(20)]
    now = int(time.time())
    frames = []
    for i in range(count):
        event = sign_event(
            keys[i % 20], 4, os.urandom(48).hex() + "?iv=" + os.urandom(12).hex(),
            [["p", os.urandom(32).hex()]], now - i,
        )
        frames.append('["EVENT","s0",' + json.dumps(event.to_json(), separators=(",", ":")) + "]")
    return frames


# sender -------------------------------------------------------------------------------


async def run_sender(port_file: Path, frames: int) -> None:
    from websockets.asyncio.server import ServerConnection, serve
    from websockets.frames import Frame, Opcode

    sample = sample_frames(100)
    blob = b"".join(
        Frame(Opcode.TEXT, text.encode()).serialize(mask=False)
        for text in sample
    )

    async def handler(ws: ServerConnection) -> None:
        await ws.recv()  # the client says it is ready
        transport = ws.transport
        for _ in range(frames // len(sample)):
            transport.write(blob)
            while transport.get_write_buffer_size() > 1 << 20:
                await asyncio.sleep(0.0005)
        await ws.wait_closed()

    async with serve(handler, "127.0.0.1", 0, compression=None, max_size=None) as server:
        port_file.write_text(str(next(iter(server.sockets)).getsockname()[1]))
        await asyncio.Future()


# readers ------------------------------------------------------------------------------


class Meter:
    """Counts frames; CPU time from the first to the last."""

    def __init__(self, total: int, on_text: Callable[[str], Any]) -> None:
        self.total = total
        self.count = 0
        self.cpu_first = 0.0
        self.cpu_last = 0.0
        self.done = asyncio.get_running_loop().create_future()
        self._on_text = on_text

    def frame(self, text: str) -> None:
        if self.count == 0:
            self.cpu_first = time.process_time()
        self._on_text(text)
        self.count += 1
        if self.count == self.total:
            self.cpu_last = time.process_time()
            self.done.set_result(None)


async def read_websockets(url: str, meter: Meter) -> None:
    from websockets.asyncio.client import connect

    async with connect(url, proxy=None, compression=None, max_size=4 << 20) as ws:
        await ws.send("go")
        async for frame in ws:
            meter.frame(frame)  # type: ignore[arg-type]
            if meter.done.done():
                return


async def read_aiohttp(url: str, meter: Meter) -> None:
    """The bridge's own reader socket (relays/reader_socket.py) and receive loop."""
    from aiohttp import WSMsgType

    from sigil_push import outbound
    from sigil_push.relays.reader_socket import open_reader

    outbound.configure(outbound.OutboundGuard(allow_private=True))
    async with open_reader(url, purpose="relay", max_size=4 << 20, open_timeout=10,
                           heartbeat=30, user_agent="bench") as ws:
        await ws.send_str("go")
        receive = ws.receive
        while not meter.done.done():
            message = await receive()
            if message.type is WSMsgType.TEXT:
                meter.frame(message.data)


async def read_picows(url: str, meter: Meter) -> None:
    from picows import WSFrame, WSListener, WSMsgType, WSTransport, ws_connect

    class Listener(WSListener):  # type: ignore[misc]
        def on_ws_frame(self, transport: WSTransport, frame: WSFrame) -> None:
            if frame.msg_type == WSMsgType.TEXT:
                meter.frame(frame.get_payload_as_utf8_text())

    transport, _ = await ws_connect(Listener, url, max_frame_size=4 << 20)
    transport.send(WSMsgType.TEXT, b"go")
    await meter.done
    transport.disconnect()


def scanner() -> Callable[[str], Any]:
    """The bridge's firehose scan over a frame, against 1,000 registered keys (none match)."""
    addressing = re.compile(r'"p"\s*,\s*"([0-9a-f]{64})"|"kind"\s*:\s*(10050|10002)\b')
    keys = {os.urandom(32).hex(): 1 for _ in range(1000)}

    def scan(text: str) -> bool:
        for key, list_kind in addressing.findall(text):
            if list_kind or key in keys:
                return False
        return True

    return scan


async def run_client(name: str, url: str, frames: int, scan: bool) -> dict[str, Any]:
    meter = Meter(frames, scanner() if scan else (lambda text: None))
    reader = {
        "websockets": read_websockets,
        "aiohttp": read_aiohttp,
        "picows": read_picows,
    }[name]
    await asyncio.wait_for(reader(url, meter), 300)
    cpu = meter.cpu_last - meter.cpu_first
    return {"reader": name, "frames": frames, "scan": scan,
            "cpu_us_per_frame": round(cpu / (frames - 1) * 1e6, 3)}


# driver -------------------------------------------------------------------------------


def one_run(name: str, frames: int, scan: bool, callgrind: bool = False) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as folder:
        port_file = Path(folder) / "port"
        sender = subprocess.Popen([sys.executable, __file__, "--sender", "--port-file",
                                   str(port_file), "--frames", str(frames)])
        try:
            deadline = time.monotonic() + 30
            while not port_file.exists() or not port_file.read_text():
                if time.monotonic() > deadline:
                    raise TimeoutError("sender did not start")
                time.sleep(0.05)
            command = [sys.executable, __file__, "--client", name, "--frames", str(frames),
                       "--url", f"ws://127.0.0.1:{port_file.read_text()}"]
            if scan:
                command.append("--scan")
            if not callgrind:
                output = subprocess.run(command, check=True, capture_output=True, text=True)
                return dict(json.loads(output.stdout.strip().splitlines()[-1]))
            counted = subprocess.run(
                ["valgrind", "--tool=callgrind", f"--callgrind-out-file={folder}/cg.out",
                 *command], check=True, capture_output=True, text=True,
            ).stderr
            collected = re.search(r"Collected : (\d+)", counted)
            assert collected is not None, counted
            return {"instructions": int(collected.group(1))}
        finally:
            sender.terminate()
            sender.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=200_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--only", default=",".join(READERS))
    parser.add_argument("--sender", action="store_true")
    parser.add_argument("--client", choices=READERS)
    parser.add_argument("--scan", action="store_true")
    parser.add_argument("--callgrind", action="store_true")
    parser.add_argument("--port-file", type=Path)
    parser.add_argument("--url")
    args = parser.parse_args()
    if args.sender:
        pin(SENDER_CORE)
        asyncio.run(run_sender(args.port_file, args.frames))
        return
    if args.client:
        import uvloop

        from sigil_push.http.server import tune_gc

        pin(CLIENT_CORE)
        tune_gc()
        print(json.dumps(uvloop.run(run_client(args.client, args.url, args.frames, args.scan))))
        return
    load_before = os.getloadavg()[0]
    results: dict[str, Any] = {}
    for name in [n for n in args.only.split(",") if n]:
        for scan in (False, True):
            values = [one_run(name, args.frames, scan)["cpu_us_per_frame"]
                      for _ in range(args.repeat)]
            key = name + ("+scan" if scan else "")
            results[key] = {"cpu_us_per_frame": min(values), "median": statistics.median(values),
                            "runs": values}
            print(key, json.dumps(results[key]), flush=True)
    if args.callgrind:
        for name, scan in [(n, False) for n in args.only.split(",") if n] + [("aiohttp", True)]:
            small, large = (one_run(name, frames, scan, callgrind=True)["instructions"]
                            for frames in (1000, 11_000))
            key = name + ("+scan" if scan else "")
            results.setdefault(key, {})["instructions_per_frame"] = round((large - small) / 10_000)
            print(key, results[key], flush=True)
    results["machine"] = {
        "python": platform.python_version(), "cpus": os.cpu_count(),
        "load_1min_before": round(load_before, 2),
        "load_1min_after": round(os.getloadavg()[0], 2),
        "frames_per_run": args.frames, "repeat": args.repeat,
        "note": "client CPU time per frame (process_time), best and median of the runs; "
        "instructions_per_frame: callgrind, (11,000 frames - 1,000 frames) / 10,000",
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
