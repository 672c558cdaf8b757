"""The task bodies (issue 21 item 1): one Struct per task type, and the chat
messages of the OpenAI-compatible ingress.

A task body is the SYN's ``payload.content`` (spec §4.2). Which Struct it is
follows from the meta's ``task_type`` (:class:`~atp_router.task.meta.TaskMeta`), the
union's tag (:data:`BODIES`, :func:`decode_body`):

==================  ==========================  ===================================
task type           body                        shape
==================  ==========================  ===================================
``code_review``     :class:`CodeReview`         ``{"diff", "files", "evidence"}``
``repo_summary``    :class:`RepoSummary`        ``{"repo"}``
``retrieval_qa``    :class:`RetrievalQA`        ``{"question", "docs"}``
any other           by its keys:                ``{"diff"}`` or ``{"files"}`` (a
                    :class:`CodeReview`,        review under the policy's own task
                    :class:`Chat`,              type), ``{"messages"}`` (the OpenAI
                    :class:`Text` or            ingress), ``{"text"}`` (the A2A
                    :class:`Opaque`             server), else any object (an
                                                operator's own task type: the router
                                                reads none of its keys)
==================  ==========================  ===================================

Keys a body does not name pass to the next-hops unchanged (a body is not
``forbid_unknown_fields``); the named ones are typed strictly (no coercion).

Size limits (``Meta`` constraints) are those of the ingresses that decode these
shapes today: :data:`MAX_MESSAGES` messages of at most :data:`MAX_MESSAGE_CHARS`
characters (or :data:`MAX_PARTS` text parts) and a name of 1..64 characters
(``POST /v1/chat/completions``); :data:`MAX_FILES` files is the OpenAI
ingress's ``atp.files`` limit and the A2A server's ``--repo`` reader's. A code
review's ``files`` are typed (path → text) but neither counted nor their paths
checked here: how many files and which paths a next-hop takes are its own limits
(a tool's ``max_files``, :mod:`atp_router.review.paths`), per agent in the RIB and
checked by the adapter, so a task over one agent's limit is that agent's client
error in the stream, not a refused SYN — as a tool's ``max_diff_bytes`` or a
retriever's ``max_question_chars``. The request body itself is bounded by the
ingress (``max_body_bytes``).

Pure: no I/O, no clock.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal, TypeAlias

import msgspec
from msgspec import Meta, Struct

from atp_router.wire.errors import ErrorCode, LocalProtocolError

__all__ = [
    "BODIES",
    "ERROR_FIELD",
    "MAX_FILES",
    "MAX_MESSAGES",
    "MAX_MESSAGE_CHARS",
    "MAX_PARTS",
    "MAX_PATH_CHARS",
    "Chat",
    "ChatMessage",
    "ChatTurn",
    "CodeReview",
    "Opaque",
    "RepoSummary",
    "RetrievalQA",
    "TaskBody",
    "Text",
    "TextPart",
    "check_task",
    "decode_body",
    "task_body",
]

#: Messages per chat request, characters per message, text parts per message.
MAX_MESSAGES = 256
MAX_MESSAGE_CHARS = 1_000_000
MAX_PARTS = 64
#: Files a code-review body may carry (the A2A server's ``--repo`` reader's limit).
MAX_FILES = 2_000
#: Characters of one file path (as :data:`atp_router.review.paths.MAX_PATH_CHARS`).
MAX_PATH_CHARS = 1024



# ------------------------------------------------------------------ the OpenAI ingress's messages
class TextPart(Struct, forbid_unknown_fields=True):
    """A text content part (``{"type": "text", "text": …}``); other part types
    (images, audio, files) are refused."""

    type: Literal["text"]
    text: Annotated[str, Meta(max_length=MAX_MESSAGE_CHARS)]


class ChatMessage(Struct, forbid_unknown_fields=True, omit_defaults=True):
    """One input message: ``role`` and ``content`` (a string or text parts, at
    most 1,000,000 characters); ``name`` is kept in the task content."""

    role: Literal["system", "developer", "user", "assistant"]
    content: Annotated[str, Meta(max_length=MAX_MESSAGE_CHARS)] | Annotated[list[TextPart], Meta(max_length=MAX_PARTS)]
    name: Annotated[str, Meta(min_length=1, max_length=64)] | None = None

    def text(self) -> str:
        """The message text (text parts joined with ``\\n``)."""
        c = self.content
        return c if isinstance(c, str) else "\n".join(p.text for p in c)

    def turn(self) -> ChatTurn:
        """This message as the task body holds it (:class:`ChatTurn`)."""
        return ChatTurn(role=self.role, content=self.text(), name=self.name)


# ------------------------------------------------------------------ bodies
class CodeReview(Struct, kw_only=True, omit_defaults=True):
    """``code_review``: ``diff`` (a unified diff, ``git diff`` output), ``files``
    (path → the full text *after* the diff; each next-hop bounds them) and, for an
    escalation with ``evidence: true``, the first stage's reports (``evidence``,
    added by the router)."""

    diff: str | None = None
    files: dict[str, str] | None = None
    evidence: list[dict[str, Any]] | None = None


class RepoSummary(Struct, kw_only=True, omit_defaults=True):
    """``repo_summary``: ``repo``, an absolute directory on the router's host
    under one of the summariser's roots (its own without it)."""

    repo: str | None = None


class RetrievalQA(Struct, kw_only=True, omit_defaults=True):
    """``retrieval_qa``: the ``question`` (non-empty) and ``docs``, an absolute
    corpus directory under one of the retriever's roots (its own without it)."""

    question: Annotated[str, Meta(min_length=1)]
    docs: str | None = None


class ChatTurn(Struct, kw_only=True, omit_defaults=True):
    """One message of a :class:`Chat` body: ``role``, ``content`` (text parts
    already joined), ``name``."""

    role: Literal["system", "developer", "user", "assistant"]
    content: Annotated[str, Meta(max_length=MAX_MESSAGE_CHARS)]
    name: Annotated[str, Meta(min_length=1, max_length=64)] | None = None


class Chat(Struct, kw_only=True, omit_defaults=True):
    """A task asked as chat messages (the OpenAI-compatible ingress): 1..
    :data:`MAX_MESSAGES` of them."""

    messages: Annotated[list[ChatTurn], Meta(min_length=1, max_length=MAX_MESSAGES)]


class Text(Struct, kw_only=True, omit_defaults=True):
    """A task asked as one text (the A2A server's non-diff message)."""

    text: str


class Opaque(Struct, kw_only=True):
    """The body of an operator's own task type that is none of the shapes above:
    any JSON object. The router reads none of its keys; the next-hops get it as
    sent (``Prompt.content``)."""


TaskBody: TypeAlias = CodeReview | RepoSummary | RetrievalQA | Chat | Text | Opaque

#: The body Struct of each task type that has its own (the union's tags).
BODIES: Mapping[str, type[CodeReview | RepoSummary | RetrievalQA]] = {
    "code_review": CodeReview,
    "repo_summary": RepoSummary,
    "retrieval_qa": RetrievalQA,
}


def decode_body(task_type: str, content: Mapping[str, Any]) -> TaskBody:
    """The body of a ``task_type`` task (module docstring's table): its
    :data:`BODIES` Struct, else by its keys — :class:`CodeReview` for
    ``{"diff"}`` / ``{"files"}``, :class:`Chat` for ``{"messages"}``,
    :class:`Text` for ``{"text"}``, :class:`Opaque` for any other object. Raises
    :class:`msgspec.ValidationError` naming the field (``Expected `str`, got
    `int` - at `$.diff```)."""
    kind: type[TaskBody]
    if task_type in BODIES:
        kind = BODIES[task_type]
    elif "diff" in content or "files" in content:
        kind = CodeReview
    elif "messages" in content:
        kind = Chat
    elif "text" in content:
        kind = Text
    else:
        return Opaque()
    return msgspec.convert(content, kind, strict=True)


#: The top-level meta field a msgspec validation error names (``- at `$.budget.usd```).
ERROR_FIELD = re.compile(r"`\$\.([A-Za-z_][A-Za-z0-9_]*)")


def task_body(task_type: str, content: Any) -> TaskBody:
    """``content`` checked (:func:`check_task`, the shapes the router reads) and
    decoded into its task type's body Struct
    (:func:`~atp_router.task.body.decode_body`): once per task, at its SYN or
    when its task message arrives. Raises LocalProtocolError(EPROTO) naming
    the field (``task content.question: Expected `str` of length >= 1 - at `$.question```)."""
    check_task(content)
    try:
        return decode_body(task_type, content)
    except msgspec.ValidationError as e:
        where = ERROR_FIELD.search(str(e))
        raise LocalProtocolError(ErrorCode.EPROTO, f"task content.{where.group(1)}: {e}" if where
                                 else f"task content: {e}") from None


def check_task(content: Any) -> None:
    """The task body fields the router itself reads (``diff`` for ``diff_loc``,
    ``files`` for consensus evidence) must have their documented shapes:
    ``{"diff": str, "files": {path: text}}``. Raises LocalProtocolError(EPROTO)."""
    if not isinstance(content, dict):
        raise LocalProtocolError(ErrorCode.EPROTO, "task content must be an object")
    diff = content.get("diff")
    if diff is not None and not isinstance(diff, str):
        raise LocalProtocolError(ErrorCode.EPROTO, "task content.diff must be a string (a unified diff)")
    files = content.get("files")
    if files is not None and not (
        isinstance(files, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in files.items())
    ):
        raise LocalProtocolError(ErrorCode.EPROTO, "task content.files must map paths to file text")
