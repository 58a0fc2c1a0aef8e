"""The charts take relay URLs from the network: hostile ones must not break the report."""

from __future__ import annotations

import base64
import importlib
from types import ModuleType

import pytest

HOSTILE = "wss://$\\frac{x$.example/<script>"
LONG = "wss://" + "a" * 300 + ".example"


def _png(uri: str) -> bytes:
    prefix = "data:image/png;base64,"
    assert uri.startswith(prefix)
    return base64.b64decode(uri[len(prefix):])


@pytest.fixture(scope="module")
def charts() -> ModuleType:
    """`analytics.charts`, imported when the test runs: matplotlib costs seconds that every
    xdist worker would otherwise pay while collecting."""
    return importlib.import_module("analytics.charts")


def test_math_text_and_long_urls_are_drawn_literally(charts: ModuleType) -> None:
    """A `$...$` would be parsed as a (here malformed) matplotlib formula and fail the
    figure; a 300-character URL would squeeze the plot to nothing."""
    assert charts.relay_labels([HOSTILE, LONG]) == [
        "wss://\\$\\frac{x\\$.example/<script>",
        LONG[: charts.MAX_LABEL - 1] + "\u2026",
    ]
    relays = [HOSTILE, LONG]
    for uri in (
        charts.latency_chart(relays, [1, 2], [3, 4], [5, 6]),
        charts.canary_chart(relays, [0.5, 1.0], [100, None], [900, None]),
        charts.miss_rate_chart(relays, ["2026-11-21T10:00:00Z"], [[0.5], [None]]),
    ):
        assert _png(uri).startswith(b"\x89PNG")
