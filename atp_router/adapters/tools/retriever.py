"""A retriever next-hop (spec §15.3 "Retriever"): BM25 over a folder of documents
with SQLite FTS5, answering with citations.

A ``retrieval_qa`` task is ``content = {"question": str, "docs": str (optional)}``:

* ``question``: at most :attr:`RetrieverLimits.max_question_chars` characters;
* ``docs``: an absolute directory on the router's host holding the corpus. It
  must lie (after resolving symlinks) inside one of the adapter's ``roots``;
  without it the adapter's own ``docs`` directory is searched.

The corpus is every regular file under the directory with one of ``suffixes``
(default ``.md .markdown .txt .rst``), hidden files and folders skipped, read as
UTF-8. A symlink is followed only when its target stays inside the directory;
paths never leave it. Each document is cut into passages: sections start at a
markdown heading (``#`` …), and a section longer than ``chunk_lines`` lines is
windowed by ``chunk_lines`` with ``overlap`` lines shared. A passage carries its
file (POSIX path relative to the corpus root), first and last line (1-based,
inclusive) and its section heading (indexed with a weight of 2).

The index (an in-memory FTS5 table, ``porter unicode61`` tokenizer) is built once
per corpus directory and kept (the last :data:`CACHE_SIZE` directories); every
task re-lists the folder (names, sizes, mtimes) and rebuilds the index when that
listing changed.

The report (``AgentReport``):

* ``findings``: the top ``k`` passages by FTS5 ``bm25()``, best first; each is a
  citation: ``file``/``start``/``end`` the passage, ``claim`` the snippet (the
  passage text, whitespace folded, at most :data:`SNIPPET_CHARS` characters),
  ``severity`` info, ``rule`` :data:`~atp_router.consensus.escalation.CITATION_RULE`,
  ``ref`` the rank, ``confidence`` the citation's strength: the share of the
  question's terms the passage contains × its BM25 score relative to the best
  passage's × ``min(1, best score / min_score)`` (1.0 for a passage holding
  every term at the top score, when that score is not weak);
* ``summary``: an extractive answer: the passage lines that hold most of the
  question's terms, each followed by its citation ``[file:start-end]``;
* ``confidence``: the strength of the best citation. Escalation triggers
  ``weak_citations`` (on the best citation) and ``low_conf`` fire on it.

Limits (:class:`RetrieverLimits`, RIB ``options``): ``max_docs`` (2,000 files
indexed; the rest, in path order, are skipped), ``max_doc_bytes`` (1 MiB; a larger
file is skipped), ``max_total_bytes`` (64 MiB over the corpus; files past it are
skipped), ``max_question_chars`` (2,000). Skips are named in the summary's
last line.

Errors: a question missing, empty, too long or without a searchable term, a
``docs`` that is not an absolute directory inside ``roots`` → ``ClientInputError``
(``EPROTO``, the client's fault); the adapter's own ``docs`` directory missing →
``AgentError(EAGENTDOWN)``. Costs nothing (zero tokens and USD).

Why it runs in a worker thread of the router and not in the sandbox of
:mod:`atp_router.adapters.tools.sandbox` (issue 19): it executes nothing of the
tenant's. The tenant sends a question (at most ``max_question_chars``, used only
as quoted FTS5 phrases, never as query syntax) and at most names a directory,
which must lie inside the operator's ``roots``; the files there are read as text,
cut into passages by regular expressions and indexed by SQLite's FTS5 in memory,
all within :class:`RetrieverLimits`. Nothing is parsed as code, imported or run.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import re
import sqlite3
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from atp_router.adapters.base import CallStats
from atp_router.adapters.tools.base import InThreadToolAdapter, confined_dir
from atp_router.consensus.escalation import CITATION_RULE
from atp_router.consensus.types import AgentFinding, AgentReport, Severity
from atp_router.wire.errors import ClientInputError

__all__ = [
    "CACHE_SIZE",
    "DEFAULT_SUFFIXES",
    "SNIPPET_CHARS",
    "Corpus",
    "Passage",
    "RetrieverAdapter",
    "RetrieverLimits",
    "chunk",
    "query_terms",
]

KiB = 1024
MiB = 1024 * KiB

#: Corpus directories whose index is kept at once.
CACHE_SIZE = 8
#: Characters of a passage kept in a citation's ``claim``.
SNIPPET_CHARS = 600
DEFAULT_SUFFIXES: tuple[str, ...] = (".md", ".markdown", ".txt", ".rst")

_HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
#: A numbered section title at the start of a line in plain text (``5.2. Canonicalization Rules``).
_TEXT_HEADING = re.compile(r"^((?:\d+\.)+\d*)\s+([A-Z][^.]{0,78})$")
_WORD = re.compile(r"[A-Za-z0-9][A-Za-z0-9_'-]*")
#: Question words that carry no topic.
STOPWORDS = frozenset(
    """a about above after again against all also am an and any are as at be because been before being below
    between both but by can could did do does doing down during each few for from further had has have having he
    her here hers how i if in into is it its itself just me more most my no nor not now of off on once only or
    other our ours out over own same she should so some such than that the their theirs them then there these
    they this those through to too under until up very was we were what when where which while who whom why will
    with would you your yours s t don explain describe tell give mean means meaning does did say says said""".split()  # noqa: SIM905
)


@dataclass(frozen=True, slots=True)
class RetrieverLimits:
    """Bounds of one retriever (module docstring): file counts and sizes in
    bytes, the question in characters. Raises ``ValueError`` naming the field
    when one is not a positive whole number."""

    max_docs: int = 2_000
    max_doc_bytes: int = 1 * MiB
    max_total_bytes: int = 64 * MiB
    max_question_chars: int = 2_000

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"options.{f.name}: must be a positive whole number, got {value!r:.40}")


@dataclass(frozen=True, slots=True)
class Passage:
    """One indexed passage: ``file`` relative to the corpus root (POSIX),
    ``start``/``end`` 1-based inclusive lines, its section ``heading`` and ``text``."""

    file: str
    start: int
    end: int
    heading: str
    text: str


def chunk(path: str, text: str, *, chunk_lines: int, overlap: int) -> list[Passage]:
    """``text`` (the document ``path``) cut into passages: a new section at every
    markdown heading (in a ``.txt``/``.rst`` file: at every numbered title such
    as ``5.2. Canonicalization Rules`` at the start of a line), sections longer
    than ``chunk_lines`` windowed with ``overlap`` shared lines. Blank-only
    passages are dropped. Lines are 1-based."""
    lines = text.splitlines()
    pattern = _HEADING if path.lower().endswith((".md", ".markdown")) else _TEXT_HEADING
    sections: list[tuple[int, int, str]] = []  # (first index, end index exclusive, heading)
    start, heading = 0, ""
    in_fence = False
    for i, line in enumerate(lines):
        if line.lstrip().startswith("```"):
            in_fence = not in_fence
        m = None if in_fence else pattern.match(line)
        if m and i > start:
            sections.append((start, i, heading))
            start = i
        if m:
            heading = m.group(2).strip()
    sections.append((start, len(lines), heading))
    step = max(1, chunk_lines - overlap)
    out: list[Passage] = []
    for first, stop, head in sections:
        i = first
        while i < stop:
            j = min(stop, i + chunk_lines)
            # Trim blank lines at both ends, so the cited span is the text itself.
            a, b = i, j
            while a < b and not lines[a].strip():
                a += 1
            while b > a and not lines[b - 1].strip():
                b -= 1
            if a < b:
                out.append(Passage(path, a + 1, b, head, "\n".join(lines[a:b])))
            if j >= stop:
                break
            i += step
    return out


def query_terms(question: str) -> list[str]:
    """The searchable terms of ``question``: words of 2+ characters, lowercased,
    stop words dropped, in first-seen order."""
    seen: dict[str, None] = {}
    for w in _WORD.findall(question):
        w = w.lower().strip("'-")
        if len(w) >= 2 and w not in STOPWORDS:
            seen.setdefault(w, None)
    return list(seen)


def _fts_phrase(term: str) -> str:
    return '"' + term.replace('"', '""') + '"'


class Corpus:
    """The FTS5 index of one corpus directory. :meth:`search` is thread-safe
    (one lock per corpus). Build with :meth:`build`."""

    def __init__(self, root: str, fingerprint: str, passages: list[Passage], skipped: list[str]):
        self.root = root
        self.fingerprint = fingerprint
        self.passages = passages
        self.skipped = skipped
        self.files = len({p.file for p in passages})
        self._lock = threading.Lock()
        self._db = sqlite3.connect(":memory:", check_same_thread=False)
        self._db.execute("CREATE VIRTUAL TABLE p USING fts5(heading, body, tokenize='porter unicode61')")
        self._db.executemany(
            "INSERT INTO p(rowid, heading, body) VALUES (?, ?, ?)",
            ((i, p.heading, p.text) for i, p in enumerate(passages)),
        )
        self._db.commit()

    @classmethod
    def build(cls, root: str, *, suffixes: Sequence[str], chunk_lines: int, overlap: int,
              limits: RetrieverLimits) -> Corpus:
        """Read and index ``root`` (an existing directory, resolved). Files are
        taken in path order within the limits; what is skipped is listed in
        :attr:`skipped` (``"path: reason"``)."""
        listing, skipped = list_corpus(root, suffixes=suffixes, limits=limits)
        passages: list[Passage] = []
        for rel, full, _size, _mtime in listing:
            try:
                with open(full, encoding="utf-8", errors="replace") as fh:
                    text = fh.read(limits.max_doc_bytes + 1)
            except OSError as e:
                skipped.append(f"{rel}: unreadable ({e.strerror})")
                continue
            passages.extend(chunk(rel, text, chunk_lines=chunk_lines, overlap=overlap))
        return cls(root, fingerprint(listing), passages, skipped)

    def frequencies(self, terms: Sequence[str]) -> dict[str, int]:
        """How many passages hold each of ``terms`` (stemmed as the index stems)."""
        with self._lock:
            return {t: self._db.execute("SELECT count(*) FROM p WHERE p MATCH ?", (_fts_phrase(t),)).fetchone()[0]
                    for t in terms}

    def search(self, terms: Sequence[str], k: int) -> list[tuple[Passage, float, int]]:
        """The best ``k`` passages for ``terms`` (any of them), best first, as
        ``(passage, bm25 strength > 0 (higher is better), number of terms it holds)``."""
        if not terms or not self.passages:
            return []
        query = " OR ".join(_fts_phrase(t) for t in terms)
        with self._lock:
            rows = self._db.execute(
                "SELECT rowid, bm25(p, 2.0, 1.0) AS s FROM p WHERE p MATCH ? ORDER BY s LIMIT ?", (query, k)
            ).fetchall()
            if not rows:
                return []
            ids = [r[0] for r in rows]
            marks = ",".join("?" * len(ids))
            held: dict[int, int] = dict.fromkeys(ids, 0)
            for t in terms:
                for (rid,) in self._db.execute(
                    f"SELECT rowid FROM p WHERE p MATCH ? AND rowid IN ({marks})", (_fts_phrase(t), *ids)
                ):
                    held[rid] += 1
        return [(self.passages[rid], -score, held[rid]) for rid, score in rows]


def list_corpus(root: str, *, suffixes: Sequence[str],
                limits: RetrieverLimits) -> tuple[list[tuple[str, str, int, int]], list[str]]:
    """The documents under ``root``: ``[(relative POSIX path, full path, size in
    bytes, mtime ns)]`` in path order, within ``limits``, and the skipped ones
    (``"path: reason"``). Hidden entries are skipped; a symlink whose target
    leaves ``root`` is skipped."""
    real_root = os.path.realpath(root)
    found: list[tuple[str, str, int, int]] = []
    for dirpath, dirnames, filenames in os.walk(real_root, followlinks=False):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in filenames:
            if name.startswith(".") or not name.lower().endswith(tuple(suffixes)):
                continue
            full = os.path.join(dirpath, name)
            real = os.path.realpath(full)
            rel = Path(os.path.relpath(full, real_root)).as_posix()
            if os.path.commonpath([real, real_root]) != real_root:
                continue  # a symlink out of the corpus: never read
            try:
                st = os.stat(real)
            except OSError:
                continue
            if not os.path.isfile(real):
                continue
            found.append((rel, real, st.st_size, st.st_mtime_ns))
    found.sort()
    out: list[tuple[str, str, int, int]] = []
    skipped: list[str] = []
    total = 0
    for rel, real, size, mtime in found:
        if size > limits.max_doc_bytes:
            skipped.append(f"{rel}: {size:,} bytes, over max_doc_bytes={limits.max_doc_bytes:,}")
        elif len(out) >= limits.max_docs:
            skipped.append(f"{rel}: past max_docs={limits.max_docs:,}")
        elif total + size > limits.max_total_bytes:
            skipped.append(f"{rel}: past max_total_bytes={limits.max_total_bytes:,}")
        else:
            total += size
            out.append((rel, real, size, mtime))
    return out, skipped


def fingerprint(listing: Iterable[tuple[str, str, int, int]]) -> str:
    """A digest of a corpus listing (paths, sizes, mtimes): equal while the folder is unchanged."""
    h = hashlib.sha256()
    for rel, _full, size, mtime in listing:
        h.update(f"{rel}\0{size}\0{mtime}\n".encode("utf-8", "surrogateescape"))
    return h.hexdigest()


class RetrieverAdapter(InThreadToolAdapter):
    """BM25 retriever next-hop (module docstring).

    ``docs``: the default corpus directory (must exist); ``roots``: directories
    a task may choose its corpus under with ``content.docs`` (default: ``docs``
    alone; relative paths are the router's working directory's); ``k`` passages
    per answer (1..50); ``chunk_lines`` (3..400) and ``overlap`` (0 ≤ overlap <
    chunk_lines) shape the passages; ``min_score``: the BM25 strength under
    which the best match counts as weak (≥ 0); ``suffixes``: document file
    endings; ``limits``: :class:`RetrieverLimits`. Raises ``ValueError`` naming
    the option for a value out of range or a ``docs`` that is not a directory.
    """

    tool = "retriever"

    def __init__(
        self,
        name: str = "retriever",
        *,
        docs: str,
        roots: Iterable[str] | None = None,
        k: int = 5,
        chunk_lines: int = 12,
        overlap: int = 4,
        min_score: float = 2.0,
        suffixes: Iterable[str] = DEFAULT_SUFFIXES,
        strengths: Iterable[str] | None = None,
        limits: RetrieverLimits | None = None,
    ) -> None:
        if not 1 <= k <= 50:
            raise ValueError(f"options.k: must be 1..50 passages, got {k}")
        if not 3 <= chunk_lines <= 400:
            raise ValueError(f"options.chunk_lines: must be 3..400 lines, got {chunk_lines}")
        if not 0 <= overlap < chunk_lines:
            raise ValueError(f"options.overlap: must be 0 ≤ overlap < chunk_lines ({chunk_lines}), got {overlap}")
        if min_score < 0:
            raise ValueError(f"options.min_score: must be >= 0, got {min_score}")
        self.suffixes = tuple(s.lower() for s in suffixes)
        if not self.suffixes or not all(s.startswith(".") and len(s) > 1 for s in self.suffixes):
            raise ValueError("options.suffixes: must list file endings such as '.md'")
        self.docs = os.path.realpath(docs)
        if not os.path.isdir(self.docs):
            raise ValueError(f"options.docs: not a directory: {docs}")
        self.roots = [os.path.realpath(r) for r in (roots if roots is not None else [docs])]
        self.name = name
        self.k = k
        self.chunk_lines = chunk_lines
        self.overlap = overlap
        self.min_score = float(min_score)
        self.strengths = list(strengths) if strengths else ["retrieval_qa", "retrieval", "citations"]
        self.limits = limits or RetrieverLimits()
        self._cache: OrderedDict[str, Corpus] = OrderedDict()
        self._cache_lock = threading.Lock()
        self._stats = CallStats()
        #: Times an index was built (tests and metrics).
        self.builds = 0

    def work(self, content: Any) -> AgentReport:
        """:meth:`answer` (the :class:`InThreadToolAdapter` hook)."""
        return self.answer(content)

    # -- the work (blocking; run in a worker thread) -------------------------------

    def corpus_root(self, content: Mapping[str, Any]) -> str:
        """The corpus directory a task asks for (resolved). Raises
        ``ClientInputError`` for a ``docs`` that is not an absolute directory
        inside ``roots``."""
        return confined_dir(content.get("docs"), field="docs", default=self.docs, roots=self.roots, who="retriever")

    def corpus(self, root: str) -> Corpus:
        """The index of ``root``, built on first use and again when its listing changed."""
        listing, _ = list_corpus(root, suffixes=self.suffixes, limits=self.limits)
        fp = fingerprint(listing)
        with self._cache_lock:
            cached = self._cache.get(root)
            if cached is not None and cached.fingerprint == fp:
                self._cache.move_to_end(root)
                return cached
        built = Corpus.build(root, suffixes=self.suffixes, chunk_lines=self.chunk_lines, overlap=self.overlap,
                             limits=self.limits)
        with self._cache_lock:
            self.builds += 1
            self._cache[root] = built
            self._cache.move_to_end(root)
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return built

    def answer(self, content: Any) -> AgentReport:
        """The report for one task's ``content`` (module docstring). Blocking."""
        if not isinstance(content, Mapping):
            raise ClientInputError("content must be an object with 'question'")
        question = content.get("question")
        if not isinstance(question, str) or not question.strip():
            raise ClientInputError("content.question must be a non-empty string")
        if len(question) > self.limits.max_question_chars:
            raise ClientInputError(
                f"content.question is {len(question):,} characters, over max_question_chars="
                f"{self.limits.max_question_chars:,}"
            )
        terms = query_terms(question)
        if not terms:
            raise ClientInputError("content.question has no searchable term")
        corpus = self.corpus(self.corpus_root(content))
        hits = corpus.search(terms, self.k)
        notes = []
        if corpus.skipped:
            notes.append(f"skipped {len(corpus.skipped)} document(s): " + "; ".join(corpus.skipped[:3]))
        if not hits:
            summary = f"No passage of the {corpus.files} document(s) matches the question."
            return AgentReport(findings=[], summary="\n".join([summary, *notes]), confidence=0.0)
        top = hits[0][1]
        # A best match under min_score is weak: every citation's strength scales down with it.
        weak = min(1.0, top / self.min_score) if self.min_score > 0 else 1.0
        findings = []
        for rank, (p, score, held) in enumerate(hits, 1):
            strength = (held / len(terms)) * (score / top if top > 0 else 0.0) * weak
            findings.append(AgentFinding(
                file=p.file, start=p.start, end=p.end, severity=Severity.INFO,
                claim=_snippet(p.text), confidence=round(min(1.0, strength), 4), ref=str(rank), rule=CITATION_RULE,
            ))
        confidence = findings[0].confidence
        n = len(corpus.passages)
        weights = {_stem(t): math.log(1 + n / (1 + df)) for t, df in corpus.frequencies(terms).items()}
        lines = _answer_lines([h[0] for h in hits], weights)
        summary = " ".join(f"{text} [{p.file}:{n}-{n}]" for p, n, text in lines)
        return AgentReport(findings=findings, summary="\n".join([summary, *notes]), confidence=round(confidence, 4))


def _snippet(text: str) -> str:
    folded = " ".join(text.split())
    return folded if len(folded) <= SNIPPET_CHARS else folded[: SNIPPET_CHARS - 1].rsplit(" ", 1)[0] + "…"


def _stem(word: str) -> str:
    return word[:5] if len(word) > 5 else word


def _answer_lines(passages: Sequence[Passage], weights: Mapping[str, float], *,
                  most: int = 2) -> list[tuple[Passage, int, str]]:
    """The ``most`` distinct lines of the best passages (the first two) holding
    the most question terms weighted by ``weights`` (term stem → IDF; a 5-letter
    prefix match stands in for stemming), as ``(passage, line number, text)``,
    best first; ties go to the earlier passage and line."""
    scored: list[tuple[float, int, int, Passage, str]] = []
    for pi, p in enumerate(passages[:2]):
        for off, line in enumerate(p.text.splitlines()):
            text = line.strip().lstrip("#*->|").strip()
            if len(text) < 3 or text.startswith("```"):
                continue
            words = {_stem(w.lower()) for w in _WORD.findall(text)}
            held = sum(w for t, w in weights.items() if t in words)
            if held:
                scored.append((-held, pi, off, p, text))
    scored.sort(key=lambda s: s[:3])
    out: list[tuple[Passage, int, str]] = []
    for _, _, off, p, text in scored:
        where = (p.file, p.start + off)
        if all((q.file, n) != where for q, n, _ in out):
            out.append((p, p.start + off, text))
        if len(out) == most:
            break
    return out
