"""Sessions with peers (spec/transport.md §5, spec/wire.md §6, spec/protocol.md §8.2): what the engine knows
of each connected peer (`PeerState`), peer exchange, and the per-peer limits on what this node serves: a byte
token bucket for every served request and a per-window budget of each artifact's copies.

`Sessions` holds this state; it acts through the few engine services `SessionHost` names."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import attrs

from . import effects as fx
from .config import SERVE_MIN_COST_BYTES, PartHost
from .identity import PeerId
from .messages import MAX_PEER_ENTRIES, ChunkMissing, ChunkRequest, PeerExchange
from .objects import ArtifactRef, Head, Manifest

MAX_SERVED_PEERS = 4096  # peers whose bytes served in this window are tracked at once (spec/protocol.md §8.2)


@attrs.define
class PeerState:
    """What the engine knows of one connected peer. Quotas are per authenticated peer, never global."""

    roles: tuple[str, ...] = ()
    greeted: bool = False
    penalty: int = 0
    chunk_tokens: float = 0.0
    tokens_at: float = 0.0
    listen: str | None = None  # the listen address its Hello gave
    exchange_at: float = float("-inf")  # when it last sent a PeerExchange
    exchange_sent_at: float = float("-inf")  # when we last sent it one
    head_window: int = -1  # the highest window it told us it holds (its Hello, heads it sent)
    chain_lacks: int | None = None  # a window it could not serve us (asked again once its head moves)
    chain_asked_at: float = float("-inf")  # when we last sent it a chain-get
    chain_served: int = 0  # chain entries it sent us that verified (such peers are asked first)
    chain_timeouts: int = 0  # chain-gets in a row it left unanswered past their deadline
    chain_backoff_until: float = float("-inf")  # not asked for chain entries again before this time
    head_proven: int = 0  # the highest window whose quorum certificate it sent us and we verified


class SessionHost(PartHost, Protocol):
    """The engine services `Sessions` uses beyond `PartHost` (core/engine.py implements them)."""

    me: PeerId

    @property
    def head(self) -> Head: ...
    @property
    def peers(self) -> Mapping[PeerId, PeerState]: ...


class Sessions:
    """Peer exchange and the serving limits, per authenticated peer."""

    def __init__(self, engine: SessionHost, manifest: Manifest) -> None:
        self.e = engine
        # greeted peers that told us where they listen (peer exchange draws from these, not from all peers)
        self.listening: dict[PeerId, str] = {}
        # The per-window serving budget (spec/protocol.md §8.2): peer -> {artifact digest: bytes served} while
        # the head is `served_window`; cleared when the head moves. Kept across reconnects within a window.
        self.served: dict[PeerId, dict[bytes, int]] = {}
        self.served_window = -1
        self.validator_ids = frozenset(manifest.validators)
        self.max_served_artifacts = 4 + 2 * len(manifest.shards) + len(manifest.validators)

    def on_chunk_request(self, peer: PeerId, state: PeerState, message: ChunkRequest,
                         stored: Mapping[bytes, ArtifactRef]) -> None:
        """Serve a chunk (`ServeChunk`), or say we lack it, within the peer's window budget and byte bucket."""
        ref = stored.get(message.artifact)
        held = ref is not None and message.index < ref.num_chunks
        length = ref.chunk_length(message.index) if ref is not None and held else 0
        served = self.window_served(peer, length)
        refusal = None if served is None or ref is None else self.serve_refusal(served, ref, length)
        if refusal is not None:
            self.e.reject(peer, "serve-quota", refusal)
            return
        if not self.take_chunk_token(state, max(SERVE_MIN_COST_BYTES, length)):
            self.e.reject(peer, "chunk-quota")
            return
        if ref is None or not held:
            self.e.send(peer, ChunkMissing(artifact=message.artifact, index=message.index))
        else:
            if served is not None:
                served[message.artifact] = served.get(message.artifact, 0) + length
            self.e.stats["chunks_served"] += 1
            self.e.emit(fx.ServeChunk(peer=peer, ref=ref, index=message.index))

    def send_peer_exchange(self, peer: PeerId) -> None:
        """Tell a newly greeted peer where the other peers we are connected to listen (at most 32)."""
        known = sorted((p, a) for p, a in self.listening.items() if p != peer)
        entries: list[tuple[PeerId, str]] = []
        for p, address in known:
            if len(entries) == MAX_PEER_ENTRIES:
                break
            if address not in {a for _, a in entries}:
                entries.append((p, address))
        if entries:
            self.e.peers[peer].exchange_sent_at = self.e.now
            self.e.send(peer, PeerExchange(peers=tuple(entries)))

    def peer_exchange_round(self) -> None:
        """Every `peer_exchange_every_s`: tell each greeted peer where the others listen now, so peers that
        connected later are found too. Skips peers told within twice the receivers' quota interval (their
        clock and the network may see the gap shorter than ours)."""
        if not self.listening:
            return
        for peer, state in sorted(self.e.peers.items()):
            if state.greeted and self.e.now - state.exchange_sent_at >= 2 * self.e.config.peer_exchange_interval_s:
                self.send_peer_exchange(peer)

    def on_peer_exchange(self, peer: PeerId, state: PeerState, message: PeerExchange) -> None:
        """Quota first (one per `peer_exchange_interval_s` per peer), then report the addresses of peers we
        are not connected to; ourselves and the sender are never among them."""
        if self.e.now - state.exchange_at < self.e.config.peer_exchange_interval_s:
            self.e.reject(peer, "peers-quota")
            return
        state.exchange_at = self.e.now
        new = tuple((p, a) for p, a in message.peers if p != self.e.me and p != peer and p not in self.e.peers)
        self.e.stats["peers_learnt"] += len(new)
        if new:
            self.e.log("peers-discovered", peer=str(peer), count=len(new))
            self.e.emit(fx.PeersDiscovered(peers=new))

    def window_served(self, peer: PeerId, length: int) -> dict[bytes, int] | None:
        """What `peer` was served in this window of the head (spec/protocol.md §8.2), artifact digest -> bytes;
        None when the budget does not apply: to the manifest's validators (they fetch every update and audit,
        so only the byte bucket bounds them) and to a chunk we lack (`length` 0). Entries last until the head
        moves, across reconnects; at most `MAX_SERVED_PEERS` peers are tracked (the oldest forgotten)."""
        if peer in self.validator_ids or length == 0:
            return None
        if self.served_window != self.e.head.window:
            self.served.clear()
            self.served_window = self.e.head.window
        served = self.served.get(peer)
        if served is None:
            if len(self.served) >= MAX_SERVED_PEERS:
                del self.served[next(iter(self.served))]
            served = self.served[peer] = {}
        return served

    def serve_refusal(self, served: dict[bytes, int], ref: ArtifactRef, length: int) -> str | None:
        """Why serving `length` more bytes of `ref` would exceed a peer's budget for this window (`served`, from
        `window_served`), or None: each artifact at most `serve_copies` times its size, and at most
        `max_served_artifacts` artifacts (spec/protocol.md §8.2)."""
        done = served.get(ref.digest)
        if done is None and len(served) >= self.max_served_artifacts:
            return f"{len(served)} artifacts served in window {self.e.head.window}"
        if (done or 0) + length > self.e.config.serve_copies * ref.size:
            return f"{done} of {ref.size} bytes of this artifact served in window {self.e.head.window}"
        return None

    def take_chunk_token(self, state: PeerState, cost: int = SERVE_MIN_COST_BYTES) -> bool:
        """Byte token bucket per peer (`serve_bytes_burst`, refilled at `serve_bytes_per_s`): a request
        costs `cost` bytes, what serving it reads and sends (at least `SERVE_MIN_COST_BYTES`). An honest
        fetcher keeps at most `max_chunks_in_flight` chunks out and pulls each artifact once, so only a
        flooder runs it dry; its requests are refused without reading anything from storage."""
        c = self.e.config
        state.chunk_tokens = min(float(c.serve_bytes_burst),
                                 state.chunk_tokens + (self.e.now - state.tokens_at) * c.serve_bytes_per_s)
        state.tokens_at = self.e.now
        if state.chunk_tokens < cost:
            return False
        state.chunk_tokens -= cost
        return True
