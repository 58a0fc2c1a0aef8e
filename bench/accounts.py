"""Benchmark of many accounts per device (issue 10) with real processes.

500 phones with 5 accounts each: 2,500 nostr-sdk users, each registering its phone's FCM
token with its own NIP-98 through the REST API of one `sigil-push serve` process, which
watches one real `nostr-relay` and sends to the local fake FCM server (run in this process, so
every push it receives is counted).

1. Primer: one DM to the first account of every phone. Each phone gets its push at once
   (500 pushes), and that push opens the phone's coalescing window.
2. Inside the window: one DM to every account (2,500 DMs, shuffled, published over 8
   connections). Every wakeup is held to the window's end and the phone's five accounts travel
   in one push: the target is exactly 500 pushes for the 2,500 DMs, one per phone.

Measured: registrations/s, time to subscribe all keys, publish time of the 2,500 DMs (and
whether the last was published within the window the primer opened), pushes counted at the
fake provider per phone, the push records of the observation log (one per event), and how
long the 500 coalesced pushes took to go out when the windows ended. Writes
bench/results/accounts.json.

This is a separate file rather than a scenario in bench/gated.py: that benchmark is about
delegated AUTH on gated relays and shares nothing with this one but the relay process.

Usage: python bench/accounts.py [--phones 500] [--accounts 5] [--window-ms 60000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import sys
import tempfile
import time
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import httpx
import nostr_sdk

from testkit.bridge_harness import relay_live
from testkit.fakes.credentials import make_service_account
from testkit.fakes.fake_fcm import FakeFcm
from testkit.fakes.harness import fcm_token, toml_tables
from testkit.nip98 import SdkUser
from testkit.nostr_client import kind4_dm, publish
from testkit.relay import RelayProcess
from testkit.service import ServiceProcess

RESULTS = ROOT / "bench" / "results" / "accounts.json"
BRIDGE = "[bridge]\nreconnect_min_seconds = 0.5\nreconnect_max_seconds = 5.0\n"
PUBLISHERS = 8
REGISTER_CONCURRENCY = 8


async def register_all(service: ServiceProcess, phones: list[tuple[str, list[SdkUser]]]) -> Counter[str]:
    """Every account registers its phone's token, each signing its own NIP-98 with nostr-sdk;
    returns the statuses of failed attempts (retried)."""
    failures: Counter[str] = Counter()
    semaphore = asyncio.Semaphore(REGISTER_CONCURRENCY)
    async with httpx.AsyncClient(base_url=service.url, timeout=30) as http:

        async def one(user: SdkUser, token: str) -> None:
            body = json.dumps(
                {"npub": user.npub, "platform": "android", "device_token": token}
            ).encode()
            for _ in range(10):
                async with semaphore:
                    header = user.header(service.url + "/register", "POST", body)
                    try:
                        response = await http.post(
                            "/register", content=body,
                            headers={"content-type": "application/json", "authorization": header},
                        )
                    except httpx.TransportError as exc:
                        failures[type(exc).__name__] += 1
                        continue
                if response.status_code == 201:
                    return
                failures[str(response.status_code)] += 1
                await asyncio.sleep(1.0)
            raise AssertionError(f"registration kept failing: {dict(failures)}")

        await asyncio.gather(*(one(user, token) for token, users in phones for user in users))
    return failures


async def publish_all(relay_url: str, events: list[dict[str, Any]]) -> None:
    """Publish over PUBLISHERS connections, each waiting for the relay's OK of every event."""
    chunks = [events[i::PUBLISHERS] for i in range(PUBLISHERS)]
    await asyncio.gather(*(publish(relay_url, *chunk) for chunk in chunks if chunk))


async def wait_for(condition: Any, what: str, timeout: float, poll: float = 0.1) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if condition():
            return time.monotonic() - started
        await asyncio.sleep(poll)
    raise TimeoutError(f"{what} not reached within {timeout} s")


def pushes_to(fcm: FakeFcm, tokens: set[str]) -> Counter[str]:
    return Counter(m["token"] for m in list(fcm.messages) if m["token"] in tokens)


def push_records(service: ServiceProcess, event_ids: set[str]) -> list[dict[str, Any]]:
    return [
        r for r in service.observation_records()
        if r["type"] == "push" and r["event_id"] in event_ids
    ]


async def run(phones_count: int, accounts: int, window_ms: int) -> dict[str, Any]:
    folder = Path(tempfile.mkdtemp(prefix="sigil-accounts-bench-"))
    fcm = FakeFcm(None).start()
    service_account, public_key = make_service_account(folder, fcm.token_uri)
    fcm.public_key = public_key
    relay = RelayProcess(folder / "relay").start()
    fcm_table = {"credentials_file": str(service_account), "endpoint": fcm.url}
    service = ServiceProcess(
        folder / "service",
        [relay.url],
        extra_toml=BRIDGE + toml_tables({"fcm": fcm_table}),
        limits="requests_per_minute_per_ip = 0\nrequests_per_minute_per_npub = 0\n"
        f"coalesce_window_ms = {window_ms}\naccounts_per_device = {max(20, accounts)}",
    )
    try:
        service.start()
        phones = [(fcm_token(), [SdkUser() for _ in range(accounts)]) for _ in range(phones_count)]
        tokens = {token for token, _ in phones}
        keys = phones_count * accounts
        print(f"registering {keys} accounts on {phones_count} phones", flush=True)
        started = time.monotonic()
        failures = await register_all(service, phones)
        registration_seconds = time.monotonic() - started
        subscribe_seconds = await wait_for(
            lambda: relay_live(service, relay.url, keys), "all keys subscribed", 300, poll=0.5
        )
        sender = nostr_sdk.Keys.generate()

        primer = [kind4_dm(sender, users[0].keys, "primer") for _, users in phones]
        window_opened = time.monotonic()
        await publish_all(relay.url, primer)
        await wait_for(
            lambda: sum(pushes_to(fcm, tokens).values()) >= phones_count, "primer pushes", 300
        )
        primer_seconds = time.monotonic() - window_opened
        primer_pushes = sum(pushes_to(fcm, tokens).values())
        print(f"primer: {primer_pushes} pushes", flush=True)

        dms = [kind4_dm(sender, user.keys, "inside the window") for _, users in phones for user in users]
        random.shuffle(dms)
        publish_started = time.monotonic()
        await publish_all(relay.url, dms)
        published = time.monotonic()
        published_within_window_seconds = published - window_opened
        ids = {dm["id"] for dm in dms}
        print(f"published {len(dms)} DMs in {published - publish_started:.1f} s; waiting for the"
              f" windows to end", flush=True)
        await wait_for(
            lambda: sum(pushes_to(fcm, tokens).values()) > primer_pushes, "first coalesced push",
            window_ms / 1000 + 300,
        )
        first_coalesced = time.monotonic()
        await wait_for(
            lambda: len(push_records(service, ids)) >= len(ids), "a push record for every DM",
            300, poll=0.5,
        )
        all_recorded = time.monotonic()
        counts = pushes_to(fcm, tokens)
        window_pushes = sum(counts.values()) - primer_pushes
        per_phone = Counter(count - 1 for count in counts.values())
        records = push_records(service, ids)
        statuses = Counter(r["status"] for r in records)
        ts = sorted(r["ts"] for r in records)
        return {
            "benchmark": "accounts",
            "when": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
            "setup": "real nostr-relay, one sigil-push serve process sending to the fake FCM"
            " server (in the bench process), nostr-sdk users registering with their own NIP-98"
            " and sending NIP-04 DMs",
            "phones": phones_count,
            "accounts_per_phone": accounts,
            "coalesce_window_ms": window_ms,
            "registration_seconds": round(registration_seconds, 2),
            "registrations_per_second": round(keys / registration_seconds, 1),
            "registration_failed_attempts_retried": dict(failures),
            "subscribe_all_keys_seconds": round(subscribe_seconds, 2),
            "primer_pushes": primer_pushes,
            "primer_all_pushed_seconds": round(primer_seconds, 2),
            "dms_inside_window": len(dms),
            "dm_publish_seconds": round(published - publish_started, 2),
            "last_dm_published_after_window_opened_seconds": round(published_within_window_seconds, 2),
            "pushes_for_dms_inside_window": window_pushes,
            "phones_by_pushes_inside_window": {str(k): v for k, v in sorted(per_phone.items())},
            "push_records": len(records),
            "push_statuses": dict(statuses),
            "coalesced_pushes_spread_seconds": round((ts[-1] - ts[0]) / 1000, 2) if ts else None,
            "first_coalesced_push_to_all_recorded_seconds": round(all_recorded - first_coalesced, 2),
            "target": {"pushes_for_dms_inside_window": phones_count},
            "ok": window_pushes == phones_count and statuses == Counter({"accepted": len(ids)}),
        }
    finally:
        service.stop()
        relay.stop()
        fcm.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phones", type=int, default=500)
    parser.add_argument("--accounts", type=int, default=5)
    parser.add_argument("--window-ms", type=int, default=60_000)
    args = parser.parse_args()
    result = asyncio.run(run(args.phones, args.accounts, args.window_ms))
    print(json.dumps(result, indent=2))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
