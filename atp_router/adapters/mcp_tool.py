"""What an MCP tool call sends and what its result means (sans-IO; the MCP
next-hop :mod:`atp_router.adapters.mcp` does the I/O).

Task → arguments (:func:`tool_arguments`), under the tool's ``inputSchema`` as
``tools/list`` gave it:

* every field of ``prompt.content`` that is a property of the schema goes by its
  name (a ``code_review`` task: ``diff``, ``files``; a chat: ``messages``), and so
  do ``task_type`` and ``instruction`` when they are properties;
* when no content field is one, the task as one text (:func:`render`: the
  reviewer instruction and the numbered diff, as a model sees it; a lone
  ``text``; else the instruction and the JSON content) goes to the
  ``text_argument`` the RIB names, else to the first property of
  :data:`TEXT_ARGUMENTS` that may be a string, else to the schema's one required
  property when it is a string; with none, the task does not fit (EPROTO);
* the RIB's fixed arguments are added last (they win);
* the result is checked against the schema's ``required`` list, the JSON types
  of its top-level properties and ``additionalProperties: false``. Only that:
  the server's ``pattern`` s, ``$ref`` s and nested schemas never run in the
  router (a hostile schema cannot stall it); the server checks the rest.

Result → :class:`AgentReport` (:func:`tool_report`), bounded whatever the server
sends: ``structuredContent.findings`` (the first :data:`MAX_FINDINGS`) become
findings, kept only when they cite a file and line of the change and a claim,
like a model's (:func:`~atp_router.adapters.openai_compat.parse_review`); else the
text content (the first :data:`MAX_TEXT_CHARS` characters) is parsed like a
model's answer for a review task (content with a ``diff``) or is the answer (the
report's summary) for any other. An ``isError`` result is the tool's failure
(EAGENTDOWN). Usage the tool reports (:func:`reported_usage`) rides along.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import mcp_types

from atp_router.adapters.base import Prompt, change_of
from atp_router.adapters.context import scrub
from atp_router.adapters.http import DETAIL_CHARS, token_count
from atp_router.adapters.openai_compat import SYSTEM_PROMPT, parse_review, render_diff
from atp_router.consensus.types import ANSWER_CHARS, AgentReport
from atp_router.wire.errors import AgentError, ErrorCode

__all__ = ["MAX_FINDINGS", "MAX_TEXT_CHARS", "TEXT_ARGUMENTS", "ToolAnswer", "render", "reported_usage",
           "tool_arguments", "tool_report"]

#: Characters of a result's text kept (the answer of a non-review task, the text a review is parsed from).
MAX_TEXT_CHARS = ANSWER_CHARS
#: Structured findings of one result considered.
MAX_FINDINGS = 100
#: Schema properties that take the task as text, in order of preference.
TEXT_ARGUMENTS: tuple[str, ...] = ("task", "text", "input", "prompt", "query", "question", "content", "message")
_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,), "object": (dict,), "array": (list,), "boolean": (bool,),
    "integer": (int,), "number": (int, float), "null": (type(None),),
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class ToolAnswer:
    """A tool's result as the adapter uses it: the ``report``, the characters of
    text received (``out_chars``) and the ``(input, output)`` tokens the tool
    reported (``None``: it reported none; either count may be missing)."""

    report: AgentReport
    out_chars: int
    reported: tuple[int | None, int | None] | None


def render(prompt: Prompt) -> str:
    """The task as one text: for a diff, the instruction (by default the
    reviewer's, asking for JSON findings) and the numbered diff as a model sees
    it; a lone ``text`` after the instruction; else the instruction (or the task
    type) and the JSON content. Parses the diff when the prompt does not carry
    it parsed (blocking, as :func:`~atp_router.adapters.base.change_of`)."""
    change = change_of(prompt)
    if change is not None:
        head = prompt.instruction or SYSTEM_PROMPT
        return f"{head}\n\nReview this diff:\n\n{render_diff(change.files)}"
    text = prompt.content.get("text")
    if isinstance(text, str) and len(prompt.content) == 1:
        return f"{prompt.instruction}\n\n{text}" if prompt.instruction else text
    head = prompt.instruction or f"Task: {prompt.task_type}"
    return f"{head}\n\n{json.dumps(prompt.content, ensure_ascii=False, indent=1)}"


def tool_arguments(prompt: Prompt, tool: mcp_types.Tool, *, fixed: Mapping[str, Any] | None = None,
                   text_argument: str | None = None) -> dict[str, Any]:  # fmt: skip
    """The ``tools/call`` arguments for ``prompt`` under ``tool.inputSchema``, the
    ``fixed`` arguments added (mapping and checks in the module docstring).
    Raises AgentError(EPROTO) naming the misfit when the task does not fit."""
    schema = tool.input_schema if isinstance(tool.input_schema, dict) else {}
    props = schema.get("properties")
    props = props if isinstance(props, dict) else {}
    args: dict[str, Any] = {k: v for k, v in prompt.content.items() if k in props}
    for key, value in (("task_type", prompt.task_type), ("instruction", prompt.instruction)):
        if key in props and key not in args and value:
            args[key] = value
    if not any(k in props for k in prompt.content):
        target = text_argument if text_argument is not None else _text_target(schema, props)
        if target is None:
            raise AgentError(ErrorCode.EPROTO, f"tool {tool.name!r} takes none of the task's fields "
                             f"({', '.join(sorted(prompt.content))[:200]}) and no text argument; "
                             "set options.text_argument")  # fmt: skip
        args[target] = render(prompt)
    args.update(fixed or {})
    _check_arguments(tool.name, schema, props, args)
    return args


def _text_target(schema: Mapping[str, Any], props: Mapping[str, Any]) -> str | None:
    for name in TEXT_ARGUMENTS:
        if name in props and _types_of(props[name]) in (None, ("string",)):
            return name
    required = schema.get("required")
    if isinstance(required, list) and len(required) == 1 and required[0] in props:
        return str(required[0]) if _types_of(props[required[0]]) == ("string",) else None
    return None


def _types_of(prop: Any) -> tuple[str, ...] | None:
    """The JSON types a property schema names (None: it names none)."""
    kind = prop.get("type") if isinstance(prop, dict) else None
    if isinstance(kind, str):
        return (kind,)
    if isinstance(kind, list) and all(isinstance(k, str) for k in kind):
        return tuple(kind)
    return None


def _check_arguments(tool: str, schema: Mapping[str, Any], props: Mapping[str, Any], args: Mapping[str, Any]) -> None:
    """EPROTO unless ``args`` has every ``required`` property, each argument the
    JSON type its property names, and none outside ``additionalProperties: false``."""
    required = schema.get("required")
    missing = [str(k) for k in required if k not in args] if isinstance(required, list) else []
    if missing:
        raise AgentError(ErrorCode.EPROTO, f"tool {tool!r} requires {', '.join(missing)[:200]}, which the task "
                         "does not give")  # fmt: skip
    for key, value in args.items():
        if key not in props:
            if schema.get("additionalProperties") is False:
                raise AgentError(ErrorCode.EPROTO, f"tool {tool!r} takes no argument {key[:80]!r}")
            continue
        kinds = _types_of(props[key])
        if kinds is not None and not any(_is_json_type(value, k) for k in kinds):
            raise AgentError(ErrorCode.EPROTO, f"tool {tool!r}: argument {key[:80]!r} must be "
                             f"{' or '.join(kinds)[:80]}, the task gives {type(value).__name__}")  # fmt: skip


def _is_json_type(value: Any, kind: str) -> bool:
    types = _JSON_TYPES.get(kind)
    if types is None:
        return True  # a type this check does not know: the server decides
    if isinstance(value, bool):
        return kind == "boolean"
    return isinstance(value, types) and not (kind == "integer" and isinstance(value, float))


def tool_report(result: mcp_types.CallToolResult, prompt: Prompt, *, tool: str,
                secrets: Iterable[str] = ()) -> ToolAnswer:  # fmt: skip
    """The :class:`ToolAnswer` of tool ``tool``'s ``result`` to ``prompt`` (module
    docstring). Raises AgentError(EAGENTDOWN) for an ``isError`` result, its text
    (``secrets`` masked, at most 300 characters) as the reason."""
    text = _text_of(result.content)
    if result.is_error:
        detail = scrub(text, secrets=secrets, max_chars=DETAIL_CHARS).strip()
        raise AgentError(ErrorCode.EAGENTDOWN, f"tool {tool!r} failed: {detail or 'no reason given'}")
    structured = result.structured_content
    reported = reported_usage(result.meta, structured)
    if isinstance(structured, dict) and isinstance(structured.get("findings"), list):
        summary = structured.get("summary")
        summary = summary if isinstance(summary, str) else text
        blob = json.dumps({"findings": structured["findings"][:MAX_FINDINGS], "summary": summary[:MAX_TEXT_CHARS]},
                          ensure_ascii=False, default=str)
        findings, summary = parse_review(blob, prompt.content, change=prompt.change)
    elif isinstance(prompt.content.get("diff"), str):
        findings, summary = parse_review(text, prompt.content, change=prompt.change)
    else:
        findings, summary = [], text.strip()
    return ToolAnswer(AgentReport(findings=findings, summary=summary), len(text), reported)


def _text_of(blocks: Iterable[Any]) -> str:
    """The text blocks of a result joined, cut to :data:`MAX_TEXT_CHARS`."""
    parts: list[str] = []
    size = 0
    for block in blocks:
        if isinstance(block, mcp_types.TextContent) and size < MAX_TEXT_CHARS:
            parts.append(block.text[: MAX_TEXT_CHARS - size])
            size += len(parts[-1])
    return "\n".join(parts)[:MAX_TEXT_CHARS]


def reported_usage(meta: Any, structured: Any) -> tuple[int | None, int | None] | None:
    """``(input, output)`` tokens a tool reported in its result's ``_meta.usage``
    or ``structuredContent.usage`` (``input_tokens``/``output_tokens``,
    ``prompt_tokens``/``completion_tokens`` or ``in_tokens``/``out_tokens``:
    integers ≥ 0); None when it reported none."""
    for source in (meta, structured):
        usage = source.get("usage") if isinstance(source, Mapping) else None
        if not isinstance(usage, Mapping):
            continue
        for k_in, k_out in (("input_tokens", "output_tokens"), ("prompt_tokens", "completion_tokens"),
                            ("in_tokens", "out_tokens")):  # fmt: skip
            tin, tout = token_count(usage.get(k_in)), token_count(usage.get(k_out))
            if tin is not None or tout is not None:
                return tin, tout
    return None
