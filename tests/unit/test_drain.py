"""Draining before a stop (``atp_router.runtime.controlplane.drain``), on a real
``atp-router`` process and a real loopback model server (tests.replay_server's
BillingModel, which holds its calls while told to): on SIGTERM the running
stream finishes with its FINAL, a new stream is refused ``503`` ``EAGENTDOWN``
with ``Retry-After``, ``/v1/ready`` fails its ``drain`` check, and the process
exits 0 once nothing runs; a second SIGTERM stops it at once. Once the stop is
under way, a further signal is ignored (``stop_signal_receiver``), also in the
interpreter's last moments, on a plain Python process that stops as the router does."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import atp
import httpx
import trio

from tests import helpers
from tests.replay_server import BillingModel, serve
from tests.scale.common import TOKENS, summarize_rib

TOKEN = TOKENS["alice"]
TASK = {"task_type": "summarize"}
#: The upper bound of every wait on an event here, s: generous, for a loaded machine (a wait ends at its event).
WAIT_S = 120
#: ``--drain-s``: far beyond any wait, so a stop seen within one was not the drain deadline's.
DRAIN_S = "3600"


async def _router(tmp_path: Path, model: BillingModel, *extra: str) -> helpers.RouterProcess:
    rib = tmp_path / "rib.yaml"
    rib.write_text(summarize_rib(model.url))
    proc = helpers.RouterProcess("--policies", rib, "--state-dir", tmp_path / "state", "--http-port", "0",
                                 "--ws-port", "0", *extra, env={"ATP_ROUTER_TOKENS": f"alice:{TOKEN}"})
    await proc.wait_listening()
    return proc


async def _exit_code(proc: helpers.RouterProcess) -> int:
    with trio.fail_after(WAIT_S):
        while proc.proc.poll() is None:
            await trio.sleep(0.05)
    return proc.proc.returncode


async def _logged(proc: helpers.RouterProcess, text: str) -> None:
    """Wait until the router's output (read by a thread, also after it exited) has a line with ``text``."""
    with trio.move_on_after(WAIT_S):
        while not any(text in line for line in proc.lines):
            await trio.sleep(0.05)
    assert any(text in line for line in proc.lines), (text, proc.lines)


async def _held_stream(url: str, model: BillingModel) -> str:
    """Open a stream whose model call waits in ``model`` (its hold is set); its id."""
    async with atp.Client(url, TOKEN) as c:
        _, st = await c.open_stream(task=TASK, content={"text": "summarise this"})
    with trio.fail_after(WAIT_S):
        while model.waiting < 1:
            await trio.sleep(0.02)
    return st.stream_id


async def _follow_then_release(url: str, stream_id: str, model: BillingModel) -> list[str]:
    """Follow the stream's events (as its client does, live) and release the held
    model call once the follower is attached; the event types through FIN."""
    types: list[str] = []
    async with atp.Client(url, TOKEN) as c, trio.open_nursery() as n:
        async def follow() -> None:
            async for ev in c.events(stream_id):
                types.append(ev.type)

        n.start_soon(follow)
        with trio.fail_after(WAIT_S):
            while not types:  # the SYN+ACK replayed: the follower is attached
                await trio.sleep(0.02)
        assert model.hold is not None
        model.hold.set()
    return types


async def test_sigterm_lets_the_running_stream_finish_and_refuses_new_ones(nursery, tmp_path):
    model = await serve(nursery, BillingModel(billed=100))
    model.hold = trio.Event()
    proc = await _router(tmp_path, model, "--drain-s", DRAIN_S)
    try:
        stream_id = await _held_stream(proc.url, model)
        proc.proc.send_signal(signal.SIGTERM)
        async with httpx.AsyncClient(base_url=proc.url, headers={"Authorization": f"Bearer {TOKEN}"}) as h:
            with trio.fail_after(WAIT_S):
                while True:  # the signal is handled asynchronously
                    ready = await h.get("/v1/ready")
                    if ready.status_code == 503:
                        break
                    await trio.sleep(0.05)
            checks = {c["name"]: c for c in ready.json()["checks"]}
            assert not checks["drain"]["ok"] and "1 streams still running" in checks["drain"]["reason"], checks
            assert ready.headers["retry-after"]
            refused = await h.post("/v1/streams", json={"task": TASK, "content": {"text": "another"}})
            assert refused.status_code == 503, refused.text
            assert "EAGENTDOWN" in refused.text and "draining" in refused.text
            assert refused.headers.get("retry-after") == "1"
            assert proc.proc.poll() is None  # still serving the running stream
            with trio.fail_after(WAIT_S):
                types = await _follow_then_release(proc.url, stream_id, model)
        assert types[-2:] == ["FINAL", "FIN"], types
        assert await _exit_code(proc) == 0
        await _logged(proc, "stopping: every stream finished")
        assert len(model.requests) == 1  # the refused open never reached the model
    finally:
        proc.stop()


async def test_a_second_sigterm_stops_at_once(nursery, tmp_path):
    model = await serve(nursery, BillingModel(billed=100))
    model.hold = trio.Event()
    proc = await _router(tmp_path, model, "--drain-s", DRAIN_S)
    try:
        await _held_stream(proc.url, model)
        proc.proc.send_signal(signal.SIGTERM)
        await _logged(proc, "draining: 1 streams running")
        proc.proc.send_signal(signal.SIGTERM)
        assert await _exit_code(proc) == 0  # not the drain deadline: the line below says why
        await _logged(proc, "stopping: a second signal")
    finally:
        model.hold.set()
        proc.stop()


async def test_without_streams_sigterm_stops_at_once(nursery, tmp_path):
    model = await serve(nursery, BillingModel(billed=100))
    proc = await _router(tmp_path, model, "--drain-s", DRAIN_S)
    try:
        proc.proc.send_signal(signal.SIGTERM)
        assert await _exit_code(proc) == 0
        await _logged(proc, "stopping: 0 streams running, no drain")
    finally:
        proc.stop()


async def test_workers_drain_behind_their_supervisor(nursery, tmp_path):
    """``--workers 2``: the supervisor's SIGTERM reaches the workers, which drain:
    the held stream (on whichever worker took it) ends with its FINAL, then all exit 0."""
    model = await serve(nursery, BillingModel(billed=100))
    model.hold = trio.Event()
    proc = await _router(tmp_path, model, "--drain-s", DRAIN_S, "--workers", "2")
    try:
        stream_id = await _held_stream(proc.url, model)
        proc.proc.send_signal(signal.SIGTERM)
        await _logged(proc, "draining: 1 streams running")
        with trio.fail_after(WAIT_S):
            types = await _follow_then_release(proc.url, stream_id, model)
        assert types[-2:] == ["FINAL", "FIN"], types
        assert await _exit_code(proc) == 0
    finally:
        model.hold.set()
        proc.stop()


#: A process that stops as a router does (``stop_signal_receiver``: the first
#: SIGTERM received in the block), then meets one more SIGTERM where ``WHEN`` says.
_STOPPING = """
import os, signal, trio
from trio._signals import get_pending_signal_count  # trio's helper for tests
from atp_router.runtime.controlplane.drain import stop_signal_receiver

async def main():
    with stop_signal_receiver() as signals:
        os.kill(os.getpid(), signal.SIGTERM)
        async for _ in signals:
            break
        if WHEN == "as the block is left":  # received by trio, not taken: re-delivered when the block is left
            os.kill(os.getpid(), signal.SIGTERM)
            with trio.fail_after(60):
                while not get_pending_signal_count(signals):
                    await trio.sleep(0.01)

class LastWords:
    def __del__(self, kill=os.kill, pid=os.getpid(), write=os.write):
        if WHEN == "in the finalization":  # module teardown: after Python reset its signal handlers
            kill(pid, signal.SIGTERM)
        write(1, b"finalized\\n")

last_words = LastWords()
trio.run(main)
"""


def _stopping(when: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", f"WHEN = {when!r}\n" + _STOPPING], capture_output=True, text=True,
                          check=False, timeout=120, cwd=Path(__file__).resolve().parents[2])


def test_a_signal_that_comes_as_the_stop_block_is_left_is_ignored():
    r = _stopping("as the block is left")
    assert (r.returncode, r.stdout) == (0, "finalized\n"), r
    assert "already stopping; signal 15 ignored" in r.stderr, r.stderr


def test_a_signal_during_the_interpreters_finalization_is_ignored():
    r = _stopping("in the finalization")
    assert (r.returncode, r.stdout) == (0, "finalized\n"), r
