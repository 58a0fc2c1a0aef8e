"""`sigil-push analytics --master spark://…` on a real standalone cluster gives the same
outputs, byte for byte, as the ``local[2]`` run on the same log, and the command says what it
read as a user sees it (this is also the test of the command's whole run: one driver JVM fewer
in the suite than a separate local run of the command).

It takes no `spark` fixture, so it stays out of the xdist group of the tests sharing that one
session: its cluster and its own local session run beside that group instead of adding the
suite's longest test to the group's serial time."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from analytics.run import run_all
from analytics.session import analytics_session
from testkit.deadlines import JVM_SECONDS, scaled
from testkit.spark_cluster import StandaloneCluster
from tests.analytics.observation_logs import CONTRACT_COLUMNS, T0, ObservationLog, network_log

pytestmark = pytest.mark.spark

REPO = Path(__file__).resolve().parents[2]


def test_standalone_cluster_matches_local(tmp_path: Path) -> None:
    with analytics_session("local[2]") as spark:
        _cluster_matches_local(spark, tmp_path)


def _cluster_matches_local(spark: SparkSession, tmp_path: Path) -> None:
    log = ObservationLog(tmp_path / "observations")
    network_log(log, relays=12, dms=150, hours=2)
    log.write(T0.strftime("%Y%m%dT%H"), ["{not json"])
    local_out, cluster_out = tmp_path / "local", tmp_path / "cluster"

    # As an operator would tune a small cluster: spark-defaults.conf in SPARK_CONF_DIR.
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "spark-defaults.conf").write_text(
        "spark.sql.shuffle.partitions 4\nspark.ui.enabled false\nspark.executor.memory 512m\n"
    )
    cluster = StandaloneCluster(tmp_path / "spark", cores=1, memory="512m")
    try:
        master = cluster.start_master()
        cluster.start_worker()  # its JVM starts while the driver's does
        env = {
            **cluster.env(),
            "PYTHONPATH": str(REPO),
            "SPARK_CONF_DIR": str(conf),
        }
        driver = subprocess.Popen(
            [sys.executable, "-m", "sigil_push", "analytics", "--master", master,
             "--input", log.path, "--output", str(cluster_out)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path,
        )
        try:
            cluster.wait_for_worker()
            # Meanwhile, the reference run in this process's local[2] session.
            run_all(log.path, str(local_out))
            stdout, stderr = driver.communicate(timeout=scaled(2 * JVM_SECONDS))
        finally:
            if driver.poll() is None:
                driver.kill()
                driver.wait()
        assert driver.returncode == 0, stderr[-3000:]
        assert "(1 corrupt lines," in stdout, stdout
        # The work really ran on the worker: it launched an executor for the application.
        assert list((tmp_path / "spark" / "work").glob("app-*/*/stderr"))
    finally:
        cluster.stop()

    local_files = sorted(p.name for p in local_out.iterdir() if p.suffix in (".csv", ".html"))
    cluster_files = sorted(p.name for p in cluster_out.iterdir() if p.suffix in (".csv", ".html"))
    assert local_files == cluster_files
    assert set(CONTRACT_COLUMNS) <= set(local_files)
    assert (cluster_out / "report.html").read_text().count("<table") >= 3
    for name in local_files:
        assert (cluster_out / name).read_bytes() == (local_out / name).read_bytes(), name
    canary_rows = (local_out / "canary.csv").read_text().splitlines()
    assert len(canary_rows) == 13
    for name in local_files:
        if name.endswith(".csv"):
            table = name.replace(".csv", ".parquet")
            assert spark.read.parquet(str(cluster_out / table)).collect() == spark.read.parquet(
                str(local_out / table)
            ).collect(), table
