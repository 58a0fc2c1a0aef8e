"""The floor of ingest in this language: the least any verifying, durable reader must do.

`bench/ingest.py` compares the bridge's CPU per unique event with bare verification
(`Event.verify` on already-parsed events). This script measures what that comparison allows at
best: a reader with none of the bridge's features, only the steps no correct ingest can skip.
Per frame it
1. reads the frame from a websocket with the same C frame reader the bridge uses (aiohttp);
2. parses it (orjson, as the bridge does) and takes the event's id;
3. for an id not seen before: builds the `Event` (field checks), verifies id and signature
   (the baseline's own work), and queues one `seen` row and one outbox row;
4. for an id already seen: nothing more (not even the relay is recorded).
Every 256 unique events (and at the end) the rows go to a real SQLite file in WAL mode with
`synchronous = NORMAL`, as one transaction of two `executemany` INSERTs, on the same thread
(no hand-off cost), into the cheapest tables that still de-duplicate durably. There is no recipient matching, no observation log, no metrics, no
batching timer, no back-pressure and no supervision.

Events, relay (the tiny relay of bench/ingest.py, on its own core) and the CPU window are
those of `bench/ingest.py`'s ingest and copies phases. `cpu_ratio` is bare verification's CPU
per event over this reader's process CPU per unique event. If it is below a target, no
implementation of the bridge on this stack can reach that target.

Usage: python bench/ingest_floor.py [--events 30000] [--repeat 3] [--copies 1,4]
Prints the figures and adds them under "floor" in bench/results/ingest.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parent))

import ingest as ingest_bench  # bench/ingest.py: the relay, events and baseline

from sigil_push.nostr.event import Event

BATCH = 256
# the cheapest tables that still de-duplicate durably: the seen ids are the one key (no rowid
# table beside the index), and the outbox needs no unique index because an id is committed once
SCHEMA = (
    "CREATE TABLE seen (id TEXT PRIMARY KEY, relay TEXT NOT NULL, ts INTEGER NOT NULL)"
    " WITHOUT ROWID;"
    "CREATE TABLE outbox (id INTEGER PRIMARY KEY, device_id INTEGER NOT NULL,"
    " event_id TEXT NOT NULL, next_attempt_ms INTEGER NOT NULL);"
)


class FloorReader:
    """The steps of ingest that no correct implementation can skip, and nothing else."""

    def __init__(self, database: Path) -> None:
        self._db = sqlite3.connect(database, isolation_level=None)
        self._db.execute("PRAGMA journal_mode = WAL")
        self._db.execute("PRAGMA synchronous = NORMAL")
        self._db.executescript(SCHEMA)
        self.seen: set[str] = set()
        self.frames = 0
        self.committed = 0
        self._rows: list[tuple[str, str, int]] = []

    def frame(self, text: str | bytes, relay: str) -> None:
        self.frames += 1
        message = orjson.loads(text)
        if message[0] != "EVENT":
            return
        raw = message[2]
        event_id = raw["id"]
        if event_id in self.seen:
            return
        event = Event.from_json(raw)
        event.verify()
        self.seen.add(event_id)
        self._rows.append((event_id, relay, int(time.time() * 1000)))
        if len(self._rows) >= BATCH:
            self.flush()

    def flush(self) -> None:
        rows, self._rows = self._rows, []
        if not rows:
            return
        self._db.execute("BEGIN")
        self._db.executemany("INSERT INTO seen (id, relay, ts) VALUES (?, ?, ?)", rows)
        self._db.executemany(
            "INSERT INTO outbox (device_id, event_id, next_attempt_ms) VALUES (?, ?, ?)",
            [(n, event_id, ts) for n, (event_id, _, ts) in enumerate(rows)],
        )
        self._db.execute("COMMIT")
        self.committed += len(rows)

    def close(self) -> None:
        self._db.close()


async def read(ws: aiohttp.ClientWebSocketResponse, relay: str, reader: FloorReader) -> None:
    async for message in ws:
        if message.type in (aiohttp.WSMsgType.TEXT, aiohttp.WSMsgType.BINARY):
            reader.frame(message.data, relay)


async def run_once(folder: Path, count: int, copies: int) -> dict[str, Any]:
    ingest_bench.pin(ingest_bench.BRIDGE_CORE)
    events = ingest_bench.make_events(ingest_bench.make_keys(1000), count)
    ingest_bench.write_events(events, folder / "events.jsonl")
    _, bare_cpu_before = ingest_bench.bare_verification(events)
    relay = ingest_bench.TinyRelay(folder)
    reader = FloorReader(folder / "floor.db")
    try:
        async with aiohttp.ClientSession() as session:
            sockets = []
            for url in relay.urls(copies):
                ws = await session.ws_connect(url, max_msg_size=0, autoping=True)
                await ws.send_str(json.dumps(["REQ", "floor", {"kinds": [4]}]))
                await ws.receive()  # EOSE
                sockets.append((ws, url))
            readers = [asyncio.create_task(read(ws, url, reader)) for ws, url in sockets]
            cpu_before = time.process_time()
            await relay.stream(folder / "events.jsonl", 0)
            await ingest_bench.Harness.until(lambda: reader.frames >= count * copies)
            reader.flush()
            cpu = time.process_time() - cpu_before
            for ws, _ in sockets:
                await ws.close()
            await asyncio.gather(*readers)
    finally:
        relay.stop()
        reader.close()
    assert reader.committed == count, (reader.committed, count)
    _, bare_cpu_after = ingest_bench.bare_verification(events)
    bare_cpu = (bare_cpu_before + bare_cpu_after) / 2
    return {
        "copies": copies,
        "events": count,
        "floor_cpu_us_per_unique_event": round(cpu / count * 1e6, 1),
        "bare_verify_cpu_us_per_event": round(bare_cpu * 1e6, 1),
        "cpu_ratio": round(bare_cpu / (cpu / count), 3),
        "load_1min": round(os.getloadavg()[0], 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=30000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--copies", default="1,4")
    args = parser.parse_args()
    uvloop.install()
    figures: dict[str, Any] = {}
    for copies in (int(c) for c in args.copies.split(",")):
        runs = []
        for _ in range(args.repeat):
            with tempfile.TemporaryDirectory() as tmp:
                runs.append(asyncio.run(run_once(Path(tmp), args.events, copies)))
            print(json.dumps(runs[-1]))
        ratios = [r["cpu_ratio"] for r in runs]
        figures[f"copies_{copies}"] = {
            "runs": runs,
            "cpu_ratio_median": statistics.median(ratios),
            "cpu_ratio_spread": [min(ratios), max(ratios)],
        }
        print(f"floor, {copies} cop{'y' if copies == 1 else 'ies'}: cpu_ratio median "
              f"{statistics.median(ratios)} (spread {min(ratios)}-{max(ratios)})")
    figures["measured_at"] = time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime())
    results = json.loads(ingest_bench.RESULTS.read_text()) if ingest_bench.RESULTS.exists() else {}
    results["floor"] = figures
    ingest_bench.RESULTS.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
