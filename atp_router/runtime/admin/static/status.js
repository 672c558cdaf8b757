// ATP router status page: reads GET /v1/status/events (Server-Sent Events of
// StatusSnapshot JSON, atp_router/runtime/admin/status.py) with fetch, because EventSource
// cannot send an Authorization header. The admin token comes from the URL
// fragment (#token=…, removed from the address bar at once) or the form, and
// lives in this tab's memory only. Everything shown is set with textContent
// (never innerHTML): stream ids, tenants and error reasons are data, not markup.
"use strict";

(() => {
  const SVG = "http://www.w3.org/2000/svg";
  // Beside the page: /status → /v1/status/events (also behind a path prefix).
  const EVENTS_URL = location.origin + location.pathname.replace(/status\/?$/, "") + "v1/status/events";
  const STALL_MS = 5000; // no event for this long: reconnect
  const W = 600, H = 220, M = { l: 52, r: 12, t: 12, b: 26 };
  const COLORS = ["#2563eb", "#d97706", "#059669", "#7c3aed", "#dc2626", "#0891b2", "#65a30d", "#db2777"];

  let token = null;
  let abort = null;
  let retryMs = 500;

  const $ = (id) => document.getElementById(id);

  function setConn(state, text) {
    const el = $("conn");
    el.dataset.state = state;
    el.textContent = text;
  }

  function el(tag, attrs, text) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "data") for (const [dk, dv] of Object.entries(v)) e.dataset[dk] = dv;
      else if (k === "class") e.className = v;
      else e.setAttribute(k, v);
    }
    if (text !== undefined && text !== null) e.textContent = String(text);
    return e;
  }

  function svg(tag, attrs, text) {
    const e = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, String(v));
    if (text !== undefined) e.textContent = String(text);
    return e;
  }

  // ---------------------------------------------------------------- formatting
  const usd = (micros) => (micros === null || micros === undefined) ? "–" : (micros / 1e6).toFixed(micros >= 1e6 ? 2 : 4);
  const num = (v, d = 0) => (v === null || v === undefined) ? "–" : Number(v).toFixed(d);
  const ms = (v) => (v === null || v === undefined) ? "–" : (v >= 10000 ? (v / 1000).toFixed(1) + " s" : Math.round(v) + " ms");
  const clock = (t) => new Date(t).toLocaleTimeString([], { hour12: false });
  const age = (v) => v < 1000 ? v + " ms" : v < 120000 ? (v / 1000).toFixed(1) + " s" : Math.round(v / 60000) + " min";

  // ---------------------------------------------------------------- plots
  function ticks(lo, hi, n) {
    if (!(hi > lo)) hi = lo + 1;
    const raw = (hi - lo) / n, mag = Math.pow(10, Math.floor(Math.log10(raw)));
    const step = [1, 2, 5, 10].map((m) => m * mag).find((s) => s >= raw) || raw;
    const out = [];
    for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) out.push(Number(v.toPrecision(12)));
    return out;
  }

  // A plot: axes over [x0,x1]×[y0,y1], then the series (lines) and dots (points).
  // lines: [{name, cls, xs, ys}] (null y: gap); dots: [{x, y, cls, r, title}].
  function plot(root, { x0, x1, y0, y1, lines = [], dots = [], xfmt, yfmt, legend = [], empty }) {
    root.replaceChildren();
    const iw = W - M.l - M.r, ih = H - M.t - M.b;
    if (!(x1 > x0)) x1 = x0 + 1;
    if (!(y1 > y0)) y1 = y0 + 1;
    const sx = (x) => M.l + ((x - x0) / (x1 - x0)) * iw;
    const sy = (y) => M.t + ih - ((y - y0) / (y1 - y0)) * ih;
    const axes = svg("g", { class: "axes" });
    for (const v of ticks(y0, y1, 4)) {
      axes.append(svg("line", { x1: M.l, x2: W - M.r, y1: sy(v), y2: sy(v), class: "grid" }));
      axes.append(svg("text", { x: M.l - 6, y: sy(v) + 4, "text-anchor": "end" }, yfmt(v)));
    }
    for (const v of ticks(x0, x1, 5)) {
      axes.append(svg("text", { x: sx(v), y: H - 8, "text-anchor": "middle" }, xfmt(v)));
    }
    axes.append(svg("line", { x1: M.l, x2: M.l, y1: M.t, y2: M.t + ih, class: "axis" }));
    axes.append(svg("line", { x1: M.l, x2: W - M.r, y1: M.t + ih, y2: M.t + ih, class: "axis" }));
    root.append(axes);
    for (const s of lines) {
      let d = "", pen = false;
      s.xs.forEach((x, i) => {
        const y = s.ys[i];
        if (y === null || y === undefined || !isFinite(y)) { pen = false; return; }
        d += (pen ? "L" : "M") + sx(x).toFixed(1) + " " + sy(Math.min(y, y1)).toFixed(1);
        pen = true;
      });
      if (d) root.append(svg("path", { d, class: "line " + (s.cls || ""), "data-series": s.name }));
    }
    const g = svg("g", { class: "dots" });
    for (const p of dots) {
      const c = svg("circle", { cx: sx(p.x).toFixed(1), cy: sy(Math.min(p.y, y1)).toFixed(1), r: p.r || 2.5, class: "dot " + (p.cls || "") });
      if (p.fill) c.setAttribute("fill", p.fill);
      if (p.title) c.append(svg("title", {}, p.title));
      g.append(c);
    }
    root.append(g);
    legend.forEach((l, i) => {
      const x = M.l + 8 + i * 110;
      root.append(svg("rect", { x, y: M.t + 2, width: 10, height: 10, class: "key " + (l.cls || ""), fill: l.fill || "" }));
      root.append(svg("text", { x: x + 14, y: M.t + 11, class: "legend" }, l.name));
    });
    if (empty) root.append(svg("text", { x: W / 2, y: H / 2, "text-anchor": "middle", class: "empty" }, empty));
  }

  const maxOf = (arr, floor) => arr.reduce((m, v) => (v !== null && v !== undefined && isFinite(v) && v > m ? v : m), floor);

  function timeRange(snap) {
    const ts = snap.series.t_ms.concat(snap.tasks.t_ms);
    const x1 = snap.t_ms, x0 = Math.min(x1 - 30000, ts.length ? Math.min(...ts) : x1 - 30000);
    return [x0, x1];
  }

  function drawLatency(snap) {
    const s = snap.series, t = snap.tasks;
    const [x0, x1] = timeRange(snap);
    const y1 = maxOf(s.p95_ms, maxOf(t.latency_ms, 10)) * 1.1;
    plot(document.querySelector('[data-plot="latency"]'), {
      x0, x1, y0: 0, y1, xfmt: clock, yfmt: (v) => ms(v),
      lines: [{ name: "p50", cls: "p50", xs: s.t_ms, ys: s.p50_ms }, { name: "p95", cls: "p95", xs: s.t_ms, ys: s.p95_ms }],
      dots: t.t_ms.map((x, i) => ({ x, y: t.latency_ms[i], cls: t.outcome[i] === "final" ? "ok" : "bad",
        title: `${t.policy[i]} · ${t.outcome[i]} · ${ms(t.latency_ms[i])}` })),
      legend: [{ name: "p50", cls: "p50" }, { name: "p95", cls: "p95" }, { name: "task", cls: "ok" }, { name: "failed task", cls: "bad" }],
      empty: (t.t_ms.length || s.t_ms.length > 1) ? "" : "waiting for finished tasks",
    });
  }

  function drawCost(snap) {
    const s = snap.series, t = snap.tasks;
    const [x0, x1] = timeRange(snap);
    const perMin = s.usd_micros_per_min, perTask = t.usd_micros;
    const y1 = maxOf(perMin, maxOf(perTask, 100)) * 1.1;
    plot(document.querySelector('[data-plot="cost"]'), {
      x0, x1, y0: 0, y1, xfmt: clock, yfmt: (v) => "$" + usd(v),
      lines: [{ name: "usd_per_min", cls: "cost", xs: s.t_ms, ys: perMin }],
      dots: t.t_ms.map((x, i) => ({ x, y: perTask[i], cls: "task", title: `${t.policy[i]} · $${usd(perTask[i])} · ${t.tokens[i]} tokens` })),
      legend: [{ name: "USD / min", cls: "cost" }, { name: "USD / task", cls: "task" }],
      empty: (t.t_ms.length || s.t_ms.length > 1) ? "" : "waiting for spend",
    });
  }

  function drawLoad(snap) {
    const s = snap.series;
    const [x0, x1] = timeRange(snap);
    const y1 = maxOf(s.open, maxOf(s.tasks_per_s, 1)) * 1.15;
    plot(document.querySelector('[data-plot="load"]'), {
      x0, x1, y0: 0, y1, xfmt: clock, yfmt: (v) => num(v, v < 10 && v % 1 ? 1 : 0),
      lines: [{ name: "open", cls: "open", xs: s.t_ms, ys: s.open }, { name: "tasks_per_s", cls: "rate", xs: s.t_ms, ys: s.tasks_per_s }],
      legend: [{ name: "open streams", cls: "open" }, { name: "tasks / s", cls: "rate" }],
      empty: s.t_ms.length > 1 ? "" : "collecting samples",
    });
  }

  function drawQuality(snap) {
    const dots = [], legend = [];
    let xmax = 100;
    snap.policies.forEach((p, i) => {
      const fill = COLORS[i % COLORS.length];
      legend.push({ name: p.policy, fill });
      for (const a of p.agents) {
        if (a.usd_micros_per_call === null) continue;
        xmax = Math.max(xmax, a.usd_micros_per_call);
        dots.push({ x: a.usd_micros_per_call, y: a.quality, r: 3, fill, cls: "agent",
          title: `${p.policy} · ${a.agent}: $${usd(a.usd_micros_per_call)} / call, quality ${num(a.quality, 2)}` });
      }
      const q = p.quality !== null ? p.quality : p.agreement;
      if (p.usd_micros_per_task !== null && q !== null) {
        xmax = Math.max(xmax, p.usd_micros_per_task);
        dots.push({ x: p.usd_micros_per_task, y: q, r: 4 + Math.min(8, Math.sqrt(p.tasks)), fill, cls: "policy",
          title: `${p.policy}: $${usd(p.usd_micros_per_task)} / task over ${p.tasks} tasks, quality ${num(q, 2)}` });
      }
    });
    plot(document.querySelector('[data-plot="quality"]'), {
      x0: 0, x1: xmax * 1.15, y0: 0, y1: 1.05, xfmt: (v) => "$" + usd(v), yfmt: (v) => num(v, 1),
      dots, legend: legend.slice(0, 5), empty: dots.length ? "" : "waiting for finished tasks",
    });
  }

  // ---------------------------------------------------------------- tables
  function fill(tbody, rows) { tbody.replaceChildren(...rows); }

  function agentRows(snap) {
    return snap.agents.map((a) => {
      const tr = el("tr", { data: { agent: a.name } });
      const cell = (field, text, cls) => tr.append(el("td", { data: { field }, class: cls || "" }, text));
      cell("name", a.name);
      cell("kind", a.kind, "dim");
      cell("up", a.up ? "up" : "down", a.up ? "good" : "bad");
      cell("breaker", a.breaker, a.breaker === "closed" ? "good" : a.breaker === "open" ? "bad" : "warn");
      const td = el("td", { data: { field: "cwnd" } });
      td.append(el("span", { data: { value: a.cwnd === null ? "" : String(a.cwnd) } }, a.cwnd === null ? "–" : num(a.cwnd, a.cwnd % 1 ? 2 : 0)));
      td.append(document.createTextNode(" / " + a.max_parallel));
      tr.append(td);
      cell("ssthresh", a.ssthresh === null ? "∞" : num(a.ssthresh, 1));
      cell("in_flight", a.in_flight);
      cell("queued", a.queued);
      cell("calls_ok", a.calls_ok);
      cell("calls_failed", a.calls_failed, a.calls_failed ? "bad" : "");
      cell("p95_ms", a.p95_ms === null ? "–" : ms(a.p95_ms));
      cell("quality", a.quality === null ? "–" : num(a.quality, 2));
      cell("usd", usd(a.usd_micros));
      return tr;
    });
  }

  function budgetBar(b) {
    const wrap = el("span", { class: "budget" });
    if (!b) return wrap;
    const limit = b.limit_usd_micros;
    if (limit) {
      const s = svg("svg", { viewBox: "0 0 100 8", class: "bar", "data-plot": "budget" });
      const spent = Math.min(100, (100 * b.spent_usd_micros) / limit);
      const held = Math.min(100 - spent, (100 * b.reserved_usd_micros) / limit);
      s.append(svg("rect", { x: 0, y: 0, width: 100, height: 8, class: "track" }));
      s.append(svg("rect", { x: 0, y: 0, width: spent.toFixed(1), height: 8, class: "spent" }));
      s.append(svg("rect", { x: spent.toFixed(1), y: 0, width: held.toFixed(1), height: 8, class: "held" }));
      wrap.append(s);
    }
    wrap.append(document.createTextNode(` ${usd(b.spent_usd_micros)} · ${usd(b.reserved_usd_micros)} / ${limit === null ? "∞" : usd(limit)}`));
    return wrap;
  }

  function streamRows(snap) {
    return snap.streams.listed.map((s) => {
      const tr = el("tr", { data: { stream: s.stream_id } });
      tr.append(el("td", {}, s.tenant), el("td", { class: "mono" }, s.stream_id), el("td", {}, s.policy),
        el("td", { class: "qos-" + s.qos }, s.qos), el("td", {}, s.state), el("td", {}, age(s.age_ms)),
        el("td", { class: "mono" }, `${s.window.max_parallel} / ${s.window.max_tokens} / ${s.window.max_usd_micros}`));
      const td = el("td");
      td.append(budgetBar(s.budget));
      tr.append(td, el("td", {}, s.next_hops.join(", ")));
      return tr;
    });
  }

  function fibRows(snap) {
    return snap.fib.routes.map((r) => {
      const tr = el("tr", { data: { policy: r.policy } });
      tr.append(el("td", {}, r.policy), el("td", {}, r.task_type),
        el("td", {}, r.next_hops.map((a, i) => `${a} (${r.weights[i] === undefined ? "–" : Number(r.weights[i]).toPrecision(2)})`).join(", ")));
      return tr;
    });
  }

  function banditRows(snap) {
    const rows = [];
    for (const [pol, b] of Object.entries(snap.fib.bandits)) {
      for (const [arm, a] of Object.entries(b.arms)) {
        const tr = el("tr");
        tr.append(el("td", {}, pol), el("td", {}, arm), el("td", {}, num(a.mean, 3)), el("td", {}, num(a.std, 3)),
          el("td", {}, num(a.count, 1)), el("td", {}, num(a.cost, 3)), el("td", {}, num(b.lambda, 3)), el("td", {}, b.choices));
        rows.push(tr);
      }
    }
    return rows;
  }

  function errorRows(snap) {
    return snap.errors.listed.map((e) => {
      const tr = el("tr");
      tr.append(el("td", {}, clock(e.t_ms)), el("td", {}, e.kind), el("td", { class: "bad" }, e.code), el("td", {}, e.tenant),
        el("td", { class: "mono" }, e.stream_id), el("td", {}, e.policy), el("td", { class: "reason" }, e.reason));
      return tr;
    });
  }

  // ---------------------------------------------------------------- render
  function render(snap) {
    const t = snap.totals;
    const kpi = (k, v) => { document.querySelector(`[data-kpi="${k}"]`).textContent = String(v); };
    const last = (arr) => (arr.length ? arr[arr.length - 1] : null);
    kpi("open_streams", t.open_streams);
    kpi("completed", t.completed);
    kpi("tasks_per_s", num(last(snap.series.tasks_per_s), 1));
    kpi("p95_ms", ms(last(snap.series.p95_ms)));
    kpi("usd", usd(t.usd_micros));
    // The tile counts what the "Recent errors" table lists (ERROR/RST frames sent on
    // streams, listed + older); every error the router counted, refused requests
    // (logins, quotas) included, is in the tile's second line.
    kpi("errors", snap.errors.listed.length + snap.errors.more);
    $("errors-all").textContent = `${Object.values(t.errors).reduce((a, b) => a + b, 0)} incl. refused requests`;
    kpi("agents_up", `${snap.agents.filter((a) => a.up).length} / ${snap.agents.length}`);
    kpi("slots", `${snap.slots.running} / ${snap.slots.capacity}` + (snap.slots.queued ? ` (+${snap.slots.queued})` : ""));
    $("rib-version").textContent = String(snap.rib.version);
    $("rib-source").textContent = `${snap.rib.policies} policies, ${snap.rib.agents} agents`;
    $("updated").textContent = clock(snap.t_ms);
    $("truncated").hidden = !snap.truncated;
    drawLatency(snap);
    drawCost(snap);
    drawLoad(snap);
    drawQuality(snap);
    fill(document.querySelector("#agents tbody"), agentRows(snap));
    fill(document.querySelector("#streams tbody"), streamRows(snap));
    $("streams-count").textContent = `(${snap.streams.count})`;
    $("streams-more").textContent = snap.streams.more ? `+ ${snap.streams.more} more not listed` : "";
    $("fib-version").textContent = `generation ${snap.fib.version}`;
    fill(document.querySelector("#fib tbody"), fibRows(snap));
    fill(document.querySelector("#bandits tbody"), banditRows(snap));
    $("bandits").hidden = !Object.keys(snap.fib.bandits).length;
    fill(document.querySelector("#errors tbody"), errorRows(snap));
    $("errors-more").textContent = snap.errors.more ? `(${snap.errors.more} older not listed)` : "";
    document.body.dataset.tMs = String(snap.t_ms);
    document.body.dataset.seq = String(snap.seq);
  }

  // ---------------------------------------------------------------- connection
  function askToken(message) {
    $("dash").hidden = token === null;
    $("login").hidden = false;
    $("login-error").textContent = message || "";
    $("token").focus();
  }

  async function stream() {
    abort = new AbortController();
    let stall = null;
    const kick = () => { clearTimeout(stall); stall = setTimeout(() => abort.abort(), STALL_MS); };
    try {
      setConn("connecting", "connecting…");
      kick();
      const resp = await fetch(EVENTS_URL, {
        headers: { Authorization: "Bearer " + token, Accept: "text/event-stream" },
        cache: "no-store", credentials: "omit", signal: abort.signal,
      });
      if (resp.status === 401 || resp.status === 403) {
        let reason = resp.status === 401 ? "unknown token" : "this token has no admin role";
        try { reason = (await resp.json()).error.reason || reason; } catch (e) { /* keep the default */ }
        clearTimeout(stall);
        setConn("refused", resp.status === 401 ? "refused: unknown token" : "refused: admin role needed");
        token = null;
        askToken(reason);
        return false;
      }
      if (!resp.ok || !resp.body) throw new Error("HTTP " + resp.status);
      setConn("live", "live");
      $("login").hidden = true;
      $("dash").hidden = false;
      retryMs = 500;
      const reader = resp.body.pipeThrough(new TextDecoderStream()).getReader();
      let buf = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        kick();
        buf += value;
        let i;
        while ((i = buf.indexOf("\n\n")) >= 0) {
          const block = buf.slice(0, i);
          buf = buf.slice(i + 2);
          let event = "message", data = "";
          for (const line of block.split("\n")) {
            if (line.startsWith("event:")) event = line.slice(6).trim();
            else if (line.startsWith("data:")) data += line.slice(5).trim();
          }
          if (event === "status" && data) render(JSON.parse(data));
          else if (event === "error" && data) setConn("retry", "busy: " + JSON.parse(data).reason);
        }
      }
    } catch (e) {
      // Network error, stall or a router restart: try again below.
    }
    clearTimeout(stall);
    return true;
  }

  async function run() {
    while (token !== null) {
      const again = await stream();
      if (!again || token === null) return;
      setConn("retry", "reconnecting…");
      await new Promise((r) => setTimeout(r, retryMs));
      retryMs = Math.min(retryMs * 2, 10000);
    }
  }

  function start(t) {
    if (abort) abort.abort();
    token = t;
    run();
  }

  document.addEventListener("DOMContentLoaded", () => {
    const m = /(?:^#|&)token=([^&]+)/.exec(location.hash);
    if (m) {
      // Out of the address bar and the history at once: the fragment is never sent to a server.
      history.replaceState(null, "", location.pathname + location.search);
      start(decodeURIComponent(m[1]));
    } else {
      askToken("");
    }
    $("login").addEventListener("submit", (ev) => {
      ev.preventDefault();
      const t = $("token").value.trim();
      $("token").value = "";
      if (t) start(t);
    });
  });
})();
