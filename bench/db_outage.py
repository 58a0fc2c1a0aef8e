"""The database goes away and comes back: are DMs lost, does the API answer 503 in time?

PostgreSQL: two `sigil-push serve` workers on one database, a steady stream of kind 4 DMs to
registered keys through a real `nostr-relay`; after BEFORE seconds the PostgreSQL server is
stopped (`pg_ctl stop -m fast`) for OUTAGE seconds and started again on the same port.
SQLite: one worker, and another connection holding an exclusive lock on the file for OUTAGE
seconds. Meanwhile `POST /register` and `/health` are probed every second. At the end, every
DM must be pushed exactly once (dry-run log lines of every worker).

    python bench/db_outage.py [--engine postgres|sqlite] [--runs N] [--outage S] [--rate R]
        [--lease S]

Lost and doubled are counted per recipient (one device each; the dry-run line names no
event ids). Prints one line per run and adds the runs to bench/results/db_outage.json, under the date,
the measured commit (`+`: with changes to sigil_push/) and the engine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import re
import sqlite3
import subprocess
import tempfile
import time
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from testkit.bridge_harness import _call, new_token, register
from testkit.nostr_client import npub_of, publish_steadily, user
from testkit.postgres import PostgresServer, find_binaries
from testkit.processes import worker_health
from testkit.relay import RelayProcess
from testkit.service import ServiceProcess
from testkit.stores import on_database

RECIPIENTS = 40
PUSHED = re.compile(r"dry-run wakeup platform=\S+ token=…(\S+) events=(\d+)")
DRAIN_SECONDS = 120.0
ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "db_outage.json"


def commit() -> str:
    """The measured tree's commit (short), with `+` when sigil_push/ has changes."""
    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], check=False, cwd=ROOT, text=True, capture_output=True
        ).stdout.strip()

    return git("rev-parse", "--short", "HEAD") + ("+" if git("status", "--porcelain", "sigil_push") else "")


def partitioned(workers: list[ServiceProcess], shards: int = 256) -> bool:
    held = [worker_health(w).get("shards", []) for w in workers]
    every = sorted(s for h in held for s in h)
    return every == list(range(shards))


def watched(workers: list[ServiceProcess], relay: str) -> int:
    total = 0
    for worker in workers:
        state = worker_health(worker).get("relays", {}).get(relay) or {}
        if not state.get("live"):
            return -1
        total += int(state.get("keys") or 0)
    return total


async def wait_for(condition: Any, what: str, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while not await asyncio.to_thread(condition):
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        await asyncio.sleep(0.5)


def probe_register(worker: ServiceProcess) -> tuple[int, float]:
    keys = user()
    body = {"npub": npub_of(keys), "platform": "android", "device_token": new_token()}
    started = time.monotonic()
    try:
        status = _call(worker, keys, "POST", "/register", body).status_code
    except httpx.HTTPError:
        status = 0  # no answer within the client's 10 s
    return status, time.monotonic() - started


def probe_health(worker: ServiceProcess) -> int:
    try:
        return httpx.get(worker.url + "/health", timeout=10).status_code
    except httpx.HTTPError:
        return 0


async def probes(workers: list[ServiceProcess], until: float, out: dict[str, list[Any]]) -> None:
    while time.monotonic() < until:
        status, took = await asyncio.to_thread(probe_register, workers[0])
        out["register"].append((status, round(took, 2)))
        out["health"].append([await asyncio.to_thread(probe_health, w) for w in workers])
        out["admin"].append([worker_health(w).get("status") for w in workers])
        await asyncio.sleep(1.0)


async def one_run(engine: str, folder: Path, args: argparse.Namespace) -> dict[str, Any]:
    relay = RelayProcess(folder / "relay").start()
    server: PostgresServer | None = None
    workers: list[ServiceProcess] = []
    toml = (
        "[bridge]\nreconnect_min_seconds = 0.2\nreconnect_max_seconds = 1.0\n"
        f"lease_seconds = {args.lease}\n"
    )
    try:
        if engine == "postgres":
            binaries = find_binaries()
            assert binaries is not None, "PostgreSQL binaries not found"
            server = PostgresServer(binaries).start()
            url = server.create_database()
            for index in range(2):
                service = ServiceProcess(folder / f"worker{index}", [relay.url], toml)
                workers.append(on_database(service, url, key_file=folder / "bridge.key").start())
            await wait_for(lambda: partitioned(workers), "the workers split the shards")
        else:
            workers.append(ServiceProcess(folder / "worker0", [relay.url], toml).start())
        recipients = [user() for _ in range(RECIPIENTS)]
        tokens = [new_token() for _ in recipients]
        for recipient, token in zip(recipients, tokens, strict=True):
            await asyncio.to_thread(register, workers[0], recipient, token)
        await wait_for(lambda: watched(workers, relay.url) == RECIPIENTS, "every key watched")

        sent: list[str] = []
        stop = asyncio.Event()
        publishing = asyncio.create_task(
            publish_steadily(relay.url, recipients, args.rate, stop, sent)
        )
        await asyncio.sleep(args.before)
        lock: sqlite3.Connection | None = None
        if server is not None:
            server.halt("fast")
        else:
            lock = sqlite3.connect(workers[0].database, isolation_level=None, timeout=60)
            lock.execute("BEGIN EXCLUSIVE")
        down_at = time.monotonic()
        seen: dict[str, list[Any]] = {"register": [], "health": [], "admin": []}
        await probes(workers, down_at + args.outage, seen)
        if server is not None:
            server.resume()
        else:
            assert lock is not None
            lock.execute("ROLLBACK")
            lock.close()
        back_at = time.monotonic()
        recovered = None
        if server is not None:
            try:
                await wait_for(lambda: partitioned(workers), "shards re-taken", 60)
                recovered = round(time.monotonic() - back_at, 1)
            except TimeoutError:
                pass
        await asyncio.sleep(max(0.0, back_at + args.after - time.monotonic()))
        stop.set()
        await publishing
        # the dry-run line names no event ids: DMs are counted per recipient's one device
        expected = Counter(tokens[i % len(tokens)][-6:] for i in range(len(sent)))
        deadline = time.monotonic() + DRAIN_SECONDS
        while time.monotonic() < deadline:
            pushes: Counter[str] = Counter()
            for worker in workers:
                for suffix, events in PUSHED.findall(worker.log()):
                    pushes[suffix] += int(events)
            if all(pushes[t] >= n for t, n in expected.items()):
                break
            await asyncio.sleep(2.0)
        lost = sum(max(0, n - pushes[t]) for t, n in expected.items())
        doubled = sum(max(0, pushes[t] - n) for t, n in expected.items())
        registers = seen["register"]
        return {
            "engine": engine,
            "dms": len(sent),
            "lost": lost,
            "doubled": doubled,
            "shards_back_after_s": recovered,
            "register_statuses": dict(Counter(str(s) for s, _ in registers)),
            "register_slowest_s": max((t for _, t in registers), default=None),
            "health_200_during_outage": sum(1 for h in seen["health"] if 200 in h),
            "health_probes": len(seen["health"]),
            "admin_status": dict(Counter(str(s) for row in seen["admin"] for s in row)),
        }
    finally:
        for worker in workers:
            worker.stop()
        relay.stop()
        if server is not None:
            server.stop()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=["postgres", "sqlite"], default="postgres")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--rate", type=float, default=20.0)
    parser.add_argument("--before", type=float, default=10.0)
    parser.add_argument("--outage", type=float, default=30.0)
    parser.add_argument("--after", type=float, default=20.0)
    parser.add_argument("--lease", type=float, default=15.0)
    parser.add_argument("--keep", type=Path, help="run in this folder and keep the logs")
    args = parser.parse_args()
    results = []
    for run in range(args.runs):
        if args.keep is not None:
            result = await one_run(args.engine, args.keep / f"run{run}", args)
        else:
            with tempfile.TemporaryDirectory(prefix="db-outage-") as folder:
                result = await one_run(args.engine, Path(folder), args)
        print(json.dumps(result), flush=True)
        results.append(result)
    summary = {
        "settings": {k: v for k, v in vars(args).items() if k != "keep"},
        "machine": {"platform": platform.platform(),
                    "note": "2 cores shared with other work unless said otherwise"},
        "dms": sum(r["dms"] for r in results),
        "lost": sum(r["lost"] for r in results),
        "doubled": sum(r["doubled"] for r in results),
        "runs": results,
    }
    print(f"{summary['lost']} of {summary['dms']} DMs lost, {summary['doubled']} doubled")
    recorded = json.loads(RESULTS.read_text()) if RESULTS.exists() else {"runs": {}}
    recorded["runs"][f"{datetime.now(UTC):%Y-%m-%d} {commit()} {args.engine}"] = summary
    RESULTS.write_text(json.dumps(recorded, indent=2) + "\n")


if __name__ == "__main__":
    asyncio.run(main())
