/** A secure, framed, flow-controlled connection (spec/transport.md §1-§4) over a WebSocket (§10): the Noise
 * handshake as initiator, 2-byte length-prefixed Noise messages, the frames of §3 with every receiver rule,
 * and per-lane credit (§4). Messages arrive whole and in order per lane through `onMessage`. */
import { concat, u32be } from "./bytes.js";
import { TransportError } from "./errors.js";
import type { Identity } from "./identity.js";
import { CipherState, Initiator, MAX_NOISE_MESSAGE, TAG } from "./noise.js";

export const LANE_WINDOW = 4 * 1024 * 1024;
export const MAX_PLAINTEXT = MAX_NOISE_MESSAGE - TAG; // 65519
const START = 1, CONTINUE = 2, PING = 3, PONG = 4, CREDIT = 5;
export const CONTROL = 0, BULK = 1;
export const DEFAULT_MAX_MESSAGE = 16 * 1024 * 1024;
export const HTTP_PATH = "/peerloom/v1/connect";

/** What the connection needs of a WebSocket: the browser's and the `ws` package's both fit. */
export interface SocketLike {
  binaryType: string;
  readyState: number;
  send(data: Uint8Array): void;
  close(): void;
  onopen: ((ev: unknown) => void) | null;
  onmessage: ((ev: { data: unknown }) => void) | null;
  onclose: ((ev: unknown) => void) | null;
  onerror: ((ev: unknown) => void) | null;
}

interface Lane {
  open: { total: number; parts: Uint8Array[]; got: number } | null;
  recvLeft: number; // bytes the peer may still send on this lane before we credit more
  sendCredit: number;
  sendLock: Promise<void>;
}

export class Connection {
  remotePeer: Uint8Array = new Uint8Array(0);
  bytesSent = 0;
  bytesReceived = 0;
  closed: TransportError | null = null;
  onMessage: (data: Uint8Array, lane: number) => void = () => {};
  onClose: (error: TransportError) => void = () => {};

  private buffer: Uint8Array = new Uint8Array(0);
  private handshakeWaiter: ((msg: Uint8Array) => void) | null = null;
  private send_: CipherState | null = null;
  private receive: CipherState | null = null;
  private lanes: Lane[] = [0, 1].map(() => ({ open: null, recvLeft: LANE_WINDOW, sendCredit: LANE_WINDOW, sendLock: Promise.resolve() }));
  private creditWaiters: (() => void)[] = [];

  private constructor(private socket: SocketLike, readonly maxMessageBytes: number) {}

  /** Open `url` (`http://H:P`, dialed as `ws://H:P/peerloom/v1/connect`), handshake, and return the connection. */
  static async dial(url: string, identity: Identity, options: {
    WebSocket?: new (url: string) => SocketLike; expectedPeer?: Uint8Array | null; maxMessageBytes?: number; timeoutMs?: number;
  } = {}): Promise<Connection> {
    const Ctor = options.WebSocket ?? (globalThis as unknown as { WebSocket: new (url: string) => SocketLike }).WebSocket;
    const wsUrl = url.replace(/^http:/, "ws:").replace(/^https:/, "wss:").replace(/\/$/, "") + HTTP_PATH;
    const socket = new Ctor(wsUrl);
    socket.binaryType = "arraybuffer";
    const conn = new Connection(socket, options.maxMessageBytes ?? DEFAULT_MAX_MESSAGE);
    const timeout = options.timeoutMs ?? 10000;
    let timer: ReturnType<typeof setTimeout> | undefined;
    try {
      await Promise.race([
        conn.handshake(identity, options.expectedPeer ?? null),
        new Promise<never>((_, reject) => {
          timer = setTimeout(() => reject(new TransportError("handshake-timeout")), timeout);
        }),
      ]);
    } catch (e) {
      conn.fail(e instanceof TransportError ? e : new TransportError("handshake-failed", String(e)));
      throw conn.closed;
    } finally {
      clearTimeout(timer);
    }
    return conn;
  }

  private async handshake(identity: Identity, expectedPeer: Uint8Array | null): Promise<void> {
    const socket = this.socket;
    await new Promise<void>((resolve, reject) => {
      socket.onopen = () => resolve();
      socket.onerror = () => reject(new TransportError("connect-failed", "the WebSocket did not open"));
      socket.onclose = () => reject(new TransportError("connect-failed", "the WebSocket closed"));
    });
    socket.onmessage = (ev) => this.feed(new Uint8Array(ev.data as ArrayBuffer));
    socket.onclose = () => this.fail(new TransportError(this.buffer.length || this.lanes.some((l) => l.open) ? "truncated" : "eof"));
    socket.onerror = () => this.fail(new TransportError("eof", "socket error"));
    const hs = new Initiator(identity, expectedPeer);
    const message2 = new Promise<Uint8Array>((resolve) => (this.handshakeWaiter = resolve));
    this.write(hs.message1());
    const closedEarly = new Promise<never>((_, reject) => {
      const prior = this.onClose;
      this.onClose = (e) => {
        prior(e);
        reject(e);
      };
    });
    closedEarly.catch(() => {});
    this.remotePeer = hs.readMessage2(await Promise.race([message2, closedEarly]));
    const { message, send, receive } = hs.message3();
    this.write(message);
    this.send_ = send;
    this.receive = receive;
    this.onClose = () => {};
    if (this.buffer.length) this.feed(new Uint8Array(0));
  }

  private write(noiseMessage: Uint8Array): void {
    if (this.closed) throw this.closed;
    const framed = new Uint8Array(2 + noiseMessage.length);
    new DataView(framed.buffer).setUint16(0, noiseMessage.length);
    framed.set(noiseMessage, 2);
    this.bytesSent += framed.length;
    this.socket.send(framed);
  }

  private writeFrame(plaintext: Uint8Array): void {
    this.write(this.send_!.encrypt(new Uint8Array(0), plaintext));
  }

  /** Bytes from the socket: whole Noise messages are taken off the buffer and handled in order. */
  private feed(data: Uint8Array): void {
    if (this.closed) return;
    this.bytesReceived += data.length;
    this.buffer = this.buffer.length ? concat(this.buffer, data) : data;
    try {
      while (this.buffer.length >= 2) {
        const n = (this.buffer[0]! << 8) | this.buffer[1]!;
        if (this.buffer.length < 2 + n) break;
        const msg = this.buffer.slice(2, 2 + n);
        this.buffer = this.buffer.subarray(2 + n);
        if (this.handshakeWaiter) {
          const w = this.handshakeWaiter;
          this.handshakeWaiter = null;
          w(msg);
          if (!this.receive) {
            // message 2 is being read; later bytes wait for the transport keys
            return;
          }
          continue;
        }
        if (!this.receive) throw new TransportError("bad-handshake", "a message before the handshake ended");
        this.frame(this.receive.decrypt(new Uint8Array(0), msg));
      }
    } catch (e) {
      this.fail(e instanceof TransportError ? e : new TransportError("bad-frame", String(e)));
    }
  }

  private frame(f: Uint8Array): void {
    if (f.length === 0) throw new TransportError("bad-frame", "empty frame");
    const kind = f[0]! >> 4;
    const laneNo = f[0]! & 15;
    const body = f.subarray(1);
    if (laneNo > 1) throw new TransportError("bad-frame", `lane ${laneNo}`);
    const lane = this.lanes[laneNo]!;
    if (kind === PING || kind === PONG) {
      if (laneNo !== 0 || body.length !== 8) throw new TransportError("bad-frame", "ping/pong");
      if (kind === PING) this.writeFrame(concat(new Uint8Array([PONG << 4]), body));
      return;
    }
    if (kind === CREDIT) {
      if (body.length !== 4) throw new TransportError("bad-frame", "credit body");
      const inc = new DataView(body.buffer, body.byteOffset).getUint32(0);
      if (inc === 0 || lane.sendCredit + inc > 0xffffffff) throw new TransportError("bad-frame", "credit increment");
      lane.sendCredit += inc;
      const waiters = this.creditWaiters;
      this.creditWaiters = [];
      for (const w of waiters) w();
      return;
    }
    let fragment: Uint8Array;
    if (kind === START) {
      if (lane.open) throw new TransportError("bad-frame", "START on an open lane");
      if (body.length < 4) throw new TransportError("bad-frame", "START shorter than its length");
      const total = new DataView(body.buffer, body.byteOffset).getUint32(0);
      if (total > this.maxMessageBytes) throw new TransportError("message-too-large", `${total} bytes`);
      lane.open = { total, parts: [], got: 0 };
      fragment = body.subarray(4);
    } else if (kind === CONTINUE) {
      if (!lane.open || body.length === 0) throw new TransportError("bad-frame", "CONTINUE without an open message");
      fragment = body;
    } else {
      throw new TransportError("bad-frame", `kind ${kind}`);
    }
    const open = lane.open!;
    if (fragment.length > lane.recvLeft) throw new TransportError("flow-control", `lane ${laneNo}`);
    if (open.got + fragment.length > open.total) throw new TransportError("bad-frame", "fragment past the message");
    lane.recvLeft -= fragment.length;
    open.parts.push(fragment.slice());
    open.got += fragment.length;
    if (open.got === open.total) {
      lane.open = null;
      const message = concat(...open.parts);
      this.onMessage(message, laneNo);
    }
    // Messages are handed over as they complete, so the application always keeps up (§4): credit back
    // once half a window has been taken, also inside a message larger than the window.
    if (LANE_WINDOW - lane.recvLeft >= LANE_WINDOW / 2 && !this.closed) {
      this.writeFrame(concat(new Uint8Array([(CREDIT << 4) | laneNo]), u32be(LANE_WINDOW - lane.recvLeft)));
      lane.recvLeft = LANE_WINDOW;
    }
  }

  /** Send one application message, whole, on `lane` (default: control up to 65536 bytes, bulk above). */
  send(message: Uint8Array, lane?: number): Promise<void> {
    const laneNo = lane ?? (message.length <= 65536 ? CONTROL : BULK);
    const l = this.lanes[laneNo]!;
    const run = l.sendLock.then(() => this.sendWhole(message, laneNo));
    l.sendLock = run.catch(() => {});
    return run;
  }

  private async sendWhole(message: Uint8Array, laneNo: number): Promise<void> {
    const l = this.lanes[laneNo]!;
    let at = 0;
    let first = true;
    while (first || at < message.length) {
      if (this.closed) throw this.closed;
      const room = first ? MAX_PLAINTEXT - 5 : MAX_PLAINTEXT - 1;
      while (l.sendCredit === 0 && message.length > 0) {
        await new Promise<void>((resolve) => this.creditWaiters.push(resolve));
        if (this.closed) throw this.closed;
      }
      const n = Math.min(room, message.length - at, l.sendCredit);
      const part = message.subarray(at, at + n);
      const header = first
        ? concat(new Uint8Array([(START << 4) | laneNo]), u32be(message.length))
        : new Uint8Array([(CONTINUE << 4) | laneNo]);
      this.writeFrame(concat(header, part));
      l.sendCredit -= n;
      at += n;
      first = false;
    }
  }

  private fail(error: TransportError): void {
    if (this.closed) return;
    this.closed = error;
    try {
      this.socket.close();
    } catch {
      // already closed
    }
    for (const w of this.creditWaiters) w();
    this.creditWaiters = [];
    this.onClose(error);
  }

  close(): void {
    this.fail(new TransportError("closed", "closed locally"));
  }
}
