"""What decides the routes the data plane follows: the running RIB compiled into
FIB generations, hot reload and the next-hop adapters
(:mod:`~atp.runtime.controlplane.control`), routing that learns from outcomes and
feedback (:mod:`~atp.runtime.controlplane.learning`), and that learning and the
circuit breakers shared by the routers of one store
(:mod:`~atp.runtime.controlplane.shared_state`).
"""
