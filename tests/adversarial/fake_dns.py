"""A DNS server on 127.0.0.1 for the guard's resolver (c-ares, pointed here with
`outbound.use_nameservers`): A records from a table, NXDOMAIN for other names, and names it
never answers (a hostile name server), counting every query it receives."""

from __future__ import annotations

import asyncio
import ipaddress
import struct
from collections import Counter
from types import TracebackType
from typing import Self

A, AAAA = 1, 28


class FakeDns(asyncio.DatagramProtocol):
    def __init__(self, records: dict[str, list[str]], silent: set[str] | None = None) -> None:
        self.records = records
        self.silent = silent or set()
        self.queries: Counter[str] = Counter()
        self.port = 0
        self._transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]  # a datagram endpoint's

    def datagram_received(self, data: bytes, addr: tuple[str | int, ...]) -> None:
        labels, offset = [], 12
        while data[offset]:
            length = data[offset]
            labels.append(data[offset + 1 : offset + 1 + length].decode())
            offset += 1 + length
        qtype = struct.unpack("!H", data[offset + 1 : offset + 3])[0]
        question = data[12 : offset + 5]
        name = ".".join(labels).lower()
        self.queries[name] += 1
        if name in self.silent or self._transport is None:
            return
        answers = [
            address for address in self.records.get(name, [])
            if (ipaddress.ip_address(address).version == 4) == (qtype == A)
        ] if qtype in (A, AAAA) else []
        flags = 0x8180 if name in self.records else 0x8183  # NOERROR / NXDOMAIN
        reply = data[:2] + struct.pack("!HHHHH", flags, 1, len(answers), 0, 0) + question
        for address in answers:
            packed = ipaddress.ip_address(address).packed
            reply += struct.pack("!HHHIH", 0xC00C, qtype, 1, 60, len(packed)) + packed
        self._transport.sendto(reply, addr)

    @property
    def server(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def __aenter__(self) -> Self:
        transport, _ = await asyncio.get_running_loop().create_datagram_endpoint(
            lambda: self, local_addr=("127.0.0.1", 0)
        )
        self.port = transport.get_extra_info("sockname")[1]
        return self

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self._transport is not None:
            self._transport.close()
