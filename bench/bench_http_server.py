"""The HTTP API's server alone: hypercorn vs the lean server (issue 25 item 4).

Run: ``python bench/bench_http_server.py [--rounds 3] [--requests 3000] [--in-flight 16] [--tls]``.
Plain script, ≈ 1 min on 2 cores. Two server processes (this script with
``--serve KIND PORT``) serve the **same** Starlette app — a small JSON ``POST``
(the shape of ``POST /v1/streams``) and an SSE ``GET`` of 8 events (the shape of
a stream's events) — one with hypercorn's trio worker as the router ran it
(``atp_router.deploy.http_serve`` with ``--http-server hypercorn``), one with the
lean HTTP/1.1 server (``atp_router.runtime.ingress.server``). One load generator
(this process: trio + httpx, keep-alive, ``--in-flight`` requests at once) sends
``--requests`` of each shape to each server, the servers interleaved in
``--rounds`` rounds (order rotated). Reported per server and shape: **server CPU
µs per request** (utime + stime of its process, ``/proc``) and requests/s, the
median over the rounds (never a best of); the load average before and after.
``--tls``: both servers serve HTTPS with the router's ``ServerTls`` (a trustme
certificate; TLS 1.3), the client speaking HTTP/1.1 to both (the lean server
offers no HTTP/2; hypercorn's HTTP/2 is not measured here).

The last line is ``HTTP_SERVER cpu_us_per_request json hypercorn=<a> lean=<b>
sse hypercorn=<c> lean=<d> tls=<on|off>`` (medians).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

SERVERS = ("hypercorn", "lean")
EVENTS = 8


def app():
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    async def open_stream(request: Request) -> JSONResponse:
        body = await request.body()
        return JSONResponse({"stream_id": "s-1", "session_id": "x", "bytes": len(body)}, status_code=201)

    async def events(request: Request) -> StreamingResponse:
        async def gen():
            for i in range(EVENTS):
                yield f"event: PARTIAL\nid: {i}\ndata: {{\"delta\": \"tok{i}\"}}\n\n".encode()
        return StreamingResponse(gen(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/streams", open_stream, methods=["POST"]), Route("/v1/events", events)])


def serve(kind: str, port: int) -> None:
    import trio

    from atp_router.deploy.http_serve import serve_http
    from atp_router.runtime.config import RouterConfig
    from atp_router.security.tls import ServerTls

    tls = ServerTls(os.environ["BENCH_TLS_CERT"], os.environ["BENCH_TLS_KEY"]) if "BENCH_TLS_CERT" in os.environ else None
    config = RouterConfig(policies=Path("."), http_server=kind, tls=tls)  # type: ignore[arg-type]
    trio.run(lambda: serve_http(app(), config, [f"127.0.0.1:{port}"]))


VERIFY: Any = True  # the client's TLS context under --tls


async def drive(url: str, shape: str, n: int, k: int) -> float:
    """``n`` requests of ``shape``, ``k`` at a time; requests/s."""
    import httpx
    import trio

    body = b'{"task": {"task_type": "chat"}, "content": {"messages": [{"role": "user", "content": "hi"}]}}'
    left = n
    async with httpx.AsyncClient(base_url=url, limits=httpx.Limits(max_connections=k), verify=VERIFY) as c:
        async def worker() -> None:
            nonlocal left
            while left > 0:
                left -= 1
                if shape == "json":
                    r = await c.post("/v1/streams", content=body)
                    assert r.status_code == 201
                else:
                    r = await c.get("/v1/events")
                    assert r.text.count("event: PARTIAL") == EVENTS
        t0 = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for _ in range(k):
                nursery.start_soon(worker)
        return n / (time.perf_counter() - t0)


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def bench(args: argparse.Namespace) -> int:
    import bench_gateway as gw
    import trio

    global VERIFY
    load0 = os.getloadavg()
    procs, urls = {}, {}
    env, scheme = dict(os.environ), "http"
    if args.tls:
        import ssl
        import tempfile

        import trustme

        ca, tmp = trustme.CA(), Path(tempfile.mkdtemp(prefix="bench-http-tls-"))
        leaf = ca.issue_cert("127.0.0.1")
        leaf.cert_chain_pems[0].write_to_path(str(tmp / "cert.pem"))
        leaf.private_key_pem.write_to_path(str(tmp / "key.pem"))
        env.update(BENCH_TLS_CERT=str(tmp / "cert.pem"), BENCH_TLS_KEY=str(tmp / "key.pem"))
        VERIFY = ssl.create_default_context()
        ca.configure_trust(VERIFY)
        scheme = "https"
    for kind in SERVERS:
        port = gw.free_port()
        procs[kind] = subprocess.Popen([sys.executable, __file__, "--serve", kind, str(port)], env=env)
        urls[kind] = f"{scheme}://127.0.0.1:{port}"
    try:
        for kind in SERVERS:
            for _ in range(200):
                try:
                    trio.run(drive, urls[kind], "json", 10, 2)
                    break
                except Exception:  # noqa: BLE001 - not up yet
                    time.sleep(0.05)
        res: dict[tuple[str, str], list[tuple[float, float]]] = {}
        for rnd in range(args.rounds):
            for kind in (SERVERS if rnd % 2 == 0 else SERVERS[::-1]):
                for shape in ("json", "sse"):
                    c0 = cpu_s(procs[kind].pid)
                    rps = trio.run(drive, urls[kind], shape, args.requests, args.in_flight)
                    us = (cpu_s(procs[kind].pid) - c0) / args.requests * 1e6
                    res.setdefault((kind, shape), []).append((us, rps))
                    print(f"round {rnd} {kind:9} {shape:4}: {us:7.0f} µs CPU a request, {rps:7.0f} requests/s",
                          flush=True)
    finally:
        for p in procs.values():
            p.terminate()
            p.wait(10)
    med = {key: (statistics.median(u for u, _ in v), statistics.median(r for _, r in v)) for key, v in res.items()}
    print(f"\nmedians of {args.rounds} rounds, {args.requests} requests each, {args.in_flight} in flight; "
          f"load average {load0[0]:.2f} before, {os.getloadavg()[0]:.2f} after (2 shared cores)")
    for (kind, shape), (us, rps) in sorted(med.items()):
        print(f"  {kind:9} {shape:4}: {us:6.0f} µs CPU a request, {rps:6.0f} requests/s")
    print(f"HTTP_SERVER cpu_us_per_request json hypercorn={med['hypercorn', 'json'][0]:.0f} "
          f"lean={med['lean', 'json'][0]:.0f} sse hypercorn={med['hypercorn', 'sse'][0]:.0f} "
          f"lean={med['lean', 'sse'][0]:.0f} tls={'on' if args.tls else 'off'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--in-flight", type=int, default=16)
    ap.add_argument("--tls", action="store_true", help="both servers over TLS 1.3 (HTTP/1.1)")
    ap.add_argument("--serve", nargs=2, metavar=("KIND", "PORT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve:
        serve(args.serve[0], int(args.serve[1]))
        return 0
    return bench(args)


if __name__ == "__main__":
    sys.exit(main())
