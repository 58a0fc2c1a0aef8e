"""Progress lines on stderr, so an operator sees which job is running and how long each took."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager


def progress(message: str) -> None:
    print(f"analytics: {message}", file=sys.stderr, flush=True)


@contextmanager
def step(name: str) -> Iterator[None]:
    """Announce ``name``, run the block, then report its wall time."""
    started = time.monotonic()
    progress(f"{name} ...")
    yield
    progress(f"{name} done in {time.monotonic() - started:.1f} s")
