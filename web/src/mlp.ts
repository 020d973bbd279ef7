/** A hand-written MLP kernel (spec/browser.md §2): Linear/ReLU layers in the numpy workload's parameter
 * layout ("0.weight" [out, in], "0.bias" [out], "2.weight", ...), softmax cross-entropy, Adam with
 * torch.optim.Adam's update rule, in float32 arrays. Batch order from a xorshift128+ generator seeded with
 * the update's train seed (not numpy's PCG64: browser updates are not replayable, §3). */
import type { Tensors } from "./objects.js";

export interface Hyper {
  lr: number;
  batchSize: number;
  epochs: number; // passes over the lease (FedAvg) when steps is 0
  steps: number; // DiLoCo inner steps H; 0: epochs
  betas: [number, number];
  eps: number;
}

export interface Layer {
  w: Float32Array; // [out, in] row-major
  b: Float32Array;
  inDim: number;
  outDim: number;
  wName: string;
  bName: string;
}

export function layersOf(params: Tensors): Layer[] {
  const idx = [...params.keys()].filter((n) => n.endsWith(".weight")).map((n) => Number(n.split(".")[0])).sort((a, b) => a - b);
  return idx.map((i) => {
    const w = params.get(`${i}.weight`)!;
    const b = params.get(`${i}.bias`)!;
    if (!w || !b || w.dtype !== "float32" || w.shape.length !== 2 || b.shape[0] !== w.shape[0]) throw new Error(`layer ${i} is not Linear`);
    return { w: Float32Array.from(w.data as Float32Array), b: Float32Array.from(b.data as Float32Array),
      outDim: w.shape[0]!, inDim: w.shape[1]!, wName: `${i}.weight`, bName: `${i}.bias` };
  });
}

class Rng {
  private s0: bigint;
  private s1: bigint;
  constructor(seed: number) {
    this.s0 = BigInt(seed) * 0x9e3779b97f4a7c15n + 1n;
    this.s1 = (BigInt(seed) ^ 0x5deece66dn) * 0xbf58476d1ce4e5b9n + 7n;
    for (let i = 0; i < 8; i++) this.next();
  }
  next(): number {
    const M = (1n << 64n) - 1n;
    let x = this.s0;
    const y = this.s1;
    this.s0 = y;
    x ^= (x << 23n) & M;
    this.s1 = x ^ y ^ (x >> 17n) ^ (y >> 26n);
    return Number(((this.s1 + y) & M) >> 11n) / 2 ** 53;
  }
  shuffle(a: number[]): void {
    for (let i = a.length - 1; i > 0; i--) {
      const j = Math.floor(this.next() * (i + 1));
      [a[i], a[j]] = [a[j]!, a[i]!];
    }
  }
}

function forward(layers: Layer[], x: Float32Array, n: number): Float32Array[] {
  const acts = [x];
  for (let l = 0; l < layers.length; l++) {
    const { w, b, inDim, outDim } = layers[l]!;
    const a = acts[l]!;
    const h = new Float32Array(n * outDim);
    for (let r = 0; r < n; r++) {
      for (let o = 0; o < outDim; o++) {
        let s = b[o]!;
        const wo = o * inDim, ar = r * inDim;
        for (let i = 0; i < inDim; i++) s += a[ar + i]! * w[wo + i]!;
        h[r * outDim + o] = l < layers.length - 1 && s < 0 ? 0 : s;
      }
    }
    acts.push(h);
  }
  return acts;
}

/** Mean cross-entropy of logits [n, C] against labels; `grad` gets d loss / d logits. */
function xent(logits: Float32Array, y: Uint8Array, n: number, c: number, grad: Float32Array | null): number {
  let loss = 0;
  for (let r = 0; r < n; r++) {
    let mx = -Infinity;
    for (let k = 0; k < c; k++) mx = Math.max(mx, logits[r * c + k]!);
    let s = 0;
    for (let k = 0; k < c; k++) s += Math.exp(logits[r * c + k]! - mx);
    loss += Math.log(s) - (logits[r * c + y[r]!]! - mx);
    if (grad) {
      for (let k = 0; k < c; k++) grad[r * c + k] = (Math.exp(logits[r * c + k]! - mx) / s - (k === y[r] ? 1 : 0)) / n;
    }
  }
  return loss / n;
}

export interface TrainResult {
  trained: Layer[];
  trainLoss: number;
  samples: number;
  steps: number;
}

/** Train a copy of `layers` on rows (`x` [n, in], labels `y`); `progress(done, total)` after each step. */
export async function train(layers0: Layer[], x: Float32Array, y: Uint8Array, h: Hyper, seed: number,
  progress: (done: number, total: number) => void = () => {}): Promise<TrainResult> {
  const layers = layers0.map((l) => ({ ...l, w: l.w.slice(), b: l.b.slice() }));
  const m = layers.map((l) => ({ w: new Float32Array(l.w.length), b: new Float32Array(l.b.length) }));
  const v = layers.map((l) => ({ w: new Float32Array(l.w.length), b: new Float32Array(l.b.length) }));
  const inDim = layers[0]!.inDim;
  const classes = layers[layers.length - 1]!.outDim;
  const n = y.length;
  const perPass = Math.ceil(n / h.batchSize);
  const total = h.steps > 0 ? h.steps : h.epochs * perPass;
  const rng = new Rng(seed);
  let order: number[] = [];
  let recent: [number, number][] = [];
  const [b1, b2] = h.betas;
  for (let k = 0; k < total; k++) {
    const pos = k % perPass;
    if (pos === 0) {
      order = Array.from({ length: n }, (_, i) => i);
      rng.shuffle(order);
      recent = [];
    }
    const rows = order.slice(pos * h.batchSize, (pos + 1) * h.batchSize);
    const bn = rows.length;
    const xb = new Float32Array(bn * inDim);
    const yb = new Uint8Array(bn);
    rows.forEach((r, i) => {
      xb.set(x.subarray(r * inDim, (r + 1) * inDim), i * inDim);
      yb[i] = y[r]!;
    });
    const acts = forward(layers, xb, bn);
    let g = new Float32Array(bn * classes);
    const loss = xent(acts[acts.length - 1]!, yb, bn, classes, g);
    recent.push([loss, bn]);
    const t = k + 1;
    const c1 = 1 - b1 ** t, c2 = 1 - b2 ** t;
    const stepSize = h.lr / c1;
    for (let l = layers.length - 1; l >= 0; l--) {
      const L = layers[l]!;
      const a = acts[l]!;
      const gw = new Float32Array(L.w.length);
      const gb = new Float32Array(L.b.length);
      for (let r = 0; r < bn; r++) {
        for (let o = 0; o < L.outDim; o++) {
          const go = g[r * L.outDim + o]!;
          if (go === 0) continue;
          gb[o]! += go;
          const wo = o * L.inDim, ar = r * L.inDim;
          for (let i = 0; i < L.inDim; i++) gw[wo + i]! += go * a[ar + i]!;
        }
      }
      if (l > 0) {
        const gn = new Float32Array(bn * L.inDim);
        for (let r = 0; r < bn; r++) {
          for (let o = 0; o < L.outDim; o++) {
            const go = g[r * L.outDim + o]!;
            if (go === 0) continue;
            const wo = o * L.inDim, gr = r * L.inDim;
            for (let i = 0; i < L.inDim; i++) gn[gr + i]! += go * L.w[wo + i]!;
          }
        }
        for (let i = 0; i < gn.length; i++) if (a[i]! <= 0) gn[i] = 0; // ReLU'
        g = gn;
      }
      for (const [p, grad, mm, vv] of [[L.w, gw, m[l]!.w, v[l]!.w], [L.b, gb, m[l]!.b, v[l]!.b]] as const) {
        for (let i = 0; i < p.length; i++) {
          mm[i] = b1 * mm[i]! + (1 - b1) * grad[i]!;
          vv[i] = b2 * vv[i]! + (1 - b2) * grad[i]! * grad[i]!;
          p[i]! -= (stepSize * mm[i]!) / (Math.sqrt(vv[i]! / c2) + h.eps);
        }
      }
    }
    progress(k + 1, total);
    if ((k & 7) === 7) await new Promise((r) => setTimeout(r, 0)); // keep the page responsive
  }
  const seen = recent.reduce((s, [, c]) => s + c, 0);
  return { trained: layers, trainLoss: recent.reduce((s, [lo, c]) => s + lo * c, 0) / seen, samples: n, steps: total };
}

/** float32 -> IEEE half bits, round to nearest even, clipped to ±65504 as the numpy codec clips. */
export function toHalfBits(x: number): number {
  const f = new Float32Array([Math.max(-65504, Math.min(65504, x))]);
  const bits = new Uint32Array(f.buffer)[0]!;
  const sign = (bits >>> 16) & 0x8000;
  const exp = ((bits >>> 23) & 0xff) - 127 + 15;
  let mant = bits & 0x7fffff;
  if (exp <= 0) {
    if (exp < -10) return sign;
    mant |= 0x800000;
    const shift = 14 - exp;
    const half = 1 << (shift - 1);
    let r = mant >> shift;
    const rest = mant & ((1 << shift) - 1);
    if (rest > half || (rest === half && r & 1)) r++;
    return sign | r;
  }
  let r = (exp << 10) | (mant >> 13);
  const rest = mant & 0x1fff;
  if (rest > 0x1000 || (rest === 0x1000 && r & 1)) r++;
  return sign | r;
}

/** The delta `base - trained`, encoded with the manifest's codec (`none` or `fp16`; names as
 * backends/numpy/codecs.py writes them). */
export function encodeDelta(base: Layer[], trained: Layer[], codec: string): Tensors {
  const out: Tensors = new Map();
  base.forEach((b, l) => {
    const t = trained[l]!;
    for (const [name, p, q, shape] of [[b.wName, b.w, t.w, [b.outDim, b.inDim]], [b.bName, b.b, t.b, [b.outDim]]] as const) {
      const d = new Float32Array(p.length);
      for (let i = 0; i < p.length; i++) d[i] = p[i]! - q[i]!;
      if (codec === "none") out.set(name, { dtype: "float32", shape: [...shape], data: d });
      else out.set(`${name}/values`, { dtype: "float16", shape: [...shape], data: Uint16Array.from(d, toHalfBits) });
    }
  });
  return out;
}
