"""RIB loader: YAML file(s) or text → validated :class:`~atp_router.policy.rib.Rib` (spec §6.1).

Every fault raises :class:`~atp_router.wire.errors.PolicyError` ``(file, key, reason)``
with a dotted key as the operator wrote it::

    policies[1].match.diff_loc      expected a comparison like '>150', got '>>1'
    agents.reviewer.gemini.model    unknown model 'gemini-ultra' (known: ...)
    $                               YAML syntax error at line 4, column 7: ...

``policies[i]`` counts within the file named. Loading is a pure function of the
files' contents: it returns a new Rib or raises, so a refused reload leaves the
running RIB untouched.

YAML dialect: safe loading with YAML 1.2 booleans (only ``true``/``false``; so
``on:`` in an escalation is the key "on", not True), decimal ints with ``_``
separators (``1_200_000``), floats with exponents (``1e-3``), no timestamps.
Duplicate keys in one mapping are refused.
"""

from __future__ import annotations

import enum
import re
import types
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, Union, get_args, get_origin

import msgspec
import yaml

from atp_router.policy.match import compile_match
from atp_router.policy.rib import (
    NAME_RE,
    AgentSpec,
    ClientSpec,
    ModelSpec,
    PolicySpec,
    Rib,
    SpecError,
    reference_errors,
)
from atp_router.wire.errors import PolicyError

__all__ = ["load_rib", "load_rib_text"]

#: Alias expansion cap: a document larger than this many nodes once anchors are
#: expanded is refused (a "billion laughs" document would otherwise hang the loader).
MAX_NODES = 200_000

_SECTIONS = ("models", "agents", "policies", "clients")


# libyaml's parser when built in (~5x faster); the resolvers below are Python either way.
_SafeLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class _RibYamlLoader(_SafeLoader):  # type: ignore[valid-type,misc]
    """SafeLoader with the implicit scalar types of a config file (see module doc)."""

    yaml_implicit_resolvers: ClassVar[dict[str, list[tuple[str, re.Pattern[str]]]]] = {}


for _tag, _regexp, _first in (
    ("tag:yaml.org,2002:null", r"^(?:~|null|Null|NULL|)$", ["~", "n", "N", ""]),
    ("tag:yaml.org,2002:bool", r"^(?:true|True|TRUE|false|False|FALSE)$", list("tTfF")),
    ("tag:yaml.org,2002:int", r"^(?:[-+]?(?:0|[1-9][0-9_]*)|0x[0-9a-fA-F_]+)$", list("-+0123456789")),
    (
        "tag:yaml.org,2002:float",
        (
            r"^(?:[-+]?(?:\.[0-9]+|[0-9][0-9_]*(?:\.[0-9_]*)?)(?:[eE][-+]?[0-9]+)?"
            r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
        ),
        list("-+0123456789."),
    ),
    ("tag:yaml.org,2002:merge", r"^(?:<<)$", ["<"]),
):
    _RibYamlLoader.add_implicit_resolver(_tag, re.compile(_regexp), _first)


def _check_nodes(node: yaml.Node, file: str) -> None:
    """Refuse duplicate mapping keys (pyyaml keeps the last silently) and
    documents that expand past :data:`MAX_NODES`."""
    budget = MAX_NODES
    stack: list[tuple[yaml.Node, str]] = [(node, "")]
    while stack:
        n, path = stack.pop()
        budget -= 1
        if budget < 0:
            raise PolicyError(file, "$", f"document too large (more than {MAX_NODES} nodes after alias expansion)")
        if isinstance(n, yaml.MappingNode):
            seen: dict[Any, yaml.Node] = {}
            for k, v in n.value:
                if isinstance(k, yaml.ScalarNode):
                    if k.tag == "tag:yaml.org,2002:merge":
                        stack.append((v, path))
                        continue
                    child = f"{path}.{k.value}" if path else k.value
                    if k.value in seen:
                        first = seen[k.value].start_mark.line + 1
                        raise PolicyError(
                            file,
                            child,
                            f"duplicate key {k.value!r} (lines {first} and {k.start_mark.line + 1})",
                        )
                    seen[k.value] = k
                else:
                    child = path
                stack.append((v, child))
        elif isinstance(n, yaml.SequenceNode):
            for i, v in enumerate(n.value):
                stack.append((v, f"{path}[{i}]"))


def _where(mark: yaml.Mark | None) -> str:
    return f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""


def _describe(e: yaml.MarkedYAMLError) -> str:
    """`` at line L, column C: <problem> (<context> at line L, column C)``, 1-based."""
    text = _where(e.problem_mark or e.context_mark) + ": " + (e.problem or e.context or "invalid YAML")
    if e.context and e.problem:
        text += f" ({e.context}{_where(e.context_mark)})"
    return text


def _parse_yaml(text: str, file: str) -> Any:
    loader = _RibYamlLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_nodes(node, file)
        return loader.construct_document(node)
    except yaml.MarkedYAMLError as e:
        raise PolicyError(file, "$", "YAML syntax error" + _describe(e)) from None
    except yaml.YAMLError as e:
        raise PolicyError(file, "$", f"YAML error: {e}") from None
    finally:
        loader.dispose()


# -- msgspec error translation -------------------------------------------------

_MSG_RE = re.compile(r"^(?P<msg>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.DOTALL)
_PATH_PART_RE = re.compile(r"\.([A-Za-z_][A-Za-z0-9_]*)|\[(\d+)\]")


def _type_at(tp: Any, path: str) -> Any:
    """The annotated type reached by following msgspec ``path`` from ``tp``."""
    for m in _PATH_PART_RE.finditer(path):
        tp = _unwrap(tp)
        if m.group(1) is not None:
            fields = {f.name: f.type for f in msgspec.structs.fields(tp)} if _is_struct(tp) else {}
            tp = fields.get(m.group(1))
        elif get_origin(tp) is list:
            tp = get_args(tp)[0]
        if tp is None:
            return None
    return _unwrap(tp)


def _unwrap(tp: Any) -> Any:
    """Strip ``Annotated[...]`` and ``X | None`` down to X."""
    while True:
        if get_origin(tp) is Annotated:
            tp = get_args(tp)[0]
            continue
        if get_origin(tp) in (Union, types.UnionType):
            args = [a for a in get_args(tp) if a is not type(None)]
            if len(args) == 1:
                tp = args[0]
                continue
        return tp


def _is_struct(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, msgspec.Struct)


def _choices(tp: Any) -> list[str] | None:
    if get_origin(tp) is Literal:
        return [str(a) for a in get_args(tp)]
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return [str(m.value) for m in tp]
    return None


def _translate(err: msgspec.ValidationError, root: type, prefix: str) -> tuple[str, str]:
    """(dotted key, reason) for a msgspec error raised converting into ``root``."""
    cause = err.__cause__
    m = _MSG_RE.match(str(err))
    assert m is not None  # the pattern matches any string
    msg, path = m.group("msg"), m.group("path") or ""
    key = prefix + path
    if isinstance(cause, SpecError):
        return _join(key, cause.field), cause.reason
    if unknown := re.match(r"Object contains unknown field `(.+)`$", msg):
        tp = _type_at(root, path)
        known = ", ".join(f.name for f in msgspec.structs.fields(tp)) if _is_struct(tp) else ""
        return _join(key, unknown.group(1)), f"unknown field {unknown.group(1)!r}" + (
            f" (known: {known})" if known else ""
        )
    if missing := re.match(r"Object missing required field `(.+)`$", msg):
        return _join(key, missing.group(1)), "missing required field"
    if bad := re.match(r"Invalid enum value (.+)$", msg):
        choices = _choices(_type_at(root, path))
        return key, f"invalid value {bad.group(1)}" + (f" (expected one of: {', '.join(choices)})" if choices else "")
    return key, msg.replace("`", "")


def _join(key: str, field: str) -> str:
    if not field:
        return key
    if field.startswith(("[", ".")):
        return key + field
    return f"{key}.{field}"


# -- one file ------------------------------------------------------------------


def _convert_entry(value: Any, tp: type, key: str, file: str) -> Any:
    try:
        return msgspec.convert(value, tp)
    except msgspec.ValidationError as e:
        raise PolicyError(file, *_translate(e, tp, key)) from None


def _check_name(name: Any, key: str, what: str, file: str) -> str:
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise PolicyError(
            file,
            key,
            f"invalid {what} name {name!r} (1-128 of letters, digits and . _ : / @ + - [ ], starting alphanumeric)",
        )
    return name


def _parse_document(data: Any, file: str, errors: list[PolicyError] | None = None,
                    broken: set[str] | None = None) -> Rib:
    """One file's document → Rib (entries validated; no cross-references yet).
    With ``errors``, a bad entry is recorded there and skipped (its name goes
    to ``broken``) instead of raising, so one load reports every fault."""

    def fault(e: PolicyError, name: str | None = None) -> None:
        if errors is None:
            raise e
        errors.append(e)
        if name is not None and broken is not None:
            broken.add(name)

    if data is None:
        return Rib()
    if not isinstance(data, dict):
        fault(PolicyError(file, "$", f"expected a mapping with {', '.join(_SECTIONS)}, got {type(data).__name__}"))
        return Rib()
    for k in data:
        if k not in _SECTIONS:
            fault(PolicyError(file, str(k), f"unknown field {k!r} (known: {', '.join(_SECTIONS)})"))

    models: dict[str, ModelSpec] = {}
    agents: dict[str, AgentSpec] = {}
    clients: dict[str, ClientSpec] = {}
    for section, tp, out in (("models", ModelSpec, models), ("agents", AgentSpec, agents),
                             ("clients", ClientSpec, clients)):
        entries = data.get(section)
        if entries is None:
            continue
        if not isinstance(entries, dict):
            fault(PolicyError(file, section, f"expected a mapping of names, got {type(entries).__name__}"))
            continue
        for name, spec in entries.items():
            key = f"{section}.{name}"
            try:
                _check_name(name, key, section[:-1], file)
                out[name] = _convert_entry(spec, tp, key, file)
            except PolicyError as e:
                fault(e, str(name))
    for name, model in models.items():
        if model.model is None:
            models[name] = msgspec.structs.replace(model, model=name)

    policies = _parse_policies(data.get("policies"), file, fault)
    return Rib(models=models, agents=agents, policies=policies, clients=clients)


def _parse_policies(entries: Any, file: str, fault: Callable[[PolicyError], None]) -> list[PolicySpec]:
    """The document's ``policies`` list (``entries``; ``None``: none) → specs, each
    validated by itself. A refused policy goes to ``fault`` and keeps its place
    as ``None``, so later policies keep their indices in messages."""
    policies: list[PolicySpec] = []
    if entries is None:
        return policies
    if not isinstance(entries, list):
        fault(PolicyError(file, "policies", f"expected a list of policies, got {type(entries).__name__}"))
        return policies
    for i, spec in enumerate(entries):
        key = f"policies[{i}]"
        try:
            if isinstance(spec, dict) and isinstance(spec.get("match"), dict):
                try:
                    compile_match(spec["match"])
                except SpecError as e:
                    raise PolicyError(file, _join(f"{key}.match", e.field), e.reason) from None
            policy = _convert_entry(spec, PolicySpec, key, file)
            if policy.name is not None:
                _check_name(policy.name, f"{key}.name", "policy", file)
        except PolicyError as e:
            fault(e)
            # Keep the policy's place: later policies keep their indices in messages.
            policies.append(None)  # type: ignore[arg-type]
            continue
        policies.append(policy)
    return policies


# -- merge and cross-references ------------------------------------------------


def _merge(parts: list[tuple[str, Rib]], origin: str, errors: list[PolicyError] | None = None,
           broken: frozenset[str] | set[str] = frozenset()) -> Rib:
    """Merge per-file RIBs: registries and clients by name (a duplicate is
    refused, naming both files), policies concatenated in file order; then
    check references. With ``errors``, every fault is recorded there instead of
    raising (a reference to a ``broken`` entry, itself already reported, is not
    reported again)."""

    def fault(e: PolicyError) -> None:
        if errors is None:
            raise e
        errors.append(e)

    models: dict[str, ModelSpec] = {}
    agents: dict[str, AgentSpec] = {}
    clients: dict[str, ClientSpec] = {}
    policies: list[PolicySpec] = []
    where: dict[str, dict[Any, str]] = {"models": {}, "agents": {}, "clients": {}}
    policy_at: list[tuple[str, int]] = []  # global index -> (file, index in file)
    for file, rib in parts:
        for section, merged, entries in (
            ("models", models, rib.models),
            ("agents", agents, rib.agents),
            ("clients", clients, rib.clients),
        ):
            for name, spec in entries.items():
                if name in merged:
                    fault(PolicyError(
                        file,
                        f"{section}.{name}",
                        f"duplicate {section[:-1]} {name!r} (also defined in {where[section][name]})",
                    ))
                    continue
                merged[name] = spec
                where[section][name] = file
        for i, policy in enumerate(rib.policies):
            if policy is None:  # refused while parsing (already reported)
                continue
            policy_at.append((file, i))
            policies.append(policy)

    _name_policies(policies, policy_at, fault)
    rib = Rib(models=models, agents=agents, policies=policies, clients=clients)
    for ref in reference_errors(rib):
        if any(repr(name) in ref.reason for name in broken):
            continue  # the referenced entry was refused, and reported, already
        if ref.section == "agents":
            fault(PolicyError(where["agents"][ref.entry], f"agents.{ref.entry}{ref.field}", ref.reason))
        elif ref.entry == -1:
            if errors:
                continue  # "no policies" because every policy was refused: already reported
            fault(PolicyError(origin, "policies", ref.reason))
        else:
            file, i = policy_at[ref.entry]  # type: ignore[index]
            fault(PolicyError(file, f"policies[{i}]{ref.field}", ref.reason))
    return rib


def _name_policies(policies: list[PolicySpec], policy_at: list[tuple[str, int]],
                   fault: Callable[[PolicyError], None]) -> None:
    """Name each unnamed policy of the merged list ``policy[<global index>]`` (in
    place); a name used twice goes to ``fault``, located by ``policy_at`` (global
    index → file, index in that file)."""
    names: dict[str, int] = {}
    for g, policy in enumerate(policies):
        if policy.name is None:
            policy = policies[g] = msgspec.structs.replace(policy, name=f"policy[{g}]")
        assert policy.name is not None
        if policy.name in names:
            file, i = policy_at[g]
            first_file, first_i = policy_at[names[policy.name]]
            fault(PolicyError(
                file,
                f"policies[{i}].name",
                f"duplicate policy name {policy.name!r} (also policies[{first_i}] in {first_file})",
            ))
            continue
        names[policy.name] = g


def load_rib_text(text: str, file: str = "<text>") -> Rib:
    """Parse and validate one RIB document (YAML or JSON text), e.g. a control-API
    body (``POST /v1/policies/reload``). ``file`` names it in errors.

    Raises PolicyError(file, key, reason) on any fault (see module doc): the
    first, with every fault found in ``.errors`` (each with its ``line``)."""
    return _load([(file, text)], file)


def load_rib(path: str | Path) -> Rib:
    """Load the RIB from a YAML file, or from a directory: every ``*.yaml`` /
    ``*.yml`` directly inside it (dotfiles skipped: editors' temp files), in
    sorted name order, merged — models and agents by name (a name defined twice
    is refused, naming both files), policies concatenated in file order.

    Raises PolicyError(file, key, reason): also for a missing path, an
    unreadable file, or a directory without YAML files."""
    p = Path(path)
    if p.is_dir():
        files = sorted(
            f for f in p.iterdir() if f.suffix in (".yaml", ".yml") and not f.name.startswith(".") and f.is_file()
        )
        if not files:
            raise PolicyError(str(p), "$", "no *.yaml or *.yml files in directory")
    else:
        files = [p]
    texts = []
    for f in files:
        try:
            texts.append((str(f), f.read_text(encoding="utf-8")))
        except FileNotFoundError:
            raise PolicyError(str(f), "$", "no such file or directory") from None
        except (OSError, UnicodeDecodeError) as e:
            raise PolicyError(str(f), "$", f"cannot read: {e}") from None
    return _load(texts, str(p))


def _load(texts: list[tuple[str, str]], origin: str) -> Rib:
    """Parse, validate and merge ``(file, text)`` pairs, recording every fault;
    raises the first (all of them in ``.errors``, with lines) if any."""
    errors: list[PolicyError] = []
    broken: set[str] = set()
    parts = []
    for file, text in texts:
        try:
            data = _parse_yaml(text, file)
        except PolicyError as e:
            errors.append(e)
            continue
        parts.append((file, _parse_document(data, file, errors, broken)))
    rib = _merge(parts, origin, errors, broken)
    if errors:
        by_file = dict(texts)
        for e in errors:
            if e.line is None and e.file in by_file:
                e.line = line_of(by_file[e.file], e.key)
        first = errors[0]
        first.errors = errors
        raise first
    return rib


def line_of(text: str, key: str) -> int | None:
    """The 1-based line of dotted ``key`` (``policies[1].match.diff_loc``,
    ``agents.summarizer.local.model``: names may contain dots) in the YAML
    ``text``; the deepest part of the key that exists; None when not even the
    first part does (or the text is not YAML)."""
    m = re.search(r" at line (\d+)", key)
    if m:
        return int(m.group(1))
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        return mark.line + 1 if mark is not None else None
    if node is None or key in ("$", ""):
        return 1 if node is not None else None
    rest, line = key, None
    while rest and node is not None:
        if isinstance(node, yaml.SequenceNode):
            m = re.match(r"\[(\d+)\]\.?", rest)
            if not m or int(m.group(1)) >= len(node.value):
                break
            node = node.value[int(m.group(1))]
            rest = rest[m.end():]
            line = node.start_mark.line + 1
        elif isinstance(node, yaml.MappingNode):
            best = None
            for k, v in node.value:
                name = str(k.value)
                if (rest == name or rest.startswith((name + ".", name + "["))) and (
                        best is None or len(name) > len(str(best[0].value))):
                    best = (k, v)
            if best is None:
                break
            k, node = best
            line = k.start_mark.line + 1
            rest = rest[len(str(k.value)):].removeprefix(".")
        else:
            break
    return line
