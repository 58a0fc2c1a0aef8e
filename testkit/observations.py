"""Reading a service's observation log while the service may still be writing it."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any


def observation_records(folder: Path) -> list[dict[str, Any]]:
    """Every complete record in `folder`'s hourly files, compressed (finished hours) or not.

    A reader polling a live log can catch the writer mid-line: the text after the last newline
    is a record still being written, not a corrupt one, so it is left for the next read."""
    records: list[dict[str, Any]] = []
    for path in sorted(folder.glob("observations-*.jsonl*")):
        if path.name.endswith(".jsonl.gz"):
            text = gzip.decompress(path.read_bytes()).decode()
        elif path.name.endswith(".jsonl"):
            text = path.read_text()
            text = text[: text.rfind("\n") + 1]
        else:
            continue
        records.extend(json.loads(line) for line in text.splitlines() if line)
    return records
