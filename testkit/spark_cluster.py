"""A real Spark standalone cluster (one master, one worker) from the installed PySpark.

PySpark's pip distribution ships the whole Spark runtime, including ``bin/spark-class``, so a
test or the benchmark can run the jobs against ``spark://`` exactly as an operator's cluster
would: separate master, worker and executor JVMs, shuffles over the network (loopback here).
Everything binds to 127.0.0.1 on ports the OS picks.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType

import pyspark

from testkit.deadlines import JVM_SECONDS, STOP_SECONDS, scaled

SPARK_HOME = Path(pyspark.__file__).resolve().parent
_MASTER_URL = re.compile(r"Starting Spark master at (spark://127\.0\.0\.1:\d+)")
_REGISTERED = "Successfully registered with master"


class StandaloneCluster:
    """``with StandaloneCluster(dir, cores=1, memory="1g") as master_url: ...``

    The worker offers ``cores`` and ``memory`` to applications; an application's executors
    must fit (``spark.executor.memory`` defaults to 1g). Both daemons are started in their own
    process group and stopped with it, executors included.
    """

    def __init__(self, directory: Path, cores: int = 1, memory: str = "1g") -> None:
        self.directory = directory
        self.cores = cores
        self.memory = memory
        self.processes: list[subprocess.Popen[bytes]] = []
        self.url = ""

    def env(self) -> dict[str, str]:
        """The environment for the daemons, and for a driver that talks to them."""
        return {
            **os.environ,
            "SPARK_HOME": str(SPARK_HOME),
            "SPARK_LOCAL_IP": "127.0.0.1",
            "SPARK_DAEMON_MEMORY": "256m",
            # Executors start Python workers only for Python-side data; use this interpreter.
            "PYSPARK_PYTHON": sys.executable,
        }

    def _start(self, name: str, *args: str) -> Path:
        log = self.directory / f"{name}.log"
        with log.open("wb") as handle:
            process = subprocess.Popen(
                [str(SPARK_HOME / "bin" / "spark-class"), *args],
                stdout=handle,
                stderr=subprocess.STDOUT,
                env=self.env(),
                cwd=self.directory,
                start_new_session=True,
            )
        self.processes.append(process)
        return log

    def _wait_for(self, log: Path, pattern: re.Pattern[str] | str) -> str:
        deadline = time.monotonic() + scaled(JVM_SECONDS)
        while time.monotonic() < deadline:
            text = log.read_text(errors="replace")
            found = pattern.search(text) if isinstance(pattern, re.Pattern) else None
            if found is not None:
                return found.group(1)
            if isinstance(pattern, str) and pattern in text:
                return pattern
            if any(p.poll() is not None for p in self.processes):
                break
            time.sleep(0.2)
        raise RuntimeError(f"{log.name}: {log.read_text(errors='replace')[-3000:]}")

    def start_master(self) -> str:
        """Start the master and return its URL; a driver may connect from now on."""
        self.directory.mkdir(parents=True, exist_ok=True)
        master_log = self._start(
            "master", "org.apache.spark.deploy.master.Master",
            "--host", "127.0.0.1", "--port", "0", "--webui-port", "0",
        )
        self.url = self._wait_for(master_log, _MASTER_URL)
        return self.url

    def start_worker(self) -> None:
        """Start the worker without waiting for it: a driver that starts meanwhile waits for
        the worker's executor by itself, so the two JVMs start side by side."""
        self._start(
            "worker", "org.apache.spark.deploy.worker.Worker",
            "--host", "127.0.0.1", "--port", "0", "--webui-port", "0",
            "--cores", str(self.cores), "--memory", self.memory,
            "--work-dir", str(self.directory / "work"), self.url,
        )

    def wait_for_worker(self) -> None:
        self._wait_for(self.directory / "worker.log", _REGISTERED)

    def start(self) -> str:
        self.start_master()
        self.start_worker()
        self.wait_for_worker()
        return self.url

    def stop(self) -> None:
        """Stop the worker (and its executors), then the master: each one's process group."""
        for process in reversed(self.processes):
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=scaled(STOP_SECONDS))
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        self.processes.clear()

    def __enter__(self) -> str:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.stop()
