"""The suite's deadline policy (testkit/deadlines.py) and port blocks (testkit/relay.py): one
scale for every wait, read from the environment, and ports no two test processes share."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from testkit import deadlines
from testkit.relay import PORTS, PORTS_PER_BLOCK, claim_block

ROOT = Path(__file__).resolve().parents[2]

WAITING_CALLS = frozenset({
    "httpx.get", "httpx.post", "httpx.put", "httpx.delete", "httpx.request", "httpx.Client",
    "httpx.AsyncClient", "urlopen", "urllib.request.urlopen", "subprocess.run", "communicate",
    "wait", "join", "asyncio.wait_for", "wait_for", "get", "sqlite3.connect", "result",
    "concurrent.futures.wait",
})
"""Calls whose `timeout=` is how long the test waits for another party (a server, a process, a
thread): a deadline, so it must come from the policy."""

PACE = "# a pace, not a deadline"
"""Written on a line whose timeout is part of what the test does (a client sending a byte a
second), not how long it waits for something to happen."""


def test_the_scale_is_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(deadlines.SCALE_VARIABLE, raising=False)
    assert deadlines._scale() == deadlines.DEFAULT_SCALE
    monkeypatch.setenv(deadlines.SCALE_VARIABLE, "2.5")
    assert deadlines._scale() == 2.5


@pytest.mark.parametrize("value", ["soon", "0", "-1"])
def test_a_bad_scale_is_refused_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv(deadlines.SCALE_VARIABLE, value)
    with pytest.raises(ValueError, match=deadlines.SCALE_VARIABLE):
        deadlines._scale()


async def test_eventually_returns_as_soon_as_the_condition_holds() -> None:
    """A deadline is a ceiling, not a pace: a condition already true costs no wait."""
    calls: list[int] = []

    def check() -> int:
        calls.append(1)
        return len(calls) if len(calls) >= 3 else 0

    assert await deadlines.eventually(check, "the third call", seconds=60, every=0) == 3


async def test_eventually_names_what_it_waited_for() -> None:
    with pytest.raises(AssertionError, match="the impossible"):
        await deadlines.eventually(lambda: False, "the impossible", seconds=0.01 / deadlines.SCALE)


def test_two_processes_never_claim_the_same_port_block(tmp_path: Path) -> None:
    """A claim holds its block until its lock file is closed (or its process exits): flock
    locks belong to the open file, so each claim here stands for another process. Every block
    goes to one claim only; with all of them held a claim fails, and a released block is
    claimed again."""
    claims = [claim_block(tmp_path) for _ in range(len(PORTS) // PORTS_PER_BLOCK)]
    try:
        blocks = [block for block, _ in claims]
        assert len(set(blocks)) == len(blocks)
        assert all((block - PORTS.start) % PORTS_PER_BLOCK == 0 for block in blocks)
        with pytest.raises(RuntimeError, match="claimed"):
            claim_block(tmp_path)
        freed, handle = claims.pop()
        handle.close()
        again = claim_block(tmp_path)
        claims.append(again)
        assert again[0] == freed
    finally:
        for _, handle in claims:
            handle.close()


def _called_name(call: ast.Call) -> str:
    func = call.func
    if isinstance(func, ast.Attribute):
        if isinstance(func.value, ast.Name):
            return f"{func.value.id}.{func.attr}"
        if isinstance(func.value, ast.Attribute) and isinstance(func.value.value, ast.Name):
            return f"{func.value.value.id}.{func.value.attr}.{func.attr}"
        return func.attr
    return func.id if isinstance(func, ast.Name) else ""


def _is_policy(node: ast.expr) -> bool:
    """`scaled(...)` or a name from the policy (a helper's own parameter is scaled inside)."""
    if isinstance(node, ast.Call):
        return _called_name(node).rsplit(".", 1)[-1] in ("scaled", "deadline", "max", "min")
    return isinstance(node, ast.Name)


def _clock(node: ast.expr) -> bool:
    """`time.monotonic()` or an event loop's `.time()`."""
    return isinstance(node, ast.Call) and _called_name(node).rsplit(".", 1)[-1] in (
        "monotonic", "time"
    ) and _called_name(node) != "time.time"


def _raw_deadlines(path: Path) -> list[str]:
    source = path.read_text(encoding="utf-8")
    lines = source.splitlines()
    found = []
    for node in ast.walk(ast.parse(source)):
        line = getattr(node, "lineno", 0)
        if line and PACE in lines[line - 1]:
            continue
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add) and _clock(node.left):
            if isinstance(node.right, ast.Constant):
                found.append(f"{path.relative_to(ROOT)}:{line}: clock + a number")
        elif isinstance(node, ast.Compare) and isinstance(node.left, ast.BinOp) and isinstance(
            node.left.op, ast.Sub
        ) and _clock(node.left.left):
            if any(isinstance(right, ast.Constant) for right in node.comparators):
                found.append(f"{path.relative_to(ROOT)}:{line}: clock - start against a number")
        elif isinstance(node, ast.Call) and _called_name(node) in WAITING_CALLS:
            for keyword in node.keywords:
                if keyword.arg == "timeout" and isinstance(keyword.value, ast.Constant):
                    found.append(f"{path.relative_to(ROOT)}:{line}: timeout={keyword.value.value}")
            name = _called_name(node).rsplit(".", 1)[-1]
            position = {"result": 0, "join": 0, "wait": 0, "wait_for": 1}.get(name)
            if position is not None and len(node.args) > position and isinstance(
                node.args[position], ast.Constant
            ):
                found.append(f"{path.relative_to(ROOT)}:{line}: {name} with a bare number")
    return found


def test_every_wait_of_the_suite_follows_the_policy() -> None:
    """A deadline written as a bare number is tuned to the machine it was written on; on a
    loaded one it fails a passing test. Waits take theirs from testkit.deadlines (`scaled`)."""
    files = sorted((ROOT / "tests").rglob("*.py")) + sorted((ROOT / "testkit").rglob("*.py"))
    found = [hit for path in files for hit in _raw_deadlines(path)]
    assert found == []
