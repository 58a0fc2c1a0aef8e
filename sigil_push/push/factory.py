"""Builds the sender for each platform the configuration enables, wrapped in its limits."""

from __future__ import annotations

from sigil_push.config import Config
from sigil_push.push import registry
from sigil_push.push.base import Sender
from sigil_push.push.dryrun import DryRunSender
from sigil_push.push.limits import ConcurrencyLimited


async def build_senders(config: Config) -> dict[str, Sender]:
    """One sender per accepted platform; dry-run instances log instead of sending.

    Each provider's `create` imports its client library, so an instance without FCM never
    loads firebase-admin.
    """
    if config.dry_run:
        plain: dict[str, Sender] = {platform: DryRunSender(platform) for platform in registry.platforms(config)}
    else:
        plain = {}
        try:
            for provider in registry.PROVIDERS:
                table = config.providers.get(provider.name)
                if table is not None:
                    plain[provider.platform] = await provider.create(
                        table, config.resolve, config.push.send_timeout_seconds
                    )
        except BaseException:
            for sender in plain.values():
                await sender.close()
            raise
    limit = config.push.concurrency_per_provider
    return {platform: ConcurrencyLimited(sender, limit) for platform, sender in plain.items()}
