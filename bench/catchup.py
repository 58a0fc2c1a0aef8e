"""Benchmark of catch-up after an outage (issue 24): negentropy (NIP-77) against paged REQ.

Two real relays, each in a process of its own: rust-nostr's relay (`nostr-sdk`'s LocalRelay,
NIP-77, 500 events per filter, no NIP-11) and `nostr-relay` (no NIP-77). For each:

1. `--keys` recipients hold `--dms` DMs in the window (half kind 4 over the last day, half kind
   1059 back-dated up to two days, as NIP-59 does), published before the bridge starts;
2. the bridge (in this process, SQLite, every key registered) starts: its first subscription
   pages through the whole window (the baseline: remembered, not pushed);
   With more than 2,000 keys (`bridge.firehose_above_keys`) the relay is read as a firehose
   (one REQ, no `#p`, the whole window reconciled); the registrations are then dated back
   before the window, as for users registered days ago (a firehose catch-up wakes a device only
   for DMs not older than its registration);
3. outage: the bridge stops, 1 % new DMs arrive (back-dated like gift wraps), it starts again
   and catches up with negentropy (bridge.negentropy = true); then the same again
   (`negentropy_again`: a restart after a process that caught up with negentropy, so its
   stored snapshot of the window's items is there, as on any later restart); then another
   1 % with bridge.negentropy = false: a full paged REQ replay of the window. On nostr-relay
   the first restart tries NIP-77 and falls back (no answer within 4 s).

Measured for each catch-up, from the restart until every new DM is in the outbox and every
REQ and page is past EOSE: bytes and websocket frames from the relay (a counting TCP proxy in
a thread of its own sits between bridge and relay, so both the shared connection and the
reconciliation socket are counted), wall time, CPU seconds of this process (the bridge and its
SQLite thread; the proxy thread's own CPU taken out) and of the relay
process, DMs pushed (outbox rows: each new DM exactly once, nothing from before).

The machine has 2 cores shared with other engineers' work: figures are floors, the load is
reported. Writes bench/results/catchup.json.

Usage: python bench/catchup.py [--keys 10000] [--dms 200000] [--relays rust,nostr-relay]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import logging
import os
import platform
import random
import secrets
import sqlite3
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prometheus_client import REGISTRY
from websockets.asyncio.client import connect

from sigil_push import outbound
from sigil_push.nostr.event import sign_event
from sigil_push.nostr.keys import SecretKey
from sigil_push.store.factory import open_sqlite
from testkit.in_process import in_process_bridge
from testkit.relay import RelayProcess, free_port
from testkit.rust_relay import RustRelayProcess

RESULTS = Path(__file__).parent / "results" / "catchup.json"
TWO_DAYS = 2 * 24 * 3600


class CountingProxy:
    """A TCP proxy on its own thread and loop: counts the bytes and websocket frames the relay
    sends (server frames are unmasked: a 2-byte header, then 2 or 8 length bytes)."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.port = free_port()
        self.bytes = 0
        self.frames = 0
        self.cpu = 0.0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._ready = threading.Event()
        self._writers: set[asyncio.StreamWriter] = set()
        self._refusing = False

    def cut(self, refuse: bool) -> None:
        """Drop every connection through the proxy and refuse new ones while `refuse`
        (an outage the bridge process lives through: it reconnects after)."""

        def apply() -> None:
            self._refusing = refuse
            if refuse:
                for writer in list(self._writers):
                    writer.close()

        self._loop.call_soon_threadsafe(apply)

    def start(self) -> None:
        self._thread.start()
        self._ready.wait()

    def reset(self) -> tuple[int, int, float]:
        before = (self.bytes, self.frames, self.cpu)
        return before

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._serve())

    async def _serve(self) -> None:
        server = await asyncio.start_server(self._client, "127.0.0.1", self.port)
        self._ready.set()
        async with server:
            while True:
                await asyncio.sleep(0.2)
                self.cpu = time.thread_time()

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._refusing:
            writer.close()
            return
        self._writers.add(writer)
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)

        async def upstream() -> None:
            try:
                while data := await reader.read(65536):
                    up_writer.write(data)
                    await up_writer.drain()
            finally:
                up_writer.close()

        task = asyncio.create_task(upstream())
        buffer = bytearray()
        headers_done = False
        try:
            while data := await up_reader.read(65536):
                self.bytes += len(data)
                writer.write(data)
                buffer += data
                if not headers_done:
                    end = buffer.find(b"\r\n\r\n")
                    if end < 0:
                        continue
                    del buffer[: end + 4]
                    headers_done = True
                while len(buffer) >= 2:
                    length, offset = buffer[1] & 0x7F, 2
                    if length == 126:
                        if len(buffer) < 4:
                            break
                        length, offset = int.from_bytes(buffer[2:4], "big"), 4
                    elif length == 127:
                        if len(buffer) < 10:
                            break
                        length, offset = int.from_bytes(buffer[2:10], "big"), 10
                    if len(buffer) < offset + length:
                        break
                    if (buffer[0] & 0x0F) in (0x1, 0x2):
                        self.frames += 1
                    del buffer[: offset + length]
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            task.cancel()
            writer.close()
            self._writers.discard(writer)


def dataset(recipients: list[str], count: int, now: int, seed: int) -> list[dict[str, Any]]:
    """Signed DMs: half kind 4 over the last day, half kind 1059 back-dated up to two days
    (their content is opaque to the bridge, so it is random text of a wrap's size)."""
    rng = random.Random(seed)
    senders = [SecretKey.generate() for _ in range(50)]
    events = []
    for n in range(count):
        recipient = recipients[rng.randrange(len(recipients))]
        if n % 2:
            kind, when, size = 1059, now - rng.randrange(60, TWO_DAYS), 1200
            sender = SecretKey.generate() if n % 64 == 1 else senders[n % 50]
        else:
            kind, when, size = 4, now - rng.randrange(60, 24 * 3600), 300
            sender = senders[n % 50]
        content = secrets.token_urlsafe(size * 3 // 4)
        events.append(sign_event(sender, kind, content, [["p", recipient]], when).to_json())
    return events


async def publish(
    url: str, events: list[dict[str, Any]], per_connection: int = 5000, parallel: int = 4
) -> None:
    """Store `events`, `per_connection` on each connection (rust-nostr's relay drops a
    connection that publishes far more), `parallel` connections at a time."""
    batches = [events[start : start + per_connection]
               for start in range(0, len(events), per_connection)]
    for first in range(0, len(batches), parallel):
        await asyncio.gather(*(_publish_some(url, batch)
                               for batch in batches[first : first + parallel]))


async def _publish_some(url: str, events: list[dict[str, Any]], window: int = 500) -> None:
    """Stream EVENTs with up to `window` unanswered, until every one is acknowledged."""
    async with connect(url, proxy=None, max_size=None) as ws:
        pending = 0
        for event in events:
            await ws.send(json.dumps(["EVENT", event]))
            pending += 1
            while pending >= window:
                if json.loads(await ws.recv())[0] == "OK":
                    pending -= 1
        while pending:
            if json.loads(await ws.recv())[0] == "OK":
                pending -= 1


def process_cpu(pid: int | None) -> float:
    if pid is None:
        return 0.0
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def snapshot_loads() -> dict[str, float]:
    """sigil_push_catchup_snapshot_loads_total by outcome (none before snapshots existed)."""
    return {sample.labels["outcome"]: sample.value
            for family in REGISTRY.collect() if family.name == "sigil_push_catchup_snapshot_loads"
            for sample in family.samples if sample.name.endswith("_total")}


async def outbox_counts(db: Any) -> dict[str, int]:
    rows = await db.execute_fetchall("SELECT event_id, COUNT(*) FROM outbox GROUP BY event_id")
    return {str(event_id): int(count) for event_id, count in rows}


async def run_bridge(
    folder: Path, url: str, negentropy: bool, new_ids: set[str], keys: int,
    proxy: CountingProxy, relay_pid: int | None, history: set[str], before: dict[str, int],
    reconnect: tuple[str, list[dict[str, Any]]] | None = None,
    profile: Path | None = None, seen_cache: int | None = None,
) -> dict[str, Any]:
    """Start the bridge; until every `new_ids` is queued and the relay is live; the figures.
    With `reconnect` (the relay's own url, DMs): then cut the bridge's sockets, publish those
    DMs meanwhile, let it reconnect, and measure that catch-up too (`reconnect` in the
    figures): the same process, so what it kept from the first catch-up is still there.
    `profile`: cProfile of the restart's catch-up there, of the reconnect's beside it."""
    loads_before = snapshot_loads()
    profiler = cProfile.Profile() if profile is not None else None
    if profiler is not None:
        profiler.enable()
    bytes0, frames0, proxy_cpu0 = proxy.bytes, proxy.frames, proxy.cpu
    relay_cpu0 = process_cpu(relay_pid)
    cpu0, wall0 = time.process_time(), time.monotonic()
    bridge_table: dict[str, Any] = {"negentropy": negentropy, "reconnect_min_seconds": 0.2}
    if seen_cache is not None:
        bridge_table["seen_cache_size"] = seen_cache
    async with in_process_bridge(folder, "bench.db", [{"url": url}], bridge_table) as parts:
        while True:
            health = parts.bridge.health().get(url, {})
            queued = await outbox_counts(parts.db)
            if new_ids <= set(queued) and health.get("live") and health.get("keys") == keys:
                break
            if time.monotonic() - wall0 > 3600:
                raise TimeoutError("catch-up did not finish within an hour")
            await asyncio.sleep(0.05)
        wall = time.monotonic() - wall0
        cpu = time.process_time() - cpu0 - (proxy.cpu - proxy_cpu0)
        # taken here, so the reconnect below (its bytes, and the relay storing its DMs) is
        # not counted twice
        moved = (proxy.bytes - bytes0, proxy.frames - frames0)
        relay_cpu = process_cpu(relay_pid) - relay_cpu0
        if profiler is not None and profile is not None:
            profiler.disable()
            profiler.dump_stats(profile)
            profiler = cProfile.Profile()
        loads = {outcome: count - loads_before.get(outcome, 0)
                 for outcome, count in snapshot_loads().items()}
        queued = await outbox_counts(parts.db)
        pool = parts.bridge._pool
        method = "negentropy" if pool.negentropy_support.get(url) else "req"
        again: dict[str, Any] | None = None
        if reconnect is not None:
            relay_url, fresh = reconnect
            proxy.cut(True)
            while parts.bridge.health().get(url, {}).get("connected"):
                await asyncio.sleep(0.05)
            await publish(relay_url, fresh)
            fresh_ids = {event["id"] for event in fresh}
            bytes1, frames1, proxy_cpu1 = proxy.bytes, proxy.frames, proxy.cpu
            cpu1, wall1 = time.process_time(), time.monotonic()
            if profiler is not None:
                profiler.enable()
            proxy.cut(False)
            while True:
                health = parts.bridge.health().get(url, {})
                queued = await outbox_counts(parts.db)
                if fresh_ids <= set(queued) and health.get("live"):
                    break
                await asyncio.sleep(0.05)
            if profiler is not None and profile is not None:
                profiler.disable()
                profiler.dump_stats(profile.with_suffix(".reconnect.prof"))
            again = {
                "bytes_from_relay": proxy.bytes - bytes1,
                "frames_from_relay": proxy.frames - frames1,
                "wall_seconds": round(time.monotonic() - wall1, 2),
                "cpu_seconds": round(time.process_time() - cpu1 - (proxy.cpu - proxy_cpu1), 2),
                "new_dms": len(fresh_ids),
                "new_pushed_exactly_once": sum(1 for i in fresh_ids if queued.get(i) == 1),
            }
    new_pushed = [queued.get(event_id, 0) for event_id in new_ids]
    return {
        "method": method,
        "bytes_from_relay": moved[0],
        "frames_from_relay": moved[1],
        "wall_seconds": round(wall, 2),
        "cpu_seconds": round(cpu, 2),
        "relay_cpu_seconds": round(relay_cpu, 2),
        "new_dms": len(new_ids),
        "new_pushed_exactly_once": sum(1 for count in new_pushed if count == 1),
        "new_pushed_twice_or_more": sum(1 for count in new_pushed if count > 1),
        "history_pushed": sum(
            1 for event_id in history if queued.get(event_id, 0) > before.get(event_id, 0)
        ),
        "snapshot_loads": {outcome: count for outcome, count in loads.items() if count},
        "queued": queued,
        **({"reconnect": again} if again is not None else {}),
    }


async def bench_relay(
    kind: str, keys: int, dms: int, folder: Path, new: int | None = None,
    replay: bool = True, profile: Path | None = None, lmdb: bool = False,
    seen_cache: int | None = None,
) -> dict[str, Any]:
    """One relay's figures; `new` DMs per outage (default 1 % of `dms`); `replay` false skips
    the paged REQ replay; `profile` writes a cProfile of the negentropy catch-up there."""
    folder.mkdir(parents=True, exist_ok=True)
    relay: RustRelayProcess | RelayProcess
    relay = (RustRelayProcess(folder / "relay", lmdb=lmdb) if kind == "rust"
             else RelayProcess(folder / "relay"))
    relay.start()
    relay_pid = relay.pid if isinstance(relay, RustRelayProcess) else relay._process.pid  # type: ignore[union-attr]
    proxy = CountingProxy(relay.port)
    proxy.start()
    url = f"ws://127.0.0.1:{proxy.port}"
    try:
        recipients = [SecretKey.generate().public_key_hex for _ in range(keys)]
        now = int(time.time())
        started = time.monotonic()
        history = dataset(recipients, dms, now, seed=1)
        generated = time.monotonic() - started
        started = time.monotonic()
        await publish(relay.url, history)
        published = time.monotonic() - started
        print(f"published {dms} in {published:.0f} s", flush=True)
        store = await open_sqlite(folder / "bench.db")
        for n, pubkey in enumerate(recipients):
            await store.devices.register(pubkey, "android", f"fcm-{n}", "opaque", (), None, 0)
        await store.close()
        history_ids = {event["id"] for event in history}
        report: dict[str, Any] = {
            "relay": kind, "keys": keys, "dms_in_window": dms,
            **({"relay_store": "lmdb"} if lmdb and kind == "rust" else {}),
            "generate_seconds": round(generated, 1), "publish_seconds": round(published, 1),
            **({"seen_cache_size": seen_cache} if seen_cache is not None else {}),
        }
        report["baseline"] = await run_bridge(
            folder, url, True, set(), keys, proxy, relay_pid, history_ids, {},
            seen_cache=seen_cache,
        )
        queued = report["baseline"].pop("queued")
        # with more than bridge.firehose_above_keys keys the relay is read as a firehose,
        # where a catch-up wakes a device only for DMs not older than its registration (no
        # per-key baseline there): date the registrations back before the window, as for
        # users registered days ago, so the outage's back-dated DMs count as new
        with sqlite3.connect(folder / "bench.db") as database:
            database.execute("UPDATE devices SET registered_at = registered_at - ?", (5 * 86400,))
        report["new_dms_per_outage"] = new or max(1, dms // 100)
        outages = [("negentropy_first", True, 2), ("negentropy_again", True, 4),
                   ("paged_req", False, 3)][: 3 if replay else 2]
        for name, negentropy, seed in outages:
            fresh = dataset(recipients, report["new_dms_per_outage"], int(time.time()), seed=seed)
            await publish(relay.url, fresh)
            later = None
            if negentropy:
                later = (relay.url, dataset(
                    recipients, report["new_dms_per_outage"], int(time.time()), seed=seed + 10
                ))
            report[name] = await run_bridge(
                folder, url, negentropy, {e["id"] for e in fresh}, keys, proxy, relay_pid,
                history_ids, queued, later, profile if negentropy else None, seen_cache,
            )
            if later is not None:
                history_ids |= {e["id"] for e in later[1]}
            queued = report[name].pop("queued")
            history_ids |= {e["id"] for e in fresh}
        neg, req = report["negentropy_first"], report.get("paged_req")
        if neg["method"] == "negentropy" and req is not None:
            report["negentropy_bytes_over_paged_replay"] = round(
                neg["bytes_from_relay"] / max(1, req["bytes_from_relay"]), 4
            )
        return report
    finally:
        relay.stop()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--keys", type=int, default=10_000)
    parser.add_argument("--dms", type=int, default=200_000)
    parser.add_argument("--relays", default="rust,nostr-relay")
    parser.add_argument("--nostr-relay-dms", type=int, default=None,
                        help="a smaller window for nostr-relay (it stores about 1,000 events/s)")
    parser.add_argument("--new", type=int, default=None,
                        help="new DMs per outage (default 1 %% of the window)")
    parser.add_argument("--no-replay", action="store_true",
                        help="skip the paged REQ replay (negentropy catch-up only)")
    parser.add_argument("--profile", type=Path, default=None,
                        help="write a cProfile of the negentropy catch-up to this file")
    parser.add_argument("--lmdb", action="store_true",
                        help="rust-nostr's relay keeps its events in LMDB (its in-memory store"
                        " keeps about 75,000)")
    parser.add_argument("--seen-cache", type=int, default=None,
                        help="bridge.seen_cache_size (default the config's): a restart warms"
                        " that many seen ids, a cost apart from the catch-up's")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where the JSON goes")
    parser.add_argument("--log", default="WARNING", help="log level of sigil_push")
    arguments = parser.parse_args()
    logging.basicConfig(format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("sigil_push").setLevel(arguments.log)
    outbound.configure(outbound.OutboundGuard(allow_private=True))
    load_before = os.getloadavg()[0]
    runs = []
    with tempfile.TemporaryDirectory() as folder:
        for kind in arguments.relays.split(","):
            dms = arguments.dms
            if kind == "nostr-relay" and arguments.nostr_relay_dms:
                dms = arguments.nostr_relay_dms
            report = await bench_relay(
                kind, arguments.keys, dms, Path(folder) / kind, arguments.new,
                not arguments.no_replay, arguments.profile, arguments.lmdb,
                arguments.seen_cache,
            )
            print(json.dumps(report, indent=2), flush=True)
            runs.append(report)
    result = {
        "benchmark": "catchup",
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cores": os.cpu_count(), "python": platform.python_version(),
                    "load_1min_before": round(load_before, 2),
                    "load_1min_after": round(os.getloadavg()[0], 2)},
        "runs": runs,
    }
    arguments.out.parent.mkdir(parents=True, exist_ok=True)
    arguments.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    asyncio.run(main())
