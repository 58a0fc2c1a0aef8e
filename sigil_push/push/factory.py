"""Builds the sender for each platform the configuration enables, wrapped in its limits."""

from __future__ import annotations

import logging

from sigil_push.config import Config, ConfigError
from sigil_push.identity import KeyFileError
from sigil_push.push.base import Sender
from sigil_push.push.dryrun import DryRunSender
from sigil_push.push.limits import ConcurrencyLimited

log = logging.getLogger(__name__)


async def build_senders(config: Config) -> dict[str, Sender]:
    """One sender per accepted platform; dry-run instances log instead of sending.

    Provider modules are imported only when configured: an instance without FCM never loads
    firebase-admin.
    """
    if config.dry_run:
        plain: dict[str, Sender] = {platform: DryRunSender(platform) for platform in config.platforms}
    else:
        plain = {}
        try:
            await _build_providers(config, plain)
        except BaseException:
            for sender in plain.values():
                await sender.close()
            raise
    limit = config.push.concurrency_per_provider
    return {platform: ConcurrencyLimited(sender, limit) for platform, sender in plain.items()}


async def _build_providers(config: Config, senders: dict[str, Sender]) -> None:
    timeout = config.push.send_timeout_seconds
    if config.apns is not None:
        from sigil_push.push.apns import ApnsSender

        ca_file = config.resolve(config.apns.ca_file) if config.apns.ca_file else None
        senders["ios"] = await ApnsSender.create(
            config.apns, config.resolve(config.apns.key_file), ca_file, timeout
        )
    if config.fcm is not None:
        from sigil_push.push.fcm import FcmSender

        senders["android"] = await FcmSender.create(
            config.fcm, config.resolve(config.fcm.credentials_file), timeout
        )
    if config.unifiedpush is not None:
        from sigil_push.push.unifiedpush import UnifiedPushSender
        from sigil_push.push.vapid import VapidSigner, load_or_create_key

        try:
            key = load_or_create_key(config.resolve(config.unifiedpush.vapid_private_key_file))
        except KeyFileError as exc:
            # never a new key in place of a bad file: apps have bound their endpoints to it
            raise ConfigError("unifiedpush.vapid_private_key_file", str(exc)) from None
        vapid = VapidSigner(key, config.unifiedpush.vapid_subject)
        log.info("UnifiedPush VAPID public key %s (sub %s)", vapid.public_key,
                 config.unifiedpush.vapid_subject)
        senders["unifiedpush"] = UnifiedPushSender(
            config.unifiedpush.allow_private_endpoints, timeout, vapid
        )
