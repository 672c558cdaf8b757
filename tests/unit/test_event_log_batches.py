"""A follower reads the events stored together as one batch (EventLog.follow_batches):
the SSE ingresses send a batch as one chunk — one socket write instead of one an event."""

from __future__ import annotations

import trio

from atp_router.runtime.dataplane.eventlog import EventLog
from tests.unit.test_event_log_compaction import _frames


async def test_the_events_stored_together_are_one_batch_and_a_pending_one_waits():
    log = EventLog()
    frames = _frames()
    log.append(frames[0])
    for f in frames[1:4]:
        log.append(f, durable=False)  # one group commit's events, written together
    got: list[list[int]] = []

    async def follow() -> None:
        async for batch in log.follow_batches():
            got.append([ev.id for ev in batch])

    async with trio.open_nursery() as n:
        n.start_soon(follow)
        await trio.testing.wait_all_tasks_blocked()
        assert got == [[1]]  # the stored one; the three others wait for their write
        log.mark_durable(4)
        await trio.testing.wait_all_tasks_blocked()
        assert got == [[1], [2, 3, 4]]
        log.append(frames[4])  # FIN, stored: the follower ends after it
    assert got == [[1], [2, 3, 4], [5]]


async def test_a_batch_is_bounded_and_resumes_after_an_id():
    log = EventLog()
    for f in _frames():
        log.append(f)
    assert [[ev.id for ev in b] async for b in log.follow_batches(after=1, most=2)] == [[2, 3], [4, 5]]
    log.compact()  # a compacted log too
    assert [[ev.id for ev in b] async for b in log.follow_batches(most=64)] == [[1, 2, 3, 4, 5]]


async def test_sse_sends_the_stored_events_of_a_stream_in_one_body_message(nursery, tmp_path):
    """Through a real router's HTTP app: a finished stream's events, read from the
    start, are one ``http.response.body`` message (one socket write), each event
    framed as SSE, in order — one message an event before (issue 25: sends a task)."""
    import atp

    from atp_router.runtime.ingress.http_api import build_app
    from tests.conftest import MECHANICS_RIB, start_router
    from tests.helpers import golden

    env = await start_router(nursery, MECHANICS_RIB, state_dir=tmp_path / "s")
    async with atp.Client(env.url) as c:
        _, st = await c.open_stream(task={"task_type": "code_review"}, content=golden())
        types = [ev.type async for ev in c.events(st)]
    sent: list[dict] = []
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET", "scheme": "http",
             "path": f"/v1/streams/{st.stream_id}/events", "raw_path": f"/v1/streams/{st.stream_id}/events".encode(),
             "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80),
             "headers": [(b"host", b"127.0.0.1")]}

    async def receive() -> dict:
        await trio.sleep_forever()
        raise AssertionError

    async def send(message: dict) -> None:
        sent.append(message)

    with trio.fail_after(30):
        await build_app(env.router)(scope, receive, send)
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200, sent[0]
    bodies = [m["body"] for m in sent[1:] if m.get("body")]
    assert len(bodies) == 1, [len(b) for b in bodies]
    blocks = [b for b in bodies[0].decode().split("\n\n") if b]
    assert [int(b.splitlines()[0][4:]) for b in blocks] == list(range(1, len(types) + 1))
    assert [b.splitlines()[1][7:] for b in blocks] == types
