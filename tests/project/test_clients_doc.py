"""docs/clients.md, the app developers' guide, held to the code it describes, so it cannot
drift again: every error code the API can answer is in its errors table (section 11) with the
status the code gives it, and the table names no code the API lacks; the payload-mode table
lists each mode once; the request examples use only fields and values the API reads; and the
limits the guide states are the code's. Read from the source and the guide alone: no server."""

from __future__ import annotations

import ast
import json
import re
import sqlite3
from pathlib import Path

from starlette.exceptions import HTTPException
from starlette.requests import Request

from sigil_push.bridge.user_lists import MAX_LIST_ENTRIES
from sigil_push.config import LimitsConfig, PushConfig
from sigil_push.http import api, validation
from sigil_push.nostr import nip98
from sigil_push.push import apns, fcm, registry
from sigil_push.push.endpoint_guard import MAX_ENDPOINT_LENGTH
from sigil_push.push.payload import MAX_PAYLOAD_BYTES
from sigil_push.push.unifiedpush_sender import AES128GCM_OVERHEAD
from sigil_push.push.vapid import TOKEN_LIFETIME_SECONDS
from sigil_push.store.errors import TargetTaken, TooManyAccounts, TooManyDevices
from sigil_push.store.records import PAYLOAD_MODES

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "sigil_push"
GUIDE = (ROOT / "docs" / "clients.md").read_text(encoding="utf-8")
RESPONSE_KEYS = {"error", "message"}
"""The keys of every error body, not codes."""


def _section(number: int) -> str:
    """The text of the guide's section `number` (from its heading to the next one)."""
    match = re.search(rf"^## {number}\. .*?(?=^## |\Z)", GUIDE, re.DOTALL | re.MULTILINE)
    assert match, f"docs/clients.md has no section {number}"
    return match.group(0)


def _constructed_codes() -> dict[str, int]:
    """code -> status of every ApiError the package builds (BadRequest is 400), read from the
    source: `BadRequest("code", …)`, `ApiError(status, "code", …)` and a subclass's
    `super().__init__(status, "code", …)`."""
    codes: dict[str, int] = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Call):
                continue
            called, args = ast.unparse(node.func), node.args
            constants = [a.value if isinstance(a, ast.Constant) else None for a in args]
            if called == "BadRequest":
                assert isinstance(constants[0], str), f"{path}: a BadRequest code must be a literal"
                codes[constants[0]] = 400
            elif called in ("ApiError", "super().__init__") and len(constants) >= 2:
                status, code = constants[0], constants[1]
                if isinstance(status, int) and isinstance(code, str):
                    codes[code] = status
    return codes


def _mapped_codes() -> dict[str, int]:
    """code -> status of the failures `api._error_response` maps itself (auth, store limits,
    busy storage, routing, bugs): each such code in its source, answered for a real exception."""
    source = ast.unparse(
        next(
            node for node in ast.parse(Path(api.__file__).read_text(encoding="utf-8")).body
            if isinstance(node, ast.FunctionDef) and node.name == "_error_response"
        )
    )
    in_source = set(re.findall(r"'([a-z]+(?:_[a-z]+)*)'", source)) - RESPONSE_KEYS
    request = Request({"type": "http", "method": "POST", "path": "/register", "headers": [],
                       "query_string": b""})
    failures: list[Exception] = [
        *(kind("detail") for kind in nip98.AuthError.__subclasses__()),
        TooManyAccounts(1), TooManyDevices(1), TargetTaken(), sqlite3.OperationalError("database is locked"),
        HTTPException(404), HTTPException(405), HTTPException(400), RuntimeError("a bug"),
    ]
    answered: dict[str, int] = {}
    for failure in failures:
        response = api._error_response(request, failure)
        answered[json.loads(bytes(response.body))["error"]] = response.status_code
    assert in_source <= set(answered), (
        f"give this test an exception for {sorted(in_source - set(answered))}"
    )
    return answered


def _documented_codes() -> dict[str, int | None]:
    """code -> status of each row of the guide's errors table (None: the row gives none)."""
    rows = re.findall(r"^\| `(?:(\d{3}) )?([a-z_]+)` \|", _section(11), re.MULTILINE)
    codes = [code for _, code in rows]
    assert len(codes) == len(set(codes)), "a code is listed twice in section 11"
    return {code: int(status) if status else None for status, code in rows}


def test_every_error_code_of_the_api_is_documented_with_its_status() -> None:
    """Section 11 lists exactly the codes the API can answer, each with the code's status."""
    actual = {**_constructed_codes(), **_mapped_codes()}
    documented = _documented_codes()
    assert sorted(set(actual) - set(documented)) == [], "codes missing from docs/clients.md §11"
    assert sorted(set(documented) - set(actual)) == [], "docs/clients.md §11 names unknown codes"
    wrong = {
        code: (status, actual[code])
        for code, status in documented.items()
        if status is not None and status != actual[code]
    }
    assert wrong == {}, "(documented, actual) statuses differ"


def test_the_payload_table_lists_each_mode_once() -> None:
    """Section 2's table has one row per payload mode the API accepts."""
    header, *modes = re.findall(r"^\| `([a-z_]+)`", _section(2), re.MULTILINE)
    assert header == "payload"
    assert sorted(modes) == sorted(PAYLOAD_MODES)


def _request_fields() -> set[str]:
    """The top-level body fields the API reads: `body.get("f")`, `body["f"]`, `"f" in body`
    and `parse_json_object(raw).get("f")` in api.py and validation.py (but in `_health`,
    whose `body` is its answer)."""
    fields: set[str] = set()
    for module in (api, validation):
        tree = ast.parse(Path(module.__file__ or "").read_text(encoding="utf-8"))
        answers = [node for node in ast.walk(tree)
                   if isinstance(node, ast.FunctionDef) and node.name == "_health"]
        for answer in answers:
            answer.body = []
        for node in ast.walk(tree):
            target: ast.expr | None = None
            key: ast.expr | None = None
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "get" and node.args):
                target, key = node.func.value, node.args[0]
            elif isinstance(node, ast.Subscript):
                target, key = node.value, node.slice
            elif isinstance(node, ast.Compare) and isinstance(node.ops[0], ast.In):
                target, key = node.comparators[0], node.left
            if target is None or not isinstance(key, ast.Constant) or not isinstance(key.value, str):
                continue
            text = ast.unparse(target)
            if text == "body" or text.startswith("parse_json_object("):
                fields.add(key.value)
    return fields


def _example_bodies() -> list[dict[str, object]]:
    """The JSON request bodies in the guide's code blocks (objects with a `device_token`),
    including the body of the HTTP example."""
    bodies = []
    for language, block in re.findall(r"^```(json|http)\n(.*?)^```", GUIDE, re.DOTALL | re.MULTILINE):
        text = block.split("\n\n", 1)[1] if language == "http" else block
        value = json.loads(text)
        if isinstance(value, dict) and "device_token" in value:
            bodies.append(value)
    return bodies


def test_the_request_examples_use_only_fields_and_values_the_api_reads() -> None:
    """A misspelt field in an example would be ignored by the API, silently."""
    fields = _request_fields()
    assert {"npub", "platform", "device_token", "payload", "keys", "device_key"} <= fields
    bodies = _example_bodies()
    assert len(bodies) >= 3
    for body in bodies:
        assert set(body) <= fields, body
        assert body["platform"] in registry.PLATFORMS
        assert body.get("payload", "opaque") in PAYLOAD_MODES


def _thousands(number: int) -> str:
    return f"{number:,}"


def _length_range(pattern: re.Pattern[str]) -> str:
    """A token pattern's `{min,max}` as the guide words it: "64 to 200"."""
    match = re.search(r"\{(\d+),(\d+)\}$", pattern.pattern)
    assert match, pattern.pattern
    return f"{_thousands(int(match[1]))} to {_thousands(int(match[2]))}"


def test_the_limits_the_guide_states_are_the_codes() -> None:
    """Each number an app developer relies on, as the guide words it, from the code."""
    words = " ".join(GUIDE.split())  # line breaks fall anywhere in a paragraph
    limits, push = LimitsConfig(), PushConfig()
    stated = [
        f"within {nip98.MAX_CLOCK_SKEW_SECONDS} s",
        f"at most {_thousands(validation.MAX_MUTED)} pubkeys",
        f"at most {validation.MAX_PAUSE_SECONDS // 86400} days ahead",
        f"(at most {validation.MAX_PRESENCE_SECONDS})",
        f"integer from 0 to {validation.MAX_PRESENCE_SECONDS}",
        f"up to {api.MAX_MUTE_BODY_BYTES // 1024} KiB",
        f"take {api.MAX_BODY_BYTES // 1024} KiB",
        (f"at most {validation.MAX_USER_RELAYS} `wss://` URLs of at most "
         f"{validation.MAX_RELAY_URL_LENGTH} characters"),
        f"`bunker://` URI of at most {_thousands(validation.MAX_BUNKER_URI_LENGTH)} characters",
        f"({limits.accounts_per_device} by default)",
        f"({limits.devices_per_npub} by default)",
        f"(default {limits.wakeups_per_minute_per_device},",
        f"(default {limits.coalesce_window_ms // 1000} s)",
        f"(default {push.max_wakeup_age_seconds // 3600} h)",
        f"({limits.requests_per_minute_per_ip} by default;",
        f"`limits.requests_per_minute_per_npub` for one npub ({limits.requests_per_minute_per_npub})",
        (f"is at most {_thousands(MAX_PAYLOAD_BYTES)} bytes "
         f"({_thousands(MAX_PAYLOAD_BYTES - AES128GCM_OVERHEAD)} of JSON)"),
        f"at most {_thousands(MAX_LIST_ENTRIES)} keys",
        f"`exp` at most {TOKEN_LIFETIME_SECONDS // 3600} h ahead",
        f"APNs: {_length_range(apns.TOKEN)} hex characters",
        f"FCM: {_length_range(fcm.TOKEN)} letters, digits and `_:.-`",
        f"an `https://` URL of at most {_thousands(MAX_ENDPOINT_LENGTH)} characters",
    ]
    missing = [phrase for phrase in stated if phrase not in words]
    assert missing == [], "docs/clients.md no longer states these as the code has them"
