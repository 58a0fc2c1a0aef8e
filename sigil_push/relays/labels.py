"""How a relay URL appears in metric labels.

Only configured relays are labelled by URL (redacted as in `telemetry.redaction.relay_label`).
Relays that come only from users (registration `relays`, kind 10050/10002 lists) share the one
label USER_RELAYS, so /metrics has a bounded set of series however many URLs users ever name;
per-URL detail stays on the admin /health and in logs and observation records (as `relay_label`).
"""

from __future__ import annotations

from collections.abc import Iterable

from sigil_push.telemetry.redaction import relay_label

USER_RELAYS = "user"
"""The metric label every relay that is not configured shares."""

_configured: frozenset[str] = frozenset()
"""The configured relays' URLs (from config, so bounded). Process-wide because metric series
are: the latest pool's set wins, as for memory_gauges.track (one bridge per process)."""


def configure_relays(urls: Iterable[str]) -> None:
    """Configured relays keep their URL label (the pool calls this with its configured relays)."""
    global _configured
    _configured = frozenset(urls)


def series_label(url: str) -> str:
    """The `relay` label of `url`'s metric series: its (redacted) URL if configured, else
    USER_RELAYS."""
    return relay_label(url) if url in _configured else USER_RELAYS
