/**
 * ATP frames on the client side (spec §4.2, §4.5), as the router checks them; a
 * port of the Python SDK's `atp/_frames.py` for the JSON encoding, without signing.
 *
 * - **Canonical bytes**: compact JSON with object keys sorted in code-point order,
 *   UTF-8 unescaped, of the frame without `sig` and `checksum` and without the
 *   fields at their default (`frag_seq` 0, `flags` [], `qos` "silver", `ttl` 8,
 *   `meta` {}, null `window`/`payload`; in the payload null `content`,
 *   `confidence`, `cost_est`). This is what the router's msgspec writes for the
 *   frame it decoded from what we sent, so numbers are written as it writes them:
 *   an integer below 1e21 in digits (JSON reads it back as an integer); any other
 *   number as a float in its shortest round-trip digits, fixed notation for decimal
 *   exponents -5..15, else `<digits>e<exponent>` (`1.5e-7`, `1e21`). NaN and
 *   infinities are refused (`TypeError`), as are values JSON cannot carry.
 * - **Checksums**: `payload.checksum` = `"sha256:" + hex` of the payload's canonical
 *   bytes without its own checksum; `checksum` = that of the frame's canonical bytes
 *   (which include `payload.checksum`). The router's WebSocket ingress requires them.
 * - **Signatures** (`sig`, HMAC-SHA256, spec §11) are not made: a router with
 *   `ATP_HMAC_KEYS` refuses this client's frames with `ESEC`.
 */

/** A frame as a plain object (the §4.2 wire shape). */
export type WireFrame = Record<string, unknown>;

const FRAME_DEFAULTS: Record<string, unknown> = {
  frag_seq: 0, flags: [], qos: "silver", ttl: 8, window: null, meta: {}, payload: null,
};
const PAYLOAD_DEFAULTS: Record<string, unknown> = { content: null, confidence: null, cost_est: null };
const SHA = "sha256:";

/** The JSON data model of `value` (what `JSON.stringify` keeps), refusing non-finite numbers. */
function plain(value: unknown): unknown {
  const text = JSON.stringify(value, (_k, v: unknown) => {
    if (typeof v === "number" && !Number.isFinite(v)) {
      throw new TypeError(`non-finite number ${v} cannot be sent in a frame (JSON data model)`);
    }
    return v;
  });
  if (text === undefined) throw new TypeError("a frame must be a JSON object");
  return JSON.parse(text) as unknown;
}

/** A number as the router's msgspec re-encodes it after reading our JSON (module doc). */
export function canonicalNumber(n: number): string {
  if (!Number.isFinite(n)) throw new TypeError(`non-finite number ${n} cannot be sent in a frame`);
  if (Number.isInteger(n) && Math.abs(n) < 1e21) return JSON.stringify(n);
  const [mant = "", exp = "0"] = n.toExponential().split("e");
  const e = Number(exp);
  if (e >= -5 && e <= 15) return String(n);
  return `${mant}e${e}`;
}

function byCodePoint(a: string, b: string): number {
  const x = Array.from(a, (c) => c.codePointAt(0) ?? 0);
  const y = Array.from(b, (c) => c.codePointAt(0) ?? 0);
  for (let i = 0; i < Math.min(x.length, y.length); i++) {
    if (x[i] !== y[i]) return (x[i] ?? 0) - (y[i] ?? 0);
  }
  return x.length - y.length;
}

function encode(v: unknown, out: string[]): void {
  if (v === null) out.push("null");
  else if (typeof v === "string" || typeof v === "boolean") out.push(JSON.stringify(v));
  else if (typeof v === "number") out.push(canonicalNumber(v));
  else if (Array.isArray(v)) {
    out.push("[");
    v.forEach((item, i) => {
      if (i) out.push(",");
      encode(item, out);
    });
    out.push("]");
  } else if (typeof v === "object") {
    const obj = v as Record<string, unknown>;
    out.push("{");
    Object.keys(obj).sort(byCodePoint).forEach((k, i) => {
      if (i) out.push(",");
      out.push(JSON.stringify(k), ":");
      encode(obj[k], out);
    });
    out.push("}");
  } else {
    throw new TypeError(`${typeof v} value cannot be sent in a frame (JSON data model only)`);
  }
}

/** Compact sorted-key JSON of a value already in the JSON data model (module doc). */
export function canonicalJson(value: unknown): string {
  const out: string[] = [];
  encode(value, out);
  return out.join("");
}

function isDefault(v: unknown, d: unknown): boolean {
  if (Array.isArray(d)) return Array.isArray(v) && v.length === 0;
  if (d !== null && typeof d === "object") {
    return v !== null && typeof v === "object" && !Array.isArray(v) && Object.keys(v).length === 0;
  }
  return v === d;
}

function drop(obj: Record<string, unknown>, defaults: Record<string, unknown>, ...also: string[]): Record<string, unknown> {
  const out: Record<string, unknown> = {};
  for (const [k, v] of Object.entries(obj)) {
    if (also.includes(k) || (k in defaults && isDefault(v, defaults[k]))) continue;
    out[k] = v;
  }
  return out;
}

function canonicalPayload(payload: Record<string, unknown>, withChecksum: boolean): Record<string, unknown> {
  const p = drop(payload, PAYLOAD_DEFAULTS, ...(withChecksum ? [] : ["checksum"]));
  if (p.checksum === null) delete p.checksum;
  const cost = p.cost_est;
  if (cost !== null && typeof cost === "object" && !Array.isArray(cost)) {
    p.cost_est = drop(cost as Record<string, unknown>, { in_tokens: 0, out_tokens: 0 });
  }
  return p;
}

function isObject(v: unknown): v is Record<string, unknown> {
  return v !== null && typeof v === "object" && !Array.isArray(v);
}

/** The text the frame's `checksum` covers (module doc). */
export function frameCanonical(frame: WireFrame): string {
  const f = drop(frame, FRAME_DEFAULTS, "sig", "checksum");
  if (isObject(f.payload)) f.payload = canonicalPayload(f.payload, true);
  return canonicalJson(f);
}

async function sha256(text: string): Promise<string> {
  const digest = await globalThis.crypto.subtle.digest("SHA-256", new TextEncoder().encode(text));
  return SHA + Array.from(new Uint8Array(digest), (b) => b.toString(16).padStart(2, "0")).join("");
}

/**
 * One WebSocket text message: `frame` with its payload checksum and checksum
 * (module doc). Throws `TypeError` for a value JSON cannot carry (NaN, a bigint, …).
 */
export async function sealedMessage(frame: WireFrame): Promise<string> {
  const out = plain(frame) as Record<string, unknown>;
  delete out.sig;
  delete out.checksum;
  if (isObject(out.payload)) {
    const p = { ...out.payload };
    delete p.checksum;
    out.payload = { ...p, checksum: await sha256(canonicalJson(canonicalPayload(p, false))) };
  }
  out.checksum = await sha256(frameCanonical(out));
  return JSON.stringify(out);
}

/** The frame's flags (strings only). */
export function flagsOf(frame: WireFrame): Set<string> {
  const flags = frame.flags;
  return new Set(Array.isArray(flags) ? flags.filter((f): f is string => typeof f === "string") : []);
}

/** The control payload's content (`{kind, …}`), or undefined. */
export function controlOf(frame: WireFrame): Record<string, unknown> | undefined {
  const p = frame.payload;
  if (isObject(p) && p.type === "control" && isObject(p.content)) return p.content;
  return undefined;
}

/** The event name of a router frame, as the router's SSE names it. */
export function eventType(frame: WireFrame): string {
  const flags = flagsOf(frame);
  if (flags.has("RST")) return "RST";
  if (flags.has("SYN")) return "SYN_ACK";
  const p = frame.payload;
  if (isObject(p)) {
    if (p.type === "agent.result.final") return "FINAL";
    if (p.type === "agent.result.partial") return "PARTIAL";
    if (p.type === "control") {
      const kind = controlOf(frame)?.kind;
      return kind === "ERROR" || kind === "WINDOW_UPDATE" ? kind : "CONTROL";
    }
    if (p.type === "agent.result.log") return "LOG";
  }
  for (const flag of ["FIN", "HB", "ACK"]) if (flags.has(flag)) return flag;
  return "DATA";
}

/** `frame` without its integrity fields (`sig`, `checksum`, `payload.checksum`): what the SSE events carry. */
export function publicFrame(frame: WireFrame): WireFrame {
  const out: WireFrame = { ...frame };
  delete out.sig;
  delete out.checksum;
  if (isObject(out.payload) && "checksum" in out.payload) {
    const p = { ...out.payload };
    delete p.checksum;
    out.payload = p;
  }
  return out;
}

// ------------------------------------------------------------------ checking the router's frames

/** A JSON value as written: scalars keep their text, objects their members' key and value. */
type Raw = { text: string } | { items: Raw[] } | { members: [string, string, Raw][] };

/** Deepest nesting read in a router frame (the router's own decoder stops near 1000 levels). */
const MAX_DEPTH = 1000;
const NUMBER = /-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?/y;
const STRING = /"(?:[^"\\\u0000-\u001f]|\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4}))*"/y;
const WORD = /true|false|null/y;
const SPACE = /[ \t\n\r]*/y;

/** Parses JSON text keeping each scalar's text (JSON.parse loses `1.0` vs `1`, which the checksum covers). */
class RawParser {
  private i = 0;

  constructor(private readonly s: string) {}

  parse(): Raw {
    const v = this.value(0);
    this.space();
    if (this.i !== this.s.length) throw new SyntaxError("trailing text after the JSON value");
    return v;
  }

  private space(): void {
    SPACE.lastIndex = this.i;
    SPACE.exec(this.s);
    this.i = SPACE.lastIndex;
  }

  private token(re: RegExp): string | undefined {
    re.lastIndex = this.i;
    const m = re.exec(this.s);
    if (m === null) return undefined;
    this.i = re.lastIndex;
    return m[0];
  }

  private expect(c: string): void {
    this.space();
    if (this.s[this.i] !== c) throw new SyntaxError(`expected ${c} at ${this.i}`);
    this.i++;
  }

  private value(depth: number): Raw {
    if (depth > MAX_DEPTH) throw new SyntaxError("nested too deeply");
    this.space();
    const c = this.s[this.i];
    if (c === "{") return this.object(depth);
    if (c === "[") return this.array(depth);
    const text = this.token(c === '"' ? STRING : c === "t" || c === "f" || c === "n" ? WORD : NUMBER);
    if (text === undefined) throw new SyntaxError(`unexpected text at ${this.i}`);
    return { text };
  }

  private object(depth: number): Raw {
    this.i++;
    const members: [string, string, Raw][] = [];
    this.space();
    if (this.s[this.i] === "}") {
      this.i++;
      return { members };
    }
    for (;;) {
      this.space();
      const keyText = this.token(STRING);
      if (keyText === undefined) throw new SyntaxError(`expected a key at ${this.i}`);
      this.expect(":");
      members.push([JSON.parse(keyText) as string, keyText, this.value(depth + 1)]);
      this.space();
      if (this.s[this.i] === "}") {
        this.i++;
        return { members };
      }
      this.expect(",");
    }
  }

  private array(depth: number): Raw {
    this.i++;
    const items: Raw[] = [];
    this.space();
    if (this.s[this.i] === "]") {
      this.i++;
      return { items };
    }
    for (;;) {
      items.push(this.value(depth + 1));
      this.space();
      if (this.s[this.i] === "]") {
        this.i++;
        return { items };
      }
      this.expect(",");
    }
  }
}

/** Sorted-key compact text of a raw value, without the members named in `skip` (top level only). */
function rawCanonical(v: Raw, skip: string[] = []): string {
  if ("text" in v) return v.text;
  if ("items" in v) return "[" + v.items.map((x) => rawCanonical(x)).join(",") + "]";
  const members = v.members.filter(([k]) => !skip.includes(k)).sort(([a], [b]) => byCodePoint(a, b));
  return "{" + members.map(([, keyText, x]) => keyText + ":" + rawCanonical(x)).join(",") + "}";
}

/**
 * Check a router frame's payload checksum and checksum against its message text
 * (the router writes its fields at their default omitted, so its text sorted is the
 * canonical text). Returns an error reason, or undefined when both match (a frame
 * without a checksum is refused: the router seals every frame).
 */
export async function checkMessage(message: string): Promise<string | undefined> {
  let raw: Raw;
  try {
    raw = new RawParser(message).parse();
  } catch (e) {
    return `undecodable JSON message from the router: ${(e as Error).message}`;
  }
  if (!("members" in raw)) return "a message from the router that is not a frame";
  const field = (r: Raw & { members: [string, string, Raw][] }, name: string): Raw | undefined =>
    r.members.find(([k]) => k === name)?.[2];
  const payload = field(raw, "payload");
  if (payload !== undefined && "members" in payload) {
    const pcs = field(payload, "checksum");
    if (pcs !== undefined && "text" in pcs && pcs.text !== "null") {
      if (JSON.parse(pcs.text) !== await sha256(rawCanonical(payload, ["checksum"]))) {
        return "frame from the router: payload checksum mismatch";
      }
    }
  }
  const cs = field(raw, "checksum");
  if (cs === undefined || !("text" in cs) || JSON.parse(cs.text) !== await sha256(rawCanonical(raw, ["checksum", "sig"]))) {
    return "frame from the router: missing checksum or checksum mismatch";
  }
  return undefined;
}
