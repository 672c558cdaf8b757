"""MQTT for the router and the 2389 agent runtime: a trio-native MQTT 5 client on
paho-mqtt (see :mod:`atp.mqtt.client`)."""

from atp.mqtt.client import (
    BrokerAddress,
    ClientStatistics,
    ConnectError,
    Message,
    MQTTClient,
    MQTTError,
    Will,
    open_mqtt_client,
    parse_broker_url,
    tls_context,
)

__all__ = [
    "BrokerAddress",
    "ClientStatistics",
    "ConnectError",
    "MQTTClient",
    "MQTTError",
    "Message",
    "Will",
    "open_mqtt_client",
    "parse_broker_url",
    "tls_context",
]
