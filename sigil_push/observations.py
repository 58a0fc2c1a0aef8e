"""The observation log: newline-delimited JSON facts about relays and pushes for analytics.

Records are queued in memory and written by a background task, so the bridge's hot path never
waits on the disk. Files rotate every UTC hour and are named `observations-YYYYMMDDTHH.jsonl`,
which sorts by time. Callers pass only relay URLs, event ids, kinds and timings: this module has
no parameter through which a pubkey, token or content could reach the log.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

FLUSH_INTERVAL_SECONDS = 0.25
MAX_BUFFERED_RECORDS = 100_000


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def file_name_for(ts_ms: int) -> str:
    hour = datetime.fromtimestamp(ts_ms / 1000, tz=UTC).strftime("%Y%m%dT%H")
    return f"observations-{hour}.jsonl"


class ObservationLog:
    def __init__(self, folder: Path) -> None:
        self._folder = folder
        self._buffer: list[dict[str, Any]] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.dropped = 0

    async def start(self) -> None:
        self._folder.mkdir(parents=True, exist_ok=True)
        self._task = asyncio.create_task(self._run(), name="observation-log")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        await asyncio.to_thread(self._write, self._take())

    def seen(self, relay: str, event_id: str, kind: int, created_at: int, ts_ms: int) -> None:
        self._append(
            {"type": "seen", "ts": ts_ms, "relay": relay, "event_id": event_id, "kind": kind,
             "created_at": created_at}
        )

    def relay_state(self, relay: str, state: str, detail: str = "") -> None:
        self._append(
            {"type": "relay", "ts": now_ms(), "relay": relay, "state": state, "detail": detail}
        )

    def push(self, event_id: str, platform: str, status: str, latency_ms: int) -> None:
        self._append(
            {"type": "push", "ts": now_ms(), "event_id": event_id, "platform": platform,
             "status": status, "latency_ms": latency_ms}
        )

    def _append(self, record: dict[str, Any]) -> None:
        if len(self._buffer) >= MAX_BUFFERED_RECORDS:
            self.dropped += 1
            return
        self._buffer.append(record)

    def _take(self) -> list[dict[str, Any]]:
        records, self._buffer = self._buffer, []
        return records

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(FLUSH_INTERVAL_SECONDS)
            records = self._take()
            if records:
                try:
                    await asyncio.to_thread(self._write, records)
                except OSError:
                    log.exception("cannot write the observation log; %d records lost", len(records))

    def _write(self, records: list[dict[str, Any]]) -> None:
        by_file: dict[str, list[str]] = {}
        for record in records:
            by_file.setdefault(file_name_for(record["ts"]), []).append(
                json.dumps(record, separators=(",", ":"))
            )
        for name, lines in by_file.items():
            with open(self._folder / name, "a", encoding="utf-8") as handle:
                handle.write("\n".join(lines) + "\n")
