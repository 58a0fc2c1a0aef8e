"""Benchmark of the relay bridge's ingest path: relay frame → verified event → outbox.

A tiny local relay (a `websockets` server written here, pinned to its own core) streams
pre-signed kind 4 events to the real `Bridge` (in-process, pinned to one core together with its
SQLite thread), which verifies, de-duplicates and writes every wakeup to the outbox.

Phases, each in a fresh process so memory figures are not mixed:
  ingest   — a burst of events as fast as the relay can send: events/s from the first to the last
             `seen` record, against the bare verification rate of the same events in the same run
             (`ratio`, wall clock); and, since the machine is shared, the same comparison in CPU
             time (`cpu_ratio`): bare verification's CPU per event (`Event.verify` on the parsed
             events, measured just before and just after, averaged) over the bridge process's
             CPU per unique event from the first frame sent until the bridge has stopped (every
             thread: the event loop, SQLite's and the observation log's);
  copies   — the same with every event delivered by 4 relays (the tiny relay serves 4 URL paths):
             unique events/s from the first to the last `seen` of any copy, against bare
             verification;
  filtered / firehose — one relay carrying 10x more DMs than are addressed to registered keys:
             `filtered` gets only the addressed tenth (the relay filters by `#p`), `firehose`
             gets all of them and matches locally; CPU seconds of the bridge process per
             delivered wakeup, compared;
  latency  — an open-loop 1,000 events/s stream: p50/p99 from frame received to outbox row;
  keys     — 100,000 registered keys: time from bridge start to every shard past EOSE, peak RSS;
  plain100k / preferences — `ingest` with 100,000 registered keys and every DM to another of
             them, without and with the users' choices (issue 20): 10% of the keys follows-only
             with a stored kind 3, 10% with a stored kind 10000 (half of those with a private
             mute list too). No DM is held back (the senders are followed, never muted), so
             every one pays the author checks and the run ends with the last wakeup. The two
             are compared by the bridge's CPU per event (best of the runs each): the same
             events give the same bare verification cost, so this is the ratio of their
             cpu_ratios without the bare figure's noise (target: within 3%). Asked for
             together, the two run in turns (`run_interleaved`), and the median of the
             ratios of neighbouring runs is kept beside the best-of-runs ratio;
  public   — issue 32's firehose of public kinds (1, 6, 7, 9735; `phase_public`): one relay read
             as a firehose, 1% of the events naming one of the registered keys; events that
             name nobody must cost at most a third of bare id+signature verification (CPU per
             event, same run), and 1,000 against 100,000 keys within 15% in CPU per event
             (`--only public --public-keys 1000,100000`: the two in turns, `--repeat` each;
             written to bench/results/ingest_public-<date>-<commit>.json); the streams are
             dated in arrival order, as a live firehose sends them (`--public-order live`), or
             over the same ten minutes in turns (`sawtooth`, a catch-up dump's order: the
             worst case of the snapshot's parts, `-sawtooth` in the file name);
  sdk      — for the websockets-vs-nostr-sdk decision: nostr-sdk's own pool receiving the same
             burst (it verifies in Rust), events/s.
Loopback only. Prints the figures and writes bench/results/ingest.json (the plain100k and
preferences figures of the issue 20 work are kept in bench/results/ingest_preferences.json).

The machine is shared: every phase runs `--repeat` times (default 3) and the best run is
reported with the spread of the main figure over all runs (for ingest and copies the main figure
is `cpu_ratio`; the wall-clock `ratio` of every run is kept in `wall_runs`), and the 1-minute
load average around each run.

Usage: python bench/ingest.py [--events 30000] [--rate 1000] [--seconds 5] [--keys 100000]
                              [--repeat 3] [--only ingest,copies,...]
       python bench/ingest.py --only public [--events 30000] [--public-keys 1000,100000]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import uvloop
from prometheus_client import REGISTRY

from sigil_push.bridge.catchup_ledger import CatchupLedger
from sigil_push.http.server import tune_gc
from sigil_push.nostr.event import Event, sign_event
from sigil_push.nostr.keys import SecretKey

RESULTS = ROOT / "bench" / "results" / "ingest.json"
BRIDGE_CORE, RELAY_CORE = 0, 1


def pin(core: int) -> None:
    """Pin the calling thread (and the threads it starts later, e.g. aiosqlite's) to one core."""
    if hasattr(os, "sched_setaffinity") and core < (os.cpu_count() or 1):
        os.sched_setaffinity(0, {core})


# the tiny relay ---------------------------------------------------------------------------


async def run_relay(port_file: Path) -> None:
    """Answer every REQ with EOSE; on a control message, stream a file of events to the others.

    Control: ["BENCH", path, rate] (rate 0: as fast as possible), answered ["DONE", lost]
    once sent, `lost` counting the bridge's connections that closed meanwhile (their rest of
    the file unsent: the run is then invalid, and says so rather than waiting forever). Events
    are sent with the subscription id of the latest REQ of each client, which is all the
    bridge needs.
    """
    from websockets.asyncio.server import ServerConnection, serve
    from websockets.exceptions import ConnectionClosed

    clients: dict[ServerConnection, str] = {}

    async def stream(path: str, rate: float) -> int:
        lines = Path(path).read_text().splitlines()
        targets = list(clients.items())
        lost = 0
        start = time.perf_counter()
        for n, line in enumerate(lines):
            if rate:
                delay = start + n / rate - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
            for target in list(targets):
                ws, sub_id = target
                try:
                    await ws.send(f'["EVENT","{sub_id}",{line}]')
                except ConnectionClosed:
                    targets.remove(target)
                    lost += 1
        return lost

    async def handler(ws: ServerConnection) -> None:
        # every URL path is one "relay" for the bridge: /r0 ... /r3 deliver copies
        async for text in ws:
            message = json.loads(text)
            if message[0] == "REQ":
                clients[ws] = message[1]
                await ws.send(json.dumps(["EOSE", message[1]]))
            elif message[0] == "BENCH":
                lost = await stream(message[1], float(message[2]))
                await ws.send(json.dumps(["DONE", lost]))
        clients.pop(ws, None)

    async with serve(handler, "127.0.0.1", 0, max_size=None, compression=None) as server:
        port = next(iter(server.sockets)).getsockname()[1]
        port_file.write_text(str(port))
        await asyncio.Future()


class TinyRelay:
    def __init__(self, folder: Path) -> None:
        self._port_file = folder / "relay.port"
        self._process = subprocess.Popen(
            [sys.executable, __file__, "--phase", "relay", "--port-file", str(self._port_file)]
        )
        deadline = time.monotonic() + 20
        while not self._port_file.exists() or not self._port_file.read_text():
            if time.monotonic() > deadline:
                raise TimeoutError("tiny relay did not start")
            time.sleep(0.05)
        self.url = f"ws://127.0.0.1:{self._port_file.read_text()}"

    def urls(self, copies: int) -> list[str]:
        """`copies` relay URLs served by this one process (one per path)."""
        return [self.url] if copies == 1 else [f"{self.url}/r{i}" for i in range(copies)]

    async def stream(self, events_file: Path, rate: float) -> None:
        from websockets.asyncio.client import connect

        async with connect(self.url, proxy=None, max_size=None) as ws:
            await ws.send(json.dumps(["BENCH", str(events_file), rate]))
            _, lost = json.loads(await ws.recv())
        if lost:
            raise RuntimeError(f"{lost} of the bridge's connections closed during the stream")

    def stop(self) -> None:
        self._process.terminate()
        self._process.wait()


# workload ---------------------------------------------------------------------------------


def make_keys(count: int) -> list[str]:
    """Distinct valid-looking recipient keys (they are only matched, never verified)."""
    return [os.urandom(32).hex() for _ in range(count)]


def make_events(
    recipients: list[str], count: int, senders: int = 200,
    signing: list[SecretKey] | None = None,
) -> list[Event]:
    signing = signing or [SecretKey.generate() for _ in range(senders)]
    senders = len(signing)
    now = int(time.time())
    return [
        sign_event(
            signing[i % senders],
            4,
            os.urandom(48).hex() + "?iv=" + os.urandom(12).hex(),
            [["p", recipients[i % len(recipients)]]],
            now - i % 600,
        )
        for i in range(count)
    ]


def write_events(events: list[Event], path: Path) -> None:
    path.write_text("\n".join(json.dumps(e.to_json(), separators=(",", ":")) for e in events))


async def register_directly(db: Any, pubkeys: list[str]) -> None:
    """Bench setup only: insert devices in bulk instead of 100,000 API calls."""
    now = int(time.time()) - 60
    await db.executemany(
        "INSERT INTO devices (pubkey, platform, token, payload, relays, registered_at, updated_at)"
        " VALUES (?, 'android', ?, 'opaque', '[]', ?, ?)",
        [(p, f"bench-token-{i:08d}", now, now) for i, p in enumerate(pubkeys)],
    )


# the bridge under test --------------------------------------------------------------------


class Harness:
    """The real Bridge with its real store, outbox and observation log; delivery not started."""

    def __init__(self, folder: Path, relay_url: str, copies: int = 1, mode: str = "auto") -> None:
        self.folder = folder
        self.relay_url = relay_url
        self.relay_urls = [relay_url] if copies == 1 else [f"{relay_url}/r{i}" for i in range(copies)]
        self.mode = mode
        self.latencies_ms: list[float] = []
        self.enqueued = 0

    async def start(
        self, pubkeys: list[str], senders: list[str] | None = None, notify_all: bool = False
    ) -> float:
        """`notify_all`: every registration asks for every notification class (issue 32's
        `notify`), where the schema has them (`devices.notify`, migration 0017)."""
        from sigil_push import outbound
        from sigil_push.bridge import Bridge
        from sigil_push.config import parse_config
        from sigil_push.observations import ObservationLog
        from sigil_push.store.sqlite.database import open_database
        from sigil_push.store.sqlite.devices import Devices
        from sigil_push.store.sqlite.outbox import Outbox

        config = parse_config(
            {"relay": [{"url": url, "mode": self.mode} for url in self.relay_urls]},
            self.folder / "relays.toml",
        )
        # as `serve` does at start: configured relays are trusted (the tiny relay is loopback)
        outbound.configure(outbound.OutboundGuard.for_urls(True, self.relay_urls))
        self.db = await open_database(config.resolve(config.server.database))
        await register_directly(self.db, pubkeys)
        self.notify_all = False
        if notify_all:
            columns = await self.db.execute_fetchall("PRAGMA table_info(devices)")
            if any(column[1] == "notify" for column in columns):
                await self.db.execute("UPDATE devices SET notify = 31")  # the five classes
                self.notify_all = True
        self.preferences: dict[str, int] = {}
        if senders is not None:
            # spread over the recipients in their (random) order
            self.preferences = await add_preferences(self.db, pubkeys, senders)
        # the set-up's rows into the database file now: left in the WAL, they were copied by
        # the checkpoints the bridge's commits trigger, inside the measured window (the
        # preferences' 100 MB of lists took 6-18 us of system CPU per event that way)
        await self.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        devices = Devices(self.db)
        self.observations = ObservationLog(self.folder / "observations")
        await self.observations.start()
        self.bridge = await Bridge.create(
            config, devices, Outbox(self.db), self.observations, SecretKey.generate()
        )
        devices.add_listener(self.bridge.registration_changed)
        devices.add_rules_listener(self.bridge.rules_changed)
        self.bridge.add_commit_listener(self._committed)
        started = time.perf_counter()
        await self.bridge.start()
        await self.until(
            lambda: all(self.bridge.health()[url]["live"] for url in self.relay_urls)
        )
        return time.perf_counter() - started

    def received(self) -> float:
        """EVENT frames the bridge has read, over all its relays."""
        from prometheus_client import REGISTRY

        return sum(
            REGISTRY.get_sample_value("sigil_push_bridge_events_received_total", {"relay": url})
            or 0.0
            for url in self.relay_urls
        )

    def _committed(self, events: Any) -> None:
        now_ms = time.time() * 1000
        self.latencies_ms.extend(now_ms - received_ms for _, received_ms in events)
        self.enqueued += len(events)

    @staticmethod
    async def until(condition: Any, timeout: float = 120.0, poll: float = 0.005) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                raise TimeoutError("benchmark condition not reached")
            await asyncio.sleep(poll)

    async def stop(self) -> None:
        await self.bridge.stop()
        await self.bridge.close()
        await self.observations.stop()
        await self.db.close()

    def records(self) -> list[dict[str, Any]]:
        """The observation log as written (read back after the bridge stopped: the harness's
        own parse of every record is no part of the bridge's CPU)."""
        records = []
        for path in sorted((self.folder / "observations").glob("*.jsonl")):
            records.extend(json.loads(line) for line in path.read_text().splitlines() if line)
        return records


async def settled(idle_share: float = 0.05, timeout: float = 120.0) -> None:
    """Wait until this process has been nearly idle for a second: what the bridge does after
    it starts (with 100,000 keys: relay-list REQs, the seen cache, the ledger's first flush)
    landed in the first stream's window and doubled its CPU per event."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        before = time.process_time()
        await asyncio.sleep(1.0)
        if time.process_time() - before < idle_share:
            return
    raise TimeoutError("the bridge did not settle")


def main_thread_cpu() -> float:
    """CPU seconds of this process's main thread (the event loop) alone: the rest of
    `time.process_time` is SQLite's and the observation log's threads."""
    fields = Path(f"/proc/self/task/{os.getpid()}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def bare_verification(events: list[Event]) -> tuple[float, float]:
    """Verify the same events with the same code, nothing else: the ceiling of ingest.
    Returns (events per wall second, CPU seconds per event of this process)."""
    fresh = [Event.from_json(e.to_json()) for e in events]
    started, cpu = time.perf_counter(), time.process_time()
    for event in fresh:
        event.verify()
    return (
        len(fresh) / (time.perf_counter() - started),
        (time.process_time() - cpu) / len(fresh),
    )


def bare_verification_rate(events: list[Event]) -> float:
    return bare_verification(events)[0]


def parse_and_verify_rate(events: list[Event]) -> float:
    """The same events from their JSON text: what a reader must do at minimum per frame."""
    texts = [json.dumps(e.to_json(), separators=(",", ":")) for e in events]
    started = time.perf_counter()
    for text in texts:
        Event.from_json(json.loads(text)).verify()
    return len(texts) / (time.perf_counter() - started)


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


FOLLOWS_PER_LIST = 250
"""Keys of each follows-only user's stored kind 3 (the 200 senders among them): 10,000 lists
of 2,000 would be 640 MB of store for a benchmark; the lookup cost grows with log2 of it."""
MUTES_PER_LIST = 50
PRIVATE_MUTES = 20


async def add_preferences(db: Any, pubkeys: list[str], senders: list[str]) -> dict[str, int]:
    """Bench setup only: 10% of `pubkeys` follows-only with a stored kind 3 that follows every
    sender, the next 10% with a stored kind 10000 muting others (half with private mutes)."""
    from sigil_push.store.records import LIST_FLAGS, pack_keys

    tenth = len(pubkeys) // 10
    follows, muting = pubkeys[:tenth], pubkeys[tenth : 2 * tenth]
    now = int(time.time()) - 60
    followed = pack_keys(senders + make_keys(FOLLOWS_PER_LIST - len(senders)))
    await db.executemany(
        "UPDATE devices SET senders = 'follows' WHERE pubkey = ?", [(p,) for p in follows]
    )
    lists = [(p, 3, now, os.urandom(32).hex(), followed, len(followed) // 32) for p in follows]
    lists += [(p, 10000, now, os.urandom(32).hex(), pack_keys(make_keys(MUTES_PER_LIST)),
               MUTES_PER_LIST) for p in muting]
    await db.executemany(
        "INSERT INTO user_lists (pubkey, kind, created_at, event_id, entries, entry_count)"
        " VALUES (?, ?, ?, ?, ?, ?)",
        lists,
    )
    await db.executemany(  # as the store does when it stores a list
        f"UPDATE devices SET list_flags = {LIST_FLAGS.format(pubkey='?1')} WHERE pubkey = ?1",
        [(p,) for p in follows + muting],
    )
    private = muting[: len(muting) // 2]
    await db.executemany(
        "UPDATE devices SET muted = ?, muted_count = ? WHERE pubkey = ?",
        [(pack_keys(make_keys(PRIVATE_MUTES)), PRIVATE_MUTES, p) for p in private],
    )
    return {"follows_only": len(follows), "mute_lists": len(muting), "private_mutes": len(private)}


async def phase_ingest(
    folder: Path, count: int, copies: int = 1, keys: int = 1000, preferences: bool = False
) -> dict[str, Any]:
    """`copies` relays deliver every event; rates are of unique events. With `keys` registered
    keys, each event to the next of them (shuffled, so the users with preferences are spread)."""
    pin(BRIDGE_CORE)
    recipients = make_keys(keys)
    signing = [SecretKey.generate() for _ in range(200)]
    # shuffled: the users with preferences (the first fifth of `recipients`) get their share
    events = make_events(random.Random(1).sample(recipients, len(recipients)), count,
                         signing=signing)
    write_events(events, folder / "events.jsonl")
    # bare verification right before and right after the bridge, in this process on this
    # core: the CPU ratio compares like with like even when the machine's load drifts
    _, bare_cpu_before = bare_verification(events)
    relay = TinyRelay(folder)
    try:
        harness = Harness(folder, relay.url, copies)
        await harness.start(
            recipients, [k.public_key_hex for k in signing] if preferences else None
        )
        load_before = os.getloadavg()[0]
        usage_before = resource.getrusage(resource.RUSAGE_SELF)
        cpu_before = time.process_time()
        await relay.stream(folder / "events.jsonl", 0)
        await harness.until(lambda: harness.enqueued >= count)
        last_commit_ms = time.time() * 1000
        # the last events' copies may still be on the wire; stopping then commits the rest
        await harness.until(lambda: harness.received() >= count * copies)
        await harness.stop()
        cpu = time.process_time() - cpu_before
        usage = resource.getrusage(resource.RUSAGE_SELF)
        load_after = os.getloadavg()[0]
    finally:
        relay.stop()
    records = harness.records()
    seen = sorted(r["ts"] for r in records if r["type"] == "seen")
    assert len(seen) == count * copies, (len(seen), count * copies)
    ingest = count / ((seen[-1] - seen[0]) / 1000) if copies > 1 else (
        (len(seen) - 1) / ((seen[-1] - seen[0]) / 1000)
    )
    end_to_end = count / ((last_commit_ms - seen[0]) / 1000)
    bare, bare_cpu_after = bare_verification(events)
    bare_cpu = (bare_cpu_before + bare_cpu_after) / 2
    parse_verify = parse_and_verify_rate(events)
    return {
        "events": count,
        "copies": copies,
        "registered_keys": keys,
        **harness.preferences,
        "ingest_events_per_s": round(ingest),
        "bare_verify_events_per_s": round(bare),
        "ratio": round(ingest / bare, 3),
        "cpu_ratio": round(bare_cpu / (cpu / count), 3),
        "end_to_end_events_per_s": round(end_to_end),
        "parse_and_verify_events_per_s": round(parse_verify),
        "bridge_cpu_us_per_unique_event": round(cpu / count * 1e6, 1),
        "bridge_user_sys_us_per_unique_event": [
            round((usage.ru_utime - usage_before.ru_utime) / count * 1e6, 1),
            round((usage.ru_stime - usage_before.ru_stime) / count * 1e6, 1),
        ],
        "bare_verify_us_per_event": round(1e6 / bare, 1),
        "bare_verify_cpu_us_per_event": [
            round(bare_cpu_before * 1e6, 1), round(bare_cpu_after * 1e6, 1)
        ],
        "load_1min": [round(load_before, 2), round(load_after, 2)],
    }


async def phase_firehose(folder: Path, count: int, mode: str) -> dict[str, Any]:
    """One relay, `count` DMs of which a tenth are addressed to the 1,000 registered keys.
    `filtered`: the relay sends only that tenth (as a `#p` subscription would get);
    `firehose`: it sends everything and the bridge matches locally. CPU of this process (the
    bridge and its SQLite thread) from the first frame to the last wakeup in the outbox."""
    pin(BRIDGE_CORE)
    recipients = make_keys(1000)
    strangers = make_keys(1000)
    signing = [SecretKey.generate() for _ in range(200)]
    now = int(time.time())
    events = []
    for i in range(count):
        # every tenth is addressed, the last one included, so the last wakeup ends the run
        addressed = i % 10 == 9
        to = recipients[i % 1000] if addressed else strangers[i % 1000]
        events.append(sign_event(
            signing[i % 200], 4, os.urandom(48).hex() + "?iv=" + os.urandom(12).hex(),
            [["p", to]], now - i % 600,
        ))
    addressed = [e for i, e in enumerate(events) if i % 10 == 9]
    write_events(events if mode == "firehose" else addressed, folder / "events.jsonl")
    relay = TinyRelay(folder)
    try:
        harness = Harness(folder, relay.url, 1, mode)
        await harness.start(recipients)
        assert harness.bridge.health()[relay.url]["mode"] == mode
        cpu_before, wall_before = time.process_time(), time.perf_counter()
        await relay.stream(folder / "events.jsonl", 0)
        await harness.until(lambda: harness.enqueued >= len(addressed))
        cpu = time.process_time() - cpu_before
        wall = time.perf_counter() - wall_before
        await harness.stop()
    finally:
        relay.stop()
    return {
        "mode": mode,
        "events_sent": count if mode == "firehose" else len(addressed),
        "wakeups": len(addressed),
        "cpu_s": round(cpu, 3),
        "cpu_us_per_wakeup": round(cpu / len(addressed) * 1e6, 1),
        "wall_s": round(wall, 3),
    }


PUBLIC_KINDS_MIX = ((7, 50), (1, 30), (6, 15), (9735, 5))
"""Kind and share (%) of the public firehose: reactions most, then notes, reposts, zaps."""


def public_event(
    author: SecretKey, kind: int, to: list[str], now: int, zapper: SecretKey | None = None
) -> Event:
    """A kind 1, 6, 7 or 9735 shaped like the real ones, `p`-tagging the keys in `to` (a zap
    receipt names one). A zap receipt carries its zap request (kind 9734, signed by `zapper`)
    in its `description` tag, whose own `p` tag is escaped JSON text inside that string."""
    target = os.urandom(32).hex()
    tags: list[list[str]] = [["e", target, "", "root"]] + [["p", key] for key in to]
    if kind == 1:
        content = " ".join(os.urandom(4).hex() for _ in range(random.randint(4, 40)))
        if not to:
            tags = [["t", "nostr"]] if random.random() < 0.3 else []
    elif kind == 6:
        reposted = {"id": target, "pubkey": os.urandom(32).hex(), "created_at": now - 600,
                    "kind": 1, "tags": [], "content": os.urandom(100).hex(),
                    "sig": os.urandom(64).hex()}
        content = json.dumps(reposted, separators=(",", ":"))
    elif kind == 7:
        content = random.choice(["+", "🤙", "❤️", "🔥"])
    else:
        assert zapper is not None and len(to) == 1
        request = sign_event(zapper, 9734, "", [
            ["relays", "wss://relay.example.org", "wss://nos.example.com"],
            ["amount", "21000"], ["p", to[0]], ["e", target]], now - 2)
        tags = [["p", to[0]], ["e", target], ["P", zapper.public_key_hex],
                ["bolt11", "lnbc210n1p" + os.urandom(150).hex()],
                ["description", json.dumps(request.to_json(), separators=(",", ":"))],
                ["preimage", os.urandom(32).hex()]]
        content = ""
    return sign_event(author, kind, content, tags, now)


def make_public_events(
    registered: list[str], count: int, addressed_every: int, seed: int = 7,
    live_from: int | None = None,
) -> tuple[list[Event], int]:
    """`count` public events (PUBLIC_KINDS_MIX); every `addressed_every`-th names one of
    `registered` (the last event is one), the others only strangers, or nobody (a kind 1 note
    without `p` tags, a third of the notes). Returns the events and how many are addressed."""
    rng = random.Random(seed)
    authors = [SecretKey.generate() for _ in range(200)]
    zappers = [SecretKey.generate() for _ in range(50)]
    kinds = [kind for kind, share in PUBLIC_KINDS_MIX for _ in range(share)]
    now = int(time.time())
    events, addressed = [], 0
    for i in range(count):
        kind = kinds[rng.randrange(len(kinds))]
        hit = (count - 1 - i) % addressed_every == 0
        addressed += hit
        if kind == 9735:
            to = [rng.choice(registered) if hit else os.urandom(32).hex()]
        elif kind == 1 and not hit and rng.random() < 1 / 3:
            to = []
        else:
            to = [os.urandom(32).hex() for _ in range(rng.randint(1, 3))]
            if hit:
                to[rng.randrange(len(to))] = rng.choice(registered)
        # dated as a live firehose sends them (in order, give or take a few seconds, over
        # LIVE_SPAN_SECONDS from `live_from`), or over the last ten minutes in turns
        at = (now - i % 600 if live_from is None
              else live_from + i * LIVE_SPAN_SECONDS // count + rng.randint(-5, 5))
        events.append(public_event(authors[i % len(authors)], kind, to, at,
                                   zappers[i % len(zappers)]))
    return events, addressed


SAVE_EVERY_SECONDS = 0.25
"""How often `phase_public` runs the housekeeping's snapshot save during a stream (the service
runs it every minute; a stream here lasts seconds, a minute of a busy firehose)."""


async def _saving_snapshots(ledger: CatchupLedger) -> None:
    while True:
        await asyncio.sleep(SAVE_EVERY_SECONDS)
        await ledger.save_snapshots()


def _snapshot_writes() -> float:
    return REGISTRY.get_sample_value(
        "sigil_push_catchup_snapshot_writes_total", {"outcome": "written"}
    ) or 0.0


LIVE_SPAN_SECONDS = 300
"""The time one stream of `phase_public --public-order live` covers (its events' created_at)."""


async def phase_public(folder: Path, count: int, keys: int, order: str = "live") -> dict[str, Any]:
    """Issue 32's firehose: one relay read as a firehose sends `count` events of kinds 1, 6, 7
    and 9735, 1% of them naming one of `keys` registered keys. Two streams through the same
    bridge (every registration asking for every class, where the schema has `notify`): first
    only events that name nobody registered (`unmatched_*`: the cost of handling
    an event that wakes no one), then the mixed stream (`mixed_*`: what the 1,000 against
    100,000 keys comparison uses). Each from the first frame sent until every frame is counted
    received and the bridge has written what it took: the catch-up ledger flushed and the
    relay's NIP-77 snapshot saved with the stream's items (and for the mixed stream, its
    wakeups committed), so each stream pays for its own snapshot parts. The relay is in the steady state of a long run: before the streams, a
    warm-up stream of `count` more events (not measured) has the ledger load the relay and
    save a snapshot of them, and during each stream the snapshot is saved as the housekeeping
    saves it (`save_snapshots` every SAVE_EVERY_SECONDS, a part once the items noted since
    pass a sixteenth of it). Against bare id and signature verification of the same events,
    in this process, just before and after (`Event.verify`, CPU per event): the
    `*_cpu_ratio` figures are bare verification's CPU per event over the bridge's."""
    pin(BRIDGE_CORE)
    recipients = make_keys(keys)
    # live: the warm-up, then the unmatched, then the mixed stream, one after the other
    start = int(time.time()) - 3 * LIVE_SPAN_SECONDS
    live = [None] * 3 if order == "sawtooth" else [start + n * LIVE_SPAN_SECONDS for n in range(3)]
    warm_up, _ = make_public_events(recipients, count, count + 1, seed=9, live_from=live[0])
    unmatched, _ = make_public_events(recipients, count, count + 1, seed=8, live_from=live[1])
    mixed, addressed = make_public_events(recipients, count, 100, live_from=live[2])
    registered = set(recipients)
    unmatched = [e for e in unmatched if registered.isdisjoint(e.tag_values("p"))]
    warm_up = [e for e in warm_up if registered.isdisjoint(e.tag_values("p"))]
    write_events(mixed, folder / "mixed.jsonl")
    write_events(unmatched, folder / "unmatched.jsonl")
    write_events(warm_up, folder / "warm_up.jsonl")
    _, bare_before = bare_verification(mixed)
    relay = TinyRelay(folder)
    try:
        harness = Harness(folder, relay.url, 1, "firehose")
        await harness.start(recipients, notify_all=True)
        assert harness.bridge.health()[relay.url]["mode"] == "firehose"
        figures: dict[str, Any] = {}
        received = harness.received()
        ledger = harness.bridge._ledger
        await relay.stream(folder / "warm_up.jsonl", 0)
        received += len(warm_up)
        await harness.until(lambda: harness.received() >= received, poll=0.05)
        await ledger.flush()
        await ledger.save_snapshots()  # loads the relay (held since its first event), saves
        for name, events in (("unmatched", unmatched), ("mixed", mixed)):
            await settled()
            load = os.getloadavg()[0]
            writes_before = _snapshot_writes()
            cpu_before, main_before = time.process_time(), main_thread_cpu()
            saving = asyncio.get_running_loop().create_task(_saving_snapshots(ledger))
            await relay.stream(folder / f"{name}.jsonl", 0)
            target = received + len(events)
            # every 50 ms, not 5: the count moves every 0.5 s (the bulk counts' flush), and
            # a poll (a registry walk) every 5 ms was a sixth of the reader's samples
            await harness.until(lambda target=target: harness.received() >= target, poll=0.05)
            received = target
            saving.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await saving
            if name == "mixed":
                # its wakeups committed: the window ends with the work the stream caused,
                # not with the bridge's stop, whose cost swung more than the comparison's 15%
                await harness.until(lambda: harness.enqueued >= addressed, poll=0.05)
            # what the stream left to write (the catch-up ledger's rows and the snapshot
            # part of the events it took) is written in its window, not the next one's
            await ledger.flush()
            await ledger.save_snapshots(final=True)
            cpu = time.process_time() - cpu_before
            figures[name] = (cpu, main_thread_cpu() - main_before, len(events), load,
                             _snapshot_writes() - writes_before)
        await harness.stop()
    finally:
        relay.stop()
    _, bare_after = bare_verification(mixed)
    bare = (bare_before + bare_after) / 2
    result: dict[str, Any] = {
        "events": count, "registered_keys": keys, "addressed": addressed,
        "kinds_mix_percent": dict(PUBLIC_KINDS_MIX), "order": order,
        "wakeups_enqueued": harness.enqueued,
        "registrations_notify": "every class" if harness.notify_all else "dm only (no notify)",
        "bare_verify_cpu_us_per_event": [round(bare_before * 1e6, 1), round(bare_after * 1e6, 1)],
    }
    result["snapshot_items_after"] = ledger.kept_items()
    for name, (cpu, loop_cpu, events, load, writes) in figures.items():
        result[f"{name}_events"] = events
        result[f"{name}_snapshot_saves"] = writes
        result[f"{name}_cpu_us_per_event"] = round(cpu / events * 1e6, 2)
        result[f"{name}_event_loop_cpu_us_per_event"] = round(loop_cpu / events * 1e6, 2)
        result[f"{name}_cpu_ratio"] = round(bare / (cpu / events), 2)
        result[f"{name}_load_1min"] = round(load, 2)
    return result


async def phase_latency(folder: Path, rate: float, seconds: float) -> dict[str, Any]:
    pin(BRIDGE_CORE)
    recipients = make_keys(1000)
    count = int(rate * seconds)
    write_events(make_events(recipients, count), folder / "events.jsonl")
    relay = TinyRelay(folder)
    try:
        harness = Harness(folder, relay.url)
        await harness.start(recipients)
        await relay.stream(folder / "events.jsonl", rate)
        await harness.until(lambda: harness.enqueued >= count)
        await harness.stop()
    finally:
        relay.stop()
    values = harness.latencies_ms
    return {
        "rate_events_per_s": rate,
        "events": count,
        "p50_ms": round(percentile(values, 0.5), 2),
        "p99_ms": round(percentile(values, 0.99), 2),
        "max_ms": round(max(values), 2),
        "mean_ms": round(statistics.fmean(values), 2),
    }


async def phase_keys(folder: Path, keys: int) -> dict[str, Any]:
    pin(BRIDGE_CORE)
    pubkeys = make_keys(keys)
    relay = TinyRelay(folder)
    try:
        harness = Harness(folder, relay.url)
        start_seconds = await harness.start(pubkeys)
        shards = harness.bridge.health()[relay.url]["subscriptions"]
        await harness.stop()
    finally:
        relay.stop()
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {
        "keys": keys,
        "shards": shards,
        "start_to_live_s": round(start_seconds, 2),
        "peak_rss_mb": round(peak_mb, 1),
    }


async def phase_sdk(folder: Path, count: int) -> dict[str, Any]:
    """nostr-sdk's pool receiving the same kind of burst (verification in its Rust threads)."""
    from datetime import timedelta

    import nostr_sdk

    recipients = make_keys(1000)
    write_events(make_events(recipients, count), folder / "events.jsonl")
    relay = TinyRelay(folder)
    try:
        client = nostr_sdk.Client()
        await client.add_relay(nostr_sdk.RelayUrl.parse(relay.url))
        await client.connect(timedelta(seconds=5))
        notifications = client.notifications()
        filters = (
            nostr_sdk.Filter()
            .kinds([nostr_sdk.Kind(4)])
            .pubkeys([nostr_sdk.PublicKey.parse(p) for p in recipients[:500]])
        )
        await client.subscribe(nostr_sdk.ReqTarget.auto([filters]))
        streaming = asyncio.create_task(relay.stream(folder / "events.jsonl", 0))
        received, first, last = 0, 0.0, 0.0
        while received < count:
            try:
                notification = await asyncio.wait_for(notifications.next(), 10)
            except Exception:  # noqa: BLE001 - a lagging notification channel ends the count
                break
            if notification is not None and notification.is_new_event():
                received += 1
                last = time.perf_counter()
                first = first or last
        await client.shutdown()
        streaming.cancel()
    finally:
        relay.stop()
    return {
        "events": count,
        "received": received,
        "sdk_events_per_s": round((received - 1) / (last - first)),
    }


PHASES = ("ingest", "copies", "filtered", "firehose", "latency", "keys", "sdk", "plain100k",
          "preferences", "public")
MAIN_FIGURE = {
    "ingest": ("cpu_ratio", max),
    # the two are compared with each other: the bridge's own CPU per event, without the bare
    # verification figure, whose CPU time swung by a third between runs on the loaded machine
    "plain100k": ("bridge_cpu_us_per_unique_event", min),
    "preferences": ("bridge_cpu_us_per_unique_event", min),
    "copies": ("cpu_ratio", max),
    "filtered": ("cpu_us_per_wakeup", min),
    "firehose": ("cpu_us_per_wakeup", min),
    "latency": ("p99_ms", min),
    "keys": ("start_to_live_s", min),
    "sdk": ("sdk_events_per_s", max),
}


PHASE_SECONDS = 900
"""A phase's run ends by then (a few minutes at most): a run that hangs is a failed run, with
its output shown, not a benchmark that waits forever."""


def run_phase(name: str, args: argparse.Namespace) -> dict[str, Any]:
    command = [
        sys.executable, __file__, "--phase", name, "--events", str(args.events),
        "--rate", str(args.rate), "--seconds", str(args.seconds), "--keys", str(args.keys),
    ]
    try:
        output = subprocess.run(
            command, check=True, capture_output=True, text=True, timeout=PHASE_SECONDS
        ).stdout
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as failed:
        stderr = failed.stderr if isinstance(failed.stderr, str) else (failed.stderr or b"").decode()
        print(f"{name} run failed ({failed}):\n{stderr[-3000:]}", file=sys.stderr, flush=True)
        raise
    return dict(json.loads(output.strip().splitlines()[-1]))


def run_repeated(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """The best of `--repeat` runs, with every run's main figure (the machine is shared)."""
    runs, failures = [], 0
    for _ in range(args.repeat):
        try:
            runs.append(run_phase(name, args))
        except subprocess.CalledProcessError:
            failures += 1  # e.g. nostr-sdk's channel lagging on a loaded machine
    if not runs:
        return {"failed_runs": failures}
    figure, better = MAIN_FIGURE[name]
    values = [run[figure] for run in runs]
    best = next(run for run in runs if run[figure] == better(values))
    spreads = {"runs": values, "spread": [min(values), max(values)], "failed_runs": failures}
    if figure == "cpu_ratio":  # the wall-clock ratio too, as before
        walls = [run["ratio"] for run in runs]
        spreads |= {"wall_runs": walls, "wall_spread": [min(walls), max(walls)]}
    return {**best, **spreads}


def run_interleaved(args: argparse.Namespace) -> dict[str, Any]:
    """plain100k and preferences in turns (ABBA: plain, preferences, preferences, plain, ...),
    `--repeat` runs each: on the shared machine the load drifts by several times within
    minutes, so only runs made side by side compare. Each is kept as `run_repeated` keeps it
    (best run, every run's figure), with the ratio of every pair of neighbours."""
    runs: dict[str, list[dict[str, Any]]] = {"plain100k": [], "preferences": []}
    for turn in range(args.repeat):
        order = ("plain100k", "preferences") if turn % 2 == 0 else ("preferences", "plain100k")
        for name in order:
            runs[name].append(run_phase(name, args))
            print(name, json.dumps(runs[name][-1]), flush=True)
    figure = "bridge_cpu_us_per_unique_event"
    results: dict[str, Any] = {}
    for name, made in runs.items():
        values = [run[figure] for run in made]
        best = next(run for run in made if run[figure] == min(values))
        results[name] = {**best, "runs": values, "spread": [min(values), max(values)],
                         "failed_runs": 0}
    pairs = [plain[figure] / chosen[figure]
             for plain, chosen in zip(runs["plain100k"], runs["preferences"], strict=True)]
    results["preferences_over_plain_pair_ratios"] = [round(r, 3) for r in pairs]
    results["preferences_over_plain_pair_ratio_median"] = round(statistics.median(pairs), 3)
    return results


def run_public(args: argparse.Namespace) -> None:
    """The public-kinds firehose (`phase_public`) with each of `--public-keys` registered keys
    in turns (ABBA), `--repeat` runs each, each in a fresh process; the figures of every run,
    the median per key count, and the ratio of the key counts' CPU per event (mixed stream) in
    each pair of neighbouring runs. Written to bench/results/ingest_public-<date>-<commit>.json
    (issue 32: unmatched events at least 3x bare verification per CPU second; 1,000 against
    100,000 keys within 15% in CPU per event)."""
    counts = [int(n) for n in args.public_keys.split(",")]
    runs: dict[int, list[dict[str, Any]]] = {n: [] for n in counts}
    for turn in range(args.repeat):
        for keys in counts if turn % 2 == 0 else list(reversed(counts)):
            run = run_phase("public", argparse.Namespace(**{**vars(args), "keys": keys}))
            runs[keys].append(run)
            print(keys, json.dumps(run), flush=True)
    summary: dict[str, Any] = {}
    for keys, made in runs.items():
        summary[str(keys)] = {
            figure: {"median": statistics.median(r[figure] for r in made),
                     "runs": [r[figure] for r in made]}
            for figure in ("unmatched_cpu_ratio", "unmatched_cpu_us_per_event",
                           "mixed_cpu_ratio", "mixed_cpu_us_per_event")
        }
    targets: dict[str, Any] = {
        f"unmatched_at_least_3x_bare_verify_{keys}_keys":
            summary[str(keys)]["unmatched_cpu_ratio"]["median"] >= 3 for keys in counts
    }
    if len(counts) == 2:
        pairs = [big["mixed_cpu_us_per_event"] / small["mixed_cpu_us_per_event"]
                 for small, big in zip(runs[counts[0]], runs[counts[1]], strict=True)]
        summary[f"mixed_cpu_per_event_{counts[1]}_over_{counts[0]}"] = {
            "pairs": [round(p, 3) for p in pairs], "median": round(statistics.median(pairs), 3)}
        targets[f"{counts[0]}_and_{counts[1]}_keys_within_15_percent"] = (
            abs(statistics.median(pairs) - 1) < 0.15)
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short=10", "HEAD"],
                            check=False, capture_output=True, text=True).stdout.strip()
    results = {
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "commit": commit,
        "command": " ".join(["python", "bench/ingest.py", *sys.argv[1:]]),
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(),
                    "bridge_cores": 1, "note": "shared 2-core machine: medians of the runs"},
        "summary": summary, "targets_met": targets,
        "runs": {str(keys): made for keys, made in runs.items()},
    }
    suffix = "" if args.public_order == "live" else f"-{args.public_order}"
    out = RESULTS.parent / (
        f"ingest_public-{time.strftime('%Y-%m-%d', time.gmtime())}-{commit}{suffix}.json"
    )
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps({"summary": summary, "targets_met": targets}, indent=2))
    print(f"written to {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=30000)
    parser.add_argument("--rate", type=float, default=1000.0)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--keys", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--public-order", choices=["live", "sawtooth"], default="live",
                        help="public streams dated in arrival order (a live firehose) or over"
                             " the same ten minutes in turns (a catch-up's dump: the snapshot's"
                             " worst case)")
    parser.add_argument("--public-keys", default="1000,100000",
                        help="registered key counts compared by --only public")
    parser.add_argument("--only", default=",".join(PHASES), help="comma-separated phases")
    parser.add_argument("--phase", choices=["relay", *PHASES])
    parser.add_argument("--port-file", type=Path)
    args = parser.parse_args()
    if args.phase == "relay":
        pin(RELAY_CORE)
        asyncio.run(run_relay(args.port_file))
        return
    if args.phase is not None:
        with tempfile.TemporaryDirectory() as folder:
            phase = {
                "ingest": lambda: phase_ingest(Path(folder), args.events),
                "copies": lambda: phase_ingest(Path(folder), args.events, copies=4),
                "filtered": lambda: phase_firehose(Path(folder), args.events, "filtered"),
                "firehose": lambda: phase_firehose(Path(folder), args.events, "firehose"),
                "latency": lambda: phase_latency(Path(folder), args.rate, args.seconds),
                "keys": lambda: phase_keys(Path(folder), args.keys),
                "sdk": lambda: phase_sdk(Path(folder), args.events),
                "plain100k": lambda: phase_ingest(Path(folder), args.events, keys=args.keys),
                "public": lambda: phase_public(Path(folder), args.events, args.keys,
                                               args.public_order),
                "preferences": lambda: phase_ingest(
                    Path(folder), args.events, keys=args.keys, preferences=True
                ),
            }[args.phase]
            # the bridge runs here as under `sigil-push serve`: same GC tuning, same event loop
            tune_gc()
            print(json.dumps(uvloop.run(phase())))
        return
    if args.only == "public":
        run_public(args)
        return
    load_before = os.getloadavg()[0]
    results: dict[str, Any] = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    names = [n for n in args.only.split(",") if n]
    if {"plain100k", "preferences"} <= set(names):
        results |= run_interleaved(args)
        names = [n for n in names if n not in ("plain100k", "preferences")]
    for name in names:
        results[name] = run_repeated(name, args)
        print(name, json.dumps(results[name]), flush=True)
    results["machine"] = {
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "load_1min_before": round(load_before, 2),
        "load_1min_after": round(os.getloadavg()[0], 2),
        "bridge_cores": 1,
        "repeat": args.repeat,
        "note": "shared 2-core machine, other engineers' work running: best of the runs, "
        "with the spread of the main figure",
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    targets = {
        "ingest_ratio_at_least_0.8": ("ingest", lambda r: max(r["wall_runs"]) >= 0.8),
        "ingest_cpu_ratio_at_least_0.8": ("ingest", lambda r: r["cpu_ratio"] >= 0.8),
        "copies_ratio_at_least_0.3": ("copies", lambda r: max(r["wall_runs"]) >= 0.3),
        "copies_cpu_ratio_at_least_0.3": ("copies", lambda r: r["cpu_ratio"] >= 0.3),
        # issue 23's targets through the port (the 0.8 above is withdrawn, see docs/bridge.md)
        "ingest_cpu_ratio_at_least_0.55": ("ingest", lambda r: r["cpu_ratio"] >= 0.55),
        "copies_cpu_ratio_at_least_0.45": ("copies", lambda r: r["cpu_ratio"] >= 0.45),
        "p99_below_20ms_at_1000_per_s": ("latency", lambda r: r["p99_ms"] < 20),
        "100k_keys_start_below_10s": ("keys", lambda r: r["start_to_live_s"] < 10),
        "100k_keys_rss_below_300mb": ("keys", lambda r: r["peak_rss_mb"] < 300),
    }
    met = {name: check(results[phase]) for name, (phase, check) in targets.items()
           if "runs" in results.get(phase, {})}
    if "filtered" in results and "firehose" in results:
        ratio = results["firehose"]["cpu_us_per_wakeup"] / results["filtered"]["cpu_us_per_wakeup"]
        results["firehose_over_filtered_cpu_per_wakeup"] = round(ratio, 2)
        met["firehose_cpu_per_wakeup_at_most_1.5x_filtered"] = ratio <= 1.5
    if "runs" in results.get("plain100k", {}) and "runs" in results.get("preferences", {}):
        plain, chosen = results["plain100k"], results["preferences"]
        # the ingest ratio is bare verification's CPU per event over the bridge's: with the
        # same events, the ratio of the two scenarios' ratios is that of their bridge CPU
        ratio = plain["bridge_cpu_us_per_unique_event"] / chosen["bridge_cpu_us_per_unique_event"]
        results["preferences_over_plain_ratio"] = round(ratio, 3)
        results["preferences_over_plain_cpu_ratio_as_measured"] = round(
            chosen["cpu_ratio"] / plain["cpu_ratio"], 3
        )
        met["preferences_within_3_percent_of_plain"] = ratio >= 0.97
        if "preferences_over_plain_pair_ratio_median" in results:
            met["preferences_within_3_percent_of_plain_median_of_pairs"] = (
                results["preferences_over_plain_pair_ratio_median"] >= 0.97
            )
    results["targets_met"] = met
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
