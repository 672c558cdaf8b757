"""The OpenAPI 3.1 document of the HTTP control API (spec §22), built from the
same msgspec Structs the API decodes and encodes (``atp_router.runtime.ingress.http_api``), so it cannot
drift from the code; ``python -m atp_router.protogen`` writes it to ``proto/openapi.json``.
"""

from __future__ import annotations

from typing import Any

import msgspec

from atp_router.consensus.types import FinalResult
from atp_router.runtime.admin.fibview import FibView
from atp_router.runtime.admin.status import StatusSnapshot
from atp_router.runtime.ingress.a2a import A2A_PATH, CARD_PATHS
from atp_router.runtime.ingress.http_api import (
    ErrorResponse,
    FeedbackRequest,
    FeedbackResponse,
    FramesResponse,
    Health,
    PolicyText,
    ReloadResponse,
    StreamOpenRequest,
    StreamOpenResponse,
)
from atp_router.runtime.ingress.openai import CHAT_PATH, MODELS_PATH
from atp_router.runtime.ingress.openai_schema import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ModelList,
    OpenAIErrorResponse,
)
from atp_router.wire.frame import Control, Frame, RouteUpdate

_STRUCTS = (
    StreamOpenRequest, StreamOpenResponse, FramesResponse, ReloadResponse, PolicyText, ErrorResponse, Health,
    Frame, RouteUpdate, FinalResult, FeedbackRequest, FeedbackResponse, FibView,
    ChatCompletionRequest, ChatCompletion, ChatCompletionChunk, ModelList, OpenAIErrorResponse, StatusSnapshot,
)


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json_body(name: str, description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": _ref(name)}}}


def _errors(*codes: int) -> dict[str, Any]:
    text = {
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
    return {str(c): _json_body("ErrorResponse", text[c]) for c in codes}


def _openai_errors(*codes: int) -> dict[str, Any]:
    text = {
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
    return {str(c): _json_body("OpenAIErrorResponse", text[c]) for c in codes}


def openapi_document() -> dict[str, Any]:
    """The control API as an OpenAPI 3.1 dict (JSON-ready)."""
    _, components = msgspec.json.schema_components(_STRUCTS + (Control,), ref_template="#/components/schemas/{name}")
    stream_id = {"name": "id", "in": "path", "required": True, "schema": {"type": "string"}}
    paths = {
        "/v1/streams": {"post": {
            "summary": "Open a stream (SYN → SYN-ACK, spec §8 steps 1-2); the task starts when `content` is given",
            "operationId": "openStream",
            "requestBody": {"required": True, "content": {"application/json": {"schema": _ref("StreamOpenRequest")}}},
            "responses": {"201": _json_body("StreamOpenResponse", "stream opened"),
                          **_errors(400, 401, 403, 409, 413, 429, 503)},
        }},
        "/v1/streams/{id}/frames": {"post": {
            "summary": "Send one frame on a stream (HTTP fallback to the WebSocket ingress)",
            "operationId": "postFrame",
            "parameters": [stream_id],
            "requestBody": {"required": True, "content": {"application/json": {"schema": _ref("Frame")}}},
            "responses": {"200": _json_body("FramesResponse", "frames the router answered with"),
                          **_errors(400, 401, 403, 404, 413)},
        }},
        "/v1/streams/{id}/events": {"get": {
            "summary": "The stream's frames as Server-Sent Events (`event:` SYN_ACK, ACK, WINDOW_UPDATE, PARTIAL, "
                       "ERROR, FINAL, FIN, RST; `data:` the frame as JSON; `id:` resumable with Last-Event-ID)",
            "operationId": "streamEvents",
            "parameters": [stream_id, {"name": "Last-Event-ID", "in": "header", "required": False,
                                       "schema": {"type": "integer", "minimum": 0}}],
            "responses": {"200": {"description": "event stream", "content": {"text/event-stream": {
                "schema": {"type": "string"}, "x-atp-event-data": _ref("Frame")}}},
                **_errors(401, 403, 404)},
        }},
        "/v1/policies/reload": {"post": {
            "summary": "Hot-reload the RIB from the router's policy path, or from a YAML/JSON body",
            "operationId": "reloadPolicies",
            "requestBody": {"required": False, "content": {"application/yaml": {"schema": {"type": "string"}}}},
            "responses": {"200": _json_body("ReloadResponse", "the new RIB generation"),
                          **_errors(400, 401, 403, 413, 422)},
        }},
        "/v1/policies": {"get": {
            "summary": "The running RIB (admin): generation, source and its YAML as loaded",
            "operationId": "getPolicies",
            "responses": {"200": _json_body("PolicyText", "the running RIB's text"), **_errors(401, 403)},
        }},
        "/v1/fib": {"get": {
            "summary": "Routing that learns (spec §6.2): each bandit policy's arms (estimate, uncertainty, count, "
                       "cost, λ) and the live next-hop metrics the FIB scores with",
            "operationId": "getFib",
            "responses": {"200": _json_body("FibView", "bandits and live metrics"), **_errors(401, 403)},
        }},
        "/v1/streams/{id}/feedback": {"post": {
            "summary": "The client's score of its finished stream (0..1, once per stream): the next-hops that "
                       "served it learn it, the policy's bandit too",
            "operationId": "postFeedback",
            "parameters": [stream_id],
            "requestBody": {"required": True,
                            "content": {"application/json": {"schema": _ref("FeedbackRequest")}}},
            "responses": {"200": _json_body("FeedbackResponse", "the feedback taken"),
                          "409": _json_body("ErrorResponse", "the stream is still running, feedback was already "
                                                             "given, or no next-hop answered it"),
                          **_errors(400, 401, 403, 404, 413)},
        }},
        "/v1/routes": {"get": {
            "summary": "The running FIB (ROUTE_UPDATE shape, spec §4.3)",
            "operationId": "getRoutes",
            "responses": {"200": _json_body("RouteUpdate", "routes"), **_errors(401, 403)},
        }},
        "/v1/metrics": {"get": {
            "summary": "Prometheus metrics (spec §12)",
            "operationId": "getMetrics",
            "responses": {"200": {"description": "Prometheus text exposition",
                                  "content": {"text/plain": {"schema": {"type": "string"}}}},
                          **_errors(401, 403)},
        }},
        **{path: {"get": {
            "summary": "A2A agent card (one skill per routed task type); the router answers as an A2A server",
            "operationId": "getAgentCard" + ("Json" if path.endswith(".json") else ""),
            "security": [],
            "responses": {"200": {"description": "A2A agent card (v0.3 shape; 1.0 fields included)",
                                  "content": {"application/json": {"schema": {"type": "object"}}}}},
        }} for path in CARD_PATHS},
        A2A_PATH: {"post": {
            "summary": "A2A JSON-RPC 2.0: message/send, message/stream (SSE), tasks/get, tasks/cancel, "
                       "tasks/resubscribe, and the A2A 1.0 methods with header A2A-Version: 1.0; each message "
                       "enters the router as an ATP stream",
            "operationId": "a2aRpc",
            "requestBody": {"required": True, "content": {"application/json": {"schema": {"type": "object"}}}},
            "responses": {"200": {"description": "JSON-RPC response, or an SSE stream for message/stream",
                                  "content": {"application/json": {"schema": {"type": "object"}},
                                              "text/event-stream": {"schema": {"type": "string"}}}},
                          "401": {"description": "ESEC: missing or unknown bearer token (JSON-RPC error)",
                                  "content": {"application/json": {"schema": {"type": "object"}}}}},
        }},
        "/v1/keys": {"get": {
            "summary": "The router's public keys (JWKS): verify the `telemetry.usage.jws` of a FINAL (spec §19)",
            "operationId": "getKeys",
            "responses": {"200": {"description": "JWKS", "content": {"application/json": {
                "schema": {"type": "object"}}}}, **_errors(401)},
        }},
        "/v1/audit": {"get": {
            "summary": "The hash-chained audit trail (spec §11), admin only: records after `since`, at most `limit`",
            "operationId": "getAudit",
            "parameters": [{"name": "since", "in": "query", "required": False,
                            "schema": {"type": "integer", "minimum": 0}},
                           {"name": "limit", "in": "query", "required": False,
                            "schema": {"type": "integer", "minimum": 1, "maximum": 1000}}],
            "responses": {"200": {"description": "{records: [...]}", "content": {"application/json": {
                "schema": {"type": "object"}}}}, **_errors(400, 401, 403)},
        }},
        CHAT_PATH: {"post": {
            "summary": "OpenAI-compatible chat completion: `model` names a task type or `policy:<name>`; the "
                       "messages become the task of a stream opened as `POST /v1/streams` opens one (fan-out, "
                       "escalation, consensus and budgets apply); `stream: true` answers with SSE chunks ending "
                       "`data: [DONE]`; `atp` extension fields in the request and the answer",
            "operationId": "createChatCompletion",
            "requestBody": {"required": True,
                            "content": {"application/json": {"schema": _ref("ChatCompletionRequest")}}},
            "responses": {"200": {"description": "the completion, or (stream: true) its chunks as Server-Sent "
                                                 "Events (`data:` a ChatCompletionChunk, then `data: [DONE]`)",
                                  "content": {"application/json": {"schema": _ref("ChatCompletion")},
                                              "text/event-stream": {"schema": {"type": "string"},
                                                                    "x-atp-event-data": _ref("ChatCompletionChunk")}}},
                          **_openai_errors(400, 401, 402, 403, 404, 409, 413, 429, 503, 504)},
        }},
        MODELS_PATH: {"get": {
            "summary": "OpenAI-compatible model list: the task types and `policy:<name>` models the caller's "
                       "tenant may use",
            "operationId": "listModels",
            "responses": {"200": _json_body("ModelList", "the models"), **_openai_errors(401, 403)},
        }},
        "/v1/status": {"get": {
            "summary": "The router's live status (admin): open streams with their windows and budgets, next-hops "
                       "with health, circuit breaker and AIMD cwnd, the FIB with bandit estimates, recent errors, "
                       "and a bounded history (samples, finished tasks)",
            "operationId": "getStatus",
            "responses": {"200": _json_body("StatusSnapshot", "the status snapshot"), **_errors(401, 403)},
        }},
        "/v1/status/events": {"get": {
            "summary": "The status snapshot as Server-Sent Events (admin): `event: status`, `data:` a "
                       "StatusSnapshot, every second and as soon as open streams, the RIB or a circuit change",
            "operationId": "statusEvents",
            "responses": {"200": {"description": "event stream", "content": {"text/event-stream": {
                "schema": {"type": "string"}, "x-atp-event-data": _ref("StatusSnapshot")}}},
                "429": _json_body("ErrorResponse", "EWINDOW: too many status event streams are open"),
                **_errors(401, 403)},
        }},
        "/status": {"get": {
            "summary": "The status page (HTML; it holds no data: it asks for an admin token and reads "
                       "`/v1/status/events`)",
            "operationId": "statusPage",
            "security": [],
            "responses": {"200": {"description": "the page", "content": {"text/html": {"schema": {"type": "string"}}}}},
        }},
        "/status/{asset}": {"get": {
            "summary": "The status page's script and style sheet (`status.js`, `status.css`)",
            "operationId": "statusAsset",
            "security": [],
            "parameters": [{"name": "asset", "in": "path", "required": True, "schema": {"type": "string"}}],
            "responses": {"200": {"description": "the file", "content": {
                "text/javascript": {"schema": {"type": "string"}}, "text/css": {"schema": {"type": "string"}}}},
                "404": {"description": "no such file"}},
        }},
        "/v1/health": {"get": {
            "summary": "Liveness and RIB generation",
            "operationId": "getHealth",
            "responses": {"200": _json_body("Health", "router health"), **_errors(401)},
        }},
    }
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
