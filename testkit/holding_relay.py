"""A thin protocol layer in front of a real relay that leaves some REQs unanswered.

While `holding` is set, a client's REQ whose subscription id starts with `prefix` is swallowed:
the relay never sees it, so it gets no stored events, no EOSE and no CLOSED, as from a relay
still working through a large answer or one that never sends EOSE at all. Its id joins `held`.
Every other frame passes both ways, and `cut` drops every client connection
(testkit.loopback_relay.ProxyRelay).
"""

from __future__ import annotations

import json
from typing import Any

from websockets.asyncio.server import ServerConnection

from testkit.loopback_relay import ProxyRelay


class HoldingRelay(ProxyRelay):
    def __init__(self, upstream: str, prefix: str) -> None:
        super().__init__(upstream)
        self.prefix = prefix
        self.holding = False
        self.held: list[str] = []
        """Subscription ids of the REQs swallowed, in order."""
        self.passed: list[str] = []
        """Subscription ids of the REQs with `prefix` handed on to the relay, in order."""

    def _serve_options(self) -> dict[str, Any]:
        return {"max_size": None}

    async def client_frame(self, ws: ServerConnection, frame: str | bytes) -> bool:
        message = json.loads(frame)
        if (
            isinstance(message, list) and len(message) > 1 and message[0] == "REQ"
            and isinstance(message[1], str) and message[1].startswith(self.prefix)
        ):
            if self.holding:
                self.held.append(message[1])
                return False
            self.passed.append(message[1])
        return True
