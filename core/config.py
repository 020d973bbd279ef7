"""A node's static configuration, `EngineConfig` (spec/design.md §2): its roles, the verified revision, limits
and local policy. Times in seconds, sizes in bytes."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any, Protocol

import attrs

from . import effects as fx
from .envelope import SignedEnvelope
from .errors import LocalProtocolError
from .identity import PeerId
from .messages import ROLES, DecodeMemo, Message
from .objects import Revision
from .privacy import Accountant


class PartHost(Protocol):
    """What every part of the engine (`Sessions`, `Fetcher`, `ChainSync`) uses of it: its configuration,
    clock and counters, and emitting, sending, logging and charging a peer (core/engine.py implements it).
    Each part's own host Protocol adds what only that part needs."""

    config: EngineConfig
    now: float
    stats: Counter[str]

    def emit(self, effect: fx.Effect) -> None: ...
    def send(self, peer: PeerId, message: Message) -> None: ...
    def log(self, event: str, **fields: Any) -> None: ...
    def reject(self, peer: PeerId | None, reason: str, detail: str = "") -> None: ...


SERVE_MIN_COST_BYTES = 64 << 10  # what a served request costs the per-peer bucket at least (spec/wire.md §6)


def _roles(roles: Iterable[str]) -> frozenset[str]:
    return frozenset(roles)


@attrs.frozen(kw_only=True)
class EngineConfig:
    """Static configuration of one node. Times in seconds, sizes in bytes."""

    roles: frozenset[str] = attrs.field(converter=_roles)
    revision: Revision
    capacity: int = 1
    max_message_bytes: int = 16 << 20
    max_chunks_in_flight: int = 8
    chunk_timeout_s: float = 5.0
    fetch_attempts: int = 6
    penalty_limit: int = 20
    ban_s: float = 600.0  # how long a peer that reached `penalty_limit` is refused (`effects.Ban`)
    reducer_close_fraction: float = 0.75
    # Per-peer serving quota in bytes (token bucket; spec/wire.md §6): a chunk request costs the chunk's
    # length, any other served request (and a request for a chunk we lack) `SERVE_MIN_COST_BYTES`. The burst
    # holds a 400 MB artifact at once and the refill outruns a window's honest fetches from one peer.
    serve_bytes_per_s: float = float(256 << 20)  # refill, bytes per second
    serve_bytes_burst: int = 1 << 30  # bucket size, bytes
    # Per window of this node's head, a peer that is not one of the manifest's validators is served each
    # artifact at most this many times its size (spec/protocol.md §8.2, `serve-quota`).
    serve_copies: int = attrs.field(default=2, validator=attrs.validators.ge(1))
    announcement_slack: int = 4  # offers a sender may make per window beyond the number of leases
    stop_after_window: int | None = None  # local policy: open no window after this one
    # Retention (spec/protocol.md §8.1): at each new head, drop the stored artifacts first held while the head
    # was more than this many windows older (never the current head's params or optimizer state). 0: keep all.
    keep_windows: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    agreement_timeout_s: float = 2.0  # Tendermint base timeout; grows linearly with the round
    # A head proposal carries its cohort's signed announcements while they and the head fit in this many
    # bytes; beyond, it names them by id only and validators fetch what they lack (spec/agreement.md §3).
    proposal_carry_bytes: int = 768 << 10
    # Archive and serve every certified head (`chain/<w>`), fetching the windows it skipped before it adopts a
    # later head (spec/protocol.md §8). Off: the node keeps its current head only and adopts at once.
    keep_chain: bool = True
    max_chain_reply_bytes: int = 512 << 10  # bound on one ChainEntries reply
    admission: SignedEnvelope | None = None  # this trainer's admission certificate (policy "certificate")
    listen_address: str | None = None  # "host:port" we accept connections on, sent in Hello (peer exchange)
    peer_exchange_interval_s: float = 10.0  # a peer may send one PeerExchange per this many seconds
    peer_exchange_every_s: float = 60.0  # re-tell greeted peers where the others listen (0: on greeting only)
    chain_request_timeout_s: float = 5.0  # a chain-get unanswered this long is asked of another peer
    # chain-gets live at once, to distinct peers (spec/protocol.md §8): a silent peer never stalls sync alone
    chain_parallel: int = attrs.field(default=2, validator=attrs.validators.ge(1))
    # A decode memo shared by the engines of one simulator process (a broadcast is decoded once); None in
    # a real node.
    decode_memo: DecodeMemo | None = attrs.field(default=None, eq=False, repr=False)
    # Private data and differential privacy (spec/protocol.md §10): `private_data` makes a trainer declare, in
    # its join, that it trains on data only it holds; `accountant` computes the privacy ledger's epsilon and
    # is required when the manifest has `privacy` (the node passes `peerloom.privacy.epsilon`).
    private_data: bool = False
    accountant: Accountant | None = attrs.field(default=None, eq=False, repr=False)

    @property
    def keeps_chain(self) -> bool:
        return self.keep_chain

    def __attrs_post_init__(self) -> None:
        if not self.roles or not self.roles <= set(ROLES):
            raise LocalProtocolError(f"roles must be a non-empty subset of {ROLES}")
        if self.capacity < 1:
            raise LocalProtocolError("capacity must be positive")
        manifest = self.revision.manifest
        if manifest.privacy is not None and self.accountant is None:
            raise LocalProtocolError("the manifest has privacy: an accountant is required (EngineConfig.accountant)")
        if self.private_data and not manifest.private_data:
            raise LocalProtocolError("this node declares private data, but the manifest admits no private-data "
                                     "trainers (private_data)")
