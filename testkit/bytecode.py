"""The suite writes and reads bytecode caches, even where the environment says not to.

A run starts about 235 `sigil-push` processes, and every xdist worker collects every test
module: each of them compiles the same 60,000 lines of `sigil_push/`, `testkit/`,
`analytics/` and `tests/` again when `PYTHONDONTWRITEBYTECODE` is set (as in containers and
CI images that keep their layers small). Compiling was about a fifth of a service start's CPU
and half of a worker's collection. So this plugin lets this process and every process it
starts write `__pycache__` (ignored by git), and the controlling process compiles the packages
once before its workers start: they read the bytecode instead of each compiling it. Test
modules and conftests are compiled by pytest's assertion rewriter, which caches them the same
way (each worker that finds no cache writes it). Listed first in tests/conftest.py's
`pytest_plugins`, so the variable is gone before any fixture starts a process.
"""

from __future__ import annotations

import compileall
import os
import re
import sys
from pathlib import Path

import pytest

VARIABLE = "PYTHONDONTWRITEBYTECODE"
PACKAGES = ("sigil_push", "testkit", "analytics", "tests")
"""What tests and the processes they start import from the checkout."""
REWRITTEN = re.compile(r"(^|/)(test_[^/]*|conftest)\.py$")
"""Modules pytest's assertion rewriter compiles (into bytecode of its own name)."""

sys.dont_write_bytecode = False
os.environ.pop(VARIABLE, None)


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config, "workerinput"):  # an xdist worker: the controller compiled already
        return
    root = Path(config.rootpath)
    for package in PACKAGES:
        if (root / package).is_dir():
            compileall.compile_dir(root / package, quiet=1, rx=REWRITTEN, workers=0)
