"""Whole-service CPU per DM, one tree of the code against another (issue 32's "Cost").

Each tree is a git revision (`43e4a27`, `main`, ...) checked out with `git worktree add
--detach` into a temporary folder, or `.` for this working tree as it is (uncommitted edits
included). Its `sigil-push serve` runs from there (PYTHONPATH = the tree; the check that the
process imports that tree's package is made once per tree), on its own fresh SQLite database,
with:
- one relay: bench/routing_relay.py (a `websockets` server in its own process) that answers
  each REQ with EOSE and streams pre-signed kind 4 DMs to the subscriptions whose `#p` names
  the recipient, as a real relay does;
- `--users` users (500) registered through the API (NIP-98, iOS tokens, the configured relay);
- APNs on: nginx answering HTTP/2 (bench/native_apns.py; `--apns python` for the tests' fake),
  with the default per-device push limits (a 2 s coalescing window, 30 pushes a minute), so
  both trees send about as many pushes for the same DMs (`apns_requests`, counted by nginx).
  With `--no-coalescing` (no limits) the wakeups of one device that are due together still
  ride in one push, and how many are due together depends on how far delivery lags behind
  ingest: 43e4a27 sent 4,989 pushes for 10,000 DMs where main, which delivers sooner, sent
  7,699, at about the same CPU per push: the comparison then measures the lag.
Once the relay holds a route for every user, `--dms` DMs (20,000, to the users in turn, from 200
senders) are streamed as fast as the relay sends. Measured: the service process's CPU (every
thread, /proc/<pid>/stat) from just before the burst until every DM is seen (its `seen`
observation record written: the bench reads the log files as they grow, every 0.25 s, which
costs the service nothing, where scraping /metrics cost it 14%), per DM; the same until APNs has
answered every wakeup (its `push` record); wall-clock events/s to the last `seen`; the process's peak RSS.

The machine is shared with other work: the trees run in turns, round by round (the order flips
each round, ABBA...), and the comparison is made within the run: per tree the median and the
spread of its rounds, and the median of the ratios of each round's pair. Process CPU is the
measure, not wall time.

`--spy TREE` records the serve process of that tree with py-spy (if installed; `pip install
py-spy`) from just before the burst until every wakeup is answered, in every round: the heaviest functions by own time and by
total time (sigil_push's frames) are printed and kept in the results.

Usage: python bench/dm_path.py [--trees 43e4a27,main] [--rounds 3] [--users 500]
                               [--dms 20000] [--apns nginx|python] [--spy main]
Writes bench/results/dm_path-<date>-<commits compared>[-window<ms>ms|-nocoalescing].json.
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import os
import platform
import re
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import api as api_bench
from ingest import make_events, write_events
from native_apns import NativeApns
from push import start_fake
from routing_relay import RoutingRelay

from sigil_push.nostr.keys import SecretKey
from sigil_push.nostr.nip98 import make_http_auth
from testkit.fakes.credentials import KEY_ID, TEAM_ID, TOPIC, make_apns_key, make_tls
from testkit.service import ServiceProcess

RESULTS = ROOT / "bench" / "results"
POLL_SECONDS = 0.25


# trees ------------------------------------------------------------------------------------


@dataclass
class Tree:
    name: str
    """As asked: a revision, or `.` for this working tree."""
    path: Path
    commit: str
    worktree: bool
    """True: a `git worktree` of ours, removed at the end."""


def check_out(name: str, folder: Path) -> Tree:
    """The tree of revision `name` in a worktree under `folder` (`.`: this working tree)."""
    if name == ".":
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], check=True,
                                capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--",
                                "sigil_push"], check=True, capture_output=True,
                               text=True).stdout.strip()
        return Tree(name, ROOT, commit + ("+edits" if dirty else ""), False)
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--verify", name + "^{commit}"],
                            check=True, capture_output=True, text=True).stdout.strip()
    path = folder / f"tree-{commit[:10]}"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), commit],
                   check=True, capture_output=True)
    return Tree(name, path, commit, True)


def remove(tree: Tree) -> None:
    if tree.worktree:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree.path)],
                       check=False, capture_output=True)


def tree_env(tree: Tree) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(tree.path), "PYTHONUNBUFFERED": "1"}


def check_imports(tree: Tree) -> None:
    """The serve process must run the tree's code, not the editable install's."""
    found = subprocess.run([sys.executable, "-c", "import sigil_push; print(sigil_push.__file__)"],
                           env=tree_env(tree), capture_output=True, text=True, check=True,
                           cwd=tempfile.gettempdir()).stdout.strip()
    if not Path(found).resolve().is_relative_to(tree.path.resolve()):
        raise SystemExit(f"{tree.name}: serve would import {found}, not the tree at {tree.path}")


# the service ------------------------------------------------------------------------------


PROFILED = """
import cProfile, runpy, sys, time
path, sys.argv = sys.argv[1], ["sigil_push", *sys.argv[3:]]
profile = cProfile.Profile(time.thread_time)
profile.enable()
try:
    runpy.run_module("sigil_push", run_name="__main__", alter_sys=True)
finally:
    profile.disable()
    profile.dump_stats(path)
"""
"""`python -m sigil_push` under cProfile timed by the event loop thread's own CPU clock: the
default wall clock charged whatever ran when the kernel took the core away (most of the time on
a loaded machine) to the function that happened to run."""


class Service(ServiceProcess):
    """A `serve` of one tree, logging at WARNING (DEBUG lines per event would be most of the
    work at these rates)."""

    tree: Tree
    profile: Path | None = None
    """Run under cProfile, its stats written there at the stop."""

    def start(self, wait: bool = True) -> Service:
        log = open(self.log_path, "ab")  # noqa: SIM115 (the child process keeps it open)
        profiler = ["-c", PROFILED, str(self.profile)] if self.profile else ["-m"]
        self._process = subprocess.Popen(
            [sys.executable, *profiler, "sigil_push", "--log-level", "WARNING", "serve", "--config",
             str(self.config_path)],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env=tree_env(self.tree), cwd=self.folder,
        )
        if wait:
            self.wait_healthy(120)
        return self

    @property
    def pid(self) -> int:
        assert self._process is not None
        return self._process.pid

    def cpu_seconds(self) -> float:
        return api_bench.cpu_seconds(self.pid)

    def thread_cpu(self) -> dict[str, float]:
        """CPU seconds of each live thread, by `name/tid`: `event loop` for the main thread,
        else the kernel's thread name (`python` for every thread Python starts)."""
        found = {}
        for task in Path(f"/proc/{self.pid}/task").iterdir():
            try:
                name = (task / "comm").read_text().strip()
                fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue  # the thread ended
            name = "event loop" if task.name == str(self.pid) else name
            found[f"{name}/{task.name}"] = (int(fields[11]) + int(fields[12])) / os.sysconf(
                "SC_CLK_TCK")
        return found

    def switches(self) -> Counter[str]:
        """Context switches of every live thread: voluntary (it waited: one per wake-up of an
        event loop with nothing to do) and not (the kernel took the core away)."""
        found: Counter[str] = Counter()
        for task in Path(f"/proc/{self.pid}/task").iterdir():
            try:
                text = (task / "status").read_text()
            except OSError:
                continue
            for kind, count in re.findall(r"^(\w+)_ctxt_switches:\s+(\d+)", text, re.MULTILINE):
                found[kind] += int(count)
        return found

    def peak_rss_mb(self) -> float:
        status = Path(f"/proc/{self.pid}/status").read_text()
        found = re.search(r"^VmHWM:\s+(\d+) kB", status, re.MULTILINE)
        return round(int(found.group(1)) / 1024, 1) if found else 0.0

    def metric(self, name: str) -> float:
        """Sum of every sample of `name` (all label sets) at the admin listener."""
        with urllib.request.urlopen(self.admin_url + "/metrics", timeout=60) as response:
            text = response.read().decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith((name + "{", name + " ")))


class Records:
    """Counts of the service's `seen` and `push` observation records, read from its log files
    as they grow (the bench's own CPU: scraping /metrics during the burst cost the service
    14% of its CPU in a trial, and more on the tree with more series)."""

    PATTERN = re.compile(rb'"type": ?"(seen|push)"')

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.counts: Counter[str] = Counter()
        self._offsets: dict[str, int] = {}

    def poll(self) -> Counter[str]:
        for path in sorted(self.folder.glob("observations-*.jsonl*")):
            if path.name in self._offsets and path.name.endswith(".gz"):
                continue
            if path.name.endswith(".gz"):
                # an hour's file compressed as the hour ended: its records were counted from
                # the plain file up to the offset reached there; count the rest
                plain = path.name[: -len(".gz")]
                text = gzip.decompress(path.read_bytes())[self._offsets.get(plain, 0):]
                self._offsets[path.name] = 0
            else:
                with path.open("rb") as file:
                    file.seek(self._offsets.get(path.name, 0))
                    text = file.read()
                text = text[: text.rfind(b"\n") + 1]  # a record still being written waits
                self._offsets[path.name] = self._offsets.get(path.name, 0) + len(text)
            self.counts.update(match.decode() for match in self.PATTERN.findall(text))
        return self.counts


async def register_all(service: Service, users: list[SecretKey]) -> None:
    """Each user's iPhone, through the API with its own NIP-98 token, one keep-alive
    connection."""
    connection = await api_bench.Connection.open(service.port)
    url = f"{service.url}/register"
    try:
        for key in users:
            body = json.dumps({"npub": key.public_key_hex, "platform": "ios",
                               "device_token": secrets.token_hex(32)}).encode()
            head = (f"POST /register HTTP/1.1\r\nHost: 127.0.0.1:{service.port}\r\n"
                    f"Content-Type: application/json\r\n"
                    f"Authorization: {make_http_auth(key, url, 'POST', body)}\r\n"
                    f"Content-Length: {len(body)}\r\n\r\n")
            status = await connection.request(head.encode() + body)
            if status not in (200, 201):
                raise RuntimeError(f"registration answered {status}")
    finally:
        connection.close()


async def wait_for(check: Any, what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not await asyncio.to_thread(check):
        if time.monotonic() > deadline:
            raise TimeoutError(f"not reached within {timeout} s: {what}")
        await asyncio.sleep(POLL_SECONDS)


# profiles ---------------------------------------------------------------------------------


def spy(pid: int, out: Path) -> subprocess.Popen[bytes] | None:
    """py-spy sampling the process's CPU (no idle frames) until stopped with SIGINT."""
    binary = shutil.which("py-spy")
    if binary is None:
        print("py-spy not installed: no profile", flush=True)
        return None
    return subprocess.Popen(
        [binary, "record", "--pid", str(pid), "--format", "raw", "--rate", "250", "--output",
         str(out), "--nonblocking"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def perf_record(pid: int, out: Path) -> subprocess.Popen[bytes] | None:
    """Linux perf sampling the process's CPU (native frames: the event loop's C code, TLS,
    SQLite) until stopped with SIGINT."""
    binary = shutil.which("perf")
    if binary is None:
        print("perf not installed: no native profile", flush=True)
        return None
    return subprocess.Popen(
        [binary, "record", "-F", "499", "-p", str(pid), "-o", str(out)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def spy_summary(paths: list[Path], lines: int = 30) -> dict[str, list[str]]:
    """Own and total shares of samples per function over py-spy's collapsed stacks."""
    own: Counter[str] = Counter()
    total: Counter[str] = Counter()
    samples = 0
    for path in paths:
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            stack, _, count = line.rpartition(" ")
            frames = [re.sub(r" \((.*/)?([^/]+?)(:\d+)?\)$", r" (\2)", f)
                      for f in stack.split(";")]
            n = int(count)
            samples += n
            own[frames[-1]] += n
            for frame in set(frames):
                total[frame] += n
    if not samples:
        return {}
    return {
        "samples": [str(samples)],
        "own": [f"{100 * n / samples:5.1f}% {f}" for f, n in own.most_common(lines)],
        "total": [f"{100 * n / samples:5.1f}% {f}" for f, n in total.most_common(lines * 3)
                  if "sigil_push" in f or ".py" in f][:lines],
    }


# one run ----------------------------------------------------------------------------------


async def run_once(tree: Tree, folder: Path, relay: RoutingRelay, events_file: Path, dms: int,
                   users: list[SecretKey], config: str, limits: str,
                   requests: Callable[[], int] | None,
                   spy_out: Path | None, timeout: float, native: bool,
                   profile: bool, await_answers: bool) -> dict[str, Any]:
    service = Service(folder, [relay.url], config, limits)
    service.tree = tree
    if spy_out is not None and profile:
        service.profile = spy_out.with_suffix(".pstats")
    service.start()
    records = Records(service.observations)
    try:
        await register_all(service, users)
        await wait_for(lambda: service.metric("sigil_push_bridge_watched_keys") >= len(users),
                       "every user watched", 120)
        await wait_for(lambda: asyncio.run(relay.routes()) >= len(users),
                       "every user's REQ at the relay", 120)
        await relay.load(events_file)
        await asyncio.sleep(1.0)  # registrations' follow-up work (list fetches) settles
        seen0, answered0 = records.poll()["seen"], records.counts["push"]
        spying = None
        if spy_out is not None and not profile:
            spying = (perf_record(service.pid, spy_out.with_suffix(".perf")) if native
                      else spy(service.pid, spy_out))
        load0 = os.getloadavg()[0]
        requests0 = requests() if requests is not None else 0
        cpu0, threads0, switches0 = service.cpu_seconds(), service.thread_cpu(), service.switches()
        started = time.monotonic()
        routed = await relay.stream(events_file)
        await wait_for(lambda: records.poll()["seen"] - seen0 >= dms, "every DM seen", timeout)
        seen_cpu, seen_seconds = service.cpu_seconds() - cpu0, time.monotonic() - started
        if await_answers:
            await wait_for(lambda: records.poll()["push"] - answered0 >= dms,
                           "every wakeup answered by APNs", timeout)
        if spying is not None:
            spying.send_signal(signal.SIGINT)
            spying.wait(60)
        answered_cpu = service.cpu_seconds() - cpu0
        pushes = requests() - requests0 if requests is not None else None
        switches = service.switches()
        switches.subtract(switches0)
        threads: Counter[str] = Counter()
        for thread, seconds in service.thread_cpu().items():
            # by name: the thread's share of the run, all threads of one name together
            threads[thread.split("/")[0]] += seconds - threads0.get(thread, 0.0)
        answered_seconds = time.monotonic() - started
        return {
            "tree": tree.name, "commit": tree.commit, "routed_by_relay": routed,
            "cpu_us_per_dm": round(1e6 * seen_cpu / dms, 1),
            "cpu_us_per_dm_to_all_answered": round(1e6 * answered_cpu / dms, 1),
            "events_per_second": round(dms / seen_seconds, 1),
            "seconds_to_all_answered": round(answered_seconds, 2),
            "apns_requests": pushes,
            "wakeups_answered": records.poll()["push"] - answered0,
            "cpu_us_per_dm_to_all_answered_by_thread": {
                name: round(1e6 * seconds / dms, 1) for name, seconds in threads.most_common()},
            "context_switches_per_dm": {kind: round(count / dms, 2)
                                        for kind, count in switches.items()},
            "peak_rss_mb": service.peak_rss_mb(),
            "load_average_before_after": [round(load0, 2), round(os.getloadavg()[0], 2)],
        }
    except TimeoutError:
        print(f"seen, push records: {records.counts}; the service's log ends:\n"
              f"{service.log()[-4000:]}", flush=True)
        raise
    finally:
        service.stop(timeout=60)


def spread(values: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(values), 1), "min": min(values),
            "max": max(values)}


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    folder = Path(tempfile.mkdtemp(prefix="sigil-push-dm-path-"))
    trees = [check_out(name, folder) for name in args.trees.split(",")]
    native: NativeApns | None = None
    fake: subprocess.Popen[str] | None = None
    relay: RoutingRelay | None = None
    try:
        for tree in trees:
            check_imports(tree)
        tls = make_tls(folder)
        apns_key, apns_public = make_apns_key(folder)
        (folder / "apns-public.pem").write_bytes(apns_public)
        if args.apns == "nginx":
            native = NativeApns(folder, tls.cert_file, tls.key_file)
            apns_port = native.port
        else:
            apns_port = api_bench.free_port()
            fake = start_fake(["testkit.fakes.fake_apns", "--cert", str(tls.cert_file), "--key",
                               str(tls.key_file), "--public-key", str(folder / "apns-public.pem"),
                               "--port", str(apns_port)], None, False)
        config = (
            "[bridge]\nreconnect_min_seconds = 0.2\nreconnect_max_seconds = 1.0\n"
            f'[apns]\nteam_id = "{TEAM_ID}"\nkey_id = "{KEY_ID}"\nkey_file = "{apns_key}"\n'
            f'topic = "{TOPIC}"\nenvironment = "sandbox"\n'
            f'endpoint = "https://127.0.0.1:{apns_port}"\nca_file = "{tls.ca_file}"\n'
        )
        # the API unlimited for the registrations; the per-device push limits as configured
        # by default (2 s coalescing window, 30 a minute), unless --no-coalescing: then how
        # many wakeups ride in one push depends on how far delivery lags behind ingest, so
        # the tree that delivers sooner sends more pushes for the same DMs
        limits = "requests_per_minute_per_ip = 0\nrequests_per_minute_per_npub = 0\n"
        if args.no_coalescing:
            limits += "wakeups_per_minute_per_device = 0\ncoalesce_window_ms = 0\n"
        elif args.coalesce_ms is not None:
            limits += f"coalesce_window_ms = {args.coalesce_ms}\n"
        requests = native.answered if native is not None else None
        users = [SecretKey.generate() for _ in range(args.users)]
        events_file = folder / "dms.jsonl"
        write_events(make_events([u.public_key_hex for u in users], args.dms), events_file)
        relay = RoutingRelay(folder)
        runs: list[dict[str, Any]] = []
        spies: list[Path] = []
        for round_ in range(args.rounds):
            order = trees if round_ % 2 == 0 else list(reversed(trees))
            for tree in order:
                spy_out = None
                if args.spy in (tree.name, "all"):
                    spy_out = (args.spy_dir or folder) / f"spy-{round_}-{tree.commit[:10]}.txt"
                    if args.spy == tree.name:
                        spies.append(spy_out)
                run = await run_once(tree, folder / f"run-{round_}-{tree.commit[:10]}", relay,
                                     events_file, args.dms, users, config, limits, requests, spy_out,
                                     args.timeout, args.perf, args.cprofile,
                                     args.coalesce_ms is None or args.coalesce_ms < 60_000)
                run["round"] = round_
                runs.append(run)
                print(json.dumps(run), flush=True)
        per_tree = {}
        for tree in trees:
            mine = [r for r in runs if r["tree"] == tree.name]
            per_tree[tree.name] = {
                "commit": tree.commit,
                "cpu_us_per_dm": spread([r["cpu_us_per_dm"] for r in mine]),
                "cpu_us_per_dm_to_all_answered": spread(
                    [r["cpu_us_per_dm_to_all_answered"] for r in mine]),
                "events_per_second": spread([r["events_per_second"] for r in mine]),
                "peak_rss_mb": spread([r["peak_rss_mb"] for r in mine]),
            }
            if mine[0]["apns_requests"] is not None:
                per_tree[tree.name]["apns_requests"] = spread([r["apns_requests"] for r in mine])
        base = trees[0].name
        ratios = {}
        for tree in trees[1:]:
            for figure in ("cpu_us_per_dm", "cpu_us_per_dm_to_all_answered"):
                pairs = [
                    next(r for r in runs if r["round"] == n and r["tree"] == tree.name)[figure]
                    / next(r for r in runs if r["round"] == n and r["tree"] == base)[figure]
                    for n in range(args.rounds)
                ]
                ratios[f"{tree.name}/{base} {figure}"] = {
                    "per_round": [round(p, 3) for p in pairs],
                    "median": round(statistics.median(pairs), 3)}
        results: dict[str, Any] = {
            "measured_at": datetime.now(UTC).isoformat(timespec="seconds"),
            "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                        "note": "2 cores shared with other engineers' work"},
            "command": " ".join(["python", "bench/dm_path.py", *sys.argv[1:]]),
            "users": args.users, "dms": args.dms, "apns_endpoint": args.apns,
            "per_device_push_limits": "none" if args.no_coalescing else (
                "defaults" if args.coalesce_ms is None
                else f"defaults, coalescing window {args.coalesce_ms} ms"),
            "per_tree": per_tree, "cpu_ratio_to_first_tree": ratios, "runs": runs,
        }
        if spies:
            results["py_spy"] = {"tree": args.spy, **spy_summary(spies)}
        return results
    finally:
        if relay is not None:
            relay.stop()
        if native is not None:
            native.stop()
        if fake is not None:
            fake.terminate()
            fake.wait(10)
        for tree in trees:
            remove(tree)
        shutil.rmtree(folder, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trees", default="43e4a27,main",
                        help="revisions, comma-separated; `.` is this working tree")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--users", type=int, default=500)
    parser.add_argument("--dms", type=int, default=20_000)
    parser.add_argument("--apns", choices=["nginx", "python"], default="nginx")
    parser.add_argument("--timeout", type=float, default=600,
                        help="seconds allowed for every DM to be seen, then answered")
    parser.add_argument("--no-coalescing", action="store_true",
                        help="no per-device push limits (wakeups_per_minute_per_device and "
                        "coalesce_window_ms 0)")
    parser.add_argument("--coalesce-ms", type=int,
                        help="the coalescing window (default: the service's, 2 s); a window "
                        "longer than the burst sends each device one push in it (from 60 s "
                        "on, the answers held to its end are not waited for: the *_answered "
                        "figures end with the last `seen`, a few ms later)")
    parser.add_argument("--spy", default="", help="the tree to record with py-spy (`all`: "
                        "each tree, files kept in --spy-dir, not summarised)")
    parser.add_argument("--spy-dir", type=Path, help="keep py-spy's raw stacks there")
    parser.add_argument("--cprofile", action="store_true",
                        help="run --spy's tree under cProfile instead (the whole run: calls per "
                        "function are exact), its stats kept in --spy-dir")
    parser.add_argument("--perf", action="store_true",
                        help="record --spy's tree with Linux perf instead (native frames), kept "
                        "in --spy-dir")
    parser.add_argument("--output", type=Path, help="the results file (default: by date and "
                        "this tree's commit in bench/results/)")
    args = parser.parse_args()
    results = asyncio.run(main_async(args))
    for name, figures in results["per_tree"].items():
        print(f"{name} ({figures['commit'][:10]}): {figures['cpu_us_per_dm']} us CPU per DM, "
              f"{figures['cpu_us_per_dm_to_all_answered']} to every push answered, "
              f"{figures['events_per_second']} events/s, peak RSS {figures['peak_rss_mb']} MB")
    for name, ratio in results["cpu_ratio_to_first_tree"].items():
        print(f"{name}: {ratio}")
    for line in results.get("py_spy", {}).get("total", []):
        print(line)
    commits = "-vs-".join(t["commit"][:10] for t in results["per_tree"].values())
    limits = ("-nocoalescing" if args.no_coalescing
              else f"-window{args.coalesce_ms}ms" if args.coalesce_ms is not None else "")
    out = args.output or RESULTS / f"dm_path-{datetime.now(UTC):%Y-%m-%d}-{commits}{limits}.json"
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"written to {out}")


if __name__ == "__main__":
    main()
