"""The live status page (issue 11 item 4) in real headless Chromium during a load run.

A real router (in-process, real sockets) on a RIB of three kinds of next-hop —
ruff (a real tool), two reviewers on an OpenAI-compatible replay server that
answers with usage (so tasks cost money), and a reviewer whose server is gone
(connection refused: its circuit opens, its AIMD window shrinks) — serves a
load of streams while Debian's Chromium, driven by Playwright with the system
browser, shows ``/status``. The numbers the page shows are checked against
``/v1/metrics`` read just before and just after the snapshot they come from
(counters bracket exactly; the open-stream gauge within the opens and closes
between the two reads), and, once the load is over, against the router's own
flow objects (``cwnd``, breaker state). Screenshots are saved in the test's
tmp dir and checked (PNG of the viewport's size, not one flat colour); the
plots' SVG elements are checked in the DOM; a client or operator token is
refused by the data endpoints, and the page says so.
"""

from __future__ import annotations

import json
import random
import re
import struct
import threading
import time
import zlib
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from atp_router.security.identity import Role
from tests.helpers import golden, start_router_on
from tests.peers import free_port
from tests.replay_server import LoopbackHTTP, serve

TOKENS = {"ops": "tok-status-admin", "acme": "tok-status-client", "watch": "tok-status-operator"}
ROLES = {"ops": frozenset({Role.ADMIN}), "acme": frozenset({Role.CLIENT}), "watch": frozenset({Role.OPERATOR})}
VIEWPORT = {"width": 1280, "height": 900}
STREAMS = 48
CONCURRENCY = 8


def _rib(model_url: str, dead_url: str) -> str:
    return f"""
models:
  cheap: {{provider: openai_compat, ctx: 8k, cost: 0.5, base_url: '{model_url}/v1', model: cheap, max_out_tokens: 128}}
  pricey: {{provider: openai_compat, ctx: 8k, cost: 4, base_url: '{model_url}/v1', model: pricey, max_out_tokens: 128}}
  gone: {{provider: openai_compat, ctx: 8k, cost: 1, base_url: '{dead_url}/v1', model: gone, max_out_tokens: 128}}
agents:
  lint.ruff: {{layer: L1, tool: ruff, p95_ms: 300, timeout_ms: 30000, scope: changed, strengths: [code_review]}}
  reviewer.cheap: {{layer: L2, model: cheap, p95_ms: 800, timeout_ms: 20000}}
  reviewer.pricey: {{layer: L2, model: pricey, p95_ms: 1500, timeout_ms: 20000}}
  reviewer.gone: {{layer: L2, model: gone, p95_ms: 800, timeout_ms: 5000}}
policies:
  - name: review.bandit
    match: {{task_type: code_review, tier: bandit}}
    fanout: [reviewer.cheap, reviewer.pricey]
    fanout_k: 1
    bandit: {{explore: 0.5, text_features: false}}
    budget: {{usd: 0.05, tokens: 200000}}
  - name: review.full
    match: {{task_type: code_review}}
    fanout: [lint.ruff, reviewer.cheap, reviewer.gone]
    consensus: union_tiebreak
    budget: {{usd: 0.05, tokens: 200000}}
"""


class ReviewModel(LoopbackHTTP):
    """An OpenAI-compatible chat server (the SSE wire shape llama-cpp-python and
    OpenAI stream, with the final usage chunk): after a delay drawn per model
    (``pricey`` is slower), an empty review and its token usage."""

    def __init__(self) -> None:
        super().__init__(path="")
        self.rng = random.Random(11)

    async def respond(self, stream: trio.SocketStream) -> None:
        model = self.requests[-1][1].get("model", "")  # read before any await: this request's
        lo, hi = (0.4, 1.0) if model == "pricey" else (0.15, 0.5)
        delay = self.rng.uniform(lo, hi)
        usage = {"prompt_tokens": self.rng.randint(600, 1200), "completion_tokens": self.rng.randint(40, 120)}
        await trio.sleep(delay)
        answer = json.dumps({"findings": [], "summary": "nothing to report"})
        chunks = [{"choices": [{"index": 0, "delta": {"content": answer}, "finish_reason": None}]},
                  {"choices": [], "usage": usage}]
        body = b"".join(b"data: %s\n\n" % json.dumps({"id": "c", "object": "chat.completion.chunk", "model": model,
                                                      **c}).encode() for c in chunks) + b"data: [DONE]\n\n"
        try:
            await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n"
                                  + body)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the router gave up on the call (RST): not the server's fault
        finally:
            await stream.aclose()


def _metrics(client: httpx.Client) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    r = client.get("/v1/metrics")
    assert r.status_code == 200, r.text
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _sum(m: dict, name: str, **labels: str) -> float:
    return sum(v for (n, ls), v in m.items() if n == name and all((k, x) in ls for k, x in labels.items()))


def _png_size(path: Path) -> tuple[int, int]:
    """Width and height of a PNG, after checking its signature and that its
    pixels are not all one colour (IDAT inflated)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    width, height = struct.unpack(">II", data[16:24])
    idat, pos = b"", 8
    while pos < len(data):
        (length,), kind = struct.unpack(">I", data[pos:pos + 4]), data[pos + 4:pos + 8]
        if kind == b"IDAT":
            idat += data[pos + 8:pos + 8 + length]
        pos += 12 + length
    pixels = zlib.decompress(idat)
    row = len(pixels) // height
    assert len({pixels[i * row + 1:(i + 1) * row] for i in range(0, height, 7)}) > 10, f"{path} is (nearly) blank"
    return width, height


def _wait(page: Any, predicate: str, arg: Any = None, timeout_s: float = 15.0) -> None:
    """Poll ``predicate`` (a JS function of ``arg``) until it is true. Not
    ``page.wait_for_function``: its predicate is compiled with eval, which the
    page's Content-Security-Policy forbids (as it should)."""
    deadline = time.monotonic() + timeout_s
    while not page.evaluate(predicate, arg):
        if time.monotonic() > deadline:
            raise AssertionError(f"the page never showed {predicate} ({arg})")
        time.sleep(0.05)


def _page_numbers(page: Any) -> dict[str, Any]:
    """What the page shows: KPI texts, per-agent cells, counts of plot elements."""
    return page.evaluate(r"""() => {
        const kpi = (k) => document.querySelector(`[data-kpi="${k}"]`).textContent;
        const agents = {};
        for (const tr of document.querySelectorAll('#agents tbody tr')) {
            const f = (k) => tr.querySelector(`[data-field="${k}"]`);
            agents[tr.dataset.agent] = {cwnd: f('cwnd').querySelector('span').dataset.value,
                breaker: f('breaker').textContent, up: f('up').textContent,
                calls_ok: Number(f('calls_ok').textContent), calls_failed: Number(f('calls_failed').textContent)};
        }
        const count = (sel) => document.querySelectorAll(sel).length;
        return {seq: Number(document.body.dataset.seq), t_ms: Number(document.body.dataset.tMs),
                open: Number(kpi('open_streams')), completed: Number(kpi('completed')), usd: kpi('usd'),
                errors: Number(kpi('errors')), agents,
                errors_more: Number((document.getElementById('errors-more').textContent.match(/\d+/) || ['0'])[0]),
                stream_rows: count('#streams tbody tr'), error_rows: count('#errors tbody tr'),
                fib_rows: count('#fib tbody tr'), bandit_rows: count('#bandits tbody tr'),
                latency_lines: count('svg[data-plot="latency"] path[data-series]'),
                latency_dots: count('svg[data-plot="latency"] circle.dot'),
                cost_dots: count('svg[data-plot="cost"] circle.dot'),
                cost_lines: count('svg[data-plot="cost"] path[data-series="usd_per_min"]'),
                load_lines: count('svg[data-plot="load"] path[data-series]'),
                quality_policies: count('svg[data-plot="quality"] circle.policy'),
                budget_bars: count('#streams svg[data-plot="budget"]')};
    }""")


def _browser_session(chromium: Path, url: str, shots: Path, load_started: threading.Event,
                     load_done: threading.Event, page_ready: threading.Event) -> dict[str, Any]:
    """Everything Playwright does, in this one thread (its objects are bound to
    it): the refused page, then the admin page during and after the load."""
    from playwright.sync_api import sync_playwright

    out: dict[str, Any] = {"requests": []}
    with sync_playwright() as p, httpx.Client(base_url=url, timeout=30,
                                              headers={"Authorization": f"Bearer {TOKENS['ops']}"}) as ops:
        browser = p.chromium.launch(executable_path=str(chromium), headless=True)
        try:
            ctx = browser.new_context(viewport=VIEWPORT, device_scale_factor=1)
            page = ctx.new_page()
            page.on("request", lambda r: out["requests"].append(r.url))
            console: list[str] = []
            page.on("console", lambda m: console.append(f"{m.type}: {m.text}") if m.type == "error" else None)
            page.on("pageerror", lambda e: console.append(f"pageerror: {e}"))

            # A client token: the page says it was refused and shows no data.
            page.goto(f"{url}/status#token={TOKENS['acme']}")
            page.wait_for_selector('#conn[data-state="refused"]', timeout=15_000)
            out["refused_text"] = page.text_content("#conn")
            out["refused_form_shown"] = page.is_visible("#login")
            out["refused_dash_hidden"] = not page.is_visible("#dash")

            # The admin token, through the form this time.
            page.fill("#token", TOKENS["ops"])
            page.click("#login button")
            page.wait_for_selector('#conn[data-state="live"]', timeout=15_000)
            _wait(page, "() => Number(document.body.dataset.seq) > 0")
            page_ready.set()

            # During the load: wait for streams on screen, then bracket one fresh snapshot.
            assert load_started.wait(60)
            _wait(page, "() => Number(document.querySelector('[data-kpi=open_streams]').textContent) > 0",
                  timeout_s=30)
            brackets = []
            for _ in range(3):
                m0, w0 = _metrics(ops), int(time.time() * 1000)
                _wait(page, "(w) => Number(document.body.dataset.tMs) > w", w0)
                shown = _page_numbers(page)
                m1 = _metrics(ops)
                brackets.append((m0, shown, m1))
            out["brackets"] = brackets
            page.screenshot(path=str(shots / "status-load.png"))
            out["during"] = _page_numbers(page)

            # After the load: the page settles on the final numbers.
            assert load_done.wait(120)
            final = _metrics(ops)
            done = int(_sum(final, "atp_streams_closed_total", outcome="final"))
            _wait(page, "(n) => Number(document.querySelector('[data-kpi=completed]').textContent) === n"
                        " && Number(document.querySelector('[data-kpi=open_streams]').textContent) === 0", done)
            w = int(time.time() * 1000)
            _wait(page, "(w) => Number(document.body.dataset.tMs) > w", w)
            out["after"] = _page_numbers(page)
            out["after_metrics"] = _metrics(ops)
            page.screenshot(path=str(shots / "status-done.png"))
            page.screenshot(path=str(shots / "status-full.png"), full_page=True)
            out["url_after_login"] = page.url
            out["favicon"] = page.evaluate("() => document.querySelector('link[rel=icon]').href")
            out["console"] = console
        finally:
            browser.close()
    return out


async def _load(env: Any, n: int, concurrency: int) -> list[str]:
    """``n`` code reviews (a third on the bandit policy), ``concurrency`` at a
    time, each until its stream closed; the last event type of each. The end
    is read from the router's stream table rather than by following the
    stream's SSE: the load is the scenery here, not what is tested."""
    task = golden()
    ends: list[str] = []
    limit = trio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=env.url, timeout=60,
                                 headers={"Authorization": f"Bearer {TOKENS['acme']}"}) as h:
        async def one(i: int) -> None:
            async with limit:
                meta = {"task_type": "code_review", **({"tier": "bandit"} if i % 3 == 0 else {})}
                r = await h.post("/v1/streams", json={"task": meta, "content": task})
                assert r.status_code == 201, r.text
                ctx = env.router.streams.find("acme", r.json()["stream_id"])
                while not ctx.log.closed:
                    await trio.sleep(0.05)
                ends.append(ctx.log.events[-1].type)

        async with trio.open_nursery() as n_:
            for i in range(n):
                n_.start_soon(one, i)
    return ends


@pytest.mark.peers
@pytest.mark.slow
async def test_status_page_live_in_headless_chromium(nursery, tmp_path: Path, chromium: Path) -> None:
    model = await serve(nursery, ReviewModel())
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens: connection refused
    env = await start_router_on(
        nursery, tmp_path, _rib(model.url, dead), client_tokens=TOKENS, client_roles=ROLES, seed=3,
        breaker_failures=3, breaker_backoff_s=60, breaker_max_backoff_s=120, tenant_rate_per_s=1000,
        tenant_rate_burst=1000)
    router = env.router

    # The data endpoints are admin-only; the page itself is public and holds no data.
    async with httpx.AsyncClient(base_url=env.url, timeout=30) as h:
        for path in ("/v1/status", "/v1/status/events"):
            assert (await h.get(path)).status_code == 401
            for who in ("acme", "watch"):
                r = await h.get(path, headers={"Authorization": f"Bearer {TOKENS[who]}"})
                assert r.status_code == 403 and r.json()["error"]["code"] == "ESEC", r.text
        page = await h.get("/status")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "script-src 'self'" in page.headers["content-security-policy"]
        assert (await h.get("/status/status.js")).headers["content-type"].startswith("text/javascript")
        assert (await h.get("/status/other.js")).status_code == 404

    shots = tmp_path / "screenshots"
    shots.mkdir()
    load_started, load_done, page_ready = threading.Event(), threading.Event(), threading.Event()
    result: dict[str, Any] = {}

    async def browser() -> None:
        result.update(await trio.to_thread.run_sync(
            _browser_session, chromium, env.url, shots, load_started, load_done, page_ready))

    with trio.fail_after(240):
        async with trio.open_nursery() as n:
            n.start_soon(browser)
            await trio.to_thread.run_sync(page_ready.wait, 60)
            assert page_ready.is_set(), "the page never went live"
            load_started.set()
            try:
                ends = await _load(env, STREAMS, CONCURRENCY)
            finally:
                load_done.set()

    assert ends.count("FIN") == STREAMS, ends

    # The refused page.
    assert "admin role" in result["refused_text"] and result["refused_form_shown"] and result["refused_dash_hidden"]
    assert "#token" not in result["url_after_login"]
    # Nothing but this router was asked for anything (no CDN: works offline).
    assert result["requests"] and all(u.startswith(env.url + "/") for u in result["requests"]), result["requests"]
    # The refused data request is the only resource that failed; no script error.
    # (the reason phrase is optional in HTTP/1.1: hypercorn sends none, the lean server "Forbidden")
    assert len(result["console"]) == 1 and re.fullmatch(
        r"error: Failed to load resource: the server responded with a status of 403 \((Forbidden)?\)",
        result["console"][0]), result["console"]

    # During the load: every shown number lies between the metrics read before and after its snapshot.
    for m0, shown, m1 in result["brackets"]:
        c0, c1 = (_sum(m, "atp_streams_closed_total", outcome="final") for m in (m0, m1))
        assert c0 <= shown["completed"] <= c1, (c0, shown["completed"], c1)
        open0 = _sum(m0, "atp_open_streams")
        opened = _sum(m1, "atp_streams_opened_total") - _sum(m0, "atp_streams_opened_total")
        closed = _sum(m1, "atp_streams_closed_total") - _sum(m0, "atp_streams_closed_total")
        assert open0 - closed <= shown["open"] <= open0 + opened, (open0, opened, closed, shown["open"])
        for agent, row in shown["agents"].items():
            ok0, ok1 = (_sum(m, "atp_agent_calls_total", agent=agent, outcome="ok") for m in (m0, m1))
            assert ok0 <= row["calls_ok"] <= ok1, (agent, ok0, row["calls_ok"], ok1)
        u0, u1 = (_sum(m, "atp_usd_micros_total") / 1e6 for m in (m0, m1))
        assert u0 - 1e-4 <= float(shown["usd"]) <= u1 + 1e-4, (u0, shown["usd"], u1)
    during = result["during"]
    assert during["stream_rows"] >= 1 and during["budget_bars"] == during["stream_rows"]
    assert during["fib_rows"] == 2 and during["bandit_rows"] == 2
    assert during["load_lines"] == 2  # open streams and tasks/s are sampled from the first snapshot

    # After the load: exact, against the metrics and the router's own flow objects.
    after, m = result["after"], result["after_metrics"]
    assert after["open"] == 0 == _sum(m, "atp_open_streams")
    assert after["completed"] == STREAMS == _sum(m, "atp_streams_closed_total", outcome="final")
    assert float(after["usd"]) > 0 and abs(float(after["usd"]) - _sum(m, "atp_usd_micros_total") / 1e6) < 1e-4
    windows = router.gates.agent_windows.statistics()
    breakers = router.gates.breakers.statistics()
    for agent, row in after["agents"].items():
        assert row["calls_ok"] == _sum(m, "atp_agent_calls_total", agent=agent, outcome="ok"), agent
        failed = _sum(m, "atp_agent_calls_total", agent=agent) - row["calls_ok"]
        assert row["calls_failed"] == failed, agent
        if agent in windows:
            assert float(row["cwnd"]) == round(windows[agent].cwnd, 3), (agent, row["cwnd"], windows[agent])
        else:  # never called: no window yet, and the page says so
            assert row["cwnd"] == "" and row["calls_ok"] == row["calls_failed"] == 0, (agent, row)
        assert row["breaker"] == str(breakers[agent].state) if agent in breakers else row["breaker"] == "closed"
    gone = after["agents"]["reviewer.gone"]
    assert gone["breaker"] == "open" and gone["up"] == "down" and gone["calls_failed"] >= 3
    assert float(gone["cwnd"]) < windows["lint.ruff"].cwnd  # AIMD halved it on the failures
    assert after["errors"] > 0 and after["error_rows"] > 0  # the gone reviewer's EAGENTDOWN
    # The tile counts what the table lists (issue 20: it said 8 beside an empty table).
    assert after["errors"] == after["error_rows"] + after["errors_more"]
    # Every finished task is plotted (latency and cost), both policies on the cost/quality plot.
    assert after["latency_dots"] == STREAMS and after["cost_dots"] == STREAMS
    assert after["quality_policies"] == 2
    assert after["latency_lines"] == 2 and after["cost_lines"] == 1 and after["load_lines"] == 2

    # Screenshots: PNGs of the viewport (and the whole page), not blank.
    for name in ("status-load.png", "status-done.png"):
        assert _png_size(shots / name) == (VIEWPORT["width"], VIEWPORT["height"])
    width, height = _png_size(shots / "status-full.png")
    assert width == VIEWPORT["width"] and height > VIEWPORT["height"]
