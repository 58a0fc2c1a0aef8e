"""Canary probes: is each relay delivering DMs right now, and how fast?

Every `interval_seconds` the bridge publishes a NIP-17 gift wrap addressed to its own canary key
to each probed relay, the way any sender would (sigil_push/relays/publish.py: a client
connection, NIP-42 AUTH when refused), and waits for it to come back through the bridge's normal
subscription to that relay. The canary key is one of the bridge's watched keys, so the probe
takes the very path a user's DM takes: the relay's write path, its `#p` filter match, a
`created_at` two days in the past, the bridge's verification. ingest (`Ingest._route`) hands anything
addressed to the canary key alone to `take` instead of the outbox: no device, no wakeup, no
`seen` record (a probe is sent to one relay only and would look like a miss everywhere else).

Each probe leaves one `canary` record (CONTRACT section 6) when it is settled: refused, or
received, or not received within the interval. Metrics feed alerts without Spark:
`sigil_push_canary_delivery_seconds{relay}` (publish to receipt) and
`sigil_push_canary_failures_total{relay,reason}`.

With several workers (PostgreSQL) one worker probes: the holder of the lease on key shard 0
(`ShardWatch.runs_canary`), checked before each round. When that worker dies its lease expires
after `bridge.lease_seconds` and the next holder of shard 0 probes from its next round on; the
lease has one owner at a time, so two workers probe together at most for the round one of them
had already begun. Every worker still watches the canary key, so a probe is never pushed.

The canary key lives in its own 0600 file next to the config, generated on first start, so the
relays keep seeing the same recipient (and its old probes, which carry a NIP-40 expiration so
relays that honour it drop them) across restarts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client import Counter, Histogram

from sigil_push.config import CanaryConfig, Config, ConfigError
from sigil_push.nostr.event import Event
from sigil_push.nostr.keys import SecretKey, is_hex
from sigil_push.nostr.kinds import DM_KINDS
from sigil_push.nostr.nip59 import gift_wrap
from sigil_push.observations import ObservationLog, now_ms
from sigil_push.relays.connection import AuthSigner, BridgeKeySigner
from sigil_push.relays.discovery import normalize_relay_url
from sigil_push.relays.publish import publish
from sigil_push.telemetry.redaction import relay_label
from sigil_push.telemetry.tracebacks import withheld

log = logging.getLogger(__name__)

NOT_RECEIVED = "not_received"
FAILURE_REASONS = (
    NOT_RECEIVED,  # accepted, but never came back through the bridge's subscription
    "rejected",  # OK false
    "auth_required",  # refused for lack of AUTH, and no challenge to answer came
    "auth_refused",  # the relay refused our AUTH answer
    "connect",
    "timeout",
    "closed",
    "protocol",
)
EXPIRATION_INTERVALS = 2

DELIVERY = Histogram(
    "sigil_push_canary_delivery_seconds",
    "Canary probes: from publishing to receipt through the bridge's own subscription",
    ["relay"],
    buckets=(0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0),
)
# counted when settled, like deliveries and failures, so delivered / probes is a clean ratio
PROBES = Counter("sigil_push_canary_probes_total", "Canary probes settled", ["relay"])
FAILURES = Counter(
    "sigil_push_canary_failures_total",
    "Canary probes that did not come back, by reason",
    ["relay", "reason"],
)


def load_canary_key(path: Path) -> SecretKey:
    """The canary key from its file, created (0600, hex) on first start."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        pass
    except OSError as exc:
        raise ConfigError("canary.key_file", f"cannot create {path}: {exc.strerror}") from None
    else:
        key = SecretKey.generate()
        with os.fdopen(fd, "w", encoding="ascii") as handle:
            handle.write(key.secret_hex + "\n")
        log.info("generated a canary key in %s", path)
        return key
    try:
        text = path.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError("canary.key_file", f"cannot read {path}: {exc}") from None
    if not is_hex(text, 64):
        raise ConfigError("canary.key_file", f"{path} must hold 64 lowercase hex digits")
    if path.stat().st_mode & 0o077:
        log.warning("canary key file %s is readable by others; chmod 600 it", path)
    return SecretKey(text)


def canary_from_config(
    config: Config, bridge_key: SecretKey, observations: ObservationLog
) -> Canary | None:
    """The configured canary, or None when `[canary]` is absent, disabled or has no relays.

    Probes go to `canary.relays`, else to every configured read relay; they are published
    with the bridge key answering AUTH, since a relay may admit writers by identity."""
    settings = config.canary
    if settings is None or not settings.enabled:
        return None
    wanted = settings.relays or tuple(relay.url for relay in config.relays if relay.read)
    relays = [url for url in (normalize_relay_url(u, True) for u in wanted) if url]
    if not relays:
        log.warning("canary enabled but there is no relay to probe")
        return None
    key = load_canary_key(config.resolve(settings.key_file))
    return Canary(settings, relays, key, BridgeKeySigner(bridge_key), observations)


def _always() -> bool:
    return True


@dataclass(slots=True)
class _Probe:
    relay: str
    received: asyncio.Event = field(default_factory=asyncio.Event)
    received_at_ms: int | None = None


class Canary:
    """Publishes the probes and settles them; `take` is the bridge's hook for their arrival."""

    def __init__(
        self,
        settings: CanaryConfig,
        relays: Sequence[str],
        key: SecretKey,
        signer: AuthSigner,
        observations: ObservationLog,
    ) -> None:
        self.pubkey = key.public_key_hex
        self.relays = tuple(dict.fromkeys(relays))
        self._key = key
        self._signer = signer
        self._observations = observations
        self._interval = settings.interval_seconds
        self._pending: dict[str, _Probe] = {}
        self._task: asyncio.Task[None] | None = None
        self._probes: set[asyncio.Task[None]] = set()
        self._active: Callable[[], bool] = _always
        self._probing = True
        for label in map(relay_label, self.relays):
            DELIVERY.labels(label)
            PROBES.labels(label)
            for reason in FAILURE_REASONS:
                FAILURES.labels(label, reason)

    def start(self, active: Callable[[], bool] | None = None) -> None:
        """Probe every interval; `active` (several workers) says whether this worker's turn
        it is, asked before each round."""
        self._active = active or _always
        self._task = asyncio.create_task(self._run(), name="canary")
        log.info("canary probing %d relays every %g s", len(self.relays), self._interval)

    async def stop(self) -> None:
        """Cancel the schedule and the probes under way; unsettled probes leave no record."""
        tasks = [t for t in (self._task, *self._probes) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            try:
                await task
            except asyncio.CancelledError:
                pass
        self._task = None

    def take(self, relay: str, event: Event) -> bool:
        """Bridge hook, for a verified DM from `relay`: True when it is addressed to the canary
        key alone (then it is ours, whether a probe under way or an old one a catch-up brings
        back) and must go no further. A probe counts as delivered only from its own relay."""
        if event.kind not in DM_KINDS:
            return False
        if set(event.tag_values("p")) != {self.pubkey}:
            return False
        probe = self._pending.get(event.id)
        if probe is not None and probe.relay == relay and probe.received_at_ms is None:
            probe.received_at_ms = now_ms()
            probe.received.set()
        return True

    async def _run(self) -> None:
        # the first round waits one interval, so it finds the subscriptions in place
        while True:
            await asyncio.sleep(self._interval)
            if self._active() != self._probing:
                self._probing = not self._probing
                log.info("canary %s on this worker", "probing" if self._probing else "idle")
            if not self._probing:
                continue
            for relay in self.relays:
                task = asyncio.create_task(self._probe(relay), name=f"canary {relay_label(relay)}")
                self._probes.add(task)
                task.add_done_callback(self._settled)

    def _settled(self, task: asyncio.Task[None]) -> None:
        self._probes.discard(task)
        failure = None if task.cancelled() else task.exception()
        if failure is not None:
            log.error("canary probe failed", exc_info=withheld(failure))

    async def _probe(self, relay: str) -> None:
        label = relay_label(relay)  # a configured URL may still carry a key: not in metrics, logs
        started_ms = now_ms()
        deadline = time.monotonic() + self._interval
        now = started_ms // 1000
        event = gift_wrap(
            self._key,
            self.pubkey,
            f"sigil-push canary {secrets.token_hex(16)}",
            expiration=now + int(EXPIRATION_INTERVALS * self._interval) + 60,
            now=now,
        )
        probe = self._pending[event.id] = _Probe(relay)
        try:
            result = await publish(relay, event, self._signer, self._interval)
            if not result.accepted or result.sent_ms is None:
                PROBES.labels(label).inc()
                FAILURES.labels(label, result.reason).inc()
                log.info("canary %s: not published (%s)", label, result.reason)
                self._observations.canary(started_ms, relay, event.id, False, result.message, None)
                return
            # asyncio.timeout, not wait_for (3.11 swallows a cancellation that lands as the
            # probe arrives, and the round would outlive stop())
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                    await probe.received.wait()
            PROBES.labels(label).inc()
            received_ms = None
            if probe.received_at_ms is not None:
                received_ms = max(0, probe.received_at_ms - result.sent_ms)
                DELIVERY.labels(label).observe(received_ms / 1000)
            else:
                FAILURES.labels(label, NOT_RECEIVED).inc()
                log.info("canary %s: published but not received within %g s", label, self._interval)
            self._observations.canary(
                started_ms, relay, event.id, True, result.message, received_ms
            )
        finally:
            del self._pending[event.id]
