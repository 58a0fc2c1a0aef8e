"""The delivery pipeline's own instructions per push, without timers: a deterministic count.

`bench/push_cost.py --mode callgrind` counts a real drain, whose interval-driven work (the
completion burst, housekeeping, the log's flush) depends on how fast valgrind runs, so on a
loaded machine the same tree counted anywhere from 0.87 to 2.2 million instructions a push.
This drives the loop's steps by hand instead: one due batch planned and queued, its sender
tasks run to the end against a provider stub that answers on the next loop tick, then the
answered rows are recorded and deleted in one burst. No timer fires, so the count per push
(the differential of two fills under callgrind, `--short` and `--pushes`) moves by about
0.2 % from run to run whatever the load. It measures the pipeline's Python and SQLite work
only: no HTTP/2, no provider.

Usage: python bench/delivery_steps.py [--pushes 4000] [--short 1000]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.push_cost import fill
from sigil_push.config import LimitsConfig, PushConfig
from sigil_push.delivery import Delivery
from sigil_push.http.server import tune_gc
from sigil_push.observations import ObservationLog, now_ms
from sigil_push.push.base import Outcome, Status, WakeupMessage
from sigil_push.store.records import Device
from sigil_push.store.sqlite.database import open_database
from sigil_push.store.sqlite.devices import Devices
from sigil_push.store.sqlite.outbox import Outbox

ACCEPTED = Outcome(Status.ACCEPTED)


class NextTick:
    """A provider that accepts every push on the next loop tick (APNs' answer, minus APNs)."""

    platform, provider, max_concurrency = "ios", "apns", 256

    def fits(self, data: dict[str, str]) -> bool:
        return True

    async def send(self, message: WakeupMessage, device: Device) -> Outcome:
        await asyncio.sleep(0)
        return ACCEPTED

    async def close(self) -> None:
        return None


async def drain(database: Path) -> None:
    """Step the loop by hand until the outbox is empty (no start(): no timer-driven task)."""
    db = await open_database(database)
    store, outbox = Devices(db), Outbox(db)
    observations = ObservationLog(database.parent / f"observations-{os.getpid()}")
    await observations.start()
    delivery = Delivery(outbox, store, {"ios": NextTick()}, observations, True, PushConfig(),
                        LimitsConfig(wakeups_per_minute_per_device=0, coalesce_window_ms=0))
    await outbox.resume(now_ms())
    tasks = delivery._dispatcher._tasks  # private parts: a measurement harness
    while await outbox.depth():
        await delivery._step()
        while tasks:
            await asyncio.wait(set(tasks))
        await delivery._settlement.flush()
    await observations.stop()
    await db.close()


def count(database: Path) -> int:
    """Instructions of one drain of `database` under callgrind."""
    out = database.parent / "callgrind.out"
    subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable,
                    __file__, "child", "--database", str(database)],
                   check=True, capture_output=True)
    for line in out.read_text().splitlines():
        if line.startswith(("totals:", "summary:")):
            return int(line.split()[1])
    raise RuntimeError("no totals in the callgrind output")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("role", nargs="?", default="parent", choices=["parent", "child"])
    parser.add_argument("--pushes", type=int, default=4000)
    parser.add_argument("--short", type=int, default=1000)
    parser.add_argument("--database", help=argparse.SUPPRESS)
    args = parser.parse_args()
    tune_gc()  # as `sigil-push serve` does
    if args.role == "child":
        uvloop.run(drain(Path(args.database)))
        return
    with tempfile.TemporaryDirectory(prefix="sigil-push-steps-") as folder:
        counts = {}
        for pushes in (args.short, args.pushes):
            database = Path(folder) / f"outbox-{pushes}.db"
            uvloop.run(fill(database, pushes))
            counts[pushes] = count(database)
    per_push = (counts[args.pushes] - counts[args.short]) / (args.pushes - args.short)
    print(f"{per_push:.0f} instructions per push ({args.pushes} minus {args.short} pushes)")


if __name__ == "__main__":
    main()
