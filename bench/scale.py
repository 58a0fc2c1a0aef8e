"""Benchmark of `sigil-push serve` scaled out on PostgreSQL: real worker processes, a real server.

A PostgreSQL cluster is started from the machine's binaries (testkit.postgres), a local
APNs answers the wakeups, and bench/routing_relay.py answers every REQ with EOSE and, on a
control message, streams pre-signed kind 4 DMs to the subscriptions whose `#p` filter holds the
recipient, as a real relay does: each worker receives only the DMs of the keys it watches.

Phases:
  startup   — `--keys` registered keys (COPY into `devices`); the narrowed key query with and
              without the shard index; then 1 worker and then 2 workers started together:
              seconds from process start until every key is watched by some worker (the shards
              of the workers whose keys watched are exactly their shards' registered keys cover
              all 256), then until the shards are split fairly (128/128) with every key
              watched, with the shard counts over time as /health shows them and as the lease
              table holds them (polled directly: live counts, shards that bounced back to an
              owner they left), and each worker's RSS (VmRSS, VmHWM);
  throughput — `--events` DMs, one to each of as many registered keys (iOS devices), streamed as fast as
              the relay sends (parsed before the clock starts); 1 then 2 workers: events/s
              (bridge `events_pushed_total` reaching the count) and wakeups/s (APNs answers
              reaching it, polled every 0.25 s), the 2:1 ratio, and the CPU seconds of the
              workers, the relay, the fake APNs, PostgreSQL and this process over the run
              (with --spy, py-spy samples of each worker, waiting included);
  handover  — 2 workers, SIGKILL one: seconds until the survivor holds every shard, and until a
              DM to a key of a moved shard is pushed;
  register  — NIP-98 signed registrations (bench/api.py's requests) through 2 workers at once.
The machine has 2 cores and is shared with other engineers' tests, so every figure is a floor;
each throughput run also reports where each worker's event loop spent it (on a CPU, runnable
but waiting for one, asleep) and the CPU milliseconds per wakeup of every process.

The APNs endpoint (`--apns`): `nginx` (default; bench/native_apns.py, C, about 0.01 ms of CPU
per wakeup, checks nothing; needs `apt-get install -y nginx-light`) or `python`, the tests'
fake (checks provider tokens and headers, about 0.4 ms of CPU per wakeup: on these 2 cores it
takes CPU from the workers and takes turns with them, so a scaling figure measured against it
mostly measures the fake).
Writes bench/results/scale.json.

Usage: python bench/scale.py [--keys 1000000] [--quick] [--profile] [--spy] [--phases ...]
                             [--apns nginx|python] [--pairs N] [--throughput-workers 1 2]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import api as api_bench
import asyncpg
from ingest import make_events, write_events
from native_apns import NativeApns, children_of
from push import start_fake
from routing_relay import RoutingRelay

from sigil_push.shards import DEFAULT_SHARDS, fair_share, shard_of
from sigil_push.store.postgres.migrate import migrate
from testkit.fakes.credentials import KEY_ID, TEAM_ID, TOPIC, make_apns_key, make_tls
from testkit.postgres import PostgresServer, find_binaries
from testkit.service import ServiceProcess
from testkit.stores import on_database

RESULTS = ROOT / "bench" / "results" / "scale.json"
LEASE_SECONDS = 3.0


# workers ----------------------------------------------------------------------------------


class Worker(ServiceProcess):
    """A serve process as the test suite starts it, but logging at WARNING (DEBUG lines per
    event would be most of the work at these rates), optionally under cProfile."""

    profile: Path | None = None

    def start(self, wait: bool = True) -> Worker:
        log = open(self.log_path, "ab")  # noqa: SIM115 (the child process keeps it open)
        profiler = ["-m", "cProfile", "-o", str(self.profile)] if self.profile else []
        self._process = subprocess.Popen(
            [sys.executable, *profiler, "-m", "sigil_push", "--log-level", "WARNING", "serve",
             "--config", str(self.config_path)],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.started_at = time.monotonic()
        if wait:
            self.wait_healthy(120)
        return self

    @property
    def pid(self) -> int:
        assert self._process is not None
        return self._process.pid

    def memory_mb(self) -> dict[str, float]:
        status = Path(f"/proc/{self.pid}/status").read_text()
        found = dict(re.findall(r"^(VmRSS|VmHWM):\s+(\d+) kB", status, re.MULTILINE))
        return {"rss_mb": round(int(found["VmRSS"]) / 1024, 1),
                "peak_rss_mb": round(int(found["VmHWM"]) / 1024, 1)}

    def cpu_seconds(self) -> float:
        return api_bench.cpu_seconds(self.pid)

    def loop_schedstat(self) -> tuple[float, float]:
        """Seconds the event loop's thread (the main thread) has run on a CPU and has waited,
        runnable, for one (/proc/<pid>/task/<pid>/schedstat)."""
        fields = Path(f"/proc/{self.pid}/task/{self.pid}/schedstat").read_text().split()
        return int(fields[0]) / 1e9, int(fields[1]) / 1e9

    def admin(self, path: str) -> str:
        try:
            with urllib.request.urlopen(self.admin_url + path, timeout=60) as response:
                return str(response.read().decode())
        except OSError:
            return ""

    def health(self) -> dict[str, Any]:
        text = self.admin("/health")
        return dict(json.loads(text)) if text else {}

    def metric(self, name: str) -> float:
        """Sum of every sample of counter `name` (all label sets)."""
        total = 0.0
        for line in self.admin("/metrics").splitlines():
            if line.startswith((name + "{", name + " ")):
                total += float(line.rsplit(" ", 1)[1])
        return total


class Instance:
    """The shared pieces (database, relay, fake APNs, bridge key) and the workers on them."""

    def __init__(self, folder: Path, database: str, relay: RoutingRelay, apns_toml: str,
                 limits: str) -> None:
        self.folder, self.database, self.relay, self.apns_toml = folder, database, relay, apns_toml
        self.limits = limits
        self.lease_seconds = LEASE_SECONDS
        self.filtered = True
        self.workers: list[Worker] = []

    def add_worker(self, profile: Path | None = None) -> Worker:
        index = len(self.workers)
        # the phases that stream DMs keep `#p`-filtered subscriptions whatever the number of
        # keys: the routing relay delivers each DM only to the worker that watches its
        # recipient (it serves no firehose, which would send every DM to every worker)
        filtered = f"firehose_above_keys = {10 ** 9}\n" if self.filtered else ""
        extra = (
            f"[bridge]\nreconnect_min_seconds = 0.2\nreconnect_max_seconds = 1.0\n"
            f"lease_seconds = {self.lease_seconds}\n{filtered}{self.apns_toml}"
        )
        worker = Worker(self.folder / f"worker{index}-{time.monotonic_ns()}", [self.relay.url], extra,
                        limits=self.limits)
        public = self.workers[0].url if self.workers else None
        on_database(worker, self.database, public_url=public, key_file=self.folder / "bridge.key")
        worker.profile = profile
        self.workers.append(worker)
        return worker

    def watched(self) -> int:
        """Keys subscribed on live relay connections, over every worker (-1: one not live)."""
        total = 0
        for worker in self.workers:
            state = worker.health().get("relays", {}).get(self.relay.url) or {}
            if not state.get("live"):
                return -1
            total += int(state.get("keys") or 0)
        return total

    def shards(self) -> list[list[int]]:
        return [list(worker.health().get("shards", [])) for worker in self.workers]

    def partitioned(self) -> bool:
        held = self.shards()
        return all(held) and sorted(s for h in held for s in h) == list(range(DEFAULT_SHARDS))

    def balanced(self, keys: int) -> bool:
        """Every shard held once, each worker at 256 // N or one more, every key watched: the
        split has settled. The routing relay keeps no events, so a DM streamed while a key
        moves between workers would be lost here (a real relay serves it to the catch-up)."""
        held = self.shards()
        least, most = DEFAULT_SHARDS // len(held), fair_share(DEFAULT_SHARDS, len(held))
        return (sorted(s for h in held for s in h) == list(range(DEFAULT_SHARDS))
                and all(least <= len(h) <= most for h in held) and self.watched() == keys)

    def total(self, metric: str) -> float:
        return sum(worker.metric(metric) for worker in self.workers)

    def stop(self) -> None:
        for worker in self.workers:
            worker.stop(timeout=60)
        self.workers = []


async def wait_for(condition: Callable[[], bool], what: str, timeout: float, poll: float = 0.2) -> float:
    started = time.monotonic()
    while not await asyncio.to_thread(condition):
        if time.monotonic() - started > timeout:
            raise TimeoutError(f"not reached within {timeout} s: {what}")
        await asyncio.sleep(poll)
    return time.monotonic() - started


class Others:
    """The processes that are not workers but share the cores with them: the routing relay,
    the APNs endpoint (the Python fake, or nginx's master and worker) and PostgreSQL
    (postmaster and every backend). Their CPU time, next to the workers', shows what the 2
    cores were spent on during a run."""

    def __init__(self, relay: RoutingRelay, apns_pids: Callable[[], list[int]],
                 server: PostgresServer) -> None:
        self.relay = relay
        self.apns_pids = apns_pids
        self.server = server

    def _postgres(self) -> list[int]:
        postmaster = int((self.server.data / "postmaster.pid").read_text().split()[0])
        return [postmaster, *children_of(postmaster)]

    def cpu(self) -> dict[str, dict[int, float]]:
        """CPU seconds per process, by component (a backend that exits between two readings
        loses its share: the pools keep theirs open for the whole run)."""
        found: dict[str, dict[int, float]] = {}
        pids = {"relay": [self.relay.pid], "apns": self.apns_pids(), "postgres": self._postgres()}
        for name, group in pids.items():
            found[name] = {}
            for pid in group:
                try:
                    found[name][pid] = api_bench.cpu_seconds(pid)
                except (OSError, ValueError):
                    continue
        return found

    @staticmethod
    def spent(before: dict[str, dict[int, float]], after: dict[str, dict[int, float]]) -> dict[str, float]:
        return {name: round(sum(after[name][pid] - before[name].get(pid, 0.0) for pid in after[name]), 2)
                for name in after}


# the database -----------------------------------------------------------------------------


async def fresh_database(server: PostgresServer, name: str) -> str:
    admin = await asyncpg.connect(server.url())
    try:
        await admin.execute(f"CREATE DATABASE {name}")
    finally:
        await admin.close()
    url = server.url(name)
    await migrate(url)
    return url


async def copy_devices(url: str, pubkeys: list[str], platform_name: str = "ios") -> float:
    """Bench setup only: COPY the registrations into `devices` instead of a million API calls."""
    now = int(time.time()) - 60
    rows = [(p, platform_name, os.urandom(32).hex(), "opaque", "[]", now, now) for p in pubkeys]
    connection = await asyncpg.connect(url)
    started = time.perf_counter()
    try:
        await connection.copy_records_to_table(
            "devices", records=rows,
            columns=["pubkey", "platform", "token", "payload", "relays", "registered_at", "updated_at"],
        )
        await connection.execute("ANALYZE devices")
    finally:
        await connection.close()
    return time.perf_counter() - started


# phases -----------------------------------------------------------------------------------


async def phase_key_query(url: str, repeats: int = 3) -> dict[str, Any]:
    """The narrowed key query (`PostgresDevices.watched_keys`) for 256, 128 and 32 shards, with
    the shard index (migration 0005) and without it (dropped inside a transaction that is
    rolled back): median milliseconds to fetch the rows into this process, as a worker does
    at start-up, and the server's own execution time (EXPLAIN ANALYZE, rows not sent)."""
    from sigil_push.store.postgres.devices import shard_keys_sql

    connection = await asyncpg.connect(url)
    result: dict[str, Any] = {}
    try:
        for indexed in (True, False):
            transaction = connection.transaction()
            await transaction.start()
            if not indexed:
                await connection.execute("DROP INDEX devices_by_shard")
            for count in (DEFAULT_SHARDS, DEFAULT_SHARDS // 2, DEFAULT_SHARDS // 8):
                times = []
                for _ in range(repeats):
                    started = time.perf_counter()
                    rows = await connection.fetch(shard_keys_sql(DEFAULT_SHARDS), list(range(count)))
                    times.append(time.perf_counter() - started)
                plan = await connection.fetch("EXPLAIN (ANALYZE) " + shard_keys_sql(DEFAULT_SHARDS),
                                              list(range(count)))
                server_ms = float(str(plan[-1][0]).split(":")[1].split()[0])  # Execution Time
                name = f"{'with' if indexed else 'without'}_index_{count}_shards"
                result[name] = {"ms_median": round(1000 * sorted(times)[repeats // 2], 1), "rows": len(rows),
                                "server_execution_ms": round(server_ms, 1)}
            await transaction.rollback()  # the index is back
    finally:
        await connection.close()
    print("key query", json.dumps(result), flush=True)
    return result


class ShardTimeline:
    """Samples how many shards each worker holds, and how many keys are watched, over time:
    when every key was first watched by some worker, when the split became fair (every worker
    at its share, every key watched) and how many shards changed hands on the way (a shard
    that flaps counts at every move).

    A worker counts as watching the keys of the shards its /health lists only once the keys it
    watches are exactly as many as are registered in those shards (`per_shard`, counted in the
    database): a worker whose reshard is still loading or releasing keys covers none of them.
    Every key is watched when the shards of such complete workers cover all of them; the sum
    of the keys watched alone would count a key twice while two workers overlap on it."""

    def __init__(self, instance: Instance, keys: int, started: float, per_shard: list[int]) -> None:
        self.instance, self.keys, self.started = instance, keys, started
        self.per_shard = per_shard
        self.samples: list[tuple[float, list[int], int]] = []
        self.slowest_poll = 0.0
        self.slowest_poll_holding = 0.0
        self.every_key_watched_at: float | None = None

    def sample(self) -> bool:
        """Take one sample; whether the workers are balanced with every key watched."""
        asked = time.monotonic()
        healths = [worker.health() for worker in self.instance.workers]
        # the polls go through every worker's API on its event loop: a loop stalled by a
        # reshard answers late
        took = time.monotonic() - asked
        held = [list(h.get("shards", [])) for h in healths]
        counts: list[int | None] = []
        for health in healths:
            state = health.get("relays", {}).get(self.instance.relay.url) or {}
            counts.append(int(state.get("keys") or 0) if state.get("live") else None)
        watched = -1 if None in counts else sum(c or 0 for c in counts)
        self.slowest_poll = max(self.slowest_poll, took)
        if all(held):  # past every worker's start-up: each holds shards
            self.slowest_poll_holding = max(self.slowest_poll_holding, took)
        at = round(time.monotonic() - self.started, 1)
        self.samples.append((at, [len(h) for h in held], watched))
        covered: set[int] = set()
        complete = True
        for shards, count in zip(held, counts, strict=True):
            if count is not None and count == sum(self.per_shard[s] for s in shards):
                covered.update(shards)
            else:
                complete = False
        every_key = covered == set(range(DEFAULT_SHARDS))
        if every_key and self.every_key_watched_at is None:
            self.every_key_watched_at = at
        least, most = DEFAULT_SHARDS // len(held), fair_share(DEFAULT_SHARDS, len(held))
        every = sorted(s for h in held for s in h)
        return (every_key and complete and every == list(range(DEFAULT_SHARDS))
                and all(least <= len(h) <= most for h in held))

    def moves(self) -> int:
        counts = [c for _, c, _ in self.samples]
        return sum(abs(a - b) for before, after in itertools.pairwise(counts)
                   for a, b in zip(before, after))

    def changes(self) -> list[tuple[float, list[int], int]]:
        """The samples at which some worker's shard count or the keys watched changed."""
        kept = []
        for sample in self.samples:
            if not kept or sample[1:] != kept[-1][1:]:
                kept.append(sample)
        return kept


class LeaseLog:
    """The lease table itself, polled every 0.1 s from process start: the truth the workers'
    /health lags (a bridge is told of a change only once its reshard begins). Records each
    live owner's count whenever it changes, every shard's owners in turn, and the bounces: a
    shard that leaves an owner and comes back to it."""

    def __init__(self, url: str, started: float) -> None:
        self.url, self.started = url, started
        self.counts: list[tuple[float, list[int]]] = []
        self.owners: dict[int, list[tuple[float, str]]] = {}
        self.names: dict[str, int] = {}
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        connection = await asyncpg.connect(self.url)
        try:
            while True:
                rows = await connection.fetch(
                    "SELECT shard, owner FROM shard_leases WHERE owner IS NOT NULL"
                    " AND expires_at > now()")
                at = round(time.monotonic() - self.started, 1)
                held: dict[int, str] = {int(r["shard"]): str(r["owner"]) for r in rows}
                for shard in range(DEFAULT_SHARDS):
                    owner = held.get(shard, "-")
                    history = self.owners.setdefault(shard, [])
                    if not history or history[-1][1] != owner:
                        history.append((at, owner))
                for owner in held.values():
                    self.names.setdefault(owner, len(self.names))
                counts = [0] * len(self.names)
                for owner in held.values():
                    counts[self.names[owner]] += 1
                if not self.counts or self.counts[-1][1] != counts:
                    self.counts.append((at, counts))
                await asyncio.sleep(0.1)
        finally:
            await connection.close()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def bounces(self) -> list[tuple[int, float, float]]:
        """(shard, left at, back at): an owner lost a shard (to another or to expiry) and took
        it again later."""
        found = []
        for shard, history in self.owners.items():
            owners = [(at, o) for at, o in history if o != "-"]
            for (left, a), (_, b), (back, c) in zip(owners, owners[1:], owners[2:]):
                if a == c != b:
                    found.append((shard, left, back))
            for (at, a), (back, c) in itertools.pairwise(owners):
                if a == c:  # expired and taken again by the same owner
                    found.append((shard, at, back))
        return sorted(found, key=lambda f: f[1])


async def phase_startup(instance: Instance, keys: int, workers: int, profile: bool) -> dict[str, Any]:
    """Start `workers` workers together; seconds until all keys are watched, then until the
    shards are split fairly with every key watched (the settling), memory of each."""
    connection = await asyncpg.connect(instance.database)
    try:
        rows = await connection.fetch(
            "SELECT ((('x' || substr(pubkey, 1, 8))::bit(32)::bigint % $1)::integer) AS shard,"
            " count(DISTINCT pubkey) AS keys FROM devices GROUP BY 1", DEFAULT_SHARDS)
    finally:
        await connection.close()
    per_shard = [0] * DEFAULT_SHARDS
    for row in rows:
        per_shard[int(row["shard"])] = int(row["keys"])
    started = time.monotonic()
    leases = LeaseLog(instance.database, started)
    leases.start()
    for index in range(workers):
        path = instance.folder / f"startup-{workers}w-{index}.prof" if profile else None
        instance.add_worker(path).start(wait=False)
    # sampled from the start: the shard moves and keys watched while the workers load, too
    timeline = ShardTimeline(instance, keys, started, per_shard)
    await wait_for(lambda: timeline.sample() or timeline.every_key_watched_at is not None,
                   f"{keys} keys watched", 900, 0.25)
    await wait_for(timeline.sample, "shards split fairly, every key watched", 600, 0.25)
    balanced = time.monotonic() - started
    seconds = timeline.every_key_watched_at
    await leases.stop()
    result = {
        "workers": workers,
        "keys": keys,
        "seconds_to_every_key_watched": seconds,
        "seconds_to_balanced": round(balanced, 1),
        "shard_moves_while_settling": timeline.moves(),
        "settling_timeline_s_shards_keys": timeline.changes(),
        "lease_table_s_live_counts": leases.counts,
        "lease_bounces_shard_left_back": leases.bounces()[:40],
        "lease_bounce_count": len(leases.bounces()),
        "load_average_1min_at_end": round(os.getloadavg()[0], 2),
        "slowest_health_poll_of_all_workers_s": round(timeline.slowest_poll, 2),
        "slowest_poll_once_every_worker_holds_shards_s": round(timeline.slowest_poll_holding, 2),
        "per_worker": [
            {**worker.memory_mb(), "cpu_seconds": round(worker.cpu_seconds(), 1),
             "keys_watched": int((worker.health().get("relays", {}).get(instance.relay.url) or {}).get("keys") or 0),
             "shards": len(worker.health().get("shards", []))}
            for worker in instance.workers
        ],
    }
    print("startup", json.dumps(result), flush=True)
    if profile:
        instance.stop()
        result["profile_top"] = [profile_top(instance.folder / f"startup-{workers}w-{i}.prof")
                                 for i in range(workers)]
    return result


def profile_top(path: Path, lines: int = 15) -> list[str]:
    import io
    import pstats

    if not path.exists():
        return [f"no profile written at {path}"]
    out = io.StringIO()
    pstats.Stats(str(path), stream=out).sort_stats("tottime").print_stats(lines)
    rows = [r for r in out.getvalue().splitlines() if r.strip()]
    print("\n".join(rows[-(lines + 1):]), flush=True)
    return rows[-(lines + 1):]


def py_spy(pid: int, seconds: float, out: Path) -> subprocess.Popen[bytes] | None:
    """Sample a worker with py-spy (if installed) for `seconds`, idle time included, so the
    profile shows where the worker waits as well as where it burns CPU."""
    binary = shutil.which("py-spy")
    if binary is None:
        return None
    return subprocess.Popen(
        [binary, "record", "--pid", str(pid), "--duration", str(int(seconds)), "--idle",
         "--format", "raw", "--rate", "200", "--output", str(out), "--nonblocking"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )


def spy_top(path: Path, lines: int = 25) -> list[str]:
    """The heaviest leaf frames of a py-spy raw (collapsed stacks) file, as shares of samples."""
    if not path.exists():
        return []
    leaves: dict[str, int] = {}
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        leaf = ";".join(frames[-2:])
        leaves[leaf] = leaves.get(leaf, 0) + int(count)
        total += int(count)
    ranked = sorted(leaves.items(), key=lambda item: -item[1])[:lines]
    return [f"{100 * n / total:5.1f}% {frame}" for frame, n in ranked]


async def phase_throughput(instance: Instance, events_file: Path, events: int, workers: int,
                           others: Others, spy: bool = False,
                           server_answered: Callable[[], int] | None = None) -> dict[str, Any]:
    for _ in range(workers):
        instance.add_worker().start(wait=False)
    dm_keys = int(events_file.with_suffix(".keys").read_text())
    await wait_for(lambda: instance.balanced(dm_keys), "shards split, DM keys watched", 300, 0.5)
    await instance.relay.load(events_file)
    pushed0 = instance.total("sigil_push_bridge_events_pushed_total")
    sent0 = instance.total("sigil_push_pushes_total")
    seen0 = server_answered() if server_answered else 0
    cpu0 = [w.cpu_seconds() for w in instance.workers]
    sched0 = [w.loop_schedstat() for w in instance.workers]
    others0 = others.cpu()
    load0 = os.getloadavg()[0]
    bench0 = time.process_time()
    spies = [(py_spy(w.pid, 30, instance.folder / f"spy-{workers}w-{i}.txt"),
              instance.folder / f"spy-{workers}w-{i}.txt")
             for i, w in enumerate(instance.workers)] if spy else []
    started = time.monotonic()
    routed = await instance.relay.stream(events_file)
    relay_done = time.monotonic() - started
    await wait_for(
        lambda: instance.total("sigil_push_bridge_events_pushed_total") - pushed0 >= events,
        "every event handed to the outbox", 600, 0.25)
    handled = time.monotonic() - started
    await wait_for(lambda: instance.total("sigil_push_pushes_total") - sent0 >= events,
                   "every wakeup answered by APNs", 600, 0.25)
    delivered = time.monotonic() - started
    cpu = [round(w.cpu_seconds() - c, 2) for w, c in zip(instance.workers, cpu0)]
    # where each worker's event loop spent the run: on a CPU, waiting for one (the cores were
    # busy with something else), or asleep with nothing to do (waiting on PostgreSQL, APNs or
    # the relay: a latency bound, not a CPU bound)
    loops = []
    for worker, (ran0, waited0) in zip(instance.workers, sched0):
        ran, waited = worker.loop_schedstat()
        ran, waited = ran - ran0, waited - waited0
        loops.append({"on_cpu": round(ran / delivered, 2), "runnable_waiting_for_cpu":
                      round(waited / delivered, 2),
                      "asleep": round(max(0.0, delivered - ran - waited) / delivered, 2)})
    spent = Others.spent(others0, others.cpu())
    spent["bench_process"] = round(time.process_time() - bench0, 2)
    for process, _ in spies:
        if process is not None:
            process.send_signal(signal.SIGINT)
            process.wait(60)
    seen = server_answered() - seen0 if server_answered else None
    all_cpu = sum(cpu) + sum(spent.values())
    per_wakeup = {"workers": round(1000 * sum(cpu) / events, 3),
                  **{name: round(1000 * seconds / events, 3) for name, seconds in spent.items()}}
    result = {
        "workers": workers,
        "events": events,
        "routed_by_relay": routed,
        "relay_send_seconds": round(relay_done, 2),
        "events_per_second": round(events / handled, 1),
        "wakeups_per_second": round(events / delivered, 1),
        "seconds_to_all_answered": round(delivered, 2),
        "apns_requests_seen_by_server": seen,
        "worker_cpu_seconds": cpu,
        "other_cpu_seconds": spent,
        "cpu_ms_per_wakeup": per_wakeup,
        "cores_busy_on_this_bench": round(all_cpu / delivered, 2),
        "worker_cores": round(sum(cpu) / delivered, 2),
        "worker_event_loop_share_of_run": loops,
        "wakeups_per_worker_cpu_second": round(events / sum(cpu), 1),
        "load_average_before_after": [round(load0, 2), round(os.getloadavg()[0], 2)],
        "per_worker": [w.memory_mb() for w in instance.workers],
    }
    if spies:
        result["py_spy_top_leaf_frames"] = [spy_top(path) for _, path in spies]
    print("throughput", json.dumps(result), flush=True)
    instance.stop()
    return result


async def phase_handover(instance: Instance, folder: Path, dm_keys: list[str]) -> dict[str, Any]:
    for _ in range(2):
        instance.add_worker().start(wait=False)
    await wait_for(lambda: instance.balanced(len(dm_keys)), "shards split, keys watched", 300, 0.5)
    victim, survivor = instance.workers
    moved = set(victim.health().get("shards", []))
    key = next(k for k in dm_keys if shard_of(k) in moved)
    dm_file = folder / "handover.jsonl"
    write_events(make_events([key], 1, senders=1), dm_file)
    sent0 = survivor.metric("sigil_push_pushes_total")
    assert victim.stop(signal.SIGKILL) == -9
    killed = time.monotonic()
    instance.workers = [survivor]
    await wait_for(lambda: len(survivor.health().get("shards", [])) == DEFAULT_SHARDS,
                   "survivor holds every shard", 120, 0.05)
    held = time.monotonic() - killed
    await wait_for(lambda: instance.watched() == len(dm_keys), "moved keys watched", 120, 0.05)
    watched = time.monotonic() - killed
    await instance.relay.stream(dm_file)
    await wait_for(lambda: survivor.metric("sigil_push_pushes_total") > sent0,
                   "DM to a moved key pushed", 120, 0.05)
    pushed = time.monotonic() - killed
    result = {
        "lease_seconds": LEASE_SECONDS,
        "shards_moved": len(moved),
        "seconds_until_all_shards_held": round(held, 2),
        "seconds_until_moved_keys_watched": round(watched, 2),
        "seconds_until_dm_to_moved_key_pushed": round(pushed, 2),
    }
    print("handover", json.dumps(result), flush=True)
    instance.stop()
    return result


async def phase_register(instance: Instance, count: int, concurrency: int) -> dict[str, Any]:
    for _ in range(2):
        instance.add_worker().start(wait=True)
    await wait_for(instance.partitioned, "shards split", 120)
    ports = [w.port for w in instance.workers]
    # NIP-98 binds the URL: every worker checks the instance's public URL (the first worker's)
    requests = [api_bench.build_requests(ports[0], count // 2) for _ in ports]
    cpu0 = [w.cpu_seconds() for w in instance.workers]
    started = time.perf_counter()
    parts = await asyncio.gather(*(api_bench.throughput(p, r, concurrency) for p, r in zip(ports, requests)))
    elapsed = time.perf_counter() - started
    total = sum(len(r) for r in requests)
    result = {
        "workers": 2,
        "registrations": total,
        "failures": sum(int(p["failures"]) for p in parts),
        "seconds": round(elapsed, 2),
        "registrations_per_second": round(total / elapsed, 1),
        "per_worker": parts,
        "worker_cpu_seconds": [round(w.cpu_seconds() - c, 1) for w, c in zip(instance.workers, cpu0)],
    }
    print("register", json.dumps(result), flush=True)
    instance.stop()
    return result


def throughput_summary(runs: dict[int, list[dict[str, Any]]], apns: str) -> dict[str, Any]:
    """The runs, and for 1 and 2 workers the medians and the 2:1 ratios of each interleaved
    pair (a pair's two runs are minutes apart, so they saw about the same machine)."""

    def median(values: list[float]) -> float:
        ordered = sorted(values)
        middle = len(ordered) // 2
        return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2

    summary: dict[str, Any] = {"apns_endpoint": apns, "runs": [r for n in sorted(runs) for r in runs[n]]}
    for n, group in runs.items():
        summary[f"median_{n}_worker"] = {
            key: round(median([r[key] for r in group]), 1)
            for key in ("events_per_second", "wakeups_per_second", "cores_busy_on_this_bench",
                        "worker_cores")
        }
    if 1 in runs and 2 in runs:
        pairs = list(zip(runs[1], runs[2]))
        for what in ("events", "wakeups"):
            ratios = [round(two[f"{what}_per_second"] / one[f"{what}_per_second"], 2) for one, two in pairs]
            summary[f"ratio_2_to_1_{what}_per_pair"] = ratios
            summary[f"ratio_2_to_1_{what}"] = round(median(ratios), 2)
        # per CPU second the workers spent: 1.0 means a second worker costs nothing extra per
        # wakeup, so on cores of their own 2 workers would give 2x
        summary["ratio_2_to_1_wakeups_per_worker_cpu_second"] = round(median(
            [two["wakeups_per_worker_cpu_second"] / one["wakeups_per_worker_cpu_second"]
             for one, two in pairs]), 2)
    return summary


# main -------------------------------------------------------------------------------------


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    binaries = find_binaries()
    if binaries is None:
        raise SystemExit("PostgreSQL binaries (initdb, pg_ctl) not found")
    folder = Path(tempfile.mkdtemp(prefix="sigil-push-scale-"))
    os.chmod(folder, 0o755)
    tls = make_tls(folder)
    apns_key, apns_public = make_apns_key(folder)
    (folder / "apns-public.pem").write_bytes(apns_public)
    fake: subprocess.Popen[str] | None = None
    native: NativeApns | None = None
    if args.apns == "nginx":
        native = NativeApns(folder, tls.cert_file, tls.key_file)
        apns_port, apns_pids = native.port, native.pids
    else:
        apns_port = api_bench.free_port()
        fake = start_fake(["testkit.fakes.fake_apns", "--cert", str(tls.cert_file), "--key",
                           str(tls.key_file), "--public-key", str(folder / "apns-public.pem"),
                           "--port", str(apns_port)], None, False)
        fake_pid = fake.pid

        def apns_pids() -> list[int]:
            return [fake_pid]
    apns_toml = (
        f'[apns]\nteam_id = "{TEAM_ID}"\nkey_id = "{KEY_ID}"\nkey_file = "{apns_key}"\n'
        f'topic = "{TOPIC}"\nenvironment = "sandbox"\nendpoint = "https://127.0.0.1:{apns_port}"\n'
        f'ca_file = "{tls.ca_file}"\n[push]\nconcurrency_per_provider = 256\n'
    )
    # every DM one push, as in bench/push.py: no per-device limit, no coalescing
    limits = ("requests_per_minute_per_ip = 0\nrequests_per_minute_per_npub = 0\n"
              "wakeups_per_minute_per_device = 0\ncoalesce_window_ms = 0\n")
    relay = RoutingRelay(folder)
    server = PostgresServer(binaries).start()
    others = Others(relay, apns_pids, server)
    results: dict[str, Any] = {}
    load = [os.getloadavg()[0]]
    try:
        def instance(database: str) -> Instance:
            return Instance(folder, database, relay, apns_toml, limits)

        if "startup" in args.phases:
            url = await fresh_database(server, "scale_keys")
            pubkeys = [os.urandom(32).hex() for _ in range(args.keys)]
            copy_seconds = await copy_devices(url, pubkeys)
            del pubkeys
            print(f"COPY of {args.keys} devices: {copy_seconds:.1f} s", flush=True)
            results["startup"] = {"copy_seconds": round(copy_seconds, 1), "runs": [],
                                  "key_query": await phase_key_query(url)}
            for workers in args.startup_workers:
                one = instance(url)
                one.lease_seconds = args.startup_lease_seconds
                one.filtered = False  # `auto`: the firehose above 2,000 keys, as deployed
                try:
                    results["startup"]["runs"].append(await phase_startup(one, args.keys, workers, False))
                finally:
                    one.stop()
                load.append(os.getloadavg()[0])
            if args.profile:
                one = instance(url)
                try:
                    results["startup"]["profile_1_worker"] = await phase_startup(one, args.keys, 1, True)
                finally:
                    one.stop()
        # one DM per key: DMs to one device within a push's flight are coalesced into one wakeup
        dm_keys = [os.urandom(32).hex() for _ in range(args.events)]
        events_file = folder / "dms.jsonl"
        if {"throughput", "handover"} & set(args.phases):
            write_events(make_events(dm_keys, args.events), events_file)
            events_file.with_suffix(".keys").write_text(str(len(dm_keys)))
        if "throughput" in args.phases:
            runs: dict[int, list[dict[str, Any]]] = {n: [] for n in args.throughput_workers}
            server_answered = native.answered if native is not None else None
            for pair in range(args.pairs):
                for workers in args.throughput_workers:
                    url = await fresh_database(server, f"scale_dms_{workers}_{pair}")
                    await copy_devices(url, dm_keys)
                    one = instance(url)
                    try:
                        runs[workers].append(await phase_throughput(
                            one, events_file, args.events, workers, others, args.spy,
                            server_answered))
                    finally:
                        one.stop()
                    load.append(os.getloadavg()[0])
            results["throughput"] = throughput_summary(runs, args.apns)
            if "ratio_2_to_1_wakeups" in results["throughput"]:
                print("ratio 2 workers : 1 worker (median) — events",
                      results["throughput"]["ratio_2_to_1_events"],
                      "wakeups", results["throughput"]["ratio_2_to_1_wakeups"], flush=True)
        if "handover" in args.phases:
            url = await fresh_database(server, "scale_handover")
            await copy_devices(url, dm_keys)
            one = instance(url)
            try:
                results["handover"] = await phase_handover(one, folder, dm_keys)
            finally:
                one.stop()
        if "register" in args.phases:
            url = await fresh_database(server, "scale_register")
            one = instance(url)
            try:
                results["register"] = await phase_register(one, args.registrations, args.concurrency)
            finally:
                one.stop()
            load.append(os.getloadavg()[0])
    finally:
        relay.stop()
        if fake is not None:
            fake.terminate()
            fake.wait(10)
        if native is not None:
            native.stop()
        server.stop()
    return {
        "benchmark": "serve on PostgreSQL, 1 and 2 workers (real processes, real PostgreSQL)",
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(),
                    "load_average_samples": [round(x, 2) for x in load],
                    "note": "2 cores shared with other engineers' test runs during the bench:"
                            " every figure is a floor, and the 2-worker runs compete with the"
                            " relay, the fake APNs and PostgreSQL for the same 2 cores"},
        "parameters": {k: v for k, v in vars(args).items() if k != "relay"},
        "results": results,
        "targets": {"startup_seconds_1m_keys": 30, "rss_mb_per_worker_1m_keys": 600,
                    "ratio_2_workers_to_1": 1.6},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keys", type=int, default=1_000_000)
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--registrations", type=int, default=4_000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--phases", nargs="+", default=["startup", "throughput", "handover", "register"])
    parser.add_argument("--startup-workers", type=int, nargs="*", default=[1, 2])
    parser.add_argument("--startup-lease-seconds", type=float, default=LEASE_SECONDS,
                        help="lease_seconds in the start-up phase (a stalled loop loses shorter leases)")
    parser.add_argument("--throughput-workers", type=int, nargs="*", default=[1, 2])
    parser.add_argument("--pairs", type=int, default=1,
                        help="throughput: how many interleaved rounds of --throughput-workers")
    parser.add_argument("--apns", choices=["nginx", "python"], default="nginx",
                        help="the APNs endpoint: nginx (native, cheap: apt-get install -y"
                             " nginx-light) or the tests' Python fake (checks tokens, costs CPU)")
    parser.add_argument("--profile", action="store_true", help="one more 1-worker start-up under cProfile")
    parser.add_argument("--spy", action="store_true",
                        help="sample the workers with py-spy during the throughput runs")
    parser.add_argument("--quick", action="store_true", help="smoke run: small sizes")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.quick:
        args.keys, args.events, args.registrations = 5_000, 1_000, 200
    document = asyncio.run(main_async(args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    document["parameters"]["out"] = str(args.out)
    args.out.write_text(json.dumps(document, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
