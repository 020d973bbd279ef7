/** The libp2p `/noise` handshake as initiator (spec/transport.md §1): Noise_XX_25519_ChaChaPoly_SHA256, empty
 * prologue, the NoiseHandshakePayload of libp2p in messages 2 and 3. The browser offers no transport
 * cipher (§1.1), so the transport phase is always ChaChaPoly. Primitives come from @noble. */
import { chacha20poly1305 } from "@noble/ciphers/chacha.js";
import { x25519 } from "@noble/curves/ed25519.js";
import { hmac } from "@noble/hashes/hmac.js";
import { sha256 } from "@noble/hashes/sha2.js";
import { concat, equal, utf8 } from "./bytes.js";
import { TransportError } from "./errors.js";
import { Identity, KEY_PROTOBUF_PREFIX, peerIdOf, verify } from "./identity.js";

const PROTOCOL_NAME = utf8("Noise_XX_25519_ChaChaPoly_SHA256");
const SIGNATURE_PREFIX = utf8("noise-libp2p-static-key:");
const EMPTY = new Uint8Array(0);
export const MAX_NOISE_MESSAGE = 65535;
export const TAG = 16;

function nonce(n: bigint): Uint8Array {
  const out = new Uint8Array(12);
  new DataView(out.buffer).setBigUint64(4, n, true);
  return out;
}

export class CipherState {
  private n = 0n;
  constructor(private key: Uint8Array | null = null) {}
  get hasKey(): boolean {
    return this.key !== null;
  }
  encrypt(ad: Uint8Array, plaintext: Uint8Array): Uint8Array {
    if (this.key === null) return plaintext;
    const out = chacha20poly1305(this.key, nonce(this.n), ad).encrypt(plaintext);
    this.n += 1n;
    return out;
  }
  decrypt(ad: Uint8Array, ciphertext: Uint8Array): Uint8Array {
    if (this.key === null) return ciphertext;
    if (ciphertext.length < TAG) throw new TransportError("decrypt-failed", "shorter than the tag");
    let out: Uint8Array;
    try {
      out = chacha20poly1305(this.key, nonce(this.n), ad).decrypt(ciphertext);
    } catch {
      throw new TransportError("decrypt-failed");
    }
    this.n += 1n;
    return out;
  }
}

function hkdf(ck: Uint8Array, ikm: Uint8Array): [Uint8Array, Uint8Array] {
  const temp = hmac(sha256, ck, ikm);
  const out1 = hmac(sha256, temp, new Uint8Array([1]));
  const out2 = hmac(sha256, temp, concat(out1, new Uint8Array([2])));
  return [out1, out2];
}

class SymmetricState {
  h: Uint8Array;
  ck: Uint8Array;
  cipher = new CipherState();
  constructor() {
    this.h = new Uint8Array(32);
    this.h.set(PROTOCOL_NAME);
    this.ck = this.h.slice();
    this.mixHash(EMPTY); // prologue
  }
  mixHash(data: Uint8Array): void {
    this.h = sha256(concat(this.h, data));
  }
  mixKey(ikm: Uint8Array): void {
    const [ck, k] = hkdf(this.ck, ikm);
    this.ck = ck;
    this.cipher = new CipherState(k);
  }
  encryptAndHash(plaintext: Uint8Array): Uint8Array {
    const c = this.cipher.encrypt(this.h, plaintext);
    this.mixHash(c);
    return c;
  }
  decryptAndHash(ciphertext: Uint8Array): Uint8Array {
    const p = this.cipher.decrypt(this.h, ciphertext);
    this.mixHash(ciphertext);
    return p;
  }
  split(): [CipherState, CipherState] {
    const [k1, k2] = hkdf(this.ck, EMPTY);
    return [new CipherState(k1), new CipherState(k2)];
  }
}

// ---- the libp2p NoiseHandshakePayload (protobuf) ----

function varint(v: number): Uint8Array {
  const out: number[] = [];
  do {
    let b = v & 0x7f;
    v = Math.floor(v / 128);
    if (v) b |= 0x80;
    out.push(b);
  } while (v);
  return new Uint8Array(out);
}

function field(num: number, value: Uint8Array): Uint8Array {
  return concat(varint((num << 3) | 2), varint(value.length), value);
}

export function encodePayload(identityKey: Uint8Array, identitySig: Uint8Array): Uint8Array {
  return concat(field(1, identityKey), field(2, identitySig));
}

function readVarint(data: Uint8Array, pos: number): [number, number] {
  let value = 0;
  for (let i = 0; i < 10; i++) {
    if (pos + i >= data.length) throw new TransportError("bad-payload", "truncated varint");
    const b = data[pos + i]!;
    value += (b & 0x7f) * 2 ** (7 * i);
    if (!(b & 0x80)) return [value, pos + i + 1];
  }
  throw new TransportError("bad-payload", "varint longer than 10 bytes");
}

/** Fields 1 (identity_key) and 2 (identity_sig); unknown fields of wire types 0, 1, 2, 5 are skipped. */
export function decodePayload(data: Uint8Array): { key: Uint8Array; sig: Uint8Array } {
  let key = EMPTY;
  let sig = EMPTY;
  let pos = 0;
  while (pos < data.length) {
    let tag: number;
    [tag, pos] = readVarint(data, pos);
    const num = Math.floor(tag / 8);
    const wire = tag & 7;
    if (num === 0) throw new TransportError("bad-payload", "field number 0");
    let start = pos;
    let end: number;
    if (wire === 0) {
      [, end] = readVarint(data, pos);
      start = end;
    } else if (wire === 1) end = pos + 8;
    else if (wire === 5) end = pos + 4;
    else if (wire === 2) {
      let len: number;
      [len, start] = readVarint(data, pos);
      end = start + len;
    } else throw new TransportError("bad-payload", `wire type ${wire}`);
    if (end > data.length) throw new TransportError("bad-payload", `field ${num} runs past the end`);
    if ((num === 1 || num === 2 || num === 4) && wire !== 2) throw new TransportError("bad-payload", `field ${num} has wire type ${wire}`);
    if (num === 1) key = data.slice(start, end);
    if (num === 2) sig = data.slice(start, end);
    pos = end;
  }
  return { key, sig };
}

/** X25519 of our secret and their public key; a low-order or malformed public key (whose shared secret
 * would be all zeros) is the typed `bad-handshake`, not the library's exception. */
function dh(secret: Uint8Array, publicKey: Uint8Array): Uint8Array {
  try {
    return x25519.getSharedSecret(secret, publicKey);
  } catch {
    throw new TransportError("bad-handshake", "a low-order or invalid X25519 public key");
  }
}

/** The initiator's side of the XX handshake, message by message (the caller frames and carries them). */
export class Initiator {
  private ss = new SymmetricState();
  private e = x25519.utils.randomSecretKey();
  private ePub = x25519.getPublicKey(this.e);
  private s = x25519.utils.randomSecretKey();
  private sPub = x25519.getPublicKey(this.s);
  private re: Uint8Array = EMPTY;
  remotePeer: Uint8Array = EMPTY;

  constructor(private identity: Identity, private expectedPeer: Uint8Array | null = null) {}

  /** Message 1: `e`, empty payload. */
  message1(): Uint8Array {
    this.ss.mixHash(this.ePub);
    return concat(this.ePub, this.ss.encryptAndHash(EMPTY));
  }

  /** Read message 2 (`e, ee, s, es` + the responder's payload): returns the proven remote peer id. */
  readMessage2(msg: Uint8Array): Uint8Array {
    if (msg.length < 32 + 48 + TAG) throw new TransportError("bad-handshake", "message 2 too short");
    this.re = msg.slice(0, 32);
    this.ss.mixHash(this.re);
    this.ss.mixKey(dh(this.e, this.re));
    const rs = this.ss.decryptAndHash(msg.slice(32, 80));
    this.ss.mixKey(dh(this.e, rs));
    const payload = decodePayload(this.ss.decryptAndHash(msg.slice(80)));
    if (payload.key.length !== 36 || !equal(payload.key.subarray(0, 4), KEY_PROTOBUF_PREFIX)) {
      throw new TransportError("bad-identity-key", "not an Ed25519 key");
    }
    const pub = payload.key.subarray(4);
    if (!verify(pub, concat(SIGNATURE_PREFIX, rs), payload.sig)) throw new TransportError("bad-identity-signature");
    const peer = peerIdOf(pub);
    if (this.expectedPeer !== null && !equal(peer, this.expectedPeer)) throw new TransportError("peer-mismatch");
    this.remotePeer = peer;
    return peer;
  }

  /** Message 3 (`s, se` + our payload), and the transport ciphers (send, receive). */
  message3(): { message: Uint8Array; send: CipherState; receive: CipherState } {
    const s = this.ss.encryptAndHash(this.sPub);
    this.ss.mixKey(dh(this.s, this.re));
    const payload = encodePayload(concat(KEY_PROTOBUF_PREFIX, this.identity.publicKey),
      this.identity.sign(concat(SIGNATURE_PREFIX, this.sPub)));
    const message = concat(s, this.ss.encryptAndHash(payload));
    const [send, receive] = this.ss.split();
    return { message, send, receive };
  }
}
