"""The router's trio runtime, in the planes of agentgateway: :mod:`~atp_router.runtime.router`
(the :class:`~atp_router.runtime.router.Router` that composes them), ``ingress/`` (how
requests and frames come in), ``dataplane/`` (streams, the SYN pipeline, dispatch to
the next-hops), ``controlplane/`` (RIB generations, reload, learning) and ``admin/``
(status page, FIB view, OpenAPI). The deployment modes that run it are in
:mod:`atp_router.deploy`; the runtime does not import them.
"""
