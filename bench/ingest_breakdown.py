"""Where the bridge's CPU per event goes, by thread and by stage: `bench/ingest.py`'s ingest and
copies phases, run in this process with CPU clocks around the stages.

`bench/ingest.py` gives one figure, the bridge process's CPU per unique event. This splits it:
- by thread, exactly: every thread's CPU time (/proc/self/task/*/stat, sampled every 100 ms
  and at the edges of the window) from the first frame sent until the bridge has stopped;
- the event loop thread by stage, with `time.thread_time` (the thread's own CPU, so the load of
  the shared machine does not count) around each step of a task (a coroutine's `send`, so time
  the task spends suspended counts for nothing) and around the synchronous per-frame calls:
  `verify` (`Event.verify`), `frame handling` (`RelayConnection._dispatch`: ingest's parse,
  dedupe, route, queue, with verification taken out), `reader task, rest` (the reader task
  less those: aiohttp's `receive`, the budgets and back-pressure checks), `committer task`
  (with its `store calls` apart: the aiosqlite hand-offs and the row building of
  `_write`), `catch-up ledger flush`, `observation log task`, and `event loop, rest` (the
  thread's CPU outside those tasks: uvloop's socket reads and aiohttp's frame parser in the
  protocol callbacks, timers, the benchmark's own polling).
Each clock read costs CPU too (about a microsecond here): it is measured first, and each
stage's figure is given with the cost of its own clock reads taken out (`clock_us_per_event`
says how much was taken out in all).

The stages are wrapped here, never in the bridge: this is a measuring copy of the benchmark,
its totals are a little above `bench/ingest.py`'s for the clocks' cost, so it is for the split,
and `bench/ingest.py` for the figure.

Usage: python bench/ingest_breakdown.py [--events 30000] [--phases ingest,copies] [--repeat 1]
Prints the split per phase and writes it under "breakdown" in bench/results/ingest.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Coroutine, Generator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import ingest as ingest_bench  # bench/ingest.py: the relay, events, harness and phase

TICKS = os.sysconf("SC_CLK_TCK")
clock = time.thread_time
spent: dict[str, float] = defaultdict(float)
reads: dict[str, int] = defaultdict(int)


def clock_cost() -> float:
    """Seconds one `thread_time` read costs, best of a few rounds."""
    best = 1.0
    for _ in range(5):
        started = clock()
        for _ in range(20_000):
            clock()
        best = min(best, (clock() - started) / 20_000)
    return best


class Timed:
    """Awaitable that drives a coroutine, charging each step's CPU to `stage` (the task's
    suspended time is not in any step)."""

    def __init__(self, coroutine: Coroutine[Any, Any, Any], stage: str) -> None:
        self._coroutine = coroutine
        self._stage = stage

    def __await__(self) -> Generator[Any, Any, Any]:
        coroutine, stage = self._coroutine, self._stage
        sent: Any = None
        thrown: BaseException | None = None
        while True:
            started = clock()
            try:
                step = coroutine.throw(thrown) if thrown is not None else coroutine.send(sent)
            except StopIteration as done:
                spent[stage] += clock() - started
                reads[stage] += 2
                return done.value
            spent[stage] += clock() - started
            reads[stage] += 2
            try:
                sent, thrown = (yield step), None
            except BaseException as error:  # noqa: BLE001 - handed on to the coroutine
                sent, thrown = None, error


def time_async(owner: Any, name: str, stage: str) -> None:
    original = getattr(owner, name)

    async def timed(*args: Any, **kwargs: Any) -> Any:
        return await Timed(original(*args, **kwargs), stage)

    setattr(owner, name, timed)


def time_sync(owner: Any, name: str, stage: str) -> None:
    original: Callable[..., Any] = getattr(owner, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        started = clock()
        try:
            return original(*args, **kwargs)
        finally:
            spent[stage] += clock() - started
            reads[stage] += 2

    setattr(owner, name, timed)


class ThreadClock:
    """Every thread's CPU seconds, the latest reading kept for threads that ended meanwhile."""

    def __init__(self) -> None:
        self.latest: dict[int, tuple[str, float]] = {}
        self._stop = threading.Event()

    def sample(self) -> dict[int, tuple[str, float]]:
        names = {t.native_id: t.name for t in threading.enumerate()}
        for entry in os.listdir("/proc/self/task"):
            tid = int(entry)
            try:
                with open(f"/proc/self/task/{tid}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            name = names.get(tid) or self.latest.get(tid, (f"thread {tid}", 0.0))[0]
            self.latest[tid] = (name, (int(fields[11]) + int(fields[12])) / TICKS)
        return dict(self.latest)

    def run(self) -> None:
        while not self._stop.wait(0.1):
            self.sample()

    def stop(self) -> None:
        self._stop.set()


def thread_kind(name: str) -> str:
    if name == "MainThread":
        return "event loop"
    if "_connection_worker_thread" in name:
        return "sqlite (aiosqlite threads)"
    if name == "breakdown clock":
        return "this script's /proc sampler"
    if name.startswith(("uvloop", "asyncio")):
        return "executor (observation log writes)"
    return "other"


def run_phase(phase: str, events: int) -> dict[str, Any]:
    from sigil_push.bridge.catchup_ledger import CatchupLedger
    from sigil_push.bridge.committer import Committer
    from sigil_push.nostr.event import Event
    from sigil_push.observations import ObservationLog
    from sigil_push.relays.connection import RelayConnection

    cost = clock_cost()
    time_sync(Event, "verify", "verify")
    time_sync(RelayConnection, "_dispatch", "frame handling")
    time_async(RelayConnection, "_read", "reader task")
    time_async(Committer, "run", "committer task")
    time_async(Committer, "_write", "committer store calls")
    time_async(CatchupLedger, "flush", "catch-up ledger flush")
    time_async(ObservationLog, "_run", "observation log task")
    threads = ThreadClock()
    window: dict[str, Any] = {}
    stream, stop = ingest_bench.TinyRelay.stream, ingest_bench.Harness.stop

    async def timed_stream(self: Any, *args: Any) -> None:
        spent.clear()
        reads.clear()
        window["threads"], window["main"] = threads.sample(), clock()
        await stream(self, *args)

    async def timed_stop(self: Any) -> None:
        await stop(self)
        window["main_end"], window["threads_end"] = clock(), threads.sample()
        window["spent"], window["reads"] = dict(spent), dict(reads)

    ingest_bench.TinyRelay.stream = timed_stream  # type: ignore[method-assign]
    ingest_bench.Harness.stop = timed_stop  # type: ignore[method-assign]
    sampler = threading.Thread(target=threads.run, name="breakdown clock", daemon=True)
    sampler.start()
    import uvloop

    ingest_bench.tune_gc()
    with tempfile.TemporaryDirectory() as folder:
        result = uvloop.run(
            ingest_bench.phase_ingest(Path(folder), events, copies=4 if phase == "copies" else 1)
        )
    threads.stop()

    def per_event(seconds: float) -> float:
        return round(seconds / events * 1e6, 1)

    by_thread: dict[str, float] = defaultdict(float)
    for tid, (name, cpu) in window["threads_end"].items():
        by_thread[thread_kind(name)] += cpu - window["threads"].get(tid, (name, 0.0))[1]
    stages = window["spent"]
    # each stage without its own clock reads; nested stages' reads are inside their parents'
    own = {stage: seconds - window["reads"][stage] * cost for stage, seconds in stages.items()}
    nested_reads = {
        "frame handling": window["reads"].get("verify", 0),
        "reader task": window["reads"].get("frame handling", 0) + window["reads"].get("verify", 0),
        "committer task": window["reads"].get("committer store calls", 0),
    }
    for stage, count in nested_reads.items():
        if stage in own:
            own[stage] -= count * cost
    main = window["main_end"] - window["main"]
    all_reads = sum(window["reads"].values())
    loop = {
        "verify": own.get("verify", 0.0),
        "frame handling (parse, dedupe, route, queue)":
            own.get("frame handling", 0.0) - own.get("verify", 0.0),
        "reader task, rest (aiohttp receive, budgets, back-pressure)":
            own.get("reader task", 0.0) - own.get("frame handling", 0.0),
        "committer task, rest (decide, targets, records, listeners)":
            own.get("committer task", 0.0) - own.get("committer store calls", 0.0),
        "committer store calls (row building, aiosqlite hand-offs)":
            own.get("committer store calls", 0.0),
        "catch-up ledger flush (rows packed, hand-off)": own.get("catch-up ledger flush", 0.0),
        "observation log task": own.get("observation log task", 0.0),
    }
    loop["event loop, rest (uvloop, aiohttp protocol, timers, bench polling)"] = (
        main - all_reads * cost - sum(loop.values())
    )
    return {
        "phase": phase,
        "events": events,
        "copies": result["copies"],
        "cpu_ratio": result["cpu_ratio"],
        "bridge_cpu_us_per_unique_event": result["bridge_cpu_us_per_unique_event"],
        "bare_verify_cpu_us_per_event": result["bare_verify_cpu_us_per_event"],
        "load_1min": result["load_1min"],
        "clock_us_per_event": per_event(all_reads * cost),
        "threads_us_per_unique_event": {k: per_event(v) for k, v in sorted(by_thread.items())},
        "event_loop_stages_us_per_unique_event": {k: per_event(v) for k, v in loop.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=30000)
    parser.add_argument("--phases", default="ingest,copies")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--phase", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase:
        print(json.dumps(run_phase(args.phase, args.events)))
        return
    runs: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for _ in range(args.repeat):
        for phase in args.phases.split(","):
            output = subprocess.run(
                [sys.executable, __file__, "--phase", phase, "--events", str(args.events)],
                check=True, capture_output=True, text=True,
            ).stdout
            runs[phase].append(json.loads(output.strip().splitlines()[-1]))
            print(json.dumps(runs[phase][-1], indent=1), flush=True)
    results = json.loads(ingest_bench.RESULTS.read_text()) if ingest_bench.RESULTS.exists() else {}
    results["breakdown"] = {
        "note": "bench/ingest_breakdown.py: CPU per unique event by thread (exact) and the event "
        "loop thread by stage (thread_time around task steps and per-frame calls, the clocks' "
        "own cost taken out); shared 2-core machine, see load_1min",
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **{phase: made for phase, made in runs.items()},
    }
    ingest_bench.RESULTS.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
