"""Chain sync (spec/protocol.md §8): every node archives every certified head (`chain/<w>`), and one that learns
of a head more than a window ahead of its own fetches and verifies the windows in between before it adopts it,
so its archive runs from window 1 to its head with no hole, also after a crash. Chain-gets go to at most
`chain_parallel` peers at once; a peer that leaves them unanswered backs off, and is hung up on after
`CHAIN_SILENT_LIMIT` in a row.

`ChainSync` holds this state and the heads this node holds (`head_at`, `chain_entry`); it acts through the
engine services `ChainHost` names."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import attrs

from . import effects as fx
from .chain import decode_chain_entry, encode_chain_entry
from .config import PartHost
from .encoding import encode
from .errors import VerificationError
from .identity import PeerId
from .messages import MAX_CHAIN_ENTRIES, CertifiedHead, ChainEntries, ChainRequest, NextHead
from .objects import Head, QuorumCertificate, Revision
from .records import HEAD_RECORD as HEAD_RECORD
from .records import ChainRecord, Record
from .records import chain_key as chain_key
from .roles import Role
from .sessions import PeerState

CHAIN_BACKOFF_MAX_DOUBLINGS = 6  # a peer that never answers is asked again at most every 2^6 chain-get timeouts
CHAIN_SILENT_LIMIT = 2  # chain-gets in a row a peer leaves unanswered before it is hung up on (§8)
MAX_CHAIN_SILENT = 1024  # peers hung up on for silence whose back-off outlives a reconnect (oldest forgotten)
MAX_PROOFS = 256  # hello certificates verified lately, not verified again (oldest forgotten)


@attrs.frozen(kw_only=True)
class Archive:
    """The certified head of `window` is being archived (`chain/<window>`): nothing waits on it."""

    window: int


@attrs.frozen(kw_only=True)
class Promote:
    """`head`, certified by `certificate`, becomes canonical once its head record is durable."""

    head: Head
    certificate: QuorumCertificate


class ChainHost(PartHost, Protocol):
    """The engine services `ChainSync` uses beyond `PartHost` (core/engine.py implements them)."""

    revision: Revision
    records: dict[str, bytes]
    head: Head
    certificate: QuorumCertificate
    adopting: int

    @property
    def peers(self) -> Mapping[PeerId, PeerState]: ...
    @property
    def roles(self) -> Sequence[Role]: ...

    def set_timer(self, key: tuple[Any, ...], deadline: float) -> None: ...
    def cancel_timer(self, key: tuple[Any, ...]) -> None: ...
    def persist_then(self, record: Record, owner: str, work: Any) -> None: ...
    def verify_certified(self, head: Head, cert: QuorumCertificate) -> None: ...
    def adopt(self, head: Head, cert: QuorumCertificate) -> None: ...


class ChainSync:
    """The certified heads this node holds, and the chain-gets that fill the windows it lacks."""

    def __init__(self, engine: ChainHost) -> None:
        self.e = engine
        # chain-gets out, peer -> (first, last); at most `chain_parallel` are live (not timed out) at a time,
        # and a late reply to one that timed out is still taken.
        self.requests: dict[PeerId, tuple[int, int]] = {}
        # A verified certified head more than one window ahead, its sender: adopted once the windows between
        # are archived. `claim`: the highest window an unlinkable next-head announced.
        self.target: tuple[Head, QuorumCertificate, PeerId] | None = None
        self.claim = 0
        self.live: dict[PeerId, float] = {}  # the live chain-gets: peer -> deadline
        self.source: PeerId | None = None  # who sent the last segment that verified
        # peers hung up on after `CHAIN_SILENT_LIMIT` unanswered chain-gets: peer -> (unanswered, back-off end),
        # restored when they reconnect, so a reconnect does not buy a liar a fresh turn
        self.silent: dict[PeerId, tuple[int, float]] = {}
        self.proofs: dict[bytes, None] = {}  # encodings of hello certificates that verified (`check_proof`)
        self.contiguous = 0  # windows 1..contiguous are all held (archive, or the current head)
        # The last heads promoted, by window: an overlapped window's leases and bases are older heads
        # (spec/protocol.md §5.2), which a node without its chain archive (`keep_chain` off) holds only here.
        self.recent: dict[int, Head] = {engine.head.window: engine.head}

    def drop_peer(self, peer: PeerId) -> None:
        """`peer` went away: a chain-get it had is asked of someone else."""
        self.requests.pop(peer, None)
        if self.live.pop(peer, None) is not None:
            self.sync()  # ask someone else

    def on_certified_head(self, peer: PeerId, state: PeerState, message: CertifiedHead) -> None:
        """A peer sent a whole certified head: adopt it, or sync up to it first when windows are missing."""
        self.note_peer_head(state, message.head.window)
        if message.head.window <= max(self.e.head.window, self.e.adopting):
            return
        self.e.verify_certified(message.head, message.certificate)
        state.head_proven = max(state.head_proven, message.head.window)
        if self.e.config.keeps_chain and message.head.window > max(self.e.head.window, self.e.adopting) + 1:
            # We missed windows (a restart, a partition): fetch and verify them first, then adopt.
            target = self.target
            if target is None or message.head.window > target[0].window:
                self.target = (message.head, message.certificate, peer)
            self.sync()
            return
        self.e.adopt(message.head, message.certificate)
        for role in self.e.roles:
            role.on_head_source(peer, message.head)

    def on_next_head(self, peer: PeerId, state: PeerState, message: NextHead) -> None:
        """A peer sent the head after one (without its roster): adopt it when it follows ours, make it the sync
        target when it follows that, else sync up to it once its certificate verifies."""
        window = message.fields["window"]
        self.note_peer_head(state, window)
        if window <= max(self.e.head.window, self.e.adopting):
            return
        parent = message.fields["parent"]
        if parent == self.e.head.id:
            head = message.head_after(self.e.head)
            self.e.verify_certified(head, message.certificate)
            state.head_proven = max(state.head_proven, window)
            self.e.adopt(head, message.certificate)
            for role in self.e.roles:
                role.on_head_source(peer, head)
            return
        target = self.target
        if target is not None and parent == target[0].id:
            # the head after the one we are syncing to becomes the target; that one is archived (it
            # links to the windows before it when they arrive, `take_segment`)
            head = message.head_after(target[0])
            self.e.verify_certified(head, message.certificate)
            state.head_proven = max(state.head_proven, window)
            if chain_key(target[0].window) not in self.e.records:
                self.e.persist_then(ChainRecord(window=target[0].window, data=encode_chain_entry(*target[:2])),
                                    "engine", Archive(window=target[0].window))
            self.target = (head, message.certificate, peer)
        else:
            # We missed a head: the chain segment up to this one carries whole heads (and rosters);
            # its last entry is adopted once every link verifies. Its certificate is checked first
            # (for this header, in this window, a quorum's votes): sync goes only as far as evidence.
            cert = message.certificate
            if cert.head != message.head_id or cert.window != window:
                raise VerificationError("wrong-head", "certificate is for another head")
            self.check_proof(cert)
            state.head_proven = max(state.head_proven, window)
            self.claim = max(self.claim, window)
        self.sync()

    def head_at(self, window: int) -> Head | None:
        """The certified head of `window` if this node holds it (current, recent, archived or genesis)."""
        if window in self.recent:
            return self.recent[window]
        entry = self.chain_entry(window)
        return None if entry is None else entry[0]

    def chain_entry(self, window: int) -> tuple[Head, QuorumCertificate] | None:
        """The certified head of `window` if this node holds it (genesis, archive or current head)."""
        if window == 0:
            genesis = self.e.revision.genesis()
            return genesis, QuorumCertificate(head=genesis.id, window=0, round=0, votes=())
        if window == self.e.head.window:
            return self.e.head, self.e.certificate
        record = self.e.records.get(chain_key(window))
        return None if record is None else decode_chain_entry(record)

    def chain_entry_held(self, window: int) -> bool:
        """True if this node holds the certified head of `window` (without decoding it)."""
        return window == 0 or window == self.e.head.window or chain_key(window) in self.e.records

    def serve_chain(self, peer: PeerId, request: ChainRequest) -> None:
        entries: list[tuple[Head, QuorumCertificate]] = []
        size = 0
        for window in range(request.from_window, min(request.to_window, self.e.head.window) + 1):
            entry = self.chain_entry(window)
            if entry is None or len(entries) == MAX_CHAIN_ENTRIES:
                break
            size += len(entry[0].to_bytes()) + 128 * len(entry[1].votes)
            if entries and size > self.e.config.max_chain_reply_bytes:
                break
            entries.append(entry)
        self.e.send(peer, ChainEntries(entries=tuple(entries)))

    def on_chain_entries(self, peer: PeerId, state: PeerState, message: ChainEntries) -> None:
        """Take a reply to our chain-get: verify and archive it (`take_segment`), then go on syncing. A peer
        whose reply brought nothing is not asked for that window again until it reports a newer head."""
        wanted = self.requests.pop(peer, None)
        if wanted is None:
            self.e.reject(peer, "unsolicited-chain")
            return
        self.live.pop(peer, None)
        state.chain_timeouts = 0  # it answers (an empty reply too): not silent
        self.silent.pop(peer, None)
        verified = self.take_segment(peer, *wanted, message.entries)
        self.e.log("chain-entries", peer=str(peer), first=wanted[0], entries=len(message.entries),
                 verified=verified or 0, seconds=round(self.e.now - state.chain_asked_at, 3))
        if verified == 0:
            state.chain_lacks = wanted[0]
        elif verified:
            self.source = peer
            state.chain_served += verified
            state.chain_backoff_until = float("-inf")
        self.sync()

    def take_segment(self, peer: PeerId, first: int, last: int,
                      entries: tuple[tuple[Head, QuorumCertificate], ...]) -> int | None:
        """Verify a chain segment link by link - window, parent id, quorum certificate - from the head we
        hold before it; archive what verifies (a node that keeps no chain adopts its last entry instead).
        The first bad entry is charged to the sender and ends the segment. Returns how many entries were
        verified, or None when we no longer hold the head the segment hangs from."""
        previous = self.chain_entry(first - 1)
        if previous is None:
            return None
        prev, prev_cert = previous
        count = 0
        for head, cert in entries:
            if head.window != prev.window + 1 or not first <= head.window <= last:
                self.e.reject(peer, "chain-window", f"window {head.window} after {prev.window}")
                return count
            if head.parent != prev.id:
                self.e.reject(peer, "chain-parent", f"window {head.window}")
                return count
            try:
                self.e.verify_certified(head, cert)
            except VerificationError as exc:
                self.e.reject(peer, exc.reason, f"window {head.window}: {exc.detail}")
                return count
            ours = self.chain_entry(head.window)
            if ours is not None and ours[0].id != head.id:
                # Two certified heads for one window would break safety: keep ours, say so loudly.
                self.e.reject(peer, "chain-conflict", f"window {head.window}")
                return count
            if ours is None and self.e.config.keeps_chain:
                self.e.persist_then(ChainRecord(window=head.window, data=encode_chain_entry(head, cert)), "engine",
                                    Archive(window=head.window))
            prev, prev_cert = head, cert
            count += 1
        after = self.chain_entry(prev.window + 1)
        target = self.target
        if after is None and target is not None and target[0].window == prev.window + 1:
            after = target[0], target[1]
        if after is not None and after[0].parent != prev.id:
            self.e.reject(peer, "chain-parent", f"window {prev.window + 1}")
            return count
        self.e.stats["chain_entries_verified"] += count
        if not self.e.config.keeps_chain and prev.window > max(self.e.head.window, self.e.adopting):
            # asked for after a next-head we could not link: the segment reaches past our head
            self.e.adopt(prev, prev_cert)
            for role in self.e.roles:
                role.on_head_source(peer, prev)
        return count

    def note_peer_head(self, state: PeerState, window: int) -> None:
        if window > state.head_window:
            state.head_window, state.chain_lacks = window, None

    def held_through(self) -> int:
        """The highest window `n` such that we hold the certified heads of windows 1..n."""
        while self.chain_entry_held(self.contiguous + 1):
            self.contiguous += 1
        return self.contiguous

    def sync(self) -> None:
        """Chain sync (spec/protocol.md §8), run whenever what we know changes: adopt what the archive now
        reaches, then ask peers for the lowest run of windows still missing (at most 64), up to
        `chain_parallel` chain-gets live at once. Missing: holes below our head, the windows before a
        verified head we learnt of (the sync target), and those up to a next-head we could not link. Peers
        asked: greeted, claiming that window, not lacking it, not asked already, not backing off after
        unanswered chain-gets; in order: those whose entries verified before, the manifest's validators, those
        that showed us a verified quorum certificate of a head that reaches the window, asked longest ago,
        peer id. What a peer claims (its roles, how high its head is) never puts it first: a claim costs
        nothing, so liars would take every turn."""
        self.advance()
        if len(self.live) >= self.e.config.chain_parallel:
            return
        base = max(self.e.head.window, self.e.adopting)
        lo = self.sync_floor()
        if self.e.config.keeps_chain:
            goal = max(base - 1, self.claim)
            if self.target is not None:
                goal = max(goal, self.target[0].window - 1)
        else:
            goal = self.claim
        if lo > goal:
            return
        hi = lo
        while hi < goal and hi - lo + 1 < MAX_CHAIN_ENTRIES and not self.chain_entry_held(hi + 1):
            hi += 1
        ahead = [(p, s) for p, s in self.e.peers.items() if s.greeted and s.head_window >= lo]
        willing = [(p, s) for p, s in ahead if s.chain_lacks != lo]
        validators = self.e.revision.manifest.validators
        candidates = sorted((s.chain_served == 0, p not in validators, s.head_proven < lo, s.chain_asked_at, p)
                            for p, s in willing if p not in self.live and s.chain_backoff_until <= self.e.now)
        while candidates and len(self.live) < self.e.config.chain_parallel:
            peer = candidates.pop(0)[-1]
            self.e.peers[peer].chain_asked_at = self.e.now
            self.requests[peer] = (lo, hi)
            self.live[peer] = self.e.now + self.e.config.chain_request_timeout_s
            self.e.send(peer, ChainRequest(from_window=lo, to_window=hi))
            self.e.log("chain-get", peer=str(peer), first=lo, last=hi, proven=self.e.peers[peer].head_proven >= lo)
        self.arm_chain_timer()
        target = self.target
        if ahead and not willing and not self.live and target is not None and lo < target[0].window:
            # Every peer ahead of us was asked and lacks these windows: liveness first. Adopt the verified
            # head; the missing windows stay wanted (holes below the head) and are asked of later peers.
            self.e.log("chain-gap", first=lo, head_window=target[0].window)
            self.target = None
            self.adopt_from(target[0], target[1], target[2])

    def sync_floor(self) -> int:
        """The lowest window chain sync may want: the first one missing from the archive (the window after our
        head for a node that keeps no chain). Peers whose heads are below it are never asked."""
        if self.e.config.keeps_chain:
            return self.held_through() + 1
        return max(self.e.head.window, self.e.adopting) + 1

    def check_proof(self, cert: QuorumCertificate) -> None:
        """Verify a hello's certificate (a quorum of the manifest's validators precommitted its head id in its
        window); raise VerificationError if it does not. The last `MAX_PROOFS` that verified are not
        verified again: every honest peer sends the fleet's head's one certificate."""
        key = encode(cert.to_cbor())
        if key in self.proofs or cert == self.e.certificate:
            return
        cert.verify_votes(self.e.revision)
        self.proofs[key] = None
        if len(self.proofs) > MAX_PROOFS:
            del self.proofs[next(iter(self.proofs))]

    def arm_chain_timer(self) -> None:
        """One timer for chain sync: the earliest live chain-get's deadline, or the earliest end of a peer's
        back-off while no chain-get is live (then it may be asked again)."""
        deadlines = list(self.live.values()) or \
            [s.chain_backoff_until for s in self.e.peers.values() if s.chain_backoff_until > self.e.now]
        if deadlines:
            self.e.set_timer(("chain-get",), min(deadlines))
        else:
            self.e.cancel_timer(("chain-get",))

    def advance(self) -> None:
        """Adopt the sync target once the archive reaches the window before it; without a target, the
        highest archived head that follows ours without a gap (fetched after a next-head we missed)."""
        base = max(self.e.head.window, self.e.adopting)
        target = self.target
        if target is not None and target[0].window <= base:
            self.target = target = None
        if not self.e.config.keeps_chain:
            return
        top = base
        while self.chain_entry_held(top + 1):
            top += 1
        if target is not None:
            if top + 1 == target[0].window:
                self.target = None
                entry = self.chain_entry(top)
                if entry is not None and entry[0].id == target[0].parent:
                    self.adopt_from(*target)
                else:  # two certified heads that do not link: keep ours, say so loudly (as `chain-conflict`)
                    self.e.reject(target[2], "chain-conflict", f"window {target[0].window} does not follow ours")
            return
        if top > base:
            entry = self.chain_entry(top)
            if entry is not None:
                self.adopt_from(entry[0], entry[1], self.source)

    def adopt_from(self, head: Head, cert: QuorumCertificate, source: PeerId | None) -> None:
        self.e.adopt(head, cert)
        if source is not None and source in self.e.peers:
            for role in self.e.roles:
                role.on_head_source(source, head)

    def on_chain_timeout(self) -> None:
        """Chain-gets went unanswered for `chain_request_timeout_s`: their peers back off (the timeout times
        2^(unanswered in a row), at most `CHAIN_BACKOFF_MAX_DOUBLINGS` doublings) and others are asked; a
        late reply is still taken. Also runs when a back-off ends."""
        for peer, deadline in list(self.live.items()):
            if deadline > self.e.now:
                continue
            del self.live[peer]
            state = self.e.peers.get(peer)
            if state is not None:
                state.chain_timeouts += 1
                doublings = min(state.chain_timeouts, CHAIN_BACKOFF_MAX_DOUBLINGS)
                state.chain_backoff_until = self.e.now + self.e.config.chain_request_timeout_s * 2**doublings
                self.e.stats["chain_timeouts"] += 1
                if state.chain_timeouts >= CHAIN_SILENT_LIMIT:
                    # It claims a head it does not serve: drop it (an honest server answers every chain-get,
                    # if only with no entries). Not charged: a slow honest peer redials and is asked again.
                    self.silent.pop(peer, None)
                    self.silent[peer] = (state.chain_timeouts, state.chain_backoff_until)
                    if len(self.silent) > MAX_CHAIN_SILENT:
                        del self.silent[next(iter(self.silent))]
                    self.e.log("chain-silent", peer=str(peer), unanswered=state.chain_timeouts,
                             claimed=state.head_window)
                    self.e.emit(fx.HangUp(peer=peer, reason="chain-silent"))
        self.sync()
