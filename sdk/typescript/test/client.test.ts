/**
 * The TypeScript client against a real router: `tests/unit/test_sdk_typescript.py`
 * starts one (the real `bandit` analyser reviews code; a scripted writer answers chat)
 * and runs `node --test` on this file with ATP_URL, ATP_TOKEN (tenant alice, any
 * task type) and ATP_TOKEN_CHAT (tenant bob, chat only) in the environment.
 */
import assert from "node:assert/strict";
import { test } from "node:test";

import { ATPError, Client, type Event } from "../src/index.js";

const URL = need("ATP_URL");
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

async function refusal(p: Promise<unknown>): Promise<ATPError> {
  try {
    await p;
  } catch (e) {
    assert.ok(e instanceof ATPError, `not an ATPError: ${String(e)}`);
    return e;
  }
  assert.fail("the router did not refuse it");
}

test("a review streams its events in order and its FINAL carries the analyser's finding", async () => {
  const atp = new Client(URL, TOKEN);
  const stream = await atp.openStream(REVIEW, { content: { diff: DIFF, files: FILES }, budget: { usd: 0.5 } });
  assert.equal(stream.route.policy, "review");
  assert.deepEqual(stream.route.next_hops, ["bandit"]);
  const events = await all(atp.events(stream));
  assert.equal(events[0]?.type, "SYN_ACK");
  assert.equal(events.at(-1)?.type, "FIN");
  const ids = events.map((e) => e.id);
  assert.deepEqual(ids, [...ids].sort((a, b) => a - b));
  assert.equal(new Set(ids).size, ids.length);
  const final = events.find((e) => e.type === "FINAL");
  assert.ok(final && final.type === "FINAL");
  const finding = final.payload.result.findings.find((f) => f.file === "app.py");
  assert.ok(finding, JSON.stringify(final.payload.result));
  assert.equal(finding.span, "3-3");
  assert.ok(finding.provenance.some((p) => p.startsWith("bandit")));
  // result() reads the same FINAL; a late follower gets every event again.
  assert.deepEqual(await atp.result(stream), final.payload);
});

test("events resume after a given event, and after a dropped connection, with nothing lost or repeated", async () => {
  const atp = new Client(URL, TOKEN);
  const stream = await atp.openStream(REVIEW, { content: { diff: DIFF, files: FILES } });
  const full = await all(atp.events(stream));
  const first = full[0];
  assert.ok(first);
  const after = await all(atp.events(stream, { lastEventId: first.id }));
  assert.deepEqual(after.map((e) => e.id), full.slice(1).map((e) => e.id));

  // A fetch whose event streams break after their first event: the client reconnects
  // with Last-Event-ID each time and still yields each event exactly once.
  let cuts = 0;
  const breaking: typeof fetch = async (input, init) => {
    const resp = await fetch(input, init);
    if (!String(input).endsWith("/events") || resp.body === null) return resp;
    const reader = resp.body.getReader();
    const body = new ReadableStream<Uint8Array>({
      async pull(controller) {
        const { value, done } = await reader.read();
        if (done) return controller.close();
        const text = new TextDecoder().decode(value);
        const end = text.indexOf("\n\n") + 2;
        if (end <= 1 || end === text.length) return controller.enqueue(value);
        controller.enqueue(new TextEncoder().encode(text.slice(0, end)));  // one event, then the reset
        cuts++;
        await reader.cancel();
        controller.error(new TypeError("terminated: the connection was reset"));
      },
    });
    return new Response(body, { status: resp.status, headers: resp.headers });
  };
  const flaky = new Client(URL, TOKEN, { fetch: breaking, reconnects: 20 });
  const resumed = await all(flaky.events(stream));
  assert.ok(cuts >= 1, "the connection was never cut");
  assert.deepEqual(resumed.map((e) => [e.id, e.type]), full.map((e) => [e.id, e.type]));
});

test("an idempotency key re-opens the same stream; another task under it is a conflict", async () => {
  const atp = new Client(URL, TOKEN);
  const key = `ts-review-${Date.now()}`;
  const a = await atp.openStream(REVIEW, { content: { diff: DIFF, files: FILES }, idempotencyKey: key });
  const b = await atp.openStream(REVIEW, { content: { diff: DIFF, files: FILES }, idempotencyKey: key });
  assert.equal(b.streamId, a.streamId);
  const other = await refusal(atp.openStream({ task_type: "chat" }, { content: CHAT, idempotencyKey: key }));
  assert.equal(other.status, 409);
  assert.equal(other.code, "EPROTO");
  assert.match(other.reason, new RegExp(key));
});

test("chat runs with its cost in the telemetry, and live text in PARTIALs", async () => {
  const atp = new Client(URL, TOKEN_CHAT);
  const stream = await atp.openStream({ task_type: "chat" }, { content: CHAT });
  const events = await all(atp.events(stream));
  const text = events.flatMap((e) =>
    e.type === "PARTIAL" && typeof e.payload.delta === "string" ? [e.payload.delta] : []).join("");
  assert.equal(text, "Hello, world.");
  const final = events.find((e) => e.type === "FINAL");
  assert.ok(final && final.type === "FINAL");
  assert.equal(final.payload.telemetry.usd, 0.00042);
  assert.equal(final.payload.telemetry.tokens, 42);
  const scored = await atp.feedback(stream, 1, ["useful"]);
  assert.equal(scored.stream_id, stream.streamId);
  const again = await refusal(atp.feedback(stream, 0));
  assert.equal(again.status, 409);
});

test("the router's refusals arrive as ATPErrors with its codes", async () => {
  const anonymous = await refusal(new Client(URL).openStream({ task_type: "chat" }, { content: CHAT }));
  assert.equal(anonymous.status, 401);
  assert.equal(anonymous.code, "ESEC");
  const wrong = await refusal(new Client(URL, "not-a-key").health());
  assert.equal(wrong.status, 401);
  // bob's key may open chat only (spec §11 scopes): a review is refused before any next-hop runs.
  const scoped = await refusal(new Client(URL, TOKEN_CHAT).openStream(REVIEW, { content: { diff: DIFF, files: FILES } }));
  assert.equal(scoped.status, 403);
  assert.equal(scoped.code, "ESEC");
  const bad = await refusal(new Client(URL, TOKEN).openStream(REVIEW, { content: { diff: DIFF }, qos: "platinum" as "gold" }));
  assert.equal(bad.status, 400);
  assert.equal(bad.code, "EPROTO");
  const down = await refusal(new Client("http://127.0.0.1:9", TOKEN, { timeoutMs: 2000 }).health());
  assert.equal(down.code, "ETRANSPORT");
});
