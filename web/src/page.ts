/** The /train page (spec/browser.md §5): loads or creates the identity key in IndexedDB, runs a BrowserPeer
 * against the node that served the page, and shows what it does. `?view=1` is viewer mode: no key, the
 * edge's head event stream read-only. */
import { fromHex, toHex } from "./bytes.js";
import { PeerloomError } from "./errors.js";
import { Identity } from "./identity.js";
import { BrowserPeer, type PeerEvent } from "./peer.js";

const $ = (id: string) => document.getElementById(id)!;
const params = new URLSearchParams(location.search);

function banner(text: string): void {
  const b = $("banner");
  b.textContent = text;
  b.className = "error";
}

async function loadKey(): Promise<Identity> {
  if (params.has("ephemeral")) return Identity.generate(); // a fresh peer per tab (tests, demos)
  const db = await new Promise<IDBDatabase>((resolve, reject) => {
    const req = indexedDB.open("peerloom", 1);
    req.onupgradeneeded = () => req.result.createObjectStore("keys");
    req.onsuccess = () => resolve(req.result);
    req.onerror = () => reject(req.error);
    req.onblocked = () => reject(new Error("blocked"));
  });
  const get = await new Promise<unknown>((resolve, reject) => {
    const r = db.transaction("keys").objectStore("keys").get("identity");
    r.onsuccess = () => resolve(r.result);
    r.onerror = () => reject(r.error);
  });
  if (typeof get === "string") return new Identity(fromHex(get));
  const id = Identity.generate();
  await new Promise<void>((resolve, reject) => {
    const tx = db.transaction("keys", "readwrite");
    tx.objectStore("keys").put(toHex(id.seed), "identity");
    tx.oncomplete = () => resolve();
    tx.onerror = () => reject(tx.error);
  });
  return id;
}

const rows = new Map<string, HTMLTableRowElement>();
(window as unknown as { peerloomEvents: PeerEvent[] }).peerloomEvents = [];

function show(e: PeerEvent): void {
  const log = (window as unknown as { peerloomEvents: PeerEvent[] }).peerloomEvents;
  if (e.type !== "progress" && e.type !== "bytes") log.push(e);
  switch (e.type) {
    case "status": $("status").textContent = e.text; break;
    case "lease": $("status").textContent = `training window ${e.window} on shards ${e.shards.join(" ")}`; break;
    case "error": banner(`${e.reason}: ${e.detail}`); break;
    case "head":
      $("window").textContent = String(e.window);
      $("accuracy").textContent = e.accuracy === null ? "–" : `${(100 * e.accuracy).toFixed(1)}%`;
      break;
    case "progress":
      $("training").textContent = String(e.window);
      ($("progress") as HTMLProgressElement).max = e.total;
      ($("progress") as HTMLProgressElement).value = e.done;
      break;
    case "bytes": $("sent").textContent = String(e.sent); break;
    case "announced": {
      const tr = document.createElement("tr");
      tr.innerHTML = `<td>${e.window}</td><td><code>${e.update.slice(4, 16)}</code></td><td>${e.shards.join(" ")}</td>` +
        `<td>${e.trainLoss.toFixed(3)}</td><td>${e.samplesPerS.toFixed(0)}</td><td>announced</td>`;
      $("updates").prepend(tr);
      rows.set(e.update, tr);
      break;
    }
    case "verdict": {
      const cell = rows.get(e.update)?.lastElementChild;
      if (cell) {
        cell.textContent = e.accepted ? "accepted" : `rejected: ${e.reason}`;
        cell.className = e.accepted ? "ok" : "bad";
      }
      break;
    }
    case "rejected": $("status").textContent = `refused a message: ${e.reason}`; break;
  }
}

async function viewer(): Promise<void> {
  $("peer").textContent = "viewer (no key)";
  $("status").textContent = "read-only";
  const source = new EventSource("/v1/events");
  source.onmessage = (m) => {
    const h = JSON.parse(m.data as string) as { window: number; metrics: Record<string, number> };
    show({ type: "head", window: h.window, accuracy: h.metrics?.test_accuracy ?? null, rostered: false, id: "" });
  };
  source.onerror = () => banner("unreachable: the node's event stream is not answering");
}

async function main(): Promise<void> {
  if (params.has("view")) return viewer();
  let identity: Identity;
  try {
    identity = await loadKey();
  } catch (e) {
    banner(`The key store is blocked (IndexedDB: ${String(e)}). Allow site data for this page, or open it with ?ephemeral=1 to train with a throwaway key.`);
    return;
  }
  $("peer").textContent = identity.text;
  const peer = new BrowserPeer({ edge: location.origin, identity, onEvent: show, tamper: params.has("tamper"),
    delayMs: Number(params.get("delay") ?? 0) || 0,
    capacity: Number(params.get("capacity") ?? 1) || 1 });
  (window as unknown as { peerloomPeer: BrowserPeer }).peerloomPeer = peer;
  try {
    await peer.start();
  } catch (e) {
    const err = e instanceof PeerloomError ? e : new PeerloomError("unreachable", String(e));
    banner(err.reason === "unreachable" || err.reason === "connect-failed" || err.reason === "handshake-timeout"
      ? `The network is unreachable: ${err.detail || err.message}` : `${err.reason}: ${err.detail}`);
  }
  window.addEventListener("beforeunload", () => peer.stop());
}

void main();
