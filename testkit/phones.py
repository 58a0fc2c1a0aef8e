"""Phones of an in-process service (testkit.in_process.in_process_service) that sends to the
fake APNs server: what the end-to-end stories of users' choices share (tests/stories/
test_preferences_e2e.py, test_notify_e2e.py). A phone is one (npub, APNs token) pair; what it
receives is what the fake APNs received for its token, and what was held back is read from the
observation log's `suppressed` records."""

from __future__ import annotations

from typing import Any

import nostr_sdk

from testkit.fakes.fake_apns import FakeApns
from testkit.fakes.harness import apns_token, eventually
from testkit.in_process import InProcessService
from testkit.nip98 import SdkUser

DEADLINE = 60.0
"""Seconds (scaled, testkit.deadlines) a story waits for the service to act."""


class Phone:
    """One (npub, token) pair: a user whose app registered an APNs token."""

    def __init__(self, instance: InProcessService, fake_apns: FakeApns, user: SdkUser,
                 token: str | None = None) -> None:
        self.instance, self.apns, self.user = instance, fake_apns, user
        self.token = token or apns_token()

    @property
    def keys(self) -> nostr_sdk.Keys:
        return self.user.keys

    async def register(self, **fields: Any) -> None:
        body = {"npub": self.user.npub, "platform": "ios", "device_token": self.token, **fields}
        response = await self.instance.call(self.user, "POST", "/register", body)
        assert response.status_code in (200, 201), response.text

    async def preferences(self, **fields: Any) -> dict[str, Any]:
        response = await self.instance.call(
            self.user, "POST", "/preferences", {"device_token": self.token, **fields}
        )
        assert response.status_code == 200, response.text
        return dict(response.json())

    async def presence(self, seconds: int) -> None:
        response = await self.instance.call(
            self.user, "POST", "/presence", {"device_token": self.token, "seconds": seconds}
        )
        assert response.status_code == 200, response.text

    async def device(self) -> dict[str, Any]:
        answer = (await self.instance.call(self.user, "GET", "/registrations")).json()
        [device] = [d for d in answer["devices"] if d["token_suffix"] == self.token[-6:]]
        return dict(device)

    def pushes(self) -> int:
        return sum(1 for request in self.apns.requests if request.token == self.token)


async def watched(instance: InProcessService, url: str, keys: int) -> None:
    """Wait until the relay at `url` is live with exactly `keys` keys subscribed."""

    def live() -> bool:
        state = instance.service.relay_health().get(url)
        return bool(state and state.get("live") and state.get("keys") == keys)

    await eventually(live, DEADLINE, f"{keys} keys live on the relay")


def suppressed(instance: InProcessService, event_id: str) -> tuple[str, str] | None:
    """(reason, class) of the event's `suppressed` record, which carries nothing else."""
    for record in instance.observation_records():
        if record["type"] == "suppressed" and record["event_id"] == event_id:
            assert set(record) == {"type", "ts", "event_id", "reason", "class"}, record
            return str(record["reason"]), str(record["class"])
    return None


async def held_back(instance: InProcessService, event: dict[str, Any], reason: str,
                    cls: str | None = None) -> None:
    """Wait for the event's `suppressed` record; it names `reason` (and `cls`, if given)."""
    await eventually(lambda: suppressed(instance, event["id"]), DEADLINE,
                     f"a suppressed record ({reason})")
    found = suppressed(instance, event["id"])
    assert found is not None
    assert found == (reason, found[1] if cls is None else cls), found


async def claim_turns(instance: InProcessService, turns: int = 3) -> None:
    """Wait until the bridge's deferred wakeup claim (presence lapses, quiet hours ending) has
    run `turns` more times."""
    committer = instance.service.components.bridge._committer
    runs: list[int] = []
    original = committer.claim_deferred

    async def counted() -> int:
        runs.append(1)
        return await original()

    committer.claim_deferred = counted  # type: ignore[method-assign]
    try:
        await eventually(lambda: len(runs) >= turns, DEADLINE, f"{turns} deferred claims")
    finally:
        committer.claim_deferred = original  # type: ignore[method-assign]
