"""What one APNs push costs this process, bare client against the pipeline, on a fixed workload.

bench/push.py measures rates on a shared machine, where the other engineers' load moves the
figures by ±10 %. This measures cost instead, so a change to the pipeline can be compared
against the bare client run for run:

- `cpu`: each side in its own fresh process, CPU seconds (all threads) for a fixed number of
  pushes, minus a shorter run of the same side, so start-up, imports and the TLS handshake
  cancel out; the sides alternate, and the median of `--repeats` is reported.
- `callgrind`: the same differential, counted in instructions under `valgrind --tool=callgrind`
  (slow, but the count does not depend on what else runs on the machine). Valgrind runs
  Python about 56x slower while timers keep wall-clock time, so work done per interval (the
  completion burst's 20 ms, the delivery loop's housekeeping each second, the log's flush
  every 0.25 s, this harness's depth poll) would run 56x as often per push as natively, and
  the smaller bursts would cost more per push. The pipeline child stretches those intervals
  by `--timer-scale` (default 56, measured) so each keeps its native share per push;
  `--timer-scale 1` counts them at valgrind's pace (2026-11-23 at 73acf75: 0.835 that way).

Both sides do what bench/push.py's do: the bare side is `bench.push.bare_apns` (the service's
own aioapns client, same body, headers and apns-ids, `concurrency` loops, no outbox); the
pipeline side drains an outbox already filled (by the parent, before the child starts) through
the real Delivery loop with the observation log on. Both send to one fake APNs process (which
is not measured).

Usage: python bench/push_cost.py [--mode cpu|callgrind] [--pushes 8000] [--repeats 5]
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
from pathlib import Path
from typing import Any

import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.push import CONCURRENCY, bare_apns, free_port, start_fake
from sigil_push import observations as observations_module
from sigil_push.config import parse_config
from sigil_push.delivery import Delivery
from sigil_push.delivery import facade as delivery_facade
from sigil_push.delivery import settle as delivery_settle
from sigil_push.http.server import tune_gc
from sigil_push.nostr.event import sign_event
from sigil_push.nostr.keys import SecretKey
from sigil_push.observations import ObservationLog, now_ms
from sigil_push.push.factory import build_senders
from sigil_push.push.registry import TABLES
from sigil_push.store.sqlite.database import open_database
from sigil_push.store.sqlite.devices import Devices
from sigil_push.store.sqlite.outbox import Outbox
from testkit.fakes.credentials import KEY_ID, TEAM_ID, TOPIC, make_apns_key, make_tls

DEVICES = 2000
DEPTH_POLL_SECONDS = 0.25
VALGRIND_SLOWDOWN = 56.0  # a CPU-bound Python loop: 1.49 s of CPU natively, 83.1 s under callgrind


def document(folder: Path, port: int) -> dict[str, Any]:
    return {
        "apns": {"team_id": TEAM_ID, "key_id": KEY_ID, "key_file": str(folder / f"AuthKey_{KEY_ID}.p8"),
                 "topic": TOPIC, "environment": "sandbox", "endpoint": f"https://127.0.0.1:{port}",
                 "ca_file": str(folder / "ca.pem")},  # as make_tls names them
        "limits": {"wakeups_per_minute_per_device": 0, "coalesce_window_ms": 0},
        "push": {"concurrency_per_provider": CONCURRENCY},
    }


async def fill(database: Path, pushes: int) -> None:
    """A fresh outbox of `pushes` wakeups for DEVICES iOS devices (payload mode event_id)."""
    db = await open_database(database)
    store, outbox = Devices(db), Outbox(db)
    recipient, sender_key = SecretKey.generate(), SecretKey.generate()
    devices = [
        (await store.register(recipient.public_key_hex, "ios", os.urandom(32).hex(), "event_id",
                              (), None, 0)).device
        for _ in range(DEVICES)
    ]
    seen = now_ms()
    for i in range(pushes):
        event = sign_event(sender_key, 4, f"m{i}", [["p", recipient.public_key_hex]])
        await outbox.enqueue(event, "wss://relay.example.com", seen, [devices[i % DEVICES]])
    await db.close()


def stretch_timers(factor: float) -> None:
    """Under valgrind every instruction takes about `factor` times longer while timers keep
    wall-clock time, so work that runs per interval (the completion burst's 20 ms, the
    delivery loop's housekeeping each second, the log's flush every 0.25 s, this harness's own
    depth poll) would run `factor` times as often per push as at full speed, and be counted
    as the pipeline's cost per push. Stretching those intervals by the same factor keeps each
    one's share per push as it is natively. Measurement only: nothing else changes."""
    delivery_settle.COMPLETE_WITHIN_SECONDS *= factor
    delivery_facade.HOUSEKEEPING_SECONDS *= factor
    delivery_facade.IDLE_POLL_SECONDS *= factor
    observations_module.FLUSH_INTERVAL_SECONDS *= factor
    global DEPTH_POLL_SECONDS
    DEPTH_POLL_SECONDS *= factor


async def child(side: str, folder: Path, port: int, database: Path, pushes: int) -> float:
    """One side's run in this (fresh) process; returns its CPU seconds, start-up included."""
    config = parse_config(document(folder, port), folder / "relays.toml", TABLES)
    db = await open_database(database)
    store, outbox = Devices(db), Outbox(db)
    if side == "bare":
        devices = await store.of_pubkeys(list(await store.watched_keys()))
        send = bare_apns(config)
        numbers = iter(range(pushes))

        async def loop() -> None:
            for i in numbers:
                if not await send(devices[i % len(devices)]):
                    raise RuntimeError("bare send failed")

        await asyncio.gather(*(loop() for _ in range(CONCURRENCY)))
    else:
        observations = ObservationLog(folder / f"observations-{os.getpid()}")
        await observations.start()
        delivery = Delivery(outbox, store, await build_senders(config), observations, True,
                            config.push, config.limits)
        await delivery.start()
        while await outbox.depth():
            await asyncio.sleep(DEPTH_POLL_SECONDS)
        await delivery.stop()
        await observations.stop()
    await db.close()
    return time.process_time()


def run_child(args: argparse.Namespace, side: str, pushes: int, port: int, template: Path,
              callgrind: bool) -> float:
    """CPU seconds (or instructions, under callgrind) of one fresh child process."""
    database = Path(args.folder) / f"run-{side}-{pushes}.db"
    shutil.copyfile(template, database)
    command = [sys.executable, __file__, "child", "--side", side, "--folder", args.folder,
               "--port", str(port), "--database", str(database), "--pushes", str(pushes),
               "--timer-scale", str(args.timer_scale if callgrind else 1.0)]
    out = Path(args.folder) / "callgrind.out"
    if callgrind:
        command = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", *command]
    elif args.py_spy:
        profile = Path(args.py_spy) / f"{side}-{pushes}-{time.time_ns()}.txt"
        command = ["py-spy", "record", "--format", "raw", "--rate", "500", "--threads",
                   "--output", str(profile), "--", *command]
    finished = subprocess.run(command, capture_output=True, text=True, check=True)
    database.unlink()
    if not callgrind:
        return float(next(line for line in finished.stdout.splitlines()
                          if line.strip() and not line.startswith("py-spy>")))
    for line in out.read_text().splitlines():
        if line.startswith(("totals:", "summary:")):
            return float(line.split()[1])
    raise RuntimeError("no totals in the callgrind output")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("role", nargs="?", default="parent", choices=["parent", "child"])
    parser.add_argument("--mode", default="cpu", choices=["cpu", "callgrind"])
    parser.add_argument("--pushes", type=int, default=8000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sides", nargs="+", default=["bare", "pipeline"])
    parser.add_argument("--py-spy", metavar="FOLDER",
                        help="record each child with py-spy (raw stacks) into FOLDER")
    parser.add_argument(
        "--timer-scale", type=float, default=VALGRIND_SLOWDOWN,
        help="under callgrind, stretch the pipeline's timers by this factor (valgrind's "
        "slowdown; 1 counts them as often as valgrind's slow clock makes them fire)",
    )
    parser.add_argument("--side", help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--database", help=argparse.SUPPRESS)
    args = parser.parse_args()
    tune_gc()  # as `sigil-push serve` does
    if args.role == "child":
        stretch_timers(args.timer_scale)
        print(uvloop.run(child(args.side, Path(args.folder), args.port, Path(args.database),
                               args.pushes)))
        return
    args.folder = tempfile.mkdtemp(prefix="sigil-push-cost-")
    folder = Path(args.folder)
    tls = make_tls(folder)
    _, public = make_apns_key(folder)
    (folder / "apns-public.pem").write_bytes(public)
    port = free_port()
    fake = start_fake(["testkit.fakes.fake_apns", "--cert", str(tls.cert_file), "--key",
                       str(tls.key_file), "--public-key", str(folder / "apns-public.pem"),
                       "--port", str(port)], None, False)
    short, long = args.pushes // 4, args.pushes
    templates = {n: folder / f"template-{n}.db" for n in (short, long)}
    for n, path in templates.items():
        uvloop.run(fill(path, n))
    callgrind = args.mode == "callgrind"
    unit = "instructions" if callgrind else "cpu_us"
    scale = 1.0 if callgrind else 1e6
    per_push: dict[str, list[float]] = {side: [] for side in args.sides}
    try:
        for number in range(args.repeats):
            for side in args.sides:
                costs = {n: run_child(args, side, n, port, templates[n], callgrind)
                         for n in (short, long)}
                per_push[side].append(scale * (costs[long] - costs[short]) / (long - short))
                print(f"repeat {number + 1} {side}: {per_push[side][-1]:.1f} {unit} per push "
                      f"(load {os.getloadavg()[0]:.2f})", flush=True)
    finally:
        fake.terminate()
        fake.wait(10)
        shutil.rmtree(folder, ignore_errors=True)
    summary: dict[str, Any] = {
        "unit": f"{unit} per push", "pushes": [short, long],
        "median": {side: round(statistics.median(v), 1) for side, v in per_push.items()},
        "all": {side: [round(x, 1) for x in v] for side, v in per_push.items()},
    }
    if {"bare", "pipeline"} <= per_push.keys():
        ratios = sorted(b / p for b, p in zip(per_push["bare"], per_push["pipeline"], strict=True))
        summary["pipeline_per_cost_ratio"] = {
            "median": round(statistics.median(ratios), 3), "min": round(ratios[0], 3),
            "max": round(ratios[-1], 3),
        }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
