"""Which tests are `slow` by the marker's definition, read from the source at collection time.

`slow` means "starts its own processes (relays, `serve`, signers, Spark) or waits on real
timers" (pyproject.toml). A hand list of slow tests rots: a new test that starts a relay its own
way silently joins the quick run. So the marker is derived from the code instead: a test is
slow when its function, or a fixture it takes that is not shared by the whole session, calls
(directly or through helpers and classes of the same module) one of `PROCESS_STARTERS`, a
`subprocess`/`asyncio` process function, or sleeps a literal half second or more.

Session-scoped fixtures of the shared test code (the API `service`, the PostgreSQL server, the
provider fakes) serve every test, so they are not a test's own processes; a test module's own
fixtures are, whatever their scope. tests/project/test_suite_markers.py checks
that every process-starting helper in testkit and testkit/fakes is listed here.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

PROCESS_STARTERS = frozenset({
    "RelayProcess",  # a `nostr-relay` process
    "ServiceProcess",  # a `python -m sigil_push serve` process
    "AuthRelay",  # a NIP-42 layer over a RelayProcess
    "RustRelayProcess",  # rust-nostr's relay in a helper process
    "StandaloneCluster",  # a Spark master and workers
    "start_listening",  # any listening helper process (testkit/relay.py)
    "start_forked_relay",  # a `nostr-relay` forked by testkit/relay_forkserver.py
    "serve_forks",  # testkit/relay_forkserver.py's loop, forking each relay
    "run_cli",  # `python -m sigil_push ...` (testkit/cli.py)
    "assert_config_refused",  # run_cli("migrate", ...)
})
"""Names from testkit whose call starts a process (constructing the class is how a test
gets one, so construction counts)."""

PROCESS_CALLS = frozenset({
    "subprocess.run", "subprocess.Popen", "subprocess.call", "subprocess.check_call",
    "subprocess.check_output", "asyncio.create_subprocess_exec",
    "asyncio.create_subprocess_shell", "os.fork", "multiprocessing.Process",
})
"""Standard-library calls that start a process, as written in a module (`module.function`)."""

REAL_TIMER_SECONDS = 1.0
"""A `sleep` of a literal at least this long waits on a real timer (shorter ones are polls); tests
waiting on timers of the code under test (deadlines, leases) say so with a `slow` mark."""

STARTING = (".__init__", ".__post_init__", ".__enter__", ".__aenter__", ".start")
"""A class of a module counts as a starter when one of these starts a process (not when some
other method does, as `Engine.dump` runs pg_dump)."""

SLEEPS = frozenset({"asyncio.sleep", "time.sleep"})


def _called_name(call: ast.Call) -> str | None:
    """`f` for `f(...)`, `mod.f` for `mod.f(...)`, `attr` for `x.y.attr(...)`."""
    func = call.func
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        if isinstance(func.value, ast.Name):
            return f"{func.value.id}.{func.attr}"
        return func.attr
    return None


def _waits_on_a_timer(call: ast.Call, name: str) -> bool:
    if name not in SLEEPS or not call.args:
        return False
    seconds = call.args[0]
    return (
        isinstance(seconds, ast.Constant)
        and isinstance(seconds.value, (int, float))
        and seconds.value >= REAL_TIMER_SECONDS
    )


def _direct_reasons(node: ast.AST) -> tuple[set[str], set[str]]:
    """(names called in `node`, reasons found right there: a starter, a process call, a timer)."""
    called: set[str] = set()
    reasons: set[str] = set()
    for child in ast.walk(node):
        if not isinstance(child, ast.Call):
            continue
        name = _called_name(child)
        if name is None:
            continue
        called.add(name)
        short = name.rsplit(".", 1)[-1]
        if short in PROCESS_STARTERS:
            reasons.add(f"starts {short}")
        elif name in PROCESS_CALLS:
            reasons.add(f"calls {name}")
        elif _waits_on_a_timer(child, name):
            reasons.add(f"{name} of {ast.unparse(child.args[0])} s")
    return called, reasons


def analyse_source(source: str) -> dict[str, str]:
    """For module text `source`: each function, method (`Class.method`) and class whose call
    starts a process or waits on a real timer, with the reason, through helpers of the same
    module (a class counts when it starts processes as it is built or entered)."""
    tree = ast.parse(source)
    direct: dict[str, tuple[set[str], set[str]]] = {}
    members: dict[str, list[str]] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            direct[node.name] = _direct_reasons(node)
        elif isinstance(node, ast.ClassDef):
            members[node.name] = []
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    qualified = f"{node.name}.{item.name}"
                    direct[qualified] = _direct_reasons(item)
                    members[node.name].append(qualified)
    slow = {name: min(reasons) for name, (_, reasons) in direct.items() if reasons}
    changed = True
    while changed:  # to a fixpoint: helpers of helpers
        changed = False
        for cls, methods in members.items():
            hit = next((slow[m] for m in methods if m in slow and m.endswith(STARTING)), None)
            if hit is not None and cls not in slow:
                slow[cls] = hit
                changed = True
        for name, (called, _) in direct.items():
            if name in slow:
                continue
            owner = name.split(".", 1)[0] if "." in name else None
            for callee in called:
                target = callee.rsplit(".", 1)[-1] if callee.startswith("self.") else callee
                candidates = [target] + ([f"{owner}.{target}"] if owner else [])
                hit = next((c for c in candidates if c in slow and c != name), None)
                if hit is not None:
                    slow[name] = f"{slow[hit]} (via {hit})"
                    changed = True
                    break
    return slow


@functools.cache
def analyse_file(path: str) -> dict[str, str]:
    return analyse_source(Path(path).read_text())


def _reason_of(function: Callable[..., Any]) -> str | None:
    function = getattr(function, "__wrapped__", function)
    code = getattr(function, "__code__", None)
    if code is None:
        return None
    qualname = getattr(function, "__qualname__", function.__name__).replace(".<locals>", "")
    return analyse_file(code.co_filename).get(qualname)


def _in_a_test_module(function: Callable[..., Any]) -> bool:
    """Whether `function` is defined in a test module (test_*.py), not in shared test code."""
    code = getattr(getattr(function, "__wrapped__", function), "__code__", None)
    return code is not None and Path(code.co_filename).name.startswith("test_")


def slow_reason(item: Any) -> str | None:
    """Why collected test `item` is slow by the definition, or None: its own function, or a
    fixture it takes that is not session-wide, starts processes or waits on a real timer."""
    function = getattr(item, "function", None)
    if function is not None and (reason := _reason_of(function)) is not None:
        return f"{item.name} {reason}"
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return None
    for name in info.names_closure:
        for definition in info.name2fixturedefs.get(name, ()):
            if definition.scope == "session" and not _in_a_test_module(definition.func):
                continue
            reason = _reason_of(definition.func)
            if reason is not None:
                return f"fixture {name} {reason}"
    return None
