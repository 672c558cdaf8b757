"""What a policy may reach (spec §11, §19 exfiltration through policy), sans-IO.

A RIB names environment variables whose values the router sends to next-hops
(``models.<m>.api_key_env``, ``agents.<a>.remote.auth_env``, option keys ending in
``_env``, and the provider defaults a ``google`` model reads without
``api_key_env``). Unchecked, a policy could name the router's own secrets — its
HMAC keys, its bearer tokens — and send them to a server of its choosing.

* :class:`PolicySecrets` is the operator's declaration of what policies may use:
  ``--policy-secret NAME`` (repeatable: the variable is read from the router's
  environment) and ``--policy-secrets-file F`` (``NAME=value`` lines: the value is
  served from the file, not the environment). The router's own variables — every
  name starting ``ATP_`` and the ``reserved`` names given — are never allowed,
  whatever is declared. :meth:`PolicySecrets.check` refuses a RIB referencing
  anything else (a :class:`~atp_router.wire.errors.PolicyError` naming file and key);
  :meth:`PolicySecrets.resolve` is how adapters should read a secret.
* :func:`egress_changes` lists every endpoint, secret reference and file a reload
  adds, removes or changes, for the audit record (who reloaded is the caller's).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from atp_router.policy.rib import GOOGLE_KEY_ENVS, Rib
from atp_router.wire.errors import PolicyError

__all__ = [
    "RESERVED_PREFIX",
    "PolicySecrets",
    "SecretRef",
    "egress_changes",
    "parse_secrets_file",
    "secret_refs",
]

#: Every environment variable starting with this belongs to the router.
RESERVED_PREFIX = "ATP_"

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
#: Option keys naming a host (beside any value written ``scheme://...``).
_HOST_KEYS = frozenset({"url", "base_url", "endpoint", "host", "hostname", "broker", "card_url"})
_URL_VALUE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def parse_secrets_file(text: str, *, source: str) -> dict[str, str]:
    """``NAME=value`` lines → ``{NAME: value}``. Blank lines and lines starting ``#``
    are skipped; the name and the value are stripped of surrounding whitespace
    (the value is otherwise verbatim: no quotes or escapes are interpreted).

    Raises ``ValueError`` ``"<source>:<line>: <reason>"`` for a line without ``=``,
    a bad name or a name given twice; the message never contains a value.
    """
    out: dict[str, str] = {}
    for lineno, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        name, sep, value = stripped.partition("=")
        name = name.strip()
        if not sep:
            raise ValueError(f"{source}:{lineno}: expected NAME=value")
        if not _ENV_NAME.match(name):
            raise ValueError(f"{source}:{lineno}: {name[:64]!r} is not a variable name (letters, digits, _)")
        if name in out:
            raise ValueError(f"{source}:{lineno}: {name} given twice")
        out[name] = value.strip()
    return out


@dataclass(frozen=True, slots=True)
class SecretRef:
    """One environment variable a RIB makes the router read: ``key`` is the dotted
    RIB key that names it, ``names`` the variable(s) (several for a provider
    default, read in order), ``implicit`` true for a provider default."""

    key: str
    names: tuple[str, ...]
    implicit: bool = False


def _option_items(options: Any, key: str) -> Iterator[tuple[str, str, Any]]:
    """``(dotted key, leaf key, value)`` of every leaf in ``options`` (nested maps
    and lists included)."""
    if isinstance(options, Mapping):
        for k, v in options.items():
            sub = f"{key}.{k}"
            if isinstance(v, Mapping | list):
                yield from _option_items(v, sub)
            else:
                yield sub, str(k), v
    elif isinstance(options, list):
        for i, v in enumerate(options):
            yield from _option_items(v, f"{key}[{i}]")


def _agent_options(rib: Rib) -> Iterator[tuple[str, str, Any]]:
    for name, agent in rib.agents.items():
        yield from _option_items(agent.options, f"agents.{name}.options")
        if agent.remote is not None:
            yield from _option_items(agent.remote.options, f"agents.{name}.remote.options")


def secret_refs(rib: Rib) -> list[SecretRef]:
    """Every environment variable ``rib`` makes the router read, in document order:
    ``models.<m>.api_key_env``; a ``google`` model without it (the provider's
    default variables); ``agents.<a>.remote.auth_env``; any option key ending in
    ``_env`` (e.g. ``remote.options.username_env``)."""
    refs: list[SecretRef] = []
    for name, model in rib.models.items():
        if model.api_key_env is not None:
            refs.append(SecretRef(f"models.{name}.api_key_env", (model.api_key_env,)))
        elif model.provider == "google":
            refs.append(SecretRef(f"models.{name}.api_key_env", tuple(GOOGLE_KEY_ENVS), implicit=True))
    for name, agent in rib.agents.items():
        if agent.remote is not None and agent.remote.auth_env is not None:
            refs.append(SecretRef(f"agents.{name}.remote.auth_env", (agent.remote.auth_env,)))
    for key, leaf, value in _agent_options(rib):
        if leaf.endswith("_env") and isinstance(value, str):
            refs.append(SecretRef(key, (value,)))
    return refs


class PolicySecrets:
    """The environment variables policies may reference (spec §11), and their values.

    ``declared`` are variable names read from ``environ`` (default ``os.environ``);
    ``file_values`` (from :func:`parse_secrets_file`) are declared too, with their
    values served from the file. ``reserved`` are the router's own variables beside
    every ``ATP_*`` one: never allowed. Declaring a reserved name raises
    ``ValueError`` (the operator's mistake is reported at start, not at a reload).
    """

    __slots__ = ("_environ", "_file", "_reserved", "declared")

    def __init__(
        self,
        declared: Iterable[str] = (),
        *,
        file_values: Mapping[str, str] | None = None,
        reserved: Iterable[str] = (),
        environ: Mapping[str, str] | None = None,
    ):
        self._reserved = frozenset(reserved)
        self._file = dict(file_values or {})
        self._environ = os.environ if environ is None else environ
        names = frozenset(declared) | frozenset(self._file)
        for name in sorted(names):
            if not _ENV_NAME.match(name):
                raise ValueError(f"--policy-secret {name[:64]!r}: not a variable name (letters, digits, _)")
            if self.is_reserved(name):
                raise ValueError(f"--policy-secret {name}: one of the router's own secrets cannot be declared "
                                 "for policies")
        self.declared: frozenset[str] = names

    @classmethod
    def load(
        cls,
        names: Iterable[str] = (),
        secrets_file: str | os.PathLike[str] | None = None,
        *,
        reserved: Iterable[str] = (),
        environ: Mapping[str, str] | None = None,
    ) -> PolicySecrets:
        """From the command line: ``--policy-secret`` ``names`` and the
        ``--policy-secrets-file`` path (read once, here). Raises ``ValueError`` for a
        bad file line or name and ``OSError`` when the file cannot be read."""
        values = None
        if secrets_file is not None:
            values = parse_secrets_file(Path(secrets_file).read_text("utf-8"), source=str(secrets_file))
        return cls(names, file_values=values, reserved=reserved, environ=environ)

    def is_reserved(self, name: str) -> bool:
        """``name`` is one of the router's own variables (``ATP_*`` or reserved)."""
        return name.startswith(RESERVED_PREFIX) or name in self._reserved

    def refusal(self, name: str) -> str | None:
        """Why a policy may not reference ``name``, or None when it may."""
        if self.is_reserved(name):
            return f"{name!r} is one of the router's own secrets: no policy may reference it"
        if name not in self.declared:
            return f"{name!r} is not declared for policies: start the router with --policy-secret {name}"
        return None

    def resolve(self, name: str) -> str | None:
        """The value of secret ``name`` for an adapter: from the secrets file when
        declared there, else from the environment; None when ``name`` is not
        allowed for policies or has no value. Never raises."""
        if self.refusal(name) is not None:
            return None
        if name in self._file:
            return self._file[name]
        return self._environ.get(name)

    def check(self, rib: Rib, *, file: str) -> None:
        """Raise :class:`PolicyError` ``(file, key, reason)`` for the first secret
        reference of ``rib`` (:func:`secret_refs`) that is not allowed; a provider
        default (``google`` without ``api_key_env``) passes when one of its
        variables is allowed."""
        for ref in secret_refs(rib):
            reasons = [self.refusal(n) for n in ref.names]
            if ref.implicit:
                if all(r is not None for r in reasons):
                    raise PolicyError(file, ref.key, f"provider google reads {' or '.join(ref.names)} when "
                                      f"api_key_env is not given, and none is declared for policies: set "
                                      f"api_key_env, or start the router with --policy-secret {ref.names[-1]}")
                continue
            if reasons[0] is not None:
                raise PolicyError(file, ref.key, reasons[0])

    def __repr__(self) -> str:
        return f"PolicySecrets(declared={sorted(self.declared)!r}, from_file={sorted(self._file)!r})"


def _egress(rib: Rib | None) -> dict[tuple[str, str], str]:
    """``{(kind, key): value}``: kind ``endpoint`` (a host data is sent to),
    ``secret_ref`` (variables read) or ``file`` (a file the router reads for it)."""
    out: dict[tuple[str, str], str] = {}
    if rib is None:
        return out
    for name, model in rib.models.items():
        out["endpoint", f"models.{name}.base_url"] = (
            model.base_url if model.base_url is not None else f"{model.provider} default endpoint"
        )
    for name, agent in rib.agents.items():
        if agent.remote is not None:
            out["endpoint", f"agents.{name}.remote.url"] = f"{agent.remote.protocol} {agent.remote.url}"
    for ref in secret_refs(rib):
        out["secret_ref", ref.key] = " or ".join(ref.names) + (" (provider default)" if ref.implicit else "")
    for key, leaf, value in _agent_options(rib):
        if not isinstance(value, str) or leaf.endswith("_env"):
            continue
        if leaf in _HOST_KEYS or _URL_VALUE.match(value):
            out["endpoint", key] = value
        elif leaf.endswith("_file"):
            out["file", key] = value
    return out


def egress_changes(old: Rib | None, new: Rib) -> list[dict[str, Any]]:
    """Every endpoint, secret reference and file that ``new`` adds, removes or
    changes against ``old`` (None: the first RIB, everything is added), for the
    audit record of a reload (spec §11). Each item::

        {"kind": "endpoint" | "secret_ref" | "file", "key": "models.gpt.base_url",
         "change": "added" | "removed" | "changed", "old": str | None, "new": str | None}

    sorted by key. Endpoints are ``models.*.base_url`` (a provider's default when
    unset), ``agents.*.remote.url`` (with the protocol) and option values that
    name a host; values are names and URLs, never secrets.
    """
    before, after = _egress(old), _egress(new)
    changes: list[dict[str, Any]] = []
    for kind, key in sorted(before.keys() | after.keys(), key=lambda k: (k[1], k[0])):
        a, b = before.get((kind, key)), after.get((kind, key))
        if a == b:
            continue
        change = "added" if a is None else "removed" if b is None else "changed"
        changes.append({"kind": kind, "key": key, "change": change, "old": a, "new": b})
    return changes
