"""Web Push messages per CPU second: the service's delivery against a bare loop (issue 33).

Both sides send the same Iris pushes (a kind 1 mention each, to one of DEVICES browser
subscriptions) to the same local push service, a separate process that is not measured
(testkit.fakes.fake_unifiedpush, which checks every VAPID header as autopush does). The
endpoints are spread over HOSTS loopback addresses (127.0.1.x), each a push host to the
service, none reaching its per-host share of the window: as Chrome's endpoints on
fcm.googleapis.com, which are exempt from that share (`iris.browser_push_services`).
Both sides sign the VAPID JWT once per host.

- `bare`: what any Web Push sender must do, with the same libraries and nothing else: parse
  the event, build the Iris JSON (sigil_push/iris/payload.py), RFC 8291-encrypt it with
  pywebpush, sign the VAPID JWT once per origin and reuse it (py-vapid, through
  push/vapid.py's cache), POST it with aiohttp from CONCURRENCY loops;
- `service`: the real Delivery loop draining an outbox already filled (by the parent) with the
  Iris targets' rows: claims, planning with the per-target budget, the Iris Web Push sender,
  settlement and the observation log, on SQLite as `sigil-push serve` runs it.

Each side runs in its own fresh process; its CPU seconds (all threads: SQLite's too) are
counted from when its setup is done to when the last push is answered. The sides alternate;
the median of `--repeats` runs of each is reported with the ratio service/bare in messages
per CPU second (target >= 0.7), and written to bench/results/webpush-<date>-<commit>.json.

Usage: python bench/webpush.py [--pushes 4000] [--repeats 5] [--profile]
(`--profile` runs the service side once under cProfile and prints its top functions.)
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import pstats
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
import orjson
import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.push import free_port, start_fake
from sigil_push.config import parse_config
from sigil_push.delivery import Delivery
from sigil_push.http.server import tune_gc
from sigil_push.iris.payload import UNKNOWN_PROFILE, web_push_body
from sigil_push.nostr.event import sign_event
from sigil_push.nostr.keys import SecretKey
from sigil_push.observations import ObservationLog, now_ms
from sigil_push.push.factory import build_senders
from sigil_push.push.iris_senders import MAX_BODY_BYTES, topic
from sigil_push.push.registry import TABLES
from sigil_push.push.vapid import VapidSigner, load_or_create_key
from sigil_push.store.factory import open_sqlite
from sigil_push.store.interface import IrisTarget
from testkit.fakes.credentials import WebPushSubscriber
from testkit.fakes.fake_unifiedpush import loopback_host

ROOT = Path(__file__).resolve().parent.parent
DEVICES = 200
HOSTS = 32
"""Push hosts the endpoints are spread over: as few as real browsers use (a handful of push
services, connections kept alive), and enough that no host reaches its share of the window
(1/8 of it: see the module docstring)."""
CONCURRENCY = 64
SUBJECT = "mailto:bench@example.org"
NOTIFICATION_URL = "https://iris.to/"
TARGET = 0.7


def document(folder: Path) -> dict[str, Any]:
    return {
        "server": {"public_url": "https://push.example.org"},
        "unifiedpush": {"allow_private_endpoints": True, "vapid_subject": SUBJECT,
                        "vapid_private_key_file": str(folder / "vapid.pem")},
        "limits": {"wakeups_per_minute_per_device": 0, "coalesce_window_ms": 0},
        "push": {"concurrency_per_provider": CONCURRENCY},
    }


async def fill(database: Path, work: Path, port: int, pushes: int) -> None:
    """DEVICES Iris users, each with one subscription on one browser endpoint (all on the one
    local push service, as Chrome's all go to FCM's), and `pushes` queued mentions spread
    over them (at most 20 each: within every target's burst, so none is rate-limited). The
    bare loop's work list is the same pushes, written to `work`."""
    assert pushes <= 20 * DEVICES, "beyond the targets' bursts the service would suppress some"
    store = await open_sqlite(database)
    subscribers, author = [SecretKey.generate() for _ in range(DEVICES)], SecretKey.generate()
    targets = []
    for number, subscriber in enumerate(subscribers):
        browser = WebPushSubscriber.generate()
        target = IrisTarget("webpush", f"http://{loopback_host(number % HOSTS)}:{port}/up/d{number}",
                            browser.p256dh, browser.auth)
        await store.iris.put(f"s{number}", subscriber.public_key_hex, "{}", [target], DEVICES)
        stored = await store.iris.get(f"s{number}")
        assert stored is not None
        device = await store.devices.by_id(stored.device_ids[0])
        assert device is not None
        targets.append((device, target))
    seen = now_ms()
    rows = []
    for i in range(pushes):
        device, target = targets[i % DEVICES]
        event = sign_event(author, 1, f"gm number {i}, how are you today?",
                           [["p", subscribers[i % DEVICES].public_key_hex]])
        # no relay: no author lookups (the bare loop has none to make either)
        await store.outbox.enqueue(event, "", seen, [device])
        rows.append([target.token, target.p256dh, target.auth,
                     json.dumps(event.to_json(), separators=(",", ":"), ensure_ascii=False)])
    await store.close()
    work.write_text(json.dumps(rows))


async def bare(folder: Path, _database: Path) -> float:
    """The bare loop over the same pushes; CPU seconds of the sending alone."""
    from pywebpush import WebPusher

    work = [tuple(row) for row in json.loads((folder / "work.json").read_text())]
    vapid = VapidSigner(load_or_create_key(folder / "vapid.pem"), SUBJECT)
    session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10), trust_env=False)
    numbers = iter(range(len(work)))
    started = time.process_time()

    async def loop() -> None:
        for i in numbers:
            endpoint, p256dh, auth, event_json = work[i]
            event = orjson.loads(event_json)
            body = web_push_body(event, UNKNOWN_PROFILE, NOTIFICATION_URL, MAX_BODY_BYTES)
            encrypted = WebPusher({"endpoint": endpoint, "keys": {"p256dh": p256dh, "auth": auth}}).encode(
                body, "aes128gcm"
            )["body"]
            headers = {
                "TTL": "3600", "Urgency": "normal", "Topic": topic(event["id"]),
                "Authorization": vapid.authorization(endpoint),
                "Content-Type": "application/octet-stream", "Content-Encoding": "aes128gcm",
            }
            async with session.post(endpoint, data=encrypted, headers=headers) as response:
                if response.status != 201:
                    raise RuntimeError(f"bare send answered {response.status}")

    await asyncio.gather(*(loop() for _ in range(CONCURRENCY)))
    spent = time.process_time() - started
    await session.close()
    return spent


async def service(folder: Path, database: Path) -> float:
    """The Delivery loop draining the outbox; CPU seconds from its start to an empty outbox."""
    config = parse_config(document(folder), folder / "relays.toml", TABLES)
    store = await open_sqlite(database)
    observations = ObservationLog(folder / f"observations-{database.stem}")
    await observations.start()
    senders = await build_senders(config)
    delivery = Delivery(store.outbox, store.devices, senders, observations, True, config.push,
                        config.limits, None, config.iris)
    started = time.process_time()
    await delivery.start()
    while await store.outbox.depth():
        await asyncio.sleep(0.05)
    spent = time.process_time() - started
    await delivery.stop()
    await observations.stop()
    await store.close()
    return spent


SIDES = {"bare": bare, "service": service}


def run_child(folder: Path, side: str, template: Path, profile: bool = False) -> float:
    database = folder / f"run-{side}.db"
    shutil.copyfile(template, database)
    command = [sys.executable, __file__, "child", "--side", side, "--folder", str(folder),
               "--database", str(database)]
    finished = subprocess.run(command + (["--profile"] if profile else []),
                              capture_output=True, text=True, check=False)
    if finished.returncode:
        raise RuntimeError(f"{side} run failed:\n{finished.stderr}")
    database.unlink()
    if profile:
        print(finished.stdout)
    return float(finished.stdout.strip().splitlines()[-1])


def commit() -> str:
    try:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short=10", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def child(side: str, folder: Path, database: Path, profile: bool) -> None:
    if not profile:
        print(uvloop.run(SIDES[side](folder, database)))
        return
    profiler = cProfile.Profile()
    spent = profiler.runcall(uvloop.run, SIDES[side](folder, database))
    pstats.Stats(profiler).sort_stats("tottime").print_stats(40)
    print(spent)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("role", nargs="?", default="parent", choices=["parent", "child"])
    parser.add_argument("--pushes", type=int, default=4000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--side", help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    parser.add_argument("--database", help=argparse.SUPPRESS)
    args = parser.parse_args()
    tune_gc()  # as `sigil-push serve` does
    if args.role == "child":
        child(args.side, Path(args.folder), Path(args.database), args.profile)
        return
    folder = Path(tempfile.mkdtemp(prefix="sigil-push-webpush-"))
    vapid = VapidSigner(load_or_create_key(folder / "vapid.pem"), SUBJECT)
    port = free_port()
    fake = start_fake(["testkit.fakes.fake_unifiedpush", "--port", str(port),
                       "--vapid-key", vapid.public_key, "--hosts", str(HOSTS)], port, False)
    runs: dict[str, list[float]] = {side: [] for side in SIDES}
    try:
        template = folder / "template.db"
        asyncio.run(fill(template, folder / "work.json", port, args.pushes))
        if args.profile:
            run_child(folder, "service", template, profile=True)
            return
        for repeat in range(args.repeats):
            order = ("bare", "service") if repeat % 2 == 0 else ("service", "bare")
            for side in order:
                seconds = run_child(folder, side, template)
                runs[side].append(seconds)
                print(f"{side:8} {args.pushes / seconds:8.0f} msg/CPU-s ({seconds:.2f} s)", flush=True)
    finally:
        fake.terminate()
        fake.wait(10)
        shutil.rmtree(folder, ignore_errors=True)
    rates = {side: args.pushes / statistics.median(seconds) for side, seconds in runs.items()}
    ratio = rates["service"] / rates["bare"]
    print(f"bare {rates['bare']:.0f} msg/CPU-s, service {rates['service']:.0f} msg/CPU-s,"
          f" ratio {ratio:.3f} (target >= {TARGET})")
    date, head = datetime.now(UTC).strftime("%Y-%m-%d"), commit()
    result = {
        "date": date, "commit": head, "command": "python bench/webpush.py " + " ".join(sys.argv[1:]),
        "pushes": args.pushes, "repeats": args.repeats, "devices": DEVICES,
        "concurrency": CONCURRENCY, "cpu_seconds": runs,
        "messages_per_cpu_second": {side: round(rate, 1) for side, rate in rates.items()},
        "ratio": round(ratio, 3), "target": TARGET,
    }
    path = ROOT / "bench" / "results" / f"webpush-{date}-{head}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"written to {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
