"""The bridge's own Nostr key, used to answer NIP-42 AUTH challenges.

Taken from `server.secret_key` when set (the config has validated it); otherwise read from
`server.secret_key_file` (default `bridge.key` next to the config), which is generated with mode
0600 on first start. The key is never kept in the database: a database copy (backup, support
dump) must not carry the bridge's identity. Instances from before this rule kept it in the
`meta` table; the first start moves it into the file and deletes the row, so relays keep seeing
the same identity and signer sessions sealed under it still open (the sealing key of
sigil_push/sealed.py is derived from the bridge key, so losing the key means users register
their signer again).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol

from sigil_push.nostr.keys import SecretKey
from sigil_push.nostr.nip19 import InvalidKey, parse_secret_key

META_KEY = "bridge_secret_key"


class MetaStore(Protocol):
    """The instance's key/value facts (`meta`): declared here, by the module that needs it, and
    implemented by each store engine, so the identity never imports the store."""

    async def get(self, key: str) -> str | None: ...

    async def put_if_absent(self, key: str, value: str) -> None: ...

    async def delete_securely(self, key: str) -> None:
        """Delete, overwriting the freed storage where the engine can (a secret's row)."""
        ...


class KeyFileError(Exception):
    """A key file exists but cannot be read as a key, or cannot be written.

    The helpers below are shared by every key the service keeps in a file of its own (the
    bridge key here, the VAPID key of sigil_push/push/vapid.py)."""


def read_private_file(path: Path) -> str | None:
    """The stripped text of a key file; None when it does not exist yet."""
    try:
        return path.read_text(encoding="ascii").strip()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise KeyFileError(f"cannot read {path}: {exc}") from None


def create_private_file(path: Path, text: str) -> str:
    """Create `path` 0600 holding `text`; returns the text the file holds afterwards.

    An existing file is never overwritten: when another process (a second worker on the same
    config folder) created it first, its key wins and is returned instead of ours.
    """
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        winner = read_private_file(path)
        if not winner:
            raise KeyFileError(f"{path} is being created by another process; start again") from None
        return winner
    except OSError as exc:
        raise KeyFileError(f"cannot create {path}: {exc}") from None
    try:
        with os.fdopen(descriptor, "w", encoding="ascii") as handle:
            handle.write(text + "\n")
    except OSError as exc:
        raise KeyFileError(f"cannot write {path}: {exc}") from None
    return text


def _read_key_file(path: Path) -> SecretKey | None:
    text = read_private_file(path)
    if text is None:
        return None
    return _parse_key_file(path, text)


def _parse_key_file(path: Path, text: str) -> SecretKey:
    try:
        return SecretKey(parse_secret_key(text))
    except InvalidKey as exc:
        raise KeyFileError(f"{path} does not hold a key: {exc}") from None


async def bridge_key(meta: MetaStore, configured: str, key_file: Path) -> SecretKey:
    """The configured key, else the key file's (created on first use). A key an older version
    kept in the database moves to the key file and is deleted there, overwriting its storage
    where the engine can (`MetaStore.delete_securely`)."""
    if configured:
        await meta.delete_securely(META_KEY)
        return SecretKey(parse_secret_key(configured))
    stored = await meta.get(META_KEY)
    key = _read_key_file(key_file)
    if key is None:
        candidate = SecretKey(stored) if stored is not None else SecretKey.generate()
        key = _parse_key_file(key_file, create_private_file(key_file, candidate.secret_hex))
    if stored is not None:
        await meta.delete_securely(META_KEY)
    return key
