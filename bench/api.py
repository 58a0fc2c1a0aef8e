"""Benchmark of authenticated registrations against a real `sigil-push serve` process.

Phase 1 (throughput): several concurrent keep-alive clients register devices as fast as the
server answers. Phase 2 (latency): an open-loop load of a fixed rate, so slow answers cannot
hide by slowing the senders down. Every request carries a fresh NIP-98 token signed just
before its phase; each registers a new device of a new key. Prints the figures and writes
them to bench/results/api.json.

Usage: python bench/api.py [--requests 15000] [--concurrency 16] [--rate 500] [--seconds 10]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from sigil_push.nostr.keys import SecretKey
from sigil_push.nostr.nip98 import make_http_auth

RESULTS = Path(__file__).parent / "results" / "api.json"


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_service(folder: Path) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    (folder / "relays.toml").write_text(
        f'[server]\nlisten = "127.0.0.1:{port}"\npublic_url = "http://127.0.0.1:{port}"\n'
        "[limits]\nrequests_per_minute_per_ip = 0\nrequests_per_minute_per_npub = 0\n"
    )
    with open(folder / "service.log", "wb") as log:  # the child keeps its own copy
        process = subprocess.Popen(
            [sys.executable, "-m", "sigil_push", "--log-level", "WARNING", "serve", "--config",
             str(folder / "relays.toml")],
            stdout=log, stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            return process, port
        except OSError:
            time.sleep(0.05)
    process.kill()
    raise SystemExit("service did not start")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, from /proc (clock ticks)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def build_requests(port: int, count: int) -> list[bytes]:
    """Complete HTTP/1.1 requests, each with its own key, device and NIP-98 token."""
    url = f"http://127.0.0.1:{port}/register"
    requests = []
    for _ in range(count):
        key = SecretKey.generate()
        body = json.dumps(
            {"npub": key.public_key_hex, "platform": "ios", "device_token": secrets.token_hex(32)}
        ).encode()
        auth = make_http_auth(key, url, "POST", body)
        head = (
            f"POST /register HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            f"Content-Type: application/json\r\nAuthorization: {auth}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        )
        requests.append(head.encode() + body)
    return requests


class Connection:
    """A keep-alive HTTP/1.1 connection that sends one request at a time."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, port: int) -> Connection:
        return cls(*await asyncio.open_connection("127.0.0.1", port))

    async def request(self, raw: bytes) -> int:
        self.writer.write(raw)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":", 1)[1])
        await self.reader.readexactly(length)
        return status

    def close(self) -> None:
        self.writer.close()


def percentile(samples: list[float], fraction: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


async def throughput(port: int, requests: list[bytes], concurrency: int) -> dict[str, float]:
    connections = [await Connection.open(port) for _ in range(concurrency)]
    queue = list(reversed(requests))
    latencies: list[float] = []
    failures = 0

    async def worker(connection: Connection) -> None:
        nonlocal failures
        while queue:
            raw = queue.pop()
            started = time.perf_counter()
            status = await connection.request(raw)
            latencies.append(time.perf_counter() - started)
            failures += status != 201

    started = time.perf_counter()
    await asyncio.gather(*(worker(c) for c in connections))
    elapsed = time.perf_counter() - started
    for connection in connections:
        connection.close()
    return {
        "requests": len(requests),
        "failures": failures,
        "seconds": round(elapsed, 3),
        "requests_per_second": round(len(requests) / elapsed, 1),
        "p50_ms": round(percentile(latencies, 0.50) * 1000, 2),
        "p99_ms": round(percentile(latencies, 0.99) * 1000, 2),
    }


async def fixed_rate(port: int, requests: list[bytes], rate: float) -> dict[str, float]:
    """Send at `rate` requests/s on a schedule; latency counts from the scheduled send time."""
    idle = [await Connection.open(port) for _ in range(32)]
    latencies: list[float] = []
    failures = 0
    start = time.perf_counter()

    async def one(index: int, raw: bytes) -> None:
        nonlocal failures
        scheduled = start + index / rate
        await asyncio.sleep(max(0.0, scheduled - time.perf_counter()))
        connection = idle.pop(0) if idle else await Connection.open(port)
        status = await connection.request(raw)
        latencies.append(time.perf_counter() - scheduled)
        failures += status != 201
        idle.append(connection)

    await asyncio.gather(*(one(i, raw) for i, raw in enumerate(requests)))
    for connection in idle:
        connection.close()
    return {
        "rate": rate,
        "requests": len(requests),
        "failures": failures,
        "p50_ms": round(statistics.median(latencies) * 1000, 2),
        "p99_ms": round(percentile(latencies, 0.99) * 1000, 2),
        "max_ms": round(max(latencies) * 1000, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=15000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rate", type=float, default=500)
    parser.add_argument("--seconds", type=float, default=10)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        process, port = start_service(Path(folder))
        try:
            warm = build_requests(port, 500)
            asyncio.run(throughput(port, warm, args.concurrency))
            burst = build_requests(port, args.requests)
            cpu_before = cpu_seconds(process.pid)
            phase1 = asyncio.run(throughput(port, burst, args.concurrency))
            server_cpu = cpu_seconds(process.pid) - cpu_before
            phase1["server_cpu_ms_per_request"] = round(server_cpu / args.requests * 1000, 3)
            phase1["one_core_ceiling_per_second"] = round(args.requests / server_cpu, 1)
            print(f"throughput: {phase1}")
            steady = build_requests(port, int(args.rate * args.seconds))
            phase2 = asyncio.run(fixed_rate(port, steady, args.rate))
            print(f"at {args.rate:.0f} req/s: {phase2}")
        finally:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=20)
    results = {
        "benchmark": "api",
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "server": "one sigil-push process (uvicorn, one worker), SQLite WAL",
        "throughput": phase1,
        "fixed_rate": phase2,
        "targets": {"requests_per_second": 1500, "p99_ms_at_500_rps": 20},
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
