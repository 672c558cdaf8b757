"""Per-peer connection slots (sans-IO): at most ``per_peer`` connections from one
peer address at once, so one client that keeps opening connections cannot hold
a listener's router-wide slots (spec §19: resource exhaustion by one party).
The lean HTTP server (:mod:`atp_router.runtime.ingress.server`) and the
WebSocket port's handshake gate (:mod:`atp_router.runtime.ingress.ws_gate`)
act on it."""

from __future__ import annotations

__all__ = ["PeerSlots"]


class PeerSlots:
    """Connections per peer address (a string: an IP address, not its port).
    :meth:`admit` takes a slot or refuses (counted in :attr:`refused`);
    :meth:`done` gives it back. Raises ValueError unless ``per_peer > 0``."""

    __slots__ = ("_held", "per_peer", "refused")

    def __init__(self, per_peer: int) -> None:
        if per_peer <= 0:
            raise ValueError(f"per_peer must be > 0, got {per_peer}")
        self.per_peer = per_peer
        self._held: dict[str, int] = {}
        self.refused = 0

    def pending(self, peer: str) -> int:
        """Slots ``peer`` holds now."""
        return self._held.get(peer, 0)

    def peers(self) -> int:
        """Peers holding at least one slot."""
        return len(self._held)

    def admit(self, peer: str) -> bool:
        """A connection from ``peer`` was accepted: may it be served?"""
        n = self._held.get(peer, 0)
        if n >= self.per_peer:
            self.refused += 1
            return False
        self._held[peer] = n + 1
        return True

    def done(self, peer: str) -> None:
        """A connection :meth:`admit` let in was closed."""
        n = self._held.get(peer, 0) - 1
        if n > 0:
            self._held[peer] = n
        else:
            self._held.pop(peer, None)
