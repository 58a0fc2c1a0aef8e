"""The token-bucket refill every budget shares: per-client request limits (`http/ratelimit`),
per-device pushes (`delivery/device_rate`), per-recipient events (`bridge/ingest`) and a relay
socket's invalid events and signature checks (`relays/budget`).

Each keeps its buckets its own way (a tuple in a dict, slots on an object, milliseconds or
seconds); what they share is the arithmetic, kept here so a fix to it is made once. Imports
nothing of the package: any layer may use it.
"""

from __future__ import annotations


def refill(tokens: float, since: float, now: float, rate: float, capacity: float) -> float:
    """The tokens a bucket holds at `now` that held `tokens` at `since`, gaining `rate` a unit of
    time (whatever unit `since` and `now` count in) and never more than `capacity`."""
    return min(capacity, tokens + (now - since) * rate)
