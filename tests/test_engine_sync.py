"""Chain sync from a stranger (spec/protocol.md §8): a late node adopts a certified head only after its
quorum certificate verifies, fetches the windows it skipped, verifies every link and certificate, and
refuses a forged chain - charged to whoever sent it."""

import random

from peerloom.core import effects as fx
from peerloom.core import events as ev
from peerloom.core.chain import verify_chain
from peerloom.core.engine import Engine, EngineConfig, chain_key
from peerloom.core.messages import (
    CertifiedHead,
    ChainEntries,
    ChainRequest,
    Hello,
    decode_message,
    encode_message,
)
from peerloom.core.objects import QuorumCertificate

from .helpers import ident, make_revision
from .test_objects import certify, child

VALS = [ident(1), ident(2), ident(3), ident(4)]
FAKES = [ident(61), ident(62), ident(63)]
SEED, STRANGER, TRAINER = ident(50), ident(51), ident(10)
REV = make_revision(validators=VALS, quorum=3, trainers=[TRAINER])


def real_chain(n=5):
    chain, head = [], REV.genesis()
    for i in range(n):
        head = child(REV, head, metrics={"test_accuracy": 0.1 * i})
        chain.append((head, certify(REV, head, VALS[i % 2:i % 2 + 3])))
    return chain


class Node:
    """One engine driven by hand: persists complete at once, sends are collected."""

    def __init__(self):
        self.engine = Engine(EngineConfig(roles={"trainer"}, revision=REV, keep_chain=True), TRAINER,
                             random.Random(0))
        self.sent = []
        self.now = 0.0
        self.engine.handle(ev.Start(now=0.0))
        self.drain()

    def drain(self):
        while (effect := self.engine.next_effect()) is not None:
            if isinstance(effect, fx.Persist):
                self.engine.handle(ev.Persisted(now=self.now, token=effect.token))
            elif isinstance(effect, fx.Send):
                self.sent.append((effect.peer, decode_message(effect.data, max_bytes=1 << 24)))

    def connect(self, peer, head_window):
        self.engine.handle(ev.PeerConnected(now=self.now, peer=peer.peer_id))
        self.deliver(peer, Hello(revision=REV.id, roles=("reducer",), head_window=head_window))

    def deliver(self, peer, message):
        self.engine.handle(ev.MessageReceived(now=self.now, peer=peer.peer_id, data=encode_message(message)))
        self.drain()

    def requests(self, peer):
        return [m for p, m in self.sent if p == peer.peer_id and isinstance(m, ChainRequest)]


def test_late_node_adopts_a_certified_head_then_verifies_and_archives_the_gap():
    chain = real_chain()
    node = Node()
    node.connect(SEED, head_window=5)
    node.deliver(SEED, CertifiedHead(head=chain[-1][0], certificate=chain[-1][1]))
    assert node.engine.head == chain[-1][0]
    assert node.requests(SEED) == [ChainRequest(from_window=1, to_window=4)]
    node.deliver(SEED, ChainEntries(entries=tuple(chain[:4])))
    assert node.engine.stats["chain_entries_verified"] == 4
    assert all(chain_key(w) in node.engine.records for w in range(1, 6))
    # Now it serves the chain to the next stranger, and what it serves verifies from genesis.
    node.connect(STRANGER, head_window=0)
    node.deliver(STRANGER, ChainRequest(from_window=1, to_window=9))
    reply = [m for p, m in node.sent if p == STRANGER.peer_id and isinstance(m, ChainEntries)][-1]
    assert [h.id for h, _ in reply.entries] == [h.id for h, _ in chain]
    assert len(verify_chain(REV, list(reply.entries))) == 6


def test_forged_certified_head_is_refused_and_charged():
    chain = real_chain()
    node = Node()
    node.connect(SEED, head_window=5)
    forged = child(REV, chain[-2][0], metrics={"test_accuracy": 0.99})
    node.deliver(SEED, CertifiedHead(head=forged, certificate=certify(REV, forged, FAKES)))
    assert node.engine.head == REV.genesis()
    assert node.engine.rejected_by_reason["not-a-validator"] == 1
    too_few = certify(REV, forged, VALS[:2])
    node.deliver(SEED, CertifiedHead(head=forged, certificate=too_few))
    assert node.engine.head == REV.genesis() and node.engine.rejected_by_reason["no-quorum"] == 1
    prevotes = certify(REV, forged, VALS[:3], step="prevote")  # right signers, wrong step
    node.deliver(SEED, CertifiedHead(head=forged, certificate=prevotes))
    assert node.engine.head == REV.genesis() and node.engine.rejected_by_reason["bad-signature"] == 1
    assert node.engine.peers[SEED.peer_id].penalty == 3
    assert not node.requests(SEED)


def test_forged_chain_segment_is_refused_link_by_link():
    chain = real_chain()
    node = Node()
    node.connect(SEED, head_window=5)
    node.deliver(SEED, CertifiedHead(head=chain[-1][0], certificate=chain[-1][1]))
    # Window 2 replaced by a head with a forged certificate (signatures zeroed): window 1 is archived,
    # window 2 is refused and charged, nothing after it is looked at.
    h2, c2 = chain[1]
    bad_cert = QuorumCertificate(head=c2.head, window=c2.window, round=c2.round,
                                 votes=tuple((p, bytes(64)) for p, _ in c2.votes))
    node.deliver(SEED, ChainEntries(entries=(chain[0], (h2, bad_cert), *chain[2:4])))
    assert node.engine.rejected_by_reason["bad-signature"] == 1
    assert chain_key(1) in node.engine.records and chain_key(2) not in node.engine.records
    # A self-consistent alternative history signed by outsiders is refused at its first entry.
    fake1 = child(REV, REV.genesis(), metrics={"test_accuracy": 0.77})
    node.engine._chain_requests[SEED.peer_id] = (2, 4)  # as if we had asked again
    node.deliver(SEED, ChainEntries(entries=((fake1, certify(REV, fake1, FAKES)),)))
    assert node.engine.rejected_by_reason["chain-window"] == 1
    # Entries that do not link to what we hold are refused (a wrong parent).
    node.engine._chain_requests[SEED.peer_id] = (2, 4)
    orphan = child(REV, fake1)
    node.deliver(SEED, ChainEntries(entries=((orphan, certify(REV, orphan, VALS[:3])),)))
    assert node.engine.rejected_by_reason["chain-parent"] == 1 and chain_key(2) not in node.engine.records
    # Unsolicited chains are refused outright.
    node.deliver(SEED, ChainEntries(entries=tuple(chain[1:4])))
    assert node.engine.rejected_by_reason["unsolicited-chain"] == 1
    assert node.engine.head == chain[-1][0]
