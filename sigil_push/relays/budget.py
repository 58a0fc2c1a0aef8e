"""What one relay connection may cost the bridge: invalid events, signature checks, and NIP-77
work (`RangeBudget`, per relay rather than per socket).

Any stranger can name a relay at registration, so a relay is untrusted input. Two bounds apply
per connection (per socket: a reconnect starts fresh, the backoff remembers):

- **invalid events** (bad id, bad signature, malformed, outside the time window, for a key the
  relay was never asked about): a token bucket with a burst. A good relay sends the odd one
  (an old replay, a relay that ignores part of a filter) and never runs it dry; a flood of
  forgeries does within a fraction of a second, and the connection is dropped and that relay
  backed off exponentially (relays/connection.py);
- **signature checks** (the costliest step): a token bucket that may go into debt; the reader
  pays the debt by pausing before it reads on. aiohttp then stops reading the socket, so the
  relay is held at the TCP window and cannot take more than that rate of checks, whatever it
  sends. Between relays the loop is shared by turns: each reader yields every few frames.
"""

from __future__ import annotations

import time

from sigil_push.token_bucket import refill

INVALID_BURST = 200.0
INVALID_PER_SECOND = 5.0
"""A good relay stays far below 5 invalid events a second; 200 at once drop the socket."""
VERIFY_BURST = 20_000.0
VERIFY_PER_SECOND = 20_000.0
"""Signature checks per connection and second: about one core's worth (~48 us each here), a
ceiling above what the ingest benchmark's single relay reaches (10.8k events/s), so a good
relay at full speed is never paused. How the loop is *shared* between relays is the reader's
turn-taking (relays/connection.py, FRAMES_PER_TURN); forgeries end at the invalid budget."""


RANGE_BURST = 200_000.0
RANGES_PER_SECOND = 100.0
"""NIP-77 work one relay may cause (`Reconciliation.steps` units: a range read or written, 16
ids listed), about 5-50 us each here: an honest catch-up of a 20,000-item slice with a
thousand differences takes some tens of thousands; a relay past the burst falls back to paged
REQ. The refill gives back a burst in about half an hour."""


class RangeBudget:
    """One relay's NIP-77 work budget, kept across reconciliations and reconnects (it lives
    with the relay's Reconciler), so a relay cannot buy a fresh one by ending each exchange."""

    __slots__ = ("_burst", "_per_second", "_stamp", "_tokens")

    def __init__(self, burst: float = RANGE_BURST, per_second: float = RANGES_PER_SECOND) -> None:
        self._burst, self._per_second = burst, per_second
        self._tokens = burst
        self._stamp = time.monotonic()

    def charge(self, units: int) -> bool:
        """Spend `units`; False once the budget is exhausted."""
        now = time.monotonic()
        self._tokens = min(self._burst, self._tokens + (now - self._stamp) * self._per_second)
        self._stamp = now
        self._tokens -= units
        return self._tokens >= 0.0


class ConnectionBudget:
    """One relay socket's budgets; `reset()` when a socket opens."""

    __slots__ = ("_invalid", "_invalid_stamp", "_verify", "_verify_stamp", "exceeded")

    def __init__(self) -> None:
        self.exceeded = False
        """True once the socket sent more invalid events than its budget: the reader drops it."""
        self._invalid = INVALID_BURST
        self._invalid_stamp = time.monotonic()
        self._verify = VERIFY_BURST
        self._verify_stamp = self._invalid_stamp

    def reset(self) -> None:
        self.exceeded = False
        self._invalid = INVALID_BURST
        self._verify = VERIFY_BURST
        self._invalid_stamp = self._verify_stamp = time.monotonic()

    def invalid(self) -> None:
        """One invalid event from this socket."""
        now = time.monotonic()
        self._invalid = refill(
            self._invalid, self._invalid_stamp, now, INVALID_PER_SECOND, INVALID_BURST
        )
        self._invalid_stamp = now
        self._invalid -= 1.0
        if self._invalid < 0.0:
            self.exceeded = True

    def verified(self) -> None:
        """One signature check spent on this socket's behalf (refilled lazily in `pause`)."""
        self._verify -= 1.0

    def pause(self) -> float:
        """Seconds the reader must wait before reading on (0 while the bucket holds tokens)."""
        if self._verify >= 0.0:
            return 0.0
        now = time.monotonic()
        self._verify = refill(
            self._verify, self._verify_stamp, now, VERIFY_PER_SECOND, VERIFY_BURST
        )
        self._verify_stamp = now
        return 0.0 if self._verify >= 0.0 else -self._verify / VERIFY_PER_SECOND
