"""Benchmark of push delivery: a full outbox drained to local APNs and FCM servers.

For each provider, in one run:
1. the fake's ceiling: the bare client sending as fast as it can with the same concurrency, no
   outbox, no database. For APNs that is the aioapns client exactly as the service builds it
   (`apns_client`: its protocol class writes once per loop tick), the same body, headers and
   apns-ids, from `concurrency` loops that send one push after another (no task, semaphore or
   timeout per push); for FCM, firebase-admin through our thin FcmSender;
2. the pipeline: N wakeups already in a real SQLite outbox, drained by the real Delivery loop
   (claim, send, settle, delete, observation records, metrics); wakeups/s and the ratio to 1;
3. latency: wakeups enqueued live at a fixed rate below capacity, p50/p99 from enqueue (the
   outbox) to the provider's answer, as written in the observation log.
The fakes run in their own processes. The CPU time each side actually got is recorded:
`cpu_busy_fraction` of the bench process stays at or below 1 (delivery is one event loop, so one
core's worth), it shows whether a fake was saturated, and `wakeups_per_cpu_second` is the rate
one fully available core would sustain on a shared machine. `--pin` pins this process and the
fakes to separate cores; under gVisor that made both slower, so it is off by default. Writes bench/results/push.json.

The machine may be shared, so steps 1-2 run `--trials` times (fresh clients each time) and the
best drain is reported with its own bare-client run; every trial is kept in the results, with the
load average around it and the spread (min/median/max) of both ratios. On a loaded machine the
wall-clock ratio swings with whoever else runs; the per-CPU-second ratio (pipeline wakeups per
CPU-second of this process, all threads, over the bare client's) is the robust figure.

The APNs endpoint (`--apns`): `nginx` (default; bench/native_apns.py, C, a few µs of CPU per
request, checks nothing) or `python` (the test suite's fake, h2 in Python, which checks the
provider token and topic as Apple does and takes most of a core at these rates). The test suite's
fake stays the correctness check; for a speed ratio it competed with the measured process for
the same 2 cores, so the bare client waited on it (this process 0.41-0.64 busy) and its CPU per
push swung by a third between trials (113-177 µs in the runs of 2026-11-23 at 73acf75).

Running a subset of `--providers` keeps the other providers' last results in the file, marked
`kept_from_earlier_run` (a fresh entry carries `measured_at`).

Sealed mode (`--sealed`, issue 21): APNs only. Per trial the same NIP-17 DMs (nostr-sdk gift
wraps of `--sealed-chars` characters) are drained once to opaque and once to sealed
registrations, one device per wakeup, in alternating order; the figure is sealed wakeups per
CPU second over opaque ones (target 0.7). It also reports the median sealed push size per
provider for DMs of 100, 500 and 2,000 characters and the share that fell back to the sealed
pointer (read by decrypting with nostr-sdk). Writes bench/results/sealed.json.

Usage: python bench/push.py [--wakeups 20000] [--devices 2000] [--trials 3] [--rate 1000]
       python bench/push.py --sealed [--wakeups 3000] [--trials 5] [--size-samples 50]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from native_apns import NativeApns

from sigil_push.config import Config, parse_config
from sigil_push.delivery import Delivery
from sigil_push.http.server import tune_gc
from sigil_push.nostr.event import Event, sign_event
from sigil_push.nostr.keys import SecretKey
from sigil_push.observations import ObservationLog, now_ms
from sigil_push.push import registry
from sigil_push.push.base import Outcome, Sender, Status, WakeupMessage
from sigil_push.push.factory import build_senders
from sigil_push.push.registry import TABLES
from sigil_push.store.records import Device
from sigil_push.store.sqlite.database import open_database
from sigil_push.store.sqlite.devices import Devices
from sigil_push.store.sqlite.outbox import Outbox
from testkit.fakes.credentials import (
    KEY_ID,
    TEAM_ID,
    TOPIC,
    make_apns_key,
    make_service_account,
    make_tls,
)

RESULTS = Path(__file__).parent / "results" / "push.json"
CONCURRENCY = 256
PLATFORM_OF = {"apns": "ios", "fcm": "android"}


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def pin(pid: int, core: int) -> None:
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) > 1:
        os.sched_setaffinity(pid, {cores[core % len(cores)]})


def start_fake(args: list[str], port: int | None, pinned: bool) -> subprocess.Popen[str]:
    process = subprocess.Popen(
        [sys.executable, "-m", *args], stdout=subprocess.PIPE, text=True,
        cwd=Path(__file__).resolve().parent.parent,
    )
    if pinned:
        pin(process.pid, 1)
    if port is None:
        assert process.stdout is not None
        process.stdout.readline()
    else:
        deadline = time.monotonic() + 20
        import socket

        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
    return process


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU time of processes (from /proc), to show whether a fake was saturated."""
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def spread(ordered: list[float]) -> dict[str, float]:
    """Min, median and max of per-trial figures (sorted): how much a shared machine moved them."""
    return {"min": ordered[0], "median": ordered[len(ordered) // 2], "max": ordered[-1]}


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def bare_apns(config: Config) -> Callable[[Device], Awaitable[bool]]:
    """The aioapns client alone, built exactly as the service builds it (`apns_client`: the same
    protocol class, which writes once per loop tick, and the same pool), sending the same
    pushes (body, headers, cheap apns-ids) with no outbox, no timeout, no bookkeeping."""
    from aioapns import NotificationRequest, PushType

    from sigil_push.push.apns import PROVIDER
    from sigil_push.push.apns_sender import NotificationIds, apns_client

    apns = registry.table(config, PROVIDER)
    assert apns is not None
    key = config.resolve(apns.key_file).read_text()
    client = apns_client(apns, key, config.resolve(apns.ca_file) if apns.ca_file else None)
    ids = NotificationIds()
    body = {"aps": {"alert": {"title": "Sigil", "body": "New message"}, "mutable-content": 1,
                    "sound": "default"}, "event_id": "0" * 64, "relay": "wss://relay.example.com"}

    async def send(device: Device) -> bool:
        request = NotificationRequest(device.token, body, ids.next(), 3600, 10, "c" * 32,
                                      PushType.ALERT)
        return (await client.send_notification(request)).is_successful

    return send


def bare_sender(sender: Sender) -> Callable[[Device], Awaitable[bool]]:
    """firebase-admin through our thin FcmSender (its app carries the endpoint and OAuth)."""
    message = WakeupMessage(("0" * 64,), {"type": "wakeup", "event_id": "0" * 64}, "c" * 32, 3600, False)

    async def send(device: Device) -> bool:
        return (await sender.send(message, device)).status is Status.ACCEPTED

    return send


async def bare_ceiling(
    send: Callable[[Device], Awaitable[bool]], devices: list[Device], count: int, concurrency: int,
    fake_pids: list[int],
) -> tuple[float, float, float]:
    """Wakeups/s of the provider client alone, with the same concurrency, no outbox; and the
    busy fractions of this process and the fake over exactly the timed sends (the warm-up,
    which opens the connection, is left out of both the rate and the CPU).

    `concurrency` senders each send their share one after another: the leanest loop that
    keeps that many sends in flight (no task or semaphore per push), so the ceiling is not
    lowered by loop overhead the client does not need."""
    failures = 0

    async def sender(numbers: Iterator[int]) -> None:
        nonlocal failures
        for i in numbers:
            failures += not await send(devices[i % len(devices)])

    async def run(total: int) -> None:
        numbers = iter(range(total))
        await asyncio.gather(*(sender(numbers) for _ in range(min(concurrency, total))))

    await run(min(500, count))  # warm the connections
    fake_cpu, own_cpu = cpu_seconds(fake_pids), time.process_time()
    started = time.perf_counter()
    await run(count)
    elapsed = time.perf_counter() - started
    own_busy = (time.process_time() - own_cpu) / elapsed
    fake_busy = (cpu_seconds(fake_pids) - fake_cpu) / elapsed
    if failures:
        raise RuntimeError(f"{failures} bare sends failed")
    return count / elapsed, own_busy, fake_busy


class Timed:
    """Wraps a sender to time each send from leaving the outbox to the provider's answer."""

    def __init__(self, inner: Sender) -> None:
        self.inner, self.platform, self.provider = inner, inner.platform, inner.provider
        self.max_concurrency = inner.max_concurrency
        self.durations: list[float] = []
        self.last_answer = 0.0

    def fits(self, data: dict[str, str]) -> bool:
        return self.inner.fits(data)

    async def send(self, message: WakeupMessage, device: Device) -> Outcome:
        started = time.perf_counter()
        outcome = await self.inner.send(message, device)
        self.last_answer = time.perf_counter()
        self.durations.append(self.last_answer - started)
        return outcome

    async def close(self) -> None:
        await self.inner.close()


class Drained(NamedTuple):
    seconds: float
    own_busy: float
    fake_busy: float
    durations: list[float]


async def drain(
    platform_name: str, senders: dict[str, Sender], config: Config, work: Path, store: Devices,
    outbox: Outbox, devices: list[Device], events: list[Event], fake_pids: list[int],
) -> Drained:
    """One full-outbox drain by the real Delivery loop: `events` spread over `devices`, enqueued
    before the clock starts; the seconds to the last answer and the CPU each side spent."""
    seen = now_ms()
    for i, event in enumerate(events):
        await outbox.enqueue(event, "wss://relay.example.com", seen, [devices[i % len(devices)]])
    observations = ObservationLog(work / "observations")
    await observations.start()
    timed = {platform: Timed(sender) for platform, sender in senders.items()}
    delivery = Delivery(outbox, store, dict(timed), observations, True, config.push, config.limits)
    fake_cpu, own_cpu = cpu_seconds(fake_pids), time.process_time()
    started = time.perf_counter()
    await delivery.start()
    while await outbox.depth():
        await asyncio.sleep(0.25)  # a COUNT(*) competes with delivery for the database: rarely
    drain_seconds = timed[platform_name].last_answer - started
    fake_busy = (cpu_seconds(fake_pids) - fake_cpu) / drain_seconds
    own_busy = (time.process_time() - own_cpu) / drain_seconds
    await delivery.stop()
    await observations.stop()
    return Drained(drain_seconds, own_busy, fake_busy, timed[platform_name].durations)


async def trial(
    provider: str, config: Config, work: Path, store: Devices, outbox: Outbox, devices: list[Device], events: list[Event], fake_pids: list[int],
) -> dict[str, Any]:
    """One bare-client run and one full-outbox drain, back to back, with fresh clients."""
    platform_name = PLATFORM_OF[provider]
    senders = await build_senders(config)
    bare = bare_apns(config) if provider == "apns" else bare_sender(senders[platform_name])
    concurrency = senders[platform_name].max_concurrency
    load_before = os.getloadavg()[0]
    ceiling, bare_own_busy, bare_fake_busy = await bare_ceiling(
        bare, devices, len(events), concurrency, fake_pids
    )

    drained = await drain(platform_name, senders, config, work, store, outbox, devices, events,
                          fake_pids)
    drain_seconds, own_busy, fake_busy = drained.seconds, drained.own_busy, drained.fake_busy
    send_ms = [d * 1000 for d in drained.durations]
    rate = len(events) / drain_seconds
    bare_per_cpu, pipeline_per_cpu = ceiling / bare_own_busy, rate / own_busy
    return {
        "bare_client_wakeups_per_second": round(ceiling),
        "pipeline_wakeups_per_second": round(rate),
        "ratio_to_bare_client": round(rate / ceiling, 3),
        "concurrency": concurrency,
        "drain_seconds": round(drain_seconds, 3),
        "wakeups_per_cpu_second": {"bare_client": round(bare_per_cpu),
                                   "pipeline": round(pipeline_per_cpu),
                                   "ratio": round(pipeline_per_cpu / bare_per_cpu, 3)},
        "load_average": {"before": round(load_before, 2), "after": round(os.getloadavg()[0], 2)},
        "cpu_busy_fraction": {"fake_during_bare": round(bare_fake_busy, 2),
                              "bench_process_during_bare": round(bare_own_busy, 2),
                              "fake_during_pipeline": round(fake_busy, 2),
                              "bench_process_during_pipeline": round(own_busy, 2)},
        "send_latency_ms": {"p50": round(percentile(send_ms, 0.5), 2),
                            "p99": round(percentile(send_ms, 0.99), 2)},
    }


async def run_provider(
    provider: str, document: dict[str, Any], folder: Path, args: argparse.Namespace,
    fake_pids: list[int],
) -> dict[str, Any]:
    platform_name = PLATFORM_OF[provider]
    config = parse_config(document, folder / "relays.toml", TABLES)
    work = folder / provider
    work.mkdir()
    db = await open_database(work / "bench.db")
    store, outbox = Devices(db), Outbox(db)
    recipient, sender_key = SecretKey.generate(), SecretKey.generate()
    tokens = [os.urandom(32).hex() if provider == "apns" else f"fcm-{os.urandom(20).hex()}"
              for _ in range(args.devices)]
    devices = [
        (await store.register(recipient.public_key_hex, platform_name, token, "event_id", (), None, 0)).device
        for token in tokens
    ]
    trials = []
    for number in range(args.trials):
        events = [sign_event(sender_key, 4, f"t{number}m{i}", [["p", recipient.public_key_hex]])
                  for i in range(args.wakeups)]
        trials.append(await trial(provider, config, work, store, outbox, devices, events, fake_pids))
        print(provider, "trial", number + 1, json.dumps(trials[-1]), flush=True)
    best = max(trials, key=lambda t: t["pipeline_wakeups_per_second"])
    wall_ratios = sorted(t["ratio_to_bare_client"] for t in trials)
    cpu_ratios = sorted(t["wakeups_per_cpu_second"]["ratio"] for t in trials)

    live_rate = min(args.rate, best["pipeline_wakeups_per_second"] // 2)  # below capacity
    observations = ObservationLog(work / "live-observations")
    await observations.start()
    delivery = Delivery(outbox, store, await build_senders(config), observations, True,
                        config.push, config.limits)
    await delivery.start()
    live = await live_latency(outbox, devices, sender_key, recipient, live_rate, args.seconds)
    await delivery.stop()
    await observations.stop()
    await db.close()
    records = [json.loads(line) for path in (work / "live-observations").glob("*.jsonl")
               for line in path.read_text().splitlines()]
    live_latency_ms = [float(r["latency_ms"]) for r in records
                       if r["type"] == "push" and r["event_id"] in live["event_ids"]]
    return {
        **best,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "wakeups_per_trial": args.wakeups,
        "devices": args.devices,
        "best_of": args.trials,
        "spread": {"ratio_to_bare_client": spread(wall_ratios),
                   "per_cpu_second_ratio": spread(cpu_ratios)},
        "all_trials": [
            {key: t[key] for key in (
                "bare_client_wakeups_per_second", "pipeline_wakeups_per_second",
                "ratio_to_bare_client", "wakeups_per_cpu_second", "load_average",
            )}
            for t in trials
        ],
        "live": {
            "rate_per_second": live_rate,
            "achieved_rate_per_second": round(live["achieved_rate"]),
            "wakeups": len(live_latency_ms),
            "outbox_to_answer_ms": {
                "p50": round(percentile(live_latency_ms, 0.5), 1),
                "p99": round(percentile(live_latency_ms, 0.99), 1),
            },
        },
    }


async def live_latency(outbox: Outbox, devices: list[Device], sender_key: SecretKey,
                       recipient: SecretKey, per_second: int, seconds: int) -> dict[str, Any]:
    """Open-loop enqueue at a fixed rate; latency is read from the observation log later."""
    total = per_second * seconds
    events = [sign_event(sender_key, 4, f"live{i}", [["p", recipient.public_key_hex]]) for i in range(total)]
    started = time.perf_counter()
    for i, event in enumerate(events):
        delay = started + i / per_second - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        await outbox.enqueue(event, "wss://relay.example.com", now_ms(), [devices[i % len(devices)]])
    achieved = total / (time.perf_counter() - started)
    while await outbox.depth():
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.5)
    return {"event_ids": {e.id for e in events}, "achieved_rate": achieved}


SEALED_RESULTS = Path(__file__).parent / "results" / "sealed.json"
DM_LENGTHS = (100, 500, 2000)
BENCH_RELAY = "wss://relay.example.com"


def nip17_dms(sender: Any, recipient: Any, chars: int, count: int) -> list[Event]:
    """`count` NIP-17 gift wraps (kind 1059, made by nostr-sdk as a client makes them) of a
    `chars`-character message each."""
    import nostr_sdk

    words = "the quick brown fox jumps over the lazy dog and back again "
    text = (words * (chars // len(words) + 1))[:chars]
    return [
        Event.from_json(json.loads(
            nostr_sdk.nip17_make_private_msg(sender, recipient.public_key(), text).as_json()
        ))
        for _ in range(count)
    ]


def sealed_sizes(samples: int) -> dict[str, Any]:
    """Median sealed push size per provider for NIP-17 DMs of each length in DM_LENGTHS, and
    the share that fell back to the pointer (read by decrypting with nostr-sdk)."""
    import nostr_sdk

    from sigil_push.push.apns_sender import apns_size
    from sigil_push.push.fcm_sender import fcm_size
    from sigil_push.push.payload import MAX_PAYLOAD_BYTES, sealed_data
    from sigil_push.push.unifiedpush_sender import unifiedpush_size

    measure = {"apns": apns_size, "fcm": fcm_size, "unifiedpush": unifiedpush_size}
    device = SecretKey.generate()
    device_secret = nostr_sdk.SecretKey.parse(device.secret_hex)
    sender, recipient = nostr_sdk.Keys.generate(), nostr_sdk.Keys.generate()
    report: dict[str, Any] = {}
    for chars in DM_LENGTHS:
        wraps = nip17_dms(sender, recipient, chars, samples)
        event_bytes = sorted(len(json.dumps(w.to_json(), separators=(",", ":")).encode())
                             for w in wraps)
        entry: dict[str, Any] = {"gift_wrap_json_bytes_median": event_bytes[len(event_bytes) // 2]}
        for provider, size in measure.items():
            sizes, pointers = [], 0
            for wrap in wraps:
                data = sealed_data(
                    device.public_key_hex, wrap.id, BENCH_RELAY,
                    json.dumps(wrap.to_json(), separators=(",", ":"), ensure_ascii=False),
                    lambda d, size=size: size(d) <= MAX_PAYLOAD_BYTES,  # type: ignore[misc]
                )
                sizes.append(size(data))
                opened = json.loads(nostr_sdk.nip44_decrypt(
                    device_secret, nostr_sdk.PublicKey.parse(data["epk"]), data["sealed"]
                ))
                pointers += "event" not in opened
            sizes.sort()
            entry[provider] = {"median_bytes": sizes[len(sizes) // 2], "max_bytes": sizes[-1],
                               "pointer_share": round(pointers / len(wraps), 3)}
        report[f"{chars}_chars"] = entry
    return report


async def run_sealed(document: dict[str, Any], folder: Path, args: argparse.Namespace,
                     fake_pids: list[int]) -> dict[str, Any]:
    """Sealed against opaque wakeups through the whole pipeline to APNs: the same NIP-17 DMs
    drained once to opaque registrations and once to sealed ones, per trial, in alternating
    order (so a load change on the shared machine does not always favour one side).

    One device per wakeup in each mode: a phone's opaque wakeups that are due together become
    one push, which would compare one opaque push for many wakeups with a push per sealed one.
    """
    import nostr_sdk

    config = parse_config(document, folder / "relays.toml", TABLES)
    work = folder / "sealed"
    work.mkdir()
    db = await open_database(work / "bench.db")
    store, outbox = Devices(db), Outbox(db)
    sender, recipient = nostr_sdk.Keys.generate(), nostr_sdk.Keys.generate()
    recipient_hex = str(recipient.public_key().to_hex())
    by_mode: dict[str, list[Device]] = {}
    for mode in ("opaque", "sealed"):
        by_mode[mode] = [
            (await store.register(
                recipient_hex, "ios", os.urandom(32).hex(), mode, (), None, 0,
                device_key=SecretKey.generate().public_key_hex if mode == "sealed" else None,
            )).device
            for _ in range(args.wakeups)
        ]
    trials = []
    for number in range(args.trials):
        events = nip17_dms(sender, recipient, args.sealed_chars, args.wakeups)
        order = ("opaque", "sealed") if number % 2 == 0 else ("sealed", "opaque")
        per_cpu: dict[str, float] = {}
        load_before = os.getloadavg()[0]
        for mode in order:
            senders = await build_senders(config)
            drained = await drain("ios", senders, config, work, store, outbox, by_mode[mode],
                                  events, fake_pids)
            per_cpu[mode] = len(events) / drained.seconds / drained.own_busy
        trials.append({
            "wakeups_per_cpu_second": {m: round(v) for m, v in per_cpu.items()},
            "ratio": round(per_cpu["sealed"] / per_cpu["opaque"], 3),
            "load_average": {"before": round(load_before, 2), "after": round(os.getloadavg()[0], 2)},
        })
        print("sealed trial", number + 1, json.dumps(trials[-1]), flush=True)
    await db.close()
    ratios = sorted(t["ratio"] for t in trials)
    return {
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "dm_chars": args.sealed_chars,
        "wakeups_per_trial": args.wakeups,
        "devices_per_mode": args.wakeups,
        "sealed_per_opaque_cpu_second": spread(ratios),
        "trials": trials,
    }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    if args.pin:
        pin(0, 0)
    folder = Path(tempfile.mkdtemp(prefix="sigil-push-bench-"))
    tls = make_tls(folder)
    apns_key, apns_public = make_apns_key(folder)
    (folder / "apns-public.pem").write_bytes(apns_public)
    fcm_port = free_port()
    account, _ = make_service_account(folder, f"http://127.0.0.1:{fcm_port}/token")
    apns_port = free_port()
    native = NativeApns(folder, tls.cert_file, tls.key_file) if args.apns == "nginx" else None
    fakes = [
        start_fake(["testkit.fakes.fake_fcm", "--port", str(fcm_port)], fcm_port, args.pin),
    ]
    if native is None:
        fakes.append(start_fake(
            ["testkit.fakes.fake_apns", "--cert", str(tls.cert_file), "--key", str(tls.key_file),
             "--public-key", str(folder / "apns-public.pem"), "--port", str(apns_port)],
            None, args.pin,
        ))
    else:
        apns_port = native.port
    fake_pids = {
        "fcm": [fakes[0].pid], "apns": native.pids() if native else [fakes[1].pid],
    }
    limits = {"wakeups_per_minute_per_device": 0, "coalesce_window_ms": 0}
    push = {"concurrency_per_provider": CONCURRENCY}
    documents = {
        "apns": {"apns": {"team_id": TEAM_ID, "key_id": KEY_ID, "key_file": str(apns_key), "topic": TOPIC,
                          "environment": "sandbox", "endpoint": f"https://127.0.0.1:{apns_port}",
                          "ca_file": str(tls.ca_file)}, "limits": limits, "push": push},
        "fcm": {"fcm": {"credentials_file": str(account), "endpoint": f"http://127.0.0.1:{fcm_port}"},
                "limits": limits, "push": push},
    }
    try:
        if args.sealed:
            return {
                "benchmark": "sealed against opaque wakeups, APNs, whole pipeline",
                "machine": {"python": platform.python_version(), "cpus": os.cpu_count(),
                            "event_loop": "uvloop (as serve)", "apns_endpoint": args.apns},
                "throughput": await run_sealed(documents["apns"], folder, args, fake_pids["apns"]),
                "payload_sizes": sealed_sizes(args.size_samples),
                "load_average_at_end": os.getloadavg()[0],
                "targets": {"sealed_per_opaque_cpu_second": 0.7},
            }
        results = {}
        for provider in args.providers:
            results[provider] = await run_provider(
                provider, documents[provider], folder, args, fake_pids[provider]
            )
            if provider == "apns":
                results[provider]["apns_endpoint"] = args.apns
            print(provider, json.dumps(results[provider]), flush=True)
    finally:
        for fake in fakes:
            fake.terminate()
            fake.wait(10)
        if native is not None:
            native.stop()
    return {
        "benchmark": "push delivery from a full outbox",
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(),
                    "pinned": "bench on core 0, fakes on core 1" if args.pin else "no",
                    "event_loop": "uvloop (as serve)",
                    "load_average_at_end": os.getloadavg()[0]},
        "concurrency_per_provider": CONCURRENCY,
        "results": results,
        "targets": {"apns_wakeups_per_second": 3000, "ratio_to_bare_client": 0.7,
                    "apns_per_cpu_second_ratio": 0.85},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wakeups", type=int, default=20_000)
    parser.add_argument("--devices", type=int, default=2_000)
    parser.add_argument("--rate", type=int, default=1_000)
    parser.add_argument("--seconds", type=int, default=5)
    parser.add_argument("--trials", type=int, default=3, help="report the best drain (all are kept)")
    parser.add_argument("--pin", action="store_true",
                        help="pin this process and the fakes to separate cores (slower under gVisor)")
    parser.add_argument("--providers", nargs="+", default=["apns", "fcm"])
    parser.add_argument("--note", default="", help="sealed mode: a note kept with the results")
    parser.add_argument(
        "--apns", choices=["nginx", "python"], default="nginx",
        help="the APNs endpoint: nginx (bench/native_apns.py, C, a few µs per request) or the "
        "test suite's checking fake (h2 in Python, most of a core at these rates)",
    )
    parser.add_argument(
        "--sealed", action="store_true",
        help="sealed mode: APNs only, sealed against opaque wakeups of the same NIP-17 DMs per CPU "
        "second, and sealed payload sizes; writes bench/results/sealed.json",
    )
    parser.add_argument("--sealed-chars", type=int, default=100,
                        help="message length of the DMs drained in sealed mode")
    parser.add_argument("--size-samples", type=int, default=50,
                        help="gift wraps per message length for the payload sizes")
    args = parser.parse_args()
    tune_gc()  # as `sigil-push serve` does
    summary = uvloop.run(main_async(args))  # `sigil-push serve` runs on uvloop through uvicorn
    if args.sealed:
        summary["note"] = args.note
        if SEALED_RESULTS.exists():  # earlier runs' figures (kept under their own keys) stay
            earlier = json.loads(SEALED_RESULTS.read_text())
            summary = {**{k: v for k, v in earlier.items() if k not in summary}, **summary}
        SEALED_RESULTS.write_text(json.dumps(summary, indent=2) + "\n")
        print(f"wrote {SEALED_RESULTS}")
        return
    if RESULTS.exists():
        earlier = json.loads(RESULTS.read_text()).get("results", {})
        kept = {p: {**r, "kept_from_earlier_run": True} for p, r in earlier.items()
                if p not in summary["results"]}
        summary["results"] = {**kept, **summary["results"]}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
