/**
 * TypeScript client for ATP routers (Agent Transport Protocol draft v0.1, spec §22).
 *
 * No runtime dependency: the platform's `fetch` and streams (Node.js ≥ 20, Deno,
 * Bun, browsers). The same calls as the Python SDK (`atp.Client`):
 *
 * ```ts
 * import { Client } from "atp-client";
 * const atp = new Client("http://127.0.0.1:7070", process.env.ATP_TOKEN);
 * const stream = await atp.openStream({ task_type: "code_review" }, {
 *   content: { diff, files }, budget: { usd: 0.10, tokens: 200_000 }, idempotencyKey: "review-42" });
 * for await (const ev of atp.events(stream)) {
 *   if (ev.type === "FINAL") console.log(ev.payload.result.findings);
 * }
 * ```
 *
 * Errors are {@link ATPError}s carrying the router's spec §10 `code` (`EPROTO`,
 * `ESEC`, `EBUDGET`, `EAGENTDOWN`, `ETIMEOUT`, …) and `reason`; a transport failure
 * is `ETRANSPORT`. `events()` resumes by itself after a dropped connection
 * (`Last-Event-ID`, spec §8): no event is lost or repeated.
 *
 * The URL picks the transport, as in the Python SDK: `http(s)://` the HTTP control
 * API with Server-Sent Events; `ws(s)://` the router's WebSocket ingress (spec §4.1;
 * `--ws-port`), JSON frames over the platform's `WebSocket` (or the `WebSocket`
 * option), the token in the `atp.bearer.` subprotocol, heartbeats (§4.4), and after
 * a dropped connection every open stream resumed (`resume_after`, §8) with no
 * duplicate and no gap (see `ws.ts`). Over WebSocket, frames are not signed (a
 * router with `ATP_HMAC_KEYS` refuses them: use HTTP there), `feedback`/`health`
 * need the `httpUrl` option, and {@link Client.close} ends the connection:
 *
 * ```ts
 * const atp = new Client("ws://127.0.0.1:7071", process.env.ATP_TOKEN, { httpUrl: "http://127.0.0.1:7070" });
 * try { console.log((await atp.result(await atp.openStream(task, { content }))).result.findings); }
 * finally { atp.close(); }
 * ```
 */
import { type WebSocketConstructor, WsTransport } from "./ws.js";
import { ATPError } from "./wsstream.js";

export { ATPError };
export { bearerSubprotocol, type WebSocketConstructor } from "./ws.js";

/** Event types of a stream, in the order they usually come. */
export type EventType = "SYN_ACK" | "ACK" | "WINDOW_UPDATE" | "PARTIAL" | "ERROR" | "FINAL" | "FIN" | "RST";

/** Quality of service classes (spec §9). */
export type QoS = "gold" | "silver" | "bronze";

/** A spend limit: float USD and tokens; an absent axis is not limited by it. */
export interface Budget {
  usd?: number;
  tokens?: number;
}

/** A flow-control window (spec §5): parallel calls, tokens, USD micros. */
export interface Window {
  max_parallel?: number;
  max_tokens?: number;
  max_usd_micros?: number;
}

/** One ATP frame (spec §4.2) as the router sends it in JSON. */
export interface Frame {
  v: number;
  session_id: string;
  stream_id: string;
  msg_seq: number;
  flags?: string[];
  window?: Window;
  meta?: Record<string, unknown>;
  payload?: { type: string; content: unknown };
  sig?: string;
  checksum?: string;
}

/** A merged finding of a FINAL (spec §7.3); `span` is `"start-end"` (1-based lines). */
export interface Finding {
  id: string;
  severity: "info" | "low" | "medium" | "high" | "critical";
  file: string;
  span: string;
  claim: string;
  confidence: number;
  provenance: string[];
  patch?: string;
  tests?: string[];
  cached?: boolean;
  suppressed_by_change?: boolean;
}

/** One next-hop's prose answer in a FINAL. */
export interface Answer {
  agent: string;
  text: string;
  confidence?: number;
  truncated?: boolean;
  cached?: boolean;
}

/** The FINAL's content (spec §7.3): the merged result and the stream's totals. */
export interface FinalResult {
  result: {
    findings: Finding[];
    consensus: { strategy: string; agreement: number; uncertainties?: string[] };
    answers?: Answer[];
  };
  telemetry: {
    tokens: number;
    usd: number;
    latency_ms: number;
    usage?: { summary: Record<string, unknown>; jws: string };
    cached?: string[];
    qos_asked?: QoS;
    qos_served?: QoS;
  };
}

/** An ERROR (or RST) body (spec §10). */
export interface ErrorBody {
  kind?: "ERROR";
  code: string;
  reason: string;
  retry_after_ms?: number;
}

/** What each event type's `payload` is. */
export interface PayloadOf {
  FINAL: FinalResult;
  ERROR: ErrorBody;
  RST: ErrorBody;
  PARTIAL: Record<string, unknown>;
  SYN_ACK: unknown;
  ACK: unknown;
  WINDOW_UPDATE: unknown;
  FIN: unknown;
}

/**
 * One event of a stream: `payload` is the frame's `payload.content` (the §7.3
 * result for FINAL, the error body for ERROR and RST), `frame` the whole frame,
 * `id` the event's number, what `events(stream, { lastEventId })` resumes after.
 */
export type Event = { [T in EventType]: { type: T; payload: PayloadOf[T]; frame: Frame; id: number } }[EventType];

/** An open stream: its ids, the window the router granted and the route it took. */
export interface StreamHandle {
  sessionId: string;
  streamId: string;
  window: Window;
  route: { policy?: string; next_hops?: string[]; rib_version?: number };
}

/** Options of {@link Client.openStream}. */
export interface OpenOptions {
  /** The task body (`code_review`: `{ diff, files: { path: text } }`). */
  content?: Record<string, unknown>;
  budget?: Budget;
  qos?: QoS;
  window?: Window;
  /** The same key (per tenant) re-opens the same stream: never run nor charged twice (spec §8). */
  idempotencyKey?: string;
}

/** Options of the {@link Client}. */
export interface ClientOptions {
  /** A `fetch` to use instead of the platform's. */
  fetch?: typeof fetch;
  /** Bound of each request (ms), not of an events stream. Default 30 000. */
  timeoutMs?: number;
  /** Reconnections of one `events()` after a dropped connection (HTTP). Default 5. */
  reconnects?: number;
  /** WebSocket: the constructor to use instead of the platform's `WebSocket`. */
  WebSocket?: WebSocketConstructor;
  /** WebSocket: the router's HTTP base, for `feedback` and `health`. */
  httpUrl?: string;
  /** WebSocket: ms between this client's heartbeats (below the router's `hb_timeout_s`). Default 10 000. */
  hbIntervalMs?: number;
  /** WebSocket: ms of silence from the router after which the connection is dead. Default 30 000. */
  hbTimeoutMs?: number;
  /** WebSocket: ms of reconnecting after a lost connection before every call fails `ETRANSPORT`. Default 60 000. */
  reconnectMs?: number;
}

const TERMINAL = new Set(["FIN", "RST"]);

/**
 * An ATP router's client (spec §22): its HTTP control API with Server-Sent Events
 * (`http://`, `https://`), or its WebSocket ingress (`ws://`, `wss://`; see the module doc).
 */
export class Client {
  readonly url: string;
  /** `"websocket"` or `"http"`, by the URL's scheme. */
  readonly transport: "websocket" | "http";
  private readonly ws: WsTransport | undefined;
  private readonly httpBase: string | undefined;
  private readonly headers: Record<string, string>;
  private readonly fetchFn: typeof fetch;
  private readonly timeoutMs: number;
  private readonly reconnects: number;
  /** stream id → msg_seq of this client's next message on it (the SYN was 0). */
  private readonly nextSeq = new Map<string, number>();

  /** Throws `TypeError` for another URL scheme; over WebSocket `ATPError` `ETRANSPORT` without a `WebSocket`. */
  constructor(url: string, token?: string, options: ClientOptions = {}) {
    this.url = url.replace(/\/+$/, "");
    const scheme = this.url.slice(0, this.url.indexOf(":")).toLowerCase();
    if (scheme === "ws" || scheme === "wss") {
      this.transport = "websocket";
      this.ws = new WsTransport(this.url, token, {
        ...(options.WebSocket !== undefined ? { WebSocket: options.WebSocket } : {}),
        timeoutMs: options.timeoutMs ?? 30_000, hbIntervalMs: options.hbIntervalMs ?? 10_000,
        hbTimeoutMs: options.hbTimeoutMs ?? 30_000, reconnectMs: options.reconnectMs ?? 60_000,
      });
      this.httpBase = options.httpUrl?.replace(/\/+$/, "");
    } else if (scheme === "http" || scheme === "https") {
      this.transport = "http";
      this.httpBase = this.url;
    } else {
      throw new TypeError(`router URL ${JSON.stringify(url)}: expected http://, https://, ws:// or wss://`);
    }
    this.headers = token ? { Authorization: `Bearer ${token}` } : {};
    this.fetchFn = options.fetch ?? globalThis.fetch.bind(globalThis);
    this.timeoutMs = options.timeoutMs ?? 30_000;
    this.reconnects = options.reconnects ?? 5;
  }

  /**
   * SYN a stream (spec §8 steps 1–2): `task` is the task meta (`task_type` and the
   * policies' match keys); resolves once the router answered SYN-ACK. Throws
   * {@link ATPError}: `EPROTO` (bad request), `ESEC` (401/403), `EWINDOW` (429,
   * `retryAfterMs`), `EBUDGET`, `EAGENTDOWN` (no route, or a store that did not answer).
   */
  async openStream(task: Record<string, unknown>, options: OpenOptions = {}): Promise<StreamHandle> {
    if (this.ws !== undefined) return (await this.ws.openStream(task, options)) as StreamHandle;
    const body: Record<string, unknown> = { task };
    if (options.content !== undefined) body.content = options.content;
    if (options.budget !== undefined) body.budget = options.budget;
    if (options.qos !== undefined) body.qos = options.qos;
    if (options.window !== undefined) body.window = options.window;
    if (options.idempotencyKey !== undefined) body.idempotency_key = options.idempotencyKey;
    const data = (await this.json("POST", "/v1/streams", body)) as {
      session_id: string; stream_id: string; window?: Window; route?: StreamHandle["route"];
    };
    if (!this.nextSeq.has(data.stream_id)) this.nextSeq.set(data.stream_id, 1);
    return { sessionId: data.session_id, streamId: data.stream_id, window: data.window ?? {}, route: data.route ?? {} };
  }

  /**
   * The stream's events until FIN or RST (Server-Sent Events). Events already
   * sent are replayed first, so following late loses nothing; `lastEventId`
   * starts after that event. A dropped connection is resumed after the last
   * event received (up to `reconnects` times). Throws {@link ATPError}.
   */
  async *events(stream: StreamHandle | string, options: { lastEventId?: number; signal?: AbortSignal } = {}
  ): AsyncGenerator<Event, void, undefined> {
    const id = typeof stream === "string" ? stream : stream.streamId;
    if (this.ws !== undefined) {
      yield* this.ws.events(id, options.lastEventId) as AsyncGenerator<Event, void, undefined>;
      return;
    }
    let last = options.lastEventId;
    for (let attempt = 0; ; attempt++) {
      let dropped: unknown;
      try {
        for await (const ev of this.sse(id, last, options.signal)) {
          last = ev.id;
          this.noteAck(id, ev.frame);
          yield ev;
          if (TERMINAL.has(ev.type)) return;
        }
        dropped = new Error("the event stream ended before FIN or RST");
      } catch (e) {
        if (e instanceof ATPError && e.code !== "ETRANSPORT") throw e;
        if (options.signal?.aborted) throw e;
        dropped = e;
      }
      if (attempt >= this.reconnects) {
        throw new ATPError("ETRANSPORT", `events of ${id}: ${String((dropped as Error)?.message ?? dropped)}`);
      }
      await new Promise((r) => setTimeout(r, Math.min(2000, 100 * 2 ** attempt)));
    }
  }

  /** Wait for the stream's FINAL; throws {@link ATPError} with the router's code when it ends without one. */
  async result(stream: StreamHandle | string): Promise<FinalResult> {
    let lastError: ErrorBody | undefined;
    for await (const ev of this.events(stream)) {
      if (ev.type === "FINAL") return ev.payload;
      if ((ev.type === "ERROR" || ev.type === "RST") && ev.payload && typeof ev.payload === "object") {
        lastError = ev.payload;
      }
    }
    if (lastError) throw new ATPError(lastError.code, lastError.reason, undefined, lastError, lastError.retry_after_ms);
    throw new ATPError("EPROTO", "the stream ended without a FINAL");
  }

  /**
   * Raise or lower a running stream's budget (BUDGET_UPDATE, spec §4.3): `usd`
   * (float USD) and `tokens` are the stream's new limits. Resolves to the
   * router's answer frames (an ACK).
   */
  async budgetUpdate(stream: StreamHandle, budget: Budget): Promise<Frame[]> {
    if (this.ws !== undefined) return (await this.ws.budgetUpdate(stream.streamId, { ...budget })) as unknown as Frame[];
    const seq = this.nextSeq.get(stream.streamId) ?? 1;
    const frame: Frame = {
      v: 1, session_id: stream.sessionId, stream_id: stream.streamId, msg_seq: seq, flags: ["CTRL"],
      payload: { type: "control", content: { kind: "BUDGET_UPDATE", budget } },
    };
    const { frames } = (await this.json("POST", `/v1/streams/${enc(stream.streamId)}/frames`, frame)) as {
      frames: Frame[];
    };
    this.nextSeq.set(stream.streamId, Math.max(this.nextSeq.get(stream.streamId) ?? 1, seq + 1));
    for (const f of frames) this.noteAck(stream.streamId, f);
    return frames;
  }

  /**
   * Score a finished stream (spec §6.2): `score` from 0 (wrong) to 1 (right and
   * useful), up to 16 `labels`. Once per stream; throws {@link ATPError} (409:
   * still running or already scored; 404: not the caller's stream).
   */
  async feedback(stream: StreamHandle | string, score: number, labels: string[] = []): Promise<Record<string, unknown>> {
    const id = typeof stream === "string" ? stream : stream.streamId;
    return (await this.json("POST", `/v1/streams/${enc(id)}/feedback`, { score, labels })) as Record<string, unknown>;
  }

  /** `GET /v1/health`: the router's liveness and RIB generation. */
  async health(): Promise<Record<string, unknown>> {
    return (await this.json("GET", "/v1/health")) as Record<string, unknown>;
  }

  /**
   * Over WebSocket: forget what this client holds of a stream (its events; it is
   * no longer resumed on reconnection). Nothing to forget over HTTP.
   */
  discard(stream: StreamHandle | string): void {
    this.ws?.discard(typeof stream === "string" ? stream : stream.streamId);
  }

  /** Close the WebSocket connection (streams go on on the router, resumable by key); nothing over HTTP. */
  close(): void {
    this.ws?.close();
  }

  /** Over WebSocket: the connections made so far (the first and each reconnection); 0 over HTTP. */
  get connections(): number {
    return this.ws?.connections ?? 0;
  }

  private noteAck(streamId: string, frame: Frame): void {
    const flags = frame.flags ?? [];
    if (flags.includes("ACK") && !flags.includes("SYN") && typeof frame.msg_seq === "number") {
      this.nextSeq.set(streamId, Math.max(this.nextSeq.get(streamId) ?? 1, frame.msg_seq + 1));
    }
  }

  private async json(method: string, path: string, body?: unknown): Promise<unknown> {
    const init: RequestInit = { method, headers: { ...this.headers }, signal: AbortSignal.timeout(this.timeoutMs) };
    if (body !== undefined) {
      init.body = JSON.stringify(body);
      (init.headers as Record<string, string>)["Content-Type"] = "application/json";
    }
    const resp = await this.send(path, init);
    const text = await resp.text();
    if (!resp.ok) throw errorOf(resp, text);
    return JSON.parse(text);
  }

  private async send(path: string, init: RequestInit): Promise<Response> {
    if (this.httpBase === undefined) {
      throw new ATPError("EPROTO", `${path} is on the router's HTTP API: new Client(wsUrl, token, { httpUrl: "http://…" })`);
    }
    try {
      return await this.fetchFn(this.httpBase + path, init);
    } catch (e) {
      if ((e as Error)?.name === "AbortError" && init.signal?.aborted && init.signal.reason?.name !== "TimeoutError") {
        throw e;
      }
      throw new ATPError("ETRANSPORT", `${(e as Error)?.name ?? "Error"}: ${(e as Error)?.message ?? e}`);
    }
  }

  private async *sse(id: string, last: number | undefined, signal?: AbortSignal): AsyncGenerator<Event> {
    const headers: Record<string, string> = { ...this.headers, Accept: "text/event-stream" };
    if (last !== undefined) headers["Last-Event-ID"] = String(last);
    const init: RequestInit = { method: "GET", headers };
    if (signal !== undefined) init.signal = signal;
    const resp = await this.send(`/v1/streams/${enc(id)}/events`, init);
    if (!resp.ok || resp.body === null) throw errorOf(resp, await resp.text());
    for await (const block of sseBlocks(resp.body)) {
      const ev = parseEvent(block);
      if (ev !== undefined) yield ev;
    }
  }
}

function enc(s: string): string {
  return encodeURIComponent(s);
}

/** The {@link ATPError} of a router's error answer (`{"error": {code, reason, …}}`, or OpenAI's shape). */
function errorOf(resp: Response, text: string): ATPError {
  const retry = resp.headers.get("retry-after");
  const retryAfterMs = retry !== null && /^\d+$/.test(retry) ? Number(retry) * 1000 : undefined;
  try {
    const body = JSON.parse(text) as { error?: { code?: string; reason?: string; message?: string } };
    const err = body.error ?? {};
    return new ATPError(err.code ?? "EPROTO", err.reason ?? err.message ?? text.slice(0, 200), resp.status, err,
      retryAfterMs);
  } catch {
    return new ATPError("EPROTO", `HTTP ${resp.status}: ${text.slice(0, 200)}`, resp.status, undefined, retryAfterMs);
  }
}

/** The blocks of an event stream (separated by a blank line; `\r\n`, `\r` and `\n` line ends). */
async function* sseBlocks(body: ReadableStream<Uint8Array>): AsyncGenerator<string> {
  const decoder = new TextDecoder();
  let buf = "";
  const reader = body.getReader();
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += decoder.decode(value, { stream: true }).replace(/\r\n?/g, "\n");
      let cut: number;
      while ((cut = buf.indexOf("\n\n")) >= 0) {
        yield buf.slice(0, cut);
        buf = buf.slice(cut + 2);
      }
    }
  } finally {
    reader.releaseLock();
    await body.cancel().catch(() => undefined);
  }
}

/** One SSE block → its {@link Event} (undefined: a comment or keep-alive). */
function parseEvent(block: string): Event | undefined {
  let type = "message";
  let id = 0;
  const data: string[] = [];
  for (const line of block.split("\n")) {
    const colon = line.indexOf(":");
    if (colon === 0) continue;
    const field = colon < 0 ? line : line.slice(0, colon);
    const value = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
    if (field === "event") type = value;
    else if (field === "id") id = Number(value);
    else if (field === "data") data.push(value);
  }
  if (data.length === 0) return undefined;
  const frame = JSON.parse(data.join("\n")) as Frame;
  return { type, payload: frame.payload?.content, frame, id } as Event;
}
