"""The README's configuration table has one entry per key: `server.secret_key` and
`server.allow_insecure_relays` were once listed twice, with contradicting text."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def test_each_config_key_is_listed_once() -> None:
    keys = [
        key.strip().strip("`")
        for line in README.read_text(encoding="utf-8").splitlines()
        if line.startswith("| `")
        for key in line.split("|")[1].split(",")
    ]
    assert "server.secret_key" in keys
    assert [key for key, count in Counter(keys).items() if count > 1] == []
