"""Builds the sender for each platform the configuration enables."""

from __future__ import annotations

from sigil_push.config import Config
from sigil_push.push.base import Sender
from sigil_push.push.dryrun import DryRunSender


async def build_senders(config: Config) -> dict[str, Sender]:
    """One sender per accepted platform; dry-run instances log instead of sending."""
    if config.dry_run:
        return {platform: DryRunSender(platform) for platform in config.platforms}
    raise NotImplementedError("push providers arrive with the push-delivery issue")
