"""ATP client SDK (spec §22): ``async with atp.Client(url, token) as c``.

The ``atp`` package is shared: this distribution (``atp-sdk``) provides the client;
the router distribution (``atp-router``) adds ``atp.wire``, ``atp.runtime``,
``atp.deploy`` and the rest under the same name. A client application installs only ``atp-sdk``.
"""

__path__ = __import__("pkgutil").extend_path(__path__, __name__)

from atp._client import Client, Event, StreamHandle, ATPClientError  # noqa: E402

__all__ = ["Client", "Event", "StreamHandle", "ATPClientError"]
