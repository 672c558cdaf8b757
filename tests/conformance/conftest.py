"""Conformance fixtures: the implementation under test is reached only over the wire.

Set ``ATP_CONFORMANCE_HTTP`` (control API base URL) and ``ATP_CONFORMANCE_WS``
(WebSocket ingress URL) to test another ATP implementation; ``ATP_CONFORMANCE_TOKEN``
is sent as a bearer token. Unset, the suite starts this repository's router on free
loopback ports with its default RIB.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest

from tests.conftest import start_router


@dataclass
class Target:
    http: str
    ws: str
    token: str | None


@pytest.fixture
async def target(nursery, policies_dir) -> Target:
    http, ws = os.environ.get("ATP_CONFORMANCE_HTTP"), os.environ.get("ATP_CONFORMANCE_WS")
    if http and ws:
        return Target(http, ws, os.environ.get("ATP_CONFORMANCE_TOKEN"))
    env = await start_router(nursery, policies_dir)
    return Target(env.url, env.ws_url, None)
