"""What docs/clients.md tells an app developer, tried against a running instance (the suite's
dry-run `service`, on SQLite and on PostgreSQL): the nostr-sdk NIP-98 example registers a
device as printed, and every answer carries exactly the fields section 12 lists, each of the
JSON type it gives."""

from __future__ import annotations

import json
import re
import secrets
import subprocess
import sys
from pathlib import Path
from typing import Any

import nostr_sdk

from testkit.deadlines import COMMAND_SECONDS, scaled
from testkit.nip98 import SdkUser
from testkit.service import ServiceProcess
from tests.conftest import ApiCaller

ROOT = Path(__file__).resolve().parents[2]
GUIDE = (ROOT / "docs" / "clients.md").read_text(encoding="utf-8")
EXAMPLE = ROOT / "docs" / "examples" / "nip98_register.py"


def _run_example(service: ServiceProcess, secret: str, token: str) -> tuple[int, dict[str, Any]]:
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), service.url, secret, token], capture_output=True,
        text=True, timeout=scaled(COMMAND_SECONDS), check=False,
    )
    status, _, answer = done.stdout.strip().partition(" ")
    assert status.isdigit(), (done.stdout, done.stderr)
    return int(status), json.loads(answer)


def test_the_nostr_sdk_example_registers_and_updates_a_device(service: ServiceProcess) -> None:
    """Run as the guide prints it: 201, then 200 for the same pair at once (its nonce tag
    makes the second auth event another event even within the same second)."""
    keys = nostr_sdk.Keys.generate()
    secret, token = keys.secret_key().to_hex(), secrets.token_hex(32)
    status, answer = _run_example(service, secret, token)
    assert status == 201, answer
    assert answer["npub"] == keys.public_key().to_bech32()
    assert answer["token_suffix"] == token[-6:]
    status, answer = _run_example(service, secret, token)
    assert status == 200, answer


_TYPES = {"string": str, "integer": int, "boolean": bool, "array": list, "object": dict}


def _documented() -> dict[str, dict[str, tuple[tuple[type, ...], bool]]]:
    """answer -> field -> (allowed Python types, optional) from section 12's table; the
    fields of each device of `GET /registrations` under the answer `device`."""
    section = re.search(r"^## 12\. .*?(?=^## |\Z)", GUIDE, re.DOTALL | re.MULTILINE)
    assert section, "docs/clients.md has no section 12"
    table: dict[str, dict[str, tuple[tuple[type, ...], bool]]] = {}
    answer = ""
    for line in section.group(0).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or cells[0] in ("answer", "---"):
            continue
        starts = bool(cells[0])
        if starts:
            answer = cells[0].strip("`")
        kind = cells[2]
        first = kind.split()[0].rstrip(":")
        types: tuple[type, ...] = (_TYPES[first],)
        if "or null" in kind:
            types += (type(None),)
        optional = "only" in cells[1] or "absent" in cells[1]
        # the rows after `devices` are the fields of each device
        target = "device" if answer == "GET /registrations" and not starts else answer
        for field in re.findall(r"`([a-z_]+)`", cells[1].split("(")[0]):
            table.setdefault(target, {})[field] = (types, optional)
    return table


def _check(documented: dict[str, tuple[tuple[type, ...], bool]], answer: dict[str, Any],
           name: str) -> None:
    required = {f for f, (_, optional) in documented.items() if not optional}
    assert required <= set(answer), f"{name}: documented but absent: {required - set(answer)}"
    assert set(answer) <= set(documented), f"{name}: undocumented: {set(answer) - set(documented)}"
    for field, value in answer.items():
        types, _ = documented[field]
        # bool is an int in Python: an integer field must not be a boolean, nor the reverse
        ok = isinstance(value, types) and (bool in types or not isinstance(value, bool))
        assert ok, f"{name}: {field} = {value!r} is not {types}"


def test_every_answer_has_the_fields_and_types_section_12_gives(api: ApiCaller) -> None:
    table = _documented()
    user, token = SdkUser(), secrets.token_hex(32)
    registered = api.call("POST", "/register", user,
                          {"npub": user.npub, "platform": "ios", "device_token": token})
    assert registered.status_code == 201, registered.text
    _check(table["POST /register"], registered.json(), "register")
    preferences = api.call("POST", "/preferences", user,
                           {"device_token": token, "pause_until": None})
    _check(table["POST /preferences"], preferences.json(), "preferences")
    presence = api.call("POST", "/presence", user, {"device_token": token, "seconds": 30})
    _check(table["POST /presence"], presence.json(), "presence")
    listing = api.call("GET", "/registrations", user).json()
    _check(table["GET /registrations"], listing, "registrations")
    [device] = listing["devices"]
    assert device["auth_signer_detail"] == "" and device["auth_signer_status"] is None
    _check(table["device"], device, "a device of registrations")
    _check(table["GET /info"], api.http.get("/info").json(), "info")
    _check(table["GET /health"], api.http.get("/health").json(), "health")
    refused = api.call("POST", "/presence", user, {"device_token": "nope", "seconds": 30})
    _check(table["every refusal"], refused.json(), "a refusal")
    removed = api.call("DELETE", "/unregister", user, {"device_token": token})
    _check(table["DELETE /unregister"], removed.json(), "unregister")
