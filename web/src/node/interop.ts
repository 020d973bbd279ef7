/** Node-side driver for tests/web/test_web_interop.py: reads one JSON command on stdin, prints one JSON
 * result on stdout. Runs the same modules the page bundles, over the `ws` package's WebSocket. */
import WebSocket from "ws";
import { fromHex, toHex } from "../bytes.js";
import { decode, encode } from "../cbor.js";
import { Connection, type SocketLike } from "../conn.js";
import { PeerloomError } from "../errors.js";
import { Envelope, Identity, peerText } from "../identity.js";
import { layersOf, train } from "../mlp.js";
import { BrowserPeer, type PeerEvent } from "../peer.js";
import { fuzz } from "./fuzz.js";

type Command =
  | { op: "cbor"; vectors: { hex: string }[]; invalid: { hex: string }[] }
  | { op: "sign"; seed: string; kind: string; body: string }
  | { op: "echo"; address: string; seed: string; expect: string | null; messages: { size: number; lane: number }[] }
  | { op: "bench"; sizes: number[]; rows: number; epochs: number; batch_size: number; x: string; y: string }
  | { op: "train"; edge: string; seed: string; updates: number; timeout_s: number; tamper?: boolean; log?: boolean }
  | { op: "fuzz"; seed: number; ms: number; manifest: string; messages: string[] };

/** Run a BrowserPeer until `updates` of its updates have a verdict (accepted or not) or the timeout. */
async function trainRun(cmd: Extract<Command, { op: "train" }>): Promise<unknown> {
  const events: PeerEvent[] = [];
  const verdicts: PeerEvent[] = [];
  let done: () => void = () => {};
  const finished = new Promise<void>((resolve) => (done = resolve));
  const peer = new BrowserPeer({
    edge: cmd.edge, identity: new Identity(fromHex(cmd.seed)), tamper: cmd.tamper,
    WebSocket: WebSocket as unknown as new (url: string) => SocketLike,
    onEvent: (e) => {
      if (e.type !== "progress" && e.type !== "bytes") events.push(e);
      if (cmd.log && e.type !== "progress") process.stderr.write(JSON.stringify(e) + "\n");
      if (e.type === "verdict") {
        verdicts.push(e);
        if (verdicts.filter((v) => v.type === "verdict" && (v.accepted || cmd.tamper)).length >= cmd.updates) done();
      }
    },
  });
  await peer.start();
  const timer = setTimeout(done, cmd.timeout_s * 1000);
  await finished;
  clearTimeout(timer);
  peer.stop();
  return { peer: peer.options.identity.text, verdicts, events: events.slice(-200) };
}

async function readStdin(): Promise<string> {
  const chunks: Buffer[] = [];
  for await (const c of process.stdin) chunks.push(c as Buffer);
  return Buffer.concat(chunks).toString();
}

function pattern(size: number, salt: number): Uint8Array {
  const out = new Uint8Array(size);
  for (let i = 0; i < size; i++) out[i] = (i * 31 + salt) & 255;
  return out;
}

async function main(): Promise<unknown> {
  const cmd = JSON.parse(await readStdin()) as Command;
  if (cmd.op === "cbor") {
    const roundtrip = cmd.vectors.map((v) => {
      const bytes = fromHex(v.hex);
      try {
        return toHex(encode(decode(bytes, 1 << 20)));
      } catch (e) {
        return `error:${e instanceof PeerloomError ? e.reason : String(e)}`;
      }
    });
    const rejected = cmd.invalid.map((v) => {
      try {
        decode(fromHex(v.hex), 1 << 20);
        return "accepted";
      } catch (e) {
        return e instanceof PeerloomError ? e.reason : `crash:${String(e)}`;
      }
    });
    return { roundtrip, rejected };
  }
  if (cmd.op === "sign") {
    const id = new Identity(fromHex(cmd.seed));
    const env = Envelope.sign(id, cmd.kind, decode(fromHex(cmd.body), 1 << 20));
    return { envelope: toHex(env.toBytes()), id: toHex(env.id), peer: peerText(id.peerId) };
  }
  if (cmd.op === "train") return trainRun(cmd);
  if (cmd.op === "fuzz") return fuzz(cmd);
  if (cmd.op === "bench") {
    const params = new Map();
    for (let l = 0; l + 1 < cmd.sizes.length; l++) {
      const w = new Float32Array(cmd.sizes[l + 1]! * cmd.sizes[l]!).map(() => (Math.random() - 0.5) / Math.sqrt(cmd.sizes[l]!));
      params.set(`${2 * l}.weight`, { dtype: "float32", shape: [cmd.sizes[l + 1]!, cmd.sizes[l]!], data: w });
      params.set(`${2 * l}.bias`, { dtype: "float32", shape: [cmd.sizes[l + 1]!], data: new Float32Array(cmd.sizes[l + 1]!) });
    }
    const x = new Float32Array(fromHex(cmd.x).buffer);
    const y = fromHex(cmd.y);
    const started = performance.now();
    const r = await train(layersOf(params), x, y, { lr: 5e-3, batchSize: cmd.batch_size, epochs: cmd.epochs, steps: 0,
      betas: [0.9, 0.999], eps: 1e-8 }, 1);
    const seconds = (performance.now() - started) / 1000;
    return { seconds, samples_per_s: (cmd.rows * cmd.epochs) / seconds, train_loss: r.trainLoss };
  }
  const id = new Identity(fromHex(cmd.seed));
  const conn = await Connection.dial(cmd.address, id, {
    WebSocket: WebSocket as unknown as new (url: string) => SocketLike,
    expectedPeer: cmd.expect ? fromHex(cmd.expect) : null,
  });
  const received: { lane: number; ok: boolean; size: number }[] = [];
  const done = new Promise<void>((resolve, reject) => {
    // messages arrive whole and in order per lane; across lanes in the order they complete (§3)
    const pending = [0, 1].map((lane) => [...cmd.messages.entries()].filter(([, m]) => m.lane === lane));
    conn.onMessage = (data, lane) => {
      const [i, m] = pending[lane]!.shift()!;
      const want = pattern(m.size, i).reverse();
      received.push({ lane, ok: Buffer.from(data).equals(Buffer.from(want)), size: data.length });
      if (received.length === cmd.messages.length) resolve();
    };
    conn.onClose = (e) => reject(e);
  });
  for (const [i, m] of cmd.messages.entries()) await conn.send(pattern(m.size, i), m.lane);
  await done;
  const out = { remote: peerText(conn.remotePeer), received, sent: conn.bytesSent };
  conn.close();
  return out;
}

main().then(
  (r) => {
    process.stdout.write(JSON.stringify(r) + "\n");
    process.exit(0);
  },
  (e) => {
    process.stdout.write(JSON.stringify({ error: e instanceof PeerloomError ? e.reason : String(e), detail: String(e) }) + "\n");
    process.exit(1);
  },
);
