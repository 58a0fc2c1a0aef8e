"""The observation log: newline-delimited JSON facts about relays and pushes for analytics.

Records are queued in memory and written by a background task, so the bridge's hot path never
waits on the disk. Files rotate every UTC hour and are named `observations-YYYYMMDDTHH.jsonl`,
which sorts by time. A worker of a multi-worker instance (PostgreSQL) puts its worker id in
the name, `observations-<worker>-YYYYMMDDTHH.jsonl`, so workers sharing a folder never write
one file and analytics reads them all together. Callers pass only relay URLs, event ids, kinds
and timings: this module has no parameter through which a pubkey, token or content could reach
the log. A relay URL can name a user (`wss://filter.nostr.wine/npub1…`, inbox services keyed by
hex pubkey), so every relay URL a record carries is written as its `relay_label` (the key
replaced by `<key-XXXXXXXX>`), whoever the caller: the same label the `relay` records and the
logs use, so the records of one relay still join. A relay's own text (a canary's
`ok_message`, a `detail`) may quote a pubkey: any key in it is replaced the same way.

Housekeeping keeps the folder bounded: a finished hour is gzip-compressed to
`observations-YYYYMMDDTHH.jsonl.gz` (which analytics reads as is), hours older than the
retention are deleted, and the folder's size is a gauge. It runs in a worker thread. The writer's
lock is held only while a finished hour is moved aside for compression, so the writer never
waits on gzip and a late record for that hour is never lost: it lands in a fresh `.jsonl` that
the next round merges into the hour's `.gz`. A `.gz` that cannot be read when a late record is
merged into it (cut short, corrupt) is renamed `<name>.damaged` for an operator, counted and
logged, and the hour's `.gz` starts afresh: one damaged file never stops the rounds.

Workers sharing a folder take turns at housekeeping: a round holds an exclusive `flock` on the
folder's `.observations.lock` (a worker that finds it held skips its round; the holder does the
folder's work). Compressing is a read-modify-write of the hour's `.gz` through a moved-aside
`.compressing` file and a `.partial` one, so two rounds at once would finish one staged file
twice (records doubled, or a `.partial` truncated under the other) or rewrite one `.gz` from two
starting points (records lost). Under the lock, a `.compressing` file that a round finds was
left by a round that died with its process (the kernel drops a dead process's lock); it is
finished before anything else is moved aside, so a new `.compressing` never replaces it.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import gzip
import json
import logging
import os
import re
import shutil
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

from prometheus_client import Counter, Gauge

from sigil_push.push.base import Status
from sigil_push.push.registry import PLATFORMS
from sigil_push.supervisor import supervise
from sigil_push.telemetry.redaction import redact_keys, relay_label

log = logging.getLogger(__name__)
_T = TypeVar("_T")

FLUSH_INTERVAL_SECONDS = 0.25
MAX_ENCODED_LISTS = 4096
"""Encoded `expect` relay lists kept (a few per user; cleared when full, just re-encoded)."""
MAX_BUFFERED_RECORDS = 100_000
HOUSEKEEPING_SECONDS = 300.0
HOUR_MS = 3_600_000
DAY_MS = 24 * HOUR_MS
STAGED_SUFFIX = ".compressing"
DAMAGED_SUFFIX = ".damaged"
"""Added to a `.gz` housekeeping could not read: kept for an operator, ignored by analytics
(it reads `.jsonl` and `.jsonl.gz` only) and by the retention."""
COPY_CHUNK_BYTES = 1 << 20
LOCK_NAME = ".observations.lock"
"""Held (flock) by the one housekeeping round running on the folder, whichever process runs it;
a dot-file, so analytics never reads it."""
_ENCODER = json.JSONEncoder(separators=(",", ":"))
"""One encoder for every record: json.dumps with options builds a new one per call."""
_HEX64 = re.compile(r"[0-9a-f]{64}").fullmatch
SeenRecord = tuple[str, str, int, int, int]
"""(relay, event_id, kind, created_at, ts_ms): one relay's delivery of one event."""
PushRecord = tuple[str, str, str, int]
"""(event_id, platform, status, latency_ms): one wakeup's answer from its provider."""
_PLAIN_WORD = re.compile(r"[a-z_]{1,32}").fullmatch
"""A platform or status name: needs no JSON escaping."""
_KNOWN_PLATFORMS = frozenset(PLATFORMS)
_KNOWN_STATUSES = frozenset(status.value for status in Status)
"""Platform and status names known to be plain words (tests hold them to `_PLAIN_WORD`)."""
FILE_NAME = re.compile(r"^observations-(?:([A-Za-z0-9._-]+)-)?(\d{8}T\d{2})\.jsonl(\.gz)?$")
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")

LOG_BYTES = Gauge(
    "sigil_push_observations_bytes", "Size on disk of the observation log folder's hourly files"
)
LOG_FILES = Gauge("sigil_push_observations_files", "Hourly files in the observation log folder")
DAMAGED_FILES = Counter(
    "sigil_push_observations_damaged_files_total",
    "Compressed hours of the observation log found unreadable by housekeeping and moved aside",
)


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def file_name_for(ts_ms: int) -> str:
    hour = datetime.fromtimestamp(ts_ms / 1000, tz=UTC).strftime("%Y%m%dT%H")
    return f"observations-{hour}.jsonl"


def safe_worker(worker_id: str) -> str:
    """A worker id as it may appear in a file name (host names may hold anything)."""
    return _UNSAFE.sub("_", worker_id)


def worker_of(name: str) -> str | None:
    """The worker part of an observation file's name: "" for a single process, None if the
    name is not an observation file."""
    match = FILE_NAME.match(name.removesuffix(STAGED_SUFFIX))
    return None if match is None else match.group(1) or ""


def hour_of(name: str) -> int | None:
    """Start (ms) of the UTC hour an observation file holds, from its name; None if not ours."""
    match = FILE_NAME.match(name)
    if match is None:
        return None
    hour = datetime.strptime(match.group(2), "%Y%m%dT%H").replace(tzinfo=UTC)
    return int(hour.timestamp()) * 1000


@dataclass(frozen=True)
class Tidied:
    """What one housekeeping round did, and the folder's size after it."""

    compressed: int
    deleted: int
    files: int
    size_bytes: int


class ObservationLog:
    def __init__(self, folder: Path, retention_days: int = 30, worker: str = "") -> None:
        """`retention_days` 0 keeps every hour forever (compression still applies). `worker`:
        this worker's id in the file names (empty: one process, the plain names)."""
        self._folder = folder
        self._retention_days = retention_days
        self._buffer: list[dict[str, Any] | tuple[int, str]] = []
        self._relay_json: dict[str, str] = {}
        self._relays_json: dict[tuple[str, ...], str] = {}
        self._tasks: list[asyncio.Task[None]] = []
        # file work started in a thread goes on when the task awaiting it is cancelled: stop()
        # waits for it, so nothing writes or compresses after stop() returns
        self._in_threads: set[asyncio.Future[Any]] = set()
        self._files = threading.Lock()
        # one housekeeping round at a time: two rounds would both finish one staged hour
        self._tidying = threading.Lock()
        self.dropped = 0
        self._worker = safe_worker(worker)

    async def start(self) -> None:
        self._folder.mkdir(parents=True, exist_ok=True)
        # supervised: a round that fails on something other than the disk is logged, counted
        # and retried instead of ending housekeeping for good without a word (a damaged `.gz`
        # is not such a failure: it is moved aside, see `_gzip_staged`)
        self._tasks = [
            supervise("observation-log", self._run),
            supervise("observation-housekeeping", self._housekeeping_loop),
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            try:
                await task
            except asyncio.CancelledError:
                pass
        self._tasks = []
        for work in list(self._in_threads):
            with contextlib.suppress(OSError):
                await work
        await asyncio.to_thread(self._write, self._take())

    async def _in_thread(self, function: Callable[..., _T], *args: Any) -> _T:
        """`function(*args)` in a worker thread, tracked until it ends (see `stop`)."""
        work = asyncio.get_running_loop().run_in_executor(None, function, *args)
        self._in_threads.add(work)
        work.add_done_callback(self._in_threads.discard)
        return await asyncio.shield(work)

    def seen(self, relay: str, event_id: str, kind: int, created_at: int, ts_ms: int) -> None:
        """One relay's delivery of one event (see `seen_many`)."""
        self.seen_many(((relay, event_id, kind, created_at, ts_ms),))

    def seen_many(self, records: Iterable[SeenRecord]) -> None:
        """`seen` records, one per relay per event: by far the commonest record when several
        relays carry every DM, so the bridge hands over a whole commit batch in one call, and
        each is encoded here in one f-string (a hex id and integers need no escaping; a relay's
        JSON is encoded once per relay) rather than as a dict in the writer. A record whose
        fields are not of those types takes the general path, so nothing else is spliced in.
        The relays' records of one event follow each other with the same id object: its
        pattern check (half of a record's cost) is made once for them."""
        relay_json = self._relay_json
        lines: list[dict[str, Any] | tuple[int, str]] = []
        checked: object = None
        for relay, event_id, kind, created_at, ts_ms in records:
            if (event_id is not checked and type(event_id) is str
                    and _HEX64(event_id) is not None):
                checked = event_id
            if not (event_id is checked and type(kind) is int and type(created_at) is int
                    and type(ts_ms) is int):
                lines.append(
                    {"type": "seen", "ts": ts_ms, "relay": relay_label(relay), "event_id": event_id,
                     "kind": kind, "created_at": created_at}
                )
                continue
            encoded = relay_json.get(relay)
            if encoded is None:
                encoded = relay_json[relay] = _ENCODER.encode(relay_label(relay))
            lines.append((ts_ms, (
                f'{{"type":"seen","ts":{ts_ms},"relay":{encoded},"event_id":"{event_id}",'
                f'"kind":{kind},"created_at":{created_at}}}'
            )))
        self._extend(lines)

    def relay_state(self, relay: str, state: str, detail: str = "") -> None:
        self._append(
            {"type": "relay", "ts": now_ms(), "relay": relay_label(relay), "state": state,
             "detail": redact_keys(detail)}
        )

    def push(self, event_id: str, platform: str, status: str, latency_ms: int) -> None:
        """One wakeup's answer (see `push_many`)."""
        self.push_many(((event_id, platform, status, latency_ms),), now_ms())

    def push_many(self, records: Iterable[PushRecord], ts_ms: int) -> None:
        """`push` records of wakeups answered together, all stamped `ts_ms`: delivery hands
        over every answer of a burst in one call, and each is encoded here in one f-string (a
        hex id, a platform or status name and an integer need no escaping) rather than as a
        dict in the writer, which was the larger part of a push's record. A record whose
        fields are not of those forms takes the general path, so nothing else is spliced in.
        The known platforms and statuses (nearly every record) are matched by a set lookup,
        anything else by the pattern."""
        lines: list[dict[str, Any] | tuple[int, str]] = []
        plain_ts = type(ts_ms) is int
        for event_id, platform, status, latency_ms in records:
            if not (plain_ts and type(latency_ms) is int and type(event_id) is str
                    and _HEX64(event_id) is not None
                    and type(platform) is str
                    and (platform in _KNOWN_PLATFORMS or _PLAIN_WORD(platform) is not None)
                    and type(status) is str
                    and (status in _KNOWN_STATUSES or _PLAIN_WORD(status) is not None)):
                lines.append(
                    {"type": "push", "ts": ts_ms, "event_id": event_id, "platform": platform,
                     "status": status, "latency_ms": latency_ms}
                )
                continue
            lines.append((ts_ms, (
                f'{{"type":"push","ts":{ts_ms},"event_id":"{event_id}","platform":"{platform}",'
                f'"status":"{status}","latency_ms":{latency_ms}}}'
            )))
        self._extend(lines)

    def expect(self, ts_ms: int, event_id: str, relays: Sequence[str]) -> None:
        """The recipient's inbox relays that were connected when the bridge handled a DM: one
        per DM, so encoded like `seen`, with the JSON of a relay list kept per list."""
        if not (type(ts_ms) is int and type(event_id) is str and _HEX64(event_id) is not None):
            self._append(
                {"type": "expect", "ts": ts_ms, "event_id": event_id,
                 "relays": [relay_label(relay) for relay in relays]}
            )
            return
        key = tuple(relays)
        encoded = self._relays_json.get(key)
        if encoded is None:
            if len(self._relays_json) >= MAX_ENCODED_LISTS:
                self._relays_json.clear()
            encoded = self._relays_json[key] = _ENCODER.encode([relay_label(r) for r in key])
        self._append((ts_ms, (
            f'{{"type":"expect","ts":{ts_ms},"event_id":"{event_id}","relays":{encoded}}}'
        )))

    def suppressed(self, ts_ms: int, event_id: str, reason: str, cls: str = "dm") -> None:
        """A verified event that woke no device because of its recipients' own choices or
        limits (pause, presence, mute lists, follows-only, quiet hours, crowded, stale, rate
        limits): the id, the reason and the notification class (`dm`, `mention`, ...) only,
        never who."""
        self._append({"type": "suppressed", "ts": ts_ms, "event_id": event_id, "reason": reason,
                      "class": cls})

    def canary(
        self,
        ts_ms: int,
        relay: str,
        event_id: str,
        published: bool,
        ok_message: str,
        received_ms: int | None,
    ) -> None:
        """One canary probe: `ts_ms` when it was published, `received_ms` after that or None."""
        self._append(
            {"type": "canary", "ts": ts_ms, "relay": relay_label(relay), "event_id": event_id,
             "published": published, "ok_message": redact_keys(ok_message), "received_ms": received_ms}
        )

    def _append(self, record: dict[str, Any] | tuple[int, str]) -> None:
        if len(self._buffer) >= MAX_BUFFERED_RECORDS:
            self.dropped += 1
            return
        self._buffer.append(record)

    def _extend(self, records: list[dict[str, Any] | tuple[int, str]]) -> None:
        room = MAX_BUFFERED_RECORDS - len(self._buffer)
        if len(records) > room:
            self.dropped += len(records) - max(0, room)
            records = records[: max(0, room)]
        self._buffer.extend(records)

    def _take(self) -> list[dict[str, Any] | tuple[int, str]]:
        records, self._buffer = self._buffer, []
        return records

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(FLUSH_INTERVAL_SECONDS)
            records = self._take()
            if records:
                try:
                    await self._in_thread(self._write, records)
                except OSError:
                    log.exception("cannot write the observation log; %d records lost", len(records))

    def _write(self, records: list[dict[str, Any] | tuple[int, str]]) -> None:
        # one encoder and one file name per hour for the whole batch: with several relays
        # delivering every event, `seen` records outnumber everything else on the hot path
        encode = _ENCODER.encode
        names: dict[int, list[str]] = {}
        by_file: dict[str, list[str]] = {}
        for record in records:
            if isinstance(record, tuple):
                ts, line = record
            else:
                ts, line = int(record["ts"]), encode(record)
            hour = ts // HOUR_MS
            lines = names.get(hour)
            if lines is None:
                lines = names[hour] = by_file.setdefault(file_name_for(ts), [])
            lines.append(line)
        with self._files:
            for name, lines in by_file.items():
                with open(self._folder / self._own(name), "a", encoding="utf-8") as handle:
                    handle.write("\n".join(lines) + "\n")

    def _own(self, name: str) -> str:
        """An hour's file name as this worker's: `observations-<worker>-YYYYMMDDTHH.jsonl`."""
        if not self._worker:
            return name
        return name.replace("observations-", f"observations-{self._worker}-", 1)

    # housekeeping -----------------------------------------------------------------------

    async def _housekeeping_loop(self) -> None:
        while True:
            try:
                done = await self._in_thread(self.tidy, now_ms())
            except OSError:
                log.exception("observation log housekeeping failed; retrying later")
            else:
                if done.compressed or done.deleted:
                    log.info(
                        "observation log: %d hours compressed, %d deleted, %d bytes in %d files",
                        done.compressed, done.deleted, done.size_bytes, done.files,
                    )
            await asyncio.sleep(HOUSEKEEPING_SECONDS)

    def tidy(self, at_ms: int) -> Tidied:
        """Compress every finished hour, delete hours past retention, measure the folder.

        An hour is past retention when it ended more than `retention_days` before `at_ms`.
        In a folder that several workers share, another worker's file is compressed only an
        hour after its hour ended (that worker may still be appending its last records), and
        the files of workers gone long ago are compressed and deleted like our own. While
        another process's round holds the folder's lock, this round only measures the folder.
        Blocking file work: call it in a worker thread.
        """
        with self._tidying, _folder_turn(self._folder) as ours:
            compressed, deleted = self._tidy(at_ms) if ours else (0, 0)
        return self._measure(compressed, deleted)

    def _tidy(self, at_ms: int) -> tuple[int, int]:
        """One round's work (the folder's lock held): how many hours it compressed and deleted."""
        current_hour = at_ms - at_ms % HOUR_MS
        cutoff = at_ms - self._retention_days * DAY_MS if self._retention_days else None
        compressed = deleted = 0
        paths = sorted(self._folder.iterdir())
        for path in paths:
            if path.name.endswith(STAGED_SUFFIX):
                staged_hour = hour_of(path.name.removesuffix(STAGED_SUFFIX))
                if staged_hour is not None and staged_hour < self._finished_before(
                    path, current_hour
                ):
                    self._gzip_staged(path)  # left by a round that died mid-compression
        for path in paths:
            hour = hour_of(path.name)
            if hour is None:
                continue
            if cutoff is not None and hour + HOUR_MS <= cutoff:
                path.unlink(missing_ok=True)
                deleted += 1
            elif path.suffix == ".jsonl" and hour < self._finished_before(path, current_hour):
                self._compress(path)
                compressed += 1
        return compressed, deleted

    def _measure(self, compressed: int, deleted: int) -> Tidied:
        files = size = 0
        for path in self._folder.iterdir():
            if hour_of(path.name) is not None:
                # another worker's round (which may run meanwhile) can move a file away
                with contextlib.suppress(FileNotFoundError):
                    size += path.stat().st_size
                    files += 1
        LOG_BYTES.set(size)
        LOG_FILES.set(files)
        return Tidied(compressed, deleted, files, size)

    def _finished_before(self, path: Path, current_hour: int) -> int:
        """Hours before this are finished for `path`'s writer: ours at once, others' an hour
        later."""
        return current_hour if worker_of(path.name) == self._worker else current_hour - HOUR_MS

    def _compress(self, path: Path) -> None:
        """`x.jsonl` → `x.jsonl.gz`. The writer's lock is held only to move the file aside, so
        a large hour never stalls the log; a late record then starts a new `x.jsonl`."""
        staged = path.with_name(path.name + STAGED_SUFFIX)
        with self._files:
            try:
                os.replace(path, staged)
            except FileNotFoundError:  # another worker sharing the folder took it first
                return
        self._gzip_staged(staged)

    @staticmethod
    def _gzip_staged(staged: Path) -> None:
        """Append a staged hour to that hour's `.gz` (rewritten under a temporary name and
        renamed, so a reader sees the old or the new file, never half of one).

        A `.gz` that cannot be read to its end (cut short by a copy or a disk fault, or
        corrupt) would fail this, and with it every later round, until an operator moved it:
        it is moved aside instead (`DAMAGED_SUFFIX`, a name neither analytics nor the retention
        reads), counted and logged, and the staged records start the hour's `.gz` afresh."""
        target = staged.with_name(staged.name.removesuffix(STAGED_SUFFIX) + ".gz")
        partial = target.with_name(target.name + ".partial")
        damage = _gzip_into(partial, target if target.exists() else None, staged)
        if damage is not None:
            aside = _set_aside(target)
            DAMAGED_FILES.inc()
            # the error's type only: a BadGzipFile message quotes the file's first bytes
            log.warning("observation log: %s is damaged (%s.%s), moved aside as %s",
                        target.name, type(damage).__module__, type(damage).__name__, aside.name)
            _gzip_into(partial, None, staged)
        os.replace(partial, target)
        staged.unlink()


def _gzip_into(partial: Path, earlier: Path | None, staged: Path) -> Exception | None:
    """Write `earlier`'s records (a `.gz`), then `staged`'s, to the `.gz` `partial`. Returns
    what made `earlier` unreadable, if it was (`partial` is then unfinished); errors writing
    `partial` or reading `staged` are the disk's and raise."""
    with gzip.open(partial, "wb") as out:
        if earlier is not None:
            with gzip.open(earlier, "rb") as source:
                while True:
                    try:
                        chunk = source.read(COPY_CHUNK_BYTES)
                    except (EOFError, gzip.BadGzipFile, zlib.error) as damage:
                        return damage
                    if not chunk:
                        break
                    out.write(chunk)
        with open(staged, "rb") as source:
            shutil.copyfileobj(source, out)
    return None


def _set_aside(path: Path) -> Path:
    """Rename `path` to `<name>.damaged` (`.damaged.2`, ... if taken); returns the new path."""
    aside = path.with_name(path.name + DAMAGED_SUFFIX)
    tries = 1
    while aside.exists():
        tries += 1
        aside = path.with_name(f"{path.name}{DAMAGED_SUFFIX}.{tries}")
    os.replace(path, aside)
    return aside


@contextlib.contextmanager
def _folder_turn(folder: Path) -> Iterator[bool]:
    """Whether this round may tidy `folder`: True while it holds the folder's lock, False when
    another process's round holds it. Closing the file releases the lock, and so does the
    holder's death. On NFS, Linux turns `flock` into a lock the server enforces."""
    fd = os.open(folder / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)
