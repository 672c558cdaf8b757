"""ATP client SDK (spec §22): ``async with atp.Client(url, token) as c``.

This distribution (``atp-sdk``) alone owns the top-level ``atp`` package; the
router distribution (``atp-router``) is ``atp_router`` (``atp_router.wire``,
``atp_router.runtime``, …), so the two install in any order, editable or not. A
client application installs only ``atp-sdk``.
"""

from atp._client import ATPClientError, Client, Event, StreamHandle

__all__ = ["ATPClientError", "Client", "Event", "StreamHandle"]
