"""Running the `sigil-push` command as an operator would, and the one way it must refuse a
bad relays.toml: exit 2 with a single stderr line that names the offending key."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from testkit.deadlines import COMMAND_SECONDS, scaled


def run_cli(
    *args: str, cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sigil_push", *args], capture_output=True, text=True, cwd=cwd,
        env=env, timeout=scaled(COMMAND_SECONDS), check=False,
    )


def assert_config_refused(folder: Path, toml: str, key: str) -> None:
    """`migrate` with `toml` as relays.toml in `folder` exits 2, its stderr one line naming `key`."""
    config = folder / "relays.toml"
    config.write_text(toml)
    result = run_cli("migrate", "--config", str(config))
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and key in lines[0], result.stderr
