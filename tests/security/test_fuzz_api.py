"""Hostile HTTP bodies against a real router (issue 7 item 10: the control API fuzzed
as the frame decoder is): random JSON of every shape, wrong types, huge numbers,
odd unicode and raw bytes on ``POST /v1/streams``, ``/frames`` and
``/v1/policies/reload``. Every answer is a 4xx with the ``{"error": {"code",
"reason"}}`` body (or a success for a body that happens to be valid) — never a
server fault — and the router keeps serving health afterwards. The one 5xx the
API documents for a well-formed request is allowed: 503 ``EAGENTDOWN`` "no route"
for a task type no policy routes (tests/unit/test_sdk.py)."""

from __future__ import annotations

import json

import httpx
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import start_router

TOKENS = "alice:tok-alice-fuzz,ops:tok-ops-fuzz:admin+operator"
ALICE = {"Authorization": "Bearer tok-alice-fuzz"}
OPS = {"Authorization": "Bearer tok-ops-fuzz"}

scalars = st.none() | st.booleans() | st.integers(min_value=-(2**80), max_value=2**80) | \
    st.floats(allow_nan=False) | st.text(max_size=40)
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=12), inner, max_size=4), max_leaves=20)
stream_bodies = st.fixed_dictionaries({}, optional={
    "task": json_values | st.fixed_dictionaries({"task_type": json_values}),
    "content": json_values | st.fixed_dictionaries({}, optional={"diff": json_values, "files": json_values}),
    "budget": json_values, "qos": json_values, "window": json_values, "idempotency_key": json_values,
})
bodies = st.one_of(
    stream_bodies.map(lambda d: json.dumps(d).encode()),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.binary(max_size=256),
    st.text(max_size=200).map(str.encode),
)


def _check(r: httpx.Response) -> None:
    if r.status_code == 503:
        err = r.json()["error"]
        assert err["code"] == "EAGENTDOWN" and err["reason"].startswith("no route for "), r.text[:300]
        return
    assert r.status_code < 500, (r.status_code, r.text[:300])
    if r.status_code >= 400:
        err = r.json()["error"]
        assert isinstance(err["code"], str) and isinstance(err["reason"], str)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(streams=st.lists(bodies, min_size=1, max_size=3), frames=st.lists(bodies, min_size=1, max_size=3),
       policies=st.lists(bodies | st.text(max_size=300).map(str.encode), min_size=1, max_size=2))
def test_hostile_bodies_get_4xx_never_5xx(tmp_path_factory, streams, frames, policies):
    async def main() -> None:
        policies_dir = tmp_path_factory.mktemp("p") / "policies"
        import shutil

        from tests.conftest import MECHANICS_RIB
        shutil.copytree(MECHANICS_RIB, policies_dir)
        async with trio.open_nursery() as nursery:
            env = await start_router(nursery, policies_dir, tokens_env=TOKENS,
                                     state_dir=tmp_path_factory.mktemp("state"))
            async with httpx.AsyncClient(base_url=env.url, timeout=30) as h:
                # A real stream to post frames on.
                r = await h.post("/v1/streams", json={"task": {"task_type": "code_review"}}, headers=ALICE)
                sid = r.json()["stream_id"]
                for body in streams:
                    _check(await h.post("/v1/streams", content=body, headers=ALICE))
                for body in frames:
                    _check(await h.post(f"/v1/streams/{sid}/frames", content=body, headers=ALICE))
                for body in policies:
                    _check(await h.post("/v1/policies/reload", content=body, headers=OPS))
                assert (await h.get("/v1/health", headers=ALICE)).status_code == 200
            nursery.cancel_scope.cancel()

    trio.run(main)
