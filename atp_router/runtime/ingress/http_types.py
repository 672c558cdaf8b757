"""The HTTP control API's shapes (spec §22): the bodies it decodes and encodes
(msgspec Structs: the OpenAPI document's schemas, :mod:`atp_router.runtime.admin.openapi`)
and the entry type of its route table, :class:`ApiRoute`
(:data:`atp_router.runtime.ingress.http_api.ROUTES`).

An :class:`ApiRoute` is one operation: method and path, the action it is
authorized for (:meth:`Router.authorize <atp_router.runtime.router.Router.authorize>`),
its handler, and what the OpenAPI document says of it — summary, operation id,
parameters, request body, the success :class:`Reply`, the error statuses (in the
control API's error shape or OpenAI's) and any other :class:`Reply`. A schema in a
:class:`Reply` or :class:`RequestBody` is a Struct type (a ``$ref`` to it), a
:class:`Sse` (``text/event-stream`` whose ``data:`` is a Struct) or a literal
JSON Schema dict.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any, Literal

import msgspec

from atp_router.wire.frame import Budget, Frame, QoS, Window

if TYPE_CHECKING:
    from starlette.requests import Request
    from starlette.responses import Response

    from atp_router.runtime.router import Router
    from atp_router.security.identity import Identity

__all__ = [
    "OBJECT",
    "STRING",
    "Anonymous",
    "ApiRoute",
    "EgressChange",
    "ErrorBody",
    "ErrorResponse",
    "FeedbackRequest",
    "FeedbackResponse",
    "FramesResponse",
    "Handler",
    "Health",
    "Liveness",
    "PolicyFault",
    "PolicyFile",
    "PolicyText",
    "ReloadResponse",
    "Reply",
    "RequestBody",
    "RouteInfo",
    "Schema",
    "Sse",
    "StreamOpenRequest",
    "StreamOpenResponse",
]


class StreamOpenRequest(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """Body of ``POST /v1/streams``. ``task`` is the task meta (``task_type`` and match
    keys); ``content`` the task body (``code_review``: ``{"diff", "files"}``);
    ``budget`` in float USD and tokens."""

    task: dict[str, Any]
    content: dict[str, Any] | None = None
    budget: Budget | None = None
    qos: QoS | None = None
    window: Window | None = None
    idempotency_key: str | None = None


class RouteInfo(msgspec.Struct):
    policy: str
    next_hops: list[str]
    rib_version: int


class StreamOpenResponse(msgspec.Struct):
    session_id: str
    stream_id: str
    window: Window
    route: RouteInfo


class FramesResponse(msgspec.Struct):
    """Frames the router answered a posted frame with (ACK, ERROR, RST, …)."""

    frames: list[Frame]


class EgressChange(msgspec.Struct):
    """An endpoint, secret reference or file a reload added, removed or changed
    (:func:`~atp_router.security.policy_guard.egress_changes`): names and URLs, never
    secret values."""

    kind: str
    key: str
    change: str
    old: str | None
    new: str | None


class ReloadResponse(msgspec.Struct):
    """Body of a successful reload: the new generation, what it changed towards
    the outside (``changes``, also in the audit record) and who reloaded (``by``,
    the caller's subject)."""

    version: int
    policies: int
    agents: list[str]
    changes: list[EgressChange] = []
    by: str = ""


class PolicyFault(msgspec.Struct, omit_defaults=True):
    """One fault of a refused RIB: file, 1-based line (when found), key, reason."""

    file: str
    key: str
    reason: str
    line: int | None = None


class ErrorBody(msgspec.Struct, omit_defaults=True):
    """``code`` and ``reason``; a refused RIB adds the first fault's ``file``,
    ``line`` and ``key`` (``reason`` is its bare reason) and ``errors``, every
    fault found."""

    code: str
    reason: str
    file: str | None = None
    key: str | None = None
    line: int | None = None
    errors: list[PolicyFault] | None = None


class ErrorResponse(msgspec.Struct):
    error: ErrorBody


class PolicyFile(msgspec.Struct):
    #: A ``--policies`` file, or ``"<request body>"`` for a RIB posted to reload.
    file: str
    text: str


class PolicyText(msgspec.Struct):
    """Body of ``GET /v1/policies``: the running RIB generation ``version``, where
    it came from (``source``) and its YAML as read at load, file by file."""

    version: int
    source: str
    files: list[PolicyFile]


class FeedbackRequest(msgspec.Struct, forbid_unknown_fields=True):
    """Body of ``POST /v1/streams/{id}/feedback`` (spec §6.2 quality signal):
    ``score`` 0..1 (1: the result was right and useful), ``labels`` up to 16
    short tags (e.g. ``"false_positive"``, ``"missed_bug"``), kept with it."""

    score: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
    labels: Annotated[list[Annotated[str, msgspec.Meta(min_length=1, max_length=64)]],
                      msgspec.Meta(max_length=16)] = []


class FeedbackResponse(msgspec.Struct):
    """The feedback taken: the next-hops it is about, whether the policy's
    bandit learned it (``bandit``), and its ``scope``: ``"tenant"`` (it trains
    this tenant's routing only) or ``"shared"`` (a trusted client: everyone's,
    and the next-hops' live quality)."""

    stream_id: str
    agents: list[str]
    score: float
    labels: list[str]
    bandit: bool
    scope: str


class Liveness(msgspec.Struct):
    """``GET /v1/health`` without a credential: ``{"status": "ok"}``, nothing more."""

    status: str


class Health(msgspec.Struct):
    """``GET /v1/health`` of an authenticated caller: liveness, the RIB
    generation and the router's open stream count."""

    status: str
    rib_version: int
    open_streams: int


# ---------------------------------------------------------------------------- the route table's entries
#: A module-level handler: ``handler(router, request, identity)`` → the response.
Handler = Callable[["Router", "Request", "Identity"], Awaitable["Response"]]
#: The answer to a caller without ``Authorization`` whom the router would refuse
#: (``GET /v1/health``'s liveness): ``liveness(router, request)``.
Anonymous = Callable[["Router", "Request"], Awaitable["Response"]]

#: Literal JSON Schemas of bodies that are no Struct.
STRING: Mapping[str, Any] = {"type": "string"}
OBJECT: Mapping[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class Sse:
    """A ``text/event-stream`` body; each event's ``data:`` is a ``data`` (``x-atp-event-data``)."""

    data: type[msgspec.Struct]


#: A body's schema: a Struct type, an event stream of one, or a literal JSON Schema.
Schema = type[msgspec.Struct] | Sse | Mapping[str, Any]


@dataclass(frozen=True)
class Reply:
    """One documented response: ``description`` and its body by media type (none: no body)."""

    description: str
    content: Mapping[str, Schema] = field(default_factory=dict)


@dataclass(frozen=True)
class RequestBody:
    """The request body by media type; ``required`` False: it may be empty."""

    content: Mapping[str, Schema]
    required: bool = True


@dataclass(frozen=True)
class ApiRoute:
    """One operation of the control API (module docstring).

    ``action``: the action :func:`~atp_router.runtime.ingress.http_api.authorized`
    checks (None: a public route, or one that authenticates its caller itself, the
    A2A JSON-RPC). ``handler`` None: the route is served by the ingress named in
    ``by`` (``a2a``, ``openai``, ``status``), which returns it from its own
    ``*_routes`` function; ``build_app`` refuses one it does not find in the table.
    ``ok`` is the success response (status ``status``), ``errors`` the error
    statuses in the ``error_shape`` (``atp``: ``ErrorResponse``, ``openai``:
    ``OpenAIErrorResponse``), ``other`` further responses by status. ``public``:
    no credential needed (``security: []``). ``anonymous``: the answer to a
    caller without ``Authorization`` that the router would refuse. ``task``: the
    route's part in a task's path (``atp-router routes --diagram``): it ``opens``
    a stream (its SYN goes through the SYN stages) or ``follows`` one's frames to
    the FINAL."""

    method: Literal["GET", "POST"]
    path: str
    action: str | None
    handler: Handler | None
    operation_id: str
    summary: str
    ok: Reply
    status: int = 200
    request: RequestBody | None = None
    parameters: tuple[Mapping[str, Any], ...] = ()
    errors: tuple[int, ...] = ()
    error_shape: Literal["atp", "openai"] = "atp"
    other: Mapping[int, Reply] = field(default_factory=dict)
    public: bool = False
    by: str = "http_api"
    anonymous: Anonymous | None = None
    task: Literal["opens", "follows"] | None = None
