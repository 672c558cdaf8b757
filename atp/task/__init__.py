"""The task boundary (issue 21 item 1), sans-IO: what a task *is*, as strict msgspec Structs.

Pure code (no I/O, no clock); imports only :mod:`atp.wire` (the frame's ``Budget``
and ``QoS``). Its layer is beside :mod:`atp.flow` and :mod:`atp.consensus`
(tests/unit/test_layers.py).

=========================  ====================================================
:mod:`atp.task.meta`       :class:`~atp.task.meta.TaskMeta`: the SYN meta fields
                           the router itself reads (task type, QoS, budget,
                           idempotency key, resume point, data scope, Agent
                           Context, trace, ``diff_loc``)
:mod:`atp.task.body`       the task bodies, one Struct per task type
                           (:class:`~atp.task.body.CodeReview`,
                           :class:`~atp.task.body.RepoSummary`,
                           :class:`~atp.task.body.RetrievalQA`,
                           :class:`~atp.task.body.Chat`), and the OpenAI
                           ingress's chat messages, with their size limits as
                           ``Meta`` constraints
:mod:`atp.task.diff`       unified-diff parsing (``parse_diff``) and the fast
                           ``diff_loc`` count the router routes on at SYN
:mod:`atp.task.change`     :class:`~atp.task.change.ParsedChange`: a code-review
                           task's diff parsed **once** (changed lines per file,
                           ``diff_loc``), shared by every next-hop of the task
                           and its consensus
=========================  ====================================================

``proto/task.schema.json`` is generated from :mod:`atp.task.meta` and
:mod:`atp.task.body` (``python -m atp.protogen``).
"""
