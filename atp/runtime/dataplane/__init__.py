"""What carries a task from its SYN to its FINAL: the stream table and event logs
(:mod:`~atp.runtime.dataplane.streams`), the SYN pipeline of stages
(:mod:`~atp.runtime.dataplane.opening`), the dispatcher that fans a task out to its
next-hops and merges what comes back (:mod:`~atp.runtime.dataplane.dispatch`), the
response cache (:mod:`~atp.runtime.dataplane.cache`) and giving memory back when idle
(:mod:`~atp.runtime.dataplane.memory`).
"""
