"""Golden code-review tasks: the harness (``harness.py``) and its test."""
