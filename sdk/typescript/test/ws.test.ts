/**
 * The TypeScript client over the router's WebSocket ingress, against a real router
 * (`tests/unit/test_sdk_typescript.py` starts it and gives ATP_URL, ATP_WS_URL,
 * ATP_TOKEN: tenant alice, any task type; ATP_TOKEN_CHAT: tenant bob, chat only).
 * The `slow_chat` task type is a scripted next-hop that streams five PARTIALs
 * 0.2 s apart. Node.js 20 runs this with `--experimental-websocket`.
 */
import assert from "node:assert/strict";
import { test } from "node:test";

import { ATPError, Client, type Event } from "../src/index.js";

const URL = need("ATP_URL");
const WS_URL = need("ATP_WS_URL");
const TOKEN = need("ATP_TOKEN");
const TOKEN_CHAT = need("ATP_TOKEN_CHAT");

const DIFF = [
  "--- a/app.py", "+++ b/app.py", "@@ -1,1 +1,3 @@", " import subprocess", "+def run(cmd):",
  "+    return subprocess.call(cmd, shell=True)", "",
].join("\n");
const FILES = { "app.py": "import subprocess\ndef run(cmd):\n    return subprocess.call(cmd, shell=True)\n" };
const REVIEW = { task_type: "code_review", languages: ["py"] };
const CHAT = { messages: [{ role: "user", content: "hi" }] };

function need(name: string): string {
  const v = process.env[name];
  if (!v) throw new Error(`${name} is not set: run tests/unit/test_sdk_typescript.py, which starts the router`);
  return v;
}

async function all(it: AsyncIterable<Event>): Promise<Event[]> {
  const out: Event[] = [];
  for await (const ev of it) out.push(ev);
  return out;
}

function rows(events: Event[]): [number, string, unknown][] {
  return events.map((e) => [e.id, e.type, e.frame]);
}

async function refusal(p: Promise<unknown>): Promise<ATPError> {
  try {
    await p;
  } catch (e) {
    assert.ok(e instanceof ATPError, `not an ATPError: ${String(e)}`);
    return e;
  }
  assert.fail("the router did not refuse it");
}

/** The platform's WebSocket, recording each socket and able to lose what arrives (a stall in flight). */
class Recording extends WebSocket {
  static made: Recording[] = [];
  stalled = false;
  dropped = 0;
  /** Rewrites each message before the client reads it (a frame altered in flight). */
  tamper: ((data: string) => string) | undefined;
  offered: string[];

  constructor(url: string | URL, protocols?: string | string[]) {
    super(url, protocols);
    this.offered = typeof protocols === "string" ? [protocols] : [...(protocols ?? [])];
    Recording.made.push(this);
  }

  override set onmessage(handler: ((ev: MessageEvent) => unknown) | null) {
    super.onmessage = handler === null ? null : (ev: MessageEvent) => {
      if (this.stalled) {
        this.dropped++;
        return undefined;
      }
      if (this.tamper !== undefined && typeof ev.data === "string") {
        return handler.call(this, new MessageEvent("message", { data: this.tamper(ev.data) }));
      }
      return handler.call(this, ev);
    };
  }

  override get onmessage(): ((ev: MessageEvent) => unknown) | null {
    return super.onmessage;
  }
}

async function until(done: () => boolean, ms = 10_000): Promise<void> {
  const end = Date.now() + ms;
  while (!done()) {
    assert.ok(Date.now() < end, "timed out waiting");
    await new Promise((r) => setTimeout(r, 10));
  }
}

test("a review over WebSocket is what the HTTP events endpoint gives for the same stream", async () => {
  Recording.made = [];
  const atp = new Client(WS_URL, TOKEN, { httpUrl: URL, WebSocket: Recording });
  const http = new Client(URL, TOKEN);
  try {
    assert.equal(atp.transport, "websocket");
    const stream = await atp.openStream(REVIEW, { content: { diff: DIFF, files: FILES }, budget: { usd: 0.5 } });
    // The token rode in the subprotocol list, and the connection's subprotocol is the encoding's.
    const ws = Recording.made[0];
    assert.ok(ws);
    assert.equal(ws.protocol, "atp.v1.json");
    assert.equal(ws.offered[0], "atp.v1.json");
    assert.match(ws.offered[1] ?? "", /^atp\.bearer\.[A-Za-z0-9_-]+$/);
    assert.equal(stream.route.policy, "review");
    assert.deepEqual(stream.route.next_hops, ["bandit"]);
    assert.equal(stream.sessionId.startsWith("sess_"), true);
    const events = await all(atp.events(stream));
    assert.equal(events[0]?.type, "SYN_ACK");
    assert.equal(events.at(-1)?.type, "FIN");
    assert.deepEqual(events.map((e) => e.id), events.map((_, i) => i + 1));
    const final = events.find((e) => e.type === "FINAL");
    assert.ok(final && final.type === "FINAL");
    const finding = final.payload.result.findings.find((f) => f.file === "app.py");
    assert.ok(finding, JSON.stringify(final.payload.result));
    assert.equal(finding.span, "3-3");
    assert.deepEqual(rows(events), rows(await all(http.events(stream.streamId))));
    assert.deepEqual(await atp.result(stream), final.payload);
    assert.deepEqual(rows(await all(atp.events(stream, { lastEventId: 2 }))), rows(events.slice(2)));

    // A key opened over HTTP is the same stream over WebSocket (the router's ids), and back.
    const key = `ts-ws-${Date.now()}`;
    const overHttp = await http.openStream(REVIEW, { content: { diff: DIFF, files: FILES }, idempotencyKey: key });
    const overWs = await atp.openStream(REVIEW, { content: { diff: DIFF, files: FILES }, idempotencyKey: key });
    assert.deepEqual([overWs.sessionId, overWs.streamId], [overHttp.sessionId, overHttp.streamId]);
    assert.deepEqual(rows(await all(atp.events(overWs))), rows(await all(http.events(overHttp))));
    const other = await refusal(atp.openStream({ task_type: "chat" }, { content: CHAT, idempotencyKey: key }));
    assert.equal(other.code, "EPROTO");
    assert.match(other.reason, new RegExp(key));
    assert.equal(atp.connections, 1);
    // The control API rides on httpUrl.
    assert.equal((await atp.health()).status, "ok");
  } finally {
    atp.close();
  }
});

test("the router's refusals over WebSocket are ATPErrors with its codes", async () => {
  const wrong = await refusal(new Client(WS_URL, "not-a-key").openStream(REVIEW, { content: { diff: DIFF } }));
  assert.deepEqual([wrong.code, wrong.status, wrong.reason], ["ESEC", 401, "unknown bearer token"]);
  const anonymous = await refusal(new Client(WS_URL).openStream(REVIEW, { content: { diff: DIFF } }));
  assert.deepEqual([anonymous.code, anonymous.status], ["ESEC", 401]);
  // bob's key may open chat only (spec §11 scopes): the SYN of a review is refused, nothing runs.
  const bob = new Client(WS_URL, TOKEN_CHAT);
  try {
    const scoped = await refusal(bob.openStream(REVIEW, { content: { diff: DIFF, files: FILES } }));
    assert.equal(scoped.code, "ESEC");
    const chat = await bob.openStream({ task_type: "chat" }, { content: CHAT });
    assert.equal((await bob.result(chat)).telemetry.tokens, 42);
    const noHttp = await refusal(bob.health());
    assert.equal(noHttp.code, "EPROTO");
    assert.match(noHttp.reason, /httpUrl/);
  } finally {
    bob.close();
  }
  const down = await refusal(new Client("ws://127.0.0.1:9", TOKEN, { timeoutMs: 2000 }).openStream(REVIEW));
  assert.equal(down.code, "ETRANSPORT");
  assert.throws(() => new Client("ftp://127.0.0.1", TOKEN), TypeError);
});

test("a connection cut mid-stream, with frames lost in flight, resumes with no duplicate and no gap", async () => {
  Recording.made = [];
  const atp = new Client(WS_URL, TOKEN, { WebSocket: Recording });
  const http = new Client(URL, TOKEN);
  try {
    const stream = await atp.openStream({ task_type: "slow_chat" }, { content: CHAT });
    const events: Event[] = [];
    for await (const ev of atp.events(stream)) {
      events.push(ev);
      const first = Recording.made[0];
      if (ev.type === "PARTIAL" && first !== undefined && !first.stalled) {
        const answer = await atp.budgetUpdate(stream, { usd: 0.2 });
        assert.deepEqual(answer.map((f) => [f.flags, f.msg_seq]), [[["ACK"], 1]]);
        first.stalled = true;  // what the router sends next is lost
        await until(() => first.dropped > 0);
        first.close();  // then the connection goes
      }
    }
    assert.equal(atp.connections, 2);
    assert.equal(Recording.made.length, 2);
    assert.ok((Recording.made[0]?.dropped ?? 0) > 0);
    assert.deepEqual(events.map((e) => e.id), events.map((_, i) => i + 1));
    assert.deepEqual(events.slice(-2).map((e) => e.type), ["FINAL", "FIN"]);
    assert.equal(events.filter((e) => e.type === "ACK").length, 1);
    const text = events.flatMap((e) => (e.type === "PARTIAL" && typeof e.payload.delta === "string" ? [e.payload.delta] : []));
    assert.deepEqual(text, ["one", "two", "three", "four", "five"]);
    assert.deepEqual(rows(events), rows(await all(http.events(stream.streamId))));
  } finally {
    atp.close();
  }
});

test("numbers, strings and keys of every shape pass the router's checksum check", async () => {
  // The router re-encodes what it read and compares checksums: a number written
  // otherwise than its msgspec writes it, or keys sorted by UTF-16 instead of code
  // points, would be refused with EPROTO "checksum mismatch".
  const atp = new Client(WS_URL, TOKEN);
  try {
    const odd = {
      task_type: "chat", big: 1e21, bigger: 1.5e300, e16: 1e16, e15: 1.5e15 + 0.5, tiny: 1.5e-7, e6: 1e-6,
      e5: 0.000015, neg: -0, negf: -2.5e-8, safe: 2 ** 53, unsafe: 2 ** 60, third: 1 / 3, tenth: 0.1,
      text: "é😀\u2028\u0000\u001f\"\\/\t", nested: [{ "\u{1F600}": 1, "\uFFFF": 2, a: [true, false, null] }],
    };
    const stream = await atp.openStream(odd, { content: CHAT, budget: { usd: 0.123456789, tokens: 5000 } });
    const final = await atp.result(stream);
    assert.equal(final.telemetry.tokens, 42);
  } finally {
    atp.close();
  }
});

test("a router frame altered in flight fails its stream with EPROTO, unread", async () => {
  Recording.made = [];
  const atp = new Client(WS_URL, TOKEN, { WebSocket: Recording });
  try {
    const stream = await atp.openStream({ task_type: "slow_chat" }, { content: CHAT });
    const ws = Recording.made[0];
    assert.ok(ws);
    ws.tamper = (data) => data.replace('"delta":"three"', '"delta":"THREE"');
    const seen: string[] = [];
    const err = await refusal((async () => {
      for await (const ev of atp.events(stream)) if (ev.type === "PARTIAL") seen.push(String(ev.payload.delta));
    })());
    assert.equal(err.code, "EPROTO");
    assert.match(err.reason, /checksum mismatch/);
    assert.deepEqual(seen, ["one", "two"]);  // nothing of the altered frame, nor after it
  } finally {
    atp.close();
  }
});
