"""The one interface every push provider implements, and the outcomes it answers.

Outcomes are data: the delivery loop decides what to do with them (forget a dead token,
retry later, give up), so providers stay small and know nothing about the outbox.
"""

from __future__ import annotations

import email.utils
import enum
import re
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import NamedTuple, Protocol

from sigil_push.store.records import Device


class Status(enum.StrEnum):
    """A provider's answer; the values are the observation log's `push.status`."""

    ACCEPTED = "accepted"
    UNREGISTERED = "unregistered"
    REJECTED = "rejected"
    RETRY = "retry"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class Outcome:
    """What became of one push; `detail` is a short fixed label (never token or content)."""

    status: Status
    retry_after_seconds: float | None = None
    detail: str = ""


class WakeupMessage(NamedTuple):
    """What one push carries: the event ids it stands for and the payload-mode extras.

    `data` is the provider-neutral JSON object of CONTRACT section 4 (`{"type": "wakeup", ...}`);
    `event_ids` are for bookkeeping only and are sent only when `data` includes them.
    `collapse_id` is random per wakeup and kept in the outbox, so a resend after a crash
    replaces the first notification instead of adding a second one. `opaque` wakeups may share
    a provider-side collapse key, since any one of them means the same thing.

    Immutable as a NamedTuple rather than a frozen dataclass: one is built per push, and a
    frozen dataclass' __init__ sets each field through object.__setattr__ (0.9 against 0.3 µs).
    """

    event_ids: tuple[str, ...]
    data: dict[str, str]
    collapse_id: str
    ttl_seconds: int
    opaque: bool


class Sender(Protocol):
    """One push provider. `platform` is the registration's platform, `provider` the metric label,
    `max_concurrency` the most sends its client handles well at once (the factory caps
    `push.concurrency_per_provider` to it). `send` must return within its own timeout."""

    platform: str
    provider: str
    max_concurrency: int

    def fits(self, data: dict[str, str]) -> bool:
        """Whether a wakeup carrying `data` is within the provider's payload limit."""
        ...

    async def send(self, message: WakeupMessage, device: Device) -> Outcome: ...

    async def close(self) -> None: ...


MAX_RETRY_AFTER_SECONDS = 3600.0
"""A provider's Retry-After is honoured up to an hour: a larger one (or 400 digits) would hold
the push past any use, or overflow the scheduler's date arithmetic."""
_DELTA_SECONDS = re.compile(r"[0-9]{1,12}")
_MAX_HEADER_LENGTH = 64


def parse_retry_after(value: str | None) -> float | None:
    """Seconds from an HTTP Retry-After header: ASCII delta-seconds or an HTTP-date with a
    zone (RFC 9110), capped at MAX_RETRY_AFTER_SECONDS. Anything else (`²`, which `isdigit`
    accepts, a 400-digit number, a date without a zone) is treated as absent: None."""
    if not value or len(value) > _MAX_HEADER_LENGTH:
        return None
    value = value.strip()
    if _DELTA_SECONDS.fullmatch(value):
        return min(float(value), MAX_RETRY_AFTER_SECONDS)
    try:
        when = email.utils.parsedate_to_datetime(value)
        if when.tzinfo is None:
            return None
        seconds = (when - datetime.now(UTC)).total_seconds()
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    return min(max(0.0, seconds), MAX_RETRY_AFTER_SECONDS)
