"""Benchmark: what Iris subscriptions cost the bridge's head on a firehose of public events that
match nobody (issue 33: "an event matching nobody pays no signature check", and the cost flat
in the number of subscriptions).

An in-process `Bridge` (testkit.in_process, SQLite) reads one relay in firehose mode (nothing
listens there: frames are handed to `RelayPool.deliver_text` as the connection would, on the
live firehose's path). The frames are `--events` signed events of kinds 1, 6, 7 and 9735, each
naming one to three random keys, by random authors: none names a watched key. The bridge holds
0, 1,000 or 100,000 Iris subscribers, each with Iris's two filters (`{"#p": [me], "kinds": [1,
6, 7, 9735]}` and `{"kinds": [1060], "authors": [three session keys]}`), compiled into its
watch index as the bridge compiles stored subscriptions. The collector is tuned as `serve`
tunes it (`http.server.tune_gc`): with Python's default thresholds, a young collection every
700 allocations makes the older generations' scans of 100,000 subscribers' watches the cost;
and each run starts after a full collection, as a service that has been running would be. Figures: CPU per event of handing the
frames to the bridge (the event loop's thread; nothing is queued, committed or verified), and
bare id+signature verification of the same events (`Event.verify`) in the same process,
before and after: `cpu_ratio` = bare verification's CPU per event over the bridge's; and the
same with the cyclic collector off (`collector_off_*`: the matching's own cost, without the
collector's scans, which grow with everything the process holds). Each
configuration runs `--repeat` times, in turns; medians are reported.

Usage: python bench/iris_match.py [--events 20000] [--subscribers 0,1000,100000] [--repeat 3]
Writes bench/results/iris_match-<date>-<commit>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from sigil_push.bridge.watches import subscription_watches
from sigil_push.http.server import tune_gc
from sigil_push.nostr.event import Event, sign_event
from sigil_push.nostr.keys import SecretKey
from testkit.in_process import in_process_bridge

RELAY = "ws://127.0.0.1:9"
KINDS = (1, 6, 7, 9735)
RESULTS = Path(__file__).parent / "results"


def random_key(rng: random.Random) -> str:
    return f"{rng.getrandbits(256):064x}"


def make_frames(count: int, seed: int = 33) -> tuple[list[str], list[dict[str, Any]]]:
    rng = random.Random(seed)
    authors = [SecretKey.generate() for _ in range(50)]
    frames: list[str] = []
    raws: list[dict[str, Any]] = []
    for n in range(count):
        kind = KINDS[n % len(KINDS)]
        tags = [["p", random_key(rng)] for _ in range(1 + n % 3)]
        raw = sign_event(authors[n % len(authors)], kind, f"note {n}", tags).to_json()
        raws.append(raw)
        frames.append(json.dumps(["EVENT", "sp0.1", raw], separators=(",", ":")))
    return frames, raws


def bare_verification(raws: list[dict[str, Any]]) -> float:
    """CPU seconds per event of parsing and verifying each event's id and signature."""
    start = time.process_time()
    for raw in raws:
        Event.from_json(raw).verify()
    return (time.process_time() - start) / len(raws)


async def run(folder: Path, subscribers: int, frames: list[str], seed: int,
              collect: bool = True) -> float:
    """CPU seconds per frame handed to a bridge holding `subscribers` Iris subscribers (with
    the cyclic collector off when not `collect`: the matching's own cost)."""
    rng = random.Random(seed)
    async with in_process_bridge(folder, str(folder / "push.db"),
                                 [{"url": RELAY, "mode": "firehose"}]) as parts:
        iris = parts.bridge._iris
        for number in range(subscribers):
            owner = random_key(rng)
            document = {
                "filter": {"#p": [owner], "kinds": list(KINDS)},
                "filters": [{"kinds": [1060], "authors": [random_key(rng) for _ in range(3)]}],
            }
            iris.index.replace_owner(owner, subscription_watches(owner, [number + 1], document))
        iris.publish()
        # a running service's index has long been through a full collection; one just built
        # has not, and the first full collection after it (a scan of every watch) would land
        # in the measured window of the largest configuration only
        gc.collect()
        pool = parts.bridge.pool
        assert pool.subs[RELAY].streaming, "the live firehose path"
        if not collect:
            gc.disable()
        try:
            start = time.process_time()
            for frame in frames:
                pool.deliver_text(RELAY, frame, 0)
            return (time.process_time() - start) / len(frames)
        finally:
            gc.enable()


def commit() -> str:
    out = subprocess.run(["git", "rev-parse", "--short=10", "HEAD"], capture_output=True,
                         text=True, check=False, cwd=Path(__file__).parent)
    return out.stdout.strip() or "unknown"


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--subscribers", default="0,1000,100000")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    tune_gc()  # as `serve` does: a young-generation collection every 50,000 allocations
    counts = [int(n) for n in args.subscribers.split(",")]
    frames, raws = make_frames(args.events)
    bare = [bare_verification(raws)]
    runs: dict[int, list[float]] = {n: [] for n in counts}
    without_gc: dict[int, list[float]] = {n: [] for n in counts}
    with tempfile.TemporaryDirectory() as tmp:
        for turn in range(args.repeat):
            for n in counts:
                for collect, into in ((True, runs), (False, without_gc)):
                    folder = Path(tmp) / f"{n}-{turn}-{collect}"
                    folder.mkdir()
                    into[n].append(await run(folder, n, frames, turn, collect))
    bare.append(bare_verification(raws))
    bare_us = statistics.fmean(bare) * 1e6
    summary = {
        str(n): {
            "cpu_us_per_event": {"median": round(statistics.median(v) * 1e6, 2),
                                 "runs": [round(x * 1e6, 2) for x in v]},
            "cpu_ratio": round(bare_us / (statistics.median(v) * 1e6), 2),
            "collector_off_cpu_us_per_event": {
                "median": round(statistics.median(without_gc[n]) * 1e6, 2),
                "runs": [round(x * 1e6, 2) for x in without_gc[n]],
            },
        }
        for n, v in runs.items()
    }
    result = {
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "commit": commit(),
        "command": "python bench/iris_match.py " + " ".join(
            f"--{k} {v}" for k, v in vars(args).items()),
        "machine": {"cpus": os.cpu_count(), "load_1min": round(os.getloadavg()[0], 2),
                    "note": "shared machine: medians of the runs, taken in turns"},
        "events": args.events,
        "bare_verify_cpu_us_per_event": [round(b * 1e6, 2) for b in bare],
        "summary": summary,
    }
    print(json.dumps(result, indent=2))
    RESULTS.mkdir(exist_ok=True)
    name = f"iris_match-{time.strftime('%Y-%m-%d')}-{result['commit']}.json"
    (RESULTS / name).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    asyncio.run(main())
