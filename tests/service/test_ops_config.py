"""Config of the operator features: `[canary]`, `server.observations_retention_days` and the
tuning keys promoted from constants (`bridge.relay_heartbeat_seconds`,
`bridge.relay_open_timeout_seconds`, `unifiedpush.endpoint_check_timeout_seconds`) are
validated like the rest of relays.toml (exit 2, one line naming the key), and a canary key file
that cannot be used stops the service without being replaced. The store plays no part in
these refusals, so the default engine is used."""

from __future__ import annotations

from pathlib import Path

import pytest

from testkit.cli import assert_config_refused
from testkit.service import ServiceProcess


@pytest.mark.parametrize(
    ("toml", "key"),
    [
        ("canary = 5\n", "canary"),
        ("[canary]\ninterval_seconds = 0\n", "canary.interval_seconds"),
        ('[canary]\ninterval_seconds = "5m"\n', "canary.interval_seconds"),
        ('[canary]\nenabled = "yes"\n', "canary.enabled"),
        ('[canary]\nrelays = "wss://r.example"\n', "canary.relays"),
        ('[canary]\nrelays = ["https://r.example"]\n', "canary.relays"),
        ("[canary]\nrelays = [1]\n", "canary.relays"),
        ('[canary]\nkey_file = ""\n', "canary.key_file"),
        ("[canary]\ncolour = 1\n", "canary.colour"),
        ("[server]\nobservations_retention_days = -1\n", "server.observations_retention_days"),
        ("[server]\nobservations_retention_days = 1.5\n", "server.observations_retention_days"),
        ("[bridge]\nrelay_heartbeat_seconds = 0\n", "bridge.relay_heartbeat_seconds"),
        ('[bridge]\nrelay_heartbeat_seconds = "30s"\n', "bridge.relay_heartbeat_seconds"),
        ("[bridge]\nrelay_open_timeout_seconds = 0\n", "bridge.relay_open_timeout_seconds"),
        (
            '[unifiedpush]\nvapid_subject = "mailto:ops@example.org"\nendpoint_check_timeout_seconds = 0\n',
            "unifiedpush.endpoint_check_timeout_seconds",
        ),
    ],
)
def test_invalid_ops_config_exits_2_naming_the_key(tmp_path: Path, toml: str, key: str) -> None:
    assert_config_refused(tmp_path, toml, key)


@pytest.mark.slow
def test_an_unusable_canary_key_file_stops_the_service_and_is_kept(tmp_path: Path) -> None:
    """A key file that holds no key is an operator's problem to fix, never a reason to make a
    new identity: the service refuses to start, names the key, and leaves the file as it was."""
    service = ServiceProcess(
        tmp_path / "service", ["ws://127.0.0.1:9"], "[canary]\ninterval_seconds = 60\n"
    )
    key_file = service.folder / "canary.key"
    key_file.write_text("not a key\n")
    assert "canary.key_file" in service.refuses_to_start()
    assert key_file.read_text() == "not a key\n"
