"""The A2A side of an ATP stream: an A2A task is a view of the stream's
:class:`~atp_router.runtime.dataplane.eventlog.EventLog`, folded into a status and artifacts
(the event table is in :mod:`atp_router.runtime.ingress.a2a`'s docstring), and rendered in
the A2A 0.3 or 1.0 dialect (:class:`Render`).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import msgspec

from atp_router.runtime.dataplane.dispatch import NEXT_HOP_FAILED
from atp_router.runtime.dataplane.eventlog import LoggedEvent
from atp_router.runtime.dataplane.stream import StreamCtx

__all__ = ["TERMINAL", "A2ATask", "Artifact", "Render", "Status", "closing", "final_of", "fold", "updates"]

#: The A2A task states after which nothing more happens.
TERMINAL = frozenset({"completed", "failed", "canceled", "rejected"})


@dataclass(slots=True)
class Status:
    """A task state (0.3 spelling), with the agent message's text and metadata."""

    state: str
    text: str = ""
    metadata: dict[str, Any] | None = None


@dataclass(slots=True)
class Artifact:
    """A task artifact: its parts as ``(kind, value)`` pairs (``text`` / ``data``)."""

    artifact_id: str
    name: str
    parts: list[tuple[str, Any]]


@dataclass(slots=True)
class A2ATask:
    """The A2A side of one stream: who sent it and the user message as received.
    A task refused before any stream opened (``rejected``) has no ``ctx``."""

    ctx: StreamCtx | None
    context_id: str
    message: dict[str, Any]
    rejected: Status | None = None
    rejected_id: str = ""

    @property
    def id(self) -> str:
        return self.ctx.stream_id if self.ctx is not None else self.rejected_id

    @property
    def closed(self) -> bool:
        return self.ctx is None or self.ctx.log.closed


def _now() -> str:
    # A2A timestamps are wall-clock ISO 8601 (this is the trio edge, not the core).
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def _to_plain(content: Any) -> Any:
    return content if isinstance(content, dict) else msgspec.to_builtins(content)


def _failures(final: Mapping[str, Any] | None) -> list[str]:
    """The next-hops that failed in a FINAL (``agent: CODE: reason``, from its
    ``consensus.uncertainties``; :data:`~atp_router.runtime.dataplane.dispatch.NEXT_HOP_FAILED`)."""
    consensus = ((final or {}).get("result") or {}).get("consensus") or {}
    return [u[len(NEXT_HOP_FAILED):] for u in consensus.get("uncertainties") or []
            if isinstance(u, str) and u.startswith(NEXT_HOP_FAILED)]


def _summary(final: Mapping[str, Any]) -> str:
    """One line per merged finding, the next-hops that failed, then the telemetry."""
    result = final.get("result") or {}
    lines = []
    for f in result.get("findings") or []:
        lines.append(f"{f.get('file')}:{f.get('span')} {f.get('severity')}: {f.get('claim')} "
                     f"[{', '.join(f.get('provenance') or [])}]"
                     + (" (silenced by the change)" if f.get("suppressed_by_change") else ""))
    failed = _failures(final)
    t = final.get("telemetry") or {}
    head = f"{len(lines)} finding(s)" if lines else "no findings"
    if failed:
        head += f" — incomplete: {len(failed)} next-hop(s) failed"
        lines += [f"failed: {f}" for f in failed]
    tail = f"telemetry: {t.get('tokens', 0)} tokens, {t.get('usd', 0)} USD, {t.get('latency_ms', 0)} ms"
    return "\n".join([head, *lines, tail])


def updates(ev: LoggedEvent, final: Mapping[str, Any] | None = None) -> list[Status | Artifact]:
    """The A2A updates one stream event stands for (the table in
    :mod:`atp_router.runtime.ingress.a2a`'s docstring);
    ``final`` is the stream's FINAL content seen before ``ev``, if any."""
    p = ev.frame.payload
    content = _to_plain(p.content) if p is not None and p.content is not None else None
    match ev.type:
        case "SYN_ACK":
            return [Status("submitted")]
        case "PARTIAL" if isinstance(content, dict):
            agent = str(content.get("agent", ""))
            if isinstance(content.get("delta"), str):
                return [Status("working", content["delta"], {"agent": agent})]
            if "report" in content:
                data = {"agent": agent, "report": content["report"], "usage": content.get("usage")}
                return [Artifact(f"agent:{agent}", agent, [("data", data)])]
            return [Status("working")]
        case "ERROR" if isinstance(content, dict):
            return [Status("working", f"{content.get('code')}: {content.get('reason')}", {"atp_error": content})]
        case "FINAL" if isinstance(content, dict):
            return [Artifact("result", "result", [("text", _summary(content)), ("data", content)])]
        case "FIN":
            failed = _failures(final)
            if failed and not ((final or {}).get("result") or {}).get("findings"):
                # Nothing found, but not everything looked: not a clean "no findings".
                # The code of the first failure (``agent: CODE: reason``).
                code = failed[0].split(": ", 2)[1] if failed[0].count(": ") >= 2 else "EAGENTDOWN"
                err = {"code": code, "reason": "no findings, and the review is incomplete: " + "; ".join(failed)}
                return [Status("failed", f"{err['code']}: {err['reason']}", {"atp_error": err})]
            return [Status("completed")]
        case "RST":
            err = content if isinstance(content, dict) else {}
            return [Status("failed", f"{err.get('code')}: {err.get('reason')}", {"atp_error": err})]
    return []


def final_of(ev: LoggedEvent) -> dict[str, Any] | None:
    p = ev.frame.payload
    if ev.type == "FINAL" and p is not None and p.content is not None:
        content = _to_plain(p.content)
        return content if isinstance(content, dict) else None
    return None


def closing(task: A2ATask) -> Status | None:
    """``canceled`` for a log closed without FIN/RST of ours (the client's RST)."""
    if task.ctx is None:
        return None
    log = task.ctx.log
    if log.closed and (not log.events or log.events[-1].type not in ("FIN", "RST")):
        return Status("canceled", "canceled by the client (tasks/cancel → RST)")
    return None


def fold(task: A2ATask) -> tuple[Status, dict[str, Artifact]]:
    """The task's current status and artifacts, from its stream's log so far."""
    if task.ctx is None:
        return task.rejected or Status("rejected"), {}
    status = Status("submitted")
    arts: dict[str, Artifact] = {}
    final = None
    for ev in task.ctx.log.events:
        final = final_of(ev) or final
        for up in updates(ev, final):
            if isinstance(up, Artifact):
                arts[up.artifact_id] = up
                if status.state == "submitted":
                    status = Status("working")
            else:
                status = up
    return closing(task) or status, arts


class Render:
    """A2A objects in one dialect (``v1``: 1.0, else 0.3)."""

    def __init__(self, v1: bool):
        self.v1 = v1

    def part(self, kind: str, value: Any) -> dict[str, Any]:
        return {kind: value} if self.v1 else {"kind": kind, kind: value}

    def state(self, state: str) -> str:
        return "TASK_STATE_" + state.upper().replace("-", "_") if self.v1 else state

    def message(self, role: str, parts: list[tuple[str, Any]], task: A2ATask, *, message_id: str | None = None,
                metadata: Any = None) -> dict[str, Any]:
        msg: dict[str, Any] = {
            "messageId": message_id or uuid.uuid4().hex,
            "contextId": task.context_id,
            "taskId": task.id,
            "role": ("ROLE_" + role.upper()) if self.v1 else role,
            "parts": [self.part(k, v) for k, v in parts],
        }
        if metadata:
            msg["metadata"] = metadata
        if not self.v1:
            msg["kind"] = "message"
        return msg

    def status(self, st: Status, task: A2ATask) -> dict[str, Any]:
        out: dict[str, Any] = {"state": self.state(st.state), "timestamp": _now()}
        if st.text:
            out["message"] = self.message("agent", [("text", st.text)], task, metadata=st.metadata)
        return out

    def artifact(self, art: Artifact) -> dict[str, Any]:
        return {"artifactId": art.artifact_id, "name": art.name, "parts": [self.part(k, v) for k, v in art.parts]}

    def task(self, task: A2ATask, history_length: int | None = None) -> dict[str, Any]:
        """A snapshot of the task from its stream's log."""
        status, arts = fold(task)
        history = [self.message("user", task.message["parts"], task, message_id=task.message["messageId"],
                                metadata=task.message.get("metadata"))]
        out: dict[str, Any] = {
            "id": task.id,
            "contextId": task.context_id,
            "status": self.status(status, task),
            "artifacts": [self.artifact(a) for a in arts.values()],
            "history": history if history_length != 0 else [],
            "metadata": {"atp": {"session_id": task.ctx.session_id, "stream_id": task.ctx.stream_id}
                         if task.ctx is not None else {"rejected": True}},
        }
        if not self.v1:
            out["kind"] = "task"
        return out

    def event(self, up: Status | Artifact, task: A2ATask) -> dict[str, Any]:
        """A stream result: status-update / artifact-update (0.3: ``kind`` and
        ``final``; 1.0: wrapped in ``statusUpdate`` / ``artifactUpdate``)."""
        base: dict[str, Any] = {"taskId": task.id, "contextId": task.context_id}
        if isinstance(up, Artifact):
            base.update(artifact=self.artifact(up), append=False, lastChunk=True)
            return {"artifactUpdate": base} if self.v1 else {"kind": "artifact-update", **base}
        base["status"] = self.status(up, task)
        if self.v1:
            return {"statusUpdate": base}
        return {"kind": "status-update", **base, "final": up.state in TERMINAL}

    def wrap_task(self, task_obj: dict[str, Any]) -> dict[str, Any]:
        """A Task as a send/stream result (1.0 wraps it in ``task``)."""
        return {"task": task_obj} if self.v1 else task_obj

