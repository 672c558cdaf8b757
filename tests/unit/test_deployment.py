"""What a deployment mode gives the Router it assembles (atp_router.runtime.deployment;
issue 21 item 3): the hooks the runtime calls at defined points, each on a real
router built by ``atp_router.deploy.single.build``.

* a :class:`SynGate`'s refusal answers the SYN with a lone ERROR (its code,
  reason and ``retry_after_ms``; no RST) before its session sees it: no stream,
  the SYN not counted in; :meth:`Router.open_stream` raises it as an ATPError;
* a gate whose ``resumes`` says no makes a keyed SYN no resumption here;
* ``store_refusal`` turns a store that cannot be reached during an open into
  the deployment's ATPError (without one, StoreUnavailable propagates);
* ``services`` are called with the router when it starts serving, before it
  reports started, and their loops run; ``rib_version`` names a reload's version.

(The cluster's and the workers' gates are tested end to end in
tests/scale/test_cluster.py and tests/scale/test_workers.py.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from atp_router.deploy import single
from atp_router.runtime.config import RouterConfig
from atp_router.runtime.deployment import SynGate
from atp_router.runtime.router import Router
from atp_router.security.authz import Refuse
from atp_router.security.identity import ANONYMOUS, Identity
from atp_router.store import StoreUnavailable
from atp_router.task.meta import TaskMeta
from atp_router.wire import session as S
from atp_router.wire.errors import ATPError, ErrorCode, PolicyError
from atp_router.wire.frame import ErrorPayload, Flag, Frame, QoS
from tests.conftest import MECHANICS_RIB

META = {"task_type": "code_review", "languages": ["py"]}


class Gate(SynGate):
    """Refuses SYNs keyed ``busy``; lets no SYN keyed in ``elsewhere`` resume;
    raises StoreUnavailable for ``down``."""

    def __init__(self) -> None:
        self.elsewhere: set[str] = set()
        self.calls: list[tuple[str, str]] = []

    def refuse(self, frame: Frame, identity: Identity, task: TaskMeta | None) -> Refuse | None:
        key = task.idempotency_key if task is not None else None
        self.calls.append(("refuse", str(key)))
        if key == "down":
            raise StoreUnavailable("store gone")
        if key == "busy":
            return Refuse(ErrorCode.EAGENTDOWN, "runs on another router: resume it there", 750)
        return None

    def resumes(self, frame: Frame, identity: Identity, key: str) -> bool:
        self.calls.append(("resumes", key))
        return key not in self.elsewhere


def build(tmp_path: Path, **kw: Any) -> Router:
    return single.build(RouterConfig(policies=MECHANICS_RIB, state_dir=tmp_path / "state"), **kw)


def keyed_syn(key: str, stream_id: str = "s1") -> Frame:
    return Frame(v=1, session_id="sess1", stream_id=stream_id, msg_seq=0, flags=[Flag.SYN], qos=QoS.SILVER,
                 meta={**META, "idempotency_key": key})


def open_keyed(router: Router, key: str) -> Any:
    return router.open_stream(task=META, content=None, budget=None, qos=None, window=None, idempotency_key=key,
                              identity=ANONYMOUS)


async def test_a_gate_refusal_is_a_lone_error_before_the_session_sees_the_syn(tmp_path):
    gate = Gate()
    router = build(tmp_path, syn_gates=[gate])
    try:
        out = router.receive_frame(keyed_syn("busy"), identity=ANONYMOUS, now=trio.current_time())
        assert len(out) == 1
        err = out[0]
        assert err.flags == [Flag.CTRL] and (err.session_id, err.stream_id, err.msg_seq) == ("sess1", "s1", 0)
        assert isinstance(err.payload.content, ErrorPayload)
        assert (err.payload.content.code, err.payload.content.reason, err.payload.content.retry_after_ms) == (
            ErrorCode.EAGENTDOWN, "runs on another router: resume it there", 750)
        # No stream, and the session never saw the SYN: the same ids open a stream afterwards.
        assert router.streams.get(ANONYMOUS.tenant, "sess1", "s1") is None
        sess = router.streams.session(ANONYMOUS.tenant, "sess1", now=trio.current_time())
        assert sess.stream_state("s1") is S.StreamState.IDLE
        assert router.metrics.errors.labels("EAGENTDOWN")._value.get() == 1
        assert router.metrics.frames.labels("in", "SYN")._value.get() == 0
        with pytest.raises(ATPError) as e:
            open_keyed(router, "busy")
        assert (e.value.code, e.value.reason, e.value.retry_after_ms) == (
            ErrorCode.EAGENTDOWN, "runs on another router: resume it there", 750)
        # A SYN the gate lets through opens as ever.
        out = router.receive_frame(keyed_syn("free"), identity=ANONYMOUS, now=trio.current_time())
        assert [f.flags for f in out] == [] and router.streams.get(ANONYMOUS.tenant, "sess1", "s1") is not None
        assert router.metrics.frames.labels("in", "SYN")._value.get() == 1
    finally:
        router.close_state()


async def test_a_gate_that_says_no_makes_a_keyed_syn_no_resumption(tmp_path):
    gate = Gate()
    router = build(tmp_path, syn_gates=[gate])
    try:
        ctx = open_keyed(router, "k1")
        assert router.resume_point(keyed_syn("k1", "s9"), identity=ANONYMOUS) == (ctx, 0)
        assert open_keyed(router, "k1") is ctx
        gate.elsewhere.add("k1")
        gate.calls.clear()
        assert router.resume_point(keyed_syn("k1", "s9"), identity=ANONYMOUS) is None
        assert gate.calls == [("resumes", "k1")]
    finally:
        router.close_state()


async def test_store_refusal_turns_an_unreachable_store_into_the_deployments_error(tmp_path):
    def refusal(op: str, e: StoreUnavailable) -> ATPError:
        seen.append((op, str(e)))
        return ATPError(ErrorCode.EBUDGET, f"budget store unavailable: {e}; retry", retry_after_ms=1000)

    seen: list[tuple[str, str]] = []
    router = build(tmp_path, syn_gates=[Gate()], store_refusal=refusal)
    try:
        with pytest.raises(ATPError) as e:
            open_keyed(router, "down")
        assert (e.value.code, e.value.reason, e.value.retry_after_ms) == (
            ErrorCode.EBUDGET, "budget store unavailable: store gone; retry", 1000)
        assert seen == [("open", "store gone")]
    finally:
        router.close_state()
    # A single router's own refusal (its store full, atp_router.deploy.single): EBUDGET, retry in a second.
    plain = single.build(RouterConfig(policies=MECHANICS_RIB, state_dir=tmp_path / "plain"), syn_gates=[Gate()])
    try:
        with pytest.raises(ATPError) as e:
            open_keyed(plain, "down")
        assert (e.value.code, e.value.retry_after_ms) == (ErrorCode.EBUDGET, single.RETRY_AFTER_MS)
        assert e.value.reason.startswith("store gone: new spend is refused until the state store takes writes again")
    finally:
        plain.close_state()


async def test_services_start_with_the_router_and_rib_version_names_a_reload(tmp_path):
    ran = trio.Event()
    called: list[Router] = []

    def service(router: Router) -> list[Any]:
        called.append(router)

        async def loop() -> None:
            ran.set()
            await trio.sleep_forever()

        return [loop]

    router = build(tmp_path, services=[service], rib_version=lambda: 42)
    async with trio.open_nursery() as nursery:
        await nursery.start(router.serve)
        assert called == [router]  # before serve reported started
        with trio.fail_after(5):
            await ran.wait()
        summary = router.reload(None)
        assert summary["version"] == 42 and router.gen.version == 42
        nursery.cancel_scope.cancel()


def test_a_router_refused_at_start_closes_its_state_as_at_a_stop(tmp_path):
    # The single router's store writes through its redo log (atp_router.store.redo): a start refused
    # after the state was opened (here: a policy whose agent no policy body can name) must not leave
    # it for the next start to replay as a crash's, nor hold the directory's lock.
    state = tmp_path / "state"
    build(tmp_path).close_state()  # a first, clean life: the directory exists, its store settled
    bad = tmp_path / "bad.yaml"
    bad.write_text("agents: {a: {kind: nonsense}}\npolicies: []\n")
    with pytest.raises(PolicyError):
        single.build(RouterConfig(policies=bad, state_dir=state))
    assert not (state / "state.db.redo").exists()
    build(tmp_path).close_state()  # the directory was released: this process opens it again
