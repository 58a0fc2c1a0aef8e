"""rust-nostr's relay (`LocalRelay` from the `nostr-sdk` package) as a third real relay
implementation for tests, beside `nostr-relay` (testkit/relay.py) and the protocol proxies.

What makes it worth having: it answers NIP-77 (negentropy), it caps every filter's answer at
500 events whatever `limit` says and publishes no NIP-11 document (the HTTP request gets its
connection closed), so it is a relay that caps silently, like many public ones. Its NIP-42
modes are the two kinds of gated inbox the bridge meets:

- `auth_reads=True` (`LocalRelayBuilderNip42` READ): every REQ first gets `["AUTH", c]` and
  `CLOSED "auth-required: you must auth"`; any authenticated key may then read.
- `auth_dm=True`: gift wraps only for their recipient. Once a client authenticated as someone
  else, a REQ for another key's gift wraps is refused with
  `CLOSED "error: you cannot request another user's gift wrap"` (an `error:` prefix).

It runs in this process (`RustRelay`, served by Rust's own runtime, so a test's busy event loop
does not slow it) or in a helper process (`RustRelayProcess`, `python -m
testkit.rust_relay`) when a benchmark wants it on the other core.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Self

import nostr_sdk

from testkit.nostr_client import publish
from testkit.relay import free_port, start_listening, stop_group, wait_for_port

FILTER_CAP = 500
"""What the relay answers at most per filter (its default `max_filter_limit`)."""


def _build(
    port: int, auth_reads: bool, auth_dm: bool, lmdb: nostr_sdk.NostrLmdb | None
) -> nostr_sdk.LocalRelay:
    builder = (
        nostr_sdk.LocalRelayBuilder()
        .port(port)
        # without it the relay refuses bulk publishing (OK false)
        .rate_limit(nostr_sdk.RateLimit(max_reqs=100_000, notes_per_minute=100_000_000))
    )
    if auth_reads:
        builder = builder.nip42(
            nostr_sdk.LocalRelayBuilderNip42(mode=nostr_sdk.LocalRelayBuilderNip42Mode.READ)
        )
    if auth_dm:
        builder = builder.auth_dm(True)
    if lmdb is not None:
        builder = builder.database(lmdb)
    return builder.build()


class RustRelay:
    """One rust-nostr relay in this process, as an async context manager.

    `restart()` stops it and serves the same store on the same port again (a relay restart:
    every client connection drops); pass `folder` for a store on disk that survives it.
    """

    def __init__(
        self,
        auth_reads: bool = False,
        auth_dm: bool = False,
        folder: Path | None = None,
        port: int | None = None,
    ) -> None:
        self.auth_reads = auth_reads
        self.auth_dm = auth_dm
        self.port = port or free_port()
        self.url = f"ws://127.0.0.1:{self.port}"
        self._folder = folder
        self._lmdb: nostr_sdk.NostrLmdb | None = None
        self._relay: nostr_sdk.LocalRelay | None = None

    async def start(self) -> Self:
        if self._folder is not None and self._lmdb is None:
            self._folder.mkdir(parents=True, exist_ok=True)
            self._lmdb = await nostr_sdk.NostrLmdb.open(str(self._folder / "lmdb"))
        self._relay = _build(self.port, self.auth_reads, self.auth_dm, self._lmdb)
        await self._relay.run()
        await asyncio.to_thread(wait_for_port, self.port)
        return self

    def stop(self) -> None:
        if self._relay is not None:
            self._relay.shutdown()
            self._relay = None

    async def restart(self) -> None:
        self.stop()
        await self.start()

    async def publish(self, *events: dict[str, Any]) -> None:
        """Store events (waits for every OK)."""
        await publish(self.url, *events)

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        self.stop()


class RustRelayProcess:
    """The same relay in a helper process of its own (own process group, stopped by PID)."""

    def __init__(
        self, folder: Path, auth_reads: bool = False, auth_dm: bool = False, lmdb: bool = False
    ) -> None:
        """`lmdb`: keep events in an LMDB store in `folder` (the default in-memory store keeps
        only about 75,000 events, dropping the oldest)."""
        self.folder = folder
        self.folder.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"ws://127.0.0.1:{self.port}"
        self._options = [*(["--auth-reads"] if auth_reads else []),
                         *(["--auth-dm"] if auth_dm else []),
                         *(["--lmdb", str(folder / "lmdb")] if lmdb else [])]
        self._process: subprocess.Popen[bytes] | None = None

    def start(self) -> Self:
        self._process = start_listening(
            [sys.executable, "-m", "testkit.rust_relay", "--port", str(self.port),
             *self._options],
            self.folder / "rust-relay.log", self.port,
        )
        return self

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def stop(self) -> None:
        if self._process is not None:
            stop_group(self._process)
            self._process = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


async def _serve(port: int, auth_reads: bool, auth_dm: bool, lmdb: str | None) -> None:
    # nostr-sdk's Python binding hands the LMDB store to the relay as a Python object (a
    # foreign NostrDatabase), so every save and lookup calls back into this process from the
    # relay's threads, on the loop set here; without it each call fails ("no running event
    # loop") and the relay stops acknowledging EVENTs: the "LMDB stall" seen before
    nostr_sdk.uniffi_set_event_loop(asyncio.get_running_loop())
    store = await nostr_sdk.NostrLmdb.open(lmdb) if lmdb else None
    relay = _build(port, auth_reads, auth_dm, store)
    await relay.run()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    relay.shutdown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="rust-nostr's LocalRelay on 127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--auth-reads", action="store_true")
    parser.add_argument("--auth-dm", action="store_true")
    parser.add_argument("--lmdb", default=None, help="folder of an LMDB store (default: memory)")
    arguments = parser.parse_args()
    asyncio.run(_serve(arguments.port, arguments.auth_reads, arguments.auth_dm, arguments.lmdb))
