"""The ATP router appliance (distribution ``atp-router``, the ``atp-router`` and
``atp-agent2389`` commands). Its packages are layered, lowest first (checked by
tests/unit/test_layers.py): ``wire``, ``cliutil``; ``consensus``, ``flow``,
``task``; ``policy``, ``review``; ``store``, ``mqtt``; ``security``;
``observability``; ``adapters``; ``agent2389``; ``runtime``; ``deploy``;
``protogen``. This module imports none of them.

The client SDK is the separate distribution ``atp-sdk``, which alone owns the
top-level ``atp`` (``atp.Client``); the router uses it only in ``atp-router
eval`` (:mod:`atp_router.review.eval`).
"""
