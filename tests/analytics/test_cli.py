"""`sigil-push analytics` as a user runs it: a real process. Its refusals come before Spark
starts; its whole run, with its own Spark session, is checked on a standalone cluster against a
local run (`test_cluster.py`)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from analytics.duration import parse_duration_ms
from analytics.preflight import local_path
from testkit.deadlines import COMMAND_SECONDS, scaled

pytestmark = pytest.mark.spark


def _without_java(tmp_path: Path) -> dict[str, str]:
    """An environment in which starting Spark's JVM fails: a usage error must not need it."""
    return {**os.environ, "JAVA_HOME": str(tmp_path / "no-java")}


def test_cli_missing_input_exits_2_before_starting_spark(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "sigil_push", "analytics", "--master", "local[1]",
         "--input", str(tmp_path / "absent"), "--output", str(tmp_path / "out")],
        check=False, capture_output=True, text=True, timeout=scaled(COMMAND_SECONDS), env=_without_java(tmp_path),
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip() == f"sigil-push: --input: {tmp_path / 'absent'} does not exist"
    assert not (tmp_path / "out").exists()


def test_cli_inverted_window_exits_2_before_starting_spark(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "sigil_push", "analytics", "--input", str(tmp_path),
         "--output", str(tmp_path / "out"),
         "--since", "2026-11-21T11:00:00Z", "--until", "2026-11-21T10:00:00Z"],
        check=False, capture_output=True, text=True, timeout=scaled(COMMAND_SECONDS), env=_without_java(tmp_path),
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip() == "sigil-push: --since must be before --until"


@pytest.mark.parametrize(
    ("path", "local"),
    [("/var/log/sigil", "/var/log/sigil"), ("logs", "logs"), ("file:/var/log", "/var/log"),
     ("file:///var/log", "/var/log"), ("file://localhost/var/log", "/var/log"),
     ("hdfs://namenode:8020/logs", None), ("s3a://bucket/logs", None)],
)
def test_only_paths_on_the_local_disk_are_checked_without_spark(
    path: str, local: str | None
) -> None:
    assert local_path(path) == (None if local is None else Path(local))


# Loaded as sitecustomize by the child interpreter: makes the analytics extra look absent,
# the way a plain `pip install .` leaves it, without touching our code.
BLOCKER = '''
import sys

class _NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("pyspark", "matplotlib", "numpy"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, _NotInstalled())
'''


def test_cli_without_the_analytics_extra_exits_2_naming_the_install(tmp_path: Path) -> None:
    blocker = tmp_path / "site"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(BLOCKER)
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(blocker), str(repo)])}
    result = subprocess.run(
        [sys.executable, "-m", "sigil_push", "analytics",
         "--input", str(tmp_path), "--output", str(tmp_path / "out")],
        check=False, capture_output=True, text=True, timeout=scaled(COMMAND_SECONDS), env=env,
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install '.[analytics]'" in lines[0], result.stderr
    assert not (tmp_path / "out").exists()
    # The bridge never needs the extra: every module of sigil_push imports without it.
    every_module = (
        "import importlib, pkgutil, sigil_push\n"
        "for m in pkgutil.walk_packages(sigil_push.__path__, 'sigil_push.'):\n"
        "    if not m.name.endswith('__main__'):\n"
        "        importlib.import_module(m.name)\n"
        "import pyspark"
    )
    imported = subprocess.run(
        [sys.executable, "-c", every_module],
        check=False, capture_output=True, text=True, timeout=scaled(COMMAND_SECONDS), env=env,
    )
    assert imported.returncode == 1
    assert imported.stderr.strip().splitlines()[-1] == "ModuleNotFoundError: No module named 'pyspark'"


def test_cli_rejects_a_bad_grace_with_exit_2(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "sigil_push", "analytics", "--grace", "soon",
         "--input", str(tmp_path), "--output", str(tmp_path / "out")],
        check=False, capture_output=True, text=True, timeout=scaled(COMMAND_SECONDS),
    )
    assert result.returncode == 2
    assert "--grace" in result.stderr and "soon" in result.stderr


@pytest.mark.parametrize(
    ("text", "ms"),
    [("120", 120_000), ("90s", 90_000), ("2m", 120_000), ("1.5min", 90_000), ("1h", 3_600_000),
     ("500ms", 500), ("0", 0)],
)
def test_grace_durations(text: str, ms: int) -> None:
    assert parse_duration_ms(text) == ms


@pytest.mark.parametrize("text", ["", "-5s", "2 weeks", "1e3", "25h"])
def test_bad_grace_durations(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        parse_duration_ms(text)
