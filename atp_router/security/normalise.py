"""Normalised views of tenant text for the secrets detectors (spec §11, §19
exfiltration; issue 19 "redaction that normalises first").

A model reads through tricks that a pattern does not: ``"AKIA" "IOSFODNN7EXAMPLE"``
is one string to a compiler, ``АKIА…`` with Cyrillic letters, ``AKIA\\u200bIOSF…``
with a zero-width space and ``\\u0041KIA…`` all read as the same key. The
detectors of :mod:`atp_router.security.redact` therefore also run over *views* of the
text in which those tricks are undone, and every detection in a view is mapped
back to the characters of the original text that produced it, so that the
redaction replaces what the tenant wrote, whatever form it took.

A :class:`View` is a string with a map to its parent's (ultimately the original
text's) character offsets. The views, each built from the one before
(:func:`views`):

1. **diff bodies** (diffs only): the ``+``/``-``/`` `` prefix of each line dropped;
2. **characters** (:func:`characters`): escapes decoded (``\\uXXXX``,
   ``\\u{X…}``, ``\\UXXXXXXXX``, ``\\xXX``, 3-digit octal, ``\\N{NAME}``, HTML
   ``&#N;`` / ``&#xH;`` / ``&name;``, URL ``%XX`` of printable ASCII),
   backslash-newline line continuations removed, then every non-ASCII character
   put through Unicode NFKC, its combining marks dropped (``Á`` → ``A``),
   default-ignorable characters dropped (zero-width spaces and joiners, bidi
   controls, soft hyphens, variation selectors, tags, Hangul fillers: every
   format character ``Cf``) and its confusables folded to ASCII (:func:`fold`:
   the Unicode confusables data, ``confusables.txt`` of UTS #39, through the
   ``confusable-homoglyphs`` package);
3. **literals** (:func:`join_literals`): adjacent string literals joined into
   one (``"a" "b"``, ``'a' + 'b'``, ``"a" . "b"``, ``"a" .. "b"``, ``"a" || "b"``,
   ``"a" & "b"``, ``"a" ++ "b"``, ``"a" ~ "b"``, ``"a" <> "b"``, across lines and
   continuations, and the literal items of ``"".join([...])`` / ``[...].join("")``
   / ``concat(...)``): Python's own tokenizer for Python sources that tokenize,
   a line-bounded regular lexer otherwise.

Mapping (:meth:`View.span`): a character kept as it was maps to itself; a piece
put in place of a stretch of the parent (a decoded escape, a folded character,
the quote of a joined literal) maps to the whole stretch; removed characters are
covered when a detection spans them. A span's image is therefore never smaller
than what produced it: masking it removes every character of the secret.

Pure functions; no I/O. Cost is proportional to the text, with per-character
Python work only where the text is not plain ASCII or holds escapes.
"""

from __future__ import annotations

import functools
import html.entities
import io
import re
import tokenize
import unicodedata
from bisect import bisect_right
from collections.abc import Callable, Iterable

__all__ = ["View", "characters", "diff_bodies", "fold", "join_literals", "views"]


class View:
    """``text`` derived from ``parent`` (None: ``text`` is the original).

    Segments ``(start, parent_start, parent_len, same)`` cover ``text`` in order:
    a ``same`` segment is a verbatim copy of ``parent_len`` parent characters; any
    other maps as a whole to its ``parent_len`` parent characters."""

    __slots__ = ("_len", "_pstarts", "_same", "_starts", "parent", "text")

    def __init__(self, text: str, parent: View | None = None,
                 segments: Iterable[tuple[int, int, int, bool]] = ()) -> None:  # fmt: skip
        self.text = text
        self.parent = parent
        self._starts: list[int] = []
        self._pstarts: list[int] = []
        self._len: list[int] = []
        self._same: list[bool] = []
        for s, ps, n, same in segments:
            self._starts.append(s)
            self._pstarts.append(ps)
            self._len.append(n)
            self._same.append(same)

    def pieces(self, start: int, end: int) -> list[tuple[int, int]]:
        """The stretches ``[s, e)`` of the original text that produced this view's
        ``text[start:end]`` (``0 <= start < end <= len(text)``), in order, touching
        ones merged: characters the views removed between two produced pieces
        (the quotes and ``+`` between joined literals, a zero-width space) are
        not in them."""
        spans = [(start, end)]
        view: View = self
        while view.parent is not None:
            spans = [p for s, e in spans for p in view._parent_pieces(s, e)]
            view = view.parent
        merged: list[tuple[int, int]] = []
        for s, e in sorted(spans):
            if merged and s <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(e, merged[-1][1]))
            else:
                merged.append((s, e))
        return merged

    def _parent_pieces(self, start: int, end: int) -> Iterable[tuple[int, int]]:
        i = bisect_right(self._starts, start) - 1
        while i < len(self._starts) and self._starts[i] < end:
            s0, ps, n, same = self._starts[i], self._pstarts[i], self._len[i], self._same[i]
            if same:
                yield ps + max(start - s0, 0), ps + min(end - s0, n)
            elif n:
                yield ps, ps + n
            i += 1


class _Builder:
    """Writes a child view of ``parent``: :meth:`keep` copies parent text,
    :meth:`put` puts a piece in place of a parent stretch (empty: removes it)."""

    def __init__(self, parent: View) -> None:
        self.parent = parent
        self.src = parent.text
        self.parts: list[str] = []
        self.segs: list[list[int | bool]] = []
        self.pos = 0
        self.edits = 0

    def keep(self, start: int, end: int) -> None:
        if end <= start:
            return
        last = self.segs[-1] if self.segs else None
        if last is not None and last[3] and last[1] + last[2] == start and last[0] + last[2] == self.pos:  # type: ignore[operator]
            last[2] += end - start  # type: ignore[operator]
        else:
            self.segs.append([self.pos, start, end - start, True])
        self.parts.append(self.src[start:end])
        self.pos += end - start

    def put(self, text: str, start: int, end: int) -> None:
        if text == self.src[start:end]:
            self.keep(start, end)
            return
        self.edits += 1
        if text:
            self.segs.append([self.pos, start, end - start, False])
            self.parts.append(text)
            self.pos += len(text)

    def view(self) -> View:
        if not self.edits:
            return self.parent
        return View("".join(self.parts), self.parent, [tuple(s) for s in self.segs])  # type: ignore[misc]


def _sub(parent: View, pattern: re.Pattern[str],
         fn: Callable[[re.Match[str], _Builder], bool]) -> View:  # fmt: skip
    """A child view: every match of ``pattern`` is handed to ``fn``, which writes
    its replacement with the builder and returns True (or False: kept as is)."""
    b = _Builder(parent)
    pos = 0
    for m in pattern.finditer(parent.text):
        b.keep(pos, m.start())
        if not fn(m, b):
            b.keep(m.start(), m.end())
        pos = m.end()
    if not b.edits:
        return parent
    b.keep(pos, len(parent.text))
    return b.view()


# ---------------------------------------------------------------------- 1. diff bodies
_DIFF_PREFIX = re.compile(r"^[+ -]", re.MULTILINE)


def diff_bodies(view: View) -> View:
    """``view`` with each line's diff prefix (``+``, ``-`` or a space) dropped."""
    def drop(m: re.Match[str], b: _Builder) -> bool:
        b.put("", m.start(), m.end())
        return True

    return _sub(view, _DIFF_PREFIX, drop)


# ---------------------------------------------------------------------- 2. characters
#: Dropped although not format characters (``Cf``): Hangul fillers (``Lo``), which
#: render as nothing; combining marks (``Mn``/``Me``, variation selectors among
#: them) are dropped by category.
_INVISIBLE = frozenset("\u115f\u1160\u3164\uffa0")


@functools.cache
def _confusables() -> dict[str, str]:
    """Non-ASCII character → its ASCII look-alike, from the Unicode confusables
    data: the UTS #39 prototype, or — where the prototype's own look-alikes hold
    one of the character's case or digit class — that one (Cyrillic ``І`` → ``I``
    rather than the prototype ``l``)."""
    from confusable_homoglyphs import confusables

    data = confusables.confusables_data

    def ascii_of(ch: str) -> list[str]:
        return [e["c"] for e in data.get(ch, ()) if len(e["c"]) == 1 and "!" <= e["c"] <= "~"]

    out: dict[str, str] = {}
    for ch in data:
        if len(ch) != 1 or ch.isascii():
            continue
        direct = ascii_of(ch)
        if not direct:
            continue
        near = direct + [c for d in direct for c in ascii_of(d) if c not in direct]
        cat = unicodedata.category(ch)
        same = [c for c in near if unicodedata.category(c) == cat]
        out[ch] = same[0] if same else direct[0]
    return out


@functools.lru_cache(maxsize=65536)
def fold(ch: str) -> str:
    """One character as the detectors read it: NFKC, combining marks and
    default-ignorable characters dropped, confusables folded to ASCII; ``""``
    for an invisible character, ``ch`` itself when nothing applies."""
    if ch.isascii():
        return ch
    if ch in _INVISIBLE or unicodedata.category(ch) == "Cf":
        return ""
    table = _confusables()
    out = []
    for c in unicodedata.normalize("NFD", unicodedata.normalize("NFKC", ch)):
        if unicodedata.category(c) in ("Mn", "Me", "Cf") or c in _INVISIBLE:
            continue
        out.append(c if c.isascii() else table.get(c, c))
    return "".join(out)


_CHARS = re.compile(
    r"\\u\{([0-9A-Fa-f]{1,6})\}|\\u([0-9A-Fa-f]{4})|\\U([0-9A-Fa-f]{8})|\\x([0-9A-Fa-f]{2})"
    r"|\\([0-7]{3})|\\N\{([A-Za-z0-9 -]{2,88})\}|\\\r?\n"
    r"|&#([0-9]{1,7});|&#[xX]([0-9A-Fa-f]{1,6});|&([A-Za-z][A-Za-z0-9]{1,31};)"
    r"|%([0-9A-Fa-f]{2})|([^\x00-\x7f]+)")


def _decoded(m: re.Match[str]) -> str | None:
    """The character an escape stands for (None: not a character)."""
    hexa = m.group(1) or m.group(2) or m.group(3) or m.group(4) or m.group(8)
    try:
        if hexa:
            return chr(int(hexa, 16))
        if m.group(5):
            code = int(m.group(5), 8)
            return chr(code) if 0x20 <= code < 0x7F else None
        if m.group(6):
            return unicodedata.lookup(m.group(6))
        if m.group(7):
            return chr(int(m.group(7)))
    except (ValueError, KeyError, OverflowError):
        return None
    if m.group(9):
        return html.entities.html5.get(m.group(9))
    if m.group(10):
        code = int(m.group(10), 16)
        return chr(code) if 0x21 <= code < 0x7F else None
    return ""  # a line continuation


def _characters(m: re.Match[str], b: _Builder) -> bool:
    run = m.group(11)
    if run is None:
        decoded = _decoded(m)
        if decoded is None:
            return False
        b.put("".join(fold(c) for c in decoded), m.start(), m.end())
        return True
    base = m.start()
    for i, ch in enumerate(run):
        b.put(fold(ch), base + i, base + i + 1)
    return True


def characters(view: View) -> View:
    """``view`` with escapes decoded and characters folded (module docstring, 2);
    escapes are decoded twice over (``&amp;#x41;``, ``\\\\u0041``) at most."""
    once = _sub(view, _CHARS, _characters)
    if once is view or not any(c in once.text for c in "\\&%"):
        return once
    return _sub(once, _CHARS, _characters)


# ---------------------------------------------------------------------- 3. literals
# Possessive and bounded (a literal of at most MAX_LITERAL_CHARS characters): a line
# of unclosed quotes (`\"\"\"…`) costs linear time, never quadratic (every quote
# would otherwise scan to the line's end); a longer literal is scanned as written.
MAX_LITERAL_CHARS = 256
_LIT = (r"""(?:\b[rRbBuUfF]{1,2})?(?:"(?:[^"\\\n]|\\.){0,%d}+"|'(?:[^'\\\n]|\\.){0,%d}+'|`(?:[^`\\\n]|\\.){0,%d}+`)"""
        % ((MAX_LITERAL_CHARS,) * 3))
_GAP = r"[ \t\r\n\f\v]*+"
_OP = r"(?:\+\+|\+|\.\.|\.|\|\||&|~|<>)"
_RUN = re.compile(rf"{_LIT}(?:{_GAP}(?:{_OP}{_GAP})?{_LIT})+")
_LIST = re.compile(
    rf"(?:\b(?:join|Join|concat|Concat|strcat|implode)\s*\(\s*(?:{_LIT}\s*,\s*)?(?:\[\]\w+\s*)?[\[({{]?\s*"
    rf"{_LIT}(?:\s*,\s*{_LIT})+)"
    rf"|(?:\[\s*{_LIT}(?:\s*,\s*{_LIT})+\s*,?\s*\]\s*\.\s*join\b)")
_ONE = re.compile(_LIT)
_QUOTES = "\"'`"


def _content(lit: str, start: int) -> tuple[int, int]:
    """``[start, end)`` of a literal's characters between its quotes."""
    i = 0
    while lit[i] not in _QUOTES:
        i += 1
    return start + i + 1, start + len(lit) - 1


def _write_joined(b: _Builder, lits: list[tuple[int, int]]) -> None:
    """Put one double-quoted literal holding the contents of ``lits`` (their
    spans in the parent) in place of the parent's ``[lits[0] start, lits[-1] end)``."""
    src = b.src
    first_s, _ = _content(src[lits[0][0]:lits[0][1]], lits[0][0])
    b.put('"', lits[0][0], first_s)
    prev_end = None
    for s, e in lits:
        cs, ce = _content(src[s:e], s)
        if prev_end is not None:
            b.put("", prev_end, cs)
        b.keep(cs, ce)
        prev_end = ce
    b.put('"', prev_end, lits[-1][1])  # type: ignore[arg-type]


def _join_run(m: re.Match[str], b: _Builder) -> bool:
    base = m.start()
    lits = [(base + x.start(), base + x.end()) for x in _ONE.finditer(m.group(0))]
    if m.re is _LIST and _separator_first(m.group(0)):
        lits = lits[1:]
    if len(lits) < 2:
        return False
    b.keep(base, lits[0][0])
    _write_joined(b, lits)
    b.keep(lits[-1][1], m.end())
    return True


def _separator_first(call: str) -> bool:
    """``", ".join(...)``-style calls whose first literal is the separator:
    ``implode(",", [...])``, ``strings.Join(..., "")`` put it elsewhere."""
    return bool(re.match(r"(?:implode)\s*\(\s*['\"]", call))


def _regex_join(view: View) -> View:
    joined = _sub(view, _LIST, _join_run)
    return _sub(joined, _RUN, _join_run)


def _python_join(view: View) -> View | None:
    """Adjacent STRING tokens (implicit concatenation, ``+``, across brackets and
    continuations) joined, by Python's tokenizer; None if the text does not
    tokenize."""
    text = view.text
    starts = [0]
    for line in io.StringIO(text):  # the tokenizer's lines: cut at "\n" only
        starts.append(starts[-1] + len(line))
    groups: list[list[tuple[int, int]]] = []
    run: list[tuple[int, int]] = []
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type == tokenize.STRING:
                s = starts[tok.start[0] - 1] + tok.start[1]
                e = starts[tok.end[0] - 1] + tok.end[1]
                run.append((s, e))
                continue
            if tok.type in (tokenize.NL, tokenize.COMMENT) or (tok.type == tokenize.OP and tok.string == "+" and run):
                continue
            if len(run) >= 2:
                groups.append(run)
            run = []
    except (tokenize.TokenError, SyntaxError, IndentationError):
        return None
    if len(run) >= 2:
        groups.append(run)
    b = _Builder(view)
    pos = 0
    for g in groups:
        if any(text[s:e].count(q * 3) for s, e in g for q in "\"'"):
            continue  # triple-quoted pieces: their lines are scanned as they are
        b.keep(pos, g[0][0])
        _write_joined(b, g)
        pos = g[-1][1]
    if not b.edits:
        return view
    b.keep(pos, len(text))
    return b.view()


#: A quote, then blanks, a ``+``, a comment or a line break (at least one of them),
#: then a quote: where two Python literals may be adjacent (the tokenizer, a few µs
#: a token, runs only where this matches; ``x = ""`` does not).
_ADJACENT = re.compile(r"""["'](?=[ \t\n+#])[ \t]*+(?:#[^\n]*+)?[ \t\n]*+(?:\+[ \t\n]*+)?[rRbBuUfF]{0,2}["']""")

#: Python sources larger than this are lexed by the regular lexer (the tokenizer
#: costs a few µs a token).
MAX_TOKENIZE_CHARS = 256 * 1024


def join_literals(view: View, *, python: bool = False) -> View:
    """``view`` with adjacent string literals joined (module docstring, 3);
    ``python``: lex with :mod:`tokenize` first (a source that does not tokenize,
    such as a diff hunk, falls back to the regular lexer)."""
    if not any(q in view.text for q in _QUOTES):
        return view
    if python and len(view.text) <= MAX_TOKENIZE_CHARS:
        if _ADJACENT.search(view.text) is None:  # nothing for the tokenizer to join
            return _sub(view, _LIST, _join_run)
        joined = _python_join(view)
        if joined is not None:
            return _sub(joined, _LIST, _join_run)
    return _regex_join(view)


def views(text: str, *, diff: bool = False, python: bool = False) -> list[View]:
    """The views of ``text`` that differ from it, in order (characters, then
    literals joined), each mapping back to ``text``; empty when every view is
    the text itself (plain ASCII without escapes or joined literals, and not a
    diff)."""
    root = View(text)
    base = diff_bodies(root) if diff else root
    chars = characters(base)
    joined = join_literals(chars, python=python)
    out = []
    if chars is not base:
        out.append(chars)
    if joined is not chars:
        out.append(joined)
    return out
