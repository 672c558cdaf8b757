"""``atp-router`` over TLS 1.3 (spec §4.1) as a user starts it: a real process with
``--tls-cert/--tls-key`` (a trustme PKI), HTTPS and WSS, the plaintext rule for
non-loopback hosts, and one state directory per router."""

from __future__ import annotations

import re
import ssl
import subprocess
from pathlib import Path

import httpx
import pytest
import trio
from trio_websocket import open_websocket_url

from tests.helpers import ROUTER

ROOT = Path(__file__).resolve().parents[2]


async def _start(args: list[str]) -> tuple[trio.Process, str]:
    proc = await trio.lowlevel.open_process([*ROUTER, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                            cwd=ROOT)
    out = b""
    with trio.fail_after(60):
        while b"listening" not in out:
            chunk = await proc.stdout.receive_some(4096)
            assert chunk, out.decode()
            out += chunk
    return proc, out.decode()


async def test_https_and_wss_with_tls13_only(tmp_path, tls_server_files, tls_client_context):
    proc, out = await _start(["--policies", "policies", "--state-dir", str(tmp_path / "s"), "--http-port", "0",
                              "--ws-port", "0", "--tls-cert", str(tls_server_files.cert),
                              "--tls-key", str(tls_server_files.key)])
    try:
        m = re.search(r"listening https://([\d.]+):(\d+) wss://[\d.]+:(\d+)", out)
        assert m, out
        host, http_port, ws_port = m[1], m[2], m[3]
        async with httpx.AsyncClient(verify=tls_client_context) as h:
            r = await h.get(f"https://{host}:{http_port}/v1/health")
            assert r.status_code == 200 and r.json()["status"] == "ok"
        old = ssl.create_default_context(cafile=str(tls_server_files.ca))
        old.maximum_version = ssl.TLSVersion.TLSv1_2
        async with httpx.AsyncClient(verify=old) as h:
            with pytest.raises(httpx.ConnectError):
                await h.get(f"https://{host}:{http_port}/v1/health")
        async with httpx.AsyncClient() as h:  # plain HTTP on the TLS port is no answer
            with pytest.raises(httpx.HTTPError):
                await h.get(f"http://{host}:{http_port}/v1/health")
        async with open_websocket_url(f"wss://{host}:{ws_port}", ssl_context=tls_client_context,
                                      subprotocols=["atp.v1.json"]) as ws:
            assert ws.subprotocol == "atp.v1.json"
    finally:
        proc.terminate()
        await proc.wait()


def test_plaintext_on_a_non_loopback_host_must_be_asked_for(tmp_path):
    r = subprocess.run([*ROUTER, "--policies", "policies", "--state-dir", str(tmp_path / "s"), "--host", "0.0.0.0"],
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 2 and "--plaintext" in r.stderr


async def test_two_routers_cannot_share_a_state_directory(tmp_path):
    state = str(tmp_path / "s")
    first, _ = await _start(["--policies", "policies", "--state-dir", state, "--http-port", "0", "--ws-port", "0"])
    try:
        r = await trio.run_process([*ROUTER, "--policies", "policies", "--state-dir", state, "--http-port", "0",
                                    "--ws-port", "0"], capture_stdout=True, capture_stderr=True, check=False,
                                   cwd=ROOT)
        assert r.returncode == 2 and b"in use by another atp-router" in r.stderr
    finally:
        first.terminate()
        await first.wait()
