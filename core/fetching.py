"""Artifact fetching (spec/protocol.md §8, spec/wire.md §6): the artifacts this node holds, and fetches of the
ones it lacks, chunk by chunk from the peers that offer them, each chunk verified on arrival (`StoreChunk`) and
the whole committed once every chunk is in (`CommitArtifact`). A silent provider is dropped after
`chunk_timeout_s`, a lying one charged; a failed fetch's verified chunks are remembered for the next one.

`Fetcher` holds this state; it acts through the few engine services `FetchHost` names, and hands finished
fetches back as `pending.Pending` work (`resume_pending`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Protocol

import attrs

from . import effects as fx
from .collector import FetchDelta
from .config import PartHost
from .identity import PeerId
from .messages import Chunk, ChunkMissing, ChunkRequest
from .objects import ArtifactRef, Head
from .pending import Done, Failed, Outcome, Pending

# Failed fetches whose verified chunks are remembered for a later fetch of the same artifact (oldest
# forgotten first). The chunks themselves sit in the host's partial store until commit or restart.
MAX_PARTIAL_FETCHES = 64


class FetchHost(PartHost, Protocol):
    """The engine services a `Fetcher` uses beyond `PartHost` (core/engine.py implements them)."""

    me: PeerId

    @property
    def head(self) -> Head: ...
    @property
    def peers(self) -> Mapping[PeerId, object]: ...

    def set_timer(self, key: tuple[Any, ...], deadline: float) -> None: ...
    def cancel_timer(self, key: tuple[Any, ...]) -> None: ...
    def resume_pending(self, pending: Pending, outcome: Outcome) -> None: ...


@attrs.define
class Fetch:
    ref: ArtifactRef
    providers: list[PeerId]
    waiters: list[Pending]  # resumed with Done() once stored, or Failed(reason)
    in_flight: dict[int, PeerId] = attrs.Factory(dict)
    done: set[int] = attrs.Factory(set)
    failures: int = 0
    committing: bool = False
    started: float = 0.0  # engine time the fetch began (the "artifact-fetched" log's seconds)
    durable: bool = True  # `CommitArtifact.durable`: False only while every waiter fetches an update's delta


class Fetcher:
    """The artifacts this node holds (`stored`, and when each was first held, for retention) and its fetches."""

    def __init__(self, engine: FetchHost, stored: Iterable[ArtifactRef]) -> None:
        self.e = engine
        self.stored: dict[bytes, ArtifactRef] = {r.digest: r for r in stored}
        self.stored_at: dict[bytes, int] = {}  # digest -> head window when first held (retention)
        self.fetches: dict[bytes, Fetch] = {}
        # digest -> (ref, verified chunk indices) of a failed fetch; in memory only, like the host's partial
        # chunks, which a restart also drops.
        self.partial: dict[bytes, tuple[ArtifactRef, set[int]]] = {}
        # digest -> {chunk index: provider} still asked for when a fetch ended because the artifact was
        # computed here (`note_stored`): those answers are dropped without charging anyone (oldest forgotten).
        self.superseded: dict[bytes, dict[int, PeerId]] = {}

    def drop_peer(self, peer: PeerId) -> None:
        """`peer` went away: ask its chunks of the other providers."""
        for fetch in list(self.fetches.values()):
            if peer in fetch.providers:
                fetch.providers.remove(peer)
                self.requeue(fetch, peer)

    def on_chunk_missing(self, peer: PeerId, message: ChunkMissing) -> None:
        """A provider lacks a chunk we asked it for: it is no provider of this artifact."""
        fetch = self.fetches.get(message.artifact)
        if fetch is not None and fetch.in_flight.get(message.index) == peer:
            if peer in fetch.providers:
                fetch.providers.remove(peer)
            self.requeue(fetch, peer)

    def note_stored(self, ref: ArtifactRef) -> None:
        """Record an artifact the host stored on its own (a compute task's output). A fetch of the same
        artifact under way (a reducer adopting the head whose params and optimizer state it is computing
        itself) is done at once; the chunks it still has asked for are dropped quietly when they come."""
        fetch = self.fetches.get(ref.digest)
        if fetch is not None and fetch.ref == ref and not fetch.committing:
            if fetch.in_flight:
                self.supersede(ref.digest, fetch.in_flight)
            self.on_artifact_stored(ref)
            return
        self.stored[ref.digest] = ref
        self.stored_at.setdefault(ref.digest, self.e.head.window)
        self.partial.pop(ref.digest, None)

    def supersede(self, digest: bytes, requests: Mapping[int, PeerId]) -> None:
        """Chunk requests (index -> provider) whose answers are no longer wanted: dropped without a charge
        when they come (the oldest artifacts' are forgotten first)."""
        self.superseded.setdefault(digest, {}).update(requests)
        if len(self.superseded) > MAX_PARTIAL_FETCHES:
            del self.superseded[next(iter(self.superseded))]

    def fetch(self, ref: ArtifactRef, providers: Iterable[PeerId], owner: str, work: Any) -> None:
        """Make `ref` stored locally, fetching verified chunks from `providers`; then `owner` (a
        `pending.OWNERS` name) resumes `work`, its attrs frozen record, with `Done()` - at once when the
        artifact is already stored - or `Failed(reason)`, reason "no-provider", "too-many-failures",
        "ref-mismatch" or "corrupt-artifact".

        A fetch of an artifact whose earlier fetch failed resumes from the chunks that one verified and
        stored (same `ref` only).
        """
        waiter = Pending(owner=owner, work=work)
        if ref.digest in self.stored:
            self.e.resume_pending(waiter, Done())
            return
        live = [p for p in dict.fromkeys(providers) if p in self.e.peers and p != self.e.me]
        # An update's delta can be fetched again from its author, and nothing this node signs or persists
        # needs it across a crash: its commit need not be durable (`CommitArtifact.durable`).
        durable = not isinstance(work, FetchDelta)
        fetch = self.fetches.get(ref.digest)
        if fetch is not None:
            if fetch.ref != ref:
                self.e.resume_pending(waiter, Failed(reason="ref-mismatch"))
                return
            fetch.providers.extend(p for p in live if p not in fetch.providers)
            fetch.waiters.append(waiter)
            fetch.durable = fetch.durable or durable
        else:
            fetch = Fetch(ref=ref, providers=live, waiters=[waiter], started=self.e.now, durable=durable)
            partial = self.partial.pop(ref.digest, None)
            # Another ref with the same digest chunks it differently: its record says nothing of ours, and
            # this fetch may overwrite its bytes, so it is dropped either way.
            if partial is not None and partial[0] == ref:
                fetch.done = partial[1]
            self.fetches[ref.digest] = fetch
        self.pump(fetch)

    def on_chunk(self, peer: PeerId, chunk: Chunk) -> None:
        fetch = self.fetches.get(chunk.artifact)
        if fetch is None or fetch.in_flight.get(chunk.index) != peer:
            late = self.superseded.get(chunk.artifact)
            if late is not None and late.get(chunk.index) == peer:
                # Asked for before we computed the artifact ourselves, or before the request timed out and
                # went to another provider: a slow answer, not the peer's fault.
                del late[chunk.index]
                if not late:
                    del self.superseded[chunk.artifact]
                return
            self.e.reject(peer, "unsolicited-chunk")
            return
        del fetch.in_flight[chunk.index]
        if not fetch.ref.chunk_ok(chunk.index, chunk.data):
            # The sender lied about content it offered: charge it, never ask it again for this artifact.
            self.e.reject(peer, "bad-chunk", f"chunk {chunk.index}")
            if peer in fetch.providers:
                fetch.providers.remove(peer)
            self.requeue(fetch, peer)
            return
        self.e.stats["chunks_fetched"] += 1
        fetch.done.add(chunk.index)
        self.e.emit(fx.StoreChunk(ref=fetch.ref, index=chunk.index, data=chunk.data))
        self.pump(fetch)

    def pump(self, fetch: Fetch) -> None:
        ref = fetch.ref
        if len(fetch.done) == ref.num_chunks:
            if not fetch.committing:
                fetch.committing = True
                self.e.cancel_timer(("fetch", ref.digest))
                self.e.emit(fx.CommitArtifact(ref=ref, durable=fetch.durable))
            return
        if not fetch.providers:
            if not fetch.in_flight:
                self.fail_fetch(fetch, "no-provider")
            return
        for index in range(ref.num_chunks):
            if len(fetch.in_flight) >= self.e.config.max_chunks_in_flight:
                break
            if index in fetch.done or index in fetch.in_flight:
                continue
            provider = fetch.providers[(index + fetch.failures) % len(fetch.providers)]
            fetch.in_flight[index] = provider
            self.e.send(provider, ChunkRequest(artifact=ref.digest, index=index))
        self.e.set_timer(("fetch", ref.digest), self.e.now + self.e.config.chunk_timeout_s)

    def requeue(self, fetch: Fetch, peer: PeerId) -> None:
        for index, p in list(fetch.in_flight.items()):
            if p == peer:
                del fetch.in_flight[index]
        fetch.failures += 1
        if fetch.failures > self.e.config.fetch_attempts * max(1, fetch.ref.num_chunks):
            self.fail_fetch(fetch, "too-many-failures")
        else:
            self.pump(fetch)

    def fail_fetch(self, fetch: Fetch, reason: str) -> None:
        self.fetches.pop(fetch.ref.digest, None)
        self.e.cancel_timer(("fetch", fetch.ref.digest))
        if fetch.done:  # stored by StoreChunk: a later fetch of this artifact need not ask for them again
            self.partial[fetch.ref.digest] = (fetch.ref, fetch.done)
            if len(self.partial) > MAX_PARTIAL_FETCHES:
                del self.partial[next(iter(self.partial))]
        for waiter in fetch.waiters:
            self.e.resume_pending(waiter, Failed(reason=reason))

    def on_fetch_timeout(self, digest: bytes) -> None:
        """No chunk arrived for `chunk_timeout_s` (every `_pump` re-arms the timer), so each provider with a
        request out left it unanswered that long. While another provider remains, those silent ones are
        dropped from this fetch and their chunks asked of the others; when every provider is silent (a
        stall of our own link looks the same) they are all asked again, up to `fetch_attempts`."""
        fetch = self.fetches.get(digest)
        if fetch is None or fetch.committing:
            return
        silent = sorted(set(fetch.in_flight.values()))
        if fetch.in_flight:
            self.supersede(digest, fetch.in_flight)  # their answers may still come: taken quietly, unused
        if any(p not in silent for p in fetch.providers):
            fetch.providers = [p for p in fetch.providers if p not in silent]
        for peer in silent:
            self.requeue(fetch, peer)
            if digest not in self.fetches:
                return
        if not fetch.in_flight:
            self.pump(fetch)

    def on_artifact_corrupt(self, ref: ArtifactRef) -> None:
        """Every chunk verified yet the whole is not `ref.digest`: the ref itself is false. Nothing of it
        is worth resuming, and no provider can fix it, so the fetch fails (its owner charges the author)."""
        self.partial.pop(ref.digest, None)
        fetch = self.fetches.get(ref.digest)
        if fetch is not None:
            fetch.done = set()
            self.fail_fetch(fetch, "corrupt-artifact")

    def on_artifact_stored(self, ref: ArtifactRef) -> None:
        self.stored[ref.digest] = ref
        self.stored_at.setdefault(ref.digest, self.e.head.window)
        self.partial.pop(ref.digest, None)
        fetch = self.fetches.pop(ref.digest, None)
        if fetch is not None:
            self.e.cancel_timer(("fetch", ref.digest))
            self.e.log("artifact-fetched", digest=ref.digest.hex()[:16], bytes=ref.size, chunks=ref.num_chunks,
                     seconds=round(self.e.now - fetch.started, 4))
            for waiter in fetch.waiters:
                self.e.resume_pending(waiter, Done())
