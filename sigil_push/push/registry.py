"""The push providers this service knows, and the lookups config, validation, the API and
delivery make instead of naming a provider.

Adding a provider: write its module (see `provider.Provider`) and list its PROVIDER here.
Every module listed is a cheap declaration; a provider's client library is imported by its
`create`, which runs only when its table is configured.
"""

from __future__ import annotations

from typing import Any

from sigil_push.errors import BadRequest
from sigil_push.push import apns, dryrun, fcm, unifiedpush
from sigil_push.push.provider import DeliveryPolicy, Provider

PROVIDERS: tuple[Provider[Any], ...] = (apns.PROVIDER, fcm.PROVIDER, unifiedpush.PROVIDER)
"""In the order `/info` lists their platforms."""

PLATFORMS = tuple(provider.platform for provider in PROVIDERS)
"""Every registration platform: what dry-run accepts, and what observation records may name."""

PROVIDER_NAMES = (*(provider.name for provider in PROVIDERS), dryrun.NAME)
"""Every `provider` metric label."""

_BY_PLATFORM = {provider.platform: provider for provider in PROVIDERS}
_POLICIES = {provider.name: provider.policy for provider in PROVIDERS}
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
