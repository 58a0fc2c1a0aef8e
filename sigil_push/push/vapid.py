"""VAPID (RFC 8292): the key and the signed `Authorization` header every UnifiedPush POST carries.

AND_3 distributors may refuse pushes from a server that does not identify itself, and an app
that hands our public key to its distributor (from `GET /info`) gets an endpoint that only we
can push to. The key lives in `unifiedpush.vapid_private_key_file`, created 0600 on first start
with the same helpers as the bridge key (sigil_push/identity.py), so restarts and every worker
on the same config folder sign with one key. Signing is py-vapid's; this module only decides
the claims and how long a signed header is reused.
"""

from __future__ import annotations

import base64
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from py_vapid import Vapid02, VapidException
from py_vapid.jwt import sign

from sigil_push.identity import KeyFileError, create_private_file, read_private_file

TOKEN_LIFETIME_SECONDS = 12 * 3600
"""RFC 8292 allows at most 24 h; half of it leaves room for a distributor whose clock runs
ahead of ours, and autopush refuses tokens that expire further out than 24 h from its now."""
REFRESH_MARGIN_SECONDS = 3600
"""A cached header is re-signed once it has less than this left, so no request carries a token
that expires in flight or that a distributor with a slow clock already sees as expired."""
MAX_CACHED_ORIGINS = 1024
"""Endpoints are user input: bound the cache, evicting the origin used longest ago."""

_DEFAULT_PORTS = {"https": 443, "http": 80}

_loaded_public_keys: dict[Path, str] = {}


def loaded_public_key(path: Path) -> str | None:
    """The public key of the VAPID key this process loaded from `path` (None before that).

    `GET /info` publishes it from here, so what apps hand their distributor is exactly the key
    the sender signs with, without a second read of the file.
    """
    return _loaded_public_keys.get(path)


def load_or_create_key(path: Path) -> Vapid02:
    """The VAPID key in `path`, generating a new P-256 key (PEM, 0600) if there is none.

    Besides PEM, the file may hold the raw base64url private key that web-push tools print
    (`vapid --gen`, `web-push generate-vapid-keys`), so an operator can bring an existing key.
    """
    text = read_private_file(path)
    if text is None:
        fresh = Vapid02()
        fresh.generate_keys()
        text = create_private_file(path, fresh.private_pem().decode("ascii").strip())
    try:
        vapid = Vapid02.from_pem(text.encode()) if "-----BEGIN" in text else Vapid02.from_string(text)
    except (VapidException, ValueError, TypeError) as exc:
        raise KeyFileError(f"{path} does not hold a VAPID key: {type(exc).__name__}") from None
    key = vapid.private_key
    if not isinstance(key, ec.EllipticCurvePrivateKey) or not isinstance(key.curve, ec.SECP256R1):
        raise KeyFileError(f"{path} does not hold a P-256 (prime256v1) private key")
    _loaded_public_keys[path] = public_key_b64(vapid)
    return vapid


def public_key_b64(vapid: Vapid02) -> str:
    """The public key as apps hand it to a distributor: base64url of the uncompressed point."""
    raw = vapid.public_key.public_bytes(
        serialization.Encoding.X962, serialization.PublicFormat.UncompressedPoint
    )
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


def origin(endpoint: str) -> str:
    """The RFC 6454 origin of an endpoint URL, which RFC 8292 makes the JWT `aud`."""
    parts = urlsplit(endpoint)
    host = parts.hostname or ""
    port = parts.port
    if ":" in host:
        host = f"[{host}]"
    if port is None or port == _DEFAULT_PORTS.get(parts.scheme):
        return f"{parts.scheme}://{host}"
    return f"{parts.scheme}://{host}:{port}"


class VapidSigner:
    """Signed `Authorization: vapid t=<JWT>, k=<public key>` headers, one per endpoint origin.

    Signing costs an ECDSA signature, about a quarter of the CPU of encrypting a wakeup (34 µs
    against 137 µs measured here; a cached header costs 4 µs). A busy distributor (ntfy.sh,
    Mozilla's autopush) receives most of our pushes, so the header is cached per origin and
    reused until it nears expiry.

    The JWT is py-vapid's (`py_vapid.jwt.sign`: ES256, sorted claims as Chrome's service
    wants). Its `Vapid02.sign` wrapper is not used because it refuses IPv6 literal origins as
    `aud`; the claims it would check are checked here and in the config (`sub`). The header is
    written as RFC 8292 shows it, with `, k=`, which distributors parse with or without the space.
    """

    def __init__(self, vapid: Vapid02, subject: str, clock: Callable[[], float] = time.time) -> None:
        self._vapid = vapid
        self._subject = subject
        self._clock = clock
        self.public_key = public_key_b64(vapid)
        self._cache: OrderedDict[str, tuple[str, int]] = OrderedDict()

    def authorization(self, endpoint: str) -> str:
        audience = origin(endpoint)
        now = self._clock()
        cached = self._cache.get(audience)
        if cached is not None and cached[1] - now > REFRESH_MARGIN_SECONDS:
            self._cache.move_to_end(audience)
            return cached[0]
        expires = int(now) + TOKEN_LIFETIME_SECONDS
        claims = {"aud": audience, "exp": expires, "sub": self._subject}
        header = f"vapid t={sign(claims, self._vapid.private_key)}, k={self.public_key}"
        self._cache[audience] = (header, expires)
        self._cache.move_to_end(audience)
        if len(self._cache) > MAX_CACHED_ORIGINS:
            self._cache.popitem(last=False)
        return header
