"""The task boundary (issue 21 item 1), sans-IO: what a task *is*, as strict msgspec Structs.

Pure code (no I/O, no clock); imports only :mod:`atp_router.wire` (the frame's ``Budget``
and ``QoS``). Its layer is beside :mod:`atp_router.flow` and :mod:`atp_router.consensus`
(tests/unit/test_layers.py).

=============================  ====================================================
:mod:`atp_router.task.meta`    :class:`~atp_router.task.meta.TaskMeta`: the SYN meta fields
                               the router itself reads (task type, QoS, budget,
                               idempotency key, resume point, data scope, Agent
                               Context, trace, ``diff_loc``)
:mod:`atp_router.task.body`    the task bodies, one Struct per task type
                               (:class:`~atp_router.task.body.CodeReview`,
                               :class:`~atp_router.task.body.RepoSummary`,
                               :class:`~atp_router.task.body.RetrievalQA`,
                               :class:`~atp_router.task.body.Chat`), and the OpenAI
                               ingress's chat messages, with their size limits as
                               ``Meta`` constraints
:mod:`atp_router.task.diff`    unified-diff parsing (``parse_diff``) and the fast
                               ``diff_loc`` count the router routes on at SYN
:mod:`atp_router.task.change`  :class:`~atp_router.task.change.ParsedChange`: a code-review
                               task's diff parsed **once** (changed lines per file,
                               ``diff_loc``), shared by every next-hop of the task
                               and its consensus
=============================  ====================================================

``proto/task.schema.json`` is generated from :mod:`atp_router.task.meta` and
:mod:`atp_router.task.body` (``python -m atp_router.protogen``).
"""
