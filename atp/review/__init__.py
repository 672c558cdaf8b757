"""Review-task helpers shared by the policy engine, the adapters and consensus.

Pure code (no I/O): :mod:`atp.review.diff` parses unified diffs into the line sets
a code-review task is scored on; :mod:`atp.review.paths` checks the file paths a
task names.
"""
