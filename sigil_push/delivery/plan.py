"""Planning: which due wakeups go now, in which pushes, and which wait on disk until when.

Pure: `Planner.plan` takes a due batch, the time and the in-flight rows per endpoint host,
and returns a `Plan` (pushes to queue, rows to hold, rows to give up), changing only its own
limiter state (each phone's rate budget and coalescing window). No I/O and no event loop, so
tests call it with plain records (tests/delivery/test_delivery_plan.py).

A device here is the phone, named by its (platform, token): several accounts (npubs) may be
registered on it, each its own row. Coalescing windows and rate budgets belong to the phone,
so opaque wakeups for all its accounts become one push. `event_id`, `event` and `sealed` pushes
stay per registration, since each names (or seals) one account's event: they are never
coalesced, and beyond the phone's rate budget the excess rides in its one opaque push.

What a push carries is decided in one place, `Planner.message`: a new payload mode (or a
per-push encrypted body) changes that method, and which wakeups may share a push is decided
in `Planner._for_phone`.

The targets of Iris subscriptions (payload 'iris') are not phones: each wakeup is its own push
while the target's budget lasts (a burst of 20, then one per 6 s, as nostr-notification-server
allows), and the excess is suppressed (`rate_limited`), not held or coalesced: an opaque push
means nothing to Iris's service worker (`Planner._for_iris_target`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from functools import lru_cache
from typing import NamedTuple
from urllib.parse import urlsplit

import orjson

from sigil_push.config import IrisConfig, LimitsConfig, PushConfig
from sigil_push.delivery.device_rate import DeviceRateLimiter
from sigil_push.hosts import registrable_domain
from sigil_push.iris.payload import BODY_PLATFORMS, WEBPUSH, planned, provider_data
from sigil_push.push import registry
from sigil_push.push.base import Sender, WakeupMessage
from sigil_push.push.payload import fallback, opaque_data, sealed_data, wakeup_data
from sigil_push.store.records import IRIS_PAYLOAD, Device, Wakeup, WebPushKeys

BATCH_SIZE = 500
"""The most due rows one planning round takes (and one completion burst deletes at once)."""
HOST_SHARE = 8
"""A UnifiedPush destination (an endpoint's registrable domain), and one npub's endpoints
together, may each hold at most 1/HOST_SHARE of the platform's window (a push to a destination
with nothing in flight always may go, however many wakeups it carries)."""
HOST_HOLD_SECONDS = 1.0
"""How long a wakeup for a host at its cap waits on disk before it is looked at again, at
least: a quarter of the send timeout, so a tarpit's backlog is not re-read (in front of
everyone else's due wakeups) every second while its pushes hang."""


PhoneKey = tuple[str, str]
"""(platform, token): one physical device, whichever accounts are registered on it."""
PushKey = tuple[str, str, WebPushKeys | None]
"""What wakeups must share to travel in one push: the phone, and for UnifiedPush the WebPush
keys the body is encrypted to (two registrations of one endpoint could give different ones)."""
Host = tuple[str, str]
"""(platform, registrable domain of the endpoint) or (platform, "npub:" + pubkey) of a
UnifiedPush push: what a per-destination cap counts."""
IRIS_BURST = 20
IRIS_PER_MINUTE = 10
"""An Iris target's budget: a burst of 20 pushes, then one per 6 seconds (CONTRACT 3b)."""


class Push(NamedTuple):
    """One push to one device, standing for one or more outbox rows (of one or more of the
    accounts registered on it); `device` is the registration whose token and keys it uses.
    A NamedTuple: immutable, and built per push without a frozen dataclass' setattr calls."""

    device: Device
    wakeups: tuple[Wakeup, ...]
    message: WakeupMessage


class PlatformPolicy(NamedTuple):
    """What planning needs to know of one enabled platform: its provider's metric label, its
    payload size check, and the most rows one endpoint host may have in flight (None: no
    per-host cap, the provider is one big service)."""

    provider: str
    fits: Callable[[dict[str, str]], bool]
    host_cap: int | None
    iris_cap: int | None = None
    """On a platform without per-host caps (APNs, FCM): the most rows one subscriber's Iris
    targets may have in flight, so one user's 200 tokens (20 subscriptions of 10) can't fill
    the window everyone's phones share (None: their npub is not capped)."""


class Plan(NamedTuple):
    """What one due batch becomes. `held` maps a time to the rows due again then (a coalescing
    window, a spent rate budget, a host at its cap); `expired` rows are too old or out of
    attempts, `unsendable` ones name a platform that is no longer enabled; `coalesced` counts,
    per provider, the wakeups that rode in another wakeup's push; `rate_limited` are Iris
    targets' wakeups past their target's budget, suppressed."""

    pushes: list[Push]
    held: dict[int, list[int]]
    expired: list[Wakeup]
    unsendable: list[Wakeup]
    coalesced: dict[str, int]
    rate_limited: list[Wakeup]


def platform_policies(senders: Mapping[str, Sender], windows: Mapping[str, int]) -> dict[str, PlatformPolicy]:
    """Each platform's policy; `windows` are the platforms' rows-in-flight windows. A provider
    whose registry policy has per-host caps (UnifiedPush: endpoints are user-chosen hosts) lets
    each host hold only a share of its platform's window."""
    policies = {}
    for platform, sender in senders.items():
        share = max(1, windows[platform] // HOST_SHARE)
        per_host = registry.policy(sender.provider).per_host_caps
        policies[platform] = PlatformPolicy(
            sender.provider, sender.fits, share if per_host else None, None if per_host else share
        )
    return policies


SUBSCRIBER_ONLY_PLATFORMS = frozenset(
    provider.platform for provider in registry.PROVIDERS if not provider.policy.per_host_caps
)
"""Platforms whose tokens lead to one operated service (APNs, FCM): an Iris target there
counts against its subscriber's share only (`PlatformPolicy.iris_cap`)."""


def endpoint_host(device: Device) -> Host:
    """The registrable domain a UnifiedPush push goes to (its token is the endpoint URL), by
    the Public Suffix List: wildcard subdomains of one domain are one destination."""
    try:
        return device.platform, registrable_domain(urlsplit(device.token).hostname or "")
    except ValueError:
        return device.platform, ""


class EndpointCaps:
    """Every cap a UnifiedPush or Web Push push counts against: its endpoint's registrable
    domain, and its npub (one npub's endpoints on many domains hold one share, not one per
    domain). A browser's Web Push to one of `browser_services` (`iris.browser_push_services`)
    counts against its npub's share only. Planning and dispatch share one instance."""

    def __init__(self, browser_services: registry.BrowserPushServices) -> None:
        self._browser_services = browser_services
        # asked three times per push (planning, queueing, the answer), and parsing the URL
        # and finding its registrable domain is pure: remembered per instance
        self._remembered = lru_cache(maxsize=16_384)(self._caps)

    def __call__(self, device: Device) -> tuple[Host, ...]:
        if device.platform in SUBSCRIBER_ONLY_PLATFORMS:  # an Iris APNs or FCM target
            return ((device.platform, "npub:" + device.pubkey),)
        return self._remembered(device.platform, device.token, device.pubkey)

    def _caps(self, platform: str, token: str, pubkey: str) -> tuple[Host, ...]:
        npub = platform, "npub:" + pubkey
        try:
            hostname = urlsplit(token).hostname or ""
        except ValueError:
            hostname = ""
        if platform == WEBPUSH and hostname in self._browser_services:
            return (npub,)
        try:
            return (platform, registrable_domain(hostname)), npub
        except ValueError:
            return (platform, ""), npub


endpoint_caps = EndpointCaps(registry.DEFAULT_BROWSER_PUSH_SERVICES)
"""The caps with the default browser push services (`iris.browser_push_services` unset)."""


class Planner:
    """Turns due batches into pushes and holds; owns the phones' rate budgets and windows."""

    def __init__(
        self,
        platforms: Mapping[str, PlatformPolicy],
        push: PushConfig,
        limits: LimitsConfig,
        collapse_id: Callable[[int], str],
        notification_url: str = IrisConfig.notification_url,
        caps: EndpointCaps = endpoint_caps,
    ) -> None:
        """`notification_url`: where an Iris push's link leads (`iris.notification_url`);
        `caps`: the per-destination caps a push counts against (shared with dispatch)."""
        self._platforms = dict(platforms)
        self._caps = caps
        self._notification_url = notification_url
        self._iris_budget = DeviceRateLimiter(IRIS_PER_MINUTE, IRIS_BURST, "iris_target_buckets")
        self._push = push
        self._collapse_id = collapse_id
        self._coalesce_ms = limits.coalesce_window_ms
        self._rate = DeviceRateLimiter(limits.wakeups_per_minute_per_device)
        # per phone: when it last got an opaque push, which opens its coalescing window
        self._last_push_ms: dict[PhoneKey, int] = {}
        self._host_hold_ms = int(1000 * max(HOST_HOLD_SECONDS, push.send_timeout_seconds / 4))

    def plan(self, due: Sequence[Wakeup], now: int, host_rows: Mapping[Host, int]) -> Plan:
        """The pushes and holds for `due` at `now`; `host_rows` are the rows already in flight
        per endpoint host (for the per-host caps)."""
        by_push_key: dict[PushKey, list[Wakeup]] = defaultdict(list)
        expired: list[Wakeup] = []
        unsendable: list[Wakeup] = []
        rate_limited: list[Wakeup] = []
        seen_after = now - self._push.max_wakeup_age_seconds * 1000
        max_attempts = self._push.max_attempts
        platforms = self._platforms
        for wakeup in due:
            device = wakeup.device
            if wakeup.first_seen_ms < seen_after or wakeup.attempts >= max_attempts:
                expired.append(wakeup)
            elif device.platform not in platforms:
                unsendable.append(wakeup)
            else:  # its PushKey
                by_push_key[device.platform, device.token, device.webpush_keys].append(wakeup)
        pushes: list[Push] = []
        held: dict[int, list[int]] = defaultdict(list)
        coalesced: dict[str, int] = {}
        planned_per_host: dict[Host, int] = defaultdict(int)
        for wakeups in by_push_key.values():
            device = wakeups[0].device
            policy = platforms[device.platform]
            host_cap = policy.host_cap
            if host_cap is None and device.payload == IRIS_PAYLOAD:
                host_cap = policy.iris_cap
            caps = self._caps(device) if host_cap is not None else ()
            if host_cap is not None and any(
                (busy := host_rows.get(cap, 0) + planned_per_host[cap])
                and busy + len(wakeups) > host_cap
                for cap in caps
            ):
                held[now + self._host_hold_ms].extend(w.id for w in wakeups)
                continue
            if device.payload == IRIS_PAYLOAD:
                going = self._for_iris_target(wakeups, now, rate_limited)
            else:
                going, waiting = self._for_phone(wakeups, now, coalesced)
                for at_ms, ids in waiting.items():
                    held[at_ms].extend(ids)
            if caps:
                rows = sum(len(p.wakeups) for p in going)
                for cap in caps:
                    planned_per_host[cap] += rows
            pushes.extend(going)
        return Plan(pushes, held, expired, unsendable, coalesced, rate_limited)

    def _for_iris_target(
        self, wakeups: list[Wakeup], now: int, rate_limited: list[Wakeup]
    ) -> list[Push]:
        """An Iris target's pushes: one per wakeup while its budget lasts, oldest first; the
        rest go to `rate_limited` (suppressed, never sent later)."""
        first = wakeups[0].device
        target = first.platform, first.token
        budget = self._iris_budget
        allowed = budget.available(target, now)
        if len(wakeups) > 1:
            wakeups.sort(key=lambda w: w.id)
        going, excess = wakeups[:allowed], wakeups[allowed:]
        rate_limited.extend(excess)
        budget.spend(target, now, len(going))
        return [Push(w.device, (w,), self.message((w,), now)) for w in going]

    def _for_phone(
        self, wakeups: list[Wakeup], now: int, coalesced: dict[str, int]
    ) -> tuple[list[Push], dict[int, list[int]]]:
        """The pushes one phone gets now for `wakeups` (all for one push key), and the rows
        held back by when they may go.

        Within the phone's rate budget, each `event_id`/`event` wakeup is its own push; all
        the rest (every account's opaque wakeups, and what exceeds the budget) is one opaque
        push, which waits for the end of the coalescing window if an opaque push went out
        less than a window ago. Nothing goes while the budget is spent.
        """
        first = wakeups[0].device
        phone = first.platform, first.token
        rate_gate = self._rate.next_allowed_ms(phone, now)
        if rate_gate > now:
            return [], {rate_gate: [w.id for w in wakeups]}
        if len(wakeups) == 1 and first.payload != "opaque":
            # most pushes: one specific wakeup, and a gate that is open has room for one push
            self._rate.spend(phone, now)
            return [Push(first, (wakeups[0],), self.message(wakeups, now))], {}
        wakeups.sort(key=lambda w: w.id)
        opaque: list[Wakeup] = []
        specific: list[Wakeup] = []
        for wakeup in wakeups:
            (opaque if wakeup.device.payload == "opaque" else specific).append(wakeup)
        window_gate = now
        last = self._last_push_ms.get(phone)
        if self._coalesce_ms and last is not None:
            window_gate = last + self._coalesce_ms
        window_open = window_gate <= now
        budget = max(1, self._rate.available(phone, now))
        slots = budget - 1 if opaque and window_open else budget
        if len(specific) <= slots:
            singles, excess = specific, []
        else:
            # one slot is left for the opaque push the excess rides in
            keep = slots if opaque and window_open else slots - 1
            singles, excess = specific[:keep], specific[keep:]
        pushes = [Push(w.device, (w,), self.message((w,), now)) for w in singles]
        held: dict[int, list[int]] = {}
        together = opaque + excess
        if together and not window_open:
            held[window_gate] = [w.id for w in together]
        elif together:
            together.sort(key=lambda w: w.id)
            pushes.append(Push(together[0].device, tuple(together), self.message(together, now)))
            provider = self._platforms[first.platform].provider
            coalesced[provider] = coalesced.get(provider, 0) + len(together) - 1
            self._last_push_ms[phone] = now
        self._rate.spend(phone, now, len(pushes))
        return pushes, held

    def message(self, wakeups: Sequence[Wakeup], now: int) -> WakeupMessage:
        """Opaque for several wakeups; one wakeup carries what its registration asked for,
        shrunk to the provider's payload limit (event → event_id → opaque; sealed → the sealed
        pointer)."""
        first = wakeups[0]
        device = first.device
        event_ids: tuple[str, ...]
        if len(wakeups) == 1:  # most pushes: spared the generators below
            oldest_ms, event_ids = first.first_seen_ms, (first.event_id,)
            opaque = device.payload == "opaque"
        else:
            oldest_ms = min(w.first_seen_ms for w in wakeups)
            event_ids, opaque = tuple(w.event_id for w in wakeups), True
        ttl = max(1, (self._push.max_wakeup_age_seconds * 1000 - (now - oldest_ms)) // 1000)
        if opaque:
            data = opaque_data()
        elif device.payload == IRIS_PAYLOAD:
            data = self._iris(device, first)
        elif device.device_key is not None and device.payload == "sealed":
            data = sealed_data(device.device_key, first.event_id, first.relay, first.event_json,
                               self._platforms[device.platform].fits)
        else:
            data = wakeup_data(device.payload, first.event_id, first.relay, first.event_json)
            fits = self._platforms[device.platform].fits
            if not fits(data):
                data = fallback(data, first.event_id, first.relay)
                if not fits(data):
                    data = opaque_data()
        return WakeupMessage(
            event_ids=event_ids,
            data=data,
            collapse_id=self._collapse_id(first.id),
            ttl_seconds=int(ttl),
            opaque=opaque,
        )

    def _iris(self, device: Device, wakeup: Wakeup) -> dict[str, str]:
        """An Iris target's data: for Web Push and webhooks the event and its relay (the
        sender builds the body, with the author's name); for APNs and FCM the keys of
        `iris.payload.provider_data`, without `event` when it would not fit."""
        if device.platform in BODY_PLATFORMS:
            return planned(wakeup.event_json, wakeup.relay)
        if wakeup.event_json is None:  # a row queued without its event: nothing to name
            return {"title": "Notification", "body": ""}
        data = provider_data(orjson.loads(wakeup.event_json), self._notification_url)
        if "event" in data and not self._platforms[device.platform].fits(data):
            del data["event"]
        return data

    def prune(self, now: int) -> None:
        """Forget rate budgets and coalescing windows that no longer hold anything back."""
        self._rate.prune(now)
        self._iris_budget.prune(now)
        horizon = now - max(self._coalesce_ms, 1)
        self._last_push_ms = {d: t for d, t in self._last_push_ms.items() if t > horizon}
