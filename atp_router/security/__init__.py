"""Trust (spec §11, §19): who is calling (:mod:`~atp_router.security.identity`,
:mod:`~atp_router.security.authn`, :mod:`~atp_router.security.tls`), what they may do
(:mod:`~atp_router.security.authz`), frame signatures and replay protection
(:mod:`~atp_router.security.signing`), data-scope redaction (:mod:`~atp_router.security.redact`)
and the hash-chained audit trail (:mod:`~atp_router.security.audit`)."""
