"""Side by side: the ATP router against LiteLLM's proxy as an OpenAI gateway (issue 10 item 5).

Run: ``python bench/bench_gateway.py [--seconds 8] [--rates 20,50] [--repeats 2]
[--closed-seconds 5] [--skip-litellm]``. Plain script, ≈ 4–5 min with the defaults
on 2 cores (plus a one-time install of LiteLLM, 1–2 min). What it does, printing
each step:

1. **LiteLLM**: uses ``bench/.venv-litellm/bin/litellm`` (git-ignored); when it is
   missing, creates that venv and ``pip install``\\s ``--litellm-spec`` (default
   the pinned ``litellm[proxy]`` from PyPI). If the install fails (offline) or the
   proxy does not start, the LiteLLM column is ``n/a``, as with ``--skip-litellm``.
2. Starts three server processes on free loopback ports:

   * a **mock OpenAI upstream** (this script with ``--mock-upstream PORT``: plain
     asyncio HTTP/1.1, keep-alive; ``POST /v1/chat/completions`` streams 6
     content chunks, a usage chunk and ``data: [DONE]`` as separate writes, or one
     JSON completion with ``stream: false``; ~0.1 ms of CPU a call, so the
     gateways' cost is not lost in the upstream's);
   * **LiteLLM's proxy**: ``litellm --config <tmp> --num_workers 1``, model ``m``
     → ``openai/m`` at the mock; a random ``LITELLM_MASTER_KEY`` (it refuses to
     start without one), no database, its defaults otherwise
     (``LITELLM_LOCAL_MODEL_COST_MAP=True``: no network at start);
   * the **ATP router**: ``atp-router --policies <tmp RIB> --state-dir <tmp>
     --no-watch``, one random bearer token (``ATP_ROUTER_TOKENS``, tenant
     ``bench``), one ``openai_compat`` model agent ``model.m`` at the mock,
     policy ``chat`` for task type ``chat``; the tenant open rate raised so the
     router's 50 opens/s default does not cap the closed loop. Its state
     (SQLite: stream logs, ledgers, audit) is durable as always; LiteLLM
     without a database writes nothing per request.

   Both gateways check a bearer key on every request (the WebSocket once, at
   the handshake).

3. Drives every target with **one** load generator (this process, trio + httpx /
   trio-websocket, the same request body everywhere), one target at a time:

   * ``direct``: the mock itself, ``POST /v1/chat/completions`` streaming;
   * ``LiteLLM``: the same request to the proxy;
   * ``ATP HTTP+SSE``: ``POST /v1/streams`` then ``GET /v1/streams/{id}/events``
     until the router ends it (FINAL, FIN);
   * ``ATP WebSocket``: one connection, sans-IO client ``Session`` + JSON
     ``FrameCodec`` (bench_router.py's ``WsClient``): SYN with the task, FINAL,
     our FIN; a session HB every 5 s while the connection idles;
   * ``ATP OpenAI ingress``: the same streaming request as ``direct`` to the
     router's ``/v1/chat/completions`` (model ``chat``).

   A task counts only when it completed whole (the mock's last token ``tok5`` and
   ``[DONE]``, or the FINAL, arrived). **Open loop**: at each ``--rates`` value, a
   task is started every 1/rate s for ``--seconds`` s whatever is in flight;
   latency is measured from the intended send time (queueing in the client
   included: no coordinated omission) and from the actual send. Repeats are
   interleaved (rate by rate, targets in a rotating order) and their samples
   pooled. **Closed loop**: 16 tasks in flight for ``--closed-seconds``;
   best of the repeats. Server processes' CPU (utime + stime of the process and
   its children, ``/proc/<pid>/stat``) per completed task over all runs, and RSS
   (``VmRSS`` of ``/proc/<pid>/status``) after warm-up ("idle") and after all the
   load. The client shares the 2 cores with the servers; its CPU per task is
   printed too.

The last line is ``GATEWAY p50_overhead_ms atp=<a> litellm=<l> tasks_per_s
atp=<x> litellm=<y>``: overhead = the gateway's p50 (from the intended send time,
at the highest rate, 50/s by default) minus direct's p50 in the same run, ATP
through its fastest ingress; tasks/s = the closed-loop maximum (ATP: its best
ingress). ``litellm=n/a`` when LiteLLM was skipped or could not run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Self

if TYPE_CHECKING:
    import subprocess
    from collections.abc import Mapping, Sequence

ROOT = Path(__file__).resolve().parents[1]
LITELLM_VENV = ROOT / "bench" / ".venv-litellm"
LITELLM_SPEC = "litellm[proxy]==1.108.7"

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello in six words."}]
IN_FLIGHT = 16
TARGETS = ("direct", "litellm", "atp_http", "atp_ws", "atp_openai")
LABELS = {"direct": "direct", "litellm": "LiteLLM", "atp_http": "ATP HTTP+SSE", "atp_ws": "ATP WebSocket",
          "atp_openai": "ATP OpenAI ingress"}
ATP_TARGETS = ("atp_http", "atp_ws", "atp_openai")


# --- the mock upstream (its own process) --------------------------------------------------


def run_mock(port: int) -> None:
    """A fast OpenAI-compatible upstream: plain asyncio, HTTP/1.1 keep-alive."""
    import asyncio

    def dumps(obj: object) -> bytes:
        return json.dumps(obj, separators=(",", ":")).encode()

    def chunk(b: bytes) -> bytes:
        return b"%x\r\n%s\r\n" % (len(b), b)

    base = {"id": "chatcmpl-mock", "object": "chat.completion.chunk", "created": 1_700_000_000, "model": "m"}
    usage = {"prompt_tokens": 40, "completion_tokens": 6, "total_tokens": 46}
    events = []
    for i in range(6):
        delta = {"role": "assistant", "content": f"tok{i} "} if i == 0 else {"content": f"tok{i} "}
        choice = {"index": 0, "delta": delta, "finish_reason": "stop" if i == 5 else None}
        events.append(chunk(b"data: " + dumps({**base, "choices": [choice]}) + b"\n\n"))
    events.append(chunk(b"data: " + dumps({**base, "choices": [], "usage": usage}) + b"\n\n"))
    events.append(chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
    stream_head = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
                   b"transfer-encoding: chunked\r\n\r\n")
    completion = dumps({"id": "chatcmpl-mock", "object": "chat.completion", "created": 1_700_000_000, "model": "m",
                        "choices": [{"index": 0, "finish_reason": "stop",
                                     "message": {"role": "assistant", "content": "".join(f"tok{i} " for i in range(6))}}],
                        "usage": usage})
    peers = 0

    def json_response(body: bytes, status: bytes = b"200 OK") -> bytes:
        return b"HTTP/1.1 %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
            status, len(body), body)

    async def read_chunked(reader: asyncio.StreamReader) -> bytes:
        parts = []
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            data = await reader.readexactly(size + 2)
            if size == 0:
                return b"".join(parts)
            parts.append(data[:-2])

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


def ensure_litellm(spec: str) -> Path | None:
    """The ``litellm`` executable of bench/.venv-litellm, installing ``spec`` there
    first when it is missing; None (with the reason printed) if that fails."""
    import subprocess

    exe = LITELLM_VENV / "bin" / "litellm"
    if exe.exists():
        print(f"LiteLLM: using {exe.relative_to(ROOT)}")
        return exe
    print(f"LiteLLM: not installed; creating {LITELLM_VENV.relative_to(ROOT)} and installing {spec} from PyPI "
          "(pip, 1-2 min) ...", flush=True)
    try:
        subprocess.run([sys.executable, "-m", "venv", str(LITELLM_VENV)], check=True)
        pip = [str(LITELLM_VENV / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
        r = subprocess.run([*pip, spec], capture_output=True, text=True, check=False)
    except (OSError, subprocess.CalledProcessError) as e:
        print(f"LiteLLM: install failed ({e}); its column is n/a (see --skip-litellm)")
        return None
    if r.returncode != 0 or not exe.exists():
        tail = "\n  ".join((r.stderr or r.stdout).strip().splitlines()[-5:])
        print(f"LiteLLM: pip install failed (exit {r.returncode}); its column is n/a:\n  {tail}")
        return None
    print("LiteLLM: installed")
    return exe


def litellm_version(exe: Path) -> str:
    import subprocess

    r = subprocess.run([str(exe.parent / "python"), "-c", "import importlib.metadata as m; print(m.version('litellm'))"],
                       capture_output=True, text=True, check=False)
    return r.stdout.strip() or "?"


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

    def __init__(self, urls: dict[str, str], keys: dict[str, str]):
        self.urls = urls
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
        self.atp_oa_body = json.dumps({"model": "chat", "messages": MESSAGES, "stream": True,
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
        body = self.atp_oa_body if target == "atp_openai" else self.oa_body
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
    """Start a task every 1/rate s for ``seconds`` s, whatever is in flight."""
    import trio

    lat_intended: list[float] = []
    lat_actual: list[float] = []
    failed = 0

    async def one(intended: float) -> None:
        nonlocal failed
        sent = trio.current_time()
        try:
            ok = await drivers.run(target)
        except Exception:  # noqa: BLE001 - a transport error is a failed task, counted
            ok = False
        end = trio.current_time()
        if ok:
            lat_intended.append((end - intended) * 1000)
            lat_actual.append((end - sent) * 1000)
        else:
            failed += 1

    n = int(rate * seconds)
    async with trio.open_nursery() as nursery:
        t0 = trio.current_time() + 0.05
        for i in range(n):
            intended = t0 + i / rate
            await trio.sleep_until(intended)
            nursery.start_soon(one, intended)
        nursery.cancel_scope.deadline = trio.current_time() + drain_s
    unfinished = n - len(lat_intended) - failed
    return {"intended": lat_intended, "actual": lat_actual, "failed": failed + unfinished, "sent": n}


async def closed_loop(drivers: Drivers, target: str, k: int, seconds: float) -> dict:
    """``k`` tasks in flight for ``seconds`` s: completed tasks per second."""
    import trio

    done = failed = 0
    stop = trio.current_time() + seconds

    async def worker() -> None:
        nonlocal done, failed
        while trio.current_time() < stop:
            try:
                ok = await drivers.run(target)
            except Exception:  # noqa: BLE001
                ok = False
            if ok:
                done += 1
            else:
                failed += 1

    t0 = trio.current_time()
    with trio.move_on_after(seconds + 30):
        async with trio.open_nursery() as nursery:
            for _ in range(k):
                nursery.start_soon(worker)
    return {"tasks": done, "failed": failed, "tasks_s": done / (trio.current_time() - t0)}


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


async def measure(args: argparse.Namespace, urls: dict[str, str], keys: dict[str, str], pids: dict[str, int],
                  mock_pid: int) -> dict:
    import time

    import trio

    targets = [t for t in TARGETS if t in urls]
    res: dict[str, dict] = {t: {"open": {r: {"intended": [], "actual": [], "failed": 0, "sent": 0}
                                         for r in args.rates},
                                "closed": [], "cpu": 0.0, "mock_cpu": 0.0, "client_cpu": 0.0, "tasks": 0}
                            for t in targets}

    def account(t: str, cpu0: float, mock0: float, cli0: float, tasks: int) -> None:
        res[t]["cpu"] += cpu_s(pids[t]) - cpu0
        res[t]["mock_cpu"] += cpu_s(mock_pid) - mock0
        res[t]["client_cpu"] += time.process_time() - cli0
        res[t]["tasks"] += tasks

    async with Drivers(urls, keys) as drivers:
        print("warm-up: 20 sequential tasks per target ...", flush=True)
        for t in targets:
            oks = [await drivers.run(t) for _ in range(20)]
            if not all(oks):
                raise SystemExit(f"warm-up: {oks.count(False)}/20 {LABELS[t]} tasks failed; is it up?")
        for t in targets:
            res[t]["rss_idle"] = rss_mb(pids[t])
        await trio.sleep(1.0)
        order = list(targets)
        for rep in range(args.repeats):
            for rate in args.rates:
                for t in order:
                    cpu0, mock0, cli0 = cpu_s(pids[t]), cpu_s(mock_pid), time.process_time()
                    r = await open_loop(drivers, t, rate, args.seconds, drain_s=max(10.0, args.seconds))
                    account(t, cpu0, mock0, cli0, len(r["intended"]))
                    o = res[t]["open"][rate]
                    o["intended"] += r["intended"]
                    o["actual"] += r["actual"]
                    o["failed"] += r["failed"]
                    o["sent"] += r["sent"]
                    print(f"  repeat {rep + 1} open {rate:g}/s {LABELS[t]:<20} p50 {pct(r['intended'], 50):7.2f} ms "
                          f"p99 {pct(r['intended'], 99):8.2f} ms  failed {r['failed']}", flush=True)
                    await trio.sleep(0.5)
                order = order[1:] + order[:1]
            for t in order:
                cpu0, mock0, cli0 = cpu_s(pids[t]), cpu_s(mock_pid), time.process_time()
                r = await closed_loop(drivers, t, IN_FLIGHT, args.closed_seconds)
                account(t, cpu0, mock0, cli0, r["tasks"])
                res[t]["closed"].append(r)
                print(f"  repeat {rep + 1} closed {IN_FLIGHT} in flight {LABELS[t]:<20} {r['tasks_s']:7.1f} tasks/s "
                      f"failed {r['failed']}", flush=True)
                await trio.sleep(0.5)
            order = order[1:] + order[:1]
        await trio.sleep(1.0)
        for t in targets:
            res[t]["rss_after"] = rss_mb(pids[t])
    return res


def report(args: argparse.Namespace, res: dict, litellm_note: str, took_s: float) -> None:
    cols = list(TARGETS)
    width = 20

    def line(label: str, cells: list[str]) -> None:
        print(f"{label:<34}" + "".join(f"{c:>{width}}" for c in cells))

    def cell(t: str, fn) -> str:
        return fn(res[t]) if t in res else "n/a"

    def ms(x: float) -> str:
        return "-" if math.isnan(x) else f"{x:.2f}"

    print(f"\nGateway side by side: mock upstream (6 chunks + usage + [DONE]), streaming; open loop "
          f"{args.seconds:g} s per rate x {args.repeats} interleaved repeats (samples pooled); closed loop "
          f"{IN_FLIGHT} in flight {args.closed_seconds:g} s, best of {args.repeats}. {litellm_note}")
    line("", [LABELS[t] for t in cols])
    for rate in args.rates:
        for q in (50, 99):
            line(f"p{q} ms @ {rate:g}/s (from intended)",
                 [cell(t, lambda r, rate=rate, q=q: ms(pct(r["open"][rate]["intended"], q))) for t in cols])
        for q in (50, 99):
            line(f"p{q} ms @ {rate:g}/s (from actual send)",
                 [cell(t, lambda r, rate=rate, q=q: ms(pct(r["open"][rate]["actual"], q))) for t in cols])
        line(f"failed / sent @ {rate:g}/s",
             [cell(t, lambda r, rate=rate: f"{r['open'][rate]['failed']}/{r['open'][rate]['sent']}") for t in cols])
    line(f"closed loop tasks/s ({IN_FLIGHT} in flight)", [cell(t, lambda r: f"{max(c['tasks_s'] for c in r['closed']):.1f}")
                                                   for t in cols])
    line("server CPU ms/task", [cell(t, lambda r: f"{r['cpu'] / max(r['tasks'], 1) * 1000:.2f}") for t in cols])
    line("  + mock upstream CPU ms/task", [cell(t, lambda r: f"{r['mock_cpu'] / max(r['tasks'], 1) * 1000:.2f}")
                                          for t in cols])
    line("  + load generator CPU ms/task", [cell(t, lambda r: f"{r['client_cpu'] / max(r['tasks'], 1) * 1000:.2f}")
                                           for t in cols])
    line("server RSS MB idle -> after load", [cell(t, lambda r: f"{r['rss_idle']:.0f} -> {r['rss_after']:.0f}")
                                              for t in cols])
    print("server = the process serving that column (direct: the mock; ATP columns: the same router process); "
          "CPU over every run of the column.")

    top = max(args.rates)
    p50 = {t: pct(res[t]["open"][top]["intended"], 50) for t in res}
    best_p50 = min(ATP_TARGETS, key=lambda t: p50[t])
    best_tps = max(ATP_TARGETS, key=lambda t: max(c["tasks_s"] for c in res[t]["closed"]))
    print(f"ATP: fastest ingress at {top:g}/s by p50 {LABELS[best_p50]}; most tasks/s closed loop {LABELS[best_tps]}. "
          f"Measured in {took_s:.0f} s.")
    atp_oh = p50[best_p50] - p50["direct"]
    atp_tps = max(c["tasks_s"] for c in res[best_tps]["closed"])
    if "litellm" in res:
        ll_oh = f"{p50['litellm'] - p50['direct']:.2f}"
        ll_tps = f"{max(c['tasks_s'] for c in res['litellm']['closed']):.1f}"
    else:
        ll_oh = ll_tps = "n/a"
    print(f"GATEWAY p50_overhead_ms atp={atp_oh:.2f} litellm={ll_oh} tasks_per_s atp={atp_tps:.1f} litellm={ll_tps}")


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


def bench(args: argparse.Namespace) -> int:
    import secrets
    import tempfile
    import time

    import trio

    print(f"bench_gateway: Python {sys.version.split()[0]}, {os.cpu_count()} CPUs, load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    exe = None if args.skip_litellm else ensure_litellm(args.litellm_spec)
    litellm_note = "LiteLLM skipped (--skip-litellm)." if args.skip_litellm else "LiteLLM not available."
    procs: list[subprocess.Popen] = []
    tmp = Path(tempfile.mkdtemp(prefix="bench_gateway_"))
    env = clean_env()
    # Both gateways authenticate a bearer key on every request (LiteLLM refuses to start without a master key).
    atp_key, ll_key = "atp-" + secrets.token_hex(32), "sk-" + secrets.token_hex(32)
    keys = {"atp_http": atp_key, "atp_ws": atp_key, "atp_openai": atp_key, "litellm": ll_key}
    try:
        started = start_mock(tmp, procs, announce="starting")
        if started is None:
            return 1
        mock_port, mock = started
        urls = {"direct": f"http://127.0.0.1:{mock_port}"}

        router = start_router(tmp, RIB.format(port=mock_port), procs, key=atp_key, announce="starting",
                              args=["--tenant-rate-per-s", "100000", "--tenant-rate-burst", "100000"])
        if router is None:
            return 1
        urls |= {"atp_http": router.url, "atp_ws": router.ws_url, "atp_openai": router.url}
        pids = {"direct": mock.pid, "atp_http": router.proc.pid, "atp_ws": router.proc.pid,
                "atp_openai": router.proc.pid}

        if exe is not None:
            version = litellm_version(exe)
            ll_port = free_port()
            (tmp / "litellm.yaml").write_text(LITELLM_CONFIG.format(port=mock_port))
            cmd = [str(exe), "--config", str(tmp / "litellm.yaml"), "--host", "127.0.0.1", "--port", str(ll_port),
                   "--num_workers", "1"]
            print(f"starting: LiteLLM {version}: litellm --config <tmp>/litellm.yaml --port {ll_port} --num_workers 1",
                  flush=True)
            llog = tmp / "litellm.log"
            ll_env = env | {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR",
                            "LITELLM_TELEMETRY": "False", "LITELLM_MASTER_KEY": ll_key}
            ll = spawn(cmd, llog, env=ll_env, cwd=tmp)
            procs.append(ll)
            if wait_up(f"http://127.0.0.1:{ll_port}/health/liveliness", ll, llog, 120):
                urls["litellm"] = f"http://127.0.0.1:{ll_port}"
                pids["litellm"] = ll.pid
                litellm_note = f"LiteLLM {version}, 1 worker, defaults."
            else:
                litellm_note = "LiteLLM did not start (column n/a)."
        t0 = time.monotonic()
        res = trio.run(measure, args, urls, keys, pids, mock.pid)
        report(args, res, litellm_note, time.monotonic() - t0)
        return 0
    finally:
        stop_procs(procs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=8.0, help="open-loop seconds per rate, target and repeat")
    ap.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], default=[20.0, 50.0],
                    help="open-loop offered rates, tasks/s, comma-separated (the last line uses the highest)")
    ap.add_argument("--repeats", type=int, default=2, help="interleaved repeats (open-loop samples pooled)")
    ap.add_argument("--closed-seconds", type=float, default=5.0, help=f"closed loop ({IN_FLIGHT} in flight) seconds")
    ap.add_argument("--skip-litellm", action="store_true", help="no LiteLLM column (offline); last line litellm=n/a")
    ap.add_argument("--litellm-spec", default=LITELLM_SPEC, help="what pip installs into bench/.venv-litellm")
    ap.add_argument("--mock-upstream", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.mock_upstream:
        run_mock(args.mock_upstream)
        return 0
    return bench(args)


if __name__ == "__main__":
    sys.exit(main())
