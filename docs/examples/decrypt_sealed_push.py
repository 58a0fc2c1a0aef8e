"""Open a sealed sigil-push wakeup the way a phone does, with nostr-sdk only (`pip install
nostr-sdk`): no sigil-push code. tests/push/test_push_sealed.py runs it on pushes captured at the
APNs, FCM and UnifiedPush fakes, so it stays true.

    python decrypt_sealed_push.py PUSH.json DEVICE_SECRET_HEX [RECIPIENT_SECRET_HEX]

PUSH.json is what arrived: the APNs payload (`{"aps": ..., "sealed", "epk"}`), FCM's data map
(`{"type", "sealed", "epk"}`) or a UnifiedPush message after RFC 8291 decryption (the same JSON
as FCM's data). DEVICE_SECRET_HEX is the secret of the key pair whose public key was registered
as `device_key`. With RECIPIENT_SECRET_HEX (the account's key, where the app holds it) the DM
itself is opened too: a NIP-17 gift wrap (kind 1059) is unwrapped, a NIP-04 DM (kind 4)
decrypted. An app whose key lives in a remote signer (NIP-46) asks the signer for that step.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import nostr_sdk


def open_sealed(push: dict[str, Any], device_secret_hex: str) -> dict[str, Any]:
    """The sealed plaintext: `{"v": 1, "event": {...}, "relay": URL}`, or the pointer
    `{"v": 1, "id": EVENT_ID, "kind": K, "relay": URL}` when the event did not fit the push."""
    text = nostr_sdk.nip44_decrypt(
        nostr_sdk.SecretKey.parse(device_secret_hex),
        nostr_sdk.PublicKey.parse(push["epk"]),
        push["sealed"],
    )
    plaintext: dict[str, Any] = json.loads(text)
    if plaintext.get("v") != 1:
        raise ValueError(f"unknown sealed push version {plaintext.get('v')!r}")
    return plaintext


def verified_event(plaintext: dict[str, Any]) -> nostr_sdk.Event:
    """The DM event the push carries, its id and signature checked (never trust a push blindly:
    anyone who learns the device key can seal to it)."""
    event = nostr_sdk.Event.from_json(json.dumps(plaintext["event"]))
    if not event.verify():
        raise ValueError("the event in the push does not verify")
    return event


def read_message(event: nostr_sdk.Event, recipient_secret_hex: str) -> tuple[str, str]:
    """(sender's hex pubkey, message text) of a gift wrap or a kind 4 DM to the recipient."""
    keys = nostr_sdk.Keys.parse(recipient_secret_hex)
    if event.kind().as_u16() == 1059:
        gift = nostr_sdk.UnwrappedGift.from_gift_wrap(keys, event)
        return gift.sender().to_hex(), gift.rumor().content()
    if event.kind().as_u16() == 4:
        text = nostr_sdk.nip04_decrypt(keys.secret_key(), event.author(), event.content())
        return event.author().to_hex(), text
    raise ValueError(f"not a DM kind: {event.kind().as_u16()}")


def main(argv: list[str]) -> int:
    if len(argv) not in (3, 4):
        print(__doc__.strip().splitlines()[4].strip(), file=sys.stderr)
        return 2
    with open(argv[1], encoding="utf-8") as handle:
        push = json.load(handle)
    plaintext = open_sealed(push, argv[2])
    if "event" not in plaintext:
        # the pointer form: fetch the event by id from that relay (a REQ with {"ids": [id]})
        print(json.dumps({"fetch": plaintext["id"], "kind": plaintext["kind"],
                          "from": plaintext["relay"]}))
        return 0
    event = verified_event(plaintext)
    if len(argv) == 3:
        print(json.dumps({"event": plaintext["event"], "relay": plaintext["relay"]}))
        return 0
    sender, text = read_message(event, argv[3])
    print(json.dumps({"from": sender, "text": text, "relay": plaintext["relay"]}, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
