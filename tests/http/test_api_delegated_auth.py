"""`auth_signer` through the real API: session outcome visible to the owner, URI never stored."""

from __future__ import annotations

import secrets
import time

import pytest

from testkit.deadlines import scaled
from testkit.nip98 import SdkUser
from testkit.relay import RelayProcess
from testkit.remote_signer import RemoteSigner
from testkit.service import ServiceProcess
from tests.conftest import ApiCaller


def signer_status(api: ApiCaller, user: SdkUser, wanted: str | None) -> dict[str, object]:
    """Poll the owner's view; one request per second, since an identical NIP-98 event made in
    the same second has the same id and would be refused as a replay."""
    deadline = time.monotonic() + scaled(30)
    while time.monotonic() < deadline:
        time.sleep(1.05)
        devices = api.call("GET", "/registrations", user).json()["devices"]
        if devices and devices[0]["auth_signer_status"] == wanted:
            return dict(devices[0])
    raise AssertionError(f"signer status never became {wanted}: {devices}")


@pytest.mark.slow
def test_signer_session_is_reported_and_ends_with_the_last_device(
    api: ApiCaller, service: ServiceProcess, module_relay: RelayProcess
) -> None:
    secret = "bunker-secret-" + secrets.token_hex(8)
    signer = RemoteSigner(module_relay.url, secret=secret).start()
    try:
        user = SdkUser(keys=signer.user)
        token = secrets.token_hex(32)
        response = api.register(user, device_token=token, auth_signer=signer.bunker_uri)
        assert response.status_code == 201, response.text
        device = signer_status(api, user, "active")
        assert device["delegated_auth"] is True
        assert signer.methods() == ["connect", "get_public_key"]
        assert api.call("DELETE", "/unregister", user, {"device_token": token}).json() == {"removed": 1}
        api.register(user, device_token=secrets.token_hex(32))
        assert signer_status(api, user, None)["delegated_auth"] is False
    finally:
        signer.stop()
    stored = b"".join(path.read_bytes() for path in service.folder.glob("sigil-push.db*"))
    assert secret.encode() not in stored
    assert secret not in service.log()
    assert signer.bunker_uri not in service.log()


@pytest.mark.slow
def test_refusing_signer_is_visible_to_the_owner(api: ApiCaller, module_relay: RelayProcess) -> None:
    signer = RemoteSigner(module_relay.url, refuse=True).start()
    try:
        user = SdkUser(keys=signer.user)
        api.register(user, device_token=secrets.token_hex(32), auth_signer=signer.bunker_uri)
        device = signer_status(api, user, "refused")
        assert device["delegated_auth"] is False
        assert device["auth_signer_detail"]
    finally:
        signer.stop()
