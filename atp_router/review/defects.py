"""Defect classes: what a finding claims and what a golden task's defect is, in
one vocabulary, so ``atp-router eval`` can count a catch only when it is made for
the right reason (issue 23 item 2).

The golden format (``shared/golden/README.md``) gives each expected defect a
``claim`` (BugsInPy: the fix's subject line; advisories: the advisory's words,
often with its CWE) and no category field, so the categories are defined here,
:data:`CATEGORIES`, and a defect's class is read from, in order:

1. its ``category`` field, when a task file carries one (a name of :data:`CATEGORIES`);
2. its ``cwe`` field, or a ``CWE-<n>`` in its claim, through :data:`CWE_CATEGORY`;
3. the words of its claim (:data:`CLAIM_WORDS`, the first category whose words match);
4. otherwise ``logic``: a bug-fix commit whose subject names no class fixed wrong
   behaviour (what BugsInPy's tasks are).

A finding's class is read from, in order: its analyser's rule through
:data:`RULE_CATEGORY` (exact code, else the longest listed prefix); its CWE
through :data:`CWE_CATEGORY`; the words of its claim (:data:`CLAIM_WORDS`; the
documented fallback for a model's finding or an unlisted rule); else ``None``
(no class: never a right-reason catch).

The tables were written from each analyser's own rule documentation (ruff's rule
pages, bandit's test list with its CWE per test, pylint's message list, mypy's
error-code list, the shipped semgrep rules' messages and ``metadata.cwe``) and
MITRE's CWE titles: what each rule detects, a priori, not from where the rules
fire on the golden tasks. A finding is a right-reason catch of an expected defect
when it matches it by line (:func:`atp_router.review.eval.matches`) and the two
classes are equal; ``maintainability`` is no defect class, so a style or
dead-code finding is never one. Pure data and functions, no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

__all__ = [
    "CATEGORIES",
    "CLAIM_WORDS",
    "CWE_CATEGORY",
    "RULE_CATEGORY",
    "claim_category",
    "cwe_category",
    "defect_category",
    "finding_category",
    "rule_category",
]

#: The defect categories: name → what belongs to it.
CATEGORIES: dict[str, str] = {
    "injection": "untrusted data reaches an interpreter: OS command, SQL, code (eval/exec), template/HTML, "
                 "HTTP header or CRLF injection",
    "redos": "regular expressions with catastrophic (exponential or polynomial) backtracking",
    "deserialization": "loading untrusted data with code-running formats (pickle, shelve, marshal, unsafe YAML)",
    "xml": "XML parsers open to external entities or entity expansion",
    "tls": "TLS certificate or host-name verification missing, off, or an obsolete protocol version",
    "crypto": "weak or misused cryptography: broken hashes and ciphers, weak keys, predictable randomness "
              "for secrets, signature or key confusion, timing-unsafe comparison",
    "exposure": "sensitive information sent or shown where it should not be: leaked headers and credentials, "
                "cleartext protocols, debug interfaces, binding every interface",
    "secrets": "credentials written into the code",
    "filesystem": "file-system paths and files: traversal, insecure temporary files, permissions, archive members",
    "resource": "uncontrolled resource use: no timeout, unbounded allocation, leaked processes or descriptors",
    "auth": "authentication or authorisation missing or bypassable",
    "validation": "input accepted without the validation its use needs (no more specific class)",
    "name": "a name used where it is not bound: undefined, used before assignment, shadowed by a redefinition",
    "type": "an operation applied to the wrong type: wrong attribute, argument, call or format arguments",
    "error_handling": "exceptional conditions unchecked or mishandled: unchecked results that raise, "
                      "swallowed or over-broad exceptions",
    "syntax": "code that does not compile",
    "logic": "wrong behaviour on valid input: wrong value, condition, comparison, regex meaning or platform "
             "assumption",
    "maintainability": "no defect: style, dead code, unused names, complexity (never a right-reason catch)",
}

#: CWE number → category (MITRE's CWE titles).
CWE_CATEGORY: dict[int, str] = {
    **dict.fromkeys((74, 75, 77, 78, 79, 80, 88, 89, 90, 91, 93, 94, 95, 96, 113, 116, 117, 643, 838, 917, 1336),
                    "injection"),
    **dict.fromkeys((1333, 407), "redos"),
    **dict.fromkeys((502,), "deserialization"),
    **dict.fromkeys((611, 776, 827), "xml"),
    **dict.fromkeys((295, 297, 322, 599), "tls"),
    **dict.fromkeys((208, 326, 327, 328, 330, 331, 335, 338, 347, 345, 916, 759, 760, 1204, 1240), "crypto"),
    **dict.fromkeys((200, 201, 209, 212, 215, 319, 359, 497, 532, 538, 605, 668), "exposure"),
    **dict.fromkeys((259, 321, 798), "secrets"),
    **dict.fromkeys((22, 23, 36, 59, 73, 276, 377, 378, 379, 732), "filesystem"),
    **dict.fromkeys((400, 401, 404, 674, 770, 772, 775, 834, 835, 1088), "resource"),
    **dict.fromkeys((284, 285, 287, 290, 306, 352, 384, 613, 639, 862, 863), "auth"),
    **dict.fromkeys((20, 1284, 1287), "validation"),
    **dict.fromkeys((456, 457), "name"),
    **dict.fromkeys((628, 686, 704, 843), "type"),
    **dict.fromkeys((125, 129, 248, 252, 253, 390, 391, 392, 396, 397, 476, 690, 703, 754, 755), "error_handling"),
    **dict.fromkeys((185, 186, 480, 481, 482, 483, 570, 571, 595, 597, 625, 670, 682, 697, 1023, 1077, 589),
                    "logic"),
    **dict.fromkeys((561, 563, 1164), "maintainability"),
}

#: bandit test id → category (bandit's test list and the CWE it gives each test).
_BANDIT: dict[str, str] = {
    "B101": "error_handling", "B102": "injection", "B103": "filesystem", "B104": "exposure",
    "B105": "secrets", "B106": "secrets", "B107": "secrets", "B108": "filesystem",
    "B110": "error_handling", "B112": "error_handling", "B113": "resource",
    "B201": "injection", "B202": "filesystem",
    "B301": "deserialization", "B302": "deserialization", "B303": "crypto", "B304": "crypto", "B305": "crypto",
    "B306": "filesystem", "B307": "injection", "B308": "injection", "B309": "tls", "B310": "filesystem",
    "B311": "crypto", "B312": "exposure", "B313": "xml", "B314": "xml", "B315": "xml", "B316": "xml",
    "B317": "xml", "B318": "xml", "B319": "xml", "B320": "xml", "B321": "exposure", "B323": "tls",
    "B324": "crypto", "B325": "filesystem",
    "B401": "exposure", "B402": "exposure", "B403": "deserialization", "B404": "injection", "B405": "xml",
    "B406": "xml", "B407": "xml", "B408": "xml", "B409": "xml", "B410": "xml", "B411": "xml",
    "B412": "injection", "B413": "crypto", "B415": "exposure",
    "B501": "tls", "B502": "tls", "B503": "tls", "B504": "tls", "B505": "crypto", "B506": "deserialization",
    "B507": "tls", "B508": "crypto", "B509": "crypto",
    "B601": "injection", "B602": "injection", "B603": "injection", "B604": "injection", "B605": "injection",
    "B606": "injection", "B607": "injection", "B608": "injection", "B609": "injection", "B610": "injection",
    "B611": "injection", "B612": "injection", "B613": "injection", "B614": "deserialization",
    "B701": "injection", "B702": "injection", "B703": "injection", "B704": "injection",
}

#: pylint message id (or prefix) → category (pylint's message list).
_PYLINT: dict[str, str] = {
    "C": "maintainability", "R": "maintainability", "I": "maintainability",
    "R0123": "logic", "R0124": "logic", "R0133": "logic",  # is-literal, comparison with itself / of constants
    "E0001": "syntax", "E01": "syntax", "E0102": "name",  # bad syntax constructs; function-redefined
    "E0601": "name", "E0602": "name", "E0603": "name", "E0604": "type", "E0605": "type", "E0611": "name",
    "E0633": "type", "E0643": "error_handling", "E0701": "error_handling", "E0702": "type", "E0704": "syntax",
    "E0710": "type", "E0711": "type", "E0712": "type",
    "E1": "type",  # no-member, not-callable, call arguments, unsupported operations, format/logging arguments
    "E1111": "type", "E1128": "type", "E1141": "type",
    "E2": "syntax",  # bad characters and encodings in the source
    "E4": "name",  # import resolution
    "W0101": "logic", "W0104": "logic", "W0106": "logic", "W0102": "logic", "W0109": "logic",
    "W0120": "logic", "W0123": "injection", "W0122": "injection", "W0124": "logic", "W0125": "logic",
    "W0126": "logic", "W0127": "logic", "W0128": "logic", "W0129": "logic", "W0130": "logic",
    "W0143": "logic", "W0150": "error_handling", "W0177": "logic", "W0199": "logic",
    "W0611": "maintainability", "W0612": "maintainability", "W0613": "maintainability",
    "W0614": "maintainability", "W0401": "maintainability", "W0404": "name", "W0621": "maintainability",
    "W0622": "maintainability", "W0631": "name", "W0640": "logic", "W0641": "maintainability",
    "W0642": "logic",
    "W07": "error_handling",  # bare/broad except, raise-missing-from, try-except-raise, wrong exception ops
    "W1113": "logic", "W1114": "logic", "W1116": "type",
    "W12": "maintainability",  # logging format style
    "W13": "type",  # format strings and their arguments
    "W1309": "maintainability",
    "W1401": "logic",  # anomalous backslash: an escape that is not one (often a regex)
    "W1404": "logic",  # implicit string concatenation: a missing comma
    "W1501": "filesystem", "W1503": "logic", "W1507": "logic", "W1508": "type", "W1509": "resource",
    "W1510": "error_handling", "W1514": "logic", "W1515": "maintainability", "W1518": "logic",
    "W2": "maintainability", "W3": "maintainability", "W4": "maintainability", "W05": "maintainability",
    "W0107": "maintainability", "W0108": "maintainability", "W0105": "maintainability",
    "W0201": "maintainability", "W0212": "maintainability", "W0221": "type", "W0222": "type",
    "W0223": "type", "W0231": "logic", "W0233": "logic", "W0236": "type",
    "W06": "maintainability",
}

#: ruff rule code (or prefix) → category (ruff's rule pages; ``S`` and ``PL`` rules are
#: ports of bandit and pylint checks and are read through those tables).
_RUFF: dict[str, str] = {
    "invalid-syntax": "syntax", "E9": "syntax", "E": "maintainability", "W": "maintainability",
    "E711": "logic", "E712": "logic", "E721": "type", "E722": "error_handling",
    "F": "maintainability", "F5": "type", "F50": "type", "F52": "type", "F541": "maintainability",
    "F601": "logic", "F602": "logic", "F631": "logic", "F632": "logic", "F633": "logic", "F634": "logic",
    "F7": "syntax", "F811": "name", "F821": "name", "F822": "name", "F823": "name", "F82": "name",
    "F401": "maintainability", "F403": "maintainability", "F405": "name", "F841": "maintainability",
    "F842": "maintainability", "F901": "type", "F402": "name",
    "B": "logic",  # bugbear: likely bugs
    "B001": "error_handling", "B011": "error_handling", "B012": "error_handling", "B013": "error_handling",
    "B014": "error_handling", "B017": "error_handling", "B025": "error_handling", "B029": "error_handling",
    "B030": "error_handling", "B904": "error_handling", "B028": "maintainability", "B009": "maintainability",
    "B010": "maintainability", "B007": "maintainability", "B027": "maintainability", "B024": "maintainability",
    "BLE": "error_handling", "TRY": "error_handling", "S110": "error_handling", "S112": "error_handling",
    "YTT": "logic", "T10": "maintainability", "ISC001": "logic", "PGH005": "logic", "RUF006": "logic",
    "DTZ": "logic", "ASYNC": "resource", "PERF": "maintainability", "SIM": "maintainability",
    "UP": "maintainability", "N": "maintainability", "D": "maintainability", "I": "maintainability",
    "C4": "maintainability", "C90": "maintainability", "ARG": "maintainability", "ERA": "maintainability",
    "RET": "maintainability", "PIE": "maintainability", "PT": "maintainability", "Q": "maintainability",
    "COM": "maintainability", "ANN": "maintainability", "T20": "maintainability", "PTH": "maintainability",
}

#: mypy error code → category (mypy's list of error codes).
_MYPY: dict[str, str] = {
    "name-defined": "name", "used-before-def": "name", "possibly-undefined": "name", "no-redef": "name",
    "syntax": "syntax", "top-level-await": "syntax", "await-not-async": "syntax",
    "unreachable": "logic", "comparison-overlap": "logic", "redundant-expr": "logic", "truthy-bool": "logic",
    "truthy-function": "logic", "truthy-iterable": "logic", "unused-coroutine": "logic",
    "unused-awaitable": "logic", "empty-body": "logic",
    "import": "name", "import-not-found": "name", "import-untyped": "maintainability",
    "var-annotated": "maintainability", "annotation-unchecked": "maintainability",
    "unused-ignore": "maintainability", "redundant-cast": "maintainability", "no-untyped-def": "maintainability",
    "no-untyped-call": "maintainability", "no-any-return": "maintainability", "no-any-unimported": "maintainability",
    "ignore-without-code": "maintainability", "type-arg": "maintainability", "explicit-override": "maintainability",
    "deprecated": "maintainability", "redundant-self": "maintainability", "unimported-reveal": "maintainability",
    "misc": "",  # mypy's catch-all: no class from the code alone (the claim decides)
}
_MYPY_DEFAULT = "type"  # every other mypy code is a type error (attr-defined, arg-type, call-arg, index, …)

#: The shipped semgrep rules (atp_router/adapters/tools/semgrep_rules/*.yaml) by id;
#: rules carrying ``metadata.cwe`` are read through it, so only those without are listed.
_SEMGREP: dict[str, str] = {
    "path-list-split-on-hardcoded-separator": "logic",
    "path-list-joined-on-hardcoded-separator": "logic",
    "split-on-single-space": "logic",
    "identity-comparison-with-literal": "logic",
    "path-join-absolute-component": "logic",
    "popen-pipe-read-without-reaping": "resource",
    "regex-flags-as-count": "logic",
}

#: The pytest next-hop (``tool: pytest``, alias ``tests``): a failing test shows
#: the code behaving other than its test expects on the test's own (valid) input —
#: wrong behaviour, whatever exception carried it (issue 23 item 4).
_PYTEST: dict[str, str] = {"test_fail": "logic"}

#: analyser → rule code (or prefix) → category.
RULE_CATEGORY: dict[str, dict[str, str]] = {
    "bandit": _BANDIT, "pylint": _PYLINT, "ruff": _RUFF, "mypy": _MYPY, "semgrep": _SEMGREP,
    "pytest": _PYTEST, "tests": _PYTEST,
}

#: category → claim words (regular expressions on the lower-cased claim); the first
#: category in this order whose words match is the claim's class.
CLAIM_WORDS: dict[str, tuple[str, ...]] = {
    "redos": (r"\bredos\b", r"backtracking", r"regular expression denial", r"inefficient regular expression"),
    "injection": (r"injection", r"\bcrlf\b", r"shell\s*=\s*true", r"\bxss\b", r"cross-site scripting",
                  r"\beval\(", r"\bexec\("),
    "deserialization": (r"deseriali[sz]", r"\bpickle\b", r"\bunpickl", r"unsafe (yaml )?load"),
    "xml": (r"\bxxe\b", r"external entit", r"entity expansion", r"billion laughs"),
    "tls": (r"\btls\b", r"\bssl\b", r"certificate", r"host ?name verification", r"verify\s*=\s*false"),
    "crypto": (r"cryptograph", r"\bcipher", r"\bmd5\b", r"\bsha-?1\b", r"weak hash", r"key confusion",
               r"algorithm confusion", r"signature", r"\bprng\b", r"timing attack", r"compare_digest",
               r"constant[- ]time"),
    "filesystem": (r"path traversal", r"directory traversal", r"\bsymlink", r"temporary file", r"\bmktemp\b",
                   r"file permission", r"\bchmod\b", r"zip slip"),
    "resource": (r"denial of service", r"\bdos\b", r"\btimeout\b", r"resource exhaustion", r"memory exhaustion",
                 r"infinite loop", r"\bzombie", r"resource leak", r"descriptor leak"),
    "exposure": (r"\bleak", r"\bexpos", r"disclos", r"sensitive (data|information)", r"cleartext",
                 r"information exposure"),
    "secrets": (r"hard-?coded (password|secret|key|token|credential)", r"\bpassword\b", r"\bcredential"),
    "auth": (r"authenticat", r"authori[sz]", r"access control", r"privilege", r"\bcsrf\b"),
    "validation": (r"not validated", r"input validation", r"unvalidated", r"without validation"),
    "name": (r"undefined name", r"undefined variable", r"nameerror", r"is not defined", r"\bunbound",
             r"before assignment"),
    "type": (r"typeerror", r"type error", r"incompatible type", r"attributeerror", r"has no attribute",
             r"wrong type", r"not callable", r"unexpected keyword argument", r"too many (positional )?arguments",
             r"missing (positional )?argument"),
    "error_handling": (r"exception", r"\bexcept\b", r"\bswallow", r"\bunchecked\b", r"not checked",
                       r"error handling", r"indexerror", r"keyerror", r"\bcrash"),
    "syntax": (r"syntax ?error", r"invalid syntax", r"does not parse"),
    "logic": (r"\bwrong\b", r"\bincorrect", r"off[- ]by[- ]one", r"\blogic", r"\bcondition", r"comparison",
              r"\bregex", r"regular expression"),
    "maintainability": (r"\bunused\b", r"\bstyle\b", r"naming", r"docstring", r"complexity", r"dead code",
                        r"line too long", r"formatting"),
}
_CLAIM_RES = [(cat, re.compile("|".join(words))) for cat, words in CLAIM_WORDS.items()]
_CWE_RE = re.compile(r"\bCWE-(\d{1,5})\b", re.IGNORECASE)


def _longest_prefix(table: Mapping[str, str], code: str) -> str | None:
    for n in range(len(code), 0, -1):
        hit = table.get(code[:n])
        if hit is not None:
            return hit
    return None


def rule_category(analyser: str, rule: str | None) -> str | None:
    """The category of ``analyser``'s rule ``rule`` (exact code, else the longest
    listed prefix; ruff's ``S``/``PL`` ports through bandit's/pylint's tables), or
    ``None`` when the table has no class for it."""
    if not rule:
        return None
    if analyser == "ruff":
        port = re.fullmatch(r"S(\d{3})", rule)
        if port and "B" + port.group(1) in _BANDIT and rule not in _RUFF:
            return _BANDIT["B" + port.group(1)]
        port = re.fullmatch(r"PL([CEFRW]\d{4})", rule)
        if port:
            return _longest_prefix(_PYLINT, port.group(1))
    if analyser == "mypy":
        hit = _MYPY.get(rule, _MYPY_DEFAULT)
        return hit or None
    table = RULE_CATEGORY.get(analyser)
    return _longest_prefix(table, rule) if table else None


def cwe_category(cwe: str | int | None) -> str | None:
    """The category of a CWE (``"CWE-78"``, ``"CWE-78: …"`` or ``78``), or ``None``."""
    if cwe is None:
        return None
    if isinstance(cwe, int):
        return CWE_CATEGORY.get(cwe)
    m = _CWE_RE.search(cwe)
    return CWE_CATEGORY.get(int(m.group(1))) if m else None


def claim_category(claim: str) -> str | None:
    """The category the words of ``claim`` name (:data:`CLAIM_WORDS`), or ``None``."""
    text = claim.lower()
    for cat, rx in _CLAIM_RES:
        if rx.search(text):
            return cat
    return None


def finding_category(analyser: str, rule: str | None, cwe: str | None, claim: str) -> str | None:
    """A finding's class: rule, else CWE, else claim words (module docstring)."""
    return rule_category(analyser, rule) or cwe_category(cwe) or claim_category(claim)


def defect_category(claim: str, *, category: str | None = None, cwe: str | None = None) -> str:
    """An expected defect's class: its ``category`` field (when a known one), else
    its ``cwe`` field or a CWE in its claim, else its claim's words, else ``logic``."""
    if category in CATEGORIES:
        return category
    return cwe_category(cwe) or cwe_category(claim) or claim_category(claim) or "logic"
