"""A hostile NIP-77 relay (issue 34, item 1), in a thread with its own event loop
(`testkit.threaded_relay`): it answers
REQ with EOSE, as an ordinary relay with nothing stored would, and every NEG-OPEN and NEG-MSG
with the message `payload()` builds, whatever it was sent, so the exchange goes on as long as
the bridge answers. The bridge under test (a `sigil-push serve` process, or the test's own
loop) pays for reading what it sends; building it is paid here."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any, Self

from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed

from sigil_push.nostr.nip77 import INFINITY, PROTOCOL_VERSION, encode_varint
from testkit.threaded_relay import ThreadedRelay

SKIP, FINGERPRINT = 0, 1


def skips_then_a_mismatch(skips: int) -> bytes:
    """The attack measured: `skips` Skip ranges (bounds one second apart, three bytes each)
    and one fingerprint that matches nothing, to keep the exchange going."""
    one_skip = encode_varint(2) + encode_varint(0) + encode_varint(SKIP)
    return (bytes([PROTOCOL_VERSION]) + one_skip * skips
            + encode_varint(0) + encode_varint(0) + encode_varint(FINGERPRINT) + bytes(16))


def mismatches(bounds: list[int]) -> bytes:
    """Fingerprints matching nothing, up to each timestamp of `bounds` (rising), the last up
    to infinity: an answer an honest relay could give, every round, forever."""
    out = bytearray([PROTOCOL_VERSION])
    previous = 0
    for bound in [*bounds, INFINITY]:
        delta = 0 if bound == INFINITY else bound - previous + 1
        out += encode_varint(delta) + encode_varint(0) + encode_varint(FINGERPRINT) + b"\x5a" * 16
        previous = bound
    return bytes(out)


class NegentropyFlooder(ThreadedRelay):
    def __init__(self, payload: Callable[[], bytes], drop_first: bool = False) -> None:
        """`drop_first`: close the first connection a second after its first EOSE (the key
        is baselined then), so the bridge reconnects and catches up with NIP-77."""
        super().__init__()
        self.payload = payload
        self.drop_first = drop_first
        self.connections = 0
        self.received: list[list[Any]] = []
        """Every frame the bridge sent (decoded)."""
        self._message = ""

    def sent(self, verb: str) -> list[list[Any]]:
        return [frame for frame in list(self.received) if frame[:1] == [verb]]

    def start(self) -> Self:
        self._message = self.payload().hex()
        return super().start()

    async def handle(self, ws: ServerConnection) -> None:
        self.connections += 1
        first = self.connections == 1
        try:
            async for raw in ws:
                frame = json.loads(raw)
                self.received.append(frame)
                if frame[0] == "REQ":
                    await ws.send(json.dumps(["EOSE", frame[1]]))
                    if first and self.drop_first:
                        await asyncio.sleep(1.0)
                        await ws.close()
                        return
                elif frame[0] in ("NEG-OPEN", "NEG-MSG"):
                    await ws.send(json.dumps(["NEG-MSG", frame[1], self._message]))
        except ConnectionClosed:
            pass
