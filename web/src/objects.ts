/** The protocol objects a browser trainer reads and writes (spec/browser.md §1): the manifest, certified
 * heads, quorum certificates, leases (core/leases.py), artifact refs and safetensors tensors (wire.md §5). */
import { sha256 } from "@noble/hashes/sha2.js";
import { compare, concat, equal, toHex, u64be, utf8 } from "./bytes.js";
import { asArray, asBool, asBytes, asMap, asNum, asText, asUint, encode, Float, type Value } from "./cbor.js";
import { DecodeError, PeerloomError } from "./errors.js";
import { cid, Envelope, PROTOCOL_VERSION, preimage, publicKeyOf, verify } from "./identity.js";

export interface ArtifactRef {
  digest: Uint8Array;
  size: number;
  chunkSize: number;
  chunks: Uint8Array[];
}

export function parseArtifact(v: Value, what: string): ArtifactRef {
  const m = asMap(v, what, { required: ["digest", "size", "chunk_size", "chunks"] });
  const ref = {
    digest: asBytes(m.get("digest"), `${what}.digest`, 34), size: asUint(m.get("size"), `${what}.size`),
    chunkSize: asUint(m.get("chunk_size"), `${what}.chunk_size`),
    chunks: asArray(m.get("chunks"), `${what}.chunks`, 1 << 20).map((c) => asBytes(c, `${what} chunk`, 32)),
  };
  if (ref.chunkSize < 1 || ref.chunks.length !== Math.ceil(ref.size / ref.chunkSize)) {
    throw new DecodeError("bad-field", `${what}: chunk count`);
  }
  if (!equal(cid(encode([ref.size, ref.chunkSize, ref.chunks])), ref.digest)) throw new DecodeError("bad-field", `${what}: digest`);
  return ref;
}

export function artifactValue(ref: ArtifactRef): Value {
  return new Map<string, Value>([["digest", ref.digest], ["size", ref.size], ["chunk_size", ref.chunkSize], ["chunks", ref.chunks]]);
}

export function makeArtifact(data: Uint8Array, chunkSize: number): ArtifactRef {
  const chunks: Uint8Array[] = [];
  for (let at = 0; at < data.length; at += chunkSize) chunks.push(sha256(data.subarray(at, at + chunkSize)));
  return { digest: cid(encode([data.length, chunkSize, chunks])), size: data.length, chunkSize, chunks };
}

export interface Manifest {
  revision: Uint8Array; // the manifest envelope's id
  body: Map<string, Value>;
  workload: string;
  schema: [string, string, number[]][];
  shards: number[];
  validators: Uint8Array[];
  quorum: number;
  maxCapacity: number;
  unprovenShare: number;
  codec: string;
  chunkSize: number;
  innerSteps: number;
  audit: boolean;
  unauditableTrainers: boolean;
  overlap: number;
  idleWindows: number;
  windowS: number;
}

/** A manifest envelope signed by `authority` (wire.md §3, protocol.md §2); only what the browser needs is typed. */
export function parseManifest(data: Uint8Array, authority: Uint8Array | null): Manifest {
  const env = Envelope.fromBytes(data);
  if (authority !== null && !equal(env.signer, authority)) throw new PeerloomError("wrong-authority", "the manifest is signed by someone else");
  const body = asMap(env.open("manifest"), "manifest");
  const get = (k: string) => body.get(k);
  return {
    revision: env.id, body, workload: asText(get("workload"), "workload"),
    schema: asArray(get("schema"), "schema", 4096).map((t) => {
      const a = asArray(t, "tensor-spec");
      return [asText(a[0], "name"), asText(a[1], "dtype"), asArray(a[2], "shape").map((d) => asUint(d, "dim"))];
    }),
    shards: asArray(get("shards"), "shards", 4096).map((s) => asUint(s, "shard")),
    validators: asArray(get("validators"), "validators", 4096).map((p) => asBytes(p, "validator", 38)),
    quorum: asUint(get("quorum"), "quorum"), maxCapacity: asUint(get("max_capacity"), "max_capacity"),
    unprovenShare: body.has("unproven_share") ? asNum(get("unproven_share"), "unproven_share") : 1.0,
    codec: asText(get("codec"), "codec"), chunkSize: asUint(get("chunk_size"), "chunk_size"),
    innerSteps: asUint(get("inner_steps"), "inner_steps"), audit: asBool(get("audit"), "audit"),
    unauditableTrainers: body.has("unauditable_trainers") && asBool(get("unauditable_trainers"), "unauditable_trainers"),
    overlap: body.has("overlap") ? asUint(get("overlap"), "overlap") : 0,
    idleWindows: body.has("idle_windows") ? asUint(get("idle_windows"), "idle_windows") : 0,
    windowS: asNum(get("window_s"), "window_s"),
  };
}

/** Why this page cannot train under `m` (spec/browser.md §2-§3), or null. */
export function browserRefusal(m: Manifest): string | null {
  if (m.audit && !m.unauditableTrainers) {
    return "the revision audits every update (audit = true) and admits no unauditable trainers " +
      "(unauditable_trainers): a browser update cannot be replayed";
  }
  if (m.codec !== "none" && m.codec !== "fp16") return `the browser does not implement the ${m.codec} codec`;
  if (m.overlap) return "overlapped windows are not implemented in the browser";
  if (m.body.has("privacy") || m.body.has("audit_segments")) return "DP-SGD and segment audits are not implemented in the browser";
  if (m.schema.some(([, dtype]) => dtype !== "float32")) return "the schema is not all float32";
  return null;
}

export interface Head {
  id: Uint8Array;
  window: number;
  params: ArtifactRef;
  paramsDigest: Uint8Array;
  roster: [Uint8Array, number][];
  unproven: Uint8Array[];
  quarantine: [Uint8Array, number][];
  cohort: Uint8Array[];
  rejected: Uint8Array[];
  metrics: Map<string, number>;
  skipped: boolean;
}

const peers = (v: Value | undefined, what: string): Uint8Array[] =>
  v === undefined ? [] : asArray(v, what, 16384).map((p) => asBytes(p, what, 38));

/** A whole head (wire.md §7 `head`): its id is the content id of the header (the head without its roster),
 * and the roster must match `roster_digest` (`roster-mismatch`). */
export function parseHead(v: Value, m: Manifest): Head {
  const map = asMap(v, "head");
  if (!map.has("roster")) throw new DecodeError("bad-field", "head: missing roster");
  const header = new Map(map);
  header.delete("roster");
  const rosterValue = map.get("roster")!;
  if (!equal(cid(encode(rosterValue)), asBytes(map.get("roster_digest"), "roster_digest", 34))) {
    throw new PeerloomError("roster-mismatch");
  }
  if (!equal(asBytes(map.get("revision"), "revision", 34), m.revision)) throw new PeerloomError("wrong-revision", "head");
  const metrics = new Map<string, number>();
  for (const [k, val] of asMap(map.get("metrics"), "metrics")) metrics.set(k, asNum(val, k));
  return {
    id: cid(encode(header)), window: asUint(map.get("window"), "window"), params: parseArtifact(map.get("params")!, "params"),
    paramsDigest: asBytes(map.get("params_digest"), "params_digest", 34),
    roster: asArray(rosterValue, "roster", 16384).map((e) => {
      const a = asArray(e, "roster entry");
      return [asBytes(a[0], "peer", 38), asUint(a[1], "capacity")];
    }),
    unproven: peers(map.get("unproven"), "unproven"),
    quarantine: asArray(map.get("quarantine"), "quarantine", 16384).map((e) => {
      const a = asArray(e, "quarantine entry");
      return [asBytes(a[0], "peer", 38), asUint(a[1], "release_window")];
    }),
    cohort: asArray(map.get("cohort"), "cohort", 4096).map((c) => asBytes(c, "cohort", 34)),
    rejected: asArray(map.get("rejected"), "rejected", 4096).map((c) => asBytes(c, "rejected", 34)),
    metrics, skipped: asBool(map.get("skipped"), "skipped"),
  };
}

/** Check a quorum certificate of `head` (protocol.md §2): sorted distinct signers of the manifest's validator
 * set, each an Ed25519 signature over the precommit vote for the head id, at least `quorum` of them. */
export function verifyCertificate(v: Value, head: Head, m: Manifest): void {
  const c = asMap(v, "certificate", { required: ["head", "window", "round", "votes"] });
  if (!equal(asBytes(c.get("head"), "head", 34), head.id) || asUint(c.get("window"), "window") !== head.window) {
    throw new PeerloomError("wrong-head", "certificate is for another head");
  }
  const round = asUint(c.get("round"), "round");
  const body = encode(new Map<string, Value>([["revision", m.revision], ["window", head.window], ["round", round],
    ["step", "precommit"], ["head", head.id]]));
  const votes = asArray(c.get("votes"), "votes", 4096);
  let last: Uint8Array | null = null;
  for (const vote of votes) {
    const [signer, sig] = asArray(vote, "vote");
    const p = asBytes(signer, "validator", 38);
    if (last !== null && compare(last, p) >= 0) throw new PeerloomError("bad-certificate", "signers must be sorted and distinct");
    last = p;
    if (!m.validators.some((x) => equal(x, p))) throw new PeerloomError("not-a-validator");
    if (!verify(publicKeyOf(p), preimage("vote", PROTOCOL_VERSION, p, body), asBytes(sig, "signature", 64))) {
      throw new PeerloomError("bad-signature", "vote");
    }
  }
  if (votes.length < m.quorum) throw new PeerloomError("no-quorum", `${votes.length} of ${m.quorum} votes`);
}

const LEASE_DOMAIN = utf8("peerloom/lease/v2");

/** The leases of `window` drawn from `head` (core/leases.py: slot order, shard s to slot s mod V, the
 * unproven cap): peer id hex -> sorted shards. */
export function leasesOf(head: Head, m: Manifest, window: number): Map<string, number[]> {
  const quarantined = new Set(head.quarantine.filter(([, until]) => until > head.window + 1).map(([p]) => toHex(p)));
  const unproven = new Set(head.unproven.map(toHex));
  const prefix = concat(LEASE_DOMAIN, head.id, u64be(window));
  const keyed: { key: Uint8Array; peer: Uint8Array; j: number }[] = [];
  for (const [peer, capacity] of head.roster) {
    if (quarantined.has(toHex(peer))) continue;
    for (let j = 0; j < Math.max(1, Math.min(capacity, m.maxCapacity)); j++) {
      keyed.push({ key: sha256(concat(prefix, peer, new Uint8Array([j >> 8, j & 255]))), peer, j });
    }
  }
  keyed.sort((a, b) => compare(a.key, b.key) || compare(a.peer, b.peer) || a.j - b.j);
  const slots = keyed.map((k) => toHex(k.peer));
  const out = new Map<string, number[]>();
  const total = slots.length;
  if (!total) return out;
  const numShards = m.shards.length;
  const slotOf = Array.from({ length: numShards }, (_, s) => s % total);
  if (unproven.size && m.unprovenShare < 1.0) {
    const provenSlots = slots.flatMap((p, i) => (unproven.has(p) ? [] : [i]));
    const cap = Math.max(1, Math.floor(m.unprovenShare * numShards));
    let held = 0, moved = 0;
    if (provenSlots.length) {
      for (let s = 0; s < numShards; s++) {
        if (unproven.has(slots[slotOf[s]!]!)) {
          if (held < cap) held++;
          else slotOf[s] = provenSlots[moved++ % provenSlots.length]!;
        }
      }
    }
  }
  for (let s = 0; s < numShards; s++) {
    const p = slots[slotOf[s]!]!;
    if (!out.has(p)) out.set(p, []);
    out.get(p)!.push(s);
  }
  return out;
}

export function trainSeed(base: Uint8Array, window: number, shards: number[], author: Uint8Array): number {
  const parts = [utf8("peerloom/train-seed/v1"), base, u64be(window)];
  for (const s of shards) parts.push(new Uint8Array([s >>> 24, (s >> 16) & 255, (s >> 8) & 255, s & 255]));
  parts.push(author);
  const d = sha256(concat(...parts));
  return ((d[0]! << 24) | (d[1]! << 16) | (d[2]! << 8) | d[3]!) >>> 0;
}

// ---- safetensors and the tensor digest (wire.md §5) ----

export type Tensors = Map<string, { dtype: "float32" | "float16"; shape: number[]; data: Float32Array | Uint16Array }>;
const CODES: Record<string, string> = { float32: "F32", float16: "F16" };
const FROM_CODES: Record<string, "float32" | "float16"> = { F32: "float32", F16: "float16" };

function leBytes(data: Float32Array | Uint16Array): Uint8Array {
  return new Uint8Array(data.buffer, data.byteOffset, data.byteLength); // hosts are little-endian (browsers, node on x86/arm)
}

/** Safetensors bytes as backends/numpy/tensors.py writes them: names sorted, compact JSON header padded
 * with spaces to a multiple of 8. */
export function toSafetensors(t: Tensors): Uint8Array {
  const names = [...t.keys()].sort();
  let offset = 0;
  const entries: string[] = [];
  for (const n of names) {
    const x = t.get(n)!;
    const end = offset + x.data.byteLength;
    entries.push(`"${n}":{"dtype":"${CODES[x.dtype]}","shape":[${x.shape.join(",")}],"data_offsets":[${offset},${end}]}`);
    offset = end;
  }
  let header = utf8("{" + entries.join(",") + "}");
  const pad = (8 - (header.length % 8)) % 8;
  header = concat(header, utf8(" ".repeat(pad)));
  const len = new Uint8Array(8);
  new DataView(len.buffer).setBigUint64(0, BigInt(header.length), true);
  return concat(len, header, ...names.map((n) => leBytes(t.get(n)!.data)));
}

export function fromSafetensors(data: Uint8Array): Tensors {
  if (data.length < 8) throw new DecodeError("bad-safetensors", "too short");
  const n = Number(new DataView(data.buffer, data.byteOffset).getBigUint64(0, true));
  if (n > data.length - 8 || n > 1 << 20) throw new DecodeError("bad-safetensors", "header length");
  let header: Record<string, { dtype: string; shape: number[]; data_offsets: [number, number] }>;
  try {
    header = JSON.parse(new TextDecoder("utf-8", { fatal: true }).decode(data.subarray(8, 8 + n)));
  } catch {
    throw new DecodeError("bad-safetensors", "header is not JSON");
  }
  const out: Tensors = new Map();
  const base = 8 + n;
  for (const [name, e] of Object.entries(header)) {
    if (name === "__metadata__") continue;
    const dtype = FROM_CODES[e.dtype];
    if (!dtype || !Array.isArray(e.shape) || !Array.isArray(e.data_offsets)) throw new DecodeError("bad-safetensors", name);
    const [a, b] = e.data_offsets;
    const count = e.shape.reduce((x, y) => x * y, 1);
    const item = dtype === "float32" ? 4 : 2;
    if (!(Number.isInteger(a) && Number.isInteger(b) && a >= 0 && b === a + count * item && base + b <= data.length)) {
      throw new DecodeError("bad-safetensors", `${name} offsets`);
    }
    const bytes = data.slice(base + a, base + b);
    out.set(name, { dtype, shape: e.shape, data: dtype === "float32" ? new Float32Array(bytes.buffer) : new Uint16Array(bytes.buffer) });
  }
  return out;
}

export function tensorDigest(t: Tensors): Uint8Array {
  const names = [...t.keys()].sort();
  const schema = names.map((n) => [n, t.get(n)!.dtype, t.get(n)!.shape] as Value);
  return cid(concat(encode(schema), ...names.map((n) => leBytes(t.get(n)!.data))));
}

export { Float };
