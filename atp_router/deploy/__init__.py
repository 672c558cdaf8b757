"""How the router runs: the ``atp-router`` command line (:mod:`~atp_router.deploy.cli`), one
router on every core with ``--workers N`` (:mod:`~atp_router.deploy.workers`: supervisor,
workers, forwarding), and several routers on one shared store such as Redis
(:mod:`~atp_router.deploy.cluster`). Each mode assembles the runtime of :mod:`atp_router.runtime`.
"""
