"""The dry-run provider: with no provider table configured, every platform is accepted and
each wakeup is logged (without tokens or keys) instead of sent.

The INFO line names the platform, the token's last six characters and how many events the
wakeup stands for: never an event id, which anyone can look up on the relay to learn the
recipient (and for a kind 4 the sender), as the README promises. Only at DEBUG, which no
production instance runs at, a second line names the event ids: what a newcomer trying the
service (and the test suite's service processes) needs to see which event woke which trial
device."""

from __future__ import annotations

import logging

from sigil_push.push.base import Outcome, Status, WakeupMessage
from sigil_push.push.provider import DeliveryPolicy
from sigil_push.store.records import Device

log = logging.getLogger("sigil_push.push.dryrun")

NAME = "dryrun"
"""The metrics' `provider` label of dry-run senders, whatever their platform."""
POLICY = DeliveryPolicy(max_concurrency=1 << 16)


class DryRunSender:
    provider = NAME
    max_concurrency = POLICY.max_concurrency

    def __init__(self, platform: str) -> None:
        self.platform = platform

    def fits(self, data: dict[str, str]) -> bool:
        return True

    async def send(self, message: WakeupMessage, device: Device) -> Outcome:
        log.info(
            "dry-run wakeup platform=%s token=…%s events=%d",
            self.platform, device.token_suffix, len(message.event_ids),
        )
        if log.isEnabledFor(logging.DEBUG):
            log.debug("dry-run wakeup token=…%s event_ids=%s",
                      device.token_suffix, ",".join(message.event_ids))
        return Outcome(Status.ACCEPTED, detail="dry-run")

    async def close(self) -> None:
        return None
