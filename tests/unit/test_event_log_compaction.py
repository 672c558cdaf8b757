"""A closed stream's event log compacted into bytes (issue 10): the same events
read back, resumption from any point, no appends after, and the router compacts
a closed stream once nobody follows it."""

from __future__ import annotations

import msgspec
import pytest

from atp_router.runtime.dataplane.eventlog import EventLog
from atp_router.wire.frame import (
    Flag,
    Frame,
    Payload,
    PayloadType,
    Window,
    WindowUpdate,
)


def _frames() -> list[Frame]:
    s, t = "sess_a", "task_b"
    return [
        Frame(v=1, session_id=s, stream_id=t, msg_seq=0, flags=[Flag.SYN, Flag.ACK], meta={"route": {"k": [1, 2]}}),
        Frame(v=1, session_id=s, stream_id=t, msg_seq=1,
              payload=Payload(type=PayloadType.PARTIAL, content={"agent": "a", "report": {"findings": []}})),
        Frame(v=1, session_id=s, stream_id=t, msg_seq=2, payload=Payload(
            type=PayloadType.CONTROL, content=WindowUpdate(window=Window(max_parallel=1, max_tokens=2,
                                                                         max_usd_micros=3)))),
        Frame(v=1, session_id=s, stream_id=t, msg_seq=3, payload=Payload(type=PayloadType.FINAL,
                                                                         content={"result": {"x": 1.5}})),
        Frame(v=1, session_id=s, stream_id=t, msg_seq=4, flags=[Flag.FIN]),
    ]


async def test_compacted_log_reads_back_the_same_events_and_resumes():
    log = EventLog()
    for f in _frames():
        log.append(f)
    before = [(e.id, e.type, msgspec.to_builtins(e.frame)) for e in log.events]
    log.compact()
    assert log._events == [] and isinstance(log._packed, bytes)
    assert [(e.id, e.type, msgspec.to_builtins(e.frame)) for e in log.events] == before
    assert [e.type for e in log.events] == ["SYN_ACK", "PARTIAL", "WINDOW_UPDATE", "FINAL", "FIN"]
    assert [e.id async for e in log.follow(after=2)] == [3, 4, 5]
    assert log.after_message(3) == 4 and len(log) == 5
    with pytest.raises(RuntimeError, match="compacted"):
        log.append(_frames()[0])


def test_an_open_log_is_not_compacted():
    log = EventLog()
    log.append(_frames()[0])
    log.compact()
    assert log._packed is None and len(log.events) == 1


async def test_the_router_compacts_a_closed_stream_nobody_follows(nursery, tmp_path):
    """Through a real router: a finished stream's log is packed once its SSE
    follower is gone, and a client resuming it later still reads every event."""
    import atp

    from tests.conftest import MECHANICS_RIB, start_router
    from tests.helpers import golden

    env = await start_router(nursery, MECHANICS_RIB, state_dir=tmp_path / "s")
    async with atp.Client(env.url) as c:
        _, st = await c.open_stream(task={"task_type": "code_review"}, content=golden())
        types = [ev.type async for ev in c.events(st)]
    [ctx] = [x for x in env.router.streams.values() if x.stream_id == st.stream_id]
    assert ctx.log._packed is not None, "closed and unfollowed: compacted"
    assert [e.type for e in ctx.log.events] == types
    async with atp.Client(env.url) as c:
        again = [ev.type async for ev in c.events(st)]  # a reader after the fact (replay from the start)
    assert again == types and ctx.log._packed is not None
