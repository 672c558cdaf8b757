"""mypy as a review next-hop: type errors that are run-time defects (undefined
names and attributes, calls that do not fit the signature, ``None`` used as a
value, wrong operand types).

Runs ``mypy --config-file= --no-incremental --cache-dir=/dev/null
--ignore-missing-imports --follow-imports=silent --no-site-packages
--explicit-package-bases --check-untyped-defs --no-error-summary
--show-column-numbers --show-error-end -O json [--disable-error-code …]
[--python-version X.Y] FILES`` in the task's work directory. ``--config-file=``
(empty) reads no configuration at all — no ``mypy.ini``/``.mypy.ini``/
``setup.cfg``/``pyproject.toml`` in the work directory and none in ``$HOME`` —
so a task cannot configure it; only ``.py`` files are written anyway. Imports of
modules outside the task resolve to ``Any`` (the rest of the project is not
there); ``--no-site-packages`` keeps the router's own installed packages out of
the check; ``--explicit-package-bases`` maps ``a/x.py`` to module ``a.x`` so two
``utils.py`` in different directories do not clash. ``--check-untyped-defs``
(on by default, ``check_untyped_defs=False`` turns it off) checks the bodies of
unannotated functions, which is most reviewed code.

Suppression comments (``# type: ignore[…]``, inline configuration such as
``# mypy: ignore-errors`` or ``# mypy: disable-error-code=…``, a ``# type:
ignore`` heading the file) are not honoured unless the operator allows them:
mypy has no switch for that, so the adapter neutralises them in the copy it
writes (:data:`SUPPRESSIONS`; lines and columns unchanged, type comments such
as ``# type: int`` kept; see :mod:`atp_router.adapters.tools.suppressions`) wherever
they follow a ``#`` on their line, strings included: mypy's parsers find
comments where Python 3.11's tokenizer sees a string — its native parser reads
Python 3.12's comments inside a triple-quoted f-string's replacement field
(``x  # type: ignore`` on a line of its own there) whatever the target
version, and its old parser
takes any line starting ``# mypy:`` as configuration, inside a docstring too.
A string that merely contains ``# type: ignore`` is changed the same way, which
changes nothing mypy checks.

Exit status: 0 nothing found, 1 errors found — both success. 2 is mypy's
"blocking error": with an empty stderr it is a file that does not parse (the
JSON report on stdout says which; mypy checks nothing further, which the
summary notes); with stderr (a usage error, an internal error) it is
``EAGENTDOWN`` (see :mod:`atp_router.adapters.tools.base`).

mypy has no per-error confidence, so :data:`GRADES` assigns a severity and a
confidence per error code.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import msgspec

from atp_router.adapters.tools.base import (
    DEFAULT_LIMITS,
    ToolLimits,
    decode_items,
    relative,
)
from atp_router.adapters.tools.suppressions import SuppressionAwareAdapter
from atp_router.consensus.types import AgentFinding, Severity

__all__ = ["DEFAULT_DISABLE", "GRADES", "SUPPRESSIONS", "MypyAdapter", "grade"]

#: Noise in review: "need type annotation" (var-annotated), "cannot determine
#: type" (has-type), unresolved / untyped imports (import-not-found,
#: import-untyped: the project is not all there), an empty body of a
#: protocol-like method (empty-body), notes about unchecked annotations
#: (annotation-unchecked).
DEFAULT_DISABLE: tuple[str, ...] = (
    "var-annotated", "has-type", "import-not-found", "import-untyped", "empty-body", "annotation-unchecked",
)  # fmt: skip

H, M, L = Severity.HIGH, Severity.MEDIUM, Severity.LOW

#: mypy error code → (severity, confidence): how often that class is a real
#: defect in review (``None`` code: mypy's own messages, graded as ``misc``).
GRADES: dict[str, tuple[Severity, float]] = {
    "syntax": (H, 0.95),  # the file does not parse
    "name-defined": (H, 0.8),  # NameError when reached
    "used-before-def": (H, 0.7),
    "attr-defined": (H, 0.65),  # AttributeError, unless set dynamically
    "call-arg": (H, 0.75),  # wrong number / names of arguments: TypeError
    "func-returns-value": (H, 0.7),  # using the None a function returns
    "await-not-async": (H, 0.75),
    "unused-coroutine": (H, 0.75),  # coroutine never awaited
    "str-format": (H, 0.75),
    "truthy-function": (M, 0.7),  # `if f:` for `if f():`
    "union-attr": (M, 0.55),  # attribute of a value that may be None
    "arg-type": (M, 0.55),
    "return-value": (M, 0.55),
    "index": (M, 0.6),
    "operator": (M, 0.6),
    "call-overload": (M, 0.55),
    "return": (M, 0.55),  # missing return
    "abstract": (M, 0.6),  # instantiating an abstract class
    "str-bytes-safe": (M, 0.6),  # "{}".format(b"x") prints b'x'
    "dict-item": (M, 0.5),
    "list-item": (M, 0.5),
    "assignment": (M, 0.45),
    "no-redef": (M, 0.5),
    "valid-type": (L, 0.4),
    "override": (L, 0.4),
    "misc": (L, 0.4),
}
_DEFAULT_GRADE = (L, 0.4)

#: mypy's suppressions in a comment: ``type: ignore`` (its ``type``) and every
#: ``mypy:`` inline-configuration comment.
SUPPRESSIONS = re.compile(r"mypy(?=\s*:)|type(?=\s*:\s*ignore)", re.IGNORECASE)

_CODE_RE = re.compile(r"^[a-z][a-z0-9-]{0,63}$")
_VERSION_RE = re.compile(r"^3\.\d{1,2}$")


def grade(code: str | None) -> tuple[Severity, float]:
    """(severity, confidence) of a mypy error code (:data:`GRADES`; others low, 0.4)."""
    return GRADES.get(code or "misc", _DEFAULT_GRADE)


class _Error(msgspec.Struct):
    """The fields of one ``-O json`` line the adapter reads (others are skipped)."""

    file: str
    line: int
    message: str
    severity: str
    code: str | None = None
    end_line: int | None = None
    hint: str | None = None


class MypyAdapter(SuppressionAwareAdapter):
    """mypy next-hop. ``disable_error_codes`` are mypy error codes not to report
    (default :data:`DEFAULT_DISABLE`); ``check_untyped_defs`` checks unannotated
    functions (default on); ``python_version`` (``"3.11"`` …) is the Python the
    code targets (default: mypy's interpreter). Raises ``ValueError`` on an entry
    that is not an error code or a version that is not ``3.N``, ``TypeError`` when
    ``check_untyped_defs`` is not a bool. Other arguments:
    :class:`~atp_router.adapters.tools.suppressions.SuppressionAwareAdapter`."""

    tool = "mypy"
    suppression_pattern = SUPPRESSIONS
    suppression_after_hash = True
    default_strengths = ("static_analysis", "bug_detection", "type_checking")

    def __init__(
        self,
        name: str = "mypy",
        *,
        scope: str = "changed",
        context: int = 0,
        strengths: Iterable[str] | None = None,
        disable_error_codes: Iterable[str] = DEFAULT_DISABLE,
        check_untyped_defs: bool = True,
        python_version: str | None = None,
        limits: ToolLimits = DEFAULT_LIMITS,
        allow_suppressions: bool = False,
    ) -> None:
        super().__init__(name, scope=scope, context=context, strengths=strengths, limits=limits,
                         allow_suppressions=allow_suppressions)
        self.disable_error_codes = list(disable_error_codes)
        for code in self.disable_error_codes:
            if not isinstance(code, str) or not _CODE_RE.match(code):
                raise ValueError(f"disable_error_codes: not a mypy error code: {code!r:.80}")
        if not isinstance(check_untyped_defs, bool):
            raise TypeError(f"check_untyped_defs: must be a bool, got {check_untyped_defs!r:.40}")
        if python_version is not None and (not isinstance(python_version, str) or not _VERSION_RE.match(python_version)):
            raise ValueError(f"python_version: must look like '3.11', got {python_version!r:.40}")
        self.check_untyped_defs = check_untyped_defs
        self.python_version = python_version

    def argv(self, paths: list[str]) -> list[str]:
        args = [
            "--config-file=", "--no-incremental", "--cache-dir=/dev/null", "--ignore-missing-imports",
            "--follow-imports=silent", "--no-site-packages", "--explicit-package-bases", "--no-error-summary",
            "--show-column-numbers", "--show-error-end", "--no-color-output", "-O", "json",
        ]  # fmt: skip
        if self.check_untyped_defs:
            args.append("--check-untyped-defs")
        for code in self.disable_error_codes:
            args += ["--disable-error-code", code]
        if self.python_version:
            args += ["--python-version", self.python_version]
        return [*args, "--", *paths]

    def _check_exit(self, returncode: int, stderr: bytes, root: str) -> None:
        """1 (errors found) is success, and so is 2 with nothing on stderr (a
        blocking parse error, reported on stdout); the rest goes to the base
        class (EAGENTDOWN, or the limit that was hit)."""
        if returncode == 1 or (returncode == 2 and not stderr.strip()):
            return
        super()._check_exit(returncode, stderr, root)

    def parse(self, stdout: bytes, root: str) -> tuple[list[AgentFinding], list[str]]:
        """mypy's JSON lines (one error object a line) as findings (runs in a
        worker thread); ``note`` lines are skipped. Notes: files that do not
        parse (mypy stops there)."""
        raws = [msgspec.Raw(line) for line in stdout.splitlines() if line.strip()]
        findings: list[AgentFinding] = []
        paths: dict[str, str] = {}
        unparsed: set[str] = set()
        for e in decode_items(raws, _Error):
            if e.severity != "error":
                continue
            path = paths.get(e.file)
            if path is None:
                path = paths[e.file] = relative(e.file, root)
            if e.code == "syntax":
                unparsed.add(path)
            start = max(e.line, 1)
            end = max(start, e.end_line or start)
            severity, confidence = grade(e.code)
            code = e.code or "misc"
            findings.append(
                AgentFinding(
                    file=path,
                    start=start,
                    end=end,
                    severity=severity,
                    claim=f"{code}: {e.message}",
                    confidence=confidence,
                    rule=code,
                )
            )
        notes = [f"{len(unparsed)} file(s) do not parse (mypy checks nothing past a syntax error)"] if unparsed else []
        return findings, notes
