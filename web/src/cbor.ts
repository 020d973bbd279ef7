/** Canonical CBOR (spec/wire.md §1): RFC 8949 §4.2.1 core deterministic encoding, text map keys only, no
 * tags, nesting at most 32. Decoding is strict: input that does not re-encode to itself is `non-canonical`.
 *
 * Values: integers are `number` when safe and `bigint` otherwise; floats are `Float` (so 1.0 stays a float
 * and encodes as f9 3c00, as Python's encoder writes it); byte strings `Uint8Array`; maps `Map<string, Value>`
 * (plain objects are accepted when encoding). */
import { compare, concat, equal } from "./bytes.js";
import { DecodeError } from "./errors.js";

export class Float {
  constructor(readonly value: number) {}
}

export type Value =
  | number
  | bigint
  | Float
  | string
  | boolean
  | null
  | Uint8Array
  | Value[]
  | Map<string, Value>
  | { [key: string]: Value };

export const MAX_DEPTH = 32;
const INT_LIMIT = 1n << 64n;

class Writer {
  private chunks: Uint8Array[] = [];
  push(b: Uint8Array | number[]): void {
    this.chunks.push(b instanceof Uint8Array ? b : new Uint8Array(b));
  }
  head(major: number, n: bigint | number): void {
    const v = BigInt(n);
    const m = major << 5;
    if (v < 24n) this.push([m | Number(v)]);
    else if (v < 0x100n) this.push([m | 24, Number(v)]);
    else if (v < 0x10000n) this.push([m | 25, Number(v >> 8n), Number(v & 255n)]);
    else if (v < 0x100000000n) {
      const b = new Uint8Array(5);
      b[0] = m | 26;
      new DataView(b.buffer).setUint32(1, Number(v));
      this.push(b);
    } else {
      const b = new Uint8Array(9);
      b[0] = m | 27;
      new DataView(b.buffer).setBigUint64(1, v);
      this.push(b);
    }
  }
  bytes(): Uint8Array {
    return concat(...this.chunks);
  }
}

/** Half-precision bits of `x` if it converts exactly, else null. */
function toHalf(x: number): number | null {
  if (Number.isNaN(x)) return 0x7e00;
  if (x === Infinity) return 0x7c00;
  if (x === -Infinity) return 0xfc00;
  const f32 = new Float32Array(1);
  f32[0] = x;
  if (f32[0] !== x) return null;
  const bits = new Uint32Array(f32.buffer)[0]!;
  const sign = (bits >>> 16) & 0x8000;
  const exp = (bits >>> 23) & 0xff;
  const mant = bits & 0x7fffff;
  if (exp === 0 && mant === 0) return sign;
  const e = exp - 127;
  if (e >= -14 && e <= 15) {
    if (mant & 0x1fff) return null;
    return sign | ((e + 15) << 10) | (mant >>> 13);
  }
  if (e >= -24 && e < -14) {
    // subnormal half: value = m * 2^-24
    const full = mant | 0x800000; // 24-bit significand, value = full * 2^(e-23)
    const shift = -14 - e + 13;
    if (full & ((1 << shift) - 1)) return null;
    return sign | (full >>> shift);
  }
  return null;
}

function encodeFloat(w: Writer, x: number): void {
  const half = toHalf(x);
  if (half !== null) {
    w.push([0xf9, half >> 8, half & 255]);
    return;
  }
  const f32 = new Float32Array([x]);
  if (f32[0] === x) {
    const b = new Uint8Array(5);
    b[0] = 0xfa;
    new DataView(b.buffer).setFloat32(1, x);
    w.push(b);
    return;
  }
  const b = new Uint8Array(9);
  b[0] = 0xfb;
  new DataView(b.buffer).setFloat64(1, x);
  w.push(b);
}

function encodeInto(w: Writer, v: Value, depth: number): void {
  if (depth > MAX_DEPTH) throw new DecodeError("too-deep");
  if (v === null) return w.push([0xf6]);
  if (v === false) return w.push([0xf4]);
  if (v === true) return w.push([0xf5]);
  if (typeof v === "number") {
    if (!Number.isInteger(v)) return encodeFloat(w, v);
    v = BigInt(v);
  }
  if (typeof v === "bigint") {
    if (v >= INT_LIMIT || v < -INT_LIMIT) throw new DecodeError("bad-type", "integer outside 64 bits");
    if (v >= 0n) w.head(0, v);
    else w.head(1, -1n - v);
    return;
  }
  if (v instanceof Float) return encodeFloat(w, v.value);
  if (typeof v === "string") {
    const b = new TextEncoder().encode(v);
    w.head(3, b.length);
    return w.push(b);
  }
  if (v instanceof Uint8Array) {
    w.head(2, v.length);
    return w.push(v);
  }
  if (Array.isArray(v)) {
    w.head(4, v.length);
    for (const item of v) encodeInto(w, item, depth + 1);
    return;
  }
  const entries: [string, Value][] = v instanceof Map ? [...v.entries()] : Object.entries(v);
  const encoded = entries.map(([k, val]) => {
    if (typeof k !== "string") throw new DecodeError("bad-type", "map keys must be text");
    const kw = new Writer();
    encodeInto(kw, k, depth + 1);
    const vw = new Writer();
    encodeInto(vw, val, depth + 1);
    return [kw.bytes(), vw.bytes()] as const;
  });
  encoded.sort((a, b) => compare(a[0], b[0]));
  w.head(5, encoded.length);
  for (const [k, val] of encoded) {
    w.push(k);
    w.push(val);
  }
}

/** The canonical bytes of `v`. */
export function encode(v: Value): Uint8Array {
  const w = new Writer();
  encodeInto(w, v, 0);
  return w.bytes();
}

class Reader {
  pos = 0;
  private view: DataView;
  constructor(readonly data: Uint8Array) {
    this.view = new DataView(data.buffer, data.byteOffset, data.byteLength);
  }
  need(n: number): void {
    if (this.pos + n > this.data.length) throw new DecodeError("malformed", "truncated");
  }
  byte(): number {
    this.need(1);
    return this.data[this.pos++]!;
  }
  arg(info: number): bigint {
    if (info < 24) return BigInt(info);
    if (info === 24) return BigInt(this.byte());
    if (info === 25) {
      this.need(2);
      const v = this.view.getUint16(this.pos);
      this.pos += 2;
      return BigInt(v);
    }
    if (info === 26) {
      this.need(4);
      const v = this.view.getUint32(this.pos);
      this.pos += 4;
      return BigInt(v);
    }
    if (info === 27) {
      this.need(8);
      const v = this.view.getBigUint64(this.pos);
      this.pos += 8;
      return v;
    }
    throw new DecodeError(info === 31 ? "non-canonical" : "malformed", "indefinite or reserved length");
  }
  length(info: number): number {
    const n = this.arg(info);
    if (n > BigInt(this.data.length - this.pos)) throw new DecodeError("malformed", "length past the end");
    return Number(n);
  }
  take(n: number): Uint8Array {
    this.need(n);
    const out = this.data.subarray(this.pos, this.pos + n);
    this.pos += n;
    return out;
  }
}

function halfToNumber(h: number): number {
  const sign = h & 0x8000 ? -1 : 1;
  const exp = (h >> 10) & 0x1f;
  const mant = h & 0x3ff;
  if (exp === 0) return sign * mant * 2 ** -24;
  if (exp === 31) return mant ? NaN : sign * Infinity;
  return sign * (1 + mant / 1024) * 2 ** (exp - 15);
}

const intValue = (v: bigint): number | bigint =>
  v <= BigInt(Number.MAX_SAFE_INTEGER) && v >= -BigInt(Number.MAX_SAFE_INTEGER) ? Number(v) : v;

function decodeItem(r: Reader, depth: number): Value {
  if (depth > MAX_DEPTH) throw new DecodeError("too-deep");
  const ib = r.byte();
  const major = ib >> 5;
  const info = ib & 31;
  switch (major) {
    case 0:
      return intValue(r.arg(info));
    case 1:
      return intValue(-1n - r.arg(info));
    case 2:
      return r.take(r.length(info)).slice();
    case 3: {
      const b = r.take(r.length(info));
      try {
        return new TextDecoder("utf-8", { fatal: true }).decode(b);
      } catch {
        throw new DecodeError("malformed", "invalid UTF-8");
      }
    }
    case 4: {
      const n = r.length(info);
      const out: Value[] = [];
      for (let i = 0; i < n; i++) out.push(decodeItem(r, depth + 1));
      return out;
    }
    case 5: {
      const n = r.length(info);
      const out = new Map<string, Value>();
      for (let i = 0; i < n; i++) {
        const k = decodeItem(r, depth + 1);
        if (typeof k !== "string") throw new DecodeError("bad-type", "map keys must be text");
        if (out.has(k)) throw new DecodeError("non-canonical", "duplicate map key");
        out.set(k, decodeItem(r, depth + 1));
      }
      return out;
    }
    case 6:
      throw new DecodeError("malformed", "tags are refused");
    default: {
      if (info === 20) return false;
      if (info === 21) return true;
      if (info === 22) return null;
      if (info === 25) return new Float(halfToNumber(Number(r.arg(25))));
      if (info === 26) {
        r.need(4);
        const b = r.take(4);
        return new Float(new DataView(b.buffer, b.byteOffset).getFloat32(0));
      }
      if (info === 27) {
        const b = r.take(8);
        return new Float(new DataView(b.buffer, b.byteOffset).getFloat64(0));
      }
      throw new DecodeError("bad-type", `simple value ${info}`);
    }
  }
}

/** Decode canonical CBOR, refusing anything else (DecodeError with the reasons of wire.md §1). */
export function decode(data: Uint8Array, maxBytes: number): Value {
  if (data.length > maxBytes) throw new DecodeError("too-large", `${data.length} > ${maxBytes} bytes`);
  const r = new Reader(data);
  const v = decodeItem(r, 0);
  if (r.pos !== data.length) throw new DecodeError("non-canonical", "trailing bytes");
  if (!equal(encode(v), data)) throw new DecodeError("non-canonical");
  return v;
}

// ---- typed access to decoded values: every wrong shape is a DecodeError("bad-field"), never a crash ----

export function asMap(v: Value | undefined, what: string, keys?: { required: string[]; optional?: string[] }): Map<string, Value> {
  if (!(v instanceof Map)) throw new DecodeError("bad-field", `${what} is not a map`);
  if (keys) {
    for (const k of keys.required) if (!v.has(k)) throw new DecodeError("bad-field", `${what} lacks ${k}`);
    const known = new Set([...keys.required, ...(keys.optional ?? [])]);
    for (const k of v.keys()) if (!known.has(k)) throw new DecodeError("bad-field", `${what} has unknown field ${k}`);
  }
  return v;
}

export function asArray(v: Value | undefined, what: string, max = Infinity): Value[] {
  if (!Array.isArray(v)) throw new DecodeError("bad-field", `${what} is not an array`);
  if (v.length > max) throw new DecodeError("bad-field", `${what} has over ${max} entries`);
  return v;
}

export function asBytes(v: Value | undefined, what: string, size?: number): Uint8Array {
  if (!(v instanceof Uint8Array)) throw new DecodeError("bad-field", `${what} is not bytes`);
  if (size !== undefined && v.length !== size) throw new DecodeError("bad-field", `${what} is not ${size} bytes`);
  return v;
}

export function asText(v: Value | undefined, what: string): string {
  if (typeof v !== "string") throw new DecodeError("bad-field", `${what} is not text`);
  return v;
}

export function asUint(v: Value | undefined, what: string): number {
  if (typeof v !== "number" || !Number.isInteger(v) || v < 0) throw new DecodeError("bad-field", `${what} is not a uint`);
  return v;
}

export function asNum(v: Value | undefined, what: string): number {
  if (v instanceof Float) return v.value;
  if (typeof v === "number") return v;
  if (typeof v === "bigint") return Number(v);
  throw new DecodeError("bad-field", `${what} is not a number`);
}

export function asBool(v: Value | undefined, what: string): boolean {
  if (typeof v !== "boolean") throw new DecodeError("bad-field", `${what} is not a bool`);
  return v;
}
