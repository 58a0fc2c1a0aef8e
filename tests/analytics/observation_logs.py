"""Hand-built observation logs for the analytics tests, written the way the bridge writes them."""

from __future__ import annotations

import gzip
import json
import random
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
    "dropped_events.csv": [
        "relay",
        "expected",
        "seen",
        "missed",
        "miss_rate",
        "inbox_expected",
        "inbox_seen",
        "inbox_missed",
        "inbox_miss_rate",
    ],
    "canary.csv": [
        "relay",
        "probes",
        "published",
        "delivered",
        "delivery_rate",
        "p50_ms",
        "p99_ms",
    ],
    "delivery.csv": [
        "platform",
        "events",
        "accepted",
        "unregistered",
        "rejected",
        "failed",
        "p50_ms",
        "p99_ms",
        "suppressed",
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


def suppressed(ts: int, event_id: str, reason: str, cls: str | None = None) -> dict[str, Any]:
    """A `suppressed` record; without `cls`, as written before issue 32 (no class)."""
    record = {"type": "suppressed", "ts": ts, "event_id": event_id, "reason": reason}
    if cls is not None:
        record["class"] = cls
    return record


def expect(ts: int, event_id: str, relays: list[str]) -> dict[str, Any]:
    return {"type": "expect", "ts": ts, "event_id": event_id, "relays": relays}


def canary(
    ts: int,
    url: str,
    event_id: str,
    published: bool = True,
    received_ms: float | None = None,
    ok_message: str = "",
) -> dict[str, Any]:
    return {
        "type": "canary",
        "ts": ts,
        "relay": url,
        "event_id": event_id,
        "published": published,
        "ok_message": ok_message,
        "received_ms": received_ms,
    }


def network_log(
    log: ObservationLog, relays: int = 200, dms: int = 1500, hours: int = 2, seed: int = 12
) -> list[str]:
    """A log shaped like a real instance's, for end-to-end runs: ``relays`` relays, a DM sent
    to 1-3 inbox relays of its recipient (popular relays more often), a push per DM, a canary
    probe per relay every 5 minutes, a few outages. The eighth relay (``relay007``) loses 60 %
    of what it is sent and of its probes. Deterministic for a seed; returns the relay URLs."""
    rng = random.Random(seed)
    urls = [f"wss://relay{i:03d}.example.net" for i in range(relays)]
    loss = {url: rng.betavariate(0.5, 30) for url in urls}
    loss[urls[7]] = 0.6
    weights = [1 / (i + 1) for i in range(relays)]
    span = hours * HOUR
    records: list[dict[str, Any]] = [relay(T0_MS, url, "connected") for url in urls]
    down: dict[str, tuple[int, int]] = {}
    for url in rng.sample(urls, relays // 20):
        start = T0_MS + rng.randrange(span - 20 * MINUTE)
        down[url] = (start, start + rng.randrange(2 * MINUTE, 20 * MINUTE))
        records += [relay(down[url][0], url, "disconnected"), relay(down[url][1], url, "connected")]

    def up(url: str, ts: int) -> bool:
        return not (url in down and down[url][0] <= ts < down[url][1])

    for n in range(dms):
        event_id = f"{n:064x}"
        sent = T0_MS + rng.randrange(span - MINUTE)
        inbox = list(dict.fromkeys(rng.choices(urls, weights, k=rng.randint(1, 3))))
        arrivals = {
            url: sent + int(rng.lognormvariate(5.0, 1.0))
            for url in inbox
            if rng.random() >= loss[url] and up(url, sent)
        }
        if not arrivals:
            continue
        first = min(arrivals.values())
        kind = 4 if n % 3 == 0 else 1059
        records += [seen(ts, url, event_id, kind=kind) for url, ts in arrivals.items()]
        records.append(expect(first + 3, event_id, [url for url in inbox if up(url, first)]))
        outcome = rng.choices(["accepted", "unregistered", "failed"], [0.95, 0.03, 0.02])[0]
        latency = int(rng.lognormvariate(5.5, 0.5))
        platform = rng.choices(["ios", "android", "unifiedpush"], [0.55, 0.4, 0.05])[0]
        records.append(push(first + latency, event_id, platform, outcome, latency))
    for url in urls:
        for probe, ts in enumerate(range(T0_MS + MINUTE, T0_MS + span, 5 * MINUTE)):
            published = up(url, ts) and rng.random() >= 0.01
            delivered = published and rng.random() >= loss[url]
            received = int(rng.lognormvariate(6.0, 0.6)) if delivered else None
            ok = "" if published else "error: not connected"
            records.append(canary(ts, url, f"c{probe:03d}{url}", published, received, ok))
    records.sort(key=lambda record: record["ts"])
    by_hour: dict[str, list[dict[str, Any] | str]] = {}
    for record in records:
        hour = datetime.fromtimestamp(record["ts"] / 1000, tz=UTC).strftime("%Y%m%dT%H")
        by_hour.setdefault(hour, []).append(record)
    for hour, lines in by_hour.items():
        log.write(hour, lines)
    return urls
