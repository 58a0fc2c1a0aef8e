"""The counters of suppressed events, here at the bottom so that both layers that suppress can
count: the bridge (the recipients' choices, bridge/choices.py) and delivery (an Iris target's
own rate limit, `rate_limited`). Their label values are bound where they are decided
(bridge/metrics.py binds every reason and class of the wake rules)."""

from __future__ import annotations

from prometheus_client import Counter

SUPPRESSED = Counter(
    "sigil_push_suppressed_total",
    "Verified events that woke no device because of the recipients' own choices or limits,"
    " by reason",
    ["reason"],
)
SUPPRESSED_CLASS = Counter(
    "sigil_push_suppressed_by_class_total",
    "Verified events that woke no device, by notification class and reason",
    ["class", "reason"],
)
