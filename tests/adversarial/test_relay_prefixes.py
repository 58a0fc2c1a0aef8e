"""A relay's CLOSED and NOTICE texts are free text it chooses; only their NIP-01 prefix
(`auth-required`, `restricted`, …) reaches our logs. A hostile relay that writes something
else before the colon (here the hex of the key it was asked about) gets it treated as no
prefix, so it can't plant a subscribed pubkey in the bridge's logs. A real `RelayConnection`
against a loopback relay in the test's loop; no store."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
from websockets.asyncio.server import ServerConnection

from sigil_push.nostr.keys import SecretKey
from tests.adversarial.hostile import HostileRelay, bridge_connection, eventually, hostile_relay

PUBKEY_HEX = SecretKey.generate().public_key_hex


async def test_text_before_a_colon_that_is_no_prefix_stays_out_of_the_logs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def quoting(relay: HostileRelay, ws: ServerConnection, frame: Any) -> None:
        if frame[0] == "REQ":
            await ws.send(json.dumps(["NOTICE", f"{PUBKEY_HEX[:40]}: is watched"]))
            await ws.send(json.dumps(["CLOSED", frame[1], f"{PUBKEY_HEX[:40]}: closed"]))
            await ws.send(json.dumps(["NOTICE", "rate-limited: slow down"]))

    caplog.set_level(logging.DEBUG, logger="sigil_push.relays.connection")
    async with hostile_relay(quoting) as relay, bridge_connection(relay, tmp_path):
        # the last frame's prefix is logged: every frame before it has been handled
        await eventually(lambda: "(rate-limited)" in caplog.text, "the real prefix logged")
    assert "closed a subscription (no reason)" in caplog.text
    assert PUBKEY_HEX[:16] not in caplog.text
