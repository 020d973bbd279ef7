"""The read-only dashboard page the HTTP edge serves at ``/`` (spec/design.md §6, HTTP edge).

Plain HTML and inline JavaScript, no external resources (test and demo machines are offline): it reads
``/v1/heads/latest``, ``/v1/chain``, ``/v1/history``, ``/v1/peers`` and (once) ``/v1/manifest``, draws the
loss/accuracy curve as inline SVG, and refreshes on every ``head`` server-sent event (and every 5 s as a fallback).

Stable element ids for tests: ``#latest-window``, ``#chain-rows`` (one ``tr`` per head), ``#curve``
(an SVG with one ``circle.acc`` / ``circle.loss`` per window that has the metric), ``#peer-rows`` (each peer's
rejected input and the last rejection's reason; under a manifest with ``privacy`` each trainer's epsilon and
DP-SGD steps from the latest head's ledger in ``td.epsilon``, and ``td.private`` "yes" for a trainer the head
lists as private; a ledger entry of a peer the node does not know gets a row of its own), ``#privacy`` (the
DP-SGD parameters and the per-trainer epsilon budget, or "off"; spec/protocol.md §10), ``#last-error`` (the
node's last failed task), ``#bytes``, ``#status``.
"""

DASHBOARD_HTML = r"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>peerloom node</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#222;background:#fafafa}
h1{font-size:1.3em;margin:0 0 .3em} h2{font-size:1.05em;margin:1.2em 0 .4em}
table{border-collapse:collapse;background:#fff} td,th{border:1px solid #ddd;padding:2px 8px;text-align:left}
th{background:#f0f0f0} code{font-size:12px} .muted{color:#777} .grid{display:flex;flex-wrap:wrap;gap:2em}
svg{background:#fff;border:1px solid #ddd} .acc{fill:#1f77b4} .loss{fill:#d62728}
.lacc{stroke:#1f77b4;fill:none;stroke-width:2} .lloss{stroke:#d62728;fill:none;stroke-width:2}
</style></head>
<body>
<h1>peerloom node <code id="self"></code></h1>
<p><a id="train-link" href="/train">Train in your browser</a> &middot; <a href="/train?view=1">watch</a></p>
<div>latest certified window: <b id="latest-window">-</b> &middot; head <code id="latest-id">-</code>
 &middot; <span id="status" class="muted">loading</span></div>
<div>last error: <span id="last-error" class="muted">none</span></div>
<div>differential privacy: <span id="privacy" class="muted">off</span></div>
<div class="grid">
<div><h2>Validation curve</h2>
<svg id="curve" width="520" height="240" viewBox="0 0 520 240" role="img"
 aria-label="accuracy and loss per window"></svg>
<div class="muted"><span style="color:#1f77b4">&#9679; accuracy</span> &nbsp;
<span style="color:#d62728">&#9679; loss (scaled to its max)</span></div></div>
<div><h2>Bytes</h2><div id="bytes">-</div>
<h2>Peers</h2><table><thead><tr><th>peer</th><th>roles</th><th>sent</th><th>received</th><th>rejected</th>
<th>last rejection</th><th>&epsilon; (steps)</th><th>private data</th></tr></thead>
<tbody id="peer-rows"></tbody></table></div>
</div>
<h2>Head chain</h2>
<table><thead><tr><th>window</th><th>head</th><th>parent</th><th>cohort</th><th>signers</th><th>accuracy</th>
<th>loss</th></tr></thead><tbody id="chain-rows"></tbody></table>
<script>
"use strict";
const short = (h) => h ? h.slice(4, 16) : "genesis";
const fmtBytes = (n) => n >= 1048576 ? (n / 1048576).toFixed(1) + " MiB"
  : n >= 1024 ? (n / 1024).toFixed(1) + " KiB" : n + " B";
const XHTML = "http://www.w3.org/1999/xhtml", SVG = "http://www.w3.org/2000/svg";
function el(tag, attrs, text) {
  const e = document.createElementNS(tag === "td" || tag === "tr" ? XHTML : SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}
function metric(m, names) { for (const n of names) if (m && typeof m[n] === "number") return m[n]; return null; }
async function getJSON(path) {
  const r = await fetch(path);
  if (!r.ok) throw new Error(path + " " + r.status);
  return r.json();
}
async function allHeads() {
  let from = 0, heads = [];
  for (let i = 0; i < 64; i++) {
    const page = await getJSON("/v1/chain?from=" + from + "&limit=256");
    heads = heads.concat(page.heads);
    if (page.next === null) break;
    from = page.next;
  }
  return heads;
}
function drawCurve(windows) {
  const svg = document.getElementById("curve");
  while (svg.firstChild) svg.removeChild(svg.firstChild);
  const W = 520, H = 240, P = 30;
  svg.appendChild(el("line", {x1: P, y1: H - P, x2: W - 10, y2: H - P, stroke: "#999"}));
  svg.appendChild(el("line", {x1: P, y1: 10, x2: P, y2: H - P, stroke: "#999"}));
  const pts = windows.map(w => ({w: w.window, acc: metric(w.metrics, ["test_accuracy", "accuracy"]),
                                  loss: metric(w.metrics, ["test_loss", "loss"])}));
  if (!pts.length) { svg.appendChild(el("text", {x: 60, y: 120}, "no certified windows yet")); return; }
  const maxW = Math.max(1, ...pts.map(p => p.w));
  const maxLoss = Math.max(1e-9, ...pts.filter(p => p.loss !== null).map(p => p.loss));
  const x = (w) => P + (W - 10 - P) * w / maxW, y = (v) => H - P - (H - P - 10) * v;
  svg.appendChild(el("text", {x: P - 4, y: 14, "text-anchor": "end", "font-size": 10}, "1"));
  svg.appendChild(el("text", {x: W - 10, y: H - 12, "text-anchor": "end", "font-size": 10}, "window " + maxW));
  for (const [key, cls, scale] of [["acc", "acc", 1], ["loss", "loss", maxLoss]]) {
    const sel = pts.filter(p => p[key] !== null);
    if (sel.length > 1) svg.appendChild(el("polyline", {class: "l" + cls,
      points: sel.map(p => x(p.w).toFixed(1) + "," + y(p[key] / scale).toFixed(1)).join(" ")}));
    for (const p of sel) {
      const c = el("circle", {class: cls, cx: x(p.w).toFixed(1), cy: y(p[key] / scale).toFixed(1), r: 3});
      c.appendChild(el("title", {}, key + " " + p[key].toFixed(4) + " @ window " + p.w));
      svg.appendChild(c);
    }
  }
}
function drawChain(heads) {
  const body = document.getElementById("chain-rows");
  body.textContent = "";
  for (const h of heads.slice().reverse()) {
    const tr = el("tr", {"data-window": h.window});
    const acc = metric(h.metrics, ["test_accuracy", "accuracy"]), loss = metric(h.metrics, ["test_loss", "loss"]);
    const cells = [h.window, short(h.id), short(h.parent), h.skipped ? "skipped" : h.cohort.length,
                   h.certificate ? h.certificate.signers.length : "-", acc === null ? "" : acc.toFixed(3),
                   loss === null ? "" : loss.toFixed(3)];
    for (const c of cells) tr.appendChild(el("td", {}, String(c)));
    body.appendChild(tr);
  }
}
function drawPrivacy(manifest, latest) {
  const dp = manifest && manifest.privacy, span = document.getElementById("privacy");
  const parts = [];
  if (dp) parts.push("DP-SGD, \u03b5 budget " + dp.epsilon_budget + " per trainer over the revision (\u03c3 "
    + String(+dp.noise_multiplier.toPrecision(4)) + ", clip " + dp.max_grad_norm + ", q "
    + dp.sample_rate + ", \u03b4 " + dp.delta.toExponential() + "); \u03b5 as of window " + latest.window);
  if (manifest && manifest.private_data) parts.push("private data admitted, private trainers: "
    + (latest.private || []).length);
  span.textContent = parts.length ? parts.join("; ") : "off";
}
function privacyCells(manifest, latest, peer, roles) {
  const dp = manifest && manifest.privacy;
  const entry = (latest.privacy || []).find(e => e.peer === peer);
  const eps = !dp ? "" : entry ? entry.epsilon.toFixed(3) + " of " + dp.epsilon_budget + " (" + entry.steps + ")"
    : roles.includes("trainer") ? "0.000 of " + dp.epsilon_budget + " (0)" : "";
  return [el("td", {class: "epsilon"}, eps), el("td", {class: "private"},
                                                   (latest.private || []).includes(peer) ? "yes" : "")];
}
function drawPeers(info, windows, latest, manifest) {
  document.getElementById("self").textContent = info.self;
  document.getElementById("last-error").textContent = info.last_error || "none";
  const body = document.getElementById("peer-rows");
  body.textContent = "";
  let sent = 0, recv = 0;
  for (const p of info.peers) {
    const tr = el("tr", {"data-peer": p.peer});
    for (const c of [p.peer.slice(-8), p.roles.join(","), fmtBytes(p.bytes_sent), fmtBytes(p.bytes_received),
                     String(p.rejected), p.last_rejection])
      tr.appendChild(el("td", {}, c));
    for (const td of privacyCells(manifest, latest, p.peer, p.roles)) tr.appendChild(td);
    body.appendChild(tr); sent += p.bytes_sent; recv += p.bytes_received;
  }
  const known = new Set(info.peers.map(p => p.peer));
  for (const e of (manifest && manifest.privacy ? latest.privacy || [] : [])) {
    if (known.has(e.peer)) continue;  // a trainer in the ledger this node does not know (left, or elsewhere)
    const tr = el("tr", {"data-peer": e.peer});
    for (const c of [e.peer.slice(-8), "trainer", "-", "-", "-", ""]) tr.appendChild(el("td", {}, c));
    for (const td of privacyCells(manifest, latest, e.peer, ["trainer"])) tr.appendChild(td);
    body.appendChild(tr);
  }
  const last = windows.length ? windows[windows.length - 1] : null;
  document.getElementById("bytes").textContent = last
    ? "node wire bytes: sent " + fmtBytes(last.bytes_sent) + ", received " + fmtBytes(last.bytes_received)
    : "per-peer total: sent " + fmtBytes(sent) + ", received " + fmtBytes(recv);
}
let busy = false, manifest = null;
async function refresh() {
  if (busy) return; busy = true;
  try {
    if (!manifest) manifest = await getJSON("/v1/manifest");  // signed once per revision: read once
    const [latest, heads, hist, peers] = await Promise.all([getJSON("/v1/heads/latest"), allHeads(),
      getJSON("/v1/history"), getJSON("/v1/peers")]);
    document.getElementById("latest-window").textContent = latest.window;
    document.getElementById("latest-id").textContent = short(latest.id);
    const windows = hist.windows.length ? hist.windows
      : heads.filter(h => h.window > 0).map(h => ({window: h.window, metrics: h.metrics}));
    drawChain(heads); drawCurve(windows); drawPeers(peers, hist.windows, latest, manifest);
    drawPrivacy(manifest, latest);
    document.getElementById("status").textContent = "updated " + new Date().toLocaleTimeString();
  } catch (e) {
    document.getElementById("status").textContent = "error: " + e.message;
  } finally { busy = false; }
}
refresh();
setInterval(refresh, 5000);
if (window.EventSource) { const es = new EventSource("/v1/events"); es.addEventListener("head", refresh); }
</script>
</body></html>
"""
