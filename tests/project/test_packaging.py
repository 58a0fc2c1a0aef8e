"""The wheel carries every package of the source tree (setuptools is given an explicit list)."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_package_in_the_tree_is_listed_for_the_wheel() -> None:
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    in_tree = {
        ".".join(init.parent.relative_to(ROOT).parts)
        for top in ("sigil_push", "analytics")
        for init in (ROOT / top).rglob("__init__.py")
    }
    assert in_tree - listed == set(), "packages missing from [tool.setuptools] packages"
