"""Benchmark: a victim's wakeup and the good relays' ingest while one relay is hostile.

Two runs of a real `sigil-push serve` process, each with a real `nostr-relay` as the good
relay, a victim whose UnifiedPush endpoint is a small recorder here (another host than the
tarpits: `localhost`, not `127.0.0.1`), and 50 keys publishing a
burst of DMs on the good relay (the ingest figure):
  quiet   — nothing else;
  hostile — plus one hostile relay (a websockets server here) that, on every REQ, streams
            valid DMs as fast as it can to 50 attacker keys, whose devices' UnifiedPush
            endpoints are 50 tarpits (accept TCP, never answer); each DM is signed by one of
            50 other, unregistered keys (the attacker's sock puppets): a DM to oneself wakes
            nothing since issue 32 (own events never wake own pairs), so a self-addressed
            flood would never reach the tarpits;
  forged  — the same relay streams well-formed DMs with correct ids and current times but
            signatures that do not verify (each costs a signature check);
  auth    — the same relay streams distinct 1 MiB NIP-42 challenges (an AUTH storm).
Victim latency: a DM published on the good relay → the push at the victim's endpoint, one at a
time, `--samples` of them; p50/p99. Ingest: events/s from the first publish of the burst until
the service's reader has received all of it (publishing one event at a time to a Python relay
bounds this figure as much as the service does). Loopback only; the machine may be shared: figures are noisy.

Usage: python bench/hostile.py [--samples 30] [--burst 500] [--modes hostile,forged,auth]
Writes bench/results/hostile-<date>-<commit>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import platform
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import httpx
import nostr_sdk
from websockets.asyncio.client import connect
from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed

from sigil_push.nostr.keys import SecretKey
from sigil_push.nostr.nip98 import make_http_auth
from testkit.bridge_harness import metric
from testkit.nostr_client import kind4_dm, npub_of, secret_hex_of, user
from testkit.relay import RelayProcess
from testkit.service import ServiceProcess
from testkit.tarpit import Tarpit

RESULTS = ROOT / "bench" / "results"
TARPITS = 50


class Recorder:
    """A UnifiedPush endpoint that answers 201 at once and notes when each push arrived."""

    def __init__(self) -> None:
        self.arrivals: list[float] = []
        self.port = 0
        self._server: asyncio.Server | None = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.decode("latin-1").split("\r\n"):
                    if line.lower().startswith("content-length:"):
                        length = int(line.split(":", 1)[1])
                await reader.readexactly(length)
                self.arrivals.append(time.monotonic())
                writer.write(b"HTTP/1.1 201 Created\r\nContent-Length: 0\r\n\r\n")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    def endpoint(self, name: str) -> str:
        return f"http://localhost:{self.port}/up/{name}"


class FloodRelay:
    """On every REQ: EOSE, then the given frames in a loop as fast as the socket takes them,
    on that subscription until it is closed or replaced (as a relay would)."""

    def __init__(self, frames: list[str], events: bool = True) -> None:
        self.frames = frames
        self.events = events
        """False: the frames are whole messages (AUTH), not events for the subscription."""
        self.sent = 0
        self.armed = False
        """Set once every attacker key is subscribed, so the flood's events are live DMs."""
        self.url = ""

    async def _handle(self, ws: ServerConnection) -> None:
        floods: dict[str, asyncio.Task[None]] = {}
        try:
            async for text in ws:
                message = json.loads(text)
                if message[0] in ("REQ", "CLOSE") and message[1] in floods:
                    floods.pop(message[1]).cancel()
                if message[0] == "REQ":
                    await ws.send(json.dumps(["EOSE", message[1]]))
                    floods[message[1]] = asyncio.create_task(self._flood(ws, message[1]))
        except ConnectionClosed:
            return
        finally:
            for task in floods.values():
                task.cancel()

    async def _flood(self, ws: ServerConnection, sub_id: str) -> None:
        prefix, suffix = (f'["EVENT","{sub_id}",', "]") if self.events else ("", "")
        while not self.armed:
            await asyncio.sleep(0.05)
        try:
            while True:
                for frame in self.frames:
                    await ws.send(prefix + frame + suffix)
                    self.sent += 1
        except ConnectionClosed:
            return

    async def start(self) -> Any:
        server = await serve(self._handle, "127.0.0.1", 0, compression=None)
        self.url = f"ws://127.0.0.1:{next(iter(server.sockets)).getsockname()[1]}"
        return server


async def _flood_main(frames: list[str], events: bool, armed: Any, sent: Any, ports: Any) -> None:
    flood = FloodRelay(frames, events)
    await flood.start()
    ports.put(flood.url)
    while True:
        flood.armed = armed.is_set()
        sent.value = flood.sent
        await asyncio.sleep(0.1)


def _flood_process(frames: list[str], events: bool, armed: Any, sent: Any, ports: Any) -> None:
    asyncio.run(_flood_main(frames, events, armed, sent, ports))


class FloodProcess:
    """The FloodRelay in a process of its own: in the benchmark's process its loop starved the
    clients measuring the victim (their keepalive pings timed out on a loaded machine)."""

    def __init__(self, frames: list[str], events: bool = True) -> None:
        context = multiprocessing.get_context("spawn")
        self._armed = context.Event()
        self._sent = context.Value("q", 0)
        ports = context.Queue()
        self._process = context.Process(
            target=_flood_process, args=(frames, events, self._armed, self._sent, ports),
            daemon=True,
        )
        self._process.start()
        self.url: str = ports.get(timeout=120)

    @property
    def sent(self) -> int:
        return int(self._sent.value)

    def arm(self) -> None:
        self._armed.set()

    def stop(self) -> None:
        self._process.terminate()
        self._process.join(10)


def register(service: ServiceProcess, keys: nostr_sdk.Keys, endpoint: str, relays: list[str]) -> None:
    body = {"npub": npub_of(keys), "platform": "unifiedpush", "device_token": endpoint,
            "relays": relays}
    raw = json.dumps(body).encode()
    header = make_http_auth(SecretKey(secret_hex_of(keys)), service.url + "/register", "POST", raw)
    response = httpx.post(service.url + "/register", content=raw, timeout=30,
                          headers={"content-type": "application/json", "authorization": header})
    assert response.status_code in (200, 201), response.text


async def publish(relay_url: str, *events: dict[str, Any]) -> None:
    """Send events and wait for each OK. No keepalive pings: this process also runs the
    flooding relay, whose loop can starve a ping past its timeout (a closed publish, no figure)."""
    async with connect(relay_url, proxy=None, ping_interval=None) as ws:
        for event in events:
            await ws.send(json.dumps(["EVENT", event]))
            while True:
                answer = json.loads(await ws.recv())
                if answer[0] == "OK" and answer[1] == event["id"]:
                    break


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


async def wait_for(check: Any, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError("benchmark condition not reached")
        await asyncio.sleep(0.02)


def flood_frames(mode: str, attackers: list[nostr_sdk.Keys]) -> FloodProcess:
    """The hostile relay's stream for `mode` (hostile, forged or auth)."""
    if mode == "auth":
        return FloodProcess(
            [json.dumps(["AUTH", f"{i:08d}" + "c" * (1024 * 1024)]) for i in range(16)],
            events=False,
        )
    frames = []
    puppets = [user() for _ in attackers]
    for i in range(300):
        for attacker, puppet in zip(attackers, puppets, strict=True):
            event = kind4_dm(puppet, attacker, f"flood {i}")
            if mode == "forged":
                event["sig"] = secrets.token_hex(64)
            frames.append(json.dumps(event, separators=(",", ":")))
    return FloodProcess(frames)


async def run(folder: Path, mode: str, samples: int, burst: int) -> dict[str, Any]:
    hostile = mode != "quiet"
    good = RelayProcess(folder / "good").start()
    recorder = Recorder()
    await recorder.start()
    tarpits: list[Tarpit] = []
    flood: FloodProcess | None = None
    try:
        config = (
            "[bridge]\nreconnect_min_seconds = 0.2\nreconnect_max_seconds = 1.0\n"
            "[unifiedpush]\nallow_private_endpoints = true\nvapid_subject = \"mailto:ops@example.org\"\n"
        )
        limits = ("requests_per_minute_per_ip = 0\nrequests_per_minute_per_npub = 0\n"
                  "coalesce_window_ms = 0\nwakeups_per_minute_per_device = 0\n")
        service = ServiceProcess(folder / "service", [good.url], config, limits).start()
        try:
            if hostile:
                attackers = [user() for _ in range(TARPITS)]
                flood = flood_frames(mode, attackers)
                for attacker in attackers:
                    tarpit = Tarpit()
                    await tarpit.__aenter__()
                    tarpits.append(tarpit)
                    register(service, attacker, tarpit.endpoint("x"), [flood.url])
                await wait_for(lambda: metric(service, "sigil_push_bridge_watched_keys") >= TARPITS)
                await asyncio.sleep(2.0)  # the last REQs answered
                flood.arm()
                await wait_for(lambda: flood is not None and flood.sent > (
                    10 if mode == "auth" else 10_000))
            victim, friend = user(), user()
            register(service, victim, recorder.endpoint("victim"), [])
            senders = [user() for _ in range(50)]
            for index, sender in enumerate(senders):
                register(service, sender, recorder.endpoint(f"burst{index}"), [])
            await wait_for(lambda: metric(service, "sigil_push_bridge_watched_keys") >= 51 + (TARPITS if hostile else 0))
            await asyncio.sleep(2.0)  # the new keys' REQs answered
            latencies = []
            for i in range(samples):
                before = len(recorder.arrivals)
                started = time.monotonic()
                await publish(good.url, kind4_dm(friend, victim, f"hello {i}"))
                await wait_for(lambda before=before: len(recorder.arrivals) > before, 60.0)
                latencies.append(recorder.arrivals[before] - started)
            received_before = metric(service, "sigil_push_bridge_events_received_total", relay=good.url)
            events = [kind4_dm(senders[(i + 1) % 50], senders[i % 50], f"burst {i}") for i in range(burst)]
            started = time.monotonic()
            await publish(good.url, *events)
            await wait_for(lambda: metric(service, "sigil_push_bridge_events_received_total",
                                          relay=good.url) - received_before >= burst)
            ingest_seconds = time.monotonic() - started
            result: dict[str, Any] = {
                "victim_p50_seconds": round(percentile(latencies, 0.5), 4),
                "victim_p99_seconds": round(percentile(latencies, 0.99), 4),
                "good_ingest_events_per_second": round(burst / ingest_seconds, 1),
            }
            if mode == "hostile" and not sum(t.connections for t in tarpits):
                raise RuntimeError("the flood woke no attacker device: nothing was measured")
            if hostile and flood is not None:
                # the flood relay is a user relay: its series are the users' shared "user" ones
                # (the only user relay here)
                result["flood_frames_sent"] = flood.sent
                result["flood_dropped_recipient_quota"] = metric(
                    service, "sigil_push_bridge_events_dropped_total", relay="user",
                    reason="recipient_quota")
                result["tarpit_connections"] = sum(t.connections for t in tarpits)
                result["flood_invalid_drops"] = metric(
                    service, "sigil_push_relay_invalid_drops_total", relay="user")
                result["flood_auth_answers"] = metric(
                    service, "sigil_push_relay_auth_answers_total", relay="user")
            return result
        finally:
            service.stop()
    finally:
        if flood is not None:
            flood.stop()
        for tarpit in tarpits:
            await tarpit.__aexit__()
        good.stop()


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        quiet = await run(Path(tmp) / "quiet", "quiet", args.samples, args.burst)
        results: dict[str, Any] = {
            "machine": {"platform": platform.platform(), "note": "2 cores shared with other work"},
            "samples": args.samples,
            "burst": args.burst,
            "quiet": quiet,
        }
        for mode in args.modes.split(","):
            figures = await run(Path(tmp) / mode, mode, args.samples, args.burst)
            figures["ingest_ratio"] = round(
                figures["good_ingest_events_per_second"] / quiet["good_ingest_events_per_second"],
                3,
            )
            results[mode] = figures
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=30)
    parser.add_argument("--burst", type=int, default=500)
    parser.add_argument("--modes", default="hostile,forged,auth")
    args = parser.parse_args()
    results = asyncio.run(main_async(args))
    quiet = results["quiet"]
    print(f"quiet: victim p50 {quiet['victim_p50_seconds']} s, p99 {quiet['victim_p99_seconds']} s,"
          f" ingest {quiet['good_ingest_events_per_second']}/s")
    for mode in args.modes.split(","):
        figures = results[mode]
        print(f"{mode}: victim p50 {figures['victim_p50_seconds']} s, "
              f"p99 {figures['victim_p99_seconds']} s (target < 2 s), ingest "
              f"{figures['good_ingest_events_per_second']}/s, ratio {figures['ingest_ratio']}")
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short=10", "HEAD"],
                            capture_output=True, text=True, check=True).stdout.strip()
    results["commit"] = commit
    out = RESULTS / f"hostile-{time.strftime('%Y-%m-%d', time.gmtime())}-{commit}.json"
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"written to {out}")


if __name__ == "__main__":
    main()
