"""Learned NIP-42 modes of gated relays, kept in the store (`AuthModeStore`, per engine).

`UserInboxes` learns per relay whether it keeps one authenticated key per connection or
several, at the cost of a probe connection and one extra signer request. Saving the verdict
spares every restart (and every other worker) that probe. A verdict older than MAX_AGE_SECONDS
is not loaded, so a relay that changed software is learned again; a saved `multi` that turns
out wrong is corrected on the spot by the usual fall-back to `single` (and saved as such).
"""

from __future__ import annotations

import logging
import time
from typing import Literal

from sigil_push.store.errors import STORE_UNAVAILABLE
from sigil_push.store.interface import AuthModeStore

log = logging.getLogger(__name__)

LearnedMode = Literal["single", "multi"]
MAX_AGE_SECONDS = 30 * 86400


class LearnedAuthModes:
    def __init__(self, rows: AuthModeStore) -> None:
        self._rows = rows

    async def load(self, now: float | None = None) -> dict[str, LearnedMode]:
        """The verdicts younger than MAX_AGE_SECONDS, by relay URL."""
        since = int(now if now is not None else time.time()) - MAX_AGE_SECONDS
        modes = await self._rows.modes_since(since)
        return {relay: "multi" if mode == "multi" else "single" for relay, mode in modes.items()}

    async def save(self, relay: str, mode: LearnedMode) -> None:
        """Record a verdict; a store outage only costs a probe after the next restart."""
        try:
            await self._rows.save_mode(relay, mode, int(time.time()))
        except STORE_UNAVAILABLE as error:
            log.warning("learned AUTH mode of a relay not saved: %s", type(error).__name__)
