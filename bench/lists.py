"""Benchmark: what one registration costs in the users' lists (issue 34, item 2).

A relay holds the kind 3 contact list of every user, 200 KB each (2,800 follows), and one
`sigil-push serve` process (dry-run, SQLite) watches it. 1,000 users register (every pair
follows-only, so the instance does read their kind 3), and once their lists are stored, 100
more register one at a time. For each of those 100 the relay counts the bytes it sent and the
service's CPU time is read from /proc, from the registration until the relay is live again
with the new key and its list is stored. The cost of a registration must not grow with the
number already registered: the last 25 cost within 20% of the first 25 (medians: one
registration's CPU window also holds the service's background loops, which the shared machine
makes swing by half either way).

The relay is an in-memory NIP-01 relay in this process (kinds, authors, #p, since, until,
ids; no cap on answers, stored events only), so the bytes are exactly what the instance
asked for: a REQ re-sent for a whole shard without `since` brings back every list of its
500 keys (one more registration after 60 cost a relay 13.5 MB before this fix).

Usage: python bench/lists.py [--keys 1000] [--more 100] [--follows 2800]
Adds its run to bench/results/lists.json under "runs", keyed by the date and the commit
measured.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import httpx
from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed

from sigil_push.nostr.event import sign_event
from sigil_push.nostr.keys import SecretKey
from testkit.bridge_harness import relay_live
from testkit.loopback_relay import LoopbackRelay
from testkit.nip98 import SdkUser
from testkit.service import ServiceProcess
from testkit.stores import fetch

RESULTS = ROOT / "bench" / "results" / "lists.json"
REGISTER_CONCURRENCY = 8
FLAT_WITHIN = 0.20


def _matches(event: dict[str, Any], query: dict[str, Any]) -> bool:
    if "ids" in query and event["id"] not in query["ids"]:
        return False
    if "kinds" in query and event["kind"] not in query["kinds"]:
        return False
    if "authors" in query and event["pubkey"] not in query["authors"]:
        return False
    if "#p" in query and not any(t[0] == "p" and t[1] in query["#p"] for t in event["tags"]):
        return False
    if "since" in query and event["created_at"] < query["since"]:
        return False
    return not ("until" in query and event["created_at"] > query["until"])


class ListsRelay(LoopbackRelay):
    """Stored events by author, answered to each REQ, then EOSE; counts the bytes it sends."""

    def __init__(self) -> None:
        self.by_author: dict[str, list[tuple[dict[str, Any], str]]] = {}
        self.sent_bytes = 0
        self.reqs = 0

    def add(self, event: dict[str, Any]) -> None:
        self.by_author.setdefault(event["pubkey"], []).append((event, json.dumps(event)))

    async def _handle(self, ws: ServerConnection) -> None:
        try:
            async for text in ws:
                message = json.loads(text)
                if message[0] == "REQ":
                    self.reqs += 1
                    await self._answer(ws, message[1], message[2:])
        except ConnectionClosed:
            return

    async def _answer(self, ws: ServerConnection, sub_id: str, queries: list[dict[str, Any]]) -> None:
        head = json.dumps(sub_id)
        for query in queries:
            authors = query.get("authors")
            stored = (
                [item for a in authors for item in self.by_author.get(a, ())] if authors is not None
                else [item for items in self.by_author.values() for item in items]
            )
            for event, raw in stored:
                if _matches(event, query):
                    frame = f'["EVENT",{head},{raw}]'
                    self.sent_bytes += len(frame)
                    await ws.send(frame)
        frame = json.dumps(["EOSE", sub_id])
        self.sent_bytes += len(frame)
        await ws.send(frame)


def contact_list(user: SdkUser, follows: list[str], created_at: int) -> dict[str, Any]:
    """The user's kind 3, signed by the libsecp256k1 binding (nostr-sdk's per-tag calls took
    seconds per list on a loaded machine; the instance verifies it like any other)."""
    key = SecretKey(str(user.keys.secret_key().to_hex()))
    return sign_event(key, 3, "", [["p", follow] for follow in follows], created_at).to_json()


def commit() -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], check=False, cwd=ROOT,
                          text=True, capture_output=True)
    return done.stdout.strip()


def cpu_seconds(service: ServiceProcess) -> float:
    """The service's CPU time so far, every thread's (aiosqlite runs SQLite in one of its own),
    in nanoseconds from /proc/<pid>/task/*/schedstat: /proc's `stat` counts 10 ms ticks, as
    coarse as one registration's whole cost."""
    assert service._process is not None
    total = 0
    for task in Path(f"/proc/{service._process.pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            continue  # a thread that ended meanwhile
    return total / 1e9


async def register(http: httpx.AsyncClient, service: ServiceProcess, user: SdkUser) -> None:
    body = json.dumps({"npub": user.npub, "platform": "ios", "device_token": secrets.token_hex(32),
                       "senders": "follows"}).encode()
    header = user.header(service.url + "/register", "POST", body)
    response = await http.post("/register", content=body, headers={
        "content-type": "application/json", "authorization": header})
    assert response.status_code == 201, response.text


def contacts_stored(service: ServiceProcess) -> int:
    [(count,)] = fetch(service.database, "SELECT COUNT(*) FROM user_lists WHERE kind = 3")
    return int(count)


async def wait_for(condition: Any, what: str, timeout: float, poll: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        await asyncio.sleep(poll)
    raise TimeoutError(f"{what} not reached within {timeout} s")


async def run(keys: int, more: int, follows_count: int) -> dict[str, Any]:
    folder = Path(tempfile.mkdtemp(prefix="sigil-lists-bench-"))
    users = [SdkUser() for _ in range(keys + more)]
    follows = [secrets.token_hex(32) for _ in range(follows_count)]
    created_at = int(time.time()) - 3600
    print(f"signing {len(users)} kind 3 lists of {follows_count} follows", flush=True)
    async with ListsRelay() as relay:
        for user in users:
            relay.add(contact_list(user, follows, created_at))
        list_bytes = len(relay.by_author[users[0].hex][0][1])
        service = ServiceProcess(folder / "service", [relay.url], insecure_relays=True)
        try:
            service.start()
            async with httpx.AsyncClient(base_url=service.url, timeout=60) as http:
                print(f"registering {keys} follows-only users", flush=True)
                semaphore = asyncio.Semaphore(REGISTER_CONCURRENCY)

                async def bounded(user: SdkUser) -> None:
                    async with semaphore:
                        await register(http, service, user)

                started = time.monotonic()
                await asyncio.gather(*(bounded(user) for user in users[:keys]))
                await wait_for(lambda: relay_live(service, relay.url, keys)
                               and contacts_stored(service) == keys, "the first lists stored", 900)
                setup = {"seconds": round(time.monotonic() - started, 1),
                         "relay_bytes": relay.sent_bytes, "reqs": relay.reqs}
                print(f"{keys} registered and their lists stored in {setup['seconds']} s;"
                      f" the relay sent {relay.sent_bytes / 1e6:.1f} MB", flush=True)
                per_registration: list[dict[str, float]] = []
                for index, user in enumerate(users[keys:], start=1):
                    bytes_before, cpu_before, reqs_before = relay.sent_bytes, cpu_seconds(service), relay.reqs
                    await register(http, service, user)
                    await wait_for(lambda n=keys + index: relay_live(service, relay.url, n)
                                   and contacts_stored(service) == n, "the new list stored", 300)
                    per_registration.append({
                        "bytes": relay.sent_bytes - bytes_before,
                        "cpu_seconds": round(cpu_seconds(service) - cpu_before, 5),
                        "reqs": relay.reqs - reqs_before,
                    })
                    if index in (1, 10, 50, more):
                        last = per_registration[-1]
                        print(f"registration {index}: {last['bytes'] / 1e3:.0f} kB,"
                              f" {last['cpu_seconds'] * 1000:.0f} ms CPU, {last['reqs']} REQs",
                              flush=True)
        finally:
            service.stop()
    # the first and the last quarter, by median: a registration's CPU window also takes in
    # the service's background loops (heartbeats, housekeeping) for as long as the relay takes
    # to answer, which on the shared machine swings one sample by half either way
    window = max(1, min(25, more // 4))
    first, last = per_registration[:window], per_registration[-window:]

    def median(rows: list[dict[str, float]], key: str) -> float:
        return statistics.median(row[key] for row in rows)

    def mean(rows: list[dict[str, float]], key: str) -> float:
        return statistics.fmean(row[key] for row in rows)

    bytes_ratio = median(last, "bytes") / max(1.0, median(first, "bytes"))
    cpu_ratio = median(last, "cpu_seconds") / max(1e-3, median(first, "cpu_seconds"))
    return {
        "benchmark": "lists",
        "when": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "commit": commit(),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "setup": "in-memory NIP-01 relay (this process, answers uncapped) holding one kind 3 of"
        " every user; one sigil-push serve process, dry-run, SQLite; every pair follows-only",
        "registered_first": keys,
        "registered_then": more,
        "kind_3_bytes": list_bytes,
        "setup_registrations": setup,
        "per_registration": per_registration,
        f"first_{window}": {
            "bytes_median": round(median(first, "bytes")),
            "cpu_seconds_median": round(median(first, "cpu_seconds"), 5),
            "cpu_seconds_mean": round(mean(first, "cpu_seconds"), 5),
        },
        f"last_{window}": {
            "bytes_median": round(median(last, "bytes")),
            "cpu_seconds_median": round(median(last, "cpu_seconds"), 5),
            "cpu_seconds_mean": round(mean(last, "cpu_seconds"), 5),
        },
        "bytes_last_over_first": round(bytes_ratio, 3),
        "cpu_last_over_first": round(cpu_ratio, 3),
        "flat_within_20_percent": abs(bytes_ratio - 1) <= FLAT_WITHIN
        and abs(cpu_ratio - 1) <= FLAT_WITHIN,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=1000)
    parser.add_argument("--more", type=int, default=100)
    parser.add_argument("--follows", type=int, default=2800)
    args = parser.parse_args()
    result = asyncio.run(run(args.keys, args.more, args.follows))
    recorded = json.loads(RESULTS.read_text()) if RESULTS.exists() else {"runs": {}}
    recorded["runs"][f"{datetime.now(UTC):%Y-%m-%d} {result['commit']}"] = result
    RESULTS.write_text(json.dumps(recorded, indent=2) + "\n")
    window = next(k for k in result if k.startswith("first_") and k[6:].isdigit())
    last = next(k for k in result if k.startswith("last_") and k[5:].isdigit())
    print(f"per registration, {window}: {result[window]}; {last}: {result[last]}")
    print(f"bytes last/first {result['bytes_last_over_first']}, CPU last/first"
          f" {result['cpu_last_over_first']}: flat within 20%: {result['flat_within_20_percent']}")
    print(f"wrote {RESULTS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
