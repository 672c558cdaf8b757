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


async def test_sse_sends_the_stored_events_of_a_stream_in_one_body_message(nursery, tmp_path, bodies_expected=1):
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
    if bodies_expected is not None:
        assert len(bodies) == bodies_expected, [len(b) for b in bodies]
    else:  # cut at SSE_CHUNK_BYTES: each chunk ends with a whole event, and past the bound only by its last one
        from atp_router.runtime.ingress.http_api import SSE_CHUNK_BYTES

        assert len(bodies) > 1 and all(b.endswith(b"\n\n") for b in bodies)
        for b in bodies:
            events = [e + b"\n\n" for e in b.split(b"\n\n") if e]
            assert b"".join(events) == b and sum(map(len, events[:-1])) < SSE_CHUNK_BYTES
    blocks = [b for b in b"".join(bodies).decode().split("\n\n") if b]
    assert [int(b.splitlines()[0][4:]) for b in blocks] == list(range(1, len(types) + 1))
    assert [b.splitlines()[1][7:] for b in blocks] == types


async def test_a_batch_of_large_events_is_cut_into_bounded_chunks(nursery, tmp_path, monkeypatch):
    """The same read with SSE_CHUNK_BYTES small: several body messages, each
    cut at an event's end once past the bound, together every event once."""
    import atp_router.runtime.ingress.http_api as http_api

    monkeypatch.setattr(http_api, "SSE_CHUNK_BYTES", 200)
    await test_sse_sends_the_stored_events_of_a_stream_in_one_body_message(nursery, tmp_path, bodies_expected=None)
