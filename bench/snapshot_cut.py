"""CPU per new item of saving a firehose relay's NIP-77 snapshot in steady state.

The catch-up ledger saves a relay's snapshot once the items noted since the last save pass a
sixteenth of it (bridge/catchup_ledger.py). This drives its save step (`_cut`: sort the new
items, encode what is new, seal the parts) directly, off any event loop or store, on a run of
`--items` items, then `--saves` saves of a sixteenth of that each, every save `--interval`
seconds of created_at later, the window sixteen intervals (so the run stays about as large), the new items dated up to `--jitter` seconds before their save (a live
firehose: a few seconds; a relay dumping old events: more than the interval). Printed and
written to bench/results/snapshot_cut-<date>-<commit>.json: CPU µs per new item, the items
the saves' parts hold per new item (what the store writes: 1 when nothing is written twice),
how many saves rewrote the whole snapshot, and the parts and late items left. With a save
interval shorter than the jitter (`--interval 5`: a busy firehose saves every few seconds),
each save's items sort among the last save's.

Usage: python bench/snapshot_cut.py [--items 200000] [--saves 40] [--jitter 0,30,600]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sigil_push.bridge.catchup_ledger import RECUT_FRACTION, RECUT_MIN_ITEMS, _cut
from sigil_push.nostr.nip77_snapshot import SnapshotPart


def run(items: int, saves: int, jitter: int, interval: int) -> dict[str, Any]:
    rng = random.Random(jitter)
    now = 1_800_000_000

    def batch(count: int, at: int) -> dict[str, int]:
        return {os.urandom(32).hex(): at - rng.randrange(jitter + 1) for _ in range(count)}

    cut = _cut(None, [], {}, 0, [batch(items, now)], 0, now, frozenset())
    cpu = 0.0
    noted = rewrites = written = 0
    for _ in range(saves):
        now += interval
        new = batch(max(RECUT_MIN_ITEMS, items // RECUT_FRACTION), now)
        before = time.process_time()
        cut = _cut(cut.base, cut.run_parts, cut.late, cut.next_part, [new],
                   now - RECUT_FRACTION * interval, now, frozenset())
        cpu += time.process_time() - before
        noted += len(new)
        rewrites += cut.replace
        written += sum(SnapshotPart(data).count for _, _, data in cut.parts)
    return {"items": items, "saves": saves, "jitter_s": jitter, "interval_s": interval,
            "cpu_us_per_new_item": round(cpu / noted * 1e6, 2),
            "items_written_per_new_item": round(written / noted, 2), "whole_rewrites": rewrites,
            "run_items_after": len(cut.base), "run_parts_after": len(cut.run_parts),
            "late_items_after": len(cut.late)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=200_000)
    parser.add_argument("--saves", type=int, default=40)
    parser.add_argument("--interval", type=int, default=60)
    parser.add_argument("--jitter", default="0,30,600")
    args = parser.parse_args()
    runs = []
    for jitter in (int(j) for j in args.jitter.split(",")):
        runs.append(run(args.items, args.saves, jitter, args.interval))
        print(json.dumps(runs[-1]), flush=True)
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short=10", "HEAD"],
                            check=False, capture_output=True, text=True).stdout.strip()
    out = ROOT / "bench" / "results" / (
        f"snapshot_cut-{time.strftime('%Y-%m-%d', time.gmtime())}-{commit}"
        f"{'' if args.interval == 60 else f'-interval{args.interval}'}.json")
    out.write_text(json.dumps({
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "commit": commit,
        "command": " ".join(["python", "bench/snapshot_cut.py", *sys.argv[1:]]),
        "load_1min": round(os.getloadavg()[0], 2), "runs": runs,
    }, indent=2) + "\n")
    print(f"written to {out}")


if __name__ == "__main__":
    main()
