"""`/metrics` of a worker: every sample carries `worker="<id>"`, added once at exposition.

Real prometheus_client metrics in a registry of the test's own, exposed through
`WorkerLabelled` and read back with the Prometheus text parser (and `promtool check metrics`
when it is installed): the label reaches counters, gauges, histograms and labelled children
alike, a series that names its worker already keeps its own, and one SQLite process (no
worker id) is exposed unchanged.
"""

from __future__ import annotations

import shutil
import subprocess

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from sigil_push.http.worker_metrics import WorkerLabelled
from testkit.deadlines import COMMAND_SECONDS, scaled


def registry() -> CollectorRegistry:
    made = CollectorRegistry()
    Counter("demo_pushes", "Pushes", ["provider"], registry=made).labels("apns").inc(3)
    Gauge("demo_depth", "Depth", registry=made).set(7)
    Histogram("demo_latency_seconds", "Latency", registry=made).observe(0.2)
    Gauge("demo_shards", "Shards of a worker", ["worker"], registry=made).labels("w-old").set(4)
    return made


def samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    return [
        (sample.name, dict(sample.labels), sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    ]


def test_every_sample_is_labelled_with_the_worker() -> None:
    text = generate_latest(WorkerLabelled(lambda: "host-1-ab12", registry())).decode()
    exposed = samples(text)
    assert {name for name, _, _ in exposed} >= {
        "demo_pushes_total", "demo_depth", "demo_latency_seconds_bucket",
        "demo_latency_seconds_sum", "demo_latency_seconds_count",
    }
    for name, labels, _ in exposed:
        expected = "w-old" if name == "demo_shards" else "host-1-ab12"
        assert labels.get("worker") == expected, (name, labels)
    assert ("demo_pushes_total", {"provider": "apns", "worker": "host-1-ab12"}, 3.0) in exposed
    if shutil.which("promtool"):
        checked = subprocess.run(
            ["promtool", "check", "metrics"], input=text.encode(), capture_output=True,
            timeout=scaled(COMMAND_SECONDS), check=False,
        )
        assert checked.returncode == 0, checked.stdout + checked.stderr


def test_one_sqlite_process_is_exposed_unchanged() -> None:
    made = registry()
    assert generate_latest(WorkerLabelled(lambda: "", made)) == generate_latest(made)


def test_the_id_is_read_at_each_scrape() -> None:
    """The worker id exists only once the service has opened its store."""
    current = {"id": ""}
    exposition = WorkerLabelled(lambda: current["id"], registry())
    assert all("worker" not in labels or labels["worker"] == "w-old"
               for _, labels, _ in samples(generate_latest(exposition).decode()))
    current["id"] = "host-77-0f0f0f"
    assert all(labels["worker"] in ("host-77-0f0f0f", "w-old")
               for _, labels, _ in samples(generate_latest(exposition).decode()))
