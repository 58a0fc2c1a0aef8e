"""Keys per worker: start-up time and RSS of `sigil-push serve` workers on one PostgreSQL
database holding KEYS registered keys, with 1 and then N workers.

Each worker reads only its own shards' keys (`PostgresDevices.narrow_to`) and baselines, so
its watched keys and memory shrink with the number of workers. The relay is a closed loopback
port: what is measured is loading and planning the keys, not subscribing them.

    python bench/worker_keys.py [KEYS] [N]
"""

from __future__ import annotations

import asyncio
import json
import secrets
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import asyncpg

from sigil_push.store.postgres.migrate import migrate
from testkit.postgres import PostgresServer, find_binaries
from testkit.relay import free_port
from testkit.service import ServiceProcess


def rss_mib(service: ServiceProcess) -> float:
    assert service._process is not None
    status = Path(f"/proc/{service._process.pid}/status").read_text()
    kib = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS"))
    return kib / 1024


def watched(service: ServiceProcess) -> int:
    with urllib.request.urlopen(service.admin_url + "/metrics", timeout=60) as response:
        for line in response.read().decode().splitlines():
            if line.startswith("sigil_push_bridge_watched_keys "):
                return int(float(line.split()[1]))
    return -1


def shards(service: ServiceProcess) -> int:
    with urllib.request.urlopen(service.admin_url + "/health", timeout=60) as response:
        return len(json.load(response).get("shards", []))


async def fill(url: str, keys: int) -> None:
    await migrate(url)
    connection = await asyncpg.connect(url)
    try:
        await connection.execute(
            "INSERT INTO devices (pubkey, platform, token, registered_at, updated_at)"
            " SELECT k, 'android', 'token-' || k, 0, 0 FROM unnest($1::text[]) AS k",
            [secrets.token_hex(32) for _ in range(keys)],
        )
    finally:
        await connection.close()


def run(folder: Path, url: str, count: int, keys: int) -> None:
    relay = f"ws://127.0.0.1:{free_port()}"
    workers = []
    toml = "[bridge]\nlease_seconds = 3\n"
    try:
        for index in range(count):
            service = ServiceProcess(folder / f"n{count}-w{index}", [relay], toml)
            text = service.config_path.read_text().replace(
                'database = "sigil-push.db"', f'database = "{url}"'
            ).replace("[server]\n", f'[server]\nsecret_key_file = "{folder / "bridge.key"}"\n', 1)
            service.config_path.write_text(text)
            started = time.monotonic()
            workers.append(service.start())
            print(f"  worker {index}: healthy after {time.monotonic() - started:.1f} s")
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if sum(shards(s) for s in workers) == 256 and sum(watched(s) for s in workers) >= keys:
                break
            time.sleep(0.5)
        time.sleep(2)
        for index, service in enumerate(workers):
            print(f"  worker {index}: {shards(service)} shards, {watched(service)} keys watched,"
                  f" RSS {rss_mib(service):.0f} MiB")
    finally:
        for service in workers:
            service.stop()


def main() -> None:
    keys = int(sys.argv[1]) if len(sys.argv) > 1 else 100_000
    count = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    binaries = find_binaries()
    assert binaries is not None, "PostgreSQL binaries not found"
    with tempfile.TemporaryDirectory() as tmp, PostgresServer(binaries) as server:
        for workers in (1, count):
            url = server.create_database()
            asyncio.run(fill(url, keys))
            print(f"{keys} keys, {workers} worker(s):")
            run(Path(tmp), url, workers, keys)


if __name__ == "__main__":
    main()
