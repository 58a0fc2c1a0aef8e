"""Fixtures for the analytics tests: one local Spark session shared by all, and a log folder."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from _pytest.mark.expression import Expression

from testkit.spark_jvm import use_quick_jvms
from tests.analytics.observation_logs import ObservationLog

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

SPARK_MODULE = "pytestmark = pytest.mark.spark"
"""How a module says all its tests run Spark (so all are `slow`, see tests/conftest.py)."""


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "spark: needs a local SparkSession (PySpark and Java 17)")
    # Every JVM these tests start (the session's, the CLI's, a cluster's) inherits it.
    use_quick_jvms()


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """A run that deselects `slow` (`-m "not slow"`) need not import the Spark modules: all
    their tests are slow, and importing them (PySpark, matplotlib, the jobs) costs each xdist
    worker about ten seconds of a loaded machine. Whatever other marks a test has, the
    expression must leave it out either way."""
    expression = config.getoption("markexpr", "")
    if not expression or collection_path.suffix != ".py":
        return None
    if not collection_path.name.startswith("test_"):
        return None
    if SPARK_MODULE not in collection_path.read_text(encoding="utf-8"):
        return None
    compiled = Expression.compile(expression)
    kept = any(compiled.evaluate(_marked_slow(other)) for other in (False, True))
    return True if not kept else None


def _marked_slow(other: bool) -> Callable[..., bool]:
    """A mark matcher for a test marked `slow` and `spark`, and `other` for any further mark."""

    def matches(name: str, /, **kwargs: object) -> bool:
        return name in ("slow", "spark") or other

    return matches


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    """One ``local[1]`` session for every test: starting Spark costs 5-8 s each time.

    The jobs reuse an active session, so ``run_all`` runs in this one too. The logs here
    are tiny, so what costs is Spark's per-query machinery, not data: adaptive execution
    splits each query into a job per stage (a `run_all` made 110 jobs with it, 49 without),
    whole-stage code generation compiles Java source for every new plan, and each partition
    of a stage is a task of its own (one partition instead of two took the group's JVM from
    128 to 91 CPU-seconds). None of that changes a result; `sigil-push analytics` keeps
    Spark's defaults, and tests/analytics/test_cluster.py checks that a cluster's four
    shuffle partitions give the same bytes as a ``local[2]`` run.
    """
    from pyspark.sql import SparkSession  # here: only runs that keep Spark tests pay for it

    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    session = (
        SparkSession.builder.master("local[1]")
        .appName("sigil-push analytics tests")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "1")
        .config("spark.default.parallelism", "1")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.sql.adaptive.enabled", "false")
        .config("spark.sql.codegen.wholeStage", "false")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


@pytest.fixture
def log(tmp_path: Path) -> ObservationLog:
    return ObservationLog(tmp_path / "observations")
