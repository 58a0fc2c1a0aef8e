"""The one interface every push provider implements, and the outcomes it answers.

Outcomes are data: the delivery loop decides what to do with them (forget a dead token,
retry later, give up), so providers stay small and know nothing about the outbox.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Protocol

from sigil_push.devices import Device


class Status(enum.StrEnum):
    """A provider's answer; the values are the observation log's `push.status`."""

    ACCEPTED = "accepted"
    UNREGISTERED = "unregistered"
    REJECTED = "rejected"
    RETRY = "retry"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class Outcome:
    status: Status
    retry_after_seconds: float | None = None
    detail: str = ""


@dataclass(frozen=True, slots=True)
class WakeupMessage:
    """What one push carries: the event ids it stands for and the payload-mode extras.

    `data` is the provider-neutral JSON object of CONTRACT section 4 (`{"type": "wakeup", ...}`);
    `event_ids` are for bookkeeping only and are sent only when `data` includes them.
    """

    event_ids: tuple[str, ...]
    data: dict[str, str] = field(default_factory=dict)
    collapse_id: str | None = None


class Sender(Protocol):
    platform: str

    async def send(self, message: WakeupMessage, device: Device) -> Outcome: ...

    async def close(self) -> None: ...
