"""Fixtures for the analytics tests: one local Spark session shared by all, and a log folder."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from tests.analytics.observation_logs import ObservationLog


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "spark: needs a local SparkSession (PySpark and Java 17)")


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    """One ``local[2]`` session for every test: starting Spark costs 5-8 s each time.

    The jobs reuse an active session, so ``run_all`` runs in this one too.
    """
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    session = (
        SparkSession.builder.master("local[2]")
        .appName("sigil-push analytics tests")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")  # one per core of local[2]
        .config("spark.sql.session.timeZone", "UTC")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


@pytest.fixture
def log(tmp_path: Path) -> ObservationLog:
    return ObservationLog(tmp_path / "observations")
