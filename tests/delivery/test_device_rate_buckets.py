"""The per-device rate buckets stay as small as the devices they hold (issue 22): pruning
rebuilds the dict, as the other bucket maps do, instead of deleting from it. A dict that has
keys deleted as fast as new ones arrive keeps the deleted slots until its entries run out and
then resizes to a table for three times its live keys, a step of memory long after it reached
its steady size."""

from __future__ import annotations

import tracemalloc

from sigil_push.delivery.device_rate import DeviceRateLimiter

DEVICES = 5_000
CYCLE_MS = 120_000  # longer than a bucket takes to refill (per_minute=1: one minute)


def test_device_buckets_do_not_grow_under_steady_churn() -> None:
    """Each cycle a fresh set of devices is pushed to and the last cycle's, full again, are
    pruned: the live count is the same every cycle, and so is the memory it takes (measured
    +112 bytes over 1.27 MB; deleting instead of rebuilding grew it by 296 KB over 1.42 MB,
    its table doubling in the third cycle)."""
    limiter = DeviceRateLimiter(per_minute=1)

    def cycle(number: int) -> None:
        now = number * CYCLE_MS
        for device in range(number * DEVICES, (number + 1) * DEVICES):
            limiter.spend(("fcm", f"token-{device:012d}"), now)
        limiter.prune(now)
        assert limiter.available(("fcm", f"token-{number * DEVICES:012d}"), now) == 0

    tracemalloc.start()
    try:
        for number in range(2):
            cycle(number)
        steady = tracemalloc.get_traced_memory()[0]
        highest = steady
        for number in range(2, 30):
            cycle(number)
            highest = max(highest, tracemalloc.get_traced_memory()[0])
    finally:
        tracemalloc.stop()
    assert highest - steady < steady // 50, f"grew {highest - steady} bytes over {steady}"
