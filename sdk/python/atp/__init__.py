"""ATP client SDK (spec §22): ``async with atp.Client(url, token) as c``.

``url`` picks the transport, with one API for both (``open_stream``,
``events``, ``result``, ``budget_update``, ``send_frame``; typed
:class:`Event` s whose ids are the router's event ids):

* ``atp.Client("http://host:7070", token)`` — the HTTP control API, events as SSE;
* ``atp.Client("ws://host:7071", token, encoding="json" | "cbor", keys=...)`` —
  the WebSocket ingress: frames in JSON (text) or CBOR (binary), signed with
  the router's frame keys when given (:class:`FrameKeys`, ``ATP_HMAC_KEYS``
  text, or a raw ``ATP_HMAC_KEY``), heartbeats, and on a dropped connection a
  reconnection that resumes every open stream with no duplicate and no gap.

This distribution (``atp-sdk``) alone owns the top-level ``atp`` package; the
router distribution (``atp-router``) is ``atp_router`` (``atp_router.wire``,
``atp_router.runtime``, …), so the two install in any order, editable or not. A
client application installs only ``atp-sdk``; the SDK imports nothing of the
router (``cbor2`` only for a CBOR client).
"""

from atp._client import ATPClientError, Client, Event, StreamHandle
from atp._frames import FrameKeys
from atp._types import EVENT_TYPES

__all__ = ["EVENT_TYPES", "ATPClientError", "Client", "Event", "FrameKeys", "StreamHandle"]
