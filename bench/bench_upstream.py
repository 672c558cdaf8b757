"""CPU per next-hop call of the ``openai_compat`` adapter against a fast keep-alive
upstream: httpx against the lean client (issue 25 item 3), and reading each response
to the end of its body or not (issue 10).

Run: ``python bench/bench_upstream.py [--calls N] [--rounds R]``. Plain script,
~20 s on 2 cores. Starts a mock OpenAI upstream in a subprocess (Starlette under
hypercorn, HTTP/1.1 keep-alive, a streamed chat completion of 6 content chunks,
a usage chunk and ``data: [DONE]``, then the body's last chunk 2 ms later, the
way llama-cpp-python's server ends its streams), then in this process, alternating rounds:

* **floor**: httpx streaming the same request and reading it to the end (no
  adapter): what any client pays;
* **lean**: the lean client (:mod:`atp_router.adapters.upstream`) streaming the
  same request and scanning its SSE events to the end of the body (no adapter);
* **adapter_httpx**: ``OpenAICompatAdapter.stream()`` on httpx (``lean_upstream=False``,
  the old path; reads on past ``[DONE]`` to the end of the body);
* **adapter_lean**: the same adapter on the lean client (its default);
* **adapter, abandon at [DONE]**: httpx with the drain turned off
  (``_DRAIN_AFTER_DONE_S = 0``): httpcore closes the connection and every call
  opens a new one (issue 10).

Prints, per path, the median over rounds (never the best) of CPU µs per call (this
thread's CPU time) and of the TCP connections opened per call (new connections seen
by the upstream), the load average, and last
``UPSTREAM cpu_us_per_call httpx=<a> lean=<b> adapter_httpx=<c> adapter_lean=<d>``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import trio

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from atp_router.adapters import openai_compat, upstream  # noqa: E402
from atp_router.adapters.base import Prompt  # noqa: E402
from atp_router.adapters.local_model import is_up  # noqa: E402

UPSTREAM = textwrap.dedent('''
    import json, sys
    import trio
    from hypercorn.config import Config
    from hypercorn.trio import serve
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    PEERS = set()

    def chunk(content=None, usage=None):
        obj = {"id": "c1", "object": "chat.completion.chunk", "model": "m",
               "choices": [] if content is None else [{"index": 0, "delta": {"content": content}}]}
        if usage:
            obj["usage"] = usage
        return "data: " + json.dumps(obj) + "\\n\\n"

    async def completions(request):
        PEERS.add(request.scope["client"])
        await request.body()
        async def body():
            for i in range(6):
                yield chunk(f"tok{i} ")
            yield chunk(usage={"prompt_tokens": 40, "completion_tokens": 6})
            yield "data: [DONE]\\n\\n"
            await trio.sleep(0.002)  # the server's clean-up before the body's last chunk, as llama.cpp's server does
        return StreamingResponse(body(), media_type="text/event-stream")

    async def models(request):
        return JSONResponse({"data": [{"id": "m"}], "connections": len(PEERS)})

    app = Starlette(routes=[Route("/v1/chat/completions", completions, methods=["POST"]),
                            Route("/v1/models", models)])
    cfg = Config(); cfg.bind = ["127.0.0.1:" + sys.argv[1]]; cfg.loglevel = "ERROR"
    trio.run(serve, app, cfg)
''')

PROMPT = Prompt(task_type="summarize", content={"text": "hello"})


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _connections(base: str) -> int:
    return httpx.get(base + "/models").json()["connections"]


async def _floor(base: str, calls: int) -> float:
    body = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "stream": True}
    async with httpx.AsyncClient(base_url=base) as client:
        t0 = time.thread_time()
        for _ in range(calls):
            async with client.stream("POST", "/chat/completions", json=body) as r:
                async for _line in r.aiter_lines():
                    pass
        return (time.thread_time() - t0) / calls


async def _lean(base: str, calls: int) -> float:
    body = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "stream": True}
    client = upstream.UpstreamClient(timeout_s=10)
    try:
        t0 = time.thread_time()
        for _ in range(calls):
            async with upstream.open_upstream(client, "POST", base + "/chat/completions", json=body) as r:
                async for _data in upstream.sse_data(r):
                    pass
        return (time.thread_time() - t0) / calls
    finally:
        await client.aclose()


async def _adapter(base: str, calls: int, drain: bool, lean: bool) -> float:
    saved = openai_compat._DRAIN_AFTER_DONE_S
    openai_compat._DRAIN_AFTER_DONE_S = saved if drain else 0.0
    adapter = openai_compat.OpenAICompatAdapter("bench", base_url=base, model="m", cost_in_per_mtok=1.0,
                                                cost_out_per_mtok=1.0, max_out_tokens=16, timeout_ms=10_000,
                                                ctx_tokens=4096, lean_upstream=lean)
    try:
        t0 = time.thread_time()
        for _ in range(calls):
            async for _frag in adapter.stream(PROMPT):
                pass
        return (time.thread_time() - t0) / calls
    finally:
        openai_compat._DRAIN_AFTER_DONE_S = saved
        await adapter.aclose()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    port = _free_port()
    base = f"http://127.0.0.1:{port}/v1"
    proc = subprocess.Popen([sys.executable, "-c", UPSTREAM, str(port)], env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        for _ in range(100):
            if is_up(base):
                break
            time.sleep(0.1)
        names = ("floor", "lean", "adapter_httpx", "adapter_lean", "abandon")
        results: dict[str, list[float]] = {name: [] for name in names}
        conns: dict[str, list[float]] = {name: [] for name in names}
        loads: list[float] = []
        for _ in range(args.rounds):
            loads.append(os.getloadavg()[0])
            for name in names:
                before = _connections(base)
                if name == "floor":
                    cpu = trio.run(_floor, base, args.calls)
                elif name == "lean":
                    cpu = trio.run(_lean, base, args.calls)
                else:
                    cpu = trio.run(_adapter, base, args.calls, name != "abandon", name == "adapter_lean")
                conns[name].append((_connections(base) - before) / args.calls)
                results[name].append(cpu * 1e6)
        print(f"openai_compat next-hop call, mock upstream (6 chunks, keep-alive), {args.calls} sequential calls "
              f"x {args.rounds} interleaved rounds, Python {sys.version.split()[0]}, "
              f"load avg (1 min) per round {' '.join(f'{x:.2f}' for x in loads)}")
        print(f"{'path':<40} {'CPU µs/call (median)':>21} {'new connections/call':>22}")
        labels = {"floor": "httpx, read to the end (floor)", "lean": "lean client, read to the end",
                  "adapter_httpx": "adapter on httpx (old path)", "adapter_lean": "adapter on the lean client",
                  "abandon": "adapter on httpx, abandon at [DONE]"}
        med = {name: statistics.median(results[name]) for name in names}
        for name, label in labels.items():
            print(f"{label:<40} {med[name]:>21.0f} {statistics.median(conns[name]):>22.2f}")
        print(f"UPSTREAM cpu_us_per_call httpx={med['floor']:.0f} lean={med['lean']:.0f} "
              f"adapter_httpx={med['adapter_httpx']:.0f} adapter_lean={med['adapter_lean']:.0f}")
    finally:
        proc.terminate()
        proc.wait()


if __name__ == "__main__":
    main()
