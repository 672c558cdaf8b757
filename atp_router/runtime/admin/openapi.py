"""The OpenAPI 3.1 document of the HTTP control API (spec §22), generated from the
API's route table (:data:`atp_router.runtime.ingress.http_api.ROUTES`: one
operation per entry) and the msgspec Structs the API decodes and encodes (its
schemas), so it cannot drift from the code; ``python -m atp_router.protogen``
writes it to ``proto/openapi.json``.
"""

from __future__ import annotations

import inspect

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import msgspec

from atp_router.consensus.types import FinalResult
from atp_router.runtime.ingress.http_api import ROUTES
from atp_router.runtime.ingress.http_types import (
    ApiRoute,
    ErrorResponse,
    Reply,
    RequestBody,
    Schema,
    Sse,
)
from atp_router.runtime.ingress.openai_schema import OpenAIErrorResponse
from atp_router.wire.frame import Control

__all__ = ["openapi_document", "operation"]

#: Structs the document describes that no route names directly (a FINAL's result
#: and a CONTROL frame's payloads, a union of Structs, both inside a ``Frame``).
DOCUMENTED_TOO: tuple[Any, ...] = (FinalResult, Control)

#: What each error status means, in the control API's error shape (``ErrorResponse``).
ATP_ERRORS = {
    400: "EPROTO: malformed body, frame or schema",
    401: "ESEC: missing or unknown bearer token",
    403: "ESEC: the caller lacks the role this action needs, or a signature failed",
    404: "unknown stream",
    409: "EWINDOW: the router is at its stream limit",
    413: "EPROTO: the body exceeds the router's limit (refused before it is read)",
    422: "the RIB was refused (`file`, `key`, `reason`); the running RIB stays",
    429: "EWINDOW: the tenant's stream quota or open rate; `Retry-After` (s) says when to try again",
    503: "EAGENTDOWN: no route, or no healthy next-hop",
}
#: The same in OpenAI's error shape (``OpenAIErrorResponse``, the OpenAI-compatible endpoints).
OPENAI_ERRORS = {
    400: "EPROTO: malformed or unsupported request (`param` names the field), or a policy that does not "
         "take it",
    401: "ESEC: missing or unknown bearer token (`authentication_error`)",
    402: "EBUDGET: nothing could run within the budget (`insufficient_quota`; `x-should-retry: false`)",
    403: "ESEC: a role, task type or data category outside the tenant's scope (`permission_error`)",
    404: "EPROTO: unknown model (`param: model`)",
    409: "EWINDOW: the router is at its stream limit",
    413: "EPROTO: the body exceeds the router's limit (refused before it is read)",
    429: "EWINDOW: the tenant's stream quota or open rate; `Retry-After` (s) says when to try again",
    503: "EAGENTDOWN: no route or no healthy next-hop; EPREEMPT: the stream was preempted",
    504: "ETIMEOUT: the stream's deadline passed",
}
_ERRORS: dict[str, tuple[type[msgspec.Struct], dict[int, str]]] = {
    "atp": (ErrorResponse, ATP_ERRORS), "openai": (OpenAIErrorResponse, OPENAI_ERRORS)}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _media(schema: Schema) -> dict[str, Any]:
    """One media type's entry: a Struct's ``$ref``, an event stream of one, or the literal schema."""
    if isinstance(schema, Sse):
        return {"schema": {"type": "string"}, "x-atp-event-data": _ref(schema.data.__name__)}
    if isinstance(schema, type):
        return {"schema": _ref(schema.__name__)}
    return {"schema": dict(schema)}


def _content(content: Mapping[str, Schema]) -> dict[str, Any]:
    return {media: _media(schema) for media, schema in content.items()}


def _reply(reply: Reply) -> dict[str, Any]:
    out: dict[str, Any] = {"description": reply.description}
    if reply.content:
        out["content"] = _content(reply.content)
    return out


def _request(body: RequestBody) -> dict[str, Any]:
    return {"required": body.required, "content": _content(body.content)}


def _responses(r: ApiRoute) -> dict[str, Any]:
    struct, text = _ERRORS[r.error_shape]
    out = {str(r.status): _reply(r.ok)}
    out.update({str(status): _reply(reply) for status, reply in r.other.items()})
    out.update({str(c): _reply(Reply(text[c], {"application/json": struct})) for c in r.errors})
    return out


def operation(r: ApiRoute) -> dict[str, Any]:
    """The OpenAPI operation object of one route table entry."""
    op: dict[str, Any] = {"summary": r.summary, "operationId": r.operation_id}
    if r.public:
        op["security"] = []
    if r.parameters:
        op["parameters"] = [dict(p) for p in r.parameters]
    if r.request is not None:
        op["requestBody"] = _request(r.request)
    op["responses"] = _responses(r)
    return op


def _structs(table: Iterable[ApiRoute]) -> list[Any]:
    """Every Struct the table's bodies and responses name, first use first, then :data:`DOCUMENTED_TOO`."""
    seen: dict[type[msgspec.Struct], None] = {}
    for r in table:
        if r.errors:
            seen.setdefault(_ERRORS[r.error_shape][0])
        replies = [r.ok, *r.other.values()]
        bodies = [reply.content for reply in replies] + ([r.request.content] if r.request is not None else [])
        for schema in (s for content in bodies for s in content.values()):
            struct = schema.data if isinstance(schema, Sse) else schema
            if isinstance(struct, type):
                seen.setdefault(struct)
    return [*seen, *DOCUMENTED_TOO]


def openapi_document(table: Sequence[ApiRoute] = ROUTES) -> dict[str, Any]:
    """The control API (the routes of ``table``) as an OpenAPI 3.1 dict (JSON-ready).
    ValueError: two entries for one method and path."""
    paths: dict[str, dict[str, Any]] = {}
    for r in table:
        ops = paths.setdefault(r.path, {})
        if r.method.lower() in ops:
            raise ValueError(f"two route table entries for {r.method} {r.path}")
        ops[r.method.lower()] = operation(r)
    _, components = msgspec.json.schema_components(_structs(table), ref_template="#/components/schemas/{name}")
    for schema in components.values():  # docstrings dedented, as msgspec >= 0.23 does itself: one document across versions
        if isinstance(schema.get("description"), str):
            schema["description"] = inspect.cleandoc(schema["description"])
    return {
        "openapi": "3.1.0",
        "info": {"title": "ATP router control API", "version": "0.1.0",
                 "description": "Control API of the ATP router (Agent Transport Protocol draft v0.1, §22)."},
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}],
    }
