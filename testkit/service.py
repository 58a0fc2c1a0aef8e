"""`sigil-push serve` as a real process with its own config, database and observation log."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Self

from testkit.deadlines import REQUEST_SECONDS, STARTUP_SECONDS, STOP_SECONDS, scaled
from testkit.observations import observation_records
from testkit.relay import free_port


class ServiceProcess:
    def __init__(
        self,
        folder: Path,
        relays: Sequence[str] = (),
        extra_toml: str = "",
        limits: str = "",
        insecure_relays: bool = True,
        database: str = "sigil-push.db",
    ) -> None:
        """`database` is the `server.database` value: a SQLite file (relative: in `folder`) or
        a `postgresql://` URL (testkit.stores.Engine.database gives either)."""
        self.folder = folder
        self.folder.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.admin_port = free_port()
        self.admin_url = f"http://127.0.0.1:{self.admin_port}"
        """The operator listener: /metrics and /health with per-relay detail."""
        self.config_path = folder / "relays.toml"
        self.log_path = folder / "service.log"
        self.database = ""
        """Where the store is, for tests that read it directly (testkit.stores.fetch,
        opened): the SQLite file's absolute path or the PostgreSQL URL."""
        self.observations = folder / "observations"
        self._process: subprocess.Popen[bytes] | None = None
        no_limits = "requests_per_minute_per_ip = 0\nrequests_per_minute_per_npub = 0"
        relay_tables = "".join(f'\n[[relay]]\nurl = "{url}"\n' for url in relays)
        self.config_path.write_text(
            "[server]\n"
            f'listen = "127.0.0.1:{self.port}"\n'
            f'public_url = "{self.url}"\n'
            f'admin_listen = "127.0.0.1:{self.admin_port}"\n'
            'database = "sigil-push.db"\n'
            'observations = "observations"\n'
            f"allow_insecure_relays = {'true' if insecure_relays else 'false'}\n"
            f"{relay_tables}\n"
            f"[limits]\n{limits or no_limits}\n"
            f"{extra_toml}\n"
        )
        self.use_database(database)

    def use_database(self, database: str) -> None:
        """Point the (not yet started) service's config at `database`."""
        text = self.config_path.read_text()
        text = re.sub(r'^database = "[^"]*"$', f'database = "{database}"', text, count=1,
                      flags=re.MULTILINE)
        self.config_path.write_text(text)
        is_url = "://" in database
        self.database = database if is_url else str(self.folder / database)

    def start(self, wait: bool = True) -> Self:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with open(self.log_path, "ab") as log:  # the child keeps its own copy
            self._process = subprocess.Popen(
                [sys.executable, "-m", "sigil_push", "--log-level", "DEBUG", "serve", "--config",
                 str(self.config_path)],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env,
            )
        if wait:
            self.wait_healthy()
        return self

    def wait_healthy(self, timeout: float = STARTUP_SECONDS) -> dict[str, Any]:
        """Polls /health until it answers (`timeout` scaled, testkit.deadlines); a service
        that exits meanwhile fails at once with its log."""
        deadline = time.monotonic() + scaled(timeout)
        while time.monotonic() < deadline:
            if self._process is not None and self._process.poll() is not None:
                raise RuntimeError(f"service exited with {self._process.returncode}:\n{self.log()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=scaled(REQUEST_SECONDS)) as response:
                    return dict(json.load(response))
            except (OSError, urllib.error.URLError):
                time.sleep(0.05)
        raise TimeoutError(f"service not healthy after {scaled(timeout):.0f} s:\n{self.log()}")

    def wait_exit(self, timeout: float = STARTUP_SECONDS) -> int:
        """The exit code of a service expected to stop by itself (e.g. failing at start);
        `timeout` is scaled (testkit.deadlines)."""
        if self._process is None:
            raise RuntimeError("service not started")
        return self._process.wait(timeout=scaled(timeout))

    def refuses_to_start(self, timeout: float = STARTUP_SECONDS) -> str:
        """Starts a service whose set-up must make it refuse to run: asserts that it exits by
        itself with a failure (stopped either way), and returns its log for the reason."""
        self.start(wait=False)
        try:
            code = self.wait_exit(timeout=timeout)
        finally:
            self.stop()
        assert code != 0, f"the service exited with {code}"
        return self.log()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self, sig: int = signal.SIGTERM, timeout: float = STOP_SECONDS) -> int:
        """Signal the service and return its exit code (SIGKILL gives -9); killed if it is
        still running after `timeout` (scaled, testkit.deadlines)."""
        if self._process is None:
            return 0
        try:
            os.killpg(self._process.pid, sig)
        except ProcessLookupError:
            pass
        try:
            code = self._process.wait(timeout=scaled(timeout))
        except subprocess.TimeoutExpired:
            os.killpg(self._process.pid, signal.SIGKILL)
            code = self._process.wait()
        self._process = None
        return code

    def observation_records(self) -> list[dict[str, Any]]:
        """Every record so far, from the hourly files, compressed (finished hours) or not."""
        return observation_records(self.observations)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
