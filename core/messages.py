"""Wire messages (spec/wire.md §4): one canonical CBOR array ``[kind, body]`` per transport message.

Trust-moving payloads (updates, votes, proposals, joins) are SignedEnvelopes inside the body; everything
else is authenticated only by the transport (Noise binds the connection to the peer's key).
"""

from __future__ import annotations

import functools
import ipaddress
from typing import Any

import attrs

from . import _fields as f
from .encoding import content_id, decode, encode, is_content_id
from .envelope import SignedEnvelope
from .errors import DecodeError
from .identity import PeerId
from .objects import Head, QuorumCertificate, RosterEntry, head_fields, roster_from_cbor, roster_to_cbor

MAX_CONTROL_BYTES = 1 << 20
MAX_ADDRESS_BYTES = 64  # a direct address: "/ip4/H/tcp/P", "http://H:P", "memory://NAME" or "host:port"
MAX_PEER_ADDRESS_BYTES = 128  # a listen address: a direct one, or "<direct>/p2p-circuit/<peer-id>" (a relay's)
MAX_MEMORY_NAME = 32  # the NAME of a "memory://NAME" address
TRANSPORT_KINDS = ("tcp", "http", "memory", "relay")
CIRCUIT = "/p2p-circuit/"  # between a relay's address and the relayed peer's id (spec/transport.md §12)
MAX_PEER_ENTRIES = 32  # entries of one PeerExchange
MAX_UPDATE_IDS = 32  # update ids of one UpdatesRequest (a batch of announcements asked at once)
MAX_CHUNK_INDEX = 1 << 24  # the largest chunk index of chunk-get, chunk and chunk-missing
MAX_CHUNK_DATA = 1 << 24  # bytes of one chunk's payload; what `Chunk.parse` and the chunk fast path accept


def parse_address(text: str) -> tuple[str, int]:
    """Split a listen address "host:port" (IPv4 literal, or "[IPv6]") into (host, port).

    Strict (spec/wire.md §4): ASCII, at most 64 bytes, an IP literal that is neither unspecified nor
    multicast, a decimal port 1..65535 without leading zeros. Raises DecodeError("bad-field").
    """
    if not isinstance(text, str) or len(text) > MAX_ADDRESS_BYTES or not text.isascii():
        raise DecodeError("bad-field", "address must be ASCII host:port of at most 64 bytes")
    host, sep, port_text = text.rpartition(":")
    if not sep or not port_text.isdigit() or port_text != str(int(port_text)) or not 1 <= int(port_text) <= 65535:
        raise DecodeError("bad-field", "address needs a port in 1..65535")
    bracketed = host.startswith("[") and host.endswith("]")
    try:
        ip = ipaddress.ip_address(host[1:-1] if bracketed else host)
    except ValueError:
        raise DecodeError("bad-field", "address host must be an IP literal") from None
    if (ip.version == 6) != bracketed or ip.is_unspecified or ip.is_multicast or str(ip) != (
            host[1:-1] if bracketed else host):
        raise DecodeError("bad-field", "address host must be a canonical unicast IP literal")
    return str(ip), int(port_text)


def parse_peer_address(text: str) -> tuple[str, str, int]:
    """Split a transport-qualified listen address into (kind, host, port) (spec/wire.md §4).

    Forms: ``/ip4/H/tcp/P`` and ``/ip6/H/tcp/P`` (TCP + Noise), ``http://H:P`` or ``http://[H6]:P`` (the
    HTTP transport), ``memory://NAME`` (an in-process listener; NAME is 1..32 of ``[A-Za-z0-9._-]``, host is
    NAME and port 0), and the legacy ``host:port`` (= tcp). Hosts and ports are as strict as
    `parse_address`; a direct address is ASCII of at most 64 bytes. A relayed (circuit) address
    ``<direct>/p2p-circuit/<peer-id>`` (spec/transport.md §12) is kind ``relay``, host its canonical text
    and port 0: the direct address of the relay (not itself a circuit) and the relayed peer's id in its
    canonical base58 text, at most 128 bytes in all. Raises DecodeError("bad-field").
    `format_peer_address(*parse_peer_address(t))` is the canonical spelling of `t`.
    """
    if not isinstance(text, str) or len(text) > MAX_PEER_ADDRESS_BYTES or not text.isascii():
        raise DecodeError("bad-field", "address must be ASCII of at most 128 bytes")
    if CIRCUIT in text:
        relay, _, peer_text = text.partition(CIRCUIT)
        if "/p2p-circuit" in relay or not 1 <= len(peer_text) <= 64 or not peer_text.isalnum():
            raise DecodeError("bad-field", "a circuit address is <direct address>/p2p-circuit/<peer-id>")
        try:
            canonical_peer = PeerId.from_text(peer_text).to_text()
        except (ValueError, DecodeError):  # base58 or key errors: any malformed peer id text
            raise DecodeError("bad-field", "a circuit address must end with a peer id") from None
        if canonical_peer != peer_text:
            raise DecodeError("bad-field", "a circuit address's peer id must be in canonical text")
        return "relay", format_peer_address(*parse_peer_address(relay)) + CIRCUIT + peer_text, 0
    if len(text) > MAX_ADDRESS_BYTES:
        raise DecodeError("bad-field", "a direct address must be ASCII of at most 64 bytes")
    if text.startswith(("/ip4/", "/ip6/")):
        parts = text.split("/")  # "", "ip4", host, "tcp", port
        if len(parts) != 5 or parts[3] != "tcp":
            raise DecodeError("bad-field", "address must be /ip4/HOST/tcp/PORT or /ip6/HOST/tcp/PORT")
        v6 = parts[1] == "ip6"
        host, port = parse_address(f"[{parts[2]}]:{parts[4]}" if v6 else f"{parts[2]}:{parts[4]}")
        return "tcp", host, port
    if text.startswith("http://"):
        host, port = parse_address(text[len("http://"):])
        return "http", host, port
    if text.startswith("memory://"):
        name = text[len("memory://"):]
        if not 1 <= len(name) <= MAX_MEMORY_NAME or not all(c.isalnum() or c in "._-" for c in name):
            raise DecodeError("bad-field", "memory address name must be 1..32 of A-Z a-z 0-9 . _ -")
        return "memory", name, 0
    host, port = parse_address(text)
    return "tcp", host, port


def format_peer_address(kind: str, host: str, port: int) -> str:
    """The canonical text of an address (inverse of `parse_peer_address`; legacy ``host:port`` becomes
    ``/ip4/host/tcp/port``). Raises ValueError for an unknown kind."""
    if kind == "tcp":
        return f"/ip6/{host}/tcp/{port}" if ":" in host else f"/ip4/{host}/tcp/{port}"
    if kind == "http":
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    if kind in ("memory", "relay"):
        return f"memory://{host}" if kind == "memory" else host
    raise ValueError(f"unknown transport kind {kind!r}")


@attrs.frozen(kw_only=True)
class Hello:
    """First message on every connection: which revision, which roles, how far the sender's chain is, and
    optionally the address the sender accepts connections on (`listen`, for peer exchange; any form of
    `parse_peer_address`) and the quorum certificate of its head (`certificate`, evidence for
    `head_window`: spec/protocol.md §8; absent at genesis and from senders that do not send it)."""

    KIND = "hello"
    revision: bytes
    roles: tuple[str, ...]
    head_window: int
    listen: str | None = None
    certificate: QuorumCertificate | None = None

    def body(self) -> Any:
        body = {"revision": self.revision, "roles": list(self.roles), "head_window": self.head_window}
        if self.listen is not None:
            body["listen"] = self.listen
        if self.certificate is not None:
            body["certificate"] = self.certificate.to_cbor()
        return body

    @classmethod
    def parse(cls, body: Any) -> Hello:
        keys = frozenset({"revision", "roles", "head_window"})
        if isinstance(body, dict):
            keys |= {k for k in ("listen", "certificate") if k in body}
        b = f.exact_keys(body, keys, "hello")
        roles = f.array(b, "roles", max_len=8)
        if not all(isinstance(r, str) and r in ROLES for r in roles):
            raise DecodeError("bad-field", "unknown role")
        listen = None
        if "listen" in b:
            listen = f.text(b, "listen", max_len=MAX_PEER_ADDRESS_BYTES)
            parse_peer_address(listen)
        head_window = f.uint(b, "head_window")
        certificate = None
        if "certificate" in b:
            certificate = QuorumCertificate.from_cbor(b["certificate"])
            if certificate.window != head_window:
                raise DecodeError("bad-field", "hello certificate is for another window than head_window")
        return cls(revision=f.cid(b, "revision"), roles=tuple(roles), head_window=head_window, listen=listen,
                   certificate=certificate)


@attrs.frozen(kw_only=True)
class CertifiedHead:
    """A head and the quorum certificate that makes it canonical."""

    KIND = "head"
    head: Head
    certificate: QuorumCertificate

    def body(self) -> Any:
        return {"head": self.head.to_cbor(), "certificate": self.certificate.to_cbor()}

    @classmethod
    def parse(cls, body: Any) -> CertifiedHead:
        b = f.exact_keys(body, frozenset({"head", "certificate"}), "head message")
        return cls(head=Head.from_cbor(b["head"]), certificate=QuorumCertificate.from_cbor(b["certificate"]))


@attrs.frozen(kw_only=True)
class NextHead:
    """A certified head for a peer that holds its parent, without the roster (spec/protocol.md §8).

    `header` is the head's header (`Head.header_cbor`: the roster named by `roster_digest`), `joined` the
    roster entries the head adds to its parent's roster (sorted by peer). The receiver derives the roster
    from its own copy of the parent's - less the header's `left` and `expired`, plus `joined` - and
    checks it against the digest (`head_after`), so a server sends each trainer O(cohort + changes) bytes
    per window instead of the whole roster. `joined` is unsigned: a wrong one fails the digest check and
    is charged to the sender.
    """

    KIND = "next-head"
    header: dict[str, Any] = attrs.field(hash=False)
    joined: tuple[RosterEntry, ...]
    certificate: QuorumCertificate

    @classmethod
    def of(cls, head: Head, parent: Head, certificate: QuorumCertificate) -> NextHead:
        """The next-head message of `head`, for peers holding `parent` (its parent)."""
        if head.parent != parent.id:
            raise ValueError("parent is not the head's parent")
        joined = tuple(e for e in head.roster if e[0] not in parent.roster_peers)
        return cls(header=head.header_cbor(), joined=joined, certificate=certificate)

    @functools.cached_property
    def fields(self) -> dict[str, Any]:
        """The parsed header (`head_fields`); DecodeError if it is not a valid one."""
        return head_fields(self.header)

    @functools.cached_property
    def head_id(self) -> bytes:
        """The id of the head this message describes (the content id of its header)."""
        return content_id(encode(self.header))

    def body(self) -> Any:
        return {"header": self.header, "joined": roster_to_cbor(self.joined), "certificate": self.certificate.to_cbor()}

    @classmethod
    def parse(cls, body: Any) -> NextHead:
        b = f.exact_keys(body, frozenset({"header", "joined", "certificate"}), "next-head")
        message = cls(header=b["header"], joined=roster_from_cbor(b, "joined", 1 << 16),
                      certificate=QuorumCertificate.from_cbor(b["certificate"]))
        message.fields  # noqa: B018 - check the header now: a bad one is a decode error like any other
        return message

    def head_after(self, parent: Head) -> Head:
        """The head, with its roster derived from `parent`'s (the receiver's current head, whose id must be
        the header's parent). Raises DecodeError ``roster-mismatch`` when the derived roster is not the one
        the header names, or ``bad-field`` when `joined` names a peer the roster keeps. Shared between the
        engines of a process (a simulator's trainers all derive the same head)."""
        key = (parent.id, self.head_id, self.joined)
        head = _DERIVED.get(key)
        if head is None:
            fields = self.fields
            if fields["parent"] != parent.id:
                raise ValueError("not the parent of this head")
            gone = set(fields["left"]) | set(fields["expired"])
            if not gone and not self.joined:
                roster = parent.roster
            else:
                kept = {p: c for p, c in parent.roster if p not in gone}
                if any(p in kept for p, _ in self.joined):
                    raise DecodeError("bad-field", "joined names a peer the roster keeps")
                roster = tuple(sorted([*kept.items(), *self.joined]))
            head = Head.from_fields(fields, roster)
            if len(_DERIVED) >= _DERIVED_KEPT:
                del _DERIVED[next(iter(_DERIVED))]
            _DERIVED[key] = head
        return head


# The last few heads derived by NextHead.head_after, by (parent id, head id, joined): immutable values.
_DERIVED: dict[tuple[bytes, bytes, tuple[RosterEntry, ...]], Head] = {}
_DERIVED_KEPT = 8


@attrs.frozen(kw_only=True)
class Signed:
    """Carries one SignedEnvelope (update, vote, proposal or join); the envelope kind says which."""

    KIND = "signed"
    envelope: SignedEnvelope

    def body(self) -> Any:
        return self.envelope.to_cbor()

    @classmethod
    def parse(cls, body: Any) -> Signed:
        return cls(envelope=SignedEnvelope.from_cbor(body))


@attrs.frozen(kw_only=True)
class ChunkRequest:
    KIND = "chunk-get"
    artifact: bytes
    index: int

    def body(self) -> Any:
        return {"artifact": self.artifact, "index": self.index}

    @classmethod
    def parse(cls, body: Any) -> ChunkRequest:
        b = f.exact_keys(body, frozenset({"artifact", "index"}), "chunk-get")
        return cls(artifact=f.cid(b, "artifact"), index=f.uint(b, "index", maximum=MAX_CHUNK_INDEX))


@attrs.frozen(kw_only=True)
class Chunk:
    """One chunk of an artifact. `data` is bytes, or a read-only view into the received message's bytes (a
    decoded chunk shares them rather than copying up to 16 MiB, see `_decode_chunk`)."""
    KIND = "chunk"
    artifact: bytes
    index: int
    data: bytes | memoryview

    def body(self) -> Any:
        return {"artifact": self.artifact, "index": self.index, "data": bytes(self.data)}

    @classmethod
    def parse(cls, body: Any) -> Chunk:
        b = f.exact_keys(body, frozenset({"artifact", "index", "data"}), "chunk")
        return cls(artifact=f.cid(b, "artifact"), index=f.uint(b, "index", maximum=MAX_CHUNK_INDEX),
                   data=f.raw(b, "data", max_len=MAX_CHUNK_DATA))


@attrs.frozen(kw_only=True)
class ChunkMissing:
    KIND = "chunk-missing"
    artifact: bytes
    index: int

    def body(self) -> Any:
        return {"artifact": self.artifact, "index": self.index}

    @classmethod
    def parse(cls, body: Any) -> ChunkMissing:
        b = f.exact_keys(body, frozenset({"artifact", "index"}), "chunk-missing")
        return cls(artifact=f.cid(b, "artifact"), index=f.uint(b, "index", maximum=MAX_CHUNK_INDEX))


MAX_CHAIN_ENTRIES = 64


@attrs.frozen(kw_only=True)
class ChainRequest:
    """Ask a peer for the certified heads of windows `from_window`..`to_window` (inclusive), to fill the
    gap a node skipped when it adopted a later certified head (spec/protocol.md §8)."""

    KIND = "chain-get"
    from_window: int
    to_window: int

    def body(self) -> Any:
        return {"from_window": self.from_window, "to_window": self.to_window}

    @classmethod
    def parse(cls, body: Any) -> ChainRequest:
        b = f.exact_keys(body, frozenset({"from_window", "to_window"}), "chain-get")
        req = cls(from_window=f.uint(b, "from_window"), to_window=f.uint(b, "to_window"))
        if not 1 <= req.from_window <= req.to_window:
            raise DecodeError("bad-field", "chain-get needs 1 <= from_window <= to_window")
        return req


@attrs.frozen(kw_only=True)
class ChainEntries:
    """Consecutive certified heads (window order) answering a ChainRequest; possibly fewer than asked."""

    KIND = "chain"
    entries: tuple[tuple[Head, QuorumCertificate], ...]

    def body(self) -> Any:
        return {"entries": [{"head": h.to_cbor(), "certificate": c.to_cbor()} for h, c in self.entries]}

    @classmethod
    def parse(cls, body: Any) -> ChainEntries:
        b = f.exact_keys(body, frozenset({"entries"}), "chain")
        entries = []
        for item in f.array(b, "entries", max_len=MAX_CHAIN_ENTRIES):
            e = f.exact_keys(item, frozenset({"head", "certificate"}), "chain entry")
            entries.append((Head.from_cbor(e["head"]), QuorumCertificate.from_cbor(e["certificate"])))
        return cls(entries=tuple(entries))


@attrs.frozen(kw_only=True)
class UpdatesRequest:
    """Ask a validator for the signed update announcements with these ids (spec/agreement.md §3): the
    announcements a head proposal names by id without carrying them. The answer is one `Signed` message per
    announcement the peer holds for `window`; ids it does not hold are left out. 1 to 32 distinct ids."""

    KIND = "updates-get"
    window: int
    ids: tuple[bytes, ...]

    def body(self) -> Any:
        return {"window": self.window, "ids": list(self.ids)}

    @classmethod
    def parse(cls, body: Any) -> UpdatesRequest:
        b = f.exact_keys(body, frozenset({"window", "ids"}), "updates-get")
        ids = f.array(b, "ids", max_len=MAX_UPDATE_IDS)  # length checked before any id is read
        parsed = tuple(f.cid({"id": i}, "id") for i in ids)
        if not parsed or len(set(parsed)) != len(parsed):
            raise DecodeError("bad-field", "updates-get needs 1 to 32 distinct ids")
        return cls(window=f.uint(b, "window"), ids=parsed)


@attrs.frozen(kw_only=True)
class PeerExchange:
    """Listen addresses of other peers the sender is connected to (spec/wire.md §4, discovery): at most
    32 `(peer id, address)` entries (`parse_peer_address` forms), distinct peers and distinct addresses."""

    KIND = "peers"
    peers: tuple[tuple[PeerId, str], ...]

    def body(self) -> Any:
        return {"peers": [[p.to_bytes(), a] for p, a in self.peers]}

    @classmethod
    def parse(cls, body: Any) -> PeerExchange:
        b = f.exact_keys(body, frozenset({"peers"}), "peers")
        entries = []
        for item in f.array(b, "peers", max_len=MAX_PEER_ENTRIES):  # length checked before any entry is read
            if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], bytes)
                    and isinstance(item[1], str)):
                raise DecodeError("bad-field", "peer entry must be [peer-id, host:port]")
            peer = f.peer({"peer": item[0]}, "peer")
            parse_peer_address(item[1])
            entries.append((peer, item[1]))
        if len({p for p, _ in entries}) != len(entries) or len({a for _, a in entries}) != len(entries):
            raise DecodeError("bad-field", "duplicate peer or address")
        return cls(peers=tuple(entries))


Message = (Hello | CertifiedHead | NextHead | Signed | ChunkRequest | Chunk | ChunkMissing | ChainRequest
           | ChainEntries | PeerExchange | UpdatesRequest)
MESSAGE_TYPES: dict[str, Any] = {m.KIND: m for m in (Hello, CertifiedHead, NextHead, Signed, ChunkRequest, Chunk,
                                                     ChunkMissing, ChainRequest, ChainEntries, PeerExchange,
                                                     UpdatesRequest)}
# The role names, the one definition: a Hello announces them, an EngineConfig and a node config choose from them.
ROLES = ("trainer", "reducer", "validator")


def encode_message(message: Message) -> bytes:
    if isinstance(message, Chunk):
        return _encode_chunk(message)
    return encode([message.KIND, message.body()])


def decode_message(data: bytes | memoryview, *, max_bytes: int) -> Message:
    """Parse one wire message. Raises DecodeError (only) for anything that is not a valid message."""
    if len(data) > max_bytes:
        raise DecodeError("too-large", f"{len(data)} > {max_bytes} bytes")
    if type(data) is bytes and data.startswith(_CHUNK_HEAD):
        chunk = _decode_chunk(data)
        if chunk is not None:
            return chunk
    obj = decode(data, max_bytes=max_bytes)
    if not (isinstance(obj, list) and len(obj) == 2 and isinstance(obj[0], str)):
        raise DecodeError("bad-message", "expected [kind, body]")
    kind, body = obj
    cls = MESSAGE_TYPES.get(kind)
    if cls is None:
        raise DecodeError("unknown-message", kind[:32])
    if kind != Chunk.KIND and len(data) > MAX_CONTROL_BYTES:
        raise DecodeError("too-large", f"{kind} over {MAX_CONTROL_BYTES} bytes")
    result: Message = cls.parse(body)
    return result


# Chunks, the bulk of every byte a node moves, skip the generic decoder: it copies the payload out of the
# message, re-encodes the whole message to check that it is canonical and compares the two (three passes over
# up to 16 MiB while holding the GIL). Their canonical encoding (spec/wire.md §4) is one fixed layout:
#   82 65"chunk" a3 64"data" <bstr head> <payload> 65"index" <uint> 68"artifact" 58 22 <34-byte content id>
# (map keys in bytewise order of their encodings). Bytes in exactly that layout, with shortest-form heads
# and fields that `Chunk.parse` accepts, decode here with the payload as a view of the message; anything
# else takes the generic path, which accepts or refuses it as it always did.
_CHUNK_HEAD = b"\x82\x65chunk\xa3\x64data"
_CHUNK_INDEX_KEY = b"\x65index"
_CHUNK_ARTIFACT_KEY = b"\x68artifact\x58\x22"


def _cbor_head(major: int, value: int) -> bytes:
    """The shortest-form CBOR head of major type `major` carrying `value` (RFC 8949 §3, §4.2.1)."""
    if value < 24:
        return bytes([major << 5 | value])
    for info, size in ((24, 1), (25, 2), (26, 4), (27, 8)):
        if value < 1 << (8 * size):
            return bytes([major << 5 | info]) + value.to_bytes(size, "big")
    raise ValueError("a CBOR head carries at most 64 bits")


def _read_head(data: bytes, pos: int, major: int) -> tuple[int, int] | None:
    """(value, position after) of the shortest-form head of major type `major` at `pos`; None otherwise."""
    if pos >= len(data) or data[pos] >> 5 != major:
        return None
    info = data[pos] & 31
    if info < 24:
        return info, pos + 1
    size = {24: 1, 25: 2, 26: 4, 27: 8}.get(info)
    if size is None or pos + 1 + size > len(data):
        return None
    value = int.from_bytes(data[pos + 1:pos + 1 + size], "big")
    if value < (24 if size == 1 else 1 << (4 * size)):  # a longer head than the value needs is not canonical
        return None
    return value, pos + 1 + size


def _encode_chunk(chunk: Chunk) -> bytes:
    """`encode([Chunk.KIND, chunk.body()])`, with the payload copied once."""
    if not (is_content_id(chunk.artifact) and 0 <= chunk.index < 1 << 64):
        return encode([chunk.KIND, {"artifact": chunk.artifact, "index": chunk.index, "data": bytes(chunk.data)}])
    size = chunk.data.nbytes if isinstance(chunk.data, memoryview) else len(chunk.data)  # bytes, not items
    return b"".join((_CHUNK_HEAD, _cbor_head(2, size), chunk.data, _CHUNK_INDEX_KEY,
                     _cbor_head(0, chunk.index), _CHUNK_ARTIFACT_KEY, chunk.artifact))


def _decode_chunk(data: bytes) -> Chunk | None:
    """The Chunk that `data` encodes canonically, its payload a view of `data`; None if `data` is not
    exactly in the layout above (then the generic decoder decides)."""
    head = _read_head(data, len(_CHUNK_HEAD), 2)
    if head is None or head[0] > MAX_CHUNK_DATA:
        return None
    start = head[1]
    end = start + head[0]
    if data[end:end + len(_CHUNK_INDEX_KEY)] != _CHUNK_INDEX_KEY:
        return None
    index = _read_head(data, end + len(_CHUNK_INDEX_KEY), 0)
    if index is None or index[0] > MAX_CHUNK_INDEX:
        return None
    pos = index[1]
    artifact = data[pos + len(_CHUNK_ARTIFACT_KEY):]
    if data[pos:pos + len(_CHUNK_ARTIFACT_KEY)] != _CHUNK_ARTIFACT_KEY or not is_content_id(artifact):
        return None
    return Chunk(artifact=artifact, index=index[0], data=memoryview(data)[start:end])


class DecodeMemo:
    """Decoded messages by their exact bytes, shared by the engines of one simulator process.

    A broadcast is one bytes object delivered to many engines; decoding is a pure function of the bytes
    and messages are immutable values, so every receiver can share one decode. Only messages of at most
    `max_message_bytes` are kept (never artifact chunks), at most `max_entries` of them and
    `max_total_bytes` of encoded bytes in all (least recently used dropped first).
    Failures are not kept: every receiver sees and charges the same DecodeError. A real node has no use for
    this (it decodes each message it receives once); `EngineConfig.decode_memo` is None there.
    """

    def __init__(self, max_entries: int = 4096, max_message_bytes: int = MAX_CONTROL_BYTES,
                 max_total_bytes: int = 256 << 20) -> None:
        self.max_entries = max_entries
        self.max_message_bytes = max_message_bytes
        self.max_total_bytes = max_total_bytes
        self.hits = 0
        self.total_bytes = 0
        self._decoded: dict[tuple[bytes, int], Message] = {}

    def decode(self, data: bytes | memoryview, *, max_bytes: int) -> Message:
        """`decode_message(data, max_bytes=max_bytes)`, shared between callers that pass equal bytes."""
        if type(data) is not bytes or len(data) > self.max_message_bytes:
            return decode_message(data, max_bytes=max_bytes)
        key = (data, max_bytes)
        message = self._decoded.pop(key, None)
        if message is not None:
            self.hits += 1
            self._decoded[key] = message  # most recently used last: a head broadcast to N peers stays
            return message
        message = decode_message(data, max_bytes=max_bytes)
        if isinstance(message, Chunk):
            return message
        while self._decoded and (len(self._decoded) >= self.max_entries
                                 or self.total_bytes + len(data) > self.max_total_bytes):
            oldest = next(iter(self._decoded))
            del self._decoded[oldest]
            self.total_bytes -= len(oldest[0])
        self._decoded[key] = message
        self.total_bytes += len(data)
        return message

