"""The stored forms of the learned routing state (spec §6.2, issue 12), as
:class:`~atp_router.runtime.controlplane.learning.Learning` keeps them in the
router's :class:`~atp_router.store.Store`: pure encoders, decoders and the
``Store.update`` functions of a shared store's merge (each may run again).

* ``bandit/<policy>/<arm>`` (:data:`ARM_PREFIX`) — one bandit arm: msgpack
  ``{policy, arm, fingerprint, state}`` (a single router's save), or that
  merged across routers (:func:`~atp_router.policy.learn.merge_arm_entry`),
  zlib-compressed msgpack;
* ``gain/<policy>`` (:data:`GAIN_PREFIX`) — a policy's text gain model
  (:class:`~atp_router.policy.textgain.TextGain`, ``atp-router learn --method
  gain``): msgpack ``{policy, arms: [cheap, dear], fingerprints, weight,
  state, seq}``; written whole by ``learn`` and by a router's save; on a
  shared store each router's online updates merge into it
  (:func:`push_gain`: natural parameters add, over the same vocabulary);
* ``live/stats`` (:data:`LIVE_KEY`) — the live FIB statistics, JSON
  (:func:`~atp_router.policy.learn.merge_live_state` when shared);
* ``learn/seqs`` (:data:`SEQ_KEY`) — a shared store's index, JSON: each key
  above → the highest sequence number written to it.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Mapping
from typing import Any

import msgspec

from atp_router.policy.bandit import ArmDelta
from atp_router.policy.learn import SharedArm, merge_arm_entry, merge_live_state
from atp_router.policy.textgain import GainDelta, TextGain

__all__ = ["ARM_PREFIX", "GAIN_PREFIX", "LIVE_KEY", "SEQ_KEY", "bump_index", "decode_arm", "decode_gain", "decode_live",
           "push_arm", "push_gain", "push_live"]

#: Store key prefix of the bandit arms (``bandit/<policy>/<arm>``).
ARM_PREFIX = "bandit/"
#: Store key prefix of the policies' text gain models (``gain/<policy>``).
GAIN_PREFIX = "gain/"
#: Store key of the live statistics.
LIVE_KEY = "live/stats"
#: Store key of a shared store's index of learned-state keys.
SEQ_KEY = "learn/seqs"


def push_arm(arm: SharedArm, delta: ArmDelta, rib: int, seq: int, old: bytes | None) -> bytes | None:
    """``Store.update`` function of one arm's entry (pure: it may run again).
    Shared entries are msgpack compressed by zlib (level 1: ~0.15 ms for an arm
    of 4,096 weights; an arm's untouched weights all hold the prior, so it
    shrinks many times — the bytes a shared store moves per sync)."""
    entry = merge_arm_entry(decode_arm(old), arm, delta, rib=rib, seq=seq)
    return old if entry is None else zlib.compress(msgspec.msgpack.encode(entry), 1)


def decode_arm(raw: bytes | None) -> dict[str, Any] | None:
    """A stored arm entry: msgpack (a single router's save), or zlib-compressed
    msgpack (shared; a zlib stream starts with 0x78, which no msgpack map does)."""
    if raw is None:
        return None
    try:
        if raw[:1] == b"\x78":
            raw = zlib.decompress(raw)
        entry = msgspec.msgpack.decode(raw)
    except (msgspec.DecodeError, zlib.error):
        return None
    return entry if isinstance(entry, dict) else None


def decode_gain(raw: bytes | None) -> dict[str, Any] | None:
    """A stored gain entry (msgpack map); None when unreadable."""
    if raw is None:
        return None
    try:
        entry = msgspec.msgpack.decode(raw)
    except msgspec.DecodeError:
        return None
    return entry if isinstance(entry, dict) else None


def push_gain(delta: GainDelta, seq: int, old: bytes | None) -> bytes | None:
    """``Store.update`` function of a policy's gain entry (pure): ``delta``
    merged into the stored model; the entry unchanged when there is none, it is
    unreadable or over another vocabulary (``learn`` fitted a new one: the
    router then adopts that)."""
    entry = decode_gain(old)
    if entry is None:
        return old
    try:
        model = TextGain.from_state(entry["state"])
        model.merge(delta)
    except (KeyError, TypeError, ValueError):
        return old
    return msgspec.msgpack.encode({**entry, "state": model.state(), "seq": seq})


def push_live(deltas: Mapping[str, Any], rib: int, agents: tuple[str, ...], seq: int,
               old: bytes | None) -> bytes:
    """``Store.update`` function of the live statistics (pure)."""
    return json.dumps(merge_live_state(decode_live(old), deltas, rib=rib, agents=agents, seq=seq)).encode()


def decode_live(raw: bytes | None) -> dict[str, Any] | None:
    """A stored JSON document (the live statistics, the index); None when unreadable."""
    if raw is None:
        return None
    try:
        doc = json.loads(raw)
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


def bump_index(written: Mapping[str, int], old: bytes | None) -> bytes:
    """``Store.update`` function of the ``learn/seqs`` index: each key's highest sequence number."""
    index = decode_live(old) or {}
    for key, seq in written.items():
        prev = index.get(key)
        index[key] = max(seq, prev) if isinstance(prev, int) else seq
    return json.dumps(index).encode()
