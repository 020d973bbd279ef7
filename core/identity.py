"""Ed25519 identities and peer ids.

A `PeerId` is the libp2p peer id of an Ed25519 key: the identity multihash (code 0x00) of the protobuf
``PublicKey{Type: Ed25519 (1), Data: <32 bytes>}``, printed in base58btc (the familiar ``12D3KooW...``).
Sources: libp2p specs, peer-ids/peer-ids.md; RFC 8032 (Ed25519).

Key *generation* needs OS randomness and therefore lives in `peerloom.adapters.keys`; core only derives
keys from seeds it is given.
"""

from __future__ import annotations

import hashlib

import attrs
import nacl.exceptions
import nacl.signing

from .errors import DecodeError

ED25519_KEY_TYPE = 1
_PROTOBUF_PREFIX = bytes([0x08, ED25519_KEY_TYPE, 0x12, 32])  # field 1 varint 1; field 2 len 32
_MULTIHASH_PREFIX = bytes([0x00, 36])  # identity multihash, 36-byte digest
PEER_ID_BYTES = len(_MULTIHASH_PREFIX) + len(_PROTOBUF_PREFIX) + 32

VERIFIED_CACHE_ENTRIES = 1 << 14
"""Signatures this process remembers as checked (`PeerId.verify`): SHA-256 digests of (key, signature, message)
that passed Ed25519 verification, forgotten all at once when full. The same envelope often arrives more than
once (a join relayed by every validator, an announcement sent again on reconnect, and in the simulator every
node of one process checking every head), and Ed25519 verification costs ~70 us against ~1 us for the digest.
Only successes are kept: a bad signature is checked every time. A 32-byte digest an entry, ~1.6 MiB at most."""

_verified: set[bytes] = set()

_B58_ALPHABET = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
_B58_INDEX = {c: i for i, c in enumerate(_B58_ALPHABET)}


def b58encode(data: bytes) -> str:
    """Base58btc (Bitcoin alphabet), leading zero bytes as '1'."""
    n = int.from_bytes(data, "big")
    out = []
    while n:
        n, r = divmod(n, 58)
        out.append(_B58_ALPHABET[r])
    pad = len(data) - len(data.lstrip(b"\0"))
    return "1" * pad + "".join(reversed(out))


def b58decode(text: str) -> bytes:
    """Inverse of `b58encode`. Raises DecodeError on a character outside the alphabet."""
    n = 0
    for c in text:
        if c not in _B58_INDEX:
            raise DecodeError("bad-base58", repr(c))
        n = n * 58 + _B58_INDEX[c]
    pad = len(text) - len(text.lstrip("1"))
    body = n.to_bytes((n.bit_length() + 7) // 8, "big") if n else b""
    return b"\0" * pad + body


def public_key_protobuf(public_key: bytes) -> bytes:
    """libp2p ``PublicKey`` protobuf bytes for an Ed25519 key (used in the Noise handshake payload)."""
    if len(public_key) != 32:
        raise DecodeError("bad-public-key", f"{len(public_key)} bytes")
    return _PROTOBUF_PREFIX + public_key


def public_key_from_protobuf(data: bytes) -> bytes:
    """The 32-byte Ed25519 key inside a libp2p ``PublicKey`` protobuf; DecodeError for anything else."""
    if len(data) != 36 or data[:4] != _PROTOBUF_PREFIX:
        raise DecodeError("unsupported-public-key", "only Ed25519 keys are accepted")
    return bytes(data[4:])


# Valid peer ids already parsed (immutable values, so sharing them is safe): a roster of N peers is decoded
# from every head, and a simulator decodes the same ids in thousands of engines.
_INTERN_LIMIT = 1 << 17
_INTERNED: dict[bytes, PeerId] = {}


@attrs.frozen(order=False)
class PeerId:
    """Identity of a peer: wraps its 32-byte Ed25519 public key. Hashable and totally ordered (by key bytes,
    which is also the order of the binary peer ids: they share one prefix)."""

    public_key: bytes = attrs.field(validator=attrs.validators.instance_of(bytes))

    def __attrs_post_init__(self) -> None:
        if len(self.public_key) != 32:
            raise DecodeError("bad-public-key", f"{len(self.public_key)} bytes")

    # Hand-written order: rosters of thousands of peers are sorted and checked for order on every decode,
    # and attrs' generated comparisons build two tuples per call.
    def __lt__(self, other: PeerId) -> bool:
        if not isinstance(other, PeerId):
            return NotImplemented
        return self.public_key < other.public_key

    def __le__(self, other: PeerId) -> bool:
        if not isinstance(other, PeerId):
            return NotImplemented
        return self.public_key <= other.public_key

    def __gt__(self, other: PeerId) -> bool:
        if not isinstance(other, PeerId):
            return NotImplemented
        return self.public_key > other.public_key

    def __ge__(self, other: PeerId) -> bool:
        if not isinstance(other, PeerId):
            return NotImplemented
        return self.public_key >= other.public_key

    def to_bytes(self) -> bytes:
        """Binary peer id (identity multihash of the protobuf public key), 38 bytes."""
        return _MULTIHASH_PREFIX + _PROTOBUF_PREFIX + self.public_key

    @classmethod
    def from_bytes(cls, data: bytes) -> PeerId:
        """Parse a binary peer id (38 bytes). Raises DecodeError "bad-peer-id", "unsupported-public-key"."""
        known = _INTERNED.get(data) if type(data) is bytes else None
        if known is not None:
            return known
        if len(data) != PEER_ID_BYTES or data[:2] != _MULTIHASH_PREFIX:
            raise DecodeError("bad-peer-id", "not an Ed25519 identity multihash")
        peer = cls(public_key_from_protobuf(data[2:]))
        if len(_INTERNED) >= _INTERN_LIMIT:
            _INTERNED.clear()  # a bounded memo, not a registry: dropping it only costs re-parsing
        _INTERNED[bytes(data)] = peer
        return peer

    def to_text(self) -> str:
        return b58encode(self.to_bytes())

    @classmethod
    def from_text(cls, text: str) -> PeerId:
        return cls.from_bytes(b58decode(text))

    def short(self) -> str:
        """Last 8 characters of the text form, for logs."""
        return self.to_text()[-8:]

    def verify(self, message: bytes, signature: bytes) -> bool:
        """True iff `signature` (64 bytes) is this key's Ed25519 signature over `message` (RFC 8032), checked
        once per process for each (key, signature, message) that passes (`VERIFIED_CACHE_ENTRIES`)."""
        if len(signature) != 64:
            return False
        seen = hashlib.sha256(self.public_key + signature + message).digest()
        if seen in _verified:
            return True
        try:
            nacl.signing.VerifyKey(self.public_key).verify(message, signature)
        except (nacl.exceptions.BadSignatureError, nacl.exceptions.ValueError, ValueError):
            return False
        if len(_verified) >= VERIFIED_CACHE_ENTRIES:
            _verified.clear()  # one step, atomic under the GIL, unlike evicting one entry from a shared set
        _verified.add(seen)
        return True

    def __str__(self) -> str:
        return self.to_text()

    def __repr__(self) -> str:
        return f"PeerId({self.to_text()})"


class Identity:
    """An Ed25519 signing key and the PeerId it implies."""

    __slots__ = ("_signing_key", "peer_id")

    def __init__(self, seed: bytes) -> None:
        if len(seed) != 32:
            raise ValueError("an Ed25519 seed is 32 bytes")
        self._signing_key = nacl.signing.SigningKey(seed)
        self.peer_id = PeerId(bytes(self._signing_key.verify_key))

    @property
    def seed(self) -> bytes:
        """The 32-byte private seed. Handle with care: it is the identity."""
        return bytes(self._signing_key)

    @property
    def public_key(self) -> bytes:
        return self.peer_id.public_key

    def sign(self, message: bytes) -> bytes:
        """Ed25519 signature (64 bytes) over `message` (RFC 8032)."""
        return self._signing_key.sign(message).signature

    def __repr__(self) -> str:
        return f"Identity({self.peer_id.to_text()})"
