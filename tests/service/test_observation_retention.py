"""Observation log housekeeping on real files: finished hours are gzip-compressed under the name
analytics reads (`observations-YYYYMMDDTHH.jsonl.gz`), hours past the retention are deleted,
a late record for a compressed hour is merged in, and the folder's size is on /metrics.
Workers sharing a folder take turns (`.observations.lock`): real processes, one held in the
middle of finishing a staged hour, show that another's round leaves it alone.

The log is files, not the store: the running service here uses the default engine (worker
file names on PostgreSQL: tests/analytics/test_worker_logs.py)."""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from sigil_push.observations import LOCK_NAME, ObservationLog, file_name_for
from testkit.bridge_harness import eventually, metric
from testkit.deadlines import COMMAND_SECONDS, scaled
from testkit.service import ServiceProcess

HOUR_MS = 3_600_000
DAY_MS = 24 * HOUR_MS


def lines(count: int, tag: str) -> bytes:
    return b"".join(
        b'{"type":"relay","ts":%d,"relay":"ws://r","state":"connected","detail":"%s"}\n'
        % (i, tag.encode())
        for i in range(count)
    )


def read_hour(folder: Path, name: str) -> bytes:
    return gzip.decompress((folder / (name + ".gz")).read_bytes())


def backdate(path: Path, days: float) -> None:
    moment = time.time() - days * 86400
    os.utime(path, (moment, moment))


def test_tidy_compresses_finished_hours_and_deletes_expired_ones(tmp_path: Path) -> None:
    """With 30 days' retention: an hour 40 days old goes (plain or compressed), an hour two
    days old and the last hour are compressed with their content intact (the last one merged
    into its existing `.gz`, as after a late record), the current hour stays plain even with
    an old mtime (names decide, not mtimes), and unrelated files are left alone."""
    now = int(time.time() * 1000)
    expired = file_name_for(now - 40 * DAY_MS)
    expired_gz = file_name_for(now - 41 * DAY_MS) + ".gz"
    kept_old = file_name_for(now - 2 * DAY_MS)
    last_hour = file_name_for(now - HOUR_MS)
    current = file_name_for(now)
    (tmp_path / expired).write_bytes(lines(3, "expired"))
    (tmp_path / expired_gz).write_bytes(gzip.compress(lines(3, "expired-gz")))
    (tmp_path / kept_old).write_bytes(lines(500, "two-days"))
    (tmp_path / (last_hour + ".gz")).write_bytes(gzip.compress(lines(2, "early")))
    (tmp_path / last_hour).write_bytes(lines(1, "late"))
    (tmp_path / current).write_bytes(lines(4, "current"))
    (tmp_path / "notes.txt").write_text("an operator's file")
    for name in (expired, kept_old, current, "notes.txt"):
        backdate(tmp_path / name, 45)

    done = ObservationLog(tmp_path, retention_days=30).tidy(now)

    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == sorted(
        [kept_old + ".gz", last_hour + ".gz", current, "notes.txt", LOCK_NAME]
    )
    assert read_hour(tmp_path, kept_old) == lines(500, "two-days")
    assert read_hour(tmp_path, last_hour) == lines(2, "early") + lines(1, "late")
    assert (tmp_path / current).read_bytes() == lines(4, "current")
    assert (done.compressed, done.deleted, done.files) == (2, 2, 3)
    sizes = sum((tmp_path / n).stat().st_size for n in names if n != "notes.txt")
    assert done.size_bytes == sizes


def test_retention_zero_keeps_everything_and_a_crash_leftover_is_finished(tmp_path: Path) -> None:
    """`observations_retention_days = 0` deletes nothing; a `.compressing` file left by a crash
    in the middle of a compression is compressed on the next round."""
    now = int(time.time() * 1000)
    ancient = file_name_for(now - 400 * DAY_MS)
    interrupted = file_name_for(now - 3 * HOUR_MS)
    (tmp_path / ancient).write_bytes(lines(2, "ancient"))
    (tmp_path / (interrupted + ".compressing")).write_bytes(lines(2, "interrupted"))

    ObservationLog(tmp_path, retention_days=0).tidy(now)

    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [ancient + ".gz", interrupted + ".gz", LOCK_NAME]
    )
    assert read_hour(tmp_path, interrupted) == lines(2, "interrupted")


@pytest.mark.slow
async def test_the_running_service_tidies_its_log_and_reports_its_size(tmp_path: Path) -> None:
    """A real `sigil-push serve` with `observations_retention_days = 7`: an old hour put in its
    folder is deleted, a recent finished one compressed, off the event loop while the API
    answers, and `sigil_push_observations_bytes` reports the folder's size."""
    service = ServiceProcess(tmp_path / "service")
    text = service.config_path.read_text()
    service.config_path.write_text(
        text.replace("[server]\n", "[server]\nobservations_retention_days = 7\n", 1)
    )
    now = int(time.time() * 1000)
    old, recent = file_name_for(now - 8 * DAY_MS), file_name_for(now - 5 * HOUR_MS)
    service.observations.mkdir(parents=True)
    (service.observations / old).write_bytes(lines(10, "old"))
    (service.observations / recent).write_bytes(lines(10, "recent"))

    def folder_size() -> int:
        return sum(p.stat().st_size for p in service.observations.glob("observations-*"))

    with service:
        await eventually(
            lambda: {p.name for p in service.observations.iterdir()} & {old, recent, recent + ".gz"}
            == {recent + ".gz"},
            "the old hour deleted and the recent one compressed",
        )
        await eventually(
            lambda: metric(service, "sigil_push_observations_bytes") == folder_size() > 0,
            "the folder's size on /metrics",
        )
    assert read_hour(service.observations, recent) == lines(10, "recent")


async def test_records_for_an_hour_being_compressed_are_never_lost(tmp_path: Path) -> None:
    """Late records for the last hour keep arriving through the real writer while housekeeping
    compresses that hour over and over in a worker thread: every record ends up in the hour's
    `.gz`, exactly once."""
    log = ObservationLog(tmp_path)
    await log.start()
    now = int(time.time() * 1000)
    last_hour = now - HOUR_MS
    done = False

    async def tidy_repeatedly() -> int:
        rounds = 0
        while not done:
            await asyncio.to_thread(log.tidy, now)
            rounds += 1
        return rounds

    tidying = asyncio.create_task(tidy_repeatedly())
    ids = [f"{i:064x}" for i in range(3000)]
    for i, event_id in enumerate(ids):
        log.expect(last_hour, event_id, ["wss://r.example"])
        if i % 100 == 99:
            await asyncio.sleep(0.05)  # let the writer's flushes interleave with compressions
    done = True
    assert await tidying > 1
    await log.stop()
    log.tidy(now)

    name = file_name_for(last_hour)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([name + ".gz", LOCK_NAME])
    written = [json.loads(line)["event_id"] for line in read_hour(tmp_path, name).splitlines()]
    assert sorted(written) == ids


def test_a_crash_leftover_is_finished_before_its_hour_is_staged_again(tmp_path: Path) -> None:
    """A process died while compressing an hour (its `.compressing` file is left), and after the
    restart a late record for that hour started a new `.jsonl`: the next round keeps both. It
    used to move the new file aside onto the leftover's name, losing the leftover's records."""
    now = int(time.time() * 1000)
    hour = file_name_for(now - 3 * HOUR_MS)
    (tmp_path / (hour + ".compressing")).write_bytes(lines(3, "before the crash"))
    (tmp_path / hour).write_bytes(lines(1, "after the restart"))

    done = ObservationLog(tmp_path, retention_days=0).tidy(now)

    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([hour + ".gz", LOCK_NAME])
    assert read_hour(tmp_path, hour) == lines(3, "before the crash") + lines(1, "after the restart")
    assert done.compressed == 1


TIDY_ONCE = """
import dataclasses, json, sys
from pathlib import Path
from sigil_push.observations import ObservationLog
done = ObservationLog(Path(sys.argv[1]), 0, sys.argv[2]).tidy(int(sys.argv[3]))
print(json.dumps(dataclasses.asdict(done)))
"""


def tidy_in_process(folder: Path, worker: str, at_ms: int) -> subprocess.Popen[str]:
    """One housekeeping round of worker `worker` in a process of its own."""
    return subprocess.Popen(
        [sys.executable, "-c", TIDY_ONCE, str(folder), worker, str(at_ms)],
        stdout=subprocess.PIPE, text=True,
    )


async def test_a_staged_hour_is_finished_by_one_worker_only(tmp_path: Path) -> None:
    """Worker `w0` died while compressing an hour, leaving its `.compressing` file in the folder
    that workers `wa` and `wb` share. `wa`'s round takes it up and is held in the middle of it
    (the staged file is a named pipe: its contents come only when the test writes them). `wb`'s
    round meanwhile must not touch it (it used to finish the same file at the same time, over
    the same `.partial`: records doubled or lost, or its round failing), and returns at once;
    once `wa` goes on, the hour's `.gz` holds its earlier records and the leftover's, once."""
    now = int(time.time() * 1000)
    hour = file_name_for(now - 3 * HOUR_MS)
    orphan = hour.replace("observations-", "observations-w0-", 1)
    (tmp_path / (orphan + ".gz")).write_bytes(gzip.compress(lines(2, "compressed earlier")))
    staged = tmp_path / (orphan + ".compressing")
    os.mkfifo(staged)
    partial = tmp_path / (orphan + ".gz.partial")

    first = tidy_in_process(tmp_path, "wa", now)
    try:
        await eventually(lambda: partial.exists(), "worker wa finishing the staged hour", 60)
        second = tidy_in_process(tmp_path, "wb", now)
        try:
            out, _ = second.communicate(timeout=scaled(COMMAND_SECONDS))
        except subprocess.TimeoutExpired:
            second.kill()
            second.communicate()
            raise AssertionError("worker wb's round went for the file worker wa is finishing")
        assert second.returncode == 0
        assert json.loads(out)["compressed"] == 0
    finally:
        # let wa read the staged hour (opening the pipe for writing waits for its reader)
        await asyncio.to_thread(staged.write_bytes, lines(3, "staged by w0"))
        out, _ = first.communicate(timeout=scaled(COMMAND_SECONDS))
    assert first.returncode == 0

    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([orphan + ".gz", LOCK_NAME])
    assert read_hour(tmp_path, orphan) == lines(2, "compressed earlier") + lines(3, "staged by w0")


def _damaged(whole: bytes, damage: str) -> bytes:
    """A `.gz` as a copy cut short, a disk fault or a stray file leave it."""
    if damage == "truncated":
        return whole[: len(whole) // 2]
    if damage == "corrupt":
        return whole[:40] + bytes(b ^ 0xFF for b in whole[40:80]) + whole[80:]
    return b"not a gzip file\n"


@pytest.mark.parametrize("damage", ["truncated", "corrupt", "not gzip"])
async def test_a_damaged_hour_is_moved_aside_and_housekeeping_goes_on(
    tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A finished hour's `.gz` is damaged and a late record for that hour waits to be merged
    into it: reading it fails (EOFError, zlib.error or BadGzipFile), which used to fail every
    round until an operator moved the file, so no later hour was compressed either. Now the
    damaged file is moved aside as `<name>.damaged` (analytics reads `.jsonl` and `.jsonl.gz`
    only), counted in `sigil_push_observations_damaged_files_total` and logged by name (no
    record in the log line); the late record starts the hour's `.gz` afresh and the round goes
    on to the next hour, with no restart of the housekeeping task."""
    now = int(time.time() * 1000)
    hour = file_name_for(now - 3 * HOUR_MS)
    later = file_name_for(now - 2 * HOUR_MS)  # after the damaged hour in the round's order
    damaged = _damaged(gzip.compress(lines(100, "earlier")), damage)
    (tmp_path / (hour + ".gz")).write_bytes(damaged)
    (tmp_path / hour).write_bytes(lines(1, "late"))
    (tmp_path / later).write_bytes(lines(2, "later"))

    def sample(name: str, labels: dict[str, str] | None = None) -> float:
        return REGISTRY.get_sample_value(name, labels or {}) or 0.0

    def restarts() -> float:
        return sample("sigil_push_task_restarts_total", {"task": "observation-housekeeping"})

    def damaged_files() -> float:
        return sample("sigil_push_observations_damaged_files_total")

    restarts_before, damaged_before = restarts(), damaged_files()
    log = ObservationLog(tmp_path, retention_days=0)
    with caplog.at_level(logging.WARNING, logger="sigil_push.observations"):
        await log.start()
        await eventually(lambda: (tmp_path / (later + ".gz")).exists(), "the later hour compressed")
        await log.stop()

    assert damaged_files() == damaged_before + 1
    assert restarts() == restarts_before
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [hour + ".gz", hour + ".gz.damaged", later + ".gz", LOCK_NAME]
    )
    assert (tmp_path / (hour + ".gz.damaged")).read_bytes() == damaged, "kept as it was"
    assert read_hour(tmp_path, hour) == lines(1, "late")
    assert read_hour(tmp_path, later) == lines(2, "later")
    (warning,) = [r.getMessage() for r in caplog.records if "damaged" in r.getMessage()]
    assert hour in warning
    assert "earlier" not in warning and "late" not in warning and "relay" not in warning


def test_a_second_damage_of_one_hour_keeps_the_first_aside(tmp_path: Path) -> None:
    """The same hour damaged again: the first damaged file is not overwritten."""
    now = int(time.time() * 1000)
    hour = file_name_for(now - 3 * HOUR_MS)
    log = ObservationLog(tmp_path, retention_days=0)
    for round_number in (1, 2):
        (tmp_path / (hour + ".gz")).write_bytes(b"damage %d" % round_number)
        (tmp_path / hour).write_bytes(lines(1, "late"))
        log.tidy(now)
    assert (tmp_path / (hour + ".gz.damaged")).read_bytes() == b"damage 1"
    assert (tmp_path / (hour + ".gz.damaged.2")).read_bytes() == b"damage 2"
    assert read_hour(tmp_path, hour) == lines(1, "late")
