"""The OpenAI ingress's streaming answer (``_SSEResponse`` in
``atp_router/runtime/ingress/openai.py``): the chunk its generator marks last
ends the body in the same ASGI message, and the generator's ``finally`` runs
before the response returns; a body without one ends as Starlette's does."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from starlette.responses import StreamingResponse

from atp_router.runtime.ingress.openai import _LastChunk, _SSEResponse

SCOPE = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "method": "POST", "path": "/"}


async def messages(response: StreamingResponse) -> list[dict[str, Any]]:
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.disconnect"}

    async def send(message: Any) -> None:
        sent.append(message)

    await response(SCOPE, receive, send)
    return sent


async def test_the_last_chunk_ends_the_body_and_the_generator_is_closed() -> None:
    closed: list[bool] = []

    async def body() -> AsyncIterator[bytes]:
        try:
            yield b"data: 1\n\n"
            yield _LastChunk(b"data: 2\n\ndata: [DONE]\n\n")
            yield b"never"
        finally:
            closed.append(True)

    sent = await messages(_SSEResponse(body(), media_type="text/event-stream"))
    assert [(m["type"], m.get("body"), m.get("more_body")) for m in sent] == [
        ("http.response.start", None, None),
        ("http.response.body", b"data: 1\n\n", True),
        ("http.response.body", b"data: 2\n\ndata: [DONE]\n\n", False)]
    assert closed == [True]


async def test_a_body_without_a_last_chunk_ends_as_starlettes() -> None:
    async def body() -> AsyncIterator[bytes]:
        yield b"data: 1\n\n"

    ours = await messages(_SSEResponse(body(), media_type="text/event-stream"))
    theirs = await messages(StreamingResponse(body(), media_type="text/event-stream"))
    assert ours == theirs
    assert ours[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
