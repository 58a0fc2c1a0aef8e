"""The bridge's frame-to-outbox histogram is observed a commit batch at a time
(`BatchHistogram`): its exposition must be exactly what prometheus_client's own Histogram
gives for the same values, every observation counted."""

from __future__ import annotations

import random

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from sigil_push.bridge.metrics import LATENCY
from sigil_push.telemetry.batch_histogram import BatchHistogram

BOUNDS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)


def _lines(registry: CollectorRegistry) -> list[str]:
    return [
        line for line in generate_latest(registry).decode().splitlines()
        if not line.startswith("#") and "_created" not in line
    ]


def test_batches_expose_what_a_histogram_observing_each_value_exposes() -> None:
    values = [0.0, 0.001, 0.0010001, 0.002, 2.5, 10.0, 10.5, 1e6]
    rng = random.Random(7)
    values += [rng.uniform(0, 12) for _ in range(500)]
    batched, single = CollectorRegistry(), CollectorRegistry()
    histogram = BatchHistogram("x_seconds", "x", BOUNDS, registry=batched)
    reference = Histogram("x_seconds", "x", buckets=BOUNDS, registry=single)
    for start in range(0, len(values), 64):  # in batches, one of them empty
        histogram.observe_many(values[start:start + 64])
        histogram.observe_many([])
    for value in values:
        reference.observe(value)
    assert _lines(batched) == _lines(single)
    assert f"x_seconds_count {float(len(values))}" in _lines(batched)


def test_the_bridge_latency_is_a_batch_histogram_under_its_name() -> None:
    assert isinstance(LATENCY, BatchHistogram)
    registry = CollectorRegistry()
    latency = BatchHistogram("sigil_push_bridge_frame_to_outbox_seconds", "x", BOUNDS,
                             registry=registry)
    latency.observe_many([0.003])
    assert registry.get_sample_value(
        "sigil_push_bridge_frame_to_outbox_seconds_bucket", {"le": "0.005"}
    ) == 1.0
    assert registry.get_sample_value(
        "sigil_push_bridge_frame_to_outbox_seconds_bucket", {"le": "0.002"}
    ) == 0.0
