"""Review-task helpers shared by the policy engine, the adapters and consensus.

:mod:`atp.review.paths` (pure) checks the file paths a task names;
:mod:`atp.review.repo` reads a diff's files from a checkout; :mod:`atp.review.eval`
is ``atp-router eval``. Unified-diff parsing is the task's (:mod:`atp.task.diff`,
:mod:`atp.task.change`).
"""
