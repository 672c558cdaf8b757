"""The provider adapter interface (spec §14).

An adapter is one next-hop: a local tool, a model endpoint, a remote agent. The
router calls ``estimate`` before every send (spec §5.2 preflight) and admits the
call against the stream's window; it then iterates ``stream`` under an overall
deadline (``trio.fail_after``) and turns each :class:`Fragment` into a PARTIAL
frame (``MORE`` set) or, for the last one, the agent's FINAL.

Contract for ``stream``:

* yield zero or more ``Fragment(type=PARTIAL, ...)`` (text deltas, progress);
* yield exactly one ``Fragment(type=FINAL, content=AgentReport | Any, usage=...)``
  last; ``usage`` on any fragment is the *cumulative* usage so far, so a stream cut
  short still tells the budget governor what was spent;
* raise :class:`~atp_router.wire.errors.AgentError` with ``ETIMEOUT`` / ``EAGENTDOWN`` /
  ``EPROTO`` on failure (never a bare ``httpx`` or ``OSError``).

Also the accounting every adapter shares: :func:`estimate_tokens` (chars/4),
:func:`usd_micros` (token prices → USD micros), :func:`usd_micros_ceil` (a USD
price → USD micros), :class:`CallStats` (recent calls → :class:`~atp_router.policy.health.Health`)
and :func:`change_of` (a prompt's diff, parsed once per task).
"""

from __future__ import annotations

import abc
import bisect
import functools
import math
from collections import deque
from collections.abc import AsyncGenerator
from fractions import Fraction
from typing import Any, ClassVar, Generic, TypeVar, cast

import msgspec
from msgspec import Struct

from atp_router.consensus.types import Usage
from atp_router.policy.health import Health
from atp_router.task.body import CodeReview, TaskBody, decode_body
from atp_router.task.change import ParsedChange, parse_change
from atp_router.task.meta import TaskMeta
from atp_router.wire.errors import ClientInputError
from atp_router.wire.frame import Capabilities, CostEstimate, PayloadType

#: The body type a :class:`Prompt` carries (``Prompt[CodeReview]``: a review's).
B_co = TypeVar("B_co", bound=TaskBody, covariant=True)


class Prompt(Struct, Generic[B_co], forbid_unknown_fields=True, omit_defaults=True, dict=True):
    """What a next-hop is asked to do: ``Prompt[B]``, ``B`` the task body type
    (:mod:`atp_router.task.body`; ``Prompt[TaskBody]`` when any).

    ``content`` is the task body as the client sent it (a JSON object), what a
    remote next-hop is sent unchanged (keys a body Struct does not name
    included); :attr:`body` is its typed view, the one every adapter reads
    (``prompt.body.diff``, ``.files``, ``.question``, ``.messages``), never
    ``content`` by key. ``meta`` is the stream's frame meta (task_type, the
    policy's match keys — ``languages``, ``risk``, ``repo`` — data_scope,
    trace, ...), passed to next-hops unchanged; ``task`` is the typed view of
    the fields the router acts on (:class:`~atp_router.task.meta.TaskMeta`:
    budget, idempotency key, data scope, Agent Context, trace, ``diff_loc``),
    decoded once at the stream's SYN (empty on a prompt built without it: a
    test's, a canary's). ``change`` is the body's diff parsed
    (:class:`~atp_router.task.change.ParsedChange`): the dispatcher parses a
    task's diff once and hands it to every leg here; None on a prompt built
    without it (an adapter then parses the diff itself, :func:`change_of`).
    """

    task_type: str
    content: dict[str, Any]
    meta: dict[str, Any] = msgspec.field(default_factory=dict)
    instruction: str = ""
    change: ParsedChange | None = None
    task: TaskMeta = msgspec.field(default_factory=TaskMeta)

    @functools.cached_property
    def body(self) -> B_co:
        """``content`` as its task type's body Struct
        (:func:`~atp_router.task.body.decode_body`), decoded once per prompt —
        or the body the router already decoded at SYN (:meth:`with_body`). A
        prompt whose content is replaced (``msgspec.structs.replace``, e.g. a
        data-scope redaction) is a new prompt and decodes its own. Raises
        :class:`~atp_router.wire.errors.ClientInputError` (``EPROTO``) naming
        the field when the content is not that shape (a prompt built outside
        a router; the router refuses such a task at SYN)."""
        try:
            return cast(B_co, decode_body(self.task_type, self.content))
        except msgspec.ValidationError as e:
            raise ClientInputError(f"task content: {e}") from None

    def with_body(self, body: TaskBody) -> Prompt[B_co]:
        """This prompt carrying ``body``, the decode of its ``content`` the
        router made at SYN (so :attr:`body` is not decoded again); returns self."""
        self.__dict__["body"] = body
        return self


def change_of(prompt: Prompt[TaskBody]) -> ParsedChange | None:
    """``prompt``'s diff parsed: :attr:`Prompt.change` when the prompt carries it
    (the task's diff, parsed once by the dispatcher), else its body's ``diff``
    parsed here (blocking: call it off the event loop for a large diff); None
    when the body is not a review with a diff."""
    if prompt.change is not None:
        return prompt.change
    body = prompt.body
    return parse_change(body.diff) if isinstance(body, CodeReview) and body.diff is not None else None


class Fragment(Struct, forbid_unknown_fields=True, omit_defaults=True):
    """One piece of an adapter's output (spec §14): ``type`` is PARTIAL, FINAL or
    LOG; ``usage`` is cumulative (tokens, USD micros)."""

    type: PayloadType
    content: Any = None
    confidence: float | None = None
    usage: Usage | None = None


#: Tokens are estimated as characters / 4 where no tokenizer is at hand (the
#: usual rule of thumb for English and code with BPE vocabularies).
CHARS_PER_TOKEN = 4


def estimate_tokens(chars: int) -> int:
    """Tokens for ``chars`` characters by the chars/4 rule, rounded up."""
    return -(-chars // CHARS_PER_TOKEN)


@functools.lru_cache(maxsize=1024)
def _exact(cost: float) -> tuple[int, int]:
    """``cost`` as the exact decimal it was written as, a (numerator, denominator) pair."""
    f = Fraction(str(cost))
    return f.numerator, f.denominator


def usd_micros(in_tokens: int, out_tokens: int, cost_in_per_mtok: float, cost_out_per_mtok: float) -> int:
    """Price of a call in USD micros. A cost in USD per 1M tokens is numerically USD
    micros per token; the decimal costs are taken exactly (``Fraction(str(x))``,
    once per distinct cost) and the total is rounded up in integer arithmetic, so
    the budget governor never under-counts spend and a fragment costs no
    ``Fraction`` work (issue 10)."""
    n_in, d_in = _exact(cost_in_per_mtok)
    n_out, d_out = _exact(cost_out_per_mtok)
    num = in_tokens * n_in * d_out + out_tokens * n_out * d_in
    return -(-num // (d_in * d_out))


def usd_micros_ceil(usd: float) -> int:
    """A price of ``usd`` USD in USD micros, taken exactly and rounded up (like
    :func:`usd_micros`)."""
    return math.ceil(Fraction(str(usd)) * 1_000_000)


class CallStats:
    """Outcomes of the last ``size`` calls of a next-hop, summarised as
    :class:`Health` (p95 latency in ms by nearest rank, error rate 0..1). Pure:
    callers pass the measured latency.

    The window is kept sorted as calls come and go (a bisect insert and delete per
    call) with its error count, so :meth:`health` — read by the FIB lookup of
    every SYN — is O(1), not a sort of the window."""

    def __init__(self, size: int = 100) -> None:
        self._calls: deque[tuple[float, bool]] = deque()
        self._size = size
        self._sorted: list[float] = []  # the window's latencies, ascending
        self._errors = 0
        self._up = True

    def record(self, latency_ms: float, *, ok: bool, down: bool = False) -> None:
        """Add one call; ``down`` marks the next-hop unreachable until a call that
        is not ``down`` is recorded. A latency that is not a number counts as 0 ms
        (it would break the window's order)."""
        if latency_ms != latency_ms:  # NaN
            latency_ms = 0.0
        if len(self._calls) >= self._size:
            old_ms, old_ok = self._calls.popleft()
            del self._sorted[bisect.bisect_left(self._sorted, old_ms)]
            self._errors -= not old_ok
        self._calls.append((latency_ms, ok))
        bisect.insort(self._sorted, latency_ms)
        self._errors += not ok
        self._up = not down

    def health(self) -> Health:
        n = len(self._sorted)
        if not n:
            return Health(up=self._up)
        return Health(p95_ms=self._sorted[max(0, math.ceil(0.95 * n) - 1)], error_rate=self._errors / n, up=self._up)


class ProviderAdapter(abc.ABC):
    """Base class of every next-hop adapter (spec §14)."""

    name: str
    #: True when ``health().up`` follows the peer's own announcements and recovers by
    #: itself (a 2389 agent's retained status and LWT): the FIB then excludes the
    #: next-hop while it is down. Otherwise only the router's circuit breaker does,
    #: since nothing would call a self-declared-down adapter again to find it back.
    live_health: bool = False
    #: True when the next-hop cannot review a code change from its diff alone and
    #: needs ``content["files"]`` (the after-diff text of the files), as the local
    #: analysers do; a client sending only a diff (the A2A server's text message)
    #: is refused for such a route unless the router can read the files (``--repo``).
    needs_files: bool = False
    #: True when the next-hop's work is bounded by the tenant's input rather than by
    #: the next-hop's health: a local tool that runs the task's own tests or analyses
    #: its files (:class:`~atp_router.adapters.tools.base.ToolAdapter`,
    #: :class:`~atp_router.adapters.tools.base.InThreadToolAdapter`). Such a call cut by its
    #: ``timeout_ms``, or crashing outside this contract, may be the task's doing: the
    #: router answers it to the tenant without retry or reroute, counts it against no
    #: breaker, and runs a canary task of its own on the next-hop to tell
    #: (:func:`atp_router.flow.breaker.attribute`). What the adapter raises is its own verdict.
    tenant_bound: ClassVar[bool] = False

    @abc.abstractmethod
    def capabilities(self) -> Capabilities:
        """Skills, context size (tokens), tools."""

    @abc.abstractmethod
    def estimate(self, prompt: Prompt) -> CostEstimate:
        """Preflight: expected input/output tokens and USD for ``prompt`` (§5.2)."""

    @abc.abstractmethod
    def stream(self, prompt: Prompt) -> AsyncGenerator[Fragment, None]:
        """Run the call, yielding fragments as described in the module docstring."""

    def health(self) -> Health:
        return Health()

    async def aclose(self) -> None:
        """Release connections; the router calls this when the RIB drops the agent."""
