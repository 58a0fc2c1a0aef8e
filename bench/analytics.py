"""Benchmark of the analytics jobs on synthetic observation logs of 1M and 10M records.

Generates logs shaped like a busy instance's (hundreds of relays, a few big ones delivering
most events, long-tailed lags, outages, a push funnel, an ``expect`` record per DM naming the
inbox relays it was sent to, a canary probe per relay every 5 minutes), runs ``run_all`` on
``local[2]`` over each, and writes ``bench/results/analytics.json``. With ``--standalone`` the
largest size also runs as ``sigil-push analytics --master spark://...`` on a standalone
cluster (a master and a 2-core worker started from the PySpark distribution on 127.0.0.1).
Targets (issues 5 and 12): 10M records in under 3 minutes on a 2-core machine, and 10x the
data in at most 12x the time.

    python bench/analytics.py [--sizes 1000000 10000000] [--standalone] [--workdir DIR] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

# The script sits in bench/ beside nothing importable; the repository root holds `analytics`.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from analytics.run import run_all
from analytics.session import analytics_session

HOUR_MS = 3_600_000
START = datetime(2026, 11, 20, tzinfo=UTC)
START_MS = int(START.timestamp() * 1000)
SPAN_HOURS = 24
RELAYS = 300
MASTER = "local[2]"
RESULTS = Path(__file__).resolve().parent / "results" / "analytics.json"
# Above the day's 86 400 canary records, so the warm-up also has DMs to join.
WARM_UP_RECORDS = 150_000
TARGET_RECORDS = 10_000_000
TARGET_SECONDS = 180.0
TARGET_TIME_RATIO = 12.0

# Shape of the synthetic traffic.
# So that seen + expect + push + relay + canary records come close to the target.
EVENTS_PER_RECORD = 0.238
CANARY_INTERVAL_MS = 5 * 60_000
CANARY_REFUSED = 0.02  # probes a relay does not accept (paid relays, rate limits)
MEAN_EXTRA_RELAYS = 2.0  # an event reaches 1 + Poisson(2) relays
PUSHED_FRACTION = 0.45
PLATFORMS = (("ios", 0.55), ("android", 0.40), ("unifiedpush", 0.05))
STATUSES = (
    ("accepted", 0.90),
    ("unregistered", 0.04),
    ("rejected", 0.01),
    ("failed", 0.02),
    ("retry", 0.03),
)


@dataclass
class Columns:
    """One record type's columns as numpy arrays (strings as Python lists for formatting)."""

    ts: np.ndarray
    lines: list[str]


def _relay_urls() -> list[str]:
    return [f"wss://relay{r:03d}.example.net" for r in range(RELAYS)]


def _event_ids(rng: np.random.Generator, count: int) -> list[str]:
    blob = rng.bytes(32 * count).hex()
    return [blob[i : i + 64] for i in range(0, 64 * count, 64)]


def _outages(rng: np.random.Generator, span_ms: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(relay, start, end) of outages: about 1.5 per relay, 15 minutes on average."""
    per_relay = rng.poisson(1.5, RELAYS)
    relay = np.repeat(np.arange(RELAYS), per_relay)
    start = START_MS + rng.integers(0, span_ms, relay.size)
    end = np.minimum(
        start + rng.exponential(15 * 60_000, relay.size).astype(np.int64) + 1000, START_MS + span_ms
    )
    return relay, start, end


def _seen(
    rng: np.random.Generator, events: int, ids: list[str], span_ms: int
) -> tuple[Columns, np.ndarray, Columns, Columns, Columns]:
    """Deliveries of every event, the relay state records of the outages they avoid, the
    ``expect`` record of every delivered event (the relays it was sent to that were up) and
    the canary probes."""
    urls = _relay_urls()
    popularity = 1.0 / np.arange(1, RELAYS + 1) ** 1.1
    popularity /= popularity.sum()
    slowness = rng.lognormal(0.0, 0.8, RELAYS)
    missing = rng.beta(0.5, 20.0, RELAYS)

    published = START_MS + rng.integers(0, span_ms, events)
    reach = 1 + rng.poisson(MEAN_EXTRA_RELAYS, events)
    event = np.repeat(np.arange(events), reach)
    relay = rng.choice(RELAYS, size=event.size, p=popularity)
    event, relay = np.divmod(np.unique(event * RELAYS + relay), RELAYS)

    lag = rng.lognormal(np.log(150.0), 1.2, event.size) * slowness[relay]
    late = rng.random(event.size) < 0.01
    lag[late] += rng.exponential(5 * 60_000, late.sum())
    arrival = published[event] + lag.astype(np.int64)

    out_relay, out_start, out_end = _outages(rng, span_ms)
    up = np.ones(event.size, dtype=bool)
    for r, s, e in zip(out_relay, out_start, out_end, strict=True):
        up &= ~((relay == r) & (arrival >= s) & (arrival < e))
    in_span = arrival < START_MS + span_ms
    keep = (rng.random(event.size) >= missing[relay]) & in_span & up
    # The bridge expects a DM from each inbox relay (every relay it was sent to) that was up.
    inbox_event, inbox_relay = event[up & in_span], relay[up & in_span]
    event, relay, arrival = event[keep], relay[keep], arrival[keep]

    kind = np.where(rng.random(events) < 0.3, 4, 1059)
    created = (
        np.where(
            kind == 4,
            published - rng.integers(0, 2_000, events),
            published - rng.integers(0, 2 * 86_400_000, events),
        )
        // 1000
    )
    kinds, createds = kind[event].tolist(), created[event].tolist()
    lines = [
        f'{{"type":"seen","ts":{ts},"relay":"{urls[r]}","event_id":"{ids[e]}","kind":{k},"created_at":{c}}}'
        for ts, r, e, k, c in zip(
            arrival.tolist(), relay.tolist(), event.tolist(), kinds, createds, strict=True
        )
    ]
    first = np.full(events, np.iinfo(np.int64).max)
    np.minimum.at(first, event, arrival)

    # An outage that lasts past the end of the log has no reconnection in it.
    back = out_end < START_MS + span_ms
    state_ts = np.concatenate([np.full(RELAYS, START_MS), out_start, out_end[back]])
    state_relay = np.concatenate([np.arange(RELAYS), out_relay, out_relay[back]])
    down = np.where(rng.random(out_relay.size) < 0.3, "error", "disconnected")
    states = ["connected"] * RELAYS + down.tolist() + ["connected"] * int(back.sum())
    state_lines = [
        f'{{"type":"relay","ts":{ts},"relay":"{urls[r]}","state":"{s}","detail":""}}'
        for ts, r, s in zip(state_ts.tolist(), state_relay.tolist(), states, strict=True)
    ]
    expects = _expects(rng, first, inbox_event, inbox_relay, ids)
    probes = _canaries(rng, missing, out_relay, out_start, out_end, span_ms)
    return Columns(arrival, lines), first, Columns(state_ts, state_lines), expects, probes


def _expects(
    rng: np.random.Generator,
    first: np.ndarray,
    event: np.ndarray,
    relay: np.ndarray,
    ids: list[str],
) -> Columns:
    """One ``expect`` record per delivered event, written just after its first arrival."""
    urls = _relay_urls()
    delivered = first[event] < np.iinfo(np.int64).max
    event, relay = event[delivered], relay[delivered]
    order = np.argsort(event, kind="stable")
    event, relay = event[order], relay[order]
    starts = np.flatnonzero(np.r_[True, event[1:] != event[:-1]])
    owners = event[starts]
    ts = first[owners] + rng.integers(1, 20, owners.size)
    groups = np.split(relay, starts[1:])
    lines = [
        f'{{"type":"expect","ts":{t},"event_id":"{ids[e]}","relays":['
        + ",".join(f'"{urls[r]}"' for r in group.tolist())
        + "]}"
        for t, e, group in zip(ts.tolist(), owners.tolist(), groups, strict=True)
    ]
    return Columns(ts, lines)


def _canaries(
    rng: np.random.Generator,
    missing: np.ndarray,
    out_relay: np.ndarray,
    out_start: np.ndarray,
    out_end: np.ndarray,
    span_ms: int,
) -> Columns:
    """A probe per relay every 5 minutes; refused while the relay is down, lost like its DMs."""
    urls = _relay_urls()
    times = np.arange(START_MS + 30_000, START_MS + span_ms, CANARY_INTERVAL_MS)
    relay = np.repeat(np.arange(RELAYS), times.size)
    ts = np.tile(times, RELAYS)
    up = np.ones(ts.size, dtype=bool)
    for r, s, e in zip(out_relay, out_start, out_end, strict=True):
        up &= ~((relay == r) & (ts >= s) & (ts < e))
    published = up & (rng.random(ts.size) >= CANARY_REFUSED)
    delivered = published & (rng.random(ts.size) >= missing[relay])
    received = rng.lognormal(np.log(600.0), 0.7, ts.size).astype(np.int64)
    ids = _event_ids(rng, ts.size)
    lines = [
        f'{{"type":"canary","ts":{t},"relay":"{urls[r]}","event_id":"{i}",'
        f'"published":{"true" if p else "false"},'
        f'"ok_message":"{"" if p else "error: could not publish"}",'
        f'"received_ms":{ms if d else "null"}}}'
        for t, r, i, p, d, ms in zip(
            ts.tolist(), relay.tolist(), ids, published.tolist(), delivered.tolist(),
            received.tolist(), strict=True,
        )
    ]
    return Columns(ts, lines)


def _pushes(rng: np.random.Generator, first: np.ndarray, ids: list[str], span_ms: int) -> Columns:
    """Push records of the pushed events; a retry is followed by an acceptance."""
    seen_events = np.flatnonzero(first < np.iinfo(np.int64).max)
    pushed = seen_events[rng.random(seen_events.size) < PUSHED_FRACTION]
    names = [name for name, _ in PLATFORMS]
    platform = rng.choice(len(names), pushed.size, p=[p for _, p in PLATFORMS])
    statuses = [name for name, _ in STATUSES]
    status = rng.choice(len(statuses), pushed.size, p=[p for _, p in STATUSES])
    latency = rng.lognormal(np.log(250.0), 0.6, pushed.size).astype(np.int64) + 1
    retry = statuses.index("retry")
    again = pushed[status == retry]
    again_latency = latency[status == retry] + rng.integers(1_000, 30_000, again.size)
    all_events = np.concatenate([pushed, again])
    all_platforms = np.concatenate([platform, platform[status == retry]])
    all_status = np.concatenate([status, np.full(again.size, statuses.index("accepted"))])
    all_latency = np.concatenate([latency, again_latency])
    ts = first[all_events] + all_latency
    keep = ts < START_MS + span_ms
    lines = [
        f'{{"type":"push","ts":{t},"event_id":"{ids[e]}","platform":"{names[p]}",'
        f'"status":"{statuses[s]}","latency_ms":{lat}}}'
        for t, e, p, s, lat in zip(
            ts[keep].tolist(),
            all_events[keep].tolist(),
            all_platforms[keep].tolist(),
            all_status[keep].tolist(),
            all_latency[keep].tolist(),
            strict=True,
        )
    ]
    return Columns(ts[keep], lines)


def generate(directory: Path, records: int, seed: int = 5) -> int:
    """Write a day of hourly log files with about ``records`` records; return the exact count."""
    rng = np.random.default_rng(seed)
    span_ms = SPAN_HOURS * HOUR_MS
    # The canary's records do not grow with traffic: a probe per relay per interval.
    probe_records = RELAYS * len(range(30_000, span_ms, CANARY_INTERVAL_MS))
    events = max(1, int((records - probe_records) * EVENTS_PER_RECORD))
    ids = _event_ids(rng, events)
    seen, first, states, expects, probes = _seen(rng, events, ids, span_ms)
    pushes = _pushes(rng, first, ids, span_ms)
    ts = np.concatenate([seen.ts, states.ts, pushes.ts, expects.ts, probes.ts])
    lines = seen.lines + states.lines + pushes.lines + expects.lines + probes.lines
    order = np.argsort(ts, kind="stable")
    hours = (ts[order] - START_MS) // HOUR_MS
    directory.mkdir(parents=True, exist_ok=True)
    bounds = np.searchsorted(hours, np.arange(SPAN_HOURS + 1))
    for hour in range(SPAN_HOURS):
        name = datetime.fromtimestamp((START_MS + hour * HOUR_MS) / 1000, tz=UTC).strftime(
            "%Y%m%dT%H"
        )
        chunk = order[bounds[hour] : bounds[hour + 1]]
        with (directory / f"observations-{name}.jsonl").open("w") as handle:
            handle.write("\n".join(lines[i] for i in chunk.tolist()))
            handle.write("\n")
    return len(lines)


def bench_one(workdir: Path, records: int, keep: bool) -> dict[str, float | int]:
    log_dir = workdir / f"log-{records}"
    started = time.monotonic()
    if keep and log_dir.is_dir():
        written = sum(1 for f in log_dir.iterdir() for _ in f.open())
    else:
        shutil.rmtree(log_dir, ignore_errors=True)
        written = generate(log_dir, records)
    generated = time.monotonic() - started
    size = sum(f.stat().st_size for f in log_dir.iterdir())
    print(
        f"bench: {written} records ({size / 1e6:.0f} MB) ready in {generated:.1f} s",
        file=sys.stderr,
    )
    # The machine may be shared: record its load so a slow run can be told from a slow job.
    load_before = os.getloadavg()[0]
    started = time.monotonic()
    summary = run_all(str(log_dir), str(workdir / f"out-{records}"), master=MASTER)
    seconds = time.monotonic() - started
    print(
        f"bench: {written} records analysed in {seconds:.1f} s ({written / seconds:,.0f} records/s)",
        file=sys.stderr,
    )
    return {
        "target_records": records,
        "records": written,
        "corrupt_lines": summary.corrupt_lines,
        "log_bytes": size,
        "generate_seconds": round(generated, 1),
        "seconds": round(seconds, 2),
        "records_per_second": round(written / seconds),
        "load_average_1m_before": round(load_before, 2),
        "load_average_1m_after": round(os.getloadavg()[0], 2),
        **{f"rows_{name}": count for name, count in summary.rows.items()},
    }


def bench_standalone(workdir: Path, records: int) -> dict[str, float | int | str]:
    """The same log through ``sigil-push analytics --master spark://...`` on a standalone
    cluster: a master and a worker offering both cores, started from the PySpark
    distribution. Wall time of the whole command, so it includes the driver's start (compare
    with ``session_start_seconds`` + ``seconds`` of the local run)."""
    from testkit.spark_cluster import StandaloneCluster

    log_dir = workdir / f"log-{records}"
    conf = workdir / "standalone-conf"
    conf.mkdir(exist_ok=True)
    # Sized like the local run: the executor gets what local[2]'s driver gets.
    (conf / "spark-defaults.conf").write_text(
        "spark.executor.memory 4g\nspark.sql.shuffle.partitions 8\nspark.ui.enabled false\n"
    )
    cluster = StandaloneCluster(workdir / "standalone", cores=os.cpu_count() or 2, memory="5g")
    load_before = os.getloadavg()[0]
    with cluster as master:
        env = {**cluster.env(), "SPARK_CONF_DIR": str(conf)}
        env["PYTHONPATH"] = os.pathsep.join(
            [str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")]
        )
        started = time.monotonic()
        subprocess.run(
            [sys.executable, "-m", "sigil_push", "analytics", "--master", master,
             "--input", str(log_dir), "--output", str(workdir / f"out-standalone-{records}")],
            check=True, env=env, timeout=3600,
        )
        seconds = time.monotonic() - started
    print(f"bench: standalone cluster analysed {records} records in {seconds:.1f} s",
          file=sys.stderr)
    return {
        "target_records": records,
        "master": "spark://127.0.0.1 (standalone, 1 worker)",
        "worker_cores": cluster.cores,
        "seconds_including_driver_start": round(seconds, 2),
        "load_average_1m_before": round(load_before, 2),
        "load_average_1m_after": round(os.getloadavg()[0], 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.strip().splitlines()[0] if __doc__ else None
    )
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 10_000_000])
    parser.add_argument(
        "--workdir", type=Path, default=None, help="where logs go (default: a temp dir)"
    )
    parser.add_argument("--keep", action="store_true", help="reuse logs already in --workdir")
    parser.add_argument(
        "--standalone",
        action="store_true",
        help="also run the largest size on a standalone Spark cluster on this machine",
    )
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="sigil-analytics-bench-"))
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    started = time.monotonic()
    with analytics_session(MASTER):
        session_seconds = time.monotonic() - started
        # A small run first, so JIT and class loading do not flatter or burden either size.
        bench_one(workdir, WARM_UP_RECORDS, args.keep)
        runs = [bench_one(workdir, size, args.keep) for size in args.sizes]
    standalone = bench_standalone(workdir, max(args.sizes)) if args.standalone else None
    result: dict[str, object] = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "master": MASTER},
        "session_start_seconds": round(session_seconds, 1),
        "span_hours": SPAN_HOURS,
        "relays": RELAYS,
        "runs": runs,
    }
    if standalone is not None:
        result["standalone"] = standalone
    if len(runs) >= 2:
        small, large = runs[0], runs[-1]
        data_ratio = float(large["records"]) / float(small["records"])
        time_ratio = float(large["seconds"]) / float(small["seconds"])
        result["data_ratio"] = round(data_ratio, 2)
        result["time_ratio"] = round(time_ratio, 2)
        if int(large["records"]) >= TARGET_RECORDS and data_ratio >= 10:
            result["targets"] = {
                "max_seconds_for_10m": TARGET_SECONDS,
                "max_time_ratio_for_10x": TARGET_TIME_RATIO,
                "met": float(large["seconds"]) < TARGET_SECONDS and time_ratio <= TARGET_TIME_RATIO,
            }
        print(f"bench: {data_ratio:.1f}x the data took {time_ratio:.2f}x the time", file=sys.stderr)
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    if args.workdir is None and not args.keep:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
