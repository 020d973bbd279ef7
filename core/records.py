"""The engine's durable records (spec/design.md §2, "Durable before visible"), one class per kind.

A `Persist` effect carries one of them; `Engine.records` and a host's store keep each under its storage key, a
string derived from the record's fields here and nowhere else (`key`), read back with `parse`. The keys and the
record bytes are what a node's store holds (adapters/database.py's ``records`` table, the simulator's disk,
`Engine.snapshot()`), so neither may change:

| class | key | data |
|---|---|---|
| `HeadRecord` | ``head`` | the canonical head's chain entry (`chain.encode_chain_entry`) |
| `ChainRecord` | ``chain/<window>`` | an archived certified head's chain entry |
| `VoteRecord` | ``vote/<window>/<round>/<step>`` | this validator's signed vote |
| `LockRecord` | ``lock/<window>`` | the round and proposal of its non-nil precommit (CBOR) |
| `ProposalRecord` | ``proposal/<window>/<round>`` | its signed head proposal |
| `ClaimRecord` | ``claim/<window>``, ``claim/<window>/<holder>`` | a trainer's signed update announcement |
| `RevocationRecord` | ``revocation/<envelope id, hex>`` | a kept revocation envelope |

Records are frozen, keyword-only value objects; don't subclass them.
"""

from __future__ import annotations

import attrs

from .errors import DecodeError
from .identity import PeerId

HEAD_RECORD = "head"
REVOCATION_PREFIX = "revocation/"


def chain_key(window: int) -> str:
    """Record key of the archived certified head of `window`."""
    return f"chain/{window}"


def vote_key(window: int, round_: int, vote_step: str) -> str:
    """Record key of this validator's vote."""
    return f"vote/{window}/{round_}/{vote_step}"


def lock_key(window: int) -> str:
    """Record key of this validator's lock in `window` (the round and proposal of its non-nil precommit)."""
    return f"lock/{window}"


def proposal_key(window: int, round_: int) -> str:
    """Record key of this validator's head proposal."""
    return f"proposal/{window}/{round_}"


def claim_key(window: int, holder: PeerId | None = None) -> str:
    """Record of the update announced for `window` (on our own lease, or claiming `holder`'s)."""
    return f"claim/{window}" if holder is None else f"claim/{window}/{holder}"


def revocation_key(envelope_id: bytes) -> str:
    """Record key of a kept revocation envelope."""
    return REVOCATION_PREFIX + envelope_id.hex()


@attrs.frozen(kw_only=True)
class HeadRecord:
    """The canonical certified head (written when it is promoted)."""
    data: bytes

    @property
    def key(self) -> str:
        return HEAD_RECORD


@attrs.frozen(kw_only=True)
class ChainRecord:
    """The certified head of `window`, archived (`EngineConfig.keeps_chain`, chain sync)."""
    window: int
    data: bytes

    @property
    def key(self) -> str:
        return chain_key(self.window)


@attrs.frozen(kw_only=True)
class VoteRecord:
    """This validator's vote for (`window`, `round`, `step`): one per triple, ever (no double vote)."""
    window: int
    round: int
    step: str
    data: bytes

    @property
    def key(self) -> str:
        return vote_key(self.window, self.round, self.step)


@attrs.frozen(kw_only=True)
class LockRecord:
    """This validator's lock in `window`."""
    window: int
    data: bytes

    @property
    def key(self) -> str:
        return lock_key(self.window)


@attrs.frozen(kw_only=True)
class ProposalRecord:
    """This validator's head proposal for (`window`, `round`)."""
    window: int
    round: int
    data: bytes

    @property
    def key(self) -> str:
        return proposal_key(self.window, self.round)


@attrs.frozen(kw_only=True)
class ClaimRecord:
    """A trainer's update announced for `window`: on its own lease (`holder` None) or claiming `holder`'s.
    `artifacts`: the digests of what the announcement names that the trainer stored without fsync (its delta
    and trajectory): a host makes them durable before the record (spec/design.md §6, Storage), so a claim
    read back after a crash never names an update whose bytes were lost. Not part of the stored record."""
    window: int
    holder: PeerId | None = None
    data: bytes
    artifacts: tuple[bytes, ...] = ()

    @property
    def key(self) -> str:
        return claim_key(self.window, self.holder)


@attrs.frozen(kw_only=True)
class RevocationRecord:
    """A revocation envelope a validator keeps (`admission`), by its envelope id."""
    envelope_id: bytes
    data: bytes

    @property
    def key(self) -> str:
        return revocation_key(self.envelope_id)


Record = (HeadRecord | ChainRecord | VoteRecord | LockRecord | ProposalRecord | ClaimRecord | RevocationRecord)


def _uint(text: str) -> int | None:
    return int(text) if text.isascii() and text.isdigit() else None


def parse(key: str, data: bytes) -> Record | None:
    """The record stored under `key` with bytes `data`, or None for a key no record of this version has (the
    inverse of `key`: ``parse(r.key, r.data) == r``)."""
    parts = key.split("/")
    match parts:
        case ["head"]:
            return HeadRecord(data=data)
        case ["chain", w] if (window := _uint(w)) is not None:
            return ChainRecord(window=window, data=data)
        case ["vote", w, r, step] if (window := _uint(w)) is not None and (round_ := _uint(r)) is not None:
            return VoteRecord(window=window, round=round_, step=step, data=data)
        case ["lock", w] if (window := _uint(w)) is not None:
            return LockRecord(window=window, data=data)
        case ["proposal", w, r] if (window := _uint(w)) is not None and (round_ := _uint(r)) is not None:
            return ProposalRecord(window=window, round=round_, data=data)
        case ["claim", w] if (window := _uint(w)) is not None:
            return ClaimRecord(window=window, data=data)
        case ["claim", w, holder] if (window := _uint(w)) is not None:
            try:
                return ClaimRecord(window=window, holder=PeerId.from_text(holder), data=data)
            except DecodeError:
                return None
        case ["revocation", hexid]:
            try:
                return RevocationRecord(envelope_id=bytes.fromhex(hexid), data=data)
            except ValueError:
                return None
    return None
