"""OpenAI-compatible ingress on the HTTP control API (issue 10 item 1).

=====================================  =========================================
``POST /v1/chat/completions``          a chat completion (``stream: false``: one
                                       :class:`ChatCompletion`; ``stream: true``:
                                       Server-Sent Events, one
                                       :class:`ChatCompletionChunk` per
                                       ``data:`` line, then ``data: [DONE]``)
``GET  /v1/models``                    :class:`ModelList`: the models the
                                       caller's tenant may use
=====================================  =========================================

Any OpenAI client works against it (``OpenAI(base_url="http://host:7070/v1",
api_key=<the tenant's ATP key>)``). Nothing here is a second data plane: a
completion is a stream opened with :meth:`Router.open_stream
<atp_router.runtime.router.Router.open_stream>` — the SYN ``POST /v1/streams`` synthesises —
so the policy's fan-out, escalation, consensus, budget, QoS and the tenant's
scopes, quotas, open rate and budget all apply, and the stream is audited and
stored like any other (its ``stream_id`` is in the answer's ``atp`` field:
``GET /v1/streams/{id}/events`` and ``POST /v1/streams/{id}/feedback`` work on it).

This module has the handlers; the request and answer Structs and the errors are in
:mod:`~atp_router.runtime.ingress.openai_schema`, the model mapping
(:func:`~atp_router.runtime.ingress.openai_models.resolve_model`) in
:mod:`~atp_router.runtime.ingress.openai_models`.

Authentication and authorization are the control API's own (``authorized`` in
:func:`atp_router.runtime.ingress.http_api.build_app`): the ``Authorization: Bearer <key>`` header,
action ``stream_open`` (role ``client``) for both endpoints.

**Models** (``model``; :func:`resolve_model`), in this order:

==========================  ================================================
``policy:<name>``           the RIB policy ``<name>``: the task meta is its
                            ``match``'s equality values (``task_type`` the
                            first the tenant may use); keys it compares
                            numerically (``diff_loc: ">400"``) come from the
                            task as usual. When another policy comes first in
                            the RIB for that meta, or the meta does not match
                            it, the request is refused (400 ``EPROTO``,
                            ``param: model``) — never silently routed elsewhere
``task:<type>``             task type ``<type>``: meta ``{task_type: <type>}``,
                            routed by the FIB (first matching policy)
``<type>``                  a task type some policy's ``match`` pins (as
                            ``task:<type>``)
``<name>``                  otherwise a policy name (as ``policy:<name>``)
anything else               404, ``code: EPROTO``, ``param: model``
==========================  ================================================

``GET /v1/models`` lists the pinned task types the tenant's ``task_types`` scope
allows (all without one) and ``policy:<name>`` for each policy with such a task
type (policies without a ``task_type`` in their match only for a tenant without
a scope); each entry's ``atp`` field says its ``kind`` and the policies / task
types behind it.

**Task content.** The messages become ``{"messages": [{"role", "content"}, …]}``
(``content`` a string; text parts are joined with ``\\n``; ``name`` kept). For
task type ``code_review``, when the last user message is a unified diff, the
content is ``{"diff": <that text>}`` instead, with ``files`` from ``atp.files``
(path → after-diff text) or, when the router runs with ``--repo``, read from the
checkout exactly as the A2A server does (:mod:`atp_router.runtime.ingress.repo_files`). A task
whose routed next-hops need files they cannot get is refused (400 ``EPROTO``).
The diff is parsed once, here (:func:`task_content`): the files read from the
checkout, the ``diff_loc`` a ``policy:<name>`` model is checked with and every
next-hop of the stream use that one parse.

**Request** (:class:`ChatCompletionRequest`, strict: an unknown field is 400
naming it in ``param``): ``model``, ``messages`` (1..256; roles ``system``,
``developer``, ``user``, ``assistant``; content a string or text parts, at most
1,000,000 characters a message; the whole body at most ``max_body_bytes``, 413
above), ``stream``, ``stream_options.include_usage``, ``max_tokens`` /
``max_completion_tokens`` (tokens), ``n`` (1 only). ``temperature``, ``top_p``,
``stop``, ``seed``, ``presence_penalty``, ``frequency_penalty``, ``user``,
``metadata`` and ``store`` are validated and ignored: the policy's agents decide
how they sample. Tools, function calls, images and audio are refused (400).
``max_tokens`` (or ``max_completion_tokens``) is OpenAI's **output cap**: each
model next-hop is asked for at most that many output tokens (the tighter of it
and its RIB model's ``max_out_tokens``), and its preflight reservation is its
prompt plus that cap (``meta.max_out_tokens``, :class:`~atp_router.task.meta.TaskMeta`);
the budget stays ``atp.budget``, the policy's and the tenant's
``max_stream_budget`` as for any stream. The extension ``atp``
(:class:`AtpOptions`): ``budget: {usd, tokens}`` (float USD, tokens), ``qos``
(``gold``/``silver``/``bronze``, at most the tenant's ``qos_max``),
``idempotency_key`` (a retried request with the same key gets the same stream,
never a second charge, spec §8; the same key with other messages is a 409
``EPROTO`` conflict naming it) and ``files``.

**Answer** (:class:`ChatCompletion`): ``id`` ``chatcmpl-<stream_id>``,
``choices[0].message.content`` the FINAL rendered by :func:`completion_text`,
``finish_reason`` ``"length"`` when the budget cut the stream short (an ERROR
``EBUDGET`` came before the FINAL) else ``"stop"``; ``usage.total_tokens`` is
the FINAL's ``telemetry.tokens``, ``completion_tokens`` the output tokens the
next-hops' reports declare (at most the total), ``prompt_tokens`` the rest; the
extension ``atp`` (:class:`AtpCompletion`) has the cost in float USD, the
stream and session ids, the policy, the findings, consensus, prose answers and
the signed usage summary (``GET /v1/keys`` verifies it).

**Streaming**: a first chunk with ``delta.role = "assistant"``; the text deltas
of the first next-hop that streams prose (PARTIAL ``{agent, delta}``), live;
at the FINAL the rest of :func:`completion_text` — when the live text is a
prefix of it (one next-hop answering) the concatenated deltas equal the
non-streaming content, otherwise a blank line and the whole content follow the
live text; then a chunk with ``finish_reason`` and ``atp``; with
``stream_options.include_usage`` a chunk with ``choices: []`` and ``usage``; then
``data: [DONE]``. A stream that ends without a FINAL sends ``data: {"error":
{…}}`` (OpenAI clients raise it) and ``data: [DONE]``. A request whose client
goes away resets its stream (RST ``EPREEMPT``: its calls stop, what they used is
committed), unless it carries ``atp.idempotency_key`` (then the stream is
detached and stays resumable by a retry for the router's grace period).

**Errors** are OpenAI-shaped, ``{"error": {"message", "type", "code", "param"}}``,
``code`` the ATP code (spec §10): 400 ``EPROTO`` (malformed or unsupported
request, ``param`` the field), 401 ``ESEC`` (missing or unknown key,
``authentication_error``), 403 ``ESEC`` (a role, task type or data category
outside the tenant's scope, ``permission_error``), 404 ``EPROTO`` (unknown model),
402 ``EBUDGET`` (nothing could be run within the budget, ``insufficient_quota``),
409 ``EWINDOW`` (the router's stream table is full), 413 ``EPROTO`` (body over
``max_body_bytes``), 429 ``EWINDOW`` with ``Retry-After`` (s; the tenant's stream
quota or open rate), 503 ``EAGENTDOWN`` (no route, no healthy next-hop) or
``EPREEMPT``, 504 ``ETIMEOUT``, 502 ``ECONSENSUS``. An error that comes after the
task ran (the stream's RST or ``EBUDGET``) carries ``x-should-retry: false``: an
OpenAI client's automatic retry would run — and charge — the task again.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal

import msgspec
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Send

from atp_router.consensus.types import FinalResult, Result
from atp_router.runtime.dataplane.dispatch import NEXT_HOP_FAILED
from atp_router.runtime.dataplane.plan import parse_off_loop
from atp_router.runtime.dataplane.stream import StreamCtx
from atp_router.runtime.ingress.bodies import BodyRefused, decode_off_loop, release_body
from atp_router.runtime.ingress.openai_models import (
    RibView,
    model_list,
    resolve_model,
    unknown_model,
)
from atp_router.runtime.ingress.openai_schema import (
    AssistantMessage,
    AtpCompletion,
    AtpOptions,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Choice,
    ChunkChoice,
    ChunkDelta,
    CompletionUsage,
    IngressError,
    decode_request,
    error_body,
    error_response,
)
from atp_router.runtime.ingress.repo_files import complete_from_repo
from atp_router.runtime.router import Router
from atp_router.security.identity import Identity
from atp_router.task.body import Chat
from atp_router.task.change import ParsedChange
from atp_router.wire.errors import ATPError, ErrorCode
from atp_router.wire.frame import ErrorPayload, Frame

__all__ = [
    "CHAT_PATH",
    "MODELS_PATH",
    "MODEL_PATH",
    "StreamOutcome",
    "completion_text",
    "error_of",
    "openai_routes",
    "remaining_text",
    "task_content",
]

CHAT_PATH = "/v1/chat/completions"
MODELS_PATH = "/v1/models"
#: One model's card (``client.models.retrieve``).
MODEL_PATH = "/v1/models/{model}"

#: The task type whose unified diff in the last user message becomes ``{"diff"}``.
CODE_REVIEW = "code_review"

_enc = msgspec.json.Encoder()


# ------------------------------------------------------------------ task content


async def task_content(req: ChatCompletionRequest,
                       task_type: str | None) -> tuple[dict[str, Any], ParsedChange | None]:
    """The stream's task content (module doc, "Task content") and, for a
    ``code_review`` diff, that diff parsed — once for the task: the ingress
    reads its files from it and the router hands it to every next-hop
    (:func:`~atp_router.runtime.dataplane.plan.parse_off_loop`, off the event
    loop for a large one). Raises :class:`IngressError` for ``atp.files``
    without a diff."""
    files = req.atp.files if req.atp is not None else None
    if task_type == CODE_REVIEW:
        last = next((m for m in reversed(req.messages) if m.role == "user"), None)
        text = last.text() if last is not None else ""
        change = await parse_off_loop(text)
        if change.files:
            content: dict[str, Any] = {"diff": text}
            if files is not None:
                content["files"] = dict(files)
            return content, change
    if files is not None:
        raise IngressError(ErrorCode.EPROTO, "atp.files goes with a code_review task whose last user message is a "
                           "unified diff", param="atp.files")
    body: dict[str, Any] = msgspec.to_builtins(Chat(messages=[m.turn() for m in req.messages]))
    return body, None


# ------------------------------------------------------------------ answer


#: Appended to a finding's line when the change itself carried the comment that would
#: have suppressed it (issue 19: a reviewer sees that the author silenced it).
SILENCED = " (silenced by the change)"


def completion_text(result: Result) -> str:
    """The message content of a FINAL ``result``, exactly:

    * one prose answer, no finding and no failed next-hop: that answer's text;
    * otherwise blocks joined by a blank line: each answer as ``<agent>: <text>``
      (FINAL order); ``N finding(s):`` then one line per merged finding,
      ``- <file>:<span> <severity>: <claim> [<provenance, …>]`` (then `` (silenced
      by the change)`` when ``suppressed_by_change``); ``incomplete:``
      then ``- next-hop failed: <agent>: <code>: <reason>`` per failed next-hop
      (``consensus.uncertainties``); ``no findings`` when there is nothing else.
    """
    failed = [u for u in result.consensus.uncertainties if u.startswith(NEXT_HOP_FAILED)]
    if len(result.answers) == 1 and not result.findings and not failed:
        return result.answers[0].text
    blocks = [f"{a.agent}: {a.text}" for a in result.answers]
    if result.findings:
        blocks.append(f"{len(result.findings)} finding(s):\n" + "\n".join(
            f"- {f.file}:{f.span} {f.severity}: {f.claim} [{', '.join(f.provenance)}]"
            + (SILENCED if f.suppressed_by_change else "") for f in result.findings))
    if failed:
        blocks.append("incomplete:\n" + "\n".join(f"- {u}" for u in failed))
    return "\n\n".join(blocks) if blocks else "no findings"


def error_of(frame: Frame) -> tuple[ErrorCode, str] | None:
    p = frame.payload
    c = p.content if p is not None else None
    if isinstance(c, ErrorPayload):
        return c.code, c.reason
    if isinstance(c, dict) and c.get("kind") == "ERROR":
        try:
            return ErrorCode(str(c.get("code"))), str(c.get("reason", ""))
        except ValueError:
            return ErrorCode.EPROTO, str(c.get("reason", ""))
    return None


@dataclass
class StreamOutcome:
    """What a stream's events said, as they are read (the OpenAI-compatible and MCP
    ingresses): its FINAL, or the error to answer with when it ended without one."""

    final: FinalResult | None = None
    budget_cut: bool = False
    error: tuple[ErrorCode, str] | None = None  # the RST's, or EBUDGET without a FINAL
    retry_after_ms: int | None = None  # the RST's hint (nothing spent: a store that did not answer)
    #: The last EBUDGET with a hint (a reserve the store did not answer) and that hint.
    undecided: tuple[tuple[ErrorCode, str], int] | None = None
    out_tokens: int = 0
    live_agent: str | None = None

    def see(self, ev: Any) -> str | None:
        """Take one event; returns live text to stream, if any."""
        t, frame = ev.type, ev.frame
        if t == "PARTIAL":
            c = frame.payload.content if frame.payload is not None else None
            if not isinstance(c, dict):
                return None
            if isinstance(c.get("delta"), str):
                agent = c.get("agent")
                if self.live_agent is None:
                    self.live_agent = agent
                return c["delta"] if agent == self.live_agent else None
            usage = c.get("usage")
            if "report" in c and isinstance(usage, dict):
                out = usage.get("out_tokens", 0)
                self.out_tokens += out if isinstance(out, int) else 0
        elif t == "FINAL":
            content = frame.payload.content if frame.payload is not None else None
            self.final = msgspec.convert(msgspec.to_builtins(content), FinalResult)
        elif t in ("ERROR", "RST"):
            err = error_of(frame)
            c = frame.payload.content if frame.payload is not None else None
            # An EBUDGET with retry_after_ms is a reserve the shared store did not answer
            # (retried; nothing decided), not a budget that cut the stream short.
            hint = c.retry_after_ms if isinstance(c, ErrorPayload) else c.get("retry_after_ms") \
                if isinstance(c, dict) else None
            undecided = hint is not None
            if err is not None and err[0] is ErrorCode.EBUDGET and not undecided:
                self.budget_cut = True
            elif err is not None and err[0] is ErrorCode.EBUDGET:
                self.undecided = (err, hint)
            if t == "RST":
                self.error = err or (ErrorCode.EPROTO, "stream reset")
                self.retry_after_ms = hint
        elif t == "FIN" and self.final is None and self.error is None and self.undecided and not self.budget_cut:
            self.error, self.retry_after_ms = self.undecided  # the store did not answer: nothing spent, retry
        elif t == "FIN" and self.final is None and self.error is None:
            self.error = ((ErrorCode.EBUDGET, "budget exhausted before any next-hop could answer")
                          if self.budget_cut else (ErrorCode.EAGENTDOWN, "the stream ended without a result"))
        return None

    def failure(self) -> ATPError:
        code, reason = self.error or (ErrorCode.EAGENTDOWN, "the stream ended without a result")
        return ATPError(code, reason, retry_after_ms=self.retry_after_ms)

    @property
    def finish_reason(self) -> Literal["stop", "length"]:
        return "length" if self.budget_cut else "stop"

    def usage(self) -> CompletionUsage:
        assert self.final is not None
        total = self.final.telemetry.tokens
        completion = min(self.out_tokens, total)
        return CompletionUsage(prompt_tokens=total - completion, completion_tokens=completion, total_tokens=total)

    def atp(self, ctx: StreamCtx) -> AtpCompletion:
        assert self.final is not None
        r, t = self.final.result, self.final.telemetry
        return AtpCompletion(stream_id=ctx.stream_id, session_id=ctx.session_id, policy=str(ctx.route.policy),
                             usd=t.usd, tokens=t.tokens, latency_ms=t.latency_ms, findings=r.findings,
                             consensus=r.consensus, answers=r.answers, usage=t.usage)


# ------------------------------------------------------------------ routes

Authorized = Callable[..., Callable[[Request], Awaitable[Response]]]
ReadBody = Callable[[Request, int], Awaitable[bytes]]


def remaining_text(full: str, streamed: str) -> str:
    """What a streaming client still needs after the ``streamed`` live text to
    hold the ``full`` answer: the rest of ``full`` when ``streamed`` is its start
    — whitespace the live text ended with aside (the answer text is trimmed) —
    else a blank line and ``full`` whole."""
    if full.startswith(streamed):
        return full[len(streamed):]
    head = streamed.rstrip()
    if head and full.startswith(head):
        tail, sent_ws = full[len(head):], streamed[len(head):]
        return tail.removeprefix(sent_ws)
    return ("\n\n" if streamed else "") + full


def openai_routes(router: Router, authorized: Authorized, read_body: ReadBody,
                  body_too_large: type[ATPError]) -> list[Route]:
    """The ingress's routes for the control API's Starlette app. ``authorized``
    is the control API's own wrapper (``authorized(action, handler, render)``:
    authentication, then the action, errors rendered by ``render(error,
    status)``); ``read_body`` reads a body up to a limit, raising
    ``body_too_large`` (413)."""
    ingress = _Ingress(router, read_body, body_too_large)
    return [
        Route(CHAT_PATH, authorized("stream_open", ingress.chat, error_response), methods=["POST"]),
        Route(MODELS_PATH, authorized("stream_open", ingress.models, error_response), methods=["GET"]),
        Route(MODEL_PATH, authorized("stream_open", ingress.model, error_response), methods=["GET"]),
    ]


class _Ingress:
    """The handlers of one router's OpenAI-compatible ingress, with the RIB view
    they share (refreshed per generation)."""

    def __init__(self, router: Router, read_body: ReadBody, body_too_large: type[ATPError]) -> None:
        self.router, self.read_body, self.body_too_large = router, read_body, body_too_large
        self.view = RibView()
        self.max_body = router.config.max_body_bytes

    def allowed(self, identity: Identity) -> list[str] | None:
        spec = self.router.client_spec(identity.tenant)
        return list(spec.task_types) if spec.task_types is not None else None

    async def models(self, request: Request, identity: Identity) -> Response:
        v = self.view.refresh(self.router.gen.fib)
        return Response(_enc.encode(model_list(v, self.allowed(identity), v.seen_at)), media_type="application/json")

    async def model(self, request: Request, identity: Identity) -> Response:
        """``GET /v1/models/{model}``: the card of one model the tenant may use
        (as ``GET /v1/models`` lists it); 404 (an OpenAI error object) for any other."""
        v = self.view.refresh(self.router.gen.fib)
        wanted = request.path_params["model"]
        for card in model_list(v, self.allowed(identity), v.seen_at).data:
            if card.id == wanted:
                return Response(_enc.encode(card), media_type="application/json")
        return error_response(unknown_model(wanted))

    async def prepare(self, request: Request, identity: Identity) -> tuple[ChatCompletionRequest, StreamCtx]:
        """The request, decoded, and the stream opened for it."""
        # A large body is decoded in a worker thread (atp_router.runtime.ingress.bodies): the event loop stays free.
        req = await decode_off_loop(decode_request, await self.read_body(request, self.max_body))
        release_body(request)  # decoded: the raw bytes are done with (the task may run for minutes)
        v = self.view.refresh(self.router.gen.fib)
        target = resolve_model(req.model, v, self.allowed(identity))
        meta = dict(target.meta)
        content, change = await task_content(req, meta.get("task_type"))
        if "files" not in content:
            refused = await complete_from_repo(self.router, meta, content, change)
            if refused is not None:
                raise IngressError(ErrorCode.EPROTO, refused, param="messages")
        if target.policy is not None:
            _check_policy(v, target.policy, meta, change)
        opts = req.atp or AtpOptions()
        cap = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if cap is not None:
            meta["max_out_tokens"] = cap  # the output cap of each model next-hop, as OpenAI means it
        ctx = await self.router.open_stream_async(task=meta, content=content, budget=opts.budget, qos=opts.qos,
                                                  window=None, idempotency_key=opts.idempotency_key,
                                                  identity=identity, change=change)
        return req, ctx

    async def chat(self, request: Request, identity: Identity) -> Response:
        try:
            req, ctx = await self.prepare(request, identity)
        except self.body_too_large as e:
            return error_response(e, 413)
        except BodyRefused:
            raise  # the authorized wrapper answers 429 + Retry-After and closes
        except ATPError as e:
            return error_response(e)
        created = int(time.time())
        cid = "chatcmpl-" + ctx.stream_id
        if req.stream:
            return _SSEResponse(_sse(self.router, req, ctx, cid, created), media_type="text/event-stream",
                                headers={"Cache-Control": "no-cache", **ctx.qos_headers()})
        out = StreamOutcome()
        ctx.attach()
        try:
            async for ev in ctx.log.follow():
                out.see(ev)
        finally:
            _let_go(self.router, ctx)
        if out.final is None:
            # A hint means nothing was decided nor spent (a store that did not answer): retry later.
            return error_response(out.failure(), after_run=out.retry_after_ms is None)
        body = ChatCompletion(
            id=cid, object="chat.completion", created=created, model=req.model,
            choices=[Choice(0, AssistantMessage("assistant", completion_text(out.final.result)), out.finish_reason)],
            usage=out.usage(), atp=out.atp(ctx))
        return Response(_enc.encode(body), media_type="application/json", headers=ctx.qos_headers())


def _check_policy(v: RibView, policy: str, meta: dict[str, Any], change: ParsedChange | None) -> None:
    """A ``policy:<name>`` model: the policy must be the first in the RIB to
    match the task's meta (``diff_loc`` added from the diff's ``change``, as the
    router does at SYN), else :class:`IngressError` (400 EPROTO, ``param: model``)."""
    if change is not None and "diff_loc" not in meta:
        meta["diff_loc"] = change.diff_loc
    first = v.first_match(meta)
    if first != policy:
        match = next(cm.source for name, _, cm in v.policies if name == policy)
        why = (f"policy {first!r} comes first in the RIB and matches it" if first is not None
               else f"its match {match} does not accept it")
        raise IngressError(ErrorCode.EPROTO, f"policy {policy!r} does not take this request "
                           f"(task meta {meta}): {why}", param="model")


class _LastChunk(bytes):
    """The last chunk of a streaming answer's body (its ``data: [DONE]``)."""


class _SSEResponse(StreamingResponse):
    """A streaming answer whose body ends with the chunk :func:`_sse` marks
    :class:`_LastChunk`: that chunk ends the body in the same ASGI message (one
    socket write with HTTP's end of chunks, not two), then the generator is closed
    (its ``finally`` runs, as when it returns). A body without one ends as
    Starlette's does (an empty last message)."""

    async def stream_response(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        body = self.body_iterator
        async for chunk in body:
            last = isinstance(chunk, _LastChunk)
            await send({"type": "http.response.body", "body": chunk, "more_body": not last})
            if last:
                if isinstance(body, AsyncGenerator):
                    await body.aclose()
                return
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def _let_go(router: Router, ctx: StreamCtx) -> None:
    """The request is over: stop following; a stream nobody can resume
    (no idempotency key) is reset so it spends nothing more."""
    ctx.detach()
    if not ctx.log.closed and ctx.idempotency_key is None:
        router.stream_closed(ctx.stop(ErrorCode.EPREEMPT, "canceled: the OpenAI-compatible client went away"))


async def _sse(router: Router, req: ChatCompletionRequest, ctx: StreamCtx, cid: str,
               created: int) -> AsyncIterator[bytes]:
    """The body of a streaming answer (module doc, "Streaming")."""
    def chunk(**kw: Any) -> bytes:
        return b"data: " + _enc.encode(ChatCompletionChunk(id=cid, object="chat.completion.chunk",
                                                           created=created, model=req.model, **kw)) + b"\n\n"

    out = StreamOutcome()
    ctx.attach()
    try:
        yield chunk(choices=[ChunkChoice(0, ChunkDelta(role="assistant", content=""))])
        live: list[str] = []
        # The events stored together go out in one chunk (one socket write), as does the end.
        async for batch in ctx.log.follow_batches():
            parts = []
            for ev in batch:
                text = out.see(ev)
                if text:
                    live.append(text)
                    parts.append(chunk(choices=[ChunkChoice(0, ChunkDelta(content=text))]))
            if parts:
                yield b"".join(parts)
        if out.final is None:
            e = out.failure()
            status = error_response(e).status_code
            yield _LastChunk(b"data: " + _enc.encode(error_body(e, status)) + b"\n\ndata: [DONE]\n\n")
            return
        rest = remaining_text(completion_text(out.final.result), "".join(live))
        tail = [chunk(choices=[ChunkChoice(0, ChunkDelta(content=rest))])] if rest else []
        tail.append(chunk(choices=[ChunkChoice(0, ChunkDelta(), out.finish_reason)], atp=out.atp(ctx)))
        if req.stream_options is not None and req.stream_options.include_usage:
            tail.append(chunk(choices=[], usage=out.usage()))
        tail.append(b"data: [DONE]\n\n")
        yield _LastChunk(b"".join(tail))
    finally:
        _let_go(router, ctx)
