"""Web Push messages per CPU second: the service's pipeline against a bare loop (issue 33).

Both sides send the same Iris pushes (a kind 1 mention each, to one of DEVICES browser
subscriptions) to the same local push endpoint, a separate process that is not measured
(testkit.fakes.fake_unifiedpush, which also checks each VAPID header as autopush does):

- `bare`: what any Web Push sender must do, with the same libraries and nothing else: read the
  event, build the Iris JSON (sigil_push/iris/payload.py), RFC 8291-encrypt it with pywebpush,
  sign the VAPID JWT once per origin and reuse it (py-vapid), POST it with aiohttp,
  CONCURRENCY loops;
- `pipeline`: the real Delivery loop draining an outbox already filled (by the parent) with
  the Iris targets' rows: claims, planning, the Iris Web Push sender, settlement, the
  observation log.

Each side runs in its own fresh process, CPU seconds (all threads) counted from when its
setup is done to when the last push is answered; the sides alternate and the median of
`--repeats` is reported with the ratio pipeline/bare (messages per CPU second; target >= 0.7).

Usage: python bench/webpush.py [--pushes 4000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.push import free_port, start_fake
from sigil_push.config import parse_config
from sigil_push.delivery import Delivery
from sigil_push.http.server import tune_gc
from sigil_push.iris.payload import UNKNOWN_PROFILE, web_push_data
from sigil_push.nostr.event import sign_event
from sigil_push.nostr.keys import SecretKey
from sigil_push.observations import ObservationLog, now_ms
from sigil_push.push.factory import build_senders
from sigil_push.push.vapid import VapidSigner, load_or_create_key
from sigil_push.store.interface import IrisTarget
from sigil_push.store.sqlite.database import open_database
from sigil_push.store.sqlite.devices import Devices
from sigil_push.store.sqlite.iris import SqliteIrisSubscriptions
from sigil_push.store.sqlite.outbox import Outbox
from testkit.fakes.credentials import WebPushSubscriber

DEVICES = 200
CONCURRENCY = 64
SUBJECT = "mailto:bench@example.org"
NOTIFICATION_URL = "https://iris.to/"
RESULTS = Path(__file__).resolve().parent / "results" / "webpush.json"


def document(folder: Path) -> dict[str, Any]:
    return {
        "unifiedpush": {"allow_private_endpoints": True, "vapid_subject": SUBJECT,
                        "vapid_private_key_file": str(folder / "vapid.pem")},
        "limits": {"wakeups_per_minute_per_device": 0, "coalesce_window_ms": 0},
        "push": {"concurrency_per_provider": CONCURRENCY},
    }


async def fill(database: Path, port: int, pushes: int) -> None:
    """DEVICES Iris users, each with one subscription on one browser endpoint (all on the one
    local push service, as Chrome's are all on FCM's), and `pushes` queued mentions."""
    db = await open_database(database)
    devices, outbox, iris = Devices(db), Outbox(db), SqliteIrisSubscriptions(db)
    subscribers, author = [SecretKey.generate() for _ in range(DEVICES)], SecretKey.generate()
    targets = []
    for number, subscriber in enumerate(subscribers):
        browser = WebPushSubscriber.generate()
        target = IrisTarget("webpush", f"http://127.0.0.1:{port}/up/d{number}",
                            browser.p256dh, browser.auth)
        await iris.put(f"s{number}", subscriber.public_key_hex, "{}", [target], DEVICES)
        stored = await iris.get(f"s{number}")
        assert stored is not None
        device = await devices.by_id(stored.device_ids[0])
        assert device is not None
        targets.append(device)
    seen = now_ms()
    for i in range(pushes):
        event = sign_event(author, 1, f"gm number {i}, how are you today?",
                           [["p", subscribers[i % DEVICES].public_key_hex]])
        # no relay: no author lookups (the bare loop has none to make either)
        await outbox.enqueue(event, "", seen, [targets[i % DEVICES]])
    await db.close()


async def bare(folder: Path, database: Path) -> float:
    """The bare loop over the outbox's rows; CPU seconds of the sending alone."""
    db = await open_database(database)
    rows = await db.execute_fetchall(
        "SELECT d.token, d.webpush_p256dh, d.webpush_auth, e.event_json FROM outbox o"
        " JOIN devices d ON d.id = o.device_id JOIN outbox_events e ON e.wakeup_id = o.id"
    )
    work = [tuple(str(v) for v in row) for row in rows]
    await db.close()
    from pywebpush import WebPusher

    vapid = VapidSigner(load_or_create_key(folder / "vapid.pem"), SUBJECT)
    session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10), trust_env=False)
    numbers = iter(range(len(work)))
    started = time.process_time()

    async def loop() -> None:
        for i in numbers:
            endpoint, p256dh, auth, event_json = work[i]
            event = json.loads(event_json)
            data = web_push_data(event, UNKNOWN_PROFILE, NOTIFICATION_URL)
            body = WebPusher({"endpoint": endpoint, "keys": {"p256dh": p256dh, "auth": auth}}).encode(
                json.dumps(data, separators=(",", ":")).encode(), "aes128gcm"
            )["body"]
            headers = {
                "TTL": "3600", "Urgency": "normal", "Topic": event["id"][:32],
                "Authorization": vapid.authorization(endpoint),
                "Content-Type": "application/octet-stream", "Content-Encoding": "aes128gcm",
            }
            async with session.post(endpoint, data=body, headers=headers) as response:
                if response.status != 201:
                    raise RuntimeError(f"bare send answered {response.status}")

    await asyncio.gather(*(loop() for _ in range(CONCURRENCY)))
    spent = time.process_time() - started
    await session.close()
    return spent


async def pipeline(folder: Path, database: Path) -> float:
    """The Delivery loop draining the outbox; CPU seconds from its start to an empty outbox."""
    config = parse_config(document(folder), folder / "relays.toml")
    db = await open_database(database)
    devices, outbox = Devices(db), Outbox(db)
    observations = ObservationLog(folder / f"observations-{os.getpid()}")
    await observations.start()
    senders = await build_senders(config)
    delivery = Delivery(outbox, devices, senders, observations, True, config.push, config.limits,
                        None, config.iris)
    started = time.process_time()
    await delivery.start()
    while await outbox.depth():
        await asyncio.sleep(0.05)
    spent = time.process_time() - started
    await delivery.stop()
    await observations.stop()
    await db.close()
    return spent


def run_child(folder: Path, side: str, template: Path) -> float:
    database = folder / f"run-{side}.db"
    shutil.copyfile(template, database)
    finished = subprocess.run(
        [sys.executable, __file__, "child", "--side", side, "--folder", str(folder),
         "--database", str(database)],
        capture_output=True, text=True, check=True,
    )
    database.unlink()
    return float(finished.stdout.strip().splitlines()[-1])


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True, cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("role", nargs="?", default="parent", choices=["parent", "child"])
    parser.add_argument("--pushes", type=int, default=4000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--side", help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    parser.add_argument("--database", help=argparse.SUPPRESS)
    args = parser.parse_args()
    tune_gc()  # as `sigil-push serve` does
    if args.role == "child":
        side = bare if args.side == "bare" else pipeline
        print(uvloop.run(side(Path(args.folder), Path(args.database))))
        return
    folder = Path(tempfile.mkdtemp(prefix="sigil-push-webpush-"))
    load_or_create_key(folder / "vapid.pem")
    port = free_port()
    fake = start_fake(["testkit.fakes.fake_unifiedpush", "--port", str(port),
                       "--vapid-key", VapidSigner(load_or_create_key(folder / "vapid.pem"),
                                                  SUBJECT).public_key], port, False)
    try:
        template = folder / "template.db"
        asyncio.run(fill(template, port, args.pushes))
        runs: dict[str, list[float]] = {"bare": [], "pipeline": []}
        for repeat in range(args.repeats):
            for side in ("bare", "pipeline") if repeat % 2 == 0 else ("pipeline", "bare"):
                seconds = run_child(folder, side, template)
                runs[side].append(seconds)
                print(f"{side:9} {args.pushes / seconds:8.0f} msg/CPU-s ({seconds:.2f} s)", flush=True)
    finally:
        fake.terminate()
        fake.wait(10)
        shutil.rmtree(folder, ignore_errors=True)
    rates = {side: args.pushes / statistics.median(seconds) for side, seconds in runs.items()}
    ratio = rates["pipeline"] / rates["bare"]
    print(f"bare {rates['bare']:.0f} msg/CPU-s, pipeline {rates['pipeline']:.0f} msg/CPU-s,"
          f" ratio {ratio:.3f} (target >= 0.7)")
    result = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d"), "commit": commit(),
        "pushes": args.pushes, "repeats": args.repeats, "devices": DEVICES,
        "concurrency": CONCURRENCY,
        "cpu_seconds": runs, "messages_per_cpu_second": rates, "ratio": round(ratio, 3),
    }
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
