"""The push providers this service knows, their `relays.toml` tables (`TABLES`, which the CLI
hands to the core config), and the lookups validation, the API and delivery make instead of
naming a provider.

Adding a provider: write its module (see `provider.Provider`) and list its PROVIDER here.
Every module listed is a cheap declaration; a provider's client library is imported by its
`create`, which runs only when its table is configured.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from sigil_push.config import Config, ConfigError, IrisConfig, parse_table
from sigil_push.errors import BadRequest
from sigil_push.iris.payload import WEBHOOK, WEBPUSH
from sigil_push.push import apns, dryrun, fcm, unifiedpush
from sigil_push.push.provider import DeliveryPolicy, Provider

PROVIDERS: tuple[Provider[Any], ...] = (apns.PROVIDER, fcm.PROVIDER, unifiedpush.PROVIDER)
"""In the order `/info` lists their platforms."""

PLATFORMS = tuple(provider.platform for provider in PROVIDERS)
"""Every registration platform: what dry-run accepts, and what observation records may name."""

IRIS_SENDERS = (WEBPUSH, WEBHOOK)
"""The senders of Iris subscriptions' browser and webhook targets (push/iris_senders.py): each
is its own platform and `provider` label. Their endpoints are user-chosen hosts, as
UnifiedPush's, and get the same per-host caps."""
IRIS_POLICY = DeliveryPolicy(max_concurrency=unifiedpush.MAX_CONCURRENCY, per_host_caps=True)

@dataclass(frozen=True, slots=True)
class BrowserPushServices:
    """The browsers' push services (`iris.browser_push_services`): operated services, like
    APNs and FCM themselves, not user-chosen hosts that could hang, so a Web Push to one of
    them is not held to one host's share of the window (which would cap every Chrome user's
    pushes at a few dozen in flight). `hosts` match exactly, `suffixes` (from `*.name`) any
    host under them."""

    hosts: frozenset[str]
    suffixes: tuple[str, ...]

    @classmethod
    def of(cls, entries: Iterable[str]) -> BrowserPushServices:
        """From the config's entries (validated there: lowercase names, `*.` wildcards)."""
        listed = tuple(entries)
        return cls(
            frozenset(entry for entry in listed if not entry.startswith("*.")),
            tuple(entry[1:] for entry in listed if entry.startswith("*.")),
        )

    def __contains__(self, host: object) -> bool:
        """Whether `host` (an endpoint's hostname, lowercase) is one of them."""
        return isinstance(host, str) and (host in self.hosts or host.endswith(self.suffixes))


DEFAULT_BROWSER_PUSH_SERVICES = BrowserPushServices.of(IrisConfig.browser_push_services)


PROVIDER_NAMES = (*(provider.name for provider in PROVIDERS), *IRIS_SENDERS, dryrun.NAME)
"""Every `provider` metric label."""

_BY_PLATFORM = {provider.platform: provider for provider in PROVIDERS}
_POLICIES = {provider.name: provider.policy for provider in PROVIDERS}
_POLICIES.update({name: IRIS_POLICY for name in IRIS_SENDERS})
_POLICIES[dryrun.NAME] = dryrun.POLICY


def by_platform(platform: str) -> Provider[Any]:
    """The provider of a platform in PLATFORMS."""
    return _BY_PLATFORM[platform]


def policy(provider_name: str) -> DeliveryPolicy:
    """The delivery policy of a sender, by its `provider` label (dry-run included)."""
    return _POLICIES[provider_name]


def stored_forms(token: str) -> list[str]:
    """The forms in which a provider would have stored `token` at registration, when they
    differ from it (an APNs token given in upper case is stored lowercase), so unregistering
    finds a pair whatever case the app sends."""
    forms: list[str] = []
    for provider in PROVIDERS:
        try:
            stored = provider.parse_token(token)
        except BadRequest:
            continue
        if stored != token and stored not in forms:
            forms.append(stored)
    return forms


class _Tables:
    """The providers' tables for the core config (its `ProviderTables` port): each configured
    table parsed and validated by its provider, and the files it names checked to exist."""

    names = tuple(provider.name for provider in PROVIDERS)

    def parse(
        self, document: dict[str, Any], public_url: str, resolve: Callable[[str], Path]
    ) -> dict[str, Any]:
        tables = {
            provider.name: provider.validate(
                parse_table(document[provider.name], provider.name, provider.table), public_url
            )
            for provider in PROVIDERS
            if provider.name in document
        }
        for provider in PROVIDERS:
            table = tables.get(provider.name)
            for key in provider.file_keys if table is not None else ():
                relative = getattr(table, key)
                path = resolve(relative)
                if relative and not path.is_file():
                    raise ConfigError(f"{provider.name}.{key}", f"file not found: {path}")
        return tables


TABLES = _Tables()
"""What `load_config` / `parse_config` take to read the providers' tables."""

T = TypeVar("T")


def platforms(config: Config) -> list[str]:
    """Platforms this instance accepts registrations for (every one in dry-run)."""
    if config.dry_run:
        return list(PLATFORMS)
    return [p.platform for p in PROVIDERS if p.name in config.providers]


def table(config: Config, provider: Provider[T]) -> T | None:
    """`provider`'s table, or None when it is not configured."""
    found: T | None = config.providers.get(provider.name)
    return found
