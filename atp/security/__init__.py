"""Trust (spec §11, §19): who is calling (:mod:`~atp.security.identity`,
:mod:`~atp.security.authn`, :mod:`~atp.security.tls`), what they may do
(:mod:`~atp.security.authz`), frame signatures and replay protection
(:mod:`~atp.security.signing`), data-scope redaction (:mod:`~atp.security.redact`)
and the hash-chained audit trail (:mod:`~atp.security.audit`)."""
