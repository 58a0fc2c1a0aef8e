"""The dry-run sender: logs each wakeup it would send, for instances without credentials."""

from __future__ import annotations

import logging

from sigil_push.push.base import Outcome, Status, WakeupMessage
from sigil_push.store.records import Device

log = logging.getLogger("sigil_push.push.dryrun")


class DryRunSender:
    provider = "dryrun"
    max_concurrency = 1 << 16

    def __init__(self, platform: str) -> None:
        self.platform = platform

    def fits(self, data: dict[str, str]) -> bool:
        return True

    async def send(self, message: WakeupMessage, device: Device) -> Outcome:
        log.info(
            "dry-run wakeup platform=%s token=…%s events=%s",
            self.platform, device.token_suffix, ",".join(message.event_ids),
        )
        return Outcome(Status.ACCEPTED, detail="dry-run")

    async def close(self) -> None:
        return None
