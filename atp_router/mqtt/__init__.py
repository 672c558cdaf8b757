"""MQTT for the router and the 2389 agent runtime: a trio-native MQTT 5 client on
paho-mqtt (see :mod:`atp_router.mqtt.client`, whose public API this package re-exports),
and the 2389 Agent Protocol both sides speak over it (:mod:`atp_router.mqtt.agent_protocol`,
sans-IO)."""

from atp_router.mqtt import client
from atp_router.mqtt.client import *  # noqa: F403  (re-export: __all__ below is the client's)

__all__ = client.__all__
