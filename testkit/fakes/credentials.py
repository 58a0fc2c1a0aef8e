"""Test credentials made on the fly with `cryptography`: a CA and a TLS certificate for
127.0.0.1/localhost, an APNs .p8 signing key, a Google service-account JSON whose `token_uri`
points at the fake OAuth endpoint, and a WebPush (RFC 8291) subscription key pair.
"""

from __future__ import annotations

import base64
import datetime
import ipaddress
import json
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import NameOID

TEAM_ID = "TEAMID1234"
KEY_ID = "KEYID12345"
TOPIC = "chat.sigil.test"
PROJECT_ID = "sigil-test"


def _pem(key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


@dataclass(frozen=True)
class TlsFiles:
    ca_file: Path
    cert_file: Path
    key_file: Path


def make_tls(folder: Path) -> TlsFiles:
    """A throwaway CA and a server certificate for 127.0.0.1, ::1 and localhost."""
    folder.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(_name("sigil-push test CA"))
        .issuer_name(_name("sigil-push test CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    server_key = ec.generate_private_key(ec.SECP256R1())
    server_cert = (
        x509.CertificateBuilder()
        .subject_name(_name("localhost"))
        .issuer_name(ca_cert.subject)
        .public_key(server_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(
            x509.SubjectAlternativeName([
                x509.DNSName("localhost"),
                x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                x509.IPAddress(ipaddress.ip_address("::1")),
            ]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False
        )
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    files = TlsFiles(folder / "ca.pem", folder / "server.pem", folder / "server-key.pem")
    files.ca_file.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    files.cert_file.write_bytes(server_cert.public_bytes(serialization.Encoding.PEM))
    files.key_file.write_bytes(_pem(server_key))
    return files


def make_apns_key(folder: Path) -> tuple[Path, bytes]:
    """An APNs auth key (.p8, ES256) and the PEM of its public half (for the fake to verify)."""
    key = ec.generate_private_key(ec.SECP256R1())
    path = folder / f"AuthKey_{KEY_ID}.p8"
    path.write_bytes(_pem(key))
    public = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return path, public


def make_service_account(folder: Path, token_uri: str) -> tuple[Path, bytes]:
    """A Google service-account JSON (RSA key) and the PEM of its public key."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    info = {
        "type": "service_account",
        "project_id": PROJECT_ID,
        "private_key_id": os.urandom(8).hex(),
        "private_key": _pem(key).decode(),
        "client_email": f"push@{PROJECT_ID}.iam.gserviceaccount.com",
        "client_id": "1234567890",
        "token_uri": token_uri,
    }
    path = folder / "service-account.json"
    path.write_text(json.dumps(info))
    public = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return path, public


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


@dataclass(frozen=True)
class WebPushSubscriber:
    """The receiving side of RFC 8291: what an app's UnifiedPush connector holds."""

    private_key: ec.EllipticCurvePrivateKey
    auth_secret: bytes

    @classmethod
    def generate(cls) -> WebPushSubscriber:
        return cls(ec.generate_private_key(ec.SECP256R1()), os.urandom(16))

    @property
    def p256dh(self) -> str:
        raw = self.private_key.public_key().public_bytes(
            serialization.Encoding.X962, serialization.PublicFormat.UncompressedPoint
        )
        return _b64url(raw)

    @property
    def auth(self) -> str:
        return _b64url(self.auth_secret)

    def decrypt(self, body: bytes) -> bytes:
        import http_ece

        return bytes(http_ece.decrypt(
            body, private_key=self.private_key, auth_secret=self.auth_secret, version="aes128gcm"
        ))
