/**
 * One stream's client state over WebSocket (no I/O): its SYN, the router's events
 * it received, its own messages not yet ACKed, and how to resume it. A port of the
 * Python SDK's `atp/_wsstream.py`.
 *
 * Event ids. The router logs every frame it sends on a stream (ids 1, 2, …; the
 * SSE `id:`) and its WebSocket ingress sends them in that order from a point:
 * event 1 (the SYN+ACK) after a SYN without `meta.resume_after`, else the event
 * after the one {@link WsStream.resumePoint} names — computed here as the router's
 * `EventLog.after_message` does over the same frames. So each logged frame's id is
 * known on arrival (`cursor`): ids already held are duplicates of a replay (checked
 * against the held frame's checksum, then dropped) and the others extend
 * `events` with no gap.
 *
 * Frames the router sends outside the log (a lone `["CTRL"]` ERROR at `msg_seq` 0;
 * a refused SYN's RST) carry no event id: before the SYN+ACK they refuse the SYN,
 * after it they answer one of our frames.
 */
import { controlOf, eventType, flagsOf, publicFrame, type WireFrame } from "./frames.js";

/** An error of the router (`code` a spec §10 code) or of the transport (`ETRANSPORT`). */
export class ATPError extends Error {
  constructor(
    readonly code: string,
    readonly reason: string,
    readonly status?: number,
    readonly detail?: unknown,
    readonly retryAfterMs?: number,
  ) {
    super(`${code}: ${reason}`);
    this.name = "ATPError";
  }
}

/** One event as the WebSocket transport holds it (the `Event` of `index.ts`). */
export interface RawEvent {
  type: string;
  payload: unknown;
  frame: WireFrame;
  id: number;
}

/** The stream handle's shape (`StreamHandle` of `index.ts`). */
export interface Handle {
  sessionId: string;
  streamId: string;
  window: Record<string, number>;
  route: Record<string, unknown>;
}

const NOT_MESSAGE = ["SYN", "ACK", "FIN", "RST", "HB"];
const TERMINAL = new Set(["FIN", "RST"]);

/** The stream id the SDKs (Python and this one) give the stream of idempotency `key`. */
export async function streamIdFor(key: string): Promise<string> {
  const digest = await globalThis.crypto.subtle.digest("SHA-256", new TextEncoder().encode(key));
  return "ik_" + Array.from(new Uint8Array(digest), (b) => b.toString(16).padStart(2, "0")).join("").slice(0, 32);
}

/** A client message (DATA or CTRL data, numbered by `msg_seq`), which the router ACKs. */
export function isMessage(frame: WireFrame): boolean {
  const flags = flagsOf(frame);
  return !NOT_MESSAGE.some((f) => flags.has(f)) && typeof frame.msg_seq === "number";
}

/** The router's ERROR in `frame` as an {@link ATPError} (`fallback` as the reason without one). */
export function errorOf(frame: WireFrame, fallback: string): ATPError {
  const c = controlOf(frame);
  if (c?.kind === "ERROR") {
    const retry = typeof c.retry_after_ms === "number" ? c.retry_after_ms : undefined;
    return new ATPError(String(c.code ?? "EPROTO"), String(c.reason ?? ""), undefined, c, retry);
  }
  return new ATPError("EPROTO", fallback);
}

/** Wakes every waiter at each {@link notify}. */
export class Signal {
  private waiters: (() => void)[] = [];

  notify(): void {
    const w = this.waiters;
    this.waiters = [];
    for (const f of w) f();
  }

  wait(): Promise<void> {
    return new Promise((resolve) => this.waiters.push(resolve));
  }
}

/** The client side of one stream (module doc). `syn` is the SYN as first built (unsealed). */
export class WsStream {
  readonly changed = new Signal();
  readonly events: RawEvent[] = [];
  private readonly checksums: unknown[] = [];
  handle: Handle | undefined;
  /** The SYN was refused (before any SYN+ACK). */
  refused: ATPError | undefined;
  /** The stream can no longer be followed (resumption failed, replay out of step). */
  error: ATPError | undefined;
  /** Connection generation the stream was last (re)opened on. */
  gen = -1;
  cursor = 0;
  /** A resume SYN went out on this connection and nothing of the log came back yet. */
  resuming = false;
  nextSeq = 1;
  /** Our messages the router has not ACKed: msg_seq → frame (unsealed), re-sent on resume. */
  readonly unacked = new Map<number, WireFrame>();
  /** msg_seq of messages whose sender waits for the answer → the answering frame. */
  readonly waiting = new Map<number, WireFrame | undefined>();
  /** Lone ERROR frames about this stream (answers to our frames) since it opened. */
  readonly direct: WireFrame[] = [];
  private finSent = false;

  constructor(readonly key: string, public sessionId: string, public streamId: string, readonly syn: WireFrame) {}

  get accepted(): boolean {
    return this.handle !== undefined;
  }

  get ended(): boolean {
    const last = this.events.at(-1);
    return last !== undefined && TERMINAL.has(last.type);
  }

  /**
   * `[event id, msg_seq]` to resume after: the newest held event that is the last
   * fragment of a router DATA message or the SYN+ACK (the router's
   * `EventLog.after_message` of that `msg_seq` is that very event).
   */
  resumePoint(): [number, number] {
    for (let i = this.events.length - 1; i >= 0; i--) {
      const ev = this.events[i] as RawEvent;
      const flags = flagsOf(ev.frame);
      if ((flags.has("ACK") && !flags.has("SYN")) || ["MORE", "RST", "FIN", "HB"].some((f) => flags.has(f))) continue;
      return [ev.id, Number(ev.frame.msg_seq)];
    }
    return [0, 0];
  }

  /**
   * The SYN to send on a new connection: the original one until the SYN+ACK came;
   * after it a SYN without the task, on the stream's ids, with `meta.resume_after`,
   * which sets the position the replay starts from.
   */
  reopenFrame(): WireFrame {
    if (!this.accepted) {
      this.cursor = 0;
      return this.syn;
    }
    const [cursor, msgSeq] = this.resumePoint();
    this.cursor = cursor;
    this.resuming = true;
    const { payload: _task, ...frame } = this.syn;
    const meta = { ...(this.syn.meta as Record<string, unknown>), resume_after: msgSeq };
    return { ...frame, session_id: this.sessionId, stream_id: this.streamId, meta };
  }

  /** Whether `task`/`content` is the task this stream's SYN carried (what the router's idempotency check compares). */
  sameTask(task: Record<string, unknown>, content: unknown): boolean {
    const payload = this.syn.payload as { content?: unknown } | undefined;
    if (payload === undefined) return true;
    const meta = this.syn.meta as Record<string, unknown>;
    return task.task_type === meta.task_type && JSON.stringify(content) === JSON.stringify(payload.content);
  }

  /** Track one of our messages until its ACK; returns its msg_seq. */
  messageSent(frame: WireFrame): number {
    const seq = Number(frame.msg_seq);
    this.unacked.set(seq, frame);
    this.nextSeq = Math.max(this.nextSeq, seq + 1);
    return seq;
  }

  /** A router frame of this stream; returns the frames to send back (our FIN after the router's, an RST). */
  onFrame(frame: WireFrame): WireFrame[] {
    const flags = flagsOf(frame);
    let out: WireFrame[] = [];
    if (!this.accepted) {
      if (flags.has("SYN")) {
        this.accept(frame);
        this.log(frame);
      } else {
        this.refused = errorOf(frame, "the router refused the SYN");
      }
    } else if (flags.size === 1 && flags.has("CTRL") && frame.msg_seq === 0) {
      this.onDirect(frame);
    } else if (flags.has("SYN") && this.cursor > 0) {
      // A resume SYN re-created a stream the router no longer had: its log is gone.
      this.error = new ATPError("EPROTO", `the router no longer has stream ${JSON.stringify(this.streamId)}: its ` +
        `events after id ${this.events.length} are lost; open it again`);
      out = [this.frame(["RST", "CTRL"], this.nextSeq - 1, { type: "control", content: {
        kind: "ERROR", code: "EPROTO", reason: "stream re-created by a resumption; not wanted" } })];
    } else {
      out = this.log(frame);
    }
    this.changed.notify();
    return out;
  }

  private accept(frame: WireFrame): void {
    // The router's ids win: a stream re-opened by key may live in another session.
    this.sessionId = String(frame.session_id);
    this.streamId = String(frame.stream_id);
    const meta = frame.meta as Record<string, unknown> | undefined;
    const route = meta?.route;
    const window = frame.window;
    this.handle = {
      sessionId: this.sessionId, streamId: this.streamId,
      window: window && typeof window === "object" ? { ...(window as Record<string, number>) } : {},
      route: route && typeof route === "object" ? { ...(route as Record<string, unknown>) } : {},
    };
  }

  private log(frame: WireFrame): WireFrame[] {
    this.resuming = false;
    this.cursor += 1;
    if (this.cursor <= this.events.length) {  // a replay of what we hold
      const held = this.checksums[this.cursor - 1];
      if (held !== undefined && frame.checksum !== held) {
        this.error = new ATPError("EPROTO", `resumption out of step on stream ${JSON.stringify(this.streamId)}: ` +
          `event ${this.cursor} differs from the one received before`);
      }
      return [];
    }
    const type = eventType(frame);
    const payload = frame.payload as { content?: unknown } | undefined;
    this.events.push({ type, payload: payload?.content, frame: publicFrame(frame), id: this.cursor });
    this.checksums.push(frame.checksum);
    const flags = flagsOf(frame);
    if (flags.has("ACK") && !flags.has("SYN") && typeof frame.msg_seq === "number") this.acked(frame);
    if (type === "FIN" && !this.finSent) {
      this.finSent = true;
      return [this.frame(["FIN"], this.nextSeq - 1)];
    }
    return [];
  }

  /** A router ACK (or NACK) names the last of our messages it delivered (§4.4). */
  private acked(frame: WireFrame): void {
    const m = Number(frame.msg_seq);
    this.nextSeq = Math.max(this.nextSeq, m + 1);
    for (const seq of [...this.unacked.keys()]) if (seq <= m) this.unacked.delete(seq);
    for (const [seq, answer] of this.waiting) if (seq <= m && answer === undefined) this.waiting.set(seq, frame);
  }

  /**
   * A lone ERROR about this stream: the refusal of a resumption (failing the
   * stream unless the router says when to retry), else the answer to one of our
   * frames (a message on a stream it closed).
   */
  private onDirect(frame: WireFrame): void {
    this.direct.push(frame);
    if (this.resuming) {
      const err = errorOf(frame, "the router refused the resumption");
      if (err.retryAfterMs === undefined) this.error = err;
    }
  }

  /** Milliseconds to wait before re-sending a resumption refused with `retry_after_ms` (undefined: none). */
  retryAfterMs(): number | undefined {
    if (!this.resuming || this.error !== undefined || this.direct.length === 0) return undefined;
    const ms = controlOf(this.direct.at(-1) as WireFrame)?.retry_after_ms;
    return typeof ms === "number" ? ms : undefined;
  }

  private frame(flags: string[], msgSeq: number, payload?: Record<string, unknown>): WireFrame {
    const f: WireFrame = { v: 1, session_id: this.sessionId, stream_id: this.streamId, msg_seq: Math.max(msgSeq, 0), flags };
    if (payload !== undefined) f.payload = payload;
    return f;
  }
}
