"""The trio MQTT client (atp_router.mqtt) against a real mosquitto 2.0 broker started by the
test (tests/peers.py): QoS 1 with PUBACK/SUBACK awaited, retained messages and
message expiry, the LWT, back-pressure, persistent sessions across a broker restart,
reconnection, manual acknowledgement, packet-size limits, TLS and passwords."""

from __future__ import annotations

import uuid

import pytest
import trio

from atp_router.mqtt import (
    ConnectError,
    MQTTClient,
    MQTTError,
    Will,
    open_mqtt_client,
    parse_broker_url,
)
from atp_router.mqtt.client import BrokerAddress, tls_context
from tests.peers import (
    MOSQUITTO_TLS,
    free_port,
    make_test_pki,
    mosquitto_passwd,
    start_mosquitto,
)


@pytest.fixture(scope="module")
def broker():
    with start_mosquitto() as b:
        yield b


@pytest.fixture
def fresh_broker():
    """A broker of its own, for tests that stop or restart it."""
    with start_mosquitto() as b:
        yield b


def topic() -> str:
    return f"/test/{uuid.uuid4().hex}"


async def take(client: MQTTClient, n: int, timeout_s: float = 5.0) -> list:
    out = []
    with trio.fail_after(timeout_s):
        async for m in client.messages:
            out.append(m)
            if len(out) == n:
                return out
    return out


async def nothing_more(client: MQTTClient, wait_s: float = 0.3) -> None:
    with trio.move_on_after(wait_s):
        m = await client.messages.receive()
        pytest.fail(f"unexpected message {m}")


# ------------------------------------------------------------------ URLs (pure)

def test_broker_urls():
    assert parse_broker_url("mqtt://127.0.0.1") == BrokerAddress("127.0.0.1", 1883, False)
    assert parse_broker_url("mqtts://broker.example:9999") == BrokerAddress("broker.example", 9999, True)
    assert parse_broker_url("tcp://h:1") == BrokerAddress("h", 1, False)
    for bad, words in [("http://h", "mqtt://"), ("mqtt://user:pw@h", "credentials"), ("mqtt://", "no host"),
                       ("mqtt://h/x", "no path"), ("mqtt://h:99999", "bad port")]:
        with pytest.raises(ValueError, match=words):
            parse_broker_url(bad)


# ------------------------------------------------------------------ QoS 1, retained, LWT

async def test_qos1_publish_waits_for_puback_and_messages_arrive_in_order(broker):
    t = topic()
    async with open_mqtt_client(broker.host, broker.port) as sub, open_mqtt_client(broker.host, broker.port) as pub:
        assert await sub.subscribe(t + "/#", qos=1) == 1
        for i in range(100):
            await pub.publish(f"{t}/x", b"m%d" % i, qos=1)
        # Returned only after each PUBACK: nothing is pending.
        assert pub.statistics().pending_publishes == 0
        got = await take(sub, 100)
        assert [m.payload for m in got] == [b"m%d" % i for i in range(100)]
        assert {(m.qos, m.retain) for m in got} == {(1, False)}


async def test_retained_message_reaches_late_subscribers_and_expires(broker):
    t = topic()
    async with open_mqtt_client(broker.host, broker.port) as pub:
        await pub.publish(t, b"kept", qos=1, retain=True)
        await pub.publish(t + "/short", b"gone soon", qos=1, retain=True, message_expiry_s=1)
        async with open_mqtt_client(broker.host, broker.port) as late:
            await late.subscribe(t + "/#")  # matches t itself too
            got = await take(late, 2)
            assert {(m.topic, m.payload, m.retain) for m in got} == {(t, b"kept", True),
                                                                   (t + "/short", b"gone soon", True)}
            # A live subscriber sees a retained publish with retain=False, unless it
            # asked for Retain-As-Published.
            async with open_mqtt_client(broker.host, broker.port) as rap:
                await rap.subscribe(t, retain_as_published=True)
                await take(rap, 1)  # the retained one
                await pub.publish(t, b"live", qos=1, retain=True)
                assert (await take(late, 1))[0].retain is False
                assert (await take(rap, 1))[0].retain is True
        await trio.sleep(1.2)
        async with open_mqtt_client(broker.host, broker.port) as later:
            await later.subscribe(t + "/#")
            await later.round_trip()
            assert [m.payload for m in await take(later, 1)] == [b"live"]
            await nothing_more(later, 0.2)  # the expired retained message is gone
        await pub.publish(t, b"", qos=1, retain=True)  # clear


async def test_will_is_published_on_a_crash_but_not_on_disconnect(broker):
    t = topic()
    async with open_mqtt_client(broker.host, broker.port) as watch:
        await watch.subscribe(t)
        async with open_mqtt_client(broker.host, broker.port, will=Will(t, b"dead", retain=False)):
            pass  # DISCONNECT: the broker drops the will
        await nothing_more(watch, 0.3)
        async with open_mqtt_client(broker.host, broker.port, will=Will(t, b"dead", retain=False)) as c:
            c.abort()  # the socket closes without DISCONNECT, as when the process is killed
            [m] = await take(watch, 1)
            assert m.payload == b"dead"


# ------------------------------------------------------------------ back-pressure

async def test_full_channel_stops_reading_and_loses_nothing(broker):
    t = topic()
    async with open_mqtt_client(broker.host, broker.port, queue_size=2) as sub, \
            open_mqtt_client(broker.host, broker.port) as pub:
        await sub.subscribe(t)
        for i in range(300):
            await pub.publish(t, b"%d" % i, qos=1)
        await trio.sleep(0.2)
        st = sub.statistics()
        assert st.queued == 2 and st.connected
        got = await take(sub, 300)
        assert [int(m.payload) for m in got] == list(range(300))
        # The read loop survived: the next message still arrives.
        await pub.publish(t, b"after", qos=1)
        assert (await take(sub, 1))[0].payload == b"after"


# ------------------------------------------------------------------ sessions and restarts

async def test_persistent_session_keeps_queued_messages_across_a_broker_restart(fresh_broker):
    b, t = fresh_broker, topic()
    session = {"client_id": f"persist-{uuid.uuid4().hex[:8]}", "clean_start": False, "session_expiry_s": 300}
    async with open_mqtt_client(b.host, b.port, **session) as sub:
        await sub.subscribe(t)
    async with open_mqtt_client(b.host, b.port) as pub:
        for i in range(5):
            await pub.publish(t, b"queued %d" % i, qos=1)
    b.restart()  # SIGTERM: mosquitto saves sessions and their queued messages
    async with open_mqtt_client(b.host, b.port, **session) as sub:
        assert sub.statistics().session_present
        got = await take(sub, 5)  # no new SUBSCRIBE: the session brought the subscription back
        assert [m.payload for m in got] == [b"queued %d" % i for i in range(5)]


async def test_publish_during_a_broker_outage_completes_after_reconnect(fresh_broker):
    b, t = fresh_broker, topic()
    async with open_mqtt_client(b.host, b.port, client_id="sub-" + uuid.uuid4().hex[:8], clean_start=False,
                                session_expiry_s=300) as sub, \
            open_mqtt_client(b.host, b.port, reconnect_delay_s=(0.05, 0.2)) as pub:
        await sub.subscribe(t)
        b.stop()
        with trio.fail_after(5):
            while pub.connected:
                await trio.sleep(0.01)
        done = trio.Event()

        async def publish() -> None:
            await pub.publish(t, b"sent while the broker was down", qos=1)
            done.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(publish)
            await trio.sleep(0.3)
            assert not done.is_set()  # no PUBACK without a broker
            b.start()
            with trio.fail_after(10):
                await done.wait()
        [m] = await take(sub, 1, timeout_s=10)
        assert m.payload == b"sent while the broker was down"
        assert pub.statistics().connections == 2


async def test_clean_session_client_resubscribes_after_reconnect(fresh_broker):
    b, t = fresh_broker, topic()
    async with open_mqtt_client(b.host, b.port, reconnect_delay_s=(0.05, 0.2)) as sub:
        await sub.subscribe(t)
        b.restart()
        async with open_mqtt_client(b.host, b.port) as pub:
            with trio.fail_after(10):
                while not sub.connected:
                    await trio.sleep(0.02)
            await sub.round_trip()  # the re-SUBSCRIBE went out before this
            await pub.publish(t, b"after restart", qos=1)
            assert (await take(sub, 1))[0].payload == b"after restart"
        assert not sub.statistics().session_present


async def test_manual_ack_redelivers_until_acknowledged(broker):
    t = topic()
    session = {"client_id": f"ack-{uuid.uuid4().hex[:8]}", "clean_start": False, "session_expiry_s": 60,
               "manual_ack": True, "reconnect_delay_s": (0.05, 0.2)}
    async with open_mqtt_client(broker.host, broker.port, **session) as sub, \
            open_mqtt_client(broker.host, broker.port) as pub:
        await sub.subscribe(t)
        await pub.publish(t, b"task", qos=1)
        first = (await take(sub, 1))[0]
        assert not first.dup
        sub.abort()  # lost before the PUBACK: the broker must send it again
        again = (await take(sub, 1))[0]
        assert again.payload == b"task" and again.dup
        again.ack()
        await sub.round_trip()
        sub.abort()
        await trio.sleep(0.3)
        await sub.round_trip()
        await nothing_more(sub, 0.2)


# ------------------------------------------------------------------ limits and security

async def test_packet_size_limits(broker):
    t = topic()
    async with open_mqtt_client(broker.host, broker.port, max_packet_bytes=1024) as small, \
            open_mqtt_client(broker.host, broker.port) as pub:
        with pytest.raises(MQTTError, match="exceeds"):
            await small.publish(t, b"x" * 2000)
        await small.subscribe(t)
        await pub.publish(t, b"y" * 2000, qos=1)  # larger than the subscriber accepts: not delivered
        await pub.publish(t, b"small", qos=1)
        assert (await take(small, 1))[0].payload == b"small"


async def test_connection_refused_is_a_connect_error():
    port = free_port()
    with pytest.raises(ConnectError, match="cannot connect"):
        async with open_mqtt_client("127.0.0.1", port, connect_timeout_s=0.3):
            pass


async def test_tls_verifies_the_broker_certificate(tmp_path):
    files = make_test_pki(tmp_path)
    with start_mosquitto(extra_config=MOSQUITTO_TLS, files=files) as b:
        ok = tls_context(ca_file=str(tmp_path / "ca.pem"))
        async with open_mqtt_client(b.host, b.port, tls=ok) as c:
            t = topic()
            await c.subscribe(t)
            await c.publish(t, b"over TLS", qos=1)
            assert (await take(c, 1))[0].payload == b"over TLS"
        # The system trust store does not know the test CA: the handshake must fail.
        with pytest.raises(ConnectError, match="certificate verification failed"):
            async with open_mqtt_client(b.host, b.port, tls=tls_context(), connect_timeout_s=0.5):
                pass


async def test_password_authentication(tmp_path):
    with start_mosquitto(extra_config="allow_anonymous false\npassword_file {dir}/passwd\n",
                         files={"passwd": b""}) as b:
        b.stop()
        mosquitto_passwd(b.workdir / "passwd", "agent", "s3cret-pw")
        b.start()
        async with open_mqtt_client(b.host, b.port, username="agent", password="s3cret-pw") as c:
            assert await c.subscribe("/allowed/x") == 1
        with pytest.raises(ConnectError) as ei:
            async with open_mqtt_client(b.host, b.port, username="agent", password="wrong", connect_timeout_s=0.5):
                pass
        assert "Not authorized" in str(ei.value) or "password" in str(ei.value)
        assert "s3cret" not in str(ei.value) and "wrong" not in str(ei.value)
