"""pylint as a review next-hop: its errors and the warnings that are defects
(``E`` and ``W`` message classes, a few ``R`` comparisons), style left out.

Runs ``pylint --rcfile=/dev/null --output-format=json2 --persistent=n --score=n
--reports=n --jobs=1 --disable=all --enable=… --disable=… FILES`` in the task's
work directory. ``--rcfile=/dev/null`` is an explicit, empty configuration: pylint
then reads no ``pylintrc``/``.pylintrc``/``pyproject.toml``/``setup.cfg`` from the
work directory, its parents or ``$HOME``, so a task cannot switch messages off
(or load plugins, or run an ``init-hook``); only ``.py`` files are written anyway.
pylint only parses the files (astroid), it never imports them.

Suppression comments (``# pylint: disable=…``, ``disable-next``, ``skip-file``)
are not honoured unless the operator allows them: pylint has no switch for
that, so the adapter neutralises every ``pylint:`` directive inside a comment
of the copy it writes (:data:`SUPPRESSIONS`; lines and columns unchanged; see
:mod:`atp_router.adapters.tools.suppressions`).

Exit status: pylint's status is bit-encoded (1 fatal, 2 error, 4 warning,
8 refactor, 16 convention, 32 usage error). Bits 2-16 only say what it found and
are success here; 1 (a fatal message: pylint crashed on a file) and 32 (it
rejected its arguments) are ``EAGENTDOWN`` (see :mod:`atp_router.adapters.tools.base`).

pylint's own ``confidence`` says how it inferred a message, not how often the
class is a real defect, so :data:`GRADES` assigns a severity and a confidence per
message id (longest prefix wins, as ruff's); an ``INFERENCE_FAILURE`` message
has its confidence scaled by :data:`INFERENCE_FAILURE_FACTOR`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import msgspec

from atp_router.adapters.tools.base import (
    DEFAULT_LIMITS,
    ToolLimits,
    decode_items,
    longest_prefix,
    relative,
)
from atp_router.adapters.tools.suppressions import SuppressionAwareAdapter
from atp_router.consensus.types import AgentFinding, Severity

__all__ = ["DEFAULT_DISABLE", "DEFAULT_ENABLE", "GRADES", "SUPPRESSIONS", "PylintAdapter", "grade"]

#: Errors (E), warnings (W), and the refactor messages that are comparison bugs:
#: ``x is 1`` (R0123), ``x == x`` (R0124), ``1 == 1`` (R0133).
DEFAULT_ENABLE: tuple[str, ...] = ("E", "W", "R0123", "R0124", "R0133")

#: Noise in review, or wrong on a partial tree (only the changed files are
#: written, so imports of the rest of the project cannot resolve): import-error
#: (E0401), no-name-in-module (E0611), relative-beyond-top-level (E0402), unknown
#: inline option (W0012), string statement (W0105), unnecessary pass/lambda
#: (W0107 W0108), attribute outside __init__ (W0201), protected access (W0212),
#: overriding-signature noise (W0221 W0222), abstract-method of a base elsewhere
#: (W0223), super-init (W0231), useless delegation (W0246), semicolon and
#: indentation style (W0301 W0311), wildcard import (W0401), TODOs (W0511),
#: ``global`` (W0602-W0604), unused arguments (W0613), shadowing names (W0621
#: W0622), broad raise (W0719), keyword before *args (W1113), logging format
#: style (W1201-W1203), f-strings without placeholders (W1309 W1310), quote style
#: (W1405 W1406), open() without encoding (W1514), ellipsis (W2301), non-ASCII
#: file names (W2402), version-specific syntax (W2601-W2607).
DEFAULT_DISABLE: tuple[str, ...] = (
    "E0401", "E0402", "E0611", "W0012", "W0105", "W0107", "W0108", "W0201", "W0212", "W0221", "W0222",
    "W0223", "W0231", "W0246", "W0301", "W0311", "W0401", "W0511", "W0602", "W0603", "W0604", "W0613",
    "W0621", "W0622", "W0719", "W1113", "W1201", "W1202", "W1203", "W1309", "W1310", "W1405", "W1406",
    "W1514", "W2301", "W2402", "W2601", "W2602", "W2603", "W2604", "W2605", "W2606", "W2607",
)  # fmt: skip

H, M, L = Severity.HIGH, Severity.MEDIUM, Severity.LOW

#: Message-id prefix → (severity, confidence); the longest matching prefix wins.
#: Confidence is how sure the class is to be a real defect in review.
GRADES: dict[str, tuple[Severity, float]] = {
    "E": (H, 0.7),  # errors: mostly raise at run time
    "E0001": (H, 0.95),  # syntax error: the file does not parse
    "E0601": (H, 0.75),  # used before assignment
    "E0602": (H, 0.8),  # undefined variable: NameError when reached
    "E0606": (M, 0.6),  # possibly used before assignment
    "E1101": (M, 0.55),  # no-member: inference can miss dynamic attributes
    "E1102": (H, 0.7),  # not-callable
    "E1111": (M, 0.6),  # assignment-from-no-return
    "E112": (H, 0.75),  # E1120-E1126: call arguments do not fit the signature
    "E113": (M, 0.6),  # E1130-E1139: unsupported operations / subscripts
    "E1205": (H, 0.75),  # logging format arguments
    "E1206": (H, 0.75),
    "E13": (H, 0.8),  # %-format errors raise at run time
    "W": (L, 0.45),  # warnings unless listed below
    "W0101": (M, 0.6),  # unreachable code
    "W0102": (M, 0.7),  # mutable default argument shared across calls
    "W0104": (M, 0.55),  # statement with no effect
    "W0106": (M, 0.55),  # expression not assigned
    "W0109": (M, 0.7),  # duplicate dict key: the first value is lost
    "W0120": (L, 0.5),  # else on a loop without break
    "W0122": (M, 0.55),  # exec
    "W0123": (M, 0.6),  # eval
    "W0125": (M, 0.65),  # constant test
    "W0126": (H, 0.8),  # `if f:` for `if f():`
    "W0127": (M, 0.7),  # x = x
    "W0129": (H, 0.8),  # assert on a string literal never fails
    "W0134": (H, 0.75),  # return in finally swallows the exception
    "W0143": (H, 0.8),  # comparison with a callable
    "W0150": (H, 0.75),  # lost exception
    "W0177": (H, 0.85),  # comparison with NaN is always False
    "W0199": (H, 0.85),  # assert on a tuple never fails
    "W0631": (M, 0.6),  # loop variable used after the loop
    "W0632": (H, 0.7),  # unbalanced tuple unpacking
    "W0640": (M, 0.65),  # closure over a loop variable
    "W0611": (L, 0.6),  # unused import
    "W0612": (L, 0.6),  # unused variable: often a typo'd use
    "W0702": (M, 0.6),  # bare except
    "W0705": (M, 0.7),  # the same exception caught twice
    "W0706": (L, 0.4),
    "W0707": (L, 0.4),  # raise without from: context lost, not a bug
    "W0711": (H, 0.8),  # `except A or B` catches only A
    "W0716": (H, 0.75),
    "W0718": (L, 0.45),  # broad except
    "W1114": (H, 0.7),  # arguments passed out of order
    "W1116": (H, 0.8),  # isinstance second argument not a type
    "W13": (M, 0.75),  # format-string / argument mismatches
    "W1401": (M, 0.6),  # anomalous backslash: a broken regex, usually
    "W1404": (M, 0.55),  # implicit concatenation: a missing comma
    "W1501": (H, 0.8),  # bad open() mode
    "W1503": (M, 0.6),
    "W1508": (M, 0.6),  # non-string os.getenv default
    "W1509": (M, 0.55),  # preexec_fn is not thread-safe
    "W1510": (L, 0.4),  # subprocess.run without check
    "W1515": (M, 0.9),  # leftover breakpoint()
    "W1518": (L, 0.45),
    "W2101": (H, 0.7),  # `with lock:` on a fresh lock guards nothing
    "W3101": (M, 0.55),  # requests without timeout hangs forever
    "W3601": (M, 0.6),  # a < b is c chains
    "W4701": (H, 0.75),  # list modified while iterating over it
    "W49": (L, 0.4),  # deprecated APIs
    "R0123": (H, 0.8),  # `is` with a literal
    "R0124": (M, 0.7),  # comparison with itself
    "R0133": (M, 0.7),  # comparison of constants
}
_DEFAULT_GRADE = (L, 0.45)
#: Scale of the confidence of a message pylint emitted although inference failed.
INFERENCE_FAILURE_FACTOR = 0.8

#: pylint's directive in a comment (``# pylint: disable=…``, ``# pylint: skip-file``).
SUPPRESSIONS = re.compile(r"pylint(?=\s*:)", re.IGNORECASE)

_FATAL = 1
_USAGE = 32
_MESSAGE_RE = re.compile(r"^[A-Za-z][A-Za-z0-9-]{0,63}$")


def grade(message_id: str) -> tuple[Severity, float]:
    """(severity, confidence) of a pylint message id by the longest prefix in GRADES."""
    return longest_prefix(GRADES, message_id, _DEFAULT_GRADE)


class _Message(msgspec.Struct):
    """The fields of one json2 message the adapter reads (others are skipped)."""

    messageId: str
    symbol: str
    message: str
    path: str
    line: int
    type: str = ""
    endLine: int | None = None
    confidence: str = ""


class _Report(msgspec.Struct):
    messages: list[msgspec.Raw]
    statistics: dict[str, msgspec.Raw] | None = None


class PylintAdapter(SuppressionAwareAdapter):
    """pylint next-hop. ``enable``/``disable`` are pylint message ids, symbols or
    classes (``"W0102"``, ``"dangerous-default-value"``, ``"W"``; default
    :data:`DEFAULT_ENABLE` / :data:`DEFAULT_DISABLE`), applied after
    ``--disable=all``. Raises ``ValueError`` when ``enable`` is empty or an entry is
    not a message name. Other arguments:
    :class:`~atp_router.adapters.tools.suppressions.SuppressionAwareAdapter`."""

    tool = "pylint"
    suppression_pattern = SUPPRESSIONS
    default_strengths = ("static_analysis", "bug_detection")

    def __init__(
        self,
        name: str = "pylint",
        *,
        scope: str = "changed",
        context: int = 0,
        strengths: Iterable[str] | None = None,
        enable: Iterable[str] = DEFAULT_ENABLE,
        disable: Iterable[str] = DEFAULT_DISABLE,
        limits: ToolLimits = DEFAULT_LIMITS,
        allow_suppressions: bool = False,
    ) -> None:
        super().__init__(name, scope=scope, context=context, strengths=strengths, limits=limits,
                         allow_suppressions=allow_suppressions)
        self.enable = list(enable)
        self.disable = list(disable)
        if not self.enable:
            raise ValueError("enable: must name at least one pylint message or class")
        for key, names in (("enable", self.enable), ("disable", self.disable)):
            for msg in names:
                if not isinstance(msg, str) or not _MESSAGE_RE.match(msg):
                    raise ValueError(f"{key}: not a pylint message id, symbol or class: {msg!r:.80}")

    def argv(self, paths: list[str]) -> list[str]:
        args = [
            "--rcfile=/dev/null", "--output-format=json2", "--persistent=n", "--score=n", "--reports=n",
            "--jobs=1", "--disable=all", "--enable=" + ",".join(self.enable),
        ]  # fmt: skip
        if self.disable:
            args.append("--disable=" + ",".join(self.disable))
        return [*args, "--", *paths]

    def _check_exit(self, returncode: int, stderr: bytes, root: str) -> None:
        """Statuses with only the found-something bits (2 4 8 16) are success;
        fatal (1), usage (32), signals and the limits go to the base class."""
        if returncode > 0 and not returncode & (_FATAL | _USAGE):
            return
        super()._check_exit(returncode, stderr, root)

    def parse(self, stdout: bytes, root: str) -> tuple[list[AgentFinding], list[str]]:
        """pylint's json2 report (``messages`` list) as findings (runs in a worker
        thread). Notes: files pylint could not parse."""
        report = msgspec.json.decode(stdout, type=_Report)
        findings: list[AgentFinding] = []
        paths: dict[str, str] = {}
        unparsed: set[str] = set()
        for m in decode_items(report.messages, _Message):
            path = paths.get(m.path)
            if path is None:
                path = paths[m.path] = relative(m.path, root)
            if m.messageId == "E0001":
                unparsed.add(path)
            start = max(m.line, 1)
            end = max(start, m.endLine or start)
            severity, confidence = grade(m.messageId)
            if m.confidence == "INFERENCE_FAILURE":
                confidence = round(confidence * INFERENCE_FAILURE_FACTOR, 3)
            findings.append(
                AgentFinding(
                    file=path,
                    start=start,
                    end=end,
                    severity=severity,
                    claim=f"{m.messageId} {m.symbol}: {m.message}",
                    confidence=confidence,
                    rule=m.messageId,
                )
            )
        notes = [f"{len(unparsed)} file(s) do not parse"] if unparsed else []
        return findings, notes
