"""Property-based checks: whatever a client sends, the answer is JSON and never a 500."""

from __future__ import annotations

import base64
import json
from typing import Any

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from testkit.nip98 import SdkUser
from tests.conftest import ApiCaller

USER = SdkUser()

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=40),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=12,
)
npubs = st.one_of(
    st.just(USER.npub), st.just(USER.hex), st.text(max_size=80),
    st.from_regex(r"npub1[02-9ac-hj-np-z]{0,70}", fullmatch=True), json_values,
)
tokens = st.one_of(
    st.from_regex(r"[0-9a-fA-F]{0,220}", fullmatch=True),
    st.from_regex(r"[A-Za-z0-9_:\-. ]{0,200}", fullmatch=True),
    st.from_regex(r"https?://[a-z0-9.\[\]:]{0,40}/[a-z]{0,8}", fullmatch=True),
    json_values,
)
FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def assert_json_answer(response: Any) -> None:
    assert response.status_code < 500, response.text
    body = response.json()
    if response.status_code >= 400:
        assert set(body) == {"error", "message"}


@FUZZ
@given(npub=npubs, token=tokens, platform=st.sampled_from(["ios", "android", "unifiedpush", "x"]),
       extra=st.dictionaries(st.sampled_from(["payload", "relays", "keys", "auth_signer"]), json_values))
def test_register_fields_never_crash(api: ApiCaller, npub: Any, token: Any, platform: str, extra: dict[str, Any]) -> None:
    body = {"npub": npub, "device_token": token, "platform": platform, **extra}
    assert_json_answer(api.call("POST", "/register", USER, body))


@FUZZ
@given(raw=st.binary(max_size=600) | json_values.map(lambda v: json.dumps(v).encode()))
def test_any_body_never_crashes(api: ApiCaller, raw: bytes) -> None:
    assert_json_answer(api.call("POST", "/register", USER, raw=raw))
    assert_json_answer(api.call("DELETE", "/unregister", USER, raw=raw))


@FUZZ
@given(
    header=st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=300)
    | st.from_regex(r"Nostr [A-Za-z0-9+/=]{1,300}", fullmatch=True)
    | json_values.map(lambda v: "Nostr " + base64.b64encode(json.dumps(v).encode()).decode())
)
def test_any_authorization_header_never_crashes(api: ApiCaller, header: str) -> None:
    try:
        response = api.http.get("/registrations", headers={"authorization": header})
    except (httpx.LocalProtocolError, UnicodeEncodeError):
        return  # the client itself refuses to send such a header
    assert_json_answer(response)
    assert response.status_code == 401
