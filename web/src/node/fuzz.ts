/** Property fuzzing of the browser peer's parsers (tests/web/test_web_fuzz.py): random and mutated bytes fed to
 * the CBOR decoder, the Noise handshake's message 2 and payload, the transport's framing and frames, and the
 * peer's message handler must either be taken or refused with the typed error of the spec (DecodeError,
 * TransportError, a PeerloomError reason), never anything else (a TypeError, a RangeError, an uncaught
 * throw). A successful CBOR decode must re-encode to the same bytes (the strict decoder's promise). */
import { toHex, fromHex } from "../bytes.js";
import { decode, encode, Float, type Value } from "../cbor.js";
import { Connection, type SocketLike } from "../conn.js";
import { DecodeError, PeerloomError, TransportError } from "../errors.js";
import { Identity } from "../identity.js";
import { CipherState, decodePayload, encodePayload, Initiator } from "../noise.js";
import { parseManifest } from "../objects.js";
import { BrowserPeer, type Link, type PeerEvent } from "../peer.js";

/** xorshift32: the same cases for the same seed. */
class Rng {
  constructor(private s: number) {
    if (this.s === 0) this.s = 0x9e3779b9;
  }
  next(): number {
    let x = this.s;
    x ^= x << 13; x >>>= 0;
    x ^= x >>> 17;
    x ^= x << 5; x >>>= 0;
    this.s = x;
    return x;
  }
  int(n: number): number {
    return this.next() % n;
  }
  bytes(n: number): Uint8Array {
    const out = new Uint8Array(n);
    for (let i = 0; i < n; i++) out[i] = this.next() & 255;
    return out;
  }
}

function randomValue(r: Rng, depth: number): Value {
  const k = r.int(depth > 3 ? 7 : 9);
  switch (k) {
    case 0: return r.int(3) === 0 ? BigInt(r.next()) * BigInt(r.next()) : r.next() >>> r.int(32);
    case 1: return -1 - (r.next() >>> r.int(32));
    case 2: return r.bytes(r.int(40));
    case 3: return String.fromCodePoint(...Array.from({ length: r.int(12) }, () => [0x41, 0xe9, 0x4e2d, 0x1f600][r.int(4)]! + r.int(20)));
    case 4: return [true, false, null][r.int(3)]!;
    case 5: return new Float([0, 1, -2.5, 1e300, 0.1, NaN, Infinity, 65504, 1e-7][r.int(9)]!);
    case 6: return r.int(2) ? BigInt.asUintN(64, BigInt(r.next()) << 32n) : r.int(1000);
    case 7: return Array.from({ length: r.int(5) }, () => randomValue(r, depth + 1));
    default: {
      const m = new Map<string, Value>();
      for (let i = r.int(5); i > 0; i--) m.set(`k${r.int(50)}`, randomValue(r, depth + 1));
      return m;
    }
  }
}

function mutate(r: Rng, data: Uint8Array): Uint8Array {
  let d = data.slice();
  for (let n = 1 + r.int(3); n > 0; n--) {
    const at = d.length ? r.int(d.length) : 0;
    switch (r.int(6)) {
      case 0: if (d.length) d[at] = d[at]! ^ (1 << r.int(8)); break;
      case 1: if (d.length) d[at] = r.next() & 255; break;
      case 2: { const x = new Uint8Array(d.length + 1); x.set(d.subarray(0, at)); x[at] = r.next() & 255; x.set(d.subarray(at), at + 1); d = x; break; }
      case 3: if (d.length) d = new Uint8Array([...d.subarray(0, at), ...d.subarray(at + 1)]); break;
      case 4: d = d.subarray(0, at); break;
      default: if (d.length) d[at] = [0x00, 0x17, 0x18, 0x1b, 0x1f, 0x5f, 0x7f, 0x9f, 0xbf, 0xff, 0xf9, 0xfb][r.int(12)]!; break;
    }
  }
  return d;
}

interface Failure { target: string; input: string; error: string }

/** True when `e` is a typed failure: a PeerloomError that is not a wrapped crash (a detail quoting a JS error). */
function typed(e: unknown, kind: typeof PeerloomError = PeerloomError): boolean {
  return e instanceof kind && !/\b(TypeError|RangeError|ReferenceError|SyntaxError|Error):/.test(e.detail);
}

export function fuzz(cmd: { seed: number; ms: number; manifest: string; messages: string[] }): unknown {
  const r = new Rng(cmd.seed >>> 0);
  const failures: Failure[] = [];
  const counts: Record<string, number> = {};
  const fail = (target: string, input: Uint8Array, error: unknown) => {
    if (failures.length < 20) failures.push({ target, input: toHex(input), error: String(error) });
  };
  const run = (target: string, body: () => void) => {
    const until = performance.now() + cmd.ms;
    let n = 0;
    while (performance.now() < until) {
      body();
      n++;
    }
    counts[target] = n;
  };

  run("cbor", () => {
    const value = randomValue(r, 0);
    const valid = encode(value);
    try {
      if (toHex(encode(decode(valid, 1 << 20))) !== toHex(valid)) fail("cbor-roundtrip", valid, "re-encodes differently");
    } catch (e) {
      fail("cbor-roundtrip", valid, e);
    }
    const input = r.int(4) === 0 ? r.bytes(r.int(48)) : mutate(r, valid);
    try {
      const v = decode(input, 1 << 20);
      if (toHex(encode(v)) !== toHex(input)) fail("cbor", input, "accepted bytes that do not re-encode to themselves");
    } catch (e) {
      if (!typed(e, DecodeError)) fail("cbor", input, e);
    }
  });

  const id = Identity.generate();
  const payload = encodePayload(new Uint8Array([8, 1, 18, 32, ...id.publicKey]), r.bytes(64));
  run("payload", () => {
    const input = r.int(4) === 0 ? r.bytes(r.int(120)) : mutate(r, payload);
    try {
      decodePayload(input);
    } catch (e) {
      if (!typed(e, TransportError)) fail("payload", input, e);
    }
  });

  run("message2", () => {
    // message 2 of a responder we do not have: random ephemeral keys (low-order points among them) and
    // ciphertexts of every length around the minimum
    const input = r.bytes([0, 50, 95, 96, 97, 150, 300][r.int(7)]! + r.int(3));
    if (input.length >= 32 && r.int(3) === 0) input.fill(r.int(2) ? 0 : 0xff, 0, 32);
    if (input.length >= 32 && r.int(5) === 0) input.set([1, ...new Uint8Array(31)], 0);
    try {
      new Initiator(id).readMessage2(input);
      fail("message2", input, "accepted");
    } catch (e) {
      if (!typed(e, TransportError)) fail("message2", input, e);
    }
  });

  // A connection past its handshake (null ciphers: plaintext transport) fed random frames and byte streams.
  const socket = (): SocketLike => ({ binaryType: "", readyState: 1, send: () => {}, close: () => {}, onopen: null,
    onmessage: null, onclose: null, onerror: null });
  const fresh = (): Connection => {
    const ConnCtor = Connection as unknown as new (s: SocketLike, max: number) => Connection;
    const c = new ConnCtor(socket(), 1 << 20);
    const internals = c as unknown as { send_: CipherState; receive: CipherState };
    internals.send_ = new CipherState(null);
    internals.receive = new CipherState(null);
    return c;
  };
  const seeds = [new Uint8Array([0x10, 0, 0, 0, 3, 1, 2, 3]), new Uint8Array([0x11, 0, 0, 0, 9, 1]),
    new Uint8Array([0x21, 7, 7]), new Uint8Array([0x30, 1, 2, 3, 4, 5, 6, 7, 8]), new Uint8Array([0x51, 0, 0, 1, 0]),
    new Uint8Array([0x40, 0, 0, 0, 0, 0, 0, 0, 0])];
  let conn = fresh();
  run("frames", () => {
    if (conn.closed) conn = fresh();
    const frame = r.int(3) === 0 ? r.bytes(r.int(12)) : mutate(r, seeds[r.int(seeds.length)]!);
    try {
      (conn as unknown as { frame: (f: Uint8Array) => void }).frame(frame);
    } catch (e) {
      if (!typed(e, TransportError)) fail("frames", frame, e);
      conn = fresh();
    }
  });
  run("stream", () => {
    const c = fresh();
    const framed: Uint8Array[] = [];
    for (let i = r.int(4); i >= 0; i--) {
      const f = r.int(2) ? mutate(r, seeds[r.int(seeds.length)]!) : r.bytes(r.int(8));
      framed.push(new Uint8Array([f.length >> 8, f.length & 255, ...f]));
    }
    const input = mutate(r, new Uint8Array(framed.flatMap((f) => [...f])));
    (c as unknown as { feed: (d: Uint8Array) => void }).feed(input);
    if (c.closed && !typed(c.closed, TransportError)) fail("stream", input, c.closed);
  });

  // The peer's message handler: every input is taken or refused with a reason (a `rejected` event), and a
  // refusal that wraps a JavaScript error (reason bad-message, detail "TypeError: ...") is a crash.
  const events: PeerEvent[] = [];
  const peer = new BrowserPeer({ edge: "http://127.0.0.1:9", identity: id, onEvent: (e) => events.push(e),
    WebSocket: class { constructor() { throw new Error("no network in the fuzzer"); } } as unknown as new (url: string) => SocketLike });
  peer.manifest = parseManifest(fromHex(cmd.manifest), null);
  const fake = { closed: null, bytesSent: 0, bytesReceived: 0, remotePeer: new Uint8Array(38), send: async () => {}, close: () => {} };
  const link: Link = { conn: fake as unknown as Connection, address: "", roles: [], primary: true };
  const valid = cmd.messages.map(fromHex);
  const receive = (peer as unknown as { receive: (l: Link, d: Uint8Array) => void }).receive.bind(peer);
  run("messages", () => {
    const input = r.int(8) === 0 ? valid[r.int(valid.length)]! : mutate(r, valid[r.int(valid.length)]!);
    events.length = 0;
    peer.head = null;
    try {
      receive(link, input);
    } catch (e) {
      fail("messages", input, `thrown out of the handler: ${String(e)}`);
      return;
    }
    for (const e of events) {
      if (e.type === "rejected" && e.reason === "bad-message" && /\b(TypeError|RangeError|ReferenceError|Error):/.test(e.detail)) {
        fail("messages", input, e.detail);
      }
    }
  });
  peer.stopped = true;
  return { counts, failures };
}
