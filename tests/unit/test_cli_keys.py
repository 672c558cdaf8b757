"""`atp-router keys new` (README "Sharing the router"): the line it prints pastes under
``api_keys:`` as is, both role spellings work, and the secret it prints authenticates
against the file made from that line."""

from __future__ import annotations

import subprocess
import sys

import pytest

from atp_router.security.authn import Authenticator, load_auth_config


def _keys_new(*args: str) -> tuple[str, str]:
    done = subprocess.run([sys.executable, "-m", "atp_router.deploy.cli", "keys", "new", *args],
                          capture_output=True, text=True, check=True, timeout=60)
    lines = done.stdout.splitlines()
    assert lines[0].startswith("secret (shown once): ")
    entry = next(line for line in lines if line.lstrip().startswith("- {"))
    return lines[0].split(": ", 1)[1], entry


@pytest.mark.parametrize("roles", [("admin,operator",), ("admin", "operator"), ("admin, operator",)])
def test_the_printed_entry_pastes_under_api_keys_and_authenticates(tmp_path, roles):
    secret, entry = _keys_new("ops", "ops", *roles)
    auth = tmp_path / "auth.yaml"
    auth.write_text("api_keys:\n" + entry + "\n")
    config = load_auth_config(auth)
    [key] = config.api_keys
    assert (key.id, key.tenant, sorted(str(r) for r in key.roles)) == ("ops", "ops", ["admin", "operator"])
    identity = Authenticator(config).authenticate(f"Bearer {secret}", now=0.0)
    assert identity.tenant == "ops"


def test_roles_default_to_client_and_an_unknown_role_is_refused():
    _, entry = _keys_new("ci", "alice")
    assert "roles: [client]" in entry
    done = subprocess.run([sys.executable, "-m", "atp_router.deploy.cli", "keys", "new", "ci", "alice", "root"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "root" in done.stderr
