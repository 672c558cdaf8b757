"""Compiled ``match`` clauses of RIB policies (spec §6.1, §23).

A policy's ``match`` is a mapping ``{meta key: value}``; every key must accept
the task meta (logical AND). Per value:

=========================  ====================================================
``">150"``, ``"<= 1_000"``  numeric comparison (``>`` ``>=`` ``<`` ``<=`` ``==``
                            ``!=``) with the meta value, which must be a number
                            or a numeric string (``"180"``); anything else, a
                            bool or a list included, does not match
``[a, b, ">1000"]``         any of the items (each compiled as above)
``code_review``, ``3``      equality; when the meta value is a list
                            (``languages: [py, ts]``) it means membership
=========================  ====================================================

A key missing from the meta never matches. Any string starting with one of
``< > = !`` must be a well-formed comparison: ``">>1"`` is refused at load
rather than silently compared as text. Comparisons are parsed once here, at
compile time; matching a task does no parsing of the policy.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable, Mapping
from typing import Any

from atp_router.policy.rib import SpecError

__all__ = ["AnyOf", "Compare", "CompiledMatch", "Equals", "Matcher", "compile_match", "compile_value"]

OPERATORS: dict[str, Callable[[Any, Any], bool]] = {
    ">=": operator.ge,
    "<=": operator.le,
    "==": operator.eq,
    "!=": operator.ne,
    ">": operator.gt,
    "<": operator.lt,
}

_COMPARISON_RE = re.compile(r"^(>=|<=|==|!=|>|<)\s*([-+]?\d+(?:_\d+)*(\.\d+(?:_\d+)*)?([eE][-+]?\d+)?)\s*$")
_OPERATOR_CHARS = frozenset("<>=!")


def _number(value: Any) -> int | float | None:
    """The meta value as a number: an int/float, or a numeric string; else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return value
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            try:
                return float(value)
            except ValueError:
                return None
    return None


def _same(a: Any, b: Any) -> bool:
    # True == 1 in Python; a policy saying `flag: true` must not match `flag: 1`.
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    return a == b


class Compare:
    """``meta_value <op> number`` for a numeric meta value."""

    __slots__ = ("_fn", "number", "op", "text")

    def __init__(self, op: str, number: float, text: str):
        self.op = op
        self.number = number
        self.text = text
        self._fn = OPERATORS[op]

    def __call__(self, value: Any) -> bool:
        n = _number(value)
        return n is not None and self._fn(n, self.number)

    def __repr__(self) -> str:
        return f"Compare({self.text!r})"


class Equals:
    """Equality with a scalar, or membership when the meta value is a list."""

    __slots__ = ("expected",)

    def __init__(self, expected: Any):
        self.expected = expected

    def __call__(self, value: Any) -> bool:
        if isinstance(value, (list, tuple)):
            return any(_same(v, self.expected) for v in value)
        return _same(value, self.expected)

    def __repr__(self) -> str:
        return f"Equals({self.expected!r})"


class AnyOf:
    """Matches when any of ``options`` matches."""

    __slots__ = ("options",)

    def __init__(self, options: tuple[Matcher, ...]):
        self.options = options

    def __call__(self, value: Any) -> bool:
        return any(m(value) for m in self.options)

    def __repr__(self) -> str:
        return f"AnyOf({list(self.options)!r})"


Matcher = Compare | Equals | AnyOf


def _compile_scalar(value: Any) -> Compare | Equals:
    if isinstance(value, str) and value[:1] in _OPERATOR_CHARS:
        m = _COMPARISON_RE.match(value)
        if m is None:
            raise ValueError(f"expected a comparison like '>150', got {value!r}")
        op, num = m.group(1), m.group(2).replace("_", "")
        number: int | float = float(num) if (m.group(3) or m.group(4)) else int(num)
        return Compare(op, number, value)
    if isinstance(value, (str, int, float)):
        return Equals(value)
    raise ValueError(f"expected a string, number, bool or comparison, got {type(value).__name__}")


def compile_value(value: Any) -> Matcher:
    """Compile one ``match`` value (see the module table).

    Raises :class:`~atp_router.policy.rib.SpecError` with ``field`` ``""`` or ``"[i]"``
    (the faulty list item) on a malformed comparison or an empty list."""
    if isinstance(value, list):
        if not value:
            raise SpecError("", "an empty list matches nothing")
        options = []
        for i, item in enumerate(value):
            try:
                options.append(_compile_scalar(item))
            except ValueError as e:
                raise SpecError(f"[{i}]", str(e)) from None
        return AnyOf(tuple(options))
    try:
        return _compile_scalar(value)
    except ValueError as e:
        raise SpecError("", str(e)) from None


class CompiledMatch:
    """A compiled ``match`` mapping: ``cm(meta) -> bool`` (AND over its keys).
    An empty mapping matches every task (a default route)."""

    __slots__ = ("items", "source")

    def __init__(self, items: tuple[tuple[str, Matcher], ...], source: Mapping[str, Any]):
        self.items = items
        self.source = dict(source)

    def __call__(self, meta: Mapping[str, Any]) -> bool:
        for key, matcher in self.items:
            if key not in meta or not matcher(meta[key]):
                return False
        return True

    def equals_values(self, key: str) -> list[Any] | None:
        """The values ``key`` is matched for equality with (``["code_review"]``),
        or None when ``key`` is unconstrained or compared numerically."""
        m = dict(self.items).get(key)
        if isinstance(m, Equals):
            return [m.expected]
        if isinstance(m, AnyOf) and all(isinstance(o, Equals) for o in m.options):
            return [o.expected for o in m.options]  # type: ignore[union-attr]
        return None

    def __repr__(self) -> str:
        return f"CompiledMatch({self.source!r})"


def compile_match(match: Mapping[str, Any]) -> CompiledMatch:
    """Compile a policy's ``match`` mapping.

    Raises :class:`~atp_router.policy.rib.SpecError` whose ``field`` is the faulty key
    (``"diff_loc"``, ``"languages[1]"``) and whose reason says what was expected."""
    items = []
    for key, value in match.items():
        if not isinstance(key, str) or not key:
            raise SpecError(str(key), "match keys must be non-empty strings")
        try:
            items.append((key, compile_value(value)))
        except SpecError as e:
            raise SpecError(key + e.field, e.reason) from None
    return CompiledMatch(tuple(items), match)
