"""What the HTTP edge reads from and hands to a running node (spec/design.md §6).

`EdgeView` is the one seam between `adapters.http_edge` (an aiohttp server on its own thread and asyncio
loop) and the node runtime (trio). Every method is called from the edge's thread, so an implementation
must be thread-safe and must not block for long (read snapshots; hand submissions to the engine through a
thread-safe channel and wait for its answer at most `SUBMIT_TIMEOUT_S`).

The edge never trusts what clients send: it checks sizes and the envelope signature before calling
`submit`, and the node verifies everything again (the edge is a convenience, not a trust boundary).
Heads and certificates are returned as decoded objects; the edge serves their canonical CBOR bytes
(`Head.to_bytes()`, `encode(certificate.to_cbor())`) so clients can verify them against the manifest.

`NodeEdgeView` implements the protocol for a running node from a few callables the runtime supplies (see
its docstring); `peerloom.testing.InMemoryEdgeView` is a complete, thread-safe fake for tests. Both pre-check
submissions with `check_submission`, which mirrors the node's collector and uses its reason codes.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import attrs

from peerloom.core.envelope import SignedEnvelope
from peerloom.core.errors import DecodeError, VerificationError
from peerloom.core.identity import PeerId
from peerloom.core.leases import lease_fault, lease_window, leases_of
from peerloom.core.objects import (
    PROTOCOL_VERSION,
    AdmissionRevocation,
    Head,
    JoinRequest,
    QuorumCertificate,
    Revision,
    UpdateAnnouncement,
    check_revocation,
    make_artifact_ref,
)

SUBMIT_TIMEOUT_S = 10.0

HeadCallback = Callable[[Head, QuorumCertificate], None]


@attrs.frozen(kw_only=True)
class CertifiedEntry:
    """A head and its quorum certificate; `certificate` is None only for the genesis head (window 0)."""

    head: Head
    certificate: QuorumCertificate | None


@attrs.frozen(kw_only=True)
class LeaseInfo:
    """The shards `peer` holds in `window` (= certified head's window + 1), computed from head `base`."""

    peer: PeerId
    window: int
    base: bytes
    shards: tuple[int, ...]


@attrs.frozen(kw_only=True)
class SubmitResult:
    """The node's verdict on a submitted envelope. `reason` is a `core.errors` reason when rejected."""

    accepted: bool
    reason: str = ""
    envelope_id: bytes = b""


@attrs.frozen(kw_only=True)
class PeerInfo:
    """A connected (or known) peer as the node sees it. Byte counts are wire bytes (Noise frames)."""

    peer_id: PeerId
    roles: tuple[str, ...]
    address: str = ""
    connected: bool = True
    bytes_sent: int = 0
    bytes_received: int = 0
    rejected: int = 0  # input of this peer the node rejected since it started (updates, messages, chunks)
    last_rejection: str = ""  # the last one's reason and detail, e.g. "screen-norm-outlier (norm 31 > ...)"


@attrs.frozen(kw_only=True)
class WindowStats:
    """One row of the dashboard history: a certified window and what the node counted during it.

    `metrics` are the head's validation metrics (e.g. ``test_loss``, ``test_accuracy``); `time` is
    seconds since the epoch when the node promoted the head; byte counts are cumulative wire bytes.
    """

    window: int
    head_id: bytes
    skipped: bool
    metrics: dict[str, float]
    accepted: int = 0
    rejected: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    time: float = 0.0


@runtime_checkable
class EdgeView(Protocol):
    """The node as the HTTP edge sees it. All methods are called from the edge's (non-trio) thread."""

    @property
    def peer_id(self) -> PeerId:
        """This node's peer id."""
        ...

    @property
    def roles(self) -> frozenset[str]:
        """This node's roles (subset of ``trainer``, ``reducer``, ``validator``)."""
        ...

    @property
    def revision(self) -> Revision:
        """The verified revision (manifest envelope) the node runs; served so light peers can verify."""
        ...

    @property
    def registry(self) -> Any:
        """The node's `prometheus_client.CollectorRegistry`, exposed at ``/metrics``."""
        ...

    def latest(self) -> CertifiedEntry:
        """The latest certified head (the genesis head with no certificate before window 1)."""
        ...

    def head(self, head_id: bytes) -> CertifiedEntry | None:
        """A certified head the node holds, by content id; None if unknown."""
        ...

    def chain(self, start_window: int, limit: int) -> Sequence[CertifiedEntry]:
        """Certified heads with window >= `start_window`, ascending, at most `limit` of them."""
        ...

    def certificate(self, head_id: bytes) -> QuorumCertificate | None:
        """The quorum certificate of a head the node holds; None if unknown (or genesis)."""
        ...

    def artifact_path(self, digest: bytes) -> Path | None:
        """Path of a complete, digest-verified artifact in the node's store; None if absent.

        The file is immutable once visible (content-addressed store), so the edge may stream ranges of it.
        """
        ...

    def leases(self, peer: PeerId) -> LeaseInfo:
        """The leases of `peer` for the window after the latest certified head (empty shards if none)."""
        ...

    def submit(self, envelope: bytes, artifact: bytes | None) -> SubmitResult:
        """Hand a signed envelope (canonical `SignedEnvelope` bytes) to the node; it verifies everything.

        Kinds: ``update`` (with `artifact` = the delta's safetensors bytes, which must match the
        announcement's delta ref) and ``join`` (no artifact). Blocks at most `SUBMIT_TIMEOUT_S` seconds;
        on timeout returns ``SubmitResult(accepted=False, reason="timeout")``.
        """
        ...

    def peers(self) -> Sequence[PeerInfo]:
        """Peers the node knows, connected ones first."""
        ...

    def addresses(self) -> Sequence[str]:
        """The node's bound transport listen addresses (spec/transport.md §9), e.g. ``http://H:P``, so a light
        trainer can dial it (`peerloom light`); empty when it listens nowhere."""
        ...

    def subscribe(self, callback: HeadCallback) -> Callable[[], None]:
        """Call `callback(head, certificate)` on every head promotion (from the node's thread; it must be
        quick and must not raise). Returns a function that unsubscribes."""
        ...

    def history(self) -> Sequence[WindowStats]:
        """Per-window statistics of every certified window this node has seen, ascending."""
        ...

    def health(self) -> str:
        """``ok``, or ``disk-full`` while the node's store cannot be written: it serves reads, refuses
        uploads and casts no votes until space is free again (spec/transport.md §15)."""
        ...

    def last_error(self) -> str:
        """The node's last failed compute task, one line (``"train task failed: ValueError: ..."``); empty
        when none has failed since it started."""
        ...


# A submission that passed `check_submission`: its envelope and the object it signs.
Checked = tuple[SignedEnvelope, JoinRequest | UpdateAnnouncement | AdmissionRevocation]


def check_submission(revision: Revision, head: Head, envelope: bytes, artifact: bytes | None, *,
                     leases: Mapping[PeerId, tuple[int, ...]] | None = None) -> Checked:
    """Verify a submission the way the node's collector does, against the latest certified `head`.

    Joins: signature and revision. Revocations: the admission authority's, for this revision
    (``bad-revocation``; spec/auth.md §6). Updates: signature, revision, window and base (``wrong-base``), a lease
    in the window after `head` (``no-lease``; quarantined peers hold none), the leased shards
    (``bad-lease``; the collector's own rule, `core.leases.lease_fault`), and `artifact` matching the announced
    delta (``bad-artifact``). `leases` is the lease table of the window after `head` when the caller has it
    cached. Raises DecodeError or VerificationError with the collector's reason codes (core/collector.py).
    """
    env = SignedEnvelope.from_bytes(envelope)
    if env.kind == JoinRequest.KIND:
        join = JoinRequest.from_cbor(env.open(JoinRequest.KIND, PROTOCOL_VERSION))
        if join.revision != revision.id:
            raise VerificationError("wrong-revision", "join")
        return env, join
    if env.kind == AdmissionRevocation.KIND:
        return env, check_revocation(env, revision.id, revision.manifest)
    ann = UpdateAnnouncement.from_cbor(env.open(UpdateAnnouncement.KIND, PROTOCOL_VERSION))
    if ann.revision != revision.id:
        raise VerificationError("wrong-revision", "update")
    if ann.window != head.window + 1 or ann.base != head.id:
        raise VerificationError("wrong-base", f"window {ann.window}")
    table = leases if leases is not None else leases_of(head, revision.manifest)
    if fault := lease_fault(env.signer, ann.shards, table):
        raise VerificationError(fault, str(env.signer))
    if artifact is None or len(artifact) != ann.delta.size or \
            make_artifact_ref(artifact, ann.delta.chunk_size) != ann.delta:
        raise VerificationError("bad-artifact", "delta bytes do not match the announcement")
    return env, ann


class ChainIndex:
    """Thread-safe index of certified heads, per-window statistics and head subscribers: the read side
    shared by `NodeEdgeView` and `peerloom.testing.InMemoryEdgeView`. `promote` is called by whoever
    certifies heads."""

    def __init__(self, revision: Revision, entries: Iterable[tuple[Head, QuorumCertificate]] = ()) -> None:
        self._lock = threading.Lock()
        genesis = CertifiedEntry(head=revision.genesis(), certificate=None)
        self._entries: list[CertifiedEntry] = [genesis]
        self._by_id: dict[bytes, CertifiedEntry] = {genesis.head.id: genesis}
        self._history: list[WindowStats] = []
        self._subscribers: list[HeadCallback] = []
        self._leases: tuple[bytes, dict[PeerId, tuple[int, ...]]] | None = None
        self._health = "ok"
        self._last_error = ""
        for head, cert in sorted(entries, key=lambda e: e[0].window):
            self._add(head, cert, {})

    def _add(self, head: Head, certificate: QuorumCertificate, stats: dict[str, Any]) -> bool:
        if head.id in self._by_id or head.window <= self._entries[-1].head.window:
            return False
        entry = CertifiedEntry(head=head, certificate=certificate)
        self._entries.append(entry)
        self._by_id[head.id] = entry
        self._history.append(WindowStats(window=head.window, head_id=head.id, skipped=head.skipped,
                                         metrics=dict(head.metrics), **stats))
        return True

    def promote(self, head: Head, certificate: QuorumCertificate, **stats: Any) -> None:
        """Append a certified head (window above the latest; others are ignored) and notify subscribers.

        `stats` are `WindowStats` fields: accepted, rejected, bytes_sent, bytes_received, time.
        """
        with self._lock:
            added = self._add(head, certificate, stats)
            subscribers = list(self._subscribers)
        if added:
            for callback in subscribers:
                callback(head, certificate)

    def latest(self) -> CertifiedEntry:
        with self._lock:
            return self._entries[-1]

    def head(self, head_id: bytes) -> CertifiedEntry | None:
        with self._lock:
            return self._by_id.get(head_id)

    def chain(self, start_window: int, limit: int) -> Sequence[CertifiedEntry]:
        with self._lock:
            entries = self._entries
            lo = bisect.bisect_left([e.head.window for e in entries], start_window)
            return entries[lo:lo + max(0, limit)]

    def certificate(self, head_id: bytes) -> QuorumCertificate | None:
        entry = self.head(head_id)
        return None if entry is None else entry.certificate

    def subscribe(self, callback: HeadCallback) -> Callable[[], None]:
        with self._lock:
            self._subscribers.append(callback)

        def unsubscribe() -> None:
            with self._lock:
                if callback in self._subscribers:
                    self._subscribers.remove(callback)

        return unsubscribe

    def health(self) -> str:
        return self._health

    def set_health(self, state: str) -> None:
        """``ok`` or ``disk-full`` (`EdgeView.health`); any thread."""
        self._health = state

    def last_error(self) -> str:
        return self._last_error

    def set_last_error(self, line: str) -> None:
        """The node's last failed task (`EdgeView.last_error`); any thread."""
        self._last_error = line

    def history(self) -> Sequence[WindowStats]:
        with self._lock:
            return list(self._history)

    def lease_table(self, revision: Revision) -> tuple[Head, Mapping[PeerId, tuple[int, ...]]]:
        """The latest head and the leases of the window after it. Computed once per head, not per request:
        a request (even a signed one) must not cost the node a full lease computation (shards x roster
        hashes)."""
        head = self.latest().head
        with self._lock:
            cached = self._leases if self._leases is not None and self._leases[0] == head.id else None
        if cached is None:
            # Overlapped windows draw a window's leases from an older head (spec/protocol.md §5.2).
            window = head.window + 1
            lease_w = lease_window(window, revision.manifest)
            found = [e.head for e in self.chain(lease_w, 1) if e.head.window == lease_w]
            lease_head = head if lease_w == head.window else (found[0] if found else None)
            cached = (head.id, {} if lease_head is None else leases_of(lease_head, revision.manifest, window))
            with self._lock:
                self._leases = cached
        return head, cached[1]

    def check_submission(self, revision: Revision, envelope: bytes, artifact: bytes | None) -> Checked | SubmitResult:
        """`check_submission` against the latest certified head and its cached lease table: the envelope and
        its object, or the refusal (`SubmitResult` with the reason) that every view's `submit` returns."""
        try:
            head, table = self.lease_table(revision)
            return check_submission(revision, head, envelope, artifact, leases=table)
        except (DecodeError, VerificationError) as exc:
            return SubmitResult(accepted=False, reason=exc.reason)

    def lease_info(self, revision: Revision, peer: PeerId) -> LeaseInfo:
        """`peer`'s leases in the window after the latest head (empty if it holds none)."""
        head, table = self.lease_table(revision)
        return LeaseInfo(peer=peer, window=head.window + 1, base=head.id, shards=table.get(peer, ()))


class ViewIdentity:
    """Who is serving: the `EdgeView` identity properties shared by both views (set by their __init__)."""

    _peer_id: PeerId
    _roles: frozenset[str]
    _revision: Revision
    _registry: Any

    @property
    def peer_id(self) -> PeerId:
        return self._peer_id

    @property
    def roles(self) -> frozenset[str]:
        return self._roles

    @property
    def revision(self) -> Revision:
        return self._revision

    @property
    def registry(self) -> Any:
        return self._registry


class NodeEdgeView(ChainIndex, ViewIdentity):
    """The `EdgeView` of a running node: the runtime feeds it and supplies three callables.

    - The runtime calls `promote(head, certificate, accepted=..., rejected=..., bytes_sent=...,
      bytes_received=..., time=...)` on every `HeadPromoted` effect (any thread; quick).
    - `artifact_path(digest)`: the verified artifact's file in the node's store, or None.
    - `relay(envelope, artifact)`: called from the edge's thread after `check_submission` passed; it must
      hand the envelope (and store the artifact) to the engine on the node's own thread (e.g. with
      ``trio.from_thread.run(..., trio_token=...)``), wait at most `SUBMIT_TIMEOUT_S` for the engine's
      verdict, and return it. The engine verifies again; the edge is no trust boundary.
    - `peers()`: the node's peers as `PeerInfo`s.
    - `addresses()`: the node's bound transport listen addresses (read from the edge's thread).
    """

    def __init__(self, *, peer_id: PeerId, roles: Iterable[str], revision: Revision, registry: Any,
                 artifact_path: Callable[[bytes], Path | None],
                 relay: Callable[[SignedEnvelope, bytes | None], SubmitResult],
                 peers: Callable[[], Sequence[PeerInfo]],
                 entries: Iterable[tuple[Head, QuorumCertificate]] = (),
                 addresses: Callable[[], Sequence[str]] = tuple) -> None:
        super().__init__(revision, entries)
        self._peer_id, self._roles, self._revision, self._registry = peer_id, frozenset(roles), revision, registry
        self._artifact_path, self._relay, self._peers = artifact_path, relay, peers
        self._addresses = addresses

    def artifact_path(self, digest: bytes) -> Path | None:
        return self._artifact_path(digest)

    def leases(self, peer: PeerId) -> LeaseInfo:
        return self.lease_info(self._revision, peer)

    def submit(self, envelope: bytes, artifact: bytes | None) -> SubmitResult:
        checked = self.check_submission(self._revision, envelope, artifact)
        return checked if isinstance(checked, SubmitResult) else self._relay(checked[0], artifact)

    def peers(self) -> Sequence[PeerInfo]:
        return list(self._peers())

    def addresses(self) -> Sequence[str]:
        return tuple(self._addresses())
