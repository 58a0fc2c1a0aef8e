"""Parsing ``--grace``-style durations: ``120``, ``90s``, ``2m``, ``1h``, ``500ms``.

Pure Python on purpose: ``sigil-push``'s argument parser uses it before it knows whether the
analytics extra (PySpark) is installed.
"""

from __future__ import annotations

import argparse
import re

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|min|h)?\s*$")
_UNIT_MS = {"ms": 1, "s": 1000, "m": 60_000, "min": 60_000, "h": 3_600_000}
# How long after an event's first arrival another relay may deliver it and still count as
# having delivered it (``--grace``'s default).
DEFAULT_GRACE_MS = 120_000
# A day is far beyond any relay's honest delay; more would make every miss invisible.
MAX_DURATION_MS = 86_400_000


def parse_duration_ms(value: str) -> int:
    """Milliseconds of a duration: a number with an optional unit (ms, s, m/min, h; default s).

    Raises ``argparse.ArgumentTypeError`` (argparse turns it into exit 2 naming the option).
    """
    match = _DURATION.match(value)
    if match is None:
        raise argparse.ArgumentTypeError(
            f"not a duration: {value!r} (use e.g. 120, 90s, 2m, 1h or 500ms)"
        )
    ms = round(float(match.group(1)) * _UNIT_MS[match.group(2) or "s"])
    if ms > MAX_DURATION_MS:
        raise argparse.ArgumentTypeError(f"duration {value!r} is longer than a day")
    return ms
