"""The per-provider concurrency cap: never more sends at once than the limit, waiting sends go
in arrival order, and a send cancelled while it waits (or just as its turn came) loses no slot.

A scripted provider stands in for a real one here: what is checked is the cap around it."""

from __future__ import annotations

import asyncio

from sigil_push.push.base import Outcome, Status, WakeupMessage
from sigil_push.push.limits import ConcurrencyLimited
from sigil_push.store.records import Device

MESSAGE = WakeupMessage(("0" * 64,), {"type": "wakeup"}, "c" * 32, 60, True)


def device(number: int) -> Device:
    return Device(number, "ab" * 32, "ios", f"{number:064x}", "opaque", (), None, 0)


class Gated:
    """A provider whose sends wait until the test releases them, recording what is in flight."""

    platform, provider, max_concurrency = "ios", "dryrun", 1000

    def __init__(self) -> None:
        self.running: list[int] = []
        self.started: list[int] = []
        self.most = 0
        self.gates: dict[int, asyncio.Event] = {}

    def fits(self, data: dict[str, str]) -> bool:
        return True

    async def send(self, message: WakeupMessage, device: Device) -> Outcome:
        self.started.append(device.id)
        self.running.append(device.id)
        self.most = max(self.most, len(self.running))
        gate = self.gates.setdefault(device.id, asyncio.Event())
        await gate.wait()
        self.running.remove(device.id)
        return Outcome(Status.ACCEPTED)

    async def close(self) -> None:
        pass


async def until(check: object) -> None:
    for _ in range(1000):
        if check():  # type: ignore[operator]
            return
        await asyncio.sleep(0)
    raise AssertionError("condition never held")


async def test_sends_beyond_the_limit_wait_in_order_and_cancellation_loses_no_slot() -> None:
    inner = Gated()
    limited = ConcurrencyLimited(inner, 2)
    sends = {n: asyncio.create_task(limited.send(MESSAGE, device(n))) for n in range(1, 6)}
    await until(lambda: inner.started == [1, 2])

    sends[3].cancel()  # cancelled while waiting: 4 and 5 keep their places
    inner.gates[1].set()
    await until(lambda: inner.started == [1, 2, 4])
    assert sends[1].done() and sends[3].cancelled()

    inner.gates[2].set()  # hands its slot to 5, which is cancelled before it runs
    await until(lambda: sends[2].done())
    sends[5].cancel()
    await asyncio.gather(sends[5], return_exceptions=True)
    after = asyncio.create_task(limited.send(MESSAGE, device(6)))
    await until(lambda: inner.started == [1, 2, 4, 6])  # 5's slot came back

    for n in (4, 6):
        inner.gates[n].set()
    await asyncio.gather(sends[4], after)
    assert inner.most == 2
    assert limited._sending == 0 and not limited._waiting
