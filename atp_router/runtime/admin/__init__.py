"""What the router shows its operators over HTTP: the live status snapshot
(its shape :mod:`~atp_router.runtime.admin.snapshot`, built by :mod:`~atp_router.runtime.admin.status`)
and page (:mod:`~atp_router.runtime.admin.statuspage`, its files in ``static/``), the learning FIB's view
(:mod:`~atp_router.runtime.admin.fibview`) and the OpenAPI document of the control API
(:mod:`~atp_router.runtime.admin.openapi`, written to ``proto/openapi.json``), and the
route table and a task's path as text (:mod:`~atp_router.runtime.admin.taskpath`,
``atp-router routes [--diagram]``).
"""
