"""Soak: does a running `sigil-push serve` keep its memory flat under steady load?

Two set-ups, chosen by `--provider`:
- `unifiedpush` (default): one real `nostr-relay` process that the DMs are published to, and
  300 UnifiedPush devices (a recorder here that answers 201 at once);
- `apns`: 300 APNs devices (the real `aioapns` client to the local HTTP/2 fake in its own
  process, answering 200) and a minimal relay in this process that streams the DMs straight
  into the bridge's subscription, so the relay never falls behind the rate.
Both send a steady stream of kind 4 DMs (default 200 a second) to those devices' keys, for
`--minutes`. Every `--sample-seconds` the service's VmRSS, RssAnon and RssFile are read from
/proc. The figure that matters is the growth between the end of the warm-up (`--warmup-minutes`,
10 by default: the seen cache fills in the first minutes) and the end; the target is < 5 MB
between minute 10 and minute 30, which needs a quiet machine.

With `--trace` the service runs under tracemalloc (slower: use it to *find* what grows, not for
the RSS figure): it dumps a snapshot every `--snapshot-minutes`, and the largest growths between
the first snapshot after the warm-up and the last one are reported by source line.

Loopback only; the load stops by itself. Writes bench/results/soak.json.

Each sample also carries the service's `sigil_push_memory_entries` (every growable cache and
queue). `--seen-cache-size` shrinks the seen cache so it is full within a short run, which is
then long enough to see what grows once every bounded cache is full.

Usage: python bench/soak.py [--provider unifiedpush|apns] [--minutes 30] [--warmup-minutes 10] [--rate 200] [--devices 300]
                            [--trace] [--snapshot-minutes 2] [--seen-cache-size N]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import httpx
import nostr_sdk
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from bench.hostile import Recorder, register
from sigil_push.nostr.keys import SecretKey
from sigil_push.nostr.nip98 import make_http_auth
from testkit.fakes.credentials import KEY_ID, TEAM_ID, TOPIC, make_apns_key, make_tls
from testkit.loopback_relay import LoopbackRelay
from testkit.nostr_client import kind4_dm, npub_of, secret_hex_of, user
from testkit.relay import RelayProcess, free_port
from testkit.service import ServiceProcess

RESULTS = ROOT / "bench" / "results" / "soak.json"


def serve_traced(config: str, snapshots: str, every_seconds: float) -> None:
    """The service under tracemalloc, dumping a snapshot every `every_seconds` (a thread: the
    service's own loop is left alone)."""
    tracemalloc.start(1)
    folder = Path(snapshots)

    def dump() -> None:
        number = 0
        while True:
            time.sleep(every_seconds)
            number += 1
            tracemalloc.take_snapshot().dump(str(folder / f"snapshot-{number:03d}.bin"))

    threading.Thread(target=dump, daemon=True).start()
    from sigil_push.cli import main

    sys.exit(main(["--log-level", "WARNING", "serve", "--config", config]))


def memory(pid: int) -> dict[str, float]:
    """VmRSS, RssAnon and RssFile of `pid`, in MB."""
    figures: dict[str, float] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "RssAnon", "RssFile"):
            figures[name] = round(int(value.split()[0]) / 1024, 2)
    return figures


async def stream(relay_url: str, keys: list[nostr_sdk.Keys], rate: float, seconds: float,
                 sent: list[int], reconnects: list[int]) -> None:
    """`rate` DMs a second to random keys for `seconds`, pipelined on one socket (opened again
    if the relay drops it: a loaded machine's relay process may)."""
    senders = [user() for _ in range(20)]
    deadline = time.monotonic() + seconds
    tick = 0.1
    per_tick = rate * tick
    owed = 0.0
    next_tick = time.monotonic()
    while time.monotonic() < deadline:
        try:
            async with connect(relay_url, proxy=None, ping_interval=None, max_queue=None) as ws:

                async def drain(ws: Any = ws) -> None:
                    async for _ in ws:
                        pass

                reader = asyncio.create_task(drain())
                try:
                    while time.monotonic() < deadline:
                        owed += per_tick
                        while owed >= 1.0:
                            event = kind4_dm(random.choice(senders), random.choice(keys), "soak")
                            await ws.send(json.dumps(["EVENT", event]))
                            sent[0] += 1
                            owed -= 1.0
                        next_tick += tick
                        await asyncio.sleep(max(0.0, next_tick - time.monotonic()))
                finally:
                    reader.cancel()
        except (ConnectionClosed, OSError):
            reconnects[0] += 1
            await asyncio.sleep(1.0)
            next_tick = time.monotonic()


class StreamingRelay(LoopbackRelay):
    """A relay that answers every REQ with EOSE at once and then streams the DMs it is handed
    to each subscription whose filter asks for kind 4 and names the recipient (or names no
    `#p`: a firehose). No storage, no verification: it only has to keep up with the rate."""

    def __init__(self) -> None:
        self.subscriptions: dict[Any, dict[str, frozenset[str] | None]] = {}
        self.streamed = 0

    async def _handle(self, ws: Any) -> None:
        subs: dict[str, frozenset[str] | None] = {}
        self.subscriptions[ws] = subs
        try:
            async for raw in ws:
                message = json.loads(raw)
                if message[0] == "REQ":
                    wanted: frozenset[str] | None = frozenset()
                    for query in message[2:]:
                        if 4 in query.get("kinds", []):
                            keys = query.get("#p")
                            wanted = None if keys is None else (
                                frozenset(keys) | (wanted or frozenset())
                                if wanted is not None else None)
                    if wanted != frozenset():
                        subs[message[1]] = wanted
                    await ws.send(json.dumps(["EOSE", message[1]]))
                elif message[0] == "CLOSE":
                    subs.pop(message[1], None)
                elif message[0] == "NEG-OPEN":
                    await ws.send(json.dumps(["NEG-ERR", message[1], "error: unsupported"]))
        except ConnectionClosed:
            pass
        finally:
            self.subscriptions.pop(ws, None)

    async def stream(self, event: dict[str, Any], recipient: str) -> None:
        for ws, subs in list(self.subscriptions.items()):
            for sub_id, keys in subs.items():
                if keys is None or recipient in keys:
                    with contextlib.suppress(ConnectionClosed):
                        await ws.send(json.dumps(["EVENT", sub_id, event]))
                        self.streamed += 1
                    break


async def stream_direct(relay: StreamingRelay, keys: list[nostr_sdk.Keys], rate: float,
                        seconds: float, sent: list[int]) -> None:
    """`rate` DMs a second to random keys for `seconds`, handed to the streaming relay."""
    senders = [user() for _ in range(20)]
    deadline = time.monotonic() + seconds
    tick = 0.1
    owed = 0.0
    next_tick = time.monotonic()
    while time.monotonic() < deadline:
        owed += rate * tick
        while owed >= 1.0:
            recipient = random.choice(keys)
            event = kind4_dm(random.choice(senders), recipient, "soak")
            await relay.stream(event, str(recipient.public_key().to_hex()))
            sent[0] += 1
            owed -= 1.0
        next_tick += tick
        await asyncio.sleep(max(0.0, next_tick - time.monotonic()))


def register_ios(service: ServiceProcess, keys: nostr_sdk.Keys, token: str) -> None:
    body = {"npub": npub_of(keys), "platform": "ios", "device_token": token}
    raw = json.dumps(body).encode()
    header = make_http_auth(SecretKey(secret_hex_of(keys)), service.url + "/register", "POST", raw)
    response = httpx.post(service.url + "/register", content=raw, timeout=30,
                          headers={"content-type": "application/json", "authorization": header})
    assert response.status_code in (200, 201), response.text


def start_fake_apns(folder: Path) -> tuple[subprocess.Popen[bytes], str]:
    """The HTTP/2 fake in its own process (it must not share this process's loop), and the
    `[apns]` table that points the service at it."""
    tls = make_tls(folder)
    apns_key, apns_public = make_apns_key(folder)
    (folder / "apns-public.pem").write_bytes(apns_public)
    port = free_port()
    fake = subprocess.Popen(
        [sys.executable, "-m", "testkit.fakes.fake_apns", "--cert", str(tls.cert_file),
         "--key", str(tls.key_file), "--public-key", str(folder / "apns-public.pem"),
         "--port", str(port)],
        stdout=subprocess.PIPE, start_new_session=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert fake.stdout is not None
    fake.stdout.readline()  # the port, once listening
    table = (f'[apns]\nteam_id = "{TEAM_ID}"\nkey_id = "{KEY_ID}"\nkey_file = "{apns_key}"\n'
             f'topic = "{TOPIC}"\nenvironment = "sandbox"\n'
             f'endpoint = "https://127.0.0.1:{port}"\nca_file = "{tls.ca_file}"\n')
    return fake, table


async def structure_sizes(admin_url: str) -> dict[str, float]:
    """The service's own gauge of every growable structure (sigil_push_memory_entries)."""
    text = (await asyncio.to_thread(httpx.get, admin_url + "/metrics", timeout=10)).text
    sizes: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith('sigil_push_memory_entries{structure="'):
            name = line.split('"')[1]
            sizes[name] = float(line.rsplit(" ", 1)[1])
    return sizes


async def pushed(admin_url: str) -> float:
    """Pushes the providers accepted, by the service's own counter (the APNs fake is another
    process)."""
    text = (await asyncio.to_thread(httpx.get, admin_url + "/metrics", timeout=10)).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("sigil_push_pushes_total{") and 'outcome="accepted"' in line)


def growth(snapshots: list[Path], warmup_index: int, top: int = 15) -> list[dict[str, Any]]:
    """The source lines whose allocations grew most between two snapshots."""
    first = tracemalloc.Snapshot.load(str(snapshots[warmup_index]))
    last = tracemalloc.Snapshot.load(str(snapshots[-1]))
    stats = last.compare_to(first, "lineno")
    return [
        {"where": str(stat.traceback[0]), "size_diff_kb": round(stat.size_diff / 1024, 1),
         "count_diff": stat.count_diff}
        for stat in sorted(stats, key=lambda s: s.size_diff, reverse=True)[:top]
    ]


def start_service(command: list[str], log_path: Path) -> subprocess.Popen[bytes]:
    with open(log_path, "ab") as log:  # the child keeps its own copy
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})


async def run(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    apns = args.provider == "apns"
    relay = None if apns else RelayProcess(folder / "relay").start()
    streaming = StreamingRelay() if apns else None
    fake_apns: subprocess.Popen[bytes] | None = None
    recorder = Recorder()
    if apns:
        assert streaming is not None
        await streaming.__aenter__()
        fake_apns, config = start_fake_apns(folder)
    else:
        await recorder.start()
        config = ("[unifiedpush]\nallow_private_endpoints = true\n"
                  "vapid_subject = \"mailto:ops@example.org\"\n")
    relay_url = streaming.url if streaming is not None else relay.url  # type: ignore[union-attr]
    if args.seen_cache_size:
        config += f"[bridge]\nseen_cache_size = {args.seen_cache_size}\n"
    limits = ("requests_per_minute_per_ip = 0\nrequests_per_minute_per_npub = 0\n"
              "coalesce_window_ms = 0\nwakeups_per_minute_per_device = 0\n")
    service = ServiceProcess(folder / "service", [relay_url], config, limits)
    snapshots = folder / "snapshots"
    snapshots.mkdir()
    command = [sys.executable, str(Path(__file__).resolve()), "--serve-traced",
               str(service.config_path), str(snapshots), str(args.snapshot_minutes * 60)]
    if not args.trace:
        command = [sys.executable, "-m", "sigil_push", "--log-level", "WARNING", "serve",
                   "--config", str(service.config_path)]
    process = start_service(command, service.log_path)
    try:
        service.wait_healthy(60)
        keys = [user() for _ in range(args.devices)]
        for index, key in enumerate(keys):
            if apns:
                register_ios(service, key, f"{index:064x}")
            else:
                register(service, key, recorder.endpoint(f"d{index}"), [])
        deadline = time.monotonic() + 120
        while True:
            watched = (await asyncio.to_thread(
                httpx.get, service.admin_url + "/metrics", timeout=10)).text
            if f"sigil_push_bridge_watched_keys {float(len(keys))}" in watched:
                break
            if time.monotonic() > deadline:
                raise TimeoutError("the keys were never watched")
            await asyncio.sleep(0.5)
        sent, reconnects = [0], [0]
        seconds = args.minutes * 60
        load = asyncio.create_task(
            stream_direct(streaming, keys, args.rate, seconds, sent) if streaming is not None
            else stream(relay_url, keys, args.rate, seconds, sent, reconnects))
        samples: list[dict[str, float]] = []
        started = time.monotonic()
        while not load.done():
            sample = {"minute": round((time.monotonic() - started) / 60, 2),
                      **memory(process.pid), "sent": sent[0],
                      "pushed": await pushed(service.admin_url) if apns
                      else len(recorder.arrivals), "load1": os.getloadavg()[0],
                      "entries": await structure_sizes(service.admin_url)}
            samples.append(sample)
            print(json.dumps(sample), flush=True)
            await asyncio.sleep(args.sample_seconds)
        await load
        after = [s for s in samples if s["minute"] >= args.warmup_minutes]
        result: dict[str, Any] = {
            "provider": args.provider,
            "minutes": args.minutes, "warmup_minutes": args.warmup_minutes, "rate": args.rate,
            "devices": args.devices, "traced": args.trace, "sent": sent[0],
            "seen_cache_size": args.seen_cache_size or "default",
            "pushed": samples[-1]["pushed"] if samples else 0,
            "publisher_reconnects": reconnects[0],
            "samples": samples,
        }
        if len(after) >= 2:
            for name in ("VmRSS", "RssAnon", "RssFile"):
                result[f"{name}_growth_after_warmup_mb"] = round(
                    after[-1][name] - after[0][name], 2)
        dumps = sorted(snapshots.glob("snapshot-*.bin"))
        if args.trace and len(dumps) >= 2:
            warm = next((i for i, _ in enumerate(dumps)
                         if (i + 1) * args.snapshot_minutes >= args.warmup_minutes), 0)
            warm = min(warm, len(dumps) - 2)
            result["tracemalloc_growth"] = growth(dumps, warm)
        return result
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(30)
        if relay is not None:
            relay.stop()
        if streaming is not None:
            await streaming.__aexit__(None, None, None)
        if fake_apns is not None:
            os.killpg(fake_apns.pid, signal.SIGTERM)
            fake_apns.wait(30)


def commit() -> str:
    """The measured tree's commit (short), with `+` when the work tree has changes."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], check=False, cwd=ROOT, text=True,
                          capture_output=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "sigil_push"], check=False,
                           cwd=ROOT, text=True,
                           capture_output=True).stdout.strip()
    return head + ("+" if dirty else "")


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "--serve-traced":
        serve_traced(sys.argv[2], sys.argv[3], float(sys.argv[4]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--provider", choices=("unifiedpush", "apns"), default="unifiedpush")
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--warmup-minutes", type=float, default=10.0)
    parser.add_argument("--rate", type=float, default=200.0)
    parser.add_argument("--devices", type=int, default=300)
    parser.add_argument("--sample-seconds", type=float, default=10.0)
    parser.add_argument("--trace", action="store_true")
    parser.add_argument("--snapshot-minutes", type=float, default=2.0)
    parser.add_argument("--seen-cache-size", type=int, default=0,
                        help="a smaller seen cache fills sooner: steady state in a short run")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        result = asyncio.run(run(args, Path(tmp)))
    result["machine"] = {"platform": platform.platform(),
                         "note": "2 cores shared with other work unless said otherwise"}
    runs = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    runs = runs if "runs" in runs else {"runs": {}, "earlier": runs}
    runs["runs"][f"{datetime.now(UTC):%Y-%m-%d} {commit()} {args.provider}"] = result
    RESULTS.write_text(json.dumps(runs, indent=2) + "\n")
    for name in ("VmRSS", "RssAnon", "RssFile"):
        key = f"{name}_growth_after_warmup_mb"
        if key in result:
            print(f"{name} growth after warm-up: {result[key]} MB (target < 5 MB over 20 min)")
    for line in result.get("tracemalloc_growth", [])[:10]:
        print(f"{line['size_diff_kb']:>10} KB {line['count_diff']:>8}  {line['where']}")


if __name__ == "__main__":
    main()
