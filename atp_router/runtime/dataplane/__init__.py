"""What carries a task from its SYN to its FINAL: the frame path
(:mod:`~atp_router.runtime.dataplane.plane`), the stream table
(:mod:`~atp_router.runtime.dataplane.streams`), its streams
(:mod:`~atp_router.runtime.dataplane.stream`), their event logs
(:mod:`~atp_router.runtime.dataplane.eventlog`) and what of them is stored
(:mod:`~atp_router.runtime.dataplane.persistence`), the SYN pipeline of stages
(:mod:`~atp_router.runtime.dataplane.opening`), running a stream's task to its outcome
(:mod:`~atp_router.runtime.dataplane.runner`), the dispatcher that fans a task out to its
next-hops and merges what comes back (:mod:`~atp_router.runtime.dataplane.dispatch`) with
what a task's run is made of (:mod:`~atp_router.runtime.dataplane.plan`), one attempt of one
next-hop call (:mod:`~atp_router.runtime.dataplane.call`) and the router-wide flow gates it
is admitted through (:mod:`~atp_router.runtime.dataplane.gates`), the
response cache (:mod:`~atp_router.runtime.dataplane.cache`) and giving memory back when idle
(:mod:`~atp_router.runtime.dataplane.memory`).
"""
