"""Recording: the delivery metrics and the `push` observation records of answered pushes.

Answers are recorded per burst (`answered_many`): one counter increment per outcome, one
histogram call and one batch of records, instead of a lock, a dict and a JSON encoding per
push. Records carry the event id, platform, status and latency: never a token or a key.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence

from sigil_push.delivery.plan import Push
from sigil_push.observations import ObservationLog, PushRecord
from sigil_push.push import metrics
from sigil_push.push.base import Sender, Status
from sigil_push.store.records import Wakeup
from sigil_push.telemetry.suppressed import SUPPRESSED, SUPPRESSED_CLASS

Answer = tuple[Push, str, str, int]
"""(push, provider, status, answered_ms): one provider answer to record."""

_FAILED = Status.FAILED.value
RATE_LIMITED = "rate_limited"
IRIS_CLASS = "iris"
"""The reason and the notification class of an Iris target's wakeup past its budget (the
bridge's `choices.RATE_LIMITED` and `watches.IRIS`, which bind these label values)."""


class Recorder:
    """Counts and records what became of pushes, with each provider's series bound once."""

    def __init__(
        self, senders: Mapping[str, Sender], observations: ObservationLog, record_outcomes: bool
    ) -> None:
        self._observations = observations
        self._record_outcomes = record_outcomes
        self._providers = {platform: sender.provider for platform, sender in senders.items()}
        # metric series bound once: a labels() lookup per push is a measurable share of a push;
        # keyed by the status' string, since hashing an enum member runs Python code
        self._pushes = {
            (s.provider, status.value): metrics.PUSHES.labels(s.provider, status.value)
            for s in senders.values() for status in Status
        }

    def answered(self, push: Push, provider: str, status: Status, answered_ms: int) -> None:
        """One answer recorded at once (the outcomes that are not a burst's acceptances)."""
        self.answered_many([(push, provider, status.value, answered_ms)])

    def answered_many(self, answers: Sequence[Answer]) -> None:
        """Metrics and observation records of a burst of answered pushes, the records stamped
        with the burst's last answer."""
        counts: dict[tuple[str, str], int] = defaultdict(int)
        latencies: dict[str, list[float]] = defaultdict(list)
        records: list[PushRecord] = []
        for push, provider, status, answered_ms in answers:
            counts[provider, status] += 1
            wakeups = push.wakeups
            platform = push.device.platform
            if len(wakeups) == 1:  # most pushes: no generators
                wakeup = wakeups[0]
                oldest = wakeup.first_seen_ms
                records.append((wakeup.event_id, platform, status, answered_ms - oldest))
            else:
                oldest = min(w.first_seen_ms for w in wakeups)
                records.extend(
                    (w.event_id, platform, status, answered_ms - w.first_seen_ms) for w in wakeups
                )
            latencies[provider].append(max(0, answered_ms - oldest) / 1000)
        for key, count in counts.items():
            self._pushes[key].inc(count)
        for provider, seconds in latencies.items():
            metrics.LATENCY.observe_many(seconds, provider)
        if self._record_outcomes:
            self._observations.push_many(records, max(a[3] for a in answers))

    def rate_limited(self, wakeups: Sequence[Wakeup], now: int) -> None:
        """Iris targets' wakeups past their target's budget: counted and recorded as
        `suppressed` (`rate_limited`), never sent."""
        SUPPRESSED.labels(RATE_LIMITED).inc(len(wakeups))
        SUPPRESSED_CLASS.labels(IRIS_CLASS, RATE_LIMITED).inc(len(wakeups))
        for wakeup in wakeups:
            self._observations.suppressed(now, wakeup.event_id, RATE_LIMITED, IRIS_CLASS)

    def gave_up(self, wakeups: Sequence[Wakeup], answered_ms: int) -> None:
        """Wakeups dropped unsent (stale, out of attempts, or without a provider): status
        failed; the metrics count only those whose platform still has a provider."""
        for wakeup in wakeups:
            platform = wakeup.device.platform
            if self._record_outcomes:
                self._observations.push(
                    wakeup.event_id, platform, _FAILED, answered_ms - wakeup.first_seen_ms
                )
            provider = self._providers.get(platform)
            if provider is not None:
                self._pushes[provider, _FAILED].inc()
                metrics.STALE_DROPPED.labels(provider).inc()

    @staticmethod
    def pruned_token(provider: str) -> None:
        """A token the provider declared dead, whose registrations were forgotten."""
        metrics.PRUNED_TOKENS.labels(provider).inc()

    @staticmethod
    def coalesced(per_provider: Mapping[str, int]) -> None:
        """Wakeups that rode in another wakeup's push, per provider."""
        for provider, count in per_provider.items():
            metrics.COALESCED.labels(provider).inc(count)

    @staticmethod
    def outbox_depth(depth: int) -> None:
        metrics.OUTBOX_DEPTH.set(depth)

    @staticmethod
    def outbox_age(oldest_first_seen_ms: int | None, now: int) -> None:
        """A stuck outbox shows as age, not depth: a quiet instance may have few rows."""
        age = 0.0 if oldest_first_seen_ms is None else max(0, now - oldest_first_seen_ms) / 1000
        metrics.OUTBOX_AGE.set(age)
