"""Who is calling (spec §11 AuthN): the :class:`Identity` every ingress resolves a
caller to, and the roles that authorization (:mod:`atp_router.security.authz`) checks.

An identity names a *tenant* — the RIB's ``clients.<tenant>`` entry, whose budget,
QoS ceiling and scopes apply — and a set of roles:

============  ==============================================================
``admin``     policy reload and read, routes, audit, tenant management
``operator``  metrics and health
``client``    streams (open, send frames, read events) in its own tenant
============  ==============================================================
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum

__all__ = ["ANONYMOUS", "TENANT_RE", "Identity", "Role"]

#: A tenant (RIB client) name: letters, digits and ``._-``, at most 64.
TENANT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


class Role(StrEnum):
    ADMIN = "admin"
    OPERATOR = "operator"
    CLIENT = "client"


@dataclass(frozen=True, slots=True)
class Identity:
    """An authenticated caller.

    ``tenant`` is the RIB client it acts for; ``roles`` what it may do;
    ``subject`` who it is for the audit trail (API key id, JWT ``sub``,
    certificate SAN; never a secret); ``method`` how it proved it
    (``"api_key"``, ``"jwt"``, ``"mtls"``, ``"none"`` when authentication is off).
    """

    tenant: str
    roles: frozenset[Role]
    subject: str
    method: str

    def has(self, role: Role) -> bool:
        return role in self.roles


#: The caller when the router runs without authentication (a local appliance only):
#: every role, tenant ``anonymous``.
ANONYMOUS = Identity("anonymous", frozenset(Role), "anonymous", "none")
