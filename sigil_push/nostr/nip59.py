"""NIP-59 gift wraps, as NIP-17 senders build them: rumor → seal (kind 13) → wrap (kind 1059).

The bridge only ever wraps messages to its own canary key (sigil_push/canary.py), but it builds
them exactly like a NIP-17 client does, so a probe takes the path of a real DM on every relay:
a one-time wrapping key, a `p` tag naming the recipient, NIP-44 encryption at both layers, and
`created_at` randomised up to two days into the past (which is what makes catch-up windows and
`since` filters matter). NIP-44 itself comes from nostr-sdk, like the NIP-46 code does.
"""

from __future__ import annotations

import json
import secrets
import time

import nostr_sdk

from sigil_push.nostr.event import Event, compute_id, sign_event
from sigil_push.nostr.keys import SecretKey
from sigil_push.nostr.kinds import CHAT_MESSAGE, GIFT_WRAP, SEAL

MAX_BACKDATE_SECONDS = 2 * 24 * 3600


def _nip44(sender: SecretKey, recipient_hex: str, plaintext: str) -> str:
    return str(
        nostr_sdk.nip44_encrypt(
            nostr_sdk.SecretKey.parse(sender.secret_hex),
            nostr_sdk.PublicKey.parse(recipient_hex),
            plaintext,
            nostr_sdk.Nip44Version.V2,
        )
    )


def _backdated(now: int) -> int:
    return now - secrets.randbelow(MAX_BACKDATE_SECONDS)


def gift_wrap(
    author: SecretKey,
    recipient_hex: str,
    text: str,
    expiration: int | None = None,
    now: int | None = None,
) -> Event:
    """A signed kind 1059 wrap of a kind 14 message from `author` to `recipient_hex`, signed
    by a fresh one-time key. `expiration` (a NIP-40 tag, absolute seconds) lets relays that
    honour it drop the wrap once it has served its purpose."""
    moment = int(time.time()) if now is None else now
    rumor_tags = [["p", recipient_hex]]
    rumor = {
        "id": compute_id(author.public_key_hex, moment, CHAT_MESSAGE, (("p", recipient_hex),), text),
        "pubkey": author.public_key_hex,
        "created_at": moment,
        "kind": CHAT_MESSAGE,
        "tags": rumor_tags,
        "content": text,
    }
    seal = sign_event(
        author,
        SEAL,
        _nip44(author, recipient_hex, json.dumps(rumor, separators=(",", ":"))),
        created_at=_backdated(moment),
    )
    one_time = SecretKey.generate()
    wrap_tags = [["p", recipient_hex]]
    if expiration is not None:
        wrap_tags.append(["expiration", str(expiration)])
    wrap = sign_event(
        one_time,
        GIFT_WRAP,
        _nip44(one_time, recipient_hex, json.dumps(seal.to_json(), separators=(",", ":"))),
        wrap_tags,
        created_at=_backdated(moment),
    )
    return wrap
