"""Hand-built observation logs for the analytics tests, written the way the bridge writes them."""

from __future__ import annotations

import gzip
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

T0 = datetime(2026, 11, 21, 10, tzinfo=UTC)
T0_MS = int(T0.timestamp() * 1000)
SECOND = 1000
MINUTE = 60 * SECOND
HOUR = 60 * MINUTE

# The output columns CONTRACT.md section 6 fixes, written out here rather than imported from
# the jobs, so a change in the code cannot silently change what the tests expect.
CONTRACT_COLUMNS = {
    "relay_latency.csv": ["relay", "events", "lag_p50_ms", "lag_p90_ms", "lag_p99_ms"],
    "dropped_events.csv": ["relay", "expected", "seen", "missed", "miss_rate"],
    "delivery.csv": [
        "platform",
        "events",
        "accepted",
        "unregistered",
        "rejected",
        "failed",
        "p50_ms",
        "p99_ms",
    ],
}


class ObservationLog:
    """Writes records the way the bridge does: one JSON object per line, a file per UTC hour."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)

    def write(self, hour: str, lines: list[dict[str, Any] | str], compress: bool = False) -> Path:
        """Append ``lines`` (records, or raw text for corrupt lines) to the file of ``hour``.

        ``hour`` is the file name's ``YYYYMMDDTHH``.
        """
        text = "".join(
            (line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines
        )
        if compress:
            path = self.directory / f"observations-{hour}.jsonl.gz"
            path.write_bytes(gzip.compress(text.encode()))
        else:
            path = self.directory / f"observations-{hour}.jsonl"
            with path.open("a") as handle:
                handle.write(text)
        return path

    @property
    def path(self) -> str:
        return str(self.directory)


def seen(
    ts: int, relay: str, event_id: str, kind: int = 1059, created_at: int | None = None
) -> dict[str, Any]:
    return {
        "type": "seen",
        "ts": ts,
        "relay": relay,
        "event_id": event_id,
        "kind": kind,
        "created_at": ts // 1000 if created_at is None else created_at,
    }


def relay(ts: int, url: str, state: str) -> dict[str, Any]:
    return {"type": "relay", "ts": ts, "relay": url, "state": state, "detail": ""}


def push(
    ts: int, event_id: str, platform: str, status: str, latency_ms: int | None
) -> dict[str, Any]:
    record: dict[str, Any] = {
        "type": "push",
        "ts": ts,
        "event_id": event_id,
        "platform": platform,
        "status": status,
    }
    if latency_ms is not None:
        record["latency_ms"] = latency_ms
    return record
