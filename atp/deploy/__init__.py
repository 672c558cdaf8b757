"""How the router runs: the ``atp-router`` command line (:mod:`~atp.deploy.cli`), one
router on every core with ``--workers N`` (:mod:`~atp.deploy.workers`: supervisor,
workers, forwarding), and several routers on one shared store such as Redis
(:mod:`~atp.deploy.cluster`). Each mode assembles the runtime of :mod:`atp.runtime`.
"""
