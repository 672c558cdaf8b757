/**
 * The WebSocket transport of {@link Client} (spec §4.1, §4.4, §8): one connection
 * to the router's WebSocket ingress, kept up and resumed. A port of the Python
 * SDK's `atp/_ws.py` (JSON frames, no signing).
 *
 * - **Connection.** The platform's `WebSocket` (browsers, Node.js ≥ 22; Node 20
 *   with `--experimental-websocket`), or the constructor given as the `WebSocket`
 *   option. It offers the subprotocol `atp.v1.json` and, with a token,
 *   `atp.bearer.<base64url(token)>`: a `WebSocket` cannot send an `Authorization`
 *   header, so the token rides in the subprotocol list (the router authenticates it
 *   as `Authorization: Bearer`, never selects it). A refused upgrade is an
 *   {@link ATPError} with the router's code and HTTP status (401, 403) under
 *   Node.js, which asks the refusal again with `node:http`; a browser hides the
 *   status, so there it is `ETRANSPORT`.
 * - **Frames.** One text message is one frame; every frame sent carries its
 *   checksums (`frames.ts`), which the router requires. Frames are not signed: a
 *   router with `ATP_HMAC_KEYS` refuses them (`ESEC`). Every frame of the router is
 *   checked against its checksums (on its message text: `checkMessage`); one that
 *   fails is not acted on, and the stream it names fails with `EPROTO`.
 * - **Streams.** A SYN carries the task (meta: the task keys, `budget`,
 *   `idempotency_key`; `window`; `qos`; the task payload). Every stream gets an
 *   idempotency key (the caller's, else a random one) and the stream id
 *   {@link streamIdFor} derives from it, so it can always be resumed. The client
 *   numbers its messages (`msg_seq` 1, 2, … after the SYN), keeps them until the
 *   router ACKs them, and answers the router's FIN with its own.
 * - **Liveness.** An HB on stream `"0"` every `hbIntervalMs` (below the router's
 *   `hb_timeout_s`, 30 s by default); a connection from which nothing came for
 *   `hbTimeoutMs` is dead (above the router's `hb_interval_s`, 10 s by default).
 * - **Reconnection.** A dead or dropped connection is reconnected (backoff 50 ms
 *   doubling to 2 s) for up to `reconnectMs`; on each new connection every stream
 *   still open is re-opened: before its SYN+ACK with its SYN again, after it with a
 *   SYN carrying `meta.resume_after` (the router's last complete message received),
 *   then the messages the router has not ACKed. The router replays from there;
 *   {@link WsStream} drops what it already holds, so `events()` goes on with no
 *   duplicate and no gap. When reconnecting fails for `reconnectMs` every waiting
 *   call throws `ETRANSPORT`, and so does every later call.
 */
import { checkMessage, flagsOf, sealedMessage, type WireFrame } from "./frames.js";
import { ATPError, type Handle, type RawEvent, WsStream, errorOf, isMessage, streamIdFor } from "./wsstream.js";

/** A `WebSocket` constructor (the platform's, or one given in the options). */
export type WebSocketConstructor = new (url: string, protocols?: string | string[]) => WebSocket;

/** Options of the WebSocket transport (all in ms). */
export interface WsOptions {
  WebSocket?: WebSocketConstructor;
  timeoutMs: number;
  hbIntervalMs: number;
  hbTimeoutMs: number;
  reconnectMs: number;
}

/** The encoding subprotocol (spec §4.1); the prefix of the token's subprotocol. */
export const JSON_SUBPROTOCOL = "atp.v1.json";
export const BEARER_SUBPROTOCOL = "atp.bearer.";
const CONNECTION_STREAM = "0";
const BACKOFF_FIRST_MS = 50;
const BACKOFF_MAX_MS = 2000;
/** A connection that served this long ends an outage: the next one starts afresh. */
const STABLE_MS = 1000;
const OPEN = 1;

/** `atp.bearer.` + the token's UTF-8 bytes in unpadded base64url. */
export function bearerSubprotocol(token: string): string {
  let bin = "";
  for (const b of new TextEncoder().encode(token)) bin += String.fromCharCode(b);
  return BEARER_SUBPROTOCOL + btoa(bin).replace(/\+/g, "-").replace(/\//g, "_").replace(/=+$/, "");
}

function randomHex(bytes: number): string {
  return Array.from(globalThis.crypto.getRandomValues(new Uint8Array(bytes)),
    (b) => b.toString(16).padStart(2, "0")).join("");
}

function sleep(ms: number): Promise<void> {
  return new Promise((r) => setTimeout(r, ms));
}

/** Serializes async sections (the Python SDK's lock). */
class Mutex {
  private tail: Promise<void> = Promise.resolve();

  async run<T>(f: () => Promise<T>): Promise<T> {
    const prev = this.tail;
    let release = (): void => undefined;
    this.tail = new Promise((r) => { release = r; });
    await prev;
    try {
      return await f();
    } finally {
      release();
    }
  }
}

/** The router's refusal of an upgrade (`{"error": {code, reason}}`) as an {@link ATPError}. */
function refusalOf(status: number, body: string): ATPError {
  try {
    const err = (JSON.parse(body) as { error: { code: string; reason: string } }).error;
    if (typeof err.code === "string" && typeof err.reason === "string") return new ATPError(err.code, err.reason, status, err);
  } catch { /* not the router's JSON */ }
  return new ATPError(status === 401 || status === 403 ? "ESEC" : "EPROTO",
    `WebSocket upgrade refused: HTTP ${status}: ${body.slice(0, 200)}`, status);
}

/**
 * Under Node.js, the status and body of a refused upgrade (a `WebSocket` hides
 * them): the same handshake once more with `node:http`. Undefined in a browser,
 * or when the router accepts now or cannot be reached.
 */
async function askRefusal(url: string, protocols: string[], timeoutMs: number): Promise<ATPError | undefined> {
  if (typeof process === "undefined" || typeof process.versions?.node !== "string") return undefined;
  const target = new URL(url);
  const name = target.protocol === "wss:" ? "node:https" : "node:http";
  const http = (await import(name)) as typeof import("node:http");
  target.protocol = target.protocol === "wss:" ? "https:" : "http:";
  return new Promise((resolve) => {
    const req = http.request(target, {  // a connection of its own: the router answers one request a socket
      method: "GET", timeout: timeoutMs, agent: false, headers: {
        Connection: "Upgrade", Upgrade: "websocket", "Sec-WebSocket-Version": "13",
        "Sec-WebSocket-Key": btoa(String.fromCharCode(...globalThis.crypto.getRandomValues(new Uint8Array(16)))),
        "Sec-WebSocket-Protocol": protocols.join(", "),
      },
    });
    req.on("upgrade", (_res, socket) => { socket.destroy(); resolve(undefined); });
    req.on("response", (res) => {
      let body = "";
      res.setEncoding("utf8");
      res.on("data", (chunk: string) => { if (body.length < 65536) body += chunk; });
      res.on("end", () => resolve(refusalOf(res.statusCode ?? 0, body)));
      res.on("error", () => resolve(undefined));
    });
    req.on("timeout", () => { req.destroy(); resolve(undefined); });
    req.on("error", () => resolve(undefined));
    req.end();
  });
}

/** Streams over one WebSocket connection, reconnected and resumed (module doc). */
export class WsTransport {
  /** This client's own session (its SYNs and HBs); streams re-opened by key keep theirs. */
  readonly sessionId = "sess_" + randomHex(8);
  /** Connections made so far (the first one and every reconnection). */
  connections = 0;
  private readonly WS: WebSocketConstructor;
  private readonly protocols: string[];
  private readonly streams = new Map<string, WsStream>();
  private ws: WebSocket | undefined;
  private gen = 0;
  private broken: ATPError | undefined;
  private started: Promise<void> | undefined;
  private closed = false;
  private readonly lock = new Mutex();
  private readonly foreignLock = new Mutex();
  private readonly sendLock = new Mutex();
  private adoptable: WsStream | undefined;
  private inbox: Promise<void> = Promise.resolve();

  constructor(readonly url: string, token: string | undefined, private readonly opts: WsOptions) {
    const ctor = opts.WebSocket ?? (globalThis as { WebSocket?: WebSocketConstructor }).WebSocket;
    if (ctor === undefined) {
      throw new ATPError("ETRANSPORT", "no WebSocket here: Node.js 20 needs --experimental-websocket (22 has it), " +
        "or pass the WebSocket option");
    }
    if (Math.min(opts.timeoutMs, opts.hbIntervalMs, opts.hbTimeoutMs) <= 0 || opts.reconnectMs < 0) {
      throw new RangeError("timeoutMs, hbIntervalMs and hbTimeoutMs must be > 0 and reconnectMs >= 0");
    }
    this.WS = ctor;
    this.protocols = token ? [JSON_SUBPROTOCOL, bearerSubprotocol(token)] : [JSON_SUBPROTOCOL];
  }

  // ------------------------------------------------------------------ lifecycle
  /** Connect once (later calls wait for the same); throws the router's refusal or `ETRANSPORT`. */
  start(): Promise<void> {
    if (this.started === undefined) {
      this.started = new Promise((resolve, reject) => {
        void this.supervise((err) => (err === undefined ? resolve() : reject(err)));
      });
      this.started.catch(() => undefined);
    }
    return this.started;
  }

  /** Close the connection. Streams still running go on on the router (resumable by idempotency key). */
  close(): void {
    this.closed = true;
    this.ws?.close(1000, "client closed");
    this.fail(this.broken ?? new ATPError("ETRANSPORT", "the client is closed"));
  }

  private running(): void {
    if (this.broken !== undefined) throw this.broken;
  }

  // ------------------------------------------------------------------ connection
  /**
   * Keep a connection up: the first attempt's failure is {@link start}'s; later
   * ones are retried with backoff for `reconnectMs` from the end of the last
   * connection that served at least {@link STABLE_MS}.
   */
  private async supervise(first: (err?: ATPError) => void): Promise<void> {
    let started = false;
    let downSince: number | undefined;
    let delay = BACKOFF_FIRST_MS;
    while (!this.closed) {
      let upAt: number | undefined;
      try {
        const ws = await this.connect();
        upAt = Date.now();
        await this.onConnected(ws);
        if (!started) {
          started = true;
          first();
        }
        await this.serve(ws);
      } catch (e) {
        const err = e instanceof ATPError ? e : new ATPError("ETRANSPORT", String((e as Error)?.message ?? e));
        if (!started) {
          this.fail(err);
          return first(err);
        }
        if (err.status === 401 || err.status === 403) return this.fail(err);
      } finally {
        this.ws = undefined;
      }
      if (this.closed) return;
      const now = Date.now();
      if (upAt !== undefined && now - upAt >= STABLE_MS) {
        downSince = now;  // it served: a new outage starts now
        delay = BACKOFF_FIRST_MS;
      } else if (downSince === undefined) {
        downSince = now;
      }
      if (now - downSince >= this.opts.reconnectMs) {
        return this.fail(new ATPError("ETRANSPORT",
          `connection to ${this.url} lost and not re-established within ${this.opts.reconnectMs} ms`));
      }
      await sleep(delay);
      delay = Math.min(delay * 2, BACKOFF_MAX_MS);
    }
  }

  /** One WebSocket, open; throws the router's refusal, `EPROTO` (another subprotocol) or `ETRANSPORT`. */
  private connect(): Promise<WebSocket> {
    this.connections += 1;
    return new Promise((resolve, reject) => {
      let ws: WebSocket;
      try {
        ws = new this.WS(this.url, this.protocols);
      } catch (e) {
        return reject(new ATPError("ETRANSPORT", `WebSocket to ${this.url}: ${(e as Error)?.message ?? e}`));
      }
      const timer = setTimeout(() => {
        ws.close();
        reject(new ATPError("ETRANSPORT", `WebSocket handshake with ${this.url} not done within ${this.opts.timeoutMs} ms`));
      }, this.opts.timeoutMs);
      const failed = (): void => {
        clearTimeout(timer);
        ws.onerror = ws.onclose = null;
        void askRefusal(this.url, this.protocols, this.opts.timeoutMs).catch(() => undefined).then((refusal) =>
          reject(refusal ?? new ATPError("ETRANSPORT", `WebSocket handshake with ${this.url} failed: the router is ` +
            "unreachable or refused the upgrade (a browser's WebSocket does not tell the HTTP status)")));
      };
      ws.onerror = failed;
      ws.onclose = failed;
      ws.onopen = () => {
        clearTimeout(timer);
        ws.onerror = ws.onclose = null;
        if (ws.protocol !== JSON_SUBPROTOCOL) {
          ws.close(1002, "subprotocol");
          return reject(new ATPError("EPROTO", `the router answered subprotocol ${JSON.stringify(ws.protocol)}, ` +
            `not ${JSON_SUBPROTOCOL}`, 101));
        }
        resolve(ws);
      };
    });
  }

  /** A new connection: every stream still open is re-opened on it (module doc). */
  private async onConnected(ws: WebSocket): Promise<void> {
    await this.lock.run(async () => {
      this.ws = ws;
      this.gen += 1;
      await this.send(this.hb());
      for (const s of this.uniqueStreams()) {
        if (s.refused === undefined && s.error === undefined && !s.ended) await this.reopen(s);
      }
    });
  }

  /** (Re)send `s`'s SYN on the current connection, then its messages not ACKed. Lock held. */
  private async reopen(s: WsStream): Promise<void> {
    s.gen = this.gen;
    await this.send(s.reopenFrame());
    if (s.accepted) {
      for (const seq of [...s.unacked.keys()].sort((a, b) => a - b)) await this.send(s.unacked.get(seq) as WireFrame);
    }
  }

  /** Read frames until the connection closes or is silent for `hbTimeoutMs`; HBs meanwhile. */
  private serve(ws: WebSocket): Promise<void> {
    return new Promise((resolve) => {
      let silence: ReturnType<typeof setTimeout> | undefined;
      const done = (): void => {
        clearInterval(hb);
        clearTimeout(silence);
        ws.onmessage = ws.onclose = ws.onerror = null;
        resolve();
      };
      const alive = (): void => {
        clearTimeout(silence);
        silence = setTimeout(() => {
          ws.close(1000, "heartbeat timeout");  // dead: reconnect at once, not after the closing handshake
          done();
        }, this.opts.hbTimeoutMs);
      };
      const hb = setInterval(() => void this.send(this.hb()), this.opts.hbIntervalMs);
      alive();
      ws.onmessage = (ev: MessageEvent) => {
        alive();
        const data: unknown = ev.data;
        if (typeof data === "string") this.inbox = this.inbox.then(() => this.onMessage(data)).catch(() => undefined);
      };
      ws.onclose = done;
      ws.onerror = () => ws.close();
    });
  }

  private hb(): WireFrame {
    return { v: 1, session_id: this.sessionId, stream_id: CONNECTION_STREAM, msg_seq: 0, flags: ["HB"], qos: "gold" };
  }

  /**
   * Seal `frame` and send it, in call order; false when there is no connection
   * (the frame goes again with the stream's resumption).
   */
  private send(frame: WireFrame): Promise<boolean> {
    return this.sendLock.run(async () => {
      const message = await sealedMessage(frame);
      const ws = this.ws;
      if (ws === undefined || ws.readyState !== OPEN) return false;
      try {
        ws.send(message);
        return true;
      } catch {
        return false;  // going down: the reader sees it too
      }
    });
  }

  private fail(error: ATPError): void {
    this.broken = error;
    for (const s of this.uniqueStreams()) s.changed.notify();
  }

  private uniqueStreams(): WsStream[] {
    return [...new Set(this.streams.values())];
  }

  // ------------------------------------------------------------------ receiving
  private async onMessage(message: string): Promise<void> {
    let frame: WireFrame;
    try {
      frame = JSON.parse(message) as WireFrame;
    } catch {
      return;  // not JSON: dropped
    }
    if (frame === null || typeof frame !== "object" || typeof frame.stream_id !== "string") return;
    const bad = await checkMessage(message);
    if (bad !== undefined) return this.unverified(frame, bad);
    if (frame.stream_id === CONNECTION_STREAM) return;  // an HB, or an error about the connection
    const s = this.streamFor(frame);
    if (s === undefined) return;  // a stream we discarded, or never had
    let replies: WireFrame[];
    try {
      replies = s.onFrame(frame);
    } catch {
      return;  // a frame of the wrong shape: not acted on
    }
    for (const reply of replies) await this.send(reply);
    const delay = s.retryAfterMs();
    if (delay !== undefined) {
      const gen = this.gen;
      setTimeout(() => void this.lock.run(async () => {
        if (this.gen === gen && s.error === undefined && !s.ended) await this.reopen(s);
      }), delay);
    }
  }

  /** A frame that failed its checks is not acted on: the stream it names fails with the reason (and what it said). */
  private unverified(frame: WireFrame, reason: string): void {
    const s = this.streams.get(frame.stream_id as string);
    if (s === undefined) return;
    const said = errorOf(frame, "");
    const err = new ATPError("EPROTO", reason + (said.reason ? `; the router's unverified answer: ${said.code}: ${said.reason}` : ""),
      undefined, said.detail);
    if (!s.accepted) s.refused = err;
    else s.error = err;
    s.changed.notify();
  }

  private streamFor(frame: WireFrame): WsStream | undefined {
    let s = this.streams.get(frame.stream_id as string);
    if (s === undefined && this.adoptable !== undefined && flagsOf(frame).has("SYN")) {
      // The SYN+ACK of a stream our key opened elsewhere (over HTTP): the open waiting for it.
      s = this.adoptable;
      this.adoptable = undefined;
      this.streams.set(frame.stream_id as string, s);
    }
    return s;
  }

  // ------------------------------------------------------------------ streams
  private get(stream: string): WsStream {
    this.running();
    const s = this.streams.get(stream);
    if (s === undefined) {
      throw new ATPError("EPROTO", `stream ${JSON.stringify(stream)} was not opened by this client ` +
        "(re-open it with its idempotency key)");
    }
    return s;
  }

  /** Wait until `done()`; throws the client's break, the stream's error, or `ETRANSPORT` after `timeoutMs`. */
  private async wait(s: WsStream, done: () => boolean, what: string): Promise<void> {
    const deadline = Date.now() + this.opts.timeoutMs;
    while (!done()) {
      if (this.broken !== undefined) throw this.broken;
      if (s.error !== undefined) throw s.error;
      const left = deadline - Date.now();
      if (left <= 0) throw new ATPError("ETRANSPORT", `no ${what} from the router within ${this.opts.timeoutMs} ms`);
      let timer: ReturnType<typeof setTimeout> | undefined;
      await Promise.race([s.changed.wait(), new Promise((r) => { timer = setTimeout(r, left); })]);
      clearTimeout(timer);
    }
  }

  /** SYN with the task and the SYN+ACK's handle (see `Client.openStream`). */
  async openStream(task: Record<string, unknown>, body: {
    content?: unknown; budget?: unknown; qos?: string; window?: unknown; idempotencyKey?: string;
  }): Promise<Handle> {
    await this.start();
    this.running();
    const key = body.idempotencyKey ?? "sdk_" + randomHex(18);
    const sid = await streamIdFor(key);
    let s = this.streams.get(sid);
    if (s !== undefined && s.key === key && s.refused === undefined && s.error === undefined) {
      if (body.content !== undefined && !s.sameTask(task, body.content)) {
        throw new ATPError("EPROTO", `idempotency key ${JSON.stringify(key)} names a different task: this client ` +
          "opened its stream with another task_type or content");
      }
      const open = s;
      await this.wait(open, () => open.accepted || open.refused !== undefined, "SYN-ACK");
    } else {
      const fresh = s = await this.newStream(key, sid, task, body);
      if (body.idempotencyKey === undefined) {
        await this.open(fresh);
      } else {
        await this.foreignLock.run(async () => {
          this.adoptable = fresh;
          try {
            await this.open(fresh);
          } finally {
            this.adoptable = undefined;
          }
        });
      }
    }
    if (s.refused !== undefined) throw s.refused;
    return s.handle as Handle;
  }

  private async newStream(key: string, sid: string, task: Record<string, unknown>, body: {
    content?: unknown; budget?: unknown; qos?: string; window?: unknown;
  }): Promise<WsStream> {
    const meta: Record<string, unknown> = { ...task, idempotency_key: key };
    if (body.budget !== undefined) meta.budget = body.budget;
    const syn: WireFrame = { v: 1, session_id: this.sessionId, stream_id: sid, msg_seq: 0, flags: ["SYN"], meta };
    if (body.qos !== undefined) syn.qos = body.qos;
    if (body.window !== undefined) syn.window = body.window;
    if (body.content !== undefined) syn.payload = { type: "task", content: body.content };
    await sealedMessage(syn);  // a task JSON cannot carry fails here, in the caller
    const s = new WsStream(key, this.sessionId, sid, syn);
    this.streams.set(sid, s);
    return s;
  }

  private async open(s: WsStream): Promise<void> {
    await this.lock.run(async () => {
      if (this.ws !== undefined && s.gen !== this.gen) await this.reopen(s);
    });
    try {
      await this.wait(s, () => s.accepted || s.refused !== undefined, "SYN-ACK");
    } catch (e) {
      this.forget(s);  // not resumed later: the caller re-opens by key
      throw e;
    }
    if (s.refused !== undefined) this.forget(s);
  }

  private forget(s: WsStream): void {
    for (const [k, v] of [...this.streams]) if (v === s) this.streams.delete(k);
  }

  /** Forget a stream's events here (it is not resumed any more). */
  discard(stream: string): void {
    const s = this.streams.get(stream);
    if (s !== undefined) this.forget(s);
  }

  /** The stream's events from the first after `lastEventId`, until FIN or RST. */
  async *events(stream: string, lastEventId?: number): AsyncGenerator<RawEvent, void, undefined> {
    const s = this.get(stream);
    let i = Math.max(lastEventId ?? 0, 0);
    for (;;) {
      while (i < s.events.length) {
        const ev = s.events[i++] as RawEvent;
        yield ev;
        if (ev.type === "FIN" || ev.type === "RST") return;
      }
      if (s.ended) return;
      if (s.error !== undefined) throw s.error;
      if (this.broken !== undefined) throw this.broken;
      await s.changed.wait();
    }
  }

  /**
   * Send one frame on a stream; for a message, wait for the router's answer (its
   * ACK or NACK, or a lone ERROR): `[frame]`; `[]` for other frames and when the
   * stream ended first. Throws `ETRANSPORT` after `timeoutMs`.
   */
  async sendFrame(stream: string, frame: WireFrame): Promise<WireFrame[]> {
    const s = this.get(stream);
    await sealedMessage(frame);  // fails in the caller for a frame JSON cannot carry
    if (!isMessage(frame)) {
      await this.send(frame);
      return [];
    }
    if (s.ended) return [];
    const seq = s.messageSent(frame);
    const mark = s.direct.length;
    s.waiting.set(seq, undefined);
    let answer: WireFrame | undefined;
    try {
      await this.lock.run(async () => {
        if (s.gen === this.gen) await this.send(frame);
      });
      await this.wait(s, () => s.waiting.get(seq) !== undefined || s.direct.length > mark || s.ended, "answer");
    } finally {
      answer = s.waiting.get(seq);
      s.waiting.delete(seq);
    }
    return answer !== undefined ? [answer] : s.direct.slice(mark);
  }

  /** BUDGET_UPDATE (spec §4.3) as the stream's next message. */
  async budgetUpdate(stream: string, budget: Record<string, unknown>): Promise<WireFrame[]> {
    const s = this.get(stream);
    return this.sendFrame(stream, {
      v: 1, session_id: s.sessionId, stream_id: s.streamId, msg_seq: s.nextSeq, flags: ["CTRL"],
      payload: { type: "control", content: { kind: "BUDGET_UPDATE", budget } },
    });
  }
}

