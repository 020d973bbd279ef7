/** Every failure the browser peer reports carries a reason code of the spec (spec/browser.md §1):
 * decode reasons of wire.md §1, transport reasons of transport.md §6, protocol rejections of protocol.md. */
export class PeerloomError extends Error {
  readonly reason: string;
  readonly detail: string;
  constructor(reason: string, detail = "") {
    super(detail ? `${reason}: ${detail}` : reason);
    this.reason = reason;
    this.detail = detail;
  }
}

/** A decode failure (wire.md §1): too-large, malformed, bad-type, too-deep, non-canonical. */
export class DecodeError extends PeerloomError {}

/** A transport failure (transport.md §6): bad-frame, flow-control, message-too-large, truncated, eof, ... */
export class TransportError extends PeerloomError {}
