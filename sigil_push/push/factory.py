"""Builds the sender for each platform the configuration enables, wrapped in its limits."""

from __future__ import annotations

from sigil_push.config import Config
from sigil_push.iris.payload import WEBHOOK, WEBPUSH
from sigil_push.push import registry, unifiedpush
from sigil_push.push.base import Sender
from sigil_push.push.dryrun import DryRunSender
from sigil_push.push.limits import ConcurrencyLimited


async def build_senders(config: Config) -> dict[str, Sender]:
    """One sender per accepted platform; dry-run instances log instead of sending.

    Each provider's `create` imports its client library, so an instance without FCM never
    loads firebase-admin. With `[iris]` on, Iris's browser targets get a Web Push sender where
    UnifiedPush is configured (its VAPID identity), and webhooks one with `[webhooks]`.
    """
    if config.dry_run:
        plain: dict[str, Sender] = {platform: DryRunSender(platform) for platform in registry.platforms(config)}
        if config.iris.enabled:
            plain[WEBPUSH] = DryRunSender(WEBPUSH)
            if config.webhooks_enabled:
                plain[WEBHOOK] = DryRunSender(WEBHOOK)
    else:
        plain = {}
        try:
            for provider in registry.PROVIDERS:
                table = config.providers.get(provider.name)
                if table is not None:
                    plain[provider.platform] = await provider.create(
                        table, config.resolve, config.push.send_timeout_seconds
                    )
            if config.iris.enabled:
                plain.update(_iris_senders(config, plain))
        except BaseException:
            for sender in plain.values():
                await sender.close()
            raise
    limit = config.push.concurrency_per_provider
    return {platform: ConcurrencyLimited(sender, limit) for platform, sender in plain.items()}


def _iris_senders(config: Config, built: dict[str, Sender]) -> dict[str, Sender]:
    """The senders of Iris targets: browser Web Push with UnifiedPush's VAPID signer (so only
    when `[unifiedpush]` is configured), webhooks with `[webhooks]` enabled. They share one
    profiles cache (the authors' names)."""
    from sigil_push.iris.profiles import Profiles
    from sigil_push.push.iris_senders import IrisBodies, IrisWebPushSender, WebhookSender
    from sigil_push.push.unifiedpush_sender import UnifiedPushSender

    web_push = built.get(unifiedpush.PROVIDER.platform)
    webhooks = config.webhooks if config.webhooks_enabled else None
    if not isinstance(web_push, UnifiedPushSender) and webhooks is None:
        return {}
    bodies = IrisBodies(config.iris.notification_url, Profiles())
    timeout = config.push.send_timeout_seconds
    senders: dict[str, Sender] = {}
    if isinstance(web_push, UnifiedPushSender):
        table = registry.table(config, unifiedpush.PROVIDER)
        allow_private = table is not None and table.allow_private_endpoints
        senders[WEBPUSH] = IrisWebPushSender(allow_private, timeout, web_push.vapid, bodies)
    if webhooks is not None:
        senders[WEBHOOK] = WebhookSender(webhooks.allow_private_endpoints, timeout, bodies)
    return senders
