"""Register a device with a sigil-push instance, the NIP-98 auth event built by nostr-sdk.

What an app does, with the library an app would use (rust-nostr's nostr-sdk; its Swift and
Kotlin bindings are generated from the same Rust API and keep these names, in their casing).
Nothing here comes from sigil-push's own package. The test suite runs this file against a
running instance (tests/http/test_client_examples.py), so it keeps working.

    pip install nostr-sdk
    python docs/examples/nip98_register.py https://push.example.org <secret key: nsec or hex> \\
        <device token> [ios|android|unifiedpush]

It prints the status and the JSON answer (201 for a new registration, 200 for an update).
"""

from __future__ import annotations

import base64
import hashlib
import json
import secrets
import sys
import urllib.error
import urllib.request

import nostr_sdk


def nip98_header(keys: nostr_sdk.Keys, url: str, method: str, body: bytes) -> str:
    """`Authorization: Nostr <base64 of a signed kind 27235>` for exactly this request: `u` is
    the instance's public URL plus the path, `method` the request's, `payload` the hex SHA-256
    of the exact body bytes (left out for a request without a body). The `nonce` tag is
    optional: the instance ignores tags it does not know, and a random one gives each signed
    event its own id, so two requests signed in the same second are two events."""
    tags = [["u", url], ["method", method]]
    if body:
        tags.append(["payload", hashlib.sha256(body).hexdigest()])
    tags.append(["nonce", secrets.token_hex(8)])
    event = (
        nostr_sdk.EventBuilder(nostr_sdk.Kind(27235), "")
        .tags([nostr_sdk.Tag.parse(tag) for tag in tags])
        .finalize(keys)
    )
    return "Nostr " + base64.b64encode(event.as_json().encode()).decode()


def register(base_url: str, keys: nostr_sdk.Keys, token: str, platform: str) -> tuple[int, dict]:
    url = base_url.rstrip("/") + "/register"
    body = json.dumps({
        "npub": keys.public_key().to_bech32(), "platform": platform, "device_token": token,
    }).encode()
    request = urllib.request.Request(url, data=body, method="POST", headers={
        "Content-Type": "application/json",
        "Authorization": nip98_header(keys, url, "POST", body),
    })
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as refused:  # every refusal is {"error", "message"}
        return refused.code, json.load(refused)


def main() -> int:
    if len(sys.argv) not in (4, 5):
        print(__doc__, file=sys.stderr)
        return 2
    base_url, secret, token = sys.argv[1:4]
    platform = sys.argv[4] if len(sys.argv) == 5 else "ios"
    status, answer = register(base_url, nostr_sdk.Keys.parse(secret), token, platform)
    print(status, json.dumps(answer))
    return 0 if status in (200, 201) else 1


if __name__ == "__main__":
    sys.exit(main())
