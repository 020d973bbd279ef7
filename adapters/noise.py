"""The Noise Protocol Framework (revision 34) and the libp2p ``/noise`` handshake, sans-IO.

Part 1 implements the Noise spec (https://noiseprotocol.org/noise.html, rev. 34, 2018-07-11) on PyNaCl,
`cryptography` and hashlib/hmac: `CipherState` (§5.1), `SymmetricState` (§5.2) and `HandshakeState` (§5.3),
the latter driven by the pattern table `PATTERNS` below (§7.4 one-way and §7.5 interactive fundamental
patterns). Supported names are ``Noise_<pattern>_25519_<cipher>_<hash>`` with cipher ChaChaPoly (§12.3) or
AESGCM (§12.4) and hash SHA256, SHA512, BLAKE2s or BLAKE2b; no modifiers (psk, fallback). NN and XX with
ChaChaPoly and NN with AESGCM are checked against the cacophony and snow test vectors
(tests/adapters/test_noise_vectors.py); the other patterns only against ourselves.

Part 2 is the libp2p handshake (github.com/libp2p/specs, noise/README.md): Noise_XX_25519_ChaChaPoly_SHA256
with an empty prologue; the responder sends a signed ``NoiseHandshakePayload`` in message 2, the initiator in
message 3; the signature is the Ed25519 identity key's over ``b"noise-libp2p-static-key:" + static key``.
Peerloom's one addition (spec/transport.md §1.1): a node may offer other transport ciphers in a field of the
payload's ``NoiseExtensions`` that libp2p ignores; two peerloom nodes that both offer AESGCM use it, with the
keys of Split, for the transport phase instead of ChaChaPoly. Framing (2-byte big-endian length per Noise
message) is done by the caller with `frame` (adapters.tcp).

Nothing here does I/O. Randomness comes from a caller-supplied ``random(n) -> bytes`` (default
`nacl.utils.random`); every key can be injected instead, which is how the test vectors run.

Every error raised on purpose is a `NoiseError` with a stable ``reason``:

=========================  ==================================================================
``decrypt-failed``         AEAD authentication failed (§5.1 DecryptWithAd)
``bad-message-length``     a handshake message shorter than its tokens need (§5.3 ReadMessage)
``message-too-long``       a Noise message over 65535 bytes, or transport plaintext over 65519 (§3)
``out-of-order``           write/read/split called at the wrong time (local misuse)
``handshake-failed``       any use after an earlier error: a handshake error is sticky (§5.3)
``nonce-exhausted``        the CipherState reached n = 2^64-1 (§5.1)
``bad-dh-key``             X25519 produced all zeros (low-order point); allowed by §12.1
``missing-key``            a key the pattern needs is absent or not 32 bytes (§5.3 Initialize)
``unsupported-protocol``   a protocol name outside the supported set (§8)
``bad-payload``            a NoiseHandshakePayload protobuf that does not parse
``bad-identity-key``       the payload's identity key is absent or not an Ed25519 PublicKey
``bad-identity-signature`` the identity signature over the static key does not verify
``peer-mismatch``          the remote PeerId is not the one the dialer expected
=========================  ==================================================================
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import cryptography.exceptions
import nacl.bindings
import nacl.exceptions
import nacl.utils
from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305

from peerloom.core.errors import DecodeError, PeerloomError
from peerloom.core.identity import Identity, PeerId, public_key_from_protobuf, public_key_protobuf

# --- the handshake pattern table (§7.4, §7.5) ------------------------------------------------------------
# name -> (initiator pre-message tokens, responder pre-message tokens, message token tuples). Message i is
# written by the initiator when i is even and by the responder when i is odd (§7.1: patterns alternate,
# starting with "->").


@attrs.frozen(kw_only=True)
class Pattern:
    """One handshake pattern (§7): pre-messages and the token sequence of each message."""

    initiator_pre: tuple[str, ...]
    responder_pre: tuple[str, ...]
    messages: tuple[tuple[str, ...], ...]

    @property
    def one_way(self) -> bool:
        """True for the one-way patterns N, K, X (§7.4): only the initiator→responder cipher is used."""
        return len(self.messages) == 1


def _p(ipre: str, rpre: str, *messages: str) -> Pattern:
    return Pattern(initiator_pre=tuple(ipre.split()), responder_pre=tuple(rpre.split()),
                   messages=tuple(tuple(m.replace(",", " ").split()) for m in messages))


PATTERNS: dict[str, Pattern] = {
    # one-way (§7.4)
    "N": _p("", "s", "e, es"),
    "K": _p("s", "s", "e, es, ss"),
    "X": _p("", "s", "e, es, s, ss"),
    # interactive (§7.5)
    "NN": _p("", "", "e", "e, ee"),
    "NK": _p("", "s", "e, es", "e, ee"),
    "NX": _p("", "", "e", "e, ee, s, es"),
    "KN": _p("s", "", "e", "e, ee, se"),
    "KK": _p("s", "s", "e, es, ss", "e, ee, se"),
    "KX": _p("s", "", "e", "e, ee, se, s, es"),
    "XN": _p("", "", "e", "e, ee", "s, se"),
    "XK": _p("", "s", "e, es", "e, ee", "s, se"),
    "XX": _p("", "", "e", "e, ee, s, es", "s, se"),
    "IN": _p("", "", "e, s", "e, ee, se"),
    "IK": _p("", "s", "e, es, s, ss", "e, ee, se"),
    "IX": _p("", "", "e, s", "e, ee, se, s, es"),
}

MAX_MESSAGE_BYTES = 65535  # §3: every Noise message, handshake or transport
DHLEN = 32  # §12.1, Curve25519
TAGLEN = 16  # §5.1, AEAD authentication tag
KEYLEN = 32  # §4.2
MAX_TRANSPORT_PLAINTEXT = MAX_MESSAGE_BYTES - TAGLEN  # 65519 bytes
MAX_NONCE = 2**64 - 1  # §5.1: reserved, never used for encryption

RandomFn = Callable[[int], bytes]


class NoiseError(PeerloomError):
    """A Noise or libp2p-noise failure. `reason` is a stable code (see the module docstring)."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


# --- crypto functions (§4, §12) --------------------------------------------------------------------------


@attrs.frozen
class HashFunction:
    """A Noise hash function (§4.3, §12.5-12.8): HASHLEN and BLOCKLEN in bytes."""

    name: str
    hashlen: int
    constructor: Callable[..., Any]  # a hashlib constructor (see HASHES)

    def hash(self, data: bytes) -> bytes:
        """HASH(data) (§4.3): HASHLEN bytes."""
        return bytes(self.constructor(data).digest())

    def hmac(self, key: bytes, data: bytes) -> bytes:
        """HMAC-HASH(key, data) (RFC 2104), with BLOCKLEN from the hash (64 or 128 bytes)."""
        return hmac.new(key, data, self.constructor).digest()

    def hkdf(self, chaining_key: bytes, ikm: bytes, outputs: int) -> tuple[bytes, ...]:
        """HKDF(chaining_key, input_key_material, num_outputs) of §4.3: 2 or 3 outputs of HASHLEN bytes."""
        temp_key = self.hmac(chaining_key, ikm)
        out1 = self.hmac(temp_key, b"\x01")
        out2 = self.hmac(temp_key, out1 + b"\x02")
        if outputs == 2:
            return out1, out2
        return out1, out2, self.hmac(temp_key, out2 + b"\x03")


HASHES: dict[str, HashFunction] = {
    "SHA256": HashFunction("SHA256", 32, hashlib.sha256),
    "SHA512": HashFunction("SHA512", 64, hashlib.sha512),
    "BLAKE2s": HashFunction("BLAKE2s", 32, hashlib.blake2s),
    "BLAKE2b": HashFunction("BLAKE2b", 64, hashlib.blake2b),
}


def x25519_public(private_key: bytes) -> bytes:
    """Public key (32 bytes) of a 32-byte X25519 private key (§12.1; RFC 7748 §5, clamping included)."""
    if len(private_key) != DHLEN:
        raise NoiseError("missing-key", f"an X25519 private key is {DHLEN} bytes, got {len(private_key)}")
    return nacl.bindings.crypto_scalarmult_base(private_key)


def x25519(private_key: bytes, public_key: bytes) -> bytes:
    """DH(key_pair, public_key) of §12.1: the 32-byte X25519 shared secret.

    Raises NoiseError("bad-dh-key") where libsodium refuses the point (an all-zero result, i.e. a low-order
    public key). §12.1 allows signalling this error instead of returning zeros.
    """
    try:
        return nacl.bindings.crypto_scalarmult(private_key, public_key)
    except (nacl.exceptions.RuntimeError, nacl.exceptions.ValueError) as exc:
        raise NoiseError("bad-dh-key", "X25519 with a low-order public key") from exc


# Cipher functions (§12.3, §12.4): name -> the 96-bit nonce layout of the 64-bit counter n. Both put 32 bits
# of zeros first; ChaChaPoly then writes n little-endian, AESGCM big-endian.
CHACHAPOLY = "ChaChaPoly"
AESGCM_CIPHER = "AESGCM"
NONCE_LAYOUTS: dict[str, struct.Struct] = {CHACHAPOLY: struct.Struct("<4xQ"), AESGCM_CIPHER: struct.Struct(">4xQ")}
# OpenSSL's implementations through `cryptography` (RFC 8439 ChaCha20-Poly1305 - byte for byte libsodium's
# IETF variant - and AES-256-GCM with a 128-bit tag, as §12.4 asks).
OPENSSL_AEADS: dict[str, type[ChaCha20Poly1305] | type[AESGCM]] = {CHACHAPOLY: ChaCha20Poly1305,
                                                                   AESGCM_CIPHER: AESGCM}


# --- CipherState (§5.1) ----------------------------------------------------------------------------------


class CipherState:
    """A key ``k`` (32 bytes or None = empty) and a 64-bit nonce ``n`` (§5.1) for one cipher: ChaChaPoly
    (§12.3, libsodium's IETF ChaCha20-Poly1305) or AESGCM (§12.4, AES-256-GCM through OpenSSL).

    `encrypt_with_ad` / `decrypt_with_ad` pass data through unchanged while there is no key. Nonce
    exhaustion: once n reaches 2^64-1 every further call raises NoiseError("nonce-exhausted"). An unknown
    cipher name raises NoiseError("unsupported-protocol").
    """

    __slots__ = ("_aesgcm", "_nonce", "cipher", "k", "n")

    def __init__(self, key: bytes | None = None, cipher: str = CHACHAPOLY) -> None:
        if cipher not in NONCE_LAYOUTS:
            raise NoiseError("unsupported-protocol", f"cipher {cipher!r}")
        self.cipher = cipher
        self._nonce = NONCE_LAYOUTS[cipher]
        self.k: bytes | None = None
        self._aesgcm: AESGCM | None = None
        self.n = 0
        self.initialize_key(key)

    def initialize_key(self, key: bytes | None) -> None:
        """InitializeKey(key): set k (32 bytes or None) and n = 0."""
        if key is not None and len(key) != KEYLEN:
            raise NoiseError("missing-key", f"a cipher key is {KEYLEN} bytes, got {len(key)}")
        self.k = key
        self.n = 0
        self._aesgcm = AESGCM(key) if key is not None and self.cipher == AESGCM_CIPHER else None

    def _encrypt(self, n: int, ad: bytes, plaintext: bytes) -> bytes:
        """ENCRYPT(k, n, ad, plaintext) of the cipher (§4.2): ciphertext + 16-byte tag."""
        assert self.k is not None
        if self._aesgcm is not None:
            return self._aesgcm.encrypt(self._nonce.pack(n), plaintext, ad)
        return nacl.bindings.crypto_aead_chacha20poly1305_ietf_encrypt(plaintext, ad, self._nonce.pack(n),
                                                                       self.k)

    def has_key(self) -> bool:
        return self.k is not None

    def set_nonce(self, nonce: int) -> None:
        """SetNonce(nonce): for out-of-order transport messages (§5.1); 0 <= nonce < 2^64."""
        if not 0 <= nonce <= MAX_NONCE:
            raise NoiseError("out-of-order", f"nonce {nonce} outside 64 bits")
        self.n = nonce

    def _check_nonce(self) -> None:
        if self.n >= MAX_NONCE:
            raise NoiseError("nonce-exhausted", "n reached 2^64-1 (§5.1); the session must end")

    def encrypt_with_ad(self, ad: bytes, plaintext: bytes) -> bytes:
        """EncryptWithAd(ad, plaintext): plaintext + 16-byte tag; n += 1. Returns plaintext if no key."""
        if self.k is None:
            return bytes(plaintext)
        self._check_nonce()
        out = self._encrypt(self.n, ad, bytes(plaintext))
        self.n += 1
        return out

    def decrypt_with_ad(self, ad: bytes, ciphertext: bytes) -> bytes:
        """DecryptWithAd(ad, ciphertext): the plaintext; n += 1 on success only.

        Raises NoiseError("decrypt-failed") when authentication fails (n is then unchanged, §5.1).
        """
        if self.k is None:
            return bytes(ciphertext)
        self._check_nonce()
        try:
            if self._aesgcm is not None:
                out = self._aesgcm.decrypt(self._nonce.pack(self.n), bytes(ciphertext), ad)
            else:
                out = nacl.bindings.crypto_aead_chacha20poly1305_ietf_decrypt(bytes(ciphertext), ad,
                                                                              self._nonce.pack(self.n), self.k)
        except (nacl.exceptions.CryptoError, nacl.exceptions.ValueError, ValueError,
                cryptography.exceptions.InvalidTag) as exc:
            raise NoiseError("decrypt-failed", f"{len(ciphertext)}-byte ciphertext, nonce {self.n}") from exc
        self.n += 1
        return out

    def rekey(self) -> None:
        """Rekey() (§5.1, §4.2): k = first 32 bytes of ENCRYPT(k, 2^64-1, empty ad, 32 zero bytes)."""
        if self.k is None:
            raise NoiseError("out-of-order", "rekey without a key")
        n = self.n
        self.initialize_key(self._encrypt(MAX_NONCE, b"", bytes(KEYLEN))[:KEYLEN])
        self.n = n  # Rekey() changes k only (§5.1)


# --- SymmetricState (§5.2) -------------------------------------------------------------------------------


class SymmetricState:
    """Chaining key ``ck``, handshake hash ``h`` (HASHLEN bytes each) and a CipherState (§5.2)."""

    __slots__ = ("cipher", "ck", "h", "hash")

    def __init__(self, protocol_name: bytes, hash_function: HashFunction, cipher: str = CHACHAPOLY) -> None:
        """InitializeSymmetric(protocol_name): h = name zero-padded to HASHLEN, or HASH(name) if longer."""
        self.hash = hash_function
        if len(protocol_name) <= hash_function.hashlen:
            self.h = protocol_name.ljust(hash_function.hashlen, b"\x00")
        else:
            self.h = hash_function.hash(protocol_name)
        self.ck = self.h
        self.cipher = CipherState(None, cipher)

    def mix_key(self, input_key_material: bytes) -> None:
        """MixKey: ck, temp_k = HKDF(ck, ikm, 2); temp_k truncated to 32 bytes if HASHLEN is 64."""
        self.ck, temp_k = self.hash.hkdf(self.ck, input_key_material, 2)
        self.cipher.initialize_key(temp_k[:KEYLEN])

    def mix_hash(self, data: bytes) -> None:
        """MixHash: h = HASH(h || data)."""
        self.h = self.hash.hash(self.h + data)

    def mix_key_and_hash(self, input_key_material: bytes) -> None:
        """MixKeyAndHash (psk modifiers; unused by the patterns here): ck, temp_h, temp_k = HKDF(.., 3)."""
        self.ck, temp_h, temp_k = self.hash.hkdf(self.ck, input_key_material, 3)
        self.mix_hash(temp_h)
        self.cipher.initialize_key(temp_k[:KEYLEN])

    def encrypt_and_hash(self, plaintext: bytes) -> bytes:
        """EncryptAndHash: ciphertext = EncryptWithAd(h, plaintext); MixHash(ciphertext)."""
        ciphertext = self.cipher.encrypt_with_ad(self.h, plaintext)
        self.mix_hash(ciphertext)
        return ciphertext

    def decrypt_and_hash(self, ciphertext: bytes) -> bytes:
        """DecryptAndHash: plaintext = DecryptWithAd(h, ciphertext); MixHash(ciphertext)."""
        plaintext = self.cipher.decrypt_with_ad(self.h, ciphertext)
        self.mix_hash(ciphertext)
        return plaintext

    def split(self) -> tuple[CipherState, CipherState]:
        """Split: (c1, c2) keyed by HKDF(ck, empty, 2); c1 for initiator→responder, c2 the other way."""
        temp_k1, temp_k2 = self.hash.hkdf(self.ck, b"", 2)
        cipher = self.cipher.cipher
        return CipherState(temp_k1[:KEYLEN], cipher), CipherState(temp_k2[:KEYLEN], cipher)


# --- HandshakeState (§5.3) -------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class ProtocolName:
    """A parsed ``Noise_<pattern>_25519_<cipher>_<hash>`` name (§8); cipher ChaChaPoly or AESGCM."""

    text: str
    pattern: Pattern
    cipher: str
    hash: HashFunction

    @classmethod
    def parse(cls, text: str) -> ProtocolName:
        """Raises NoiseError("unsupported-protocol") for any other DH, cipher, hash or a modifier."""
        parts = text.split("_")
        if (len(parts) != 5 or parts[0] != "Noise" or parts[1] not in PATTERNS or parts[2] != "25519"
                or parts[3] not in NONCE_LAYOUTS or parts[4] not in HASHES):
            raise NoiseError("unsupported-protocol", text)
        return cls(text=text, pattern=PATTERNS[parts[1]], cipher=parts[3], hash=HASHES[parts[4]])


class HandshakeState:
    """The Noise handshake of §5.3 for one party, sans-IO.

    Call order: while not `is_finished`: if `wants_write`, send `write_message(payload)`, else pass the
    next received message to `read_message`; then call `split()` once. Private keys `s`, `e` (32 bytes)
    and the remote's public keys `rs`, `re` may be given (pre-messages need them; test vectors inject `e`);
    a missing `e` is generated with ``random(32)`` when the first "e" token is written.

    Any error while reading a message leaves the state failed: every later call raises
    NoiseError("handshake-failed") (§5.3: the handshake is aborted on any error). A payload too long to fit
    in a 65535-byte message raises NoiseError("message-too-long") before any state changes.
    """

    def __init__(self, protocol_name: str, *, initiator: bool, prologue: bytes = b"",
                 s: bytes | None = None, e: bytes | None = None, rs: bytes | None = None,
                 re: bytes | None = None, random: RandomFn = nacl.utils.random) -> None:
        """Initialize(handshake_pattern, initiator, prologue, s, e, rs, re) of §5.3.

        Raises NoiseError("unsupported-protocol") or NoiseError("missing-key") where the pattern needs a
        local static key or a remote static key (pre-message) that was not given.
        """
        name = ProtocolName.parse(protocol_name)
        self.protocol = name
        self.initiator = initiator
        self._random = random
        self._s = s
        self._s_pub = x25519_public(s) if s is not None else None
        self._e = e
        self._e_pub = x25519_public(e) if e is not None else None
        self.rs = rs
        self.re = re
        self._index = 0
        self._split_done = False
        self._failed: NoiseError | None = None
        pattern = name.pattern
        ours = [t for i, m in enumerate(pattern.messages) if (i % 2 == 0) == initiator for t in m]
        ours += pattern.initiator_pre if initiator else pattern.responder_pre
        if "s" in ours and s is None:
            raise NoiseError("missing-key", f"{protocol_name} needs a local static key")
        theirs_pre = pattern.responder_pre if initiator else pattern.initiator_pre
        if "s" in theirs_pre and rs is None:
            raise NoiseError("missing-key", f"{protocol_name} needs the remote static key")
        self._ss = SymmetricState(protocol_name.encode("ascii"), name.hash, name.cipher)
        self._ss.mix_hash(prologue)
        # Pre-message public keys, initiator's first (§5.3 Initialize).
        for pre, is_ours in ((pattern.initiator_pre, initiator), (pattern.responder_pre, not initiator)):
            for token in pre:
                if token != "s":
                    raise NoiseError("unsupported-protocol", f"pre-message token {token!r}")
                self._ss.mix_hash(self._s_pub if is_ours else rs)  # type: ignore[arg-type]  # not None: checked above

    # -- queries --

    @property
    def is_finished(self) -> bool:
        """True once every message of the pattern has been written or read."""
        return self._index >= len(self.protocol.pattern.messages)

    @property
    def wants_write(self) -> bool:
        """True if the next step is `write_message` (our turn), False if `read_message` or finished."""
        return not self.is_finished and (self._index % 2 == 0) == self.initiator

    @property
    def message_index(self) -> int:
        """Number of handshake messages processed so far."""
        return self._index

    @property
    def handshake_hash(self) -> bytes:
        """GetHandshakeHash() (§5.2): h, HASHLEN bytes; a channel binding once the handshake is finished."""
        return self._ss.h

    @property
    def local_static_public(self) -> bytes | None:
        return self._s_pub

    # -- transitions --

    def _check(self, writing: bool) -> None:
        if self._failed is not None:
            raise NoiseError("handshake-failed", self._failed.reason)
        if self.is_finished:
            raise NoiseError("out-of-order", "the handshake is finished")
        if self.wants_write != writing:
            raise NoiseError("out-of-order", "it is the other party's turn" if writing else "it is our turn")

    def _dh_token(self, token: str) -> None:
        """MixKey(DH(..)) for ee, es, se, ss (§5.3 WriteMessage/ReadMessage, role-dependent)."""
        local, remote = {
            "ee": ("e", "e"),
            "es": ("e", "s") if self.initiator else ("s", "e"),
            "se": ("s", "e") if self.initiator else ("e", "s"),
            "ss": ("s", "s"),
        }[token]
        private = self._e if local == "e" else self._s
        public = self.re if remote == "e" else self.rs
        if private is None or public is None:
            raise NoiseError("missing-key", f"token {token}")
        self._ss.mix_key(x25519(private, public))

    def _message_size(self, tokens: tuple[str, ...], payload_len: int) -> int:
        keyed = self._ss.cipher.has_key()
        size = 0
        for token in tokens:
            if token == "e":
                size += DHLEN
            elif token == "s":
                size += DHLEN + (TAGLEN if keyed else 0)
            else:
                keyed = True
        return size + payload_len + (TAGLEN if keyed else 0)

    def write_message(self, payload: bytes = b"") -> bytes:
        """WriteMessage(payload) of §5.3: the next handshake message (bytes, at most 65535).

        Raises NoiseError("out-of-order") if it is not our turn, ("message-too-long") if the payload does
        not fit (state unchanged), ("handshake-failed") after an earlier error.
        """
        self._check(writing=True)
        tokens = self.protocol.pattern.messages[self._index]
        size = self._message_size(tokens, len(payload))
        if size > MAX_MESSAGE_BYTES:
            raise NoiseError("message-too-long", f"handshake message of {size} bytes")
        try:
            out = bytearray()
            for token in tokens:
                if token == "e":
                    if self._e is None:
                        self._e = self._random(DHLEN)
                        self._e_pub = x25519_public(self._e)
                    assert self._e_pub is not None
                    out += self._e_pub
                    self._ss.mix_hash(self._e_pub)
                elif token == "s":
                    assert self._s_pub is not None
                    out += self._ss.encrypt_and_hash(self._s_pub)
                else:
                    self._dh_token(token)
            out += self._ss.encrypt_and_hash(payload)
        except NoiseError as exc:
            self._failed = exc
            raise
        self._index += 1
        return bytes(out)

    def read_message(self, message: bytes) -> bytes:
        """ReadMessage(message) of §5.3: the decrypted payload.

        Raises NoiseError with reason ``message-too-long`` (over 65535 bytes), ``bad-message-length`` (too
        short for its tokens), ``decrypt-failed``, ``bad-dh-key``, ``out-of-order`` or ``handshake-failed``.
        Every error but ``out-of-order``/``handshake-failed`` leaves the state failed.
        """
        self._check(writing=False)
        try:
            if len(message) > MAX_MESSAGE_BYTES:
                raise NoiseError("message-too-long", f"handshake message of {len(message)} bytes")
            tokens = self.protocol.pattern.messages[self._index]
            if len(message) < self._message_size(tokens, 0):
                raise NoiseError("bad-message-length", f"{len(message)} bytes for tokens {tokens}")
            view = memoryview(message)
            pos = 0
            for token in tokens:
                if token == "e":
                    self.re = bytes(view[pos:pos + DHLEN])
                    pos += DHLEN
                    self._ss.mix_hash(self.re)
                elif token == "s":
                    size = DHLEN + (TAGLEN if self._ss.cipher.has_key() else 0)
                    self.rs = self._ss.decrypt_and_hash(bytes(view[pos:pos + size]))
                    pos += size
                else:
                    self._dh_token(token)
            payload = self._ss.decrypt_and_hash(bytes(view[pos:]))
        except NoiseError as exc:
            self._failed = exc
            raise
        self._index += 1
        return payload

    def split(self) -> tuple[CipherState, CipherState]:
        """Split() of §5.2 once the handshake is finished: (c1, c2), c1 for initiator→responder.

        One call only (a second pair would reuse nonces): raises NoiseError("out-of-order") before the end
        of the handshake or on a second call.
        """
        if self._failed is not None:
            raise NoiseError("handshake-failed", self._failed.reason)
        if not self.is_finished or self._split_done:
            raise NoiseError("out-of-order", "split before the end of the handshake, or twice")
        self._split_done = True
        return self._ss.split()


# --- libp2p /noise ---------------------------------------------------------------------------------------

LIBP2P_PROTOCOL_NAME = "Noise_XX_25519_ChaChaPoly_SHA256"
LIBP2P_SIGNATURE_PREFIX = b"noise-libp2p-static-key:"
LENGTH_PREFIX_BYTES = 2  # libp2p noise "Wire Format": 16-bit big-endian noise_message_len

# NoiseHandshakePayload field numbers (libp2p noise README, "The libp2p Handshake Payload"; field 3, the old
# `data`, is retired and skipped like any unknown field).
_FIELD_IDENTITY_KEY = 1
_FIELD_IDENTITY_SIG = 2
_FIELD_EXTENSIONS = 4
_WIRE_VARINT, _WIRE_I64, _WIRE_LEN, _WIRE_I32 = 0, 1, 2, 5


@attrs.frozen(kw_only=True)
class HandshakePayload:
    """A libp2p ``NoiseHandshakePayload``.

    identity_key: libp2p ``PublicKey`` protobuf bytes; identity_sig: signature bytes; extensions: the raw
    ``NoiseExtensions`` protobuf bytes, opaque here, or None when absent.
    """

    identity_key: bytes = b""
    identity_sig: bytes = b""
    extensions: bytes | None = None


def _encode_varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _decode_varint(data: bytes, pos: int) -> tuple[int, int]:
    """A protobuf base-128 varint at `pos`: (value, next position). At most 10 bytes, value < 2^64."""
    value = 0
    for i in range(10):
        if pos + i >= len(data):
            raise NoiseError("bad-payload", "truncated varint")
        byte = data[pos + i]
        value |= (byte & 0x7F) << (7 * i)
        if not byte & 0x80:
            if value >= 1 << 64:
                raise NoiseError("bad-payload", "varint over 64 bits")
            return value, pos + i + 1
    raise NoiseError("bad-payload", "varint longer than 10 bytes")


def _encode_field(field: int, value: bytes) -> bytes:
    return _encode_varint(field << 3 | _WIRE_LEN) + _encode_varint(len(value)) + value


def encode_handshake_payload(payload: HandshakePayload) -> bytes:
    """Protobuf bytes of a NoiseHandshakePayload (fields 1, 2 always; 4 only when extensions is not None)."""
    out = _encode_field(_FIELD_IDENTITY_KEY, payload.identity_key)
    out += _encode_field(_FIELD_IDENTITY_SIG, payload.identity_sig)
    if payload.extensions is not None:
        out += _encode_field(_FIELD_EXTENSIONS, payload.extensions)
    return out


def _protobuf_fields(data: bytes) -> Iterator[tuple[int, int, int, int]]:
    """Walk protobuf wire format: (field number, wire type, start, end) of each field's value in `data`.

    Wire types 0, 1, 2 and 5 are understood; groups (3, 4) and field number 0 are NoiseError("bad-payload"),
    as is a value running past the end (checked before anything is sliced).
    """
    pos = 0
    while pos < len(data):
        key, pos = _decode_varint(data, pos)
        field, wire = key >> 3, key & 7
        if field == 0:
            raise NoiseError("bad-payload", "field number 0")
        if wire == _WIRE_VARINT:
            _, pos = _decode_varint(data, pos)
            end = pos
        elif wire == _WIRE_I64:
            end = pos + 8
        elif wire == _WIRE_I32:
            end = pos + 4
        elif wire == _WIRE_LEN:
            length, pos = _decode_varint(data, pos)
            end = pos + length
        else:
            raise NoiseError("bad-payload", f"wire type {wire}")
        if end > len(data):
            raise NoiseError("bad-payload", f"field {field} runs past the end")
        yield field, wire, pos, end
        pos = end


def decode_handshake_payload(data: bytes) -> HandshakePayload:
    """Parse a NoiseHandshakePayload (proto3 wire format). Raises NoiseError("bad-payload"), nothing else.

    Fields 1, 2 and 4 must be length-delimited; a repeated field 1 or 2 keeps the last value and repeated
    field-4 occurrences are concatenated (protobuf merge semantics). Unknown fields of wire types 0, 1, 2 and
    5 are skipped; groups (3, 4) and field number 0 are refused. Lengths are checked against the input
    before slicing; the input itself is at most one Noise message (65535 bytes).
    """
    if len(data) > MAX_MESSAGE_BYTES:
        raise NoiseError("bad-payload", f"{len(data)} bytes")
    fields: dict[int, bytes] = {}
    extensions: bytes | None = None
    for field, wire, start, end in _protobuf_fields(data):
        if field in (_FIELD_IDENTITY_KEY, _FIELD_IDENTITY_SIG, _FIELD_EXTENSIONS) and wire != _WIRE_LEN:
            raise NoiseError("bad-payload", f"field {field} has wire type {wire}")
        if field == _FIELD_EXTENSIONS:
            extensions = (extensions or b"") + data[start:end]
        elif field in (_FIELD_IDENTITY_KEY, _FIELD_IDENTITY_SIG):
            fields[field] = bytes(data[start:end])
    return HandshakePayload(identity_key=fields.get(_FIELD_IDENTITY_KEY, b""),
                            identity_sig=fields.get(_FIELD_IDENTITY_SIG, b""), extensions=extensions)


def sign_static_key(identity: Identity, static_public: bytes) -> HandshakePayload:
    """The payload proving `identity` owns the Noise static key: Ed25519 over prefix + key (64 bytes)."""
    return HandshakePayload(identity_key=public_key_protobuf(identity.public_key),
                            identity_sig=identity.sign(LIBP2P_SIGNATURE_PREFIX + static_public))


def verify_handshake_payload(payload: HandshakePayload, remote_static: bytes) -> PeerId:
    """The PeerId whose identity key signed `remote_static` (32 bytes).

    Raises NoiseError("bad-identity-key") if the key is absent or not Ed25519 (the only type peerloom
    accepts), NoiseError("bad-identity-signature") if the signature does not verify.
    """
    try:
        peer = PeerId(public_key_from_protobuf(payload.identity_key))
    except DecodeError as exc:
        raise NoiseError("bad-identity-key", exc.reason) from exc
    if not peer.verify(LIBP2P_SIGNATURE_PREFIX + remote_static, payload.identity_sig):
        raise NoiseError("bad-identity-signature", peer.to_text())
    return peer


# --- transport cipher negotiation (peerloom's extension, spec/transport.md §1.1) ----------------------------
# A peerloom node may list, in its NoiseExtensions, the transport ciphers it accepts besides ChaChaPoly, in
# order of preference: field 20556 ("PL"), a repeated string of Noise cipher names (§12). libp2p knows
# fields 1 and 2 only and skips unknown ones, so a libp2p peer sends no offer and gets ChaChaPoly.
EXTENSION_TRANSPORT_CIPHERS = 20556
MAX_OFFERED_CIPHERS = 8
MAX_CIPHER_NAME_BYTES = 32


def encode_transport_ciphers(names: tuple[str, ...]) -> bytes:
    """NoiseExtensions protobuf bytes carrying only the transport-cipher offer `names` (b"" if empty).

    Raises NoiseError("unsupported-protocol") for a name that is not a cipher we implement, or more than
    MAX_OFFERED_CIPHERS names.
    """
    if len(names) > MAX_OFFERED_CIPHERS or any(name not in NONCE_LAYOUTS for name in names):
        raise NoiseError("unsupported-protocol", f"transport ciphers {names!r}")
    return b"".join(_encode_field(EXTENSION_TRANSPORT_CIPHERS, name.encode("ascii")) for name in names)


def decode_transport_ciphers(extensions: bytes | None) -> tuple[str, ...]:
    """The transport ciphers a peer offers in its NoiseExtensions bytes, in its order (unknown names kept,
    for `choose_transport_cipher` to skip); () if it offers none.

    Raises NoiseError("bad-payload") for malformed protobuf, an offer field that is not length-delimited,
    more than MAX_OFFERED_CIPHERS entries, or a name over MAX_CIPHER_NAME_BYTES or not printable ASCII.
    Other NoiseExtensions fields are not looked at.
    """
    if not extensions:
        return ()
    names: list[str] = []
    for field, wire, start, end in _protobuf_fields(extensions):
        if field != EXTENSION_TRANSPORT_CIPHERS:
            continue
        if wire != _WIRE_LEN:
            raise NoiseError("bad-payload", f"transport-cipher offer with wire type {wire}")
        if len(names) == MAX_OFFERED_CIPHERS:
            raise NoiseError("bad-payload", f"more than {MAX_OFFERED_CIPHERS} transport ciphers offered")
        raw = extensions[start:end]
        if len(raw) > MAX_CIPHER_NAME_BYTES or not all(0x21 <= byte <= 0x7E for byte in raw):
            raise NoiseError("bad-payload", "a transport-cipher name that is not short printable ASCII")
        names.append(raw.decode("ascii"))
    return tuple(names)


def choose_transport_cipher(initiator_offer: tuple[str, ...], responder_offer: tuple[str, ...]) -> str:
    """The transport cipher of a connection: the first cipher of the initiator's offer that the responder
    also offers and we implement; ChaChaPoly (libp2p's one cipher, always accepted) if there is none."""
    for name in initiator_offer:
        if name in responder_offer and name in NONCE_LAYOUTS:
            return name
    return CHACHAPOLY


def frame(message: bytes) -> bytes:
    """A Noise message with its 2-byte big-endian length prefix (libp2p noise "Wire Format")."""
    if len(message) > MAX_MESSAGE_BYTES:
        raise NoiseError("message-too-long", f"{len(message)} bytes")
    return len(message).to_bytes(LENGTH_PREFIX_BYTES, "big") + message


class NoiseTransport:
    """The transport phase: `send` encrypts our messages, `receive` decrypts the peer's (§5.2 Split).

    Each Noise transport message carries at most 65519 bytes of plaintext (65535 with the tag, §3). Both
    CipherStates use one cipher, `cipher` (ChaChaPoly or AESGCM); NoiseError("unsupported-protocol") if
    they differ.
    """

    __slots__ = ("_nonce", "_receive_aead", "_send_aead", "cipher", "receive", "send")

    def __init__(self, send: CipherState, receive: CipherState) -> None:
        if send.cipher != receive.cipher:
            raise NoiseError("unsupported-protocol", f"send {send.cipher}, receive {receive.cipher}")
        self.send = send
        self.receive = receive
        self.cipher = send.cipher
        self._nonce = NONCE_LAYOUTS[send.cipher]
        # The in-place paths run OpenSSL's AEAD of the same cipher (for ChaChaPoly the same bytes as
        # libsodium's, vectorized and several times faster here). Keys are fixed after Split.
        aead = OPENSSL_AEADS[send.cipher]
        self._send_aead = aead(send.k) if send.k is not None else None
        self._receive_aead = aead(receive.k) if receive.k is not None else None

    def encrypt(self, plaintext: bytes) -> bytes:
        """One transport message (len(plaintext) + 16 bytes). NoiseError "message-too-long" or
        "nonce-exhausted"."""
        if len(plaintext) > MAX_TRANSPORT_PLAINTEXT:
            raise NoiseError("message-too-long", f"{len(plaintext)}-byte plaintext")
        return self.send.encrypt_with_ad(b"", plaintext)

    def decrypt(self, ciphertext: bytes) -> bytes:
        """Plaintext of one transport message. NoiseError "decrypt-failed", "message-too-long",
        "nonce-exhausted"."""
        if len(ciphertext) > MAX_MESSAGE_BYTES:
            raise NoiseError("message-too-long", f"{len(ciphertext)}-byte ciphertext")
        if len(ciphertext) < TAGLEN:
            raise NoiseError("decrypt-failed", f"{len(ciphertext)} bytes is shorter than the tag")
        return self.receive.decrypt_with_ad(b"", ciphertext)

    def encrypt_in_place(self, buffer: bytearray | memoryview, offset: int, length: int) -> int:
        """Encrypt the `length` plaintext bytes at ``buffer[offset:]`` in place, appending the 16-byte tag
        (the buffer needs ``length + 16`` bytes from `offset`); returns ``length + 16``.

        Same transport message as `encrypt` (EncryptWithAd, empty ad, §5.1) without allocating: OpenSSL's
        AEAD (through `cryptography`'s `encrypt_into`) writes the ciphertext over the plaintext. Pass a
        memoryview to save making one per call (the bulk path does). NoiseError "message-too-long",
        "nonce-exhausted".
        """
        if length > MAX_TRANSPORT_PLAINTEXT:
            raise NoiseError("message-too-long", f"{length}-byte plaintext")
        end = offset + length
        if offset < 0 or end + TAGLEN > len(buffer):
            raise NoiseError("out-of-order", "buffer too small for plaintext + tag")
        cipher, aead = self.send, self._send_aead
        if aead is None:
            raise NoiseError("out-of-order", "no transport key")
        n = cipher.n
        if n >= MAX_NONCE:
            raise NoiseError("nonce-exhausted", "n reached 2^64-1 (§5.1); the session must end")
        view = buffer if isinstance(buffer, memoryview) else memoryview(buffer)
        aead.encrypt_into(self._nonce.pack(n), view[offset:end], b"", view[offset:end + TAGLEN])
        cipher.n = n + 1
        return length + TAGLEN

    def decrypt_into(self, ciphertext: bytes | bytearray | memoryview, out: bytearray | memoryview) -> int:
        """Decrypt one transport message into `out` (at least ``len(ciphertext) - 16`` bytes); returns the
        plaintext length. Same checks and errors as `decrypt`; the receive nonce advances on success only.
        Pass `out` as a memoryview to save making one per call (the bulk path does)."""
        size = len(ciphertext)
        if size > MAX_MESSAGE_BYTES:
            raise NoiseError("message-too-long", f"{size}-byte ciphertext")
        if size < TAGLEN:
            raise NoiseError("decrypt-failed", f"{size} bytes is shorter than the tag")
        plain = size - TAGLEN
        if len(out) < plain:
            raise NoiseError("out-of-order", "output buffer too small")
        cipher, aead = self.receive, self._receive_aead
        if aead is None:
            raise NoiseError("out-of-order", "no transport key")
        n = cipher.n
        if n >= MAX_NONCE:
            raise NoiseError("nonce-exhausted", "n reached 2^64-1 (§5.1); the session must end")
        if len(out) != plain:
            out = (out if isinstance(out, memoryview) else memoryview(out))[:plain]
        try:
            aead.decrypt_into(self._nonce.pack(n), ciphertext, b"", out)
        except cryptography.exceptions.InvalidTag:
            raise NoiseError("decrypt-failed", f"{size}-byte ciphertext, nonce {n}") from None
        cipher.n = n + 1
        return plain


class Libp2pNoiseHandshake:
    """The libp2p ``/noise`` handshake for one side, sans-IO (libp2p specs, noise/README.md).

    Noise_XX_25519_ChaChaPoly_SHA256, empty prologue. Message 1 (initiator) has an empty payload and a
    payload received in it is ignored (the spec forbids sending one: it would be unencrypted). Message 2
    carries the responder's signed `HandshakePayload`, message 3 the initiator's; each is verified on
    receipt and sets `remote_peer`. A dialer that passes `expected_peer` aborts after message 2 - before
    revealing its own identity - if the responder is someone else.

    Use: ``while not hs.is_finished: send(hs.write_message()) if hs.wants_write else
    hs.read_message(received)``, then ``hs.transport()``. Messages are unframed; see `frame`.

    `static_seed` / `ephemeral_seed` are 32-byte X25519 private keys (generated with `random` if None);
    `extensions` is raw ``NoiseExtensions`` protobuf bytes to send. `transport_ciphers` offers ciphers for
    the transport phase besides ChaChaPoly (spec/transport.md §1.1), most preferred first: the offer is
    added to the extensions (nothing is added when it is empty, so the payload is libp2p's byte for byte),
    and `transport()` uses `choose_transport_cipher` of both offers. The payloads carrying the offers are
    encrypted and bound into the handshake hash, so nobody in the middle can change the outcome.

    Errors: `NoiseError` with reasons from `HandshakeState.read_message`, plus ``bad-payload`` (also a
    malformed cipher offer), ``bad-identity-key``, ``bad-identity-signature``, ``peer-mismatch``; all of
    them sticky. ``unsupported-protocol`` at construction for an offer of a cipher we do not implement.
    """

    def __init__(self, identity: Identity, initiator: bool, *, static_seed: bytes | None = None,
                 ephemeral_seed: bytes | None = None, expected_peer: PeerId | None = None,
                 extensions: bytes | None = None, transport_ciphers: tuple[str, ...] = (),
                 random: RandomFn = nacl.utils.random) -> None:
        self.identity = identity
        self.initiator = initiator
        self.expected_peer = expected_peer
        self.remote_peer: PeerId | None = None
        self.remote_extensions: bytes | None = None
        self.transport_ciphers = tuple(transport_ciphers)
        self.remote_transport_ciphers: tuple[str, ...] = ()
        offer = encode_transport_ciphers(self.transport_ciphers)
        if offer:
            extensions = (extensions or b"") + offer
        static = static_seed if static_seed is not None else random(DHLEN)
        self._state = HandshakeState(LIBP2P_PROTOCOL_NAME, initiator=initiator, prologue=b"", s=static,
                                     e=ephemeral_seed, random=random)
        signed = sign_static_key(identity, x25519_public(static))
        self._payload = encode_handshake_payload(attrs.evolve(signed, extensions=extensions))
        self._failed: NoiseError | None = None

    @property
    def is_finished(self) -> bool:
        return self._state.is_finished

    @property
    def wants_write(self) -> bool:
        return self._state.wants_write

    @property
    def handshake_hash(self) -> bytes:
        return self._state.handshake_hash

    def write_message(self) -> bytes:
        """The next handshake message (unframed bytes). Raises NoiseError ("out-of-order", ...)."""
        if self._failed is not None:
            raise NoiseError("handshake-failed", self._failed.reason)
        payload = b"" if self._state.message_index == 0 else self._payload
        return self._state.write_message(payload)

    def read_message(self, message: bytes) -> None:
        """Process one received handshake message (unframed); on messages 2 and 3 verify the identity.

        Raises NoiseError; see the class docstring for reasons.
        """
        if self._failed is not None:
            raise NoiseError("handshake-failed", self._failed.reason)
        index = self._state.message_index
        payload = self._state.read_message(message)
        if index == 0:
            return
        try:
            assert self._state.rs is not None
            decoded = decode_handshake_payload(payload)
            peer = verify_handshake_payload(decoded, self._state.rs)
            if self.expected_peer is not None and peer != self.expected_peer:
                raise NoiseError("peer-mismatch", f"expected {self.expected_peer}, got {peer}")
            remote_ciphers = decode_transport_ciphers(decoded.extensions)
        except NoiseError as exc:
            self._failed = exc
            raise
        self.remote_peer = peer
        self.remote_extensions = decoded.extensions
        self.remote_transport_ciphers = remote_ciphers

    @property
    def transport_cipher(self) -> str:
        """The cipher the transport phase will use (meaningful once the handshake is finished)."""
        ours, theirs = self.transport_ciphers, self.remote_transport_ciphers
        return choose_transport_cipher(*((ours, theirs) if self.initiator else (theirs, ours)))

    def transport(self) -> NoiseTransport:
        """The transport ciphers for our role, once the handshake is finished (one call only)."""
        if self._failed is not None:
            raise NoiseError("handshake-failed", self._failed.reason)
        c1, c2 = self._state.split()
        cipher = self.transport_cipher
        if cipher != c1.cipher:  # the negotiated cipher keyed with Split's keys, each used by that cipher only
            c1, c2 = CipherState(c1.k, cipher), CipherState(c2.k, cipher)
        return NoiseTransport(send=c1, receive=c2) if self.initiator else NoiseTransport(send=c2, receive=c1)
