"""Review-task helpers shared by the policy engine, the adapters and consensus.

:mod:`atp_router.review.paths` (pure) checks the file paths a task names;
:mod:`atp_router.review.repo` reads a diff's files from a checkout; :mod:`atp_router.review.eval`
is ``atp-router eval``. Unified-diff parsing is the task's (:mod:`atp_router.task.diff`,
:mod:`atp_router.task.change`).
"""
