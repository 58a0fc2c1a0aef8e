"""The canary on several workers: one worker of the instance probes (the holder of key shard
0's lease), and when it is SIGKILLed another takes the lease and the probes keep coming.

Real `sigil-push serve` processes on a real PostgreSQL server and a real `nostr-relay`; the
probes are counted per worker from each worker's own observation files (their names carry the
worker id), and each record is the relay's answer to a real published gift wrap.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from sigil_push.observations import safe_worker
from sigil_push.store.postgres.sharding import CANARY_SHARD
from testkit.bridge_harness import eventually
from testkit.deadlines import REQUEST_SECONDS, scaled
from testkit.processes import FAST_RECONNECT
from testkit.relay import RelayProcess
from testkit.service import ServiceProcess
from testkit.stores import on_database

pytestmark = pytest.mark.slow  # every story here starts its own processes

LEASE_SECONDS = 3
INTERVAL_SECONDS = 1
WORKER_TOML = (
    FAST_RECONNECT + f"lease_seconds = {LEASE_SECONDS}\n"
    f"[canary]\ninterval_seconds = {INTERVAL_SECONDS}\n"
)


def _shards(service: ServiceProcess) -> list[int]:
    try:
        return list(httpx.get(service.admin_url + "/health", timeout=scaled(REQUEST_SECONDS)).json().get("shards", []))
    except (httpx.HTTPError, ValueError):
        return []


def _worker(service: ServiceProcess) -> str:
    return str(httpx.get(service.admin_url + "/health", timeout=scaled(REQUEST_SECONDS)).json()["worker"])


def _probes(service: ServiceProcess) -> list[dict[str, Any]]:
    return [r for r in service.observation_records() if r["type"] == "canary"]


def _worker_of_files(service: ServiceProcess) -> set[str]:
    """The worker ids in the names of a worker's observation files."""
    return {
        path.name.removeprefix("observations-").rsplit("-", 1)[0]
        for path in service.observations.glob("observations-*.jsonl*")
    }


def _overlap(first: list[dict[str, Any]], second: list[dict[str, Any]]) -> int:
    """Probes of `second` published while `first` was still probing."""
    if not first or not second:
        return 0
    start, end = min(r["ts"] for r in first), max(r["ts"] for r in first)
    return sum(1 for r in second if start <= r["ts"] <= end)


async def test_one_worker_probes_and_the_canary_moves_when_it_dies(
    tmp_path: Path, postgres_url: str, start_relay: Callable[..., RelayProcess],
    workers: list[ServiceProcess],
) -> None:
    relay = start_relay("relay")
    for index in range(3):
        service = ServiceProcess(tmp_path / f"worker{index}", [relay.url], WORKER_TOML)
        workers.append(on_database(service, postgres_url, key_file=tmp_path / "bridge.key").start())
    await eventually(
        lambda: sum(CANARY_SHARD in _shards(s) for s in workers) == 1
        and all(_shards(s) for s in workers),
        "the workers split the shards",
        timeout=60,
    )
    prober = next(s for s in workers if CANARY_SHARD in _shards(s))
    others = [s for s in workers if s is not prober]
    await eventually(
        lambda: sum(r["received_ms"] is not None for r in _probes(prober)) >= 3,
        "the shard-0 worker's probes come back", timeout=60,
    )
    assert [len(_probes(s)) for s in others] == [0, 0], "only one worker probes"
    assert _worker_of_files(prober) == {safe_worker(_worker(prober))}, "names carry the worker"

    before = len(_probes(prober))
    assert prober.stop(signal.SIGKILL) == -9
    killed_at = time.monotonic()
    await eventually(
        lambda: any(r["received_ms"] is not None for s in others for r in _probes(s)),
        "a survivor probes and its probe comes back", timeout=60,
    )
    hand_over = time.monotonic() - killed_at
    print(f"canary hand-over after SIGKILL: {hand_over:.1f} s (lease {LEASE_SECONDS} s,"
          f" interval {INTERVAL_SECONDS} s; {before} probes before)")
    successor = next(s for s in others if CANARY_SHARD in _shards(s))
    await eventually(lambda: len(_probes(successor)) >= 5, "the probes keep coming", timeout=60)

    counts = {s.folder.name: len(_probes(s)) for s in workers}
    print(f"canary records per worker: {counts}")
    idle = next(s for s in others if s is not successor)
    assert _probes(idle) == [], "the worker without shard 0 never probed"
    assert _overlap(_probes(prober), _probes(successor)) == 0, "never two probing workers"
    assert all(r["published"] for r in _probes(successor))
    assert sum(r["received_ms"] is not None for r in _probes(successor)) >= 3
