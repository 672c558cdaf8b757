"""What decides the routes the data plane follows: the running RIB compiled into
FIB generations, hot reload and the next-hop adapters
(:mod:`~atp_router.runtime.controlplane.control`), routing that learns from outcomes and
feedback (:mod:`~atp_router.runtime.controlplane.learning`; what it stores:
:mod:`~atp_router.runtime.controlplane.learn_entries`), and that learning and the
circuit breakers shared by the routers of one store
(:mod:`~atp_router.runtime.controlplane.shared_state`).
"""
