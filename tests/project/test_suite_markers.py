"""The `slow` marker follows its definition ("starts its own processes or waits on real
timers", pyproject.toml) by reading the code (testkit.slow_marks), and this module keeps
that reading honest: every helper in the shared test code that starts a process is one the
reading knows, and the reading finds starters through fixtures, helpers and classes."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from testkit import cli, processes, stores
from testkit.slow_marks import PROCESS_STARTERS, analyse_file, analyse_source, slow_reason

ROOT = Path(__file__).resolve().parents[2]
SHARED_CODE = sorted(
    path for folder in ("testkit", "testkit/fakes", "tests/adversarial", "tests/analytics")
    for path in (ROOT / folder).glob("*.py") if not path.name.startswith("test_")
)
SESSION_WIDE = frozenset({"PostgresServer", "postgres_server", "service"})
"""Process starters behind session-wide fixtures: one per test session (or worker), shared by
every test, so no test's own."""


def _public_names(path: Path) -> dict[str, bool]:
    """Module-level functions and classes of `path` that tests can call: name -> is a fixture."""
    names: dict[str, bool] = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            fixture = any("fixture" in ast.unparse(d) for d in node.decorator_list)
            if not node.name.startswith("_"):
                names[node.name] = fixture
    return names


def test_every_shared_helper_that_starts_a_process_is_a_known_starter() -> None:
    """A new process-starting helper in testkit (or the fakes) must join
    PROCESS_STARTERS, or tests calling it would silently stay in the quick run. Fixtures need
    not: their own code is read for each test that takes them."""
    unknown = []
    for path in SHARED_CODE:
        starting = analyse_file(str(path))
        for name, fixture in _public_names(path).items():
            if name in starting and not fixture and name not in PROCESS_STARTERS | SESSION_WIDE:
                unknown.append(f"{path.relative_to(ROOT)}::{name} ({starting[name]})")
    assert not unknown, "add to slow_marks.PROCESS_STARTERS: " + ", ".join(unknown)


def test_every_listed_starter_exists_and_starts_a_process() -> None:
    """The list cannot keep names that no longer start anything."""
    found = {name for path in SHARED_CODE for name in analyse_file(str(path))}
    assert PROCESS_STARTERS - found == set()


HELPERS = '''
import subprocess, asyncio
from testkit.relay import RelayProcess
from testkit.service import ServiceProcess

def annotated_only(service: ServiceProcess) -> ServiceProcess:
    return service

def runs(folder):
    return subprocess.run(["true"])

def via_helper():
    return runs(None)

class Instance:
    def __init__(self, folder):
        self.relay = RelayProcess(folder)
    def dump(self):
        return runs(None)

class Reader:
    def dump(self):
        return subprocess.run(["pg_dump"])

def builds_instance(folder):
    return Instance(folder)

def builds_reader():
    return Reader()

async def polls():
    await asyncio.sleep(0.05)

async def waits_a_timer():
    await asyncio.sleep(2)
'''


@pytest.mark.parametrize(("name", "slow"), [
    ("annotated_only", False), ("runs", True), ("via_helper", True), ("Instance", True),
    ("builds_instance", True), ("Reader", False), ("builds_reader", False), ("polls", False),
    ("waits_a_timer", True),
])
def test_the_reading_follows_helpers_classes_and_timers(name: str, slow: bool) -> None:
    assert (name in analyse_source(HELPERS)) is slow


def test_the_quick_run_keeps_most_of_the_suite(request: pytest.FixtureRequest) -> None:
    """`-m "not slow"` must run at least 70% of the tests (issue 23); this session's own
    collection, when it is the whole suite, shows it."""
    items = request.session.items
    if len(items) < 500 or request.config.getoption("-m"):
        pytest.skip("only a whole-suite, unfiltered run sees the share")
    quick = [item for item in items if item.get_closest_marker("slow") is None]
    assert len(quick) >= 0.7 * len(items), f"{len(quick)} of {len(items)} are not slow"


def _item(function: Any, **fixtures: tuple[str, Any]) -> SimpleNamespace:
    """A collected test as slow_reason reads it: its function and its fixtures' definitions."""
    definitions = {
        name: [SimpleNamespace(scope=scope, func=fixture.__wrapped__)]
        for name, (scope, fixture) in fixtures.items()
    }
    info = SimpleNamespace(names_closure=list(fixtures), name2fixturedefs=definitions)
    return SimpleNamespace(name="a_test", function=function, _fixtureinfo=info)


def test_a_test_is_slow_by_its_own_code_or_its_fixtures_but_not_the_session_service() -> None:
    assert slow_reason(_item(cli.assert_config_refused)) is not None
    assert slow_reason(_item(stores.engine_of)) is None  # Engine builds no process
    assert slow_reason(_item(stores.engine_of, service=("session", stores.service))) is None
    relay = slow_reason(_item(stores.engine_of, start_relay=("function", processes.start_relay)))
    assert relay is not None and "RelayProcess" in relay


@pytest.mark.xdist_group("grouping-check")
def test_a_grouped_test_reaches_the_loadgroup_scheduler_with_its_group(
    request: pytest.FixtureRequest,
) -> None:
    """xdist's scheduler reads a test's `xdist_group` only from the `@group` suffix of the id
    the worker reports; with pytest 9 xdist 3.8's own rename does not take (testkit.
    xdist_groups), and the Spark session's tests ran on every worker, a JVM each."""
    if not getattr(request.config.option, "loadgroup", False):
        pytest.skip("only a worker of `--dist loadgroup` reports groups")
    assert request.node.nodeid.endswith("@grouping-check")


def test_a_loadgroup_worker_hands_out_the_slow_tests_first(request: pytest.FixtureRequest) -> None:
    """The worker finishing last sets the wall time: no quick test is scheduled before a slow
    one (testkit.xdist_groups), so long stories do not start at the end of a run."""
    if not getattr(request.config.option, "loadgroup", False):
        pytest.skip("only a worker of `--dist loadgroup` orders for the scheduler")
    slow = [item.get_closest_marker("slow") is not None for item in request.session.items]
    assert slow == sorted(slow, reverse=True)
