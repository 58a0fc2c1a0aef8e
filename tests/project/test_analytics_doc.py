"""docs/analytics.md against the code that writes and reads the observation log.

Operators read what the log holds from the doc's Records table, and the jobs' needs from its
list of corrupt lines; both had drifted from the writers before (states the bridge writes and
no doc named). These checks keep them true: every record type and field the writer
(sigil_push/observations.py) puts in a line is in the table, in order, and nothing else; every
`relay` state, push status, platform and suppression reason the bridge writes is named there;
the jobs require only fields the bridge writes; the contract's CSV columns are the doc's. Fast:
the sources are parsed, nothing is started, PySpark is not imported.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

import pytest

from sigil_push.bridge.metrics import SUPPRESS_REASONS
from sigil_push.push.base import Status
from sigil_push.push.registry import PLATFORMS
from tests.analytics.observation_logs import CONTRACT_COLUMNS

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "analytics.md").read_text(encoding="utf-8")
WRITER = ROOT / "sigil_push" / "observations.py"
_SPLICED_KEY = re.compile(r'"(\w+)":')


def _constant(node: ast.expr | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def written_records(source: str) -> dict[str, list[list[str]]]:
    """Record type -> the field lists the writer builds for it: each dict literal with a
    constant "type", and each f-string line spliced by hand (`{"type":"seen",...}`)."""
    records: dict[str, list[list[str]]] = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Dict):
            keys = [_constant(key) for key in node.keys]
            if "type" not in keys:
                continue
            record_type = _constant(node.values[keys.index("type")])
            assert record_type is not None and None not in keys, ast.unparse(node)
            records.setdefault(record_type, []).append([k for k in keys if k is not None])
        elif isinstance(node, ast.JoinedStr):
            text = "".join(_constant(part) or "\0" for part in node.values)
            match = re.match(r'\{"type":"(\w+)"', text)
            if match:
                records.setdefault(match.group(1), []).append(_SPLICED_KEY.findall(text))
    return records


def documented_records(doc: str) -> dict[str, tuple[list[str], str]]:
    """Record type -> (fields, what the row says of them) from the doc's Records table."""
    if "### Records" not in doc:
        return {}
    section = doc.split("### Records", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, tuple[list[str], str]] = {}
    for line in section.splitlines():
        match = re.fullmatch(r"\| `(\w+)` \| `([\w, ]+)` \| (.+) \|", line)
        if match:
            rows[match.group(1)] = (match.group(2).split(", "), match.group(3))
    return rows


def code_constants(pattern: str) -> set[str]:
    """The string constants matched by `pattern`'s group in the bridge's source."""
    found: set[str] = set()
    for path in (ROOT / "sigil_push").rglob("*.py"):
        found.update(re.findall(pattern, path.read_text(encoding="utf-8")))
    return found


def written_states() -> set[str]:
    """Every `relay` state the bridge writes: the constants handed to `relay_state(...)`
    and to the connection's `_down(...)`, which writes the state it is given."""
    states = code_constants(r'\.relay_state\(\s*[^,]+,\s*"(\w+)"')
    states |= code_constants(r'self\._down\(\s*"(\w+)"')
    return states


def literal(path: Path, name: str) -> Any:
    """The literal value assigned to module-level `name` in `path`, without importing it."""
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        targets = [node.target] if isinstance(node, ast.AnnAssign) else getattr(node, "targets", [])
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            assert node.value is not None
            return ast.literal_eval(node.value)
    raise AssertionError(f"{name} not assigned in {path}")


WRITTEN = written_records(WRITER.read_text(encoding="utf-8"))
DOCUMENTED = documented_records(DOC)


def test_the_parsers_find_what_they_look_for() -> None:
    """Guards the checks below against passing on nothing: both sides are read, the hand-
    spliced lines too, and a field missing from a line would show."""
    assert {"seen", "push", "expect"} <= {t for t, shapes in WRITTEN.items() if len(shapes) > 1}
    assert len(DOCUMENTED) >= 6
    spliced = written_records('x = f\'{{"type":"seen","ts":{a},"relay":{b}}}\'')
    assert spliced == {"seen": [["type", "ts", "relay"]]}
    assert {"connected", "disconnected", "error"} <= written_states()


def test_every_record_type_the_writer_builds_is_documented_and_no_other() -> None:
    assert sorted(DOCUMENTED) == sorted(WRITTEN)


@pytest.mark.parametrize("record_type", sorted(WRITTEN))
def test_each_records_fields_are_the_documented_ones(record_type: str) -> None:
    """Every shape the writer builds for a type (dict and spliced line alike) carries the
    documented fields in the documented order, after `type`."""
    fields = DOCUMENTED[record_type][0] if record_type in DOCUMENTED else []
    for shape in WRITTEN[record_type]:
        assert shape == ["type", *fields], (record_type, shape, fields)


def test_every_relay_state_the_bridge_writes_is_named() -> None:
    described = DOCUMENTED["relay"][1]
    missing = {s for s in written_states() if f"`{s}`" not in described}
    assert not missing, missing


def test_the_states_the_jobs_rely_on_are_written() -> None:
    """dropped_events builds connected intervals from these states: one the bridge never
    writes would leave a relay's intervals silently open or never opened."""
    jobs = ROOT / "analytics" / "dropped_events.py"
    relied_on = {*literal(jobs, "CONNECTED_STATES"), *literal(jobs, "DISCONNECTED_STATES")}
    assert relied_on <= written_states(), relied_on - written_states()


@pytest.mark.parametrize(
    ("record_type", "values"),
    [
        ("push", [status.value for status in Status]),
        ("push", list(PLATFORMS)),
        ("suppressed", list(SUPPRESS_REASONS)),
    ],
)
def test_every_value_named_in_a_record_is_documented(record_type: str, values: list[str]) -> None:
    described = DOCUMENTED[record_type][1]
    missing = [value for value in values if f"`{value}`" not in described]
    assert not missing, missing


def documented_required_fields(doc: str) -> dict[str, list[str]]:
    """The doc's list of the fields without which a record is a corrupt line."""
    text = " ".join(doc.split())
    listing = text.split("without a field the jobs need (", 1)[1].split("). Corrupt lines", 1)[0]
    required: dict[str, list[str]] = {}
    for part in listing.split(";"):
        fields, _, record_type = part.rpartition(" for ")
        required[record_type.strip().strip("`")] = re.findall(r"`(\w+)`", fields)
    return required


def test_the_fields_the_jobs_require_are_written_and_documented() -> None:
    """A field the jobs require but the bridge does not write would make every such record a
    corrupt line; the doc lists the requirements as the reader has them."""
    required = literal(ROOT / "analytics" / "observations.py", "REQUIRED_FIELDS")
    assert sorted(required) == sorted(WRITTEN)
    for record_type, fields in required.items():
        assert set(fields) <= set(WRITTEN[record_type][0]), (record_type, fields)
    assert documented_required_fields(DOC) == {t: list(f) for t, f in required.items()}


def test_the_output_table_has_the_contract_columns() -> None:
    rows = {
        match.group(1): match.group(2)
        for match in re.finditer(r"^\| `(\w+\.csv)` \| (.+) \|$", DOC, re.MULTILINE)
    }
    for name, columns in CONTRACT_COLUMNS.items():
        cell = rows[name]
        listed = re.match(r"`([\w, ]+)`", cell)
        assert listed is not None, cell
        documented = listed.group(1).split(", ") + re.findall(r"then `(\w+)`", cell)
        assert documented == columns, (name, documented)
