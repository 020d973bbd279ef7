/** Ed25519 identities, peer ids, content ids and signed envelopes (spec/wire.md §2-§3). */
import { ed25519 } from "@noble/curves/ed25519.js";
import { sha256 } from "@noble/hashes/sha2.js";
import { base58, concat, equal } from "./bytes.js";
import { asArray, asBytes, asText, asUint, decode, encode, type Value } from "./cbor.js";
import { DecodeError, PeerloomError } from "./errors.js";

export const PEER_ID_PREFIX = new Uint8Array([0x00, 0x24, 0x08, 0x01, 0x12, 0x20]);
export const KEY_PROTOBUF_PREFIX = new Uint8Array([0x08, 0x01, 0x12, 0x20]);
export const PROTOCOL_VERSION = 1;
export const MAX_ENVELOPE_BYTES = 1 << 20;

export function cid(data: Uint8Array): Uint8Array {
  return concat(new Uint8Array([0x12, 0x20]), sha256(data));
}

export function peerIdOf(publicKey: Uint8Array): Uint8Array {
  return concat(PEER_ID_PREFIX, publicKey);
}

export function publicKeyOf(peerId: Uint8Array): Uint8Array {
  if (peerId.length !== 38 || !equal(peerId.subarray(0, 6), PEER_ID_PREFIX)) {
    throw new DecodeError("bad-field", "not an Ed25519 peer id");
  }
  return peerId.subarray(6);
}

export const peerText = (peerId: Uint8Array): string => base58(peerId);

export function verify(publicKey: Uint8Array, message: Uint8Array, signature: Uint8Array): boolean {
  try {
    return signature.length === 64 && ed25519.verify(signature, message, publicKey, { zip215: false });
  } catch {
    return false;
  }
}

export class Identity {
  readonly publicKey: Uint8Array;
  readonly peerId: Uint8Array;
  constructor(readonly seed: Uint8Array) {
    if (seed.length !== 32) throw new Error("an Ed25519 seed is 32 bytes");
    this.publicKey = ed25519.getPublicKey(seed);
    this.peerId = peerIdOf(this.publicKey);
  }
  static generate(): Identity {
    return new Identity(crypto.getRandomValues(new Uint8Array(32)));
  }
  sign(message: Uint8Array): Uint8Array {
    return ed25519.sign(message, this.seed);
  }
  get text(): string {
    return peerText(this.peerId);
  }
}

const CONTEXT = "peerloom/envelope/v1";

export function preimage(kind: string, version: number, signer: Uint8Array, body: Uint8Array): Uint8Array {
  return encode([CONTEXT, kind, version, signer, body]);
}

/** A signed envelope `[kind, version, body, signer, signature]`. */
export class Envelope {
  constructor(
    readonly kind: string,
    readonly version: number,
    readonly body: Uint8Array,
    readonly signer: Uint8Array,
    readonly signature: Uint8Array,
  ) {}

  static sign(identity: Identity, kind: string, body: Value): Envelope {
    const bytes = encode(body);
    return new Envelope(kind, PROTOCOL_VERSION, bytes, identity.peerId,
      identity.sign(preimage(kind, PROTOCOL_VERSION, identity.peerId, bytes)));
  }

  toValue(): Value {
    return [this.kind, this.version, this.body, this.signer, this.signature];
  }

  toBytes(): Uint8Array {
    return encode(this.toValue());
  }

  get id(): Uint8Array {
    return cid(this.toBytes());
  }

  static fromValue(v: Value): Envelope {
    const a = asArray(v, "envelope");
    if (a.length !== 5) throw new DecodeError("bad-field", "envelope is not 5 items");
    const env = new Envelope(asText(a[0], "kind"), asUint(a[1], "version"), asBytes(a[2], "body"),
      asBytes(a[3], "signer", 38), asBytes(a[4], "signature", 64));
    publicKeyOf(env.signer);
    return env;
  }

  static fromBytes(data: Uint8Array): Envelope {
    return Envelope.fromValue(decode(data, MAX_ENVELOPE_BYTES + 4096));
  }

  /** The decoded body, after the version, kind and signature checks (wire.md §3). */
  open(kind: string): Value {
    if (this.version !== PROTOCOL_VERSION) throw new PeerloomError("unknown-version", String(this.version));
    if (this.kind !== kind) throw new PeerloomError("wrong-kind", `${this.kind} is not ${kind}`);
    if (!verify(publicKeyOf(this.signer), preimage(this.kind, this.version, this.signer, this.body), this.signature)) {
      throw new PeerloomError("bad-signature", kind);
    }
    return decode(this.body, MAX_ENVELOPE_BYTES);
  }
}
