"""POST /preferences, POST /presence and the preference keys of /register and /registrations
(issue 20), against the shared `serve` process on both engines, authenticated by nostr-sdk.

Everything is per (npub, token) pair: another npub that registers the same token gets a pair
of its own, and nothing it sets reaches the first npub's pair.
"""

from __future__ import annotations

import os
import time
from typing import Any

import httpx
import nostr_sdk

from testkit.nip98 import SdkUser
from tests.conftest import ApiCaller

DAY = 24 * 3600


def _token() -> str:
    return os.urandom(32).hex()


def _registered(api: ApiCaller, user: SdkUser, token: str, **fields: Any) -> None:
    response = api.register(user, device_token=token, **fields)
    assert response.status_code in (200, 201), response.text


def _device(api: ApiCaller, user: SdkUser, token: str) -> dict[str, Any]:
    # a nonce tag: two reads in one second would otherwise be the same (replayed) auth event
    header = user.header(api.public_url + "/registrations", "GET",
                         extra_tags=[["nonce", os.urandom(8).hex()]])
    answer = api.call("GET", "/registrations", None, headers={"authorization": header}).json()
    [device] = [d for d in answer["devices"] if d["token_suffix"] == token[-6:]]
    return dict(device)


def _preferences(api: ApiCaller, user: SdkUser, token: str, **fields: Any) -> httpx.Response:
    return api.call("POST", "/preferences", user, {"device_token": token, **fields})


def _npubs(count: int) -> list[str]:
    return [str(nostr_sdk.Keys.generate().public_key().to_bech32()) for _ in range(count)]


def test_a_new_pair_has_default_preferences(api: ApiCaller) -> None:
    user, token = SdkUser(), _token()
    _registered(api, user, token)
    device = _device(api, user, token)
    assert (device["pause_until"], device["senders"], device["muted_count"]) == (None, "anyone", 0)
    assert device["follows_known"] is False


def test_registering_again_replaces_the_registration_but_keeps_the_preferences(
    api: ApiCaller,
) -> None:
    """docs/clients.md, section 1: an update replaces `payload` and `relays` with what it sends
    (a field left out is removed), while the pause, follows-only and the mute list stay."""
    user, token = SdkUser(), _token()
    until = int(time.time()) + 3600
    _registered(api, user, token, payload="event_id", relays=["wss://inbox.example"],
                pause_until=until, senders="follows", muted=[SdkUser().hex])
    again = api.register(user, device_token=token)
    assert again.status_code == 200, again.text
    shown = again.json()
    assert (shown["payload"], shown["relays"]) == ("opaque", [])
    assert (shown["pause_until"], shown["senders"], shown["muted_count"]) == (until, "follows", 1)
    device = _device(api, user, token)
    assert (device["payload"], device["relays"]) == ("opaque", [])
    assert (device["pause_until"], device["senders"], device["muted_count"]) == (until, "follows", 1)


def test_preferences_are_set_shown_and_replaced(api: ApiCaller) -> None:
    """A pause, follows-only and a private mute list (hex and npub, duplicates counted once);
    a second mute list replaces the first; a past pause clears it."""
    user, token = SdkUser(), _token()
    _registered(api, user, token)
    until = int(time.time()) + 3600
    muted = [SdkUser().hex, _npubs(1)[0]]
    answer = _preferences(api, user, token, pause_until=until, senders="follows",
                          muted=[*muted, muted[0].upper()])
    assert answer.status_code == 200, answer.text
    assert answer.json() == {"pause_until": until, "senders": "follows", "muted_count": 2,
                             "notify": ["dm"], "quiet": None}
    device = _device(api, user, token)
    assert (device["pause_until"], device["senders"], device["muted_count"]) == (until, "follows", 2)
    # only the keys given change; a new list replaces the old one whole
    answer = _preferences(api, user, token, muted=[SdkUser().hex])
    assert answer.json() == {"pause_until": until, "senders": "follows", "muted_count": 1,
                             "notify": ["dm"], "quiet": None}
    answer = _preferences(api, user, token, pause_until=int(time.time()) - 10, senders="anyone")
    assert answer.json() == {"pause_until": None, "senders": "anyone", "muted_count": 1,
                             "notify": ["dm"], "quiet": None}
    assert _preferences(api, user, token, pause_until=None, muted=[]).json()["muted_count"] == 0


def test_register_accepts_the_preference_keys(api: ApiCaller) -> None:
    user, token = SdkUser(), _token()
    until = int(time.time()) + 600
    response = api.register(user, device_token=token, pause_until=until, senders="follows",
                            muted=[SdkUser().hex])
    assert response.status_code == 201, response.text
    assert (response.json()["pause_until"], response.json()["muted_count"]) == (until, 1)
    assert _device(api, user, token)["senders"] == "follows"


def test_a_thousand_muted_npubs_fit_and_one_more_does_not(api: ApiCaller) -> None:
    """1,000 keys are about 66 KiB of JSON: more than the other routes' 8 KiB, accepted by
    /preferences; /register keeps its 8 KiB."""
    user, token = SdkUser(), _token()
    _registered(api, user, token)
    keys = [os.urandom(32).hex() for _ in range(1001)]
    answer = _preferences(api, user, token, muted=keys[:1000])
    assert answer.status_code == 200, answer.text
    assert answer.json()["muted_count"] == 1000
    refused = _preferences(api, user, token, muted=keys)
    assert refused.status_code == 400
    assert refused.json()["error"] == "invalid_preferences" and "muted" in refused.json()["message"]
    assert _device(api, user, token)["muted_count"] == 1000
    too_large = api.register(user, device_token=token, muted=keys[:1000])
    assert too_large.status_code == 413 and too_large.json()["error"] == "body_too_large"


def test_bad_preferences_are_refused_naming_the_field_and_change_nothing(api: ApiCaller) -> None:
    user, token = SdkUser(), _token()
    until = int(time.time()) + 3600
    _registered(api, user, token, pause_until=until, senders="follows", muted=[SdkUser().hex])
    before = _device(api, user, token)
    now = int(time.time())
    bad: list[tuple[dict[str, Any], str]] = [
        ({"senders": "friends"}, "senders"),
        ({"senders": None}, "senders"),
        ({"pause_until": now + 367 * DAY}, "pause_until"),
        ({"pause_until": "tomorrow"}, "pause_until"),
        ({"pause_until": True}, "pause_until"),
        ({"muted": "ab" * 32}, "muted"),
        ({"muted": ["ab" * 31]}, "muted"),
        ({"muted": ["npub1notakey"]}, "muted"),
        ({"muted": [7]}, "muted"),
        # a valid key beside a bad one: the good one is not applied either
        ({"senders": "anyone", "muted": ["zz" * 32]}, "muted"),
        ({"notify": []}, "notify"),
        ({"notify": ["dm", "likes"]}, "notify"),
        ({"notify": "dm"}, "notify"),
        ({"notify": ["dm"] * 6}, "notify"),
        ({"quiet": {"from": "22:00", "to": "22:00", "tz": "Europe/Berlin"}}, "quiet"),
        ({"quiet": {"from": "22:00", "to": "07:00"}}, "quiet"),
        ({"quiet": {"from": "25:00", "to": "07:00", "tz": "UTC"}}, "quiet.from"),
        ({"quiet": {"from": "22:00", "to": "7:00", "tz": "UTC"}}, "quiet.to"),
        ({"quiet": {"from": "22:00", "to": "07:00", "tz": "Mars/Olympus_Mons"}}, "quiet.tz"),
        ({"quiet": {"from": "22:00", "to": "07:00", "tz": "../../etc/passwd"}}, "quiet.tz"),
        ({"quiet": {"from": "22:00", "to": "07:00", "tz": "Europe"}}, "quiet.tz"),
        ({"quiet": {"from": "22:00", "to": "07:00", "tz": "E" * 5_000}}, "quiet.tz"),
        ({"quiet": "22:00-07:00"}, "quiet"),
    ]
    for fields, field in bad:
        response = _preferences(api, user, token, **fields)
        assert response.status_code == 400, (fields, response.text)
        assert response.json()["error"] == "invalid_preferences", fields
        assert f"'{field}'" in response.json()["message"], (fields, response.json())
        refused = api.register(user, device_token=token, **fields)
        assert refused.json()["error"] == "invalid_preferences", fields
    assert _device(api, user, token) == before


def test_notify_and_quiet_hours_are_set_shown_and_cleared(api: ApiCaller) -> None:
    """`notify` (any order, shown in the contract's order) and `quiet` on /register and
    /preferences, shown by GET /registrations; `quiet: null` clears; a window may cross
    midnight and carry seconds."""
    user, token = SdkUser(), _token()
    registered = api.register(user, device_token=token, notify=["zap", "dm"],
                              quiet={"from": "22:00", "to": "07:00", "tz": "Europe/Berlin"})
    assert registered.status_code == 201, registered.text
    assert registered.json()["notify"] == ["dm", "zap"]
    device = _device(api, user, token)
    assert device["notify"] == ["dm", "zap"]
    assert device["quiet"] == {"from": "22:00", "to": "07:00", "tz": "Europe/Berlin"}
    answer = _preferences(api, user, token, notify=["mention", "repost", "reaction"],
                          quiet={"from": "09:30:15", "to": "09:30", "tz": "America/New_York"})
    assert answer.status_code == 200, answer.text
    assert answer.json()["notify"] == ["mention", "repost", "reaction"]
    assert answer.json()["quiet"] == {"from": "09:30:15", "to": "09:30", "tz": "America/New_York"}
    cleared = _preferences(api, user, token, quiet=None).json()
    assert (cleared["quiet"], cleared["notify"]) == (None, ["mention", "repost", "reaction"])
    assert _device(api, user, token)["quiet"] is None
    # a 10 KB zone name (within /preferences' body limit) is refused unread
    huge = _preferences(api, user, token, quiet={"from": "22:00", "to": "07:00", "tz": "Z" * 10_240})
    assert (huge.status_code, huge.json()["error"]) == (400, "invalid_preferences")


def test_presence_starts_ends_and_is_bounded(api: ApiCaller) -> None:
    user, token = SdkUser(), _token()
    _registered(api, user, token)
    started = api.call("POST", "/presence", user, {"device_token": token, "seconds": 90})
    assert started.status_code == 200, started.text
    assert abs(started.json()["present_until"] - (time.time() + 90)) < 30
    ended = api.call("POST", "/presence", user, {"device_token": token, "seconds": 0})
    assert ended.json() == {"present_until": None}
    for seconds in (-1, 301, 1.5, "60", None, True):
        refused = api.call("POST", "/presence", user, {"device_token": token, "seconds": seconds})
        assert refused.status_code == 400, seconds
        assert refused.json()["error"] == "invalid_preferences"
        assert "'seconds'" in refused.json()["message"]


def test_another_npub_can_neither_see_nor_change_a_pair(api: ApiCaller) -> None:
    """The attacker knows the victim's token: without a pair of its own it gets 404; with one
    (registering the same token) it changes only its own pair."""
    victim, attacker, token = SdkUser(), SdkUser(), _token()
    _registered(api, victim, token)
    pause = int(time.time()) + 3600
    for path, body in (("/preferences", {"pause_until": pause}), ("/presence", {"seconds": 300})):
        response = api.call("POST", path, attacker, {"device_token": token, **body})
        assert response.status_code == 404, response.text
        assert response.json()["error"] == "not_registered"
    _registered(api, attacker, token)
    assert _preferences(api, attacker, token, pause_until=pause, muted=[SdkUser().hex]).status_code == 200
    assert api.call("POST", "/presence", attacker, {"device_token": token, "seconds": 299}).status_code == 200
    victim_device = _device(api, victim, token)
    assert (victim_device["pause_until"], victim_device["muted_count"]) == (None, 0)
    assert _device(api, attacker, token)["pause_until"] == pause


def test_preference_routes_need_auth_and_json(api: ApiCaller) -> None:
    user, token = SdkUser(), _token()
    _registered(api, user, token)
    for path in ("/preferences", "/presence"):
        missing = api.call("POST", path, None, {"device_token": token, "seconds": 1})
        assert missing.status_code == 401 and missing.json()["error"] == "auth_missing"
        wrong = api.call("POST", path, user, raw=b"[1]")
        assert wrong.status_code == 400 and wrong.json()["error"] == "invalid_json"
        no_token = api.call("POST", path, user, {"seconds": 1})
        assert no_token.json()["error"] == "invalid_device_token"
