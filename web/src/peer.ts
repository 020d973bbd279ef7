/** The browser trainer (spec/browser.md §1-§4): one connection to a node's HTTP transport, the trainer's
 * subset of the wire messages, leases computed from certified heads, training on leased samples fetched
 * from the edge, signed update announcements and serving the delta's chunks. Every peer input is decoded
 * strictly; a bad one is reported (`rejected` events) and dropped, never thrown out of the handler. */
import { sha256 } from "@noble/hashes/sha2.js";
import { concat, equal, fromHex, toHex } from "./bytes.js";
import { asArray, asBytes, asMap, asText, asUint, decode, encode, Float, type Value } from "./cbor.js";
import { Connection, type SocketLike } from "./conn.js";
import { PeerloomError } from "./errors.js";
import { Envelope, type Identity, peerText } from "./identity.js";
import { encodeDelta, layersOf, train, type Hyper } from "./mlp.js";
import {
  artifactValue, browserRefusal, fromSafetensors, type Head, leasesOf, makeArtifact, type Manifest, parseArtifact,
  parseHead, parseManifest, tensorDigest, toSafetensors, trainSeed, verifyCertificate,
} from "./objects.js";

export const MAX_MESSAGE = 16 * 1024 * 1024;
const CONTROL_MAX = 1 << 20;
/** Connections the peer holds at most: the edge's node and the validators and reducers it learns of. */
export const MAX_LINKS = 8;
const HTTP_ADDRESS = /^http:\/\/(\d{1,3}(\.\d{1,3}){3}|\[[0-9a-fA-F:.]{2,45}\]):\d{1,5}$/;

/** One connection: to the edge's node (`primary`) or to a server a `peers` message listed, and the roles its
 * `hello` gave (empty until then). */
export interface Link {
  conn: Connection;
  address: string;
  roles: string[];
  primary: boolean;
}

export interface DataIndex {
  dim: number;
  record_bytes: number;
  shards: [number, number][]; // [first record, count]
  sizes: number[];
  lr: number;
  batch_size: number;
  local_epochs: number;
  inner_steps: number;
  workload: string;
}

export type PeerEvent =
  | { type: "status"; text: string }
  | { type: "error"; reason: string; detail: string }
  | { type: "head"; window: number; accuracy: number | null; rostered: boolean; id: string }
  | { type: "lease"; window: number; shards: number[] }
  | { type: "progress"; window: number; done: number; total: number }
  | { type: "announced"; window: number; update: string; delta: string; shards: number[]; trainLoss: number; samplesPerS: number }
  | { type: "verdict"; window: number; update: string; accepted: boolean; reason: string }
  | { type: "rejected"; reason: string; detail: string }
  | { type: "bytes"; sent: number; received: number };

export interface PeerOptions {
  edge: string; // http://H:P of a node's HTTP edge
  identity: Identity;
  authority?: Uint8Array | null; // default: the authority the edge names
  capacity?: number;
  WebSocket?: new (url: string) => SocketLike;
  fetch?: typeof fetch;
  onEvent?: (e: PeerEvent) => void;
  /** Tests only: change the encoded delta after the digest is signed (a tampered update, §3). */
  tamper?: boolean;
  /** Tests and demos: wait this long before training each leased window, as a slow device would (a lease
   * held and not delivered, §4). */
  delayMs?: number;
}

export class BrowserPeer {
  manifest!: Manifest;
  head: Head | null = null;
  conn: Connection | null = null; // the primary link's connection (the edge's node)
  readonly links = new Map<string, Link>(); // remote peer id hex -> link
  private dialing = new Set<string>(); // addresses being dialed
  private announcement: { window: number; message: Value } | null = null; // the current window's update
  private index!: DataIndex;
  private params = new Map<string, Uint8Array>(); // artifact digest hex -> bytes (the head's params)
  private served = new Map<string, Uint8Array>(); // delta digest hex -> bytes
  private fetches = new Map<string, { resolve: (d: Uint8Array) => void; reject: (e: Error) => void }>();
  private joinedFor = -1;
  private trainingFor = -1;
  private pending = new Map<string, number>(); // our update ids (hex) -> window, until a head decides them
  private fetchImpl: typeof fetch;
  stopped = false;

  constructor(readonly options: PeerOptions) {
    this.fetchImpl = options.fetch ?? fetch.bind(globalThis);
  }

  private emit(e: PeerEvent): void {
    this.options.onEvent?.(e);
  }

  private async json(path: string): Promise<unknown> {
    const r = await this.fetchImpl(this.options.edge.replace(/\/$/, "") + path);
    if (!r.ok) throw new PeerloomError("edge-error", `${path}: HTTP ${r.status}`);
    return r.json();
  }

  async start(): Promise<void> {
    let doc: { envelope: string; authority: string };
    try {
      doc = (await this.json("/v1/manifest")) as { envelope: string; authority: string };
    } catch (e) {
      throw new PeerloomError("unreachable", `the node at ${this.options.edge} cannot be reached: ${String(e)}`);
    }
    this.manifest = parseManifest(fromHex(doc.envelope), this.options.authority ?? null);
    const refusal = browserRefusal(this.manifest);
    if (refusal) throw new PeerloomError("not-browser-trainable", refusal);
    this.index = (await this.json("/v1/data/index")) as DataIndex;
    const health = (await this.json("/healthz")) as { addresses: string[] };
    const host = new URL(this.options.edge).hostname;
    const addresses = (health.addresses ?? []).filter((a) => a.startsWith("http://"))
      .map((a) => a.replace(/^http:\/\/(0\.0\.0\.0|\[::\])/, `http://${host}`));
    if (!addresses.length) throw new PeerloomError("unreachable", "the edge lists no http:// transport address");
    this.emit({ type: "status", text: `dialing ${addresses[0]}` });
    const conn = await Connection.dial(addresses[0]!, this.options.identity, { WebSocket: this.options.WebSocket, maxMessageBytes: MAX_MESSAGE });
    this.conn = conn;
    await this.attach(conn, addresses[0]!, true);
    this.emit({ type: "status", text: `connected to ${peerText(conn.remotePeer)} as ${this.options.identity.text}` });
  }

  /** Take a handshaken connection as a link: route its messages, say `hello`. Closing the primary link is
   * an error the page shows; another link just goes. */
  private async attach(conn: Connection, address: string, primary: boolean): Promise<void> {
    const key = toHex(conn.remotePeer);
    if (this.links.has(key) || this.stopped) {
      conn.close(); // a second connection to a peer we hold one to
      return;
    }
    const link: Link = { conn, address, roles: [], primary };
    this.links.set(key, link);
    conn.onMessage = (data) => this.receive(link, data);
    conn.onClose = (e) => {
      if (this.links.get(key) === link) this.links.delete(key);
      if (!primary) return;
      this.emit({ type: "error", reason: e.reason, detail: `connection closed: ${e.message}` });
      for (const f of this.fetches.values()) f.reject(e);
      this.fetches.clear();
    };
    await this.sendOn(link, ["hello", new Map<string, Value>([["revision", this.manifest.revision], ["roles", ["trainer"]], ["head_window", 0]])]);
  }

  /** Dial a server a `peers` message listed (spec/browser.md §1): an `http://` address, a peer we hold no
   * link to, within `MAX_LINKS`. A failed dial is reported and forgotten. */
  private dialPeer(peer: Uint8Array, address: string): void {
    const key = toHex(peer);
    if (!HTTP_ADDRESS.test(address) || equal(peer, this.options.identity.peerId) || this.links.has(key)
      || this.dialing.has(address) || this.links.size + this.dialing.size >= MAX_LINKS || this.stopped) return;
    this.dialing.add(address);
    Connection.dial(address, this.options.identity, { WebSocket: this.options.WebSocket, maxMessageBytes: MAX_MESSAGE, expectedPeer: peer })
      .then((conn) => this.attach(conn, address, false))
      .catch((e) => {
        const err = e instanceof PeerloomError ? e : new PeerloomError("connect-failed", String(e));
        this.emit({ type: "rejected", reason: err.reason, detail: `dialing ${address}: ${err.detail}` });
      })
      .finally(() => this.dialing.delete(address));
  }

  stop(): void {
    this.stopped = true;
    for (const link of [...this.links.values()]) link.conn.close();
  }

  /** Send on the primary link. */
  private async send(message: Value): Promise<void> {
    const link = [...this.links.values()].find((l) => l.primary);
    if (link) await this.sendOn(link, message);
  }

  private async sendOn(link: Link, message: Value): Promise<void> {
    const conn = link.conn;
    if (conn.closed) return;
    try {
      await conn.send(encode(message));
    } catch {
      return; // the connection closed meanwhile: its onClose reports it
    }
    this.emit({ type: "bytes", sent: this.bytes("bytesSent"), received: this.bytes("bytesReceived") });
  }

  private bytes(which: "bytesSent" | "bytesReceived"): number {
    let n = 0;
    for (const l of this.links.values()) n += l.conn[which];
    return n;
  }

  /** Send to every link whose hello named one of `roles` (validators for joins and heartbeats; validators
   * and reducers for updates), or to the primary link when no link has said its roles yet. */
  private async sendTo(roles: string[], message: Value): Promise<void> {
    const targets = [...this.links.values()].filter((l) => l.roles.some((r) => roles.includes(r)));
    if (!targets.length) return this.send(message);
    await Promise.all(targets.map((l) => this.sendOn(l, message)));
  }

  private receive(link: Link, data: Uint8Array): void {
    try {
      const msg = asArray(decode(data, data.length > CONTROL_MAX ? MAX_MESSAGE : CONTROL_MAX), "message");
      if (msg.length !== 2) throw new PeerloomError("bad-message", "not a [kind, body] array");
      const kind = asText(msg[0], "kind");
      const body = msg[1]!;
      switch (kind) {
        case "hello": {
          const hello = asMap(body, "hello");
          const w = asUint(hello.get("head_window"), "head_window");
          link.roles = asArray(hello.get("roles"), "roles", 8).map((r) => asText(r, "role"));
          const server = link.roles.includes("validator") || link.roles.includes("reducer");
          if (!link.primary && !server) {
            link.conn.close(); // another trainer: nothing to send it
            return;
          }
          if (server && this.announcement && this.announcement.window > (this.head?.window ?? 0)) {
            void this.sendOn(link, this.announcement.message); // a server that connected while the window is open
          }
          if (w > 0 && (this.head === null || w > this.head.window)) void this.sendOn(link, ["chain-get", new Map<string, Value>([["from_window", w], ["to_window", w]])]);
          return;
        }
        case "head":
          return this.entry(body);
        case "chain":
          for (const e of asArray(asMap(body, "chain").get("entries"), "entries", 64)) this.entry(e);
          return;
        case "next-head": {
          const header = asMap(asMap(body, "next-head").get("header"), "header");
          const w = asUint(header.get("window"), "window");
          if (this.head === null || w > this.head.window) void this.sendOn(link, ["chain-get", new Map<string, Value>([["from_window", w], ["to_window", w]])]);
          return;
        }
        case "chunk": {
          const m = asMap(body, "chunk", { required: ["artifact", "index", "data"] });
          const key = `${toHex(asBytes(m.get("artifact"), "artifact", 34))}/${asUint(m.get("index"), "index")}`;
          const f = this.fetches.get(key);
          if (!f) throw new PeerloomError("unsolicited-chunk");
          this.fetches.delete(key);
          f.resolve(asBytes(m.get("data"), "data"));
          return;
        }
        case "chunk-missing": {
          const m = asMap(body, "chunk-missing", { required: ["artifact", "index"] });
          const key = `${toHex(asBytes(m.get("artifact"), "artifact", 34))}/${asUint(m.get("index"), "index")}`;
          this.fetches.get(key)?.reject(new PeerloomError("chunk-missing", key));
          this.fetches.delete(key);
          return;
        }
        case "chunk-get":
          return this.serve(link, body);
        case "peers": {
          const entries = asArray(asMap(body, "peers", { required: ["peers"] }).get("peers"), "peers", 32);
          for (const e of entries) {
            const [peer, address] = asArray(e, "peer-entry", 2);
            this.dialPeer(asBytes(peer, "peer"), asText(address, "address"));
          }
          return;
        }
        case "signed":
        case "updates-get":
          return; // not a trainer's business (spec/browser.md §1)
        default:
          throw new PeerloomError("unknown-message", kind);
      }
    } catch (e) {
      const err = e instanceof PeerloomError ? e : new PeerloomError("bad-message", String(e));
      this.emit({ type: "rejected", reason: err.reason, detail: err.detail });
    }
  }

  private entry(v: Value): void {
    const m = asMap(v, "chain-entry", { required: ["head", "certificate"] });
    const head = parseHead(m.get("head")!, this.manifest);
    verifyCertificate(m.get("certificate")!, head, this.manifest);
    if (this.head !== null && head.window <= this.head.window) return;
    this.adopt(head);
  }

  private adopt(head: Head): void {
    this.head = head;
    const me = this.options.identity.peerId;
    const rostered = head.roster.some(([p]) => equal(p, me));
    const accuracy = head.metrics.get("test_accuracy") ?? null;
    this.emit({ type: "head", window: head.window, accuracy, rostered, id: toHex(head.id) });
    for (const [id, window] of [...this.pending]) {
      const inCohort = head.cohort.some((c) => toHex(c) === id);
      const rejected = head.rejected.some((c) => toHex(c) === id);
      if (inCohort) {
        this.emit({ type: "verdict", window, update: id, accepted: true, reason: "accepted" });
        this.pending.delete(id);
      } else if (rejected) {
        this.pending.delete(id);
        void this.rejectionReason().then((reason) => this.emit({ type: "verdict", window, update: id, accepted: false, reason }));
      } else if (head.window >= window) {
        this.pending.delete(id);
        const fallback = head.skipped ? "window skipped" : "not in the certified cohort";
        void this.rejectionReason(fallback).then((reason) => this.emit({ type: "verdict", window, update: id, accepted: false, reason }));
      }
    }
    const next = head.window + 1;
    const revision = this.manifest.revision;
    if (!rostered) {
      if (this.joinedFor < next) {
        this.joinedFor = next;
        // `unauditable`: a browser's training cannot be replayed (spec/browser.md §3, protocol.md §6.4)
        const join = Envelope.sign(this.options.identity, "join", new Map<string, Value>([["revision", revision], ["window", next],
          ["capacity", this.options.capacity ?? 1], ["unauditable", true]]));
        void this.sendTo(["validator"], ["signed", join.toValue()]);
        this.emit({ type: "status", text: `asked to join for window ${next}` });
      }
      return;
    }
    if (this.manifest.idleWindows > 0) {
      const hb = Envelope.sign(this.options.identity, "heartbeat", new Map<string, Value>([["revision", revision], ["window", next]]));
      void this.sendTo(["validator"], ["signed", hb.toValue()]);
    }
    const shards = leasesOf(head, this.manifest, next).get(toHex(me));
    if (shards && this.trainingFor < next) {
      this.trainingFor = next;
      this.trainWindow(head, next, shards).catch((e) => {
        const err = e instanceof PeerloomError ? e : new PeerloomError("train-failed", String(e));
        this.emit({ type: "error", reason: err.reason, detail: `window ${next}: ${err.detail}` });
      });
    } else if (!shards) {
      this.emit({ type: "status", text: `no lease in window ${next}` });
    }
  }

  /** The typed reason the node gave for this peer's last rejected input (`GET /v1/peers` `last_rejection`):
   * the head lists a rejected update by id only. */
  private async rejectionReason(fallback = "screening"): Promise<string> {
    try {
      const peers = (await this.json("/v1/peers")) as { peers?: { peer: string; last_rejection?: string }[] } | { peer: string; last_rejection?: string }[];
      const list = Array.isArray(peers) ? peers : peers.peers ?? [];
      const mine = list.find((p) => p.peer === this.options.identity.text);
      return mine?.last_rejection || fallback;
    } catch {
      return fallback;
    }
  }

  private async fetchArtifact(ref: ReturnType<typeof parseArtifact>): Promise<Uint8Array> {
    const key = toHex(ref.digest);
    const have = this.params.get(key);
    if (have) return have;
    const parts: Uint8Array[] = [];
    for (let i = 0; i < ref.chunks.length; i++) {
      const got = new Promise<Uint8Array>((resolve, reject) => this.fetches.set(`${key}/${i}`, { resolve, reject }));
      await this.send(["chunk-get", new Map<string, Value>([["artifact", ref.digest], ["index", i]])]);
      const data = await got;
      if (!equal(sha256(data), ref.chunks[i]!)) throw new PeerloomError("bad-chunk", `chunk ${i} of ${key.slice(0, 12)}`);
      parts.push(data);
    }
    const bytes = concat(...parts);
    this.params.clear();
    this.params.set(key, bytes);
    return bytes;
  }

  /** The leased samples: one range request per run of consecutive shards (spec/browser.md §2). */
  private async samples(shards: number[]): Promise<{ x: Float32Array; y: Uint8Array }> {
    const { dim, record_bytes: rb } = this.index;
    const runs: [number, number][] = [];
    for (const s of shards) {
      const [first, count] = this.index.shards[s]!;
      const last = runs[runs.length - 1];
      if (last && last[0] + last[1] === first) last[1] += count;
      else runs.push([first, count]);
    }
    const rows = runs.reduce((n, [, c]) => n + c, 0);
    const x = new Float32Array(rows * dim);
    const y = new Uint8Array(rows);
    let row = 0;
    for (const [first, count] of runs) {
      const r = await this.fetchImpl(this.options.edge.replace(/\/$/, "") + "/v1/data/train",
        { headers: { Range: `bytes=${first * rb}-${(first + count) * rb - 1}` } });
      const buf = new Uint8Array(await r.arrayBuffer());
      if (r.status !== 206 || buf.length !== count * rb) throw new PeerloomError("edge-error", `samples: HTTP ${r.status}, ${buf.length} bytes`);
      const view = new DataView(buf.buffer);
      for (let i = 0; i < count; i++, row++) {
        for (let d = 0; d < dim; d++) x[row * dim + d] = view.getFloat32(i * rb + 4 * d, true);
        y[row] = buf[i * rb + 4 * dim]!;
      }
    }
    return { x, y };
  }

  private async trainWindow(head: Head, window: number, shards: number[]): Promise<void> {
    const m = this.manifest;
    this.emit({ type: "lease", window, shards });
    this.emit({ type: "progress", window, done: 0, total: 1 });
    if (this.options.delayMs) await new Promise((resolve) => setTimeout(resolve, this.options.delayMs));
    if (this.stopped) return;
    const params = fromSafetensors(await this.fetchArtifact(head.params));
    if (!equal(tensorDigest(params), head.paramsDigest)) throw new PeerloomError("params-digest-mismatch");
    const { x, y } = await this.samples(shards);
    const hyper: Hyper = { lr: this.index.lr, batchSize: this.index.batch_size, epochs: this.index.local_epochs,
      steps: m.innerSteps || this.index.inner_steps || 0, betas: [0.9, 0.999], eps: 1e-8 };
    const base = layersOf(params);
    const me = this.options.identity.peerId;
    const started = performance.now();
    const result = await train(base, x, y, hyper, trainSeed(head.id, window, shards, me),
      (done, total) => this.emit({ type: "progress", window, done, total }));
    const seconds = (performance.now() - started) / 1000;
    if (this.head !== head) {
      this.emit({ type: "status", text: `window ${window} closed while training; the update is not sent` });
      return;
    }
    const delta = encodeDelta(base, result.trained, m.codec);
    const digest = tensorDigest(delta);
    let bytes = toSafetensors(delta);
    if (this.options.tamper) {
      bytes = bytes.slice();
      bytes[bytes.length - 1]! ^= 0x40; // the signed digest no longer names these tensors
    }
    const ref = makeArtifact(bytes, m.chunkSize);
    this.served.clear();
    this.served.set(toHex(ref.digest), bytes);
    const update = Envelope.sign(this.options.identity, "update", new Map<string, Value>([
      ["revision", m.revision], ["window", window], ["base", head.id], ["shards", shards], ["delta", artifactValue(ref)],
      ["delta_digest", digest], ["train_loss", new Float(result.trainLoss)], ["unauditable", true],
    ]));
    const id = toHex(update.id);
    this.pending.set(id, window);
    const message: Value = ["signed", update.toValue()];
    this.announcement = { window, message };
    await this.sendTo(["validator", "reducer"], message);
    this.emit({ type: "announced", window, update: id, delta: toHex(ref.digest), shards, trainLoss: result.trainLoss,
      samplesPerS: (result.steps * Math.min(hyper.batchSize, result.samples)) / Math.max(seconds, 1e-6) });
  }

  private serve(link: Link, body: Value): void {
    const m = asMap(body, "chunk-get", { required: ["artifact", "index"] });
    const artifact = asBytes(m.get("artifact"), "artifact", 34);
    const index = asUint(m.get("index"), "index");
    const bytes = this.served.get(toHex(artifact));
    const ref = this.manifest.chunkSize;
    if (!bytes || index * ref >= Math.max(bytes.length, 1)) {
      void this.sendOn(link, ["chunk-missing", new Map<string, Value>([["artifact", artifact], ["index", index]])]);
      return;
    }
    void this.sendOn(link, ["chunk", new Map<string, Value>([["artifact", artifact], ["index", index],
      ["data", bytes.subarray(index * ref, (index + 1) * ref)]])]);
  }
}
