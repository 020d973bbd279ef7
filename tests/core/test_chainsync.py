"""Chain sync from a stranger (spec/protocol.md §8): a late node adopts a certified head only after its
quorum certificate verifies and the windows it skipped are fetched, every link and certificate verified,
and archived; it refuses a forged chain - charged to whoever sent it. A peer that lacks the windows, is
silent or goes away is replaced by another; when every peer ahead lacks them, the node adopts the head
anyway and fills the hole from the next peer that has it (no holes after a crash). Sync goes by verified
evidence: a peer that showed the certificate of its head is asked before one that only claims a head,
a claim without a verified certificate never sets how far sync goes, and a peer that claims a head and
leaves chain-gets unanswered is hung up on."""

import random

from peerloom.core import effects as fx
from peerloom.core import events as ev
from peerloom.core.chain import decode_chain_entry, encode_chain_entry, verify_chain
from peerloom.core.chainsync import CHAIN_SILENT_LIMIT, HEAD_RECORD, chain_key
from peerloom.core.engine import Engine, EngineConfig
from peerloom.core.messages import (
    CertifiedHead,
    ChainEntries,
    ChainRequest,
    Hello,
    NextHead,
    decode_message,
    encode_message,
)
from peerloom.core.objects import QuorumCertificate
from tests.helpers import certify, child, ident, make_revision

VALS = [ident(1), ident(2), ident(3), ident(4)]
FAKES = [ident(61), ident(62), ident(63)]
SEED, STRANGER, TRAINER = ident(50), ident(51), ident(10)
REV = make_revision(validators=VALS, quorum=3, trainers=[TRAINER])


def previous_life(chain, windows, head):
    """The records a node restarted from: the archived heads of `windows` and its head record."""
    records = {chain_key(w): encode_chain_entry(*chain[w - 1]) for w in windows}
    records[HEAD_RECORD] = encode_chain_entry(*chain[head - 1])
    return records


def real_chain(n=5):
    chain, head = [], REV.genesis()
    for i in range(n):
        head = child(REV, head, metrics={"test_accuracy": 0.1 * i})
        chain.append((head, certify(REV, head, VALS[i % 2:i % 2 + 3])))
    return chain


class Node:
    """One engine driven by hand: persists complete at once, sends are collected. `records`: what a
    previous life left on disk."""

    def __init__(self, records=None, **config):
        self.engine = Engine(EngineConfig(roles={"trainer"}, revision=REV, **config), TRAINER,
                             random.Random(0), records=records)
        self.sent = []
        self.logs = []
        self.hangups = []
        self.now = 0.0
        self.engine.handle(ev.Start(now=0.0))
        self.drain()

    def drain(self):
        while (effect := self.engine.next_effect()) is not None:
            if isinstance(effect, fx.Persist):
                self.engine.handle(ev.Persisted(now=self.now, token=effect.token))
            elif isinstance(effect, fx.Send):
                self.sent.append((effect.peer, decode_message(effect.data, max_bytes=1 << 24)))
            elif isinstance(effect, fx.Log):
                self.logs.append(effect.event)
            elif isinstance(effect, fx.HangUp):
                self.hangups.append((effect.peer, effect.reason))

    def connect(self, peer, head_window, roles=("reducer",), certificate=None):
        self.engine.handle(ev.PeerConnected(now=self.now, peer=peer.peer_id))
        self.deliver(peer, Hello(revision=REV.id, roles=roles, head_window=head_window, certificate=certificate))

    def disconnect(self, peer):
        self.engine.handle(ev.PeerDisconnected(now=self.now, peer=peer.peer_id))
        self.drain()

    def tick(self, now):
        self.now = now
        self.engine.handle(ev.TimerDue(now=now))
        self.drain()

    def deliver(self, peer, message):
        self.engine.handle(ev.MessageReceived(now=self.now, peer=peer.peer_id, data=encode_message(message)))
        self.drain()

    def requests(self, peer):
        return [m for p, m in self.sent if p == peer.peer_id and isinstance(m, ChainRequest)]


def test_late_node_verifies_and_archives_the_gap_then_adopts_the_certified_head():
    chain = real_chain()
    node = Node()
    node.connect(SEED, head_window=5)
    node.deliver(SEED, CertifiedHead(head=chain[-1][0], certificate=chain[-1][1]))
    assert node.engine.head == REV.genesis()  # not before the windows it skipped are in its archive
    assert node.requests(SEED) == [ChainRequest(from_window=1, to_window=4)]
    node.deliver(SEED, ChainEntries(entries=tuple(chain[:4])))
    assert node.engine.stats["chain_entries_verified"] == 4
    assert node.engine.head == chain[-1][0]
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
    node.engine.chain.requests[SEED.peer_id] = (2, 4)  # as if we had asked again
    node.deliver(SEED, ChainEntries(entries=((fake1, certify(REV, fake1, FAKES)),)))
    assert node.engine.rejected_by_reason["chain-window"] == 1
    # Entries that do not link to what we hold are refused (a wrong parent).
    node.engine.chain.requests[SEED.peer_id] = (2, 4)
    orphan = child(REV, fake1)
    node.deliver(SEED, ChainEntries(entries=((orphan, certify(REV, orphan, VALS[:3])),)))
    assert node.engine.rejected_by_reason["chain-parent"] == 1 and chain_key(2) not in node.engine.records
    # Unsolicited chains are refused outright.
    node.deliver(SEED, ChainEntries(entries=tuple(chain[1:4])))
    assert node.engine.rejected_by_reason["unsolicited-chain"] == 1
    assert node.engine.head == chain[-1][0]


def test_restarted_node_fills_what_it_missed_before_it_adopts_by_default():
    """Every node keeps the chain unless told not to: a trainer back from a crash at window 2 hears of
    window 6, asks a validator for 3..5, verifies them, and only then moves to window 6."""
    chain = real_chain(6)
    node = Node(records=previous_life(chain, (1, 2), head=2), chain_parallel=1)
    assert node.engine.config.keeps_chain and node.engine.head == chain[1][0]
    node.connect(VALS[0], head_window=6, roles=("validator",))
    node.connect(SEED, head_window=6)
    node.deliver(SEED, CertifiedHead(head=chain[5][0], certificate=chain[5][1]))
    assert node.engine.head == chain[1][0]
    assert node.requests(VALS[0]) == [ChainRequest(from_window=3, to_window=5)] and not node.requests(SEED)
    node.deliver(VALS[0], ChainEntries(entries=tuple(chain[2:5])))
    assert node.engine.head == chain[5][0]
    assert [w for w in range(1, 7) if chain_key(w) not in node.engine.records] == []
    assert len(verify_chain(REV, [decode_chain_entry(node.engine.records[chain_key(w)]) for w in range(1, 7)])) == 7


def _asked(node, *peers):
    """The one peer among `peers` with a chain-get out, and its request."""
    asked = [(p, node.requests(p)[-1]) for p in peers if node.requests(p)]
    assert len(asked) == 1, asked
    return asked[0]


def test_a_peer_that_lacks_the_windows_is_not_asked_again_another_is():
    chain = real_chain(6)
    node = Node(chain_parallel=1)
    node.connect(SEED, head_window=6)
    node.connect(STRANGER, head_window=6)
    node.deliver(SEED, CertifiedHead(head=chain[5][0], certificate=chain[5][1]))
    first, request = _asked(node, SEED, STRANGER)
    assert request == ChainRequest(from_window=1, to_window=5)
    node.deliver(first, ChainEntries(entries=()))  # it keeps no chain
    other = STRANGER if first is SEED else SEED
    assert node.requests(other) == [request] and len(node.requests(first)) == 1
    node.deliver(other, ChainEntries(entries=tuple(chain[:5])))
    assert node.engine.head == chain[5][0] and "chain-gap" not in node.logs


def test_a_silent_or_departed_peer_is_replaced_and_a_late_reply_still_counts():
    chain = real_chain(6)
    node = Node(chain_parallel=1)
    third = ident(52)
    for peer in (SEED, STRANGER, third):
        node.connect(peer, head_window=6)
    node.deliver(SEED, CertifiedHead(head=chain[5][0], certificate=chain[5][1]))
    silent, request = _asked(node, SEED, STRANGER, third)
    node.tick(node.engine.config.chain_request_timeout_s - 0.1)
    assert len(node.requests(silent)) == 1 and sum(len(node.requests(p)) for p in (SEED, STRANGER, third)) == 1
    node.tick(node.engine.config.chain_request_timeout_s + 0.1)
    rest = [p for p in (SEED, STRANGER, third) if p is not silent]
    departed, again = _asked(node, *rest)
    assert again == request
    node.disconnect(departed)
    last, _ = _asked(node, *[p for p in rest if p is not departed])
    node.deliver(silent, ChainEntries(entries=tuple(chain[:5])))  # the late reply: taken, not charged
    assert node.engine.head == chain[5][0] and not node.engine.rejected_by_reason
    assert last not in (silent, departed)


def test_when_no_peer_ahead_has_the_windows_the_head_is_adopted_and_the_hole_filled_later():
    """Liveness first: the verified head is adopted (logged as ``chain-gap``); the windows stay wanted and
    the next peer that holds them fills them in."""
    chain = real_chain(6)
    node = Node()
    node.connect(SEED, head_window=6)
    node.deliver(SEED, CertifiedHead(head=chain[5][0], certificate=chain[5][1]))
    node.deliver(SEED, ChainEntries(entries=tuple(chain[:2])))  # 1..2, then it has no more
    assert node.requests(SEED)[-1] == ChainRequest(from_window=3, to_window=5)
    node.deliver(SEED, ChainEntries(entries=()))
    assert node.engine.head == chain[5][0] and "chain-gap" in node.logs
    assert [w for w in range(1, 7) if chain_key(w) not in node.engine.records] == [3, 4, 5]
    node.connect(VALS[0], head_window=6, roles=("validator",))
    assert node.requests(VALS[0]) == [ChainRequest(from_window=3, to_window=5)]
    node.deliver(VALS[0], ChainEntries(entries=tuple(chain[2:5])))
    assert [w for w in range(1, 7) if chain_key(w) not in node.engine.records] == []
    assert node.engine.head == chain[5][0]


def test_holes_in_a_store_from_before_are_filled_on_the_first_greeting():
    chain = real_chain(5)
    node = Node(records=previous_life(chain, (1, 2, 4, 5), head=5))
    node.connect(SEED, head_window=5)
    assert node.requests(SEED) == [ChainRequest(from_window=3, to_window=3)]
    node.deliver(SEED, ChainEntries(entries=(chain[2],)))
    assert chain_key(3) in node.engine.records and node.engine.head == chain[4][0]
    assert node.engine.stats["chain_entries_verified"] == 1


def test_a_next_head_after_the_one_being_synced_to_becomes_the_target():
    chain = real_chain(7)
    node = Node()
    node.connect(SEED, head_window=6)
    node.deliver(SEED, CertifiedHead(head=chain[5][0], certificate=chain[5][1]))
    assert node.requests(SEED) == [ChainRequest(from_window=1, to_window=5)]
    head7, cert7 = chain[6]
    node.deliver(SEED, NextHead.of(head7, chain[5][0], cert7))
    node.deliver(SEED, ChainEntries(entries=tuple(chain[:5])))
    assert node.engine.head == head7 and len(node.requests(SEED)) == 1


def test_a_node_that_keeps_no_chain_adopts_at_once_and_asks_for_nothing():
    chain = real_chain()
    node = Node(keep_chain=False)
    node.connect(SEED, head_window=5)
    node.deliver(SEED, CertifiedHead(head=chain[-1][0], certificate=chain[-1][1]))
    assert node.engine.head == chain[-1][0] and not node.requests(SEED)
    assert not [k for k in node.engine.records if k.startswith("chain/")]


def _serve_honestly(node, peer, chain):
    """`peer` answers every chain-get it has been sent and not answered yet, from `chain`."""
    answered = getattr(node, "answered", {})
    node.answered = answered
    requests = node.requests(peer)
    for request in requests[answered.get(peer, 0):]:
        entries = tuple(e for e in chain if request.from_window <= e[0].window <= request.to_window)
        node.deliver(peer, ChainEntries(entries=entries))
    answered[peer] = len(requests)


def test_liars_claiming_a_high_head_and_never_answering_do_not_stall_sync():
    """10 peers claim to be validators with a head of window 10^12 and never answer a chain-get; one honest
    stranger holds the chain. The node reaches the tip within ceil(10 / chain_parallel) chain-get timeouts,
    and the liars, backing off, are not what it asks first afterwards (spec/protocol.md §8)."""
    chain = real_chain(6)
    node = Node()
    liars = [ident(200 + i) for i in range(10)]
    for liar in liars:
        node.connect(liar, head_window=10**12, roles=("validator",))
    node.connect(SEED, head_window=6)
    node.deliver(SEED, CertifiedHead(head=chain[5][0], certificate=chain[5][1]))
    timeout, parallel = node.engine.config.chain_request_timeout_s, node.engine.config.chain_parallel
    bound = -(-len(liars) // parallel) * timeout + 0.5
    now = 0.0
    while node.engine.head != chain[5][0] and now <= bound:
        _serve_honestly(node, SEED, chain)
        now += 0.5
        node.tick(now)
    assert node.engine.head == chain[5][0], f"not at the tip after {now} s"
    assert all(chain_key(w) in node.engine.records for w in range(1, 6)) and "chain-gap" not in node.logs
    assert all(len(node.requests(liar)) <= 1 for liar in liars)  # each silent one was asked once at most
    # A next head the node cannot link: the peer whose entries verified is asked first, liars never.
    later = real_chain(9)
    for entry in later[6:8]:
        chain.append(entry)
    asked_before = {p.peer_id: len(node.requests(p)) for p in (*liars, SEED)}
    node.deliver(SEED, CertifiedHead(head=later[8][0], certificate=later[8][1]))
    assert len(node.requests(SEED)) == asked_before[SEED.peer_id] + 1
    assert all(len(node.requests(liar)) == asked_before[liar.peer_id] for liar in liars
               if node.engine.peers[liar.peer_id].chain_backoff_until > node.now)


def test_the_manifests_validators_are_asked_before_peers_that_only_claim_the_role():
    chain = real_chain(6)
    node = Node(chain_parallel=1)
    for liar in (ident(200), ident(201), ident(202)):
        node.connect(liar, head_window=10**12, roles=("validator",))
    node.connect(VALS[3], head_window=6, roles=("validator",))
    node.deliver(VALS[3], CertifiedHead(head=chain[5][0], certificate=chain[5][1]))
    asked, request = _asked(node, ident(200), ident(201), ident(202), VALS[3])
    assert asked is VALS[3] and request == ChainRequest(from_window=1, to_window=5)


def test_a_hello_carries_the_certificate_of_the_senders_head_once_past_genesis():
    chain = real_chain(3)
    fresh = Node()
    fresh.connect(SEED, head_window=0)
    hello = [m for p, m in fresh.sent if isinstance(m, Hello)][-1]
    assert hello.head_window == 0 and hello.certificate is None  # absent when unused: old peers interoperate
    node = Node(records=previous_life(chain, (1, 2, 3), head=3))
    node.connect(SEED, head_window=0)
    hello = [m for p, m in node.sent if isinstance(m, Hello)][-1]
    assert hello.head_window == 3 and hello.certificate == chain[2][1]


def test_a_peer_that_proves_its_head_in_its_hello_is_asked_before_peers_that_only_claim_one():
    """Liars are greeted first and claim a far higher head; an honest stranger greets last with the
    certificate of its head. The stranger is asked, and the node reaches the tip with no chain-get timeout.
    Without the certificate the same stranger is asked only after liars with lower peer ids."""
    chain = real_chain(6)
    liars = [ident(200 + i) for i in range(6)]
    honest = max((SEED, STRANGER), key=lambda p: p.peer_id)
    assert any(liar.peer_id < honest.peer_id for liar in liars)  # order by peer id alone would pick a liar
    for proof in (None, chain[5][1]):
        node = Node(chain_parallel=1)
        for liar in liars:
            node.connect(liar, head_window=10**12, roles=("validator",))
        node.connect(honest, head_window=6, certificate=proof)
        assert node.engine.peers[honest.peer_id].head_proven == (6 if proof else 0)
        node.engine.chain.target = (chain[5][0], chain[5][1], liars[0].peer_id)  # the head, told by anyone
        node.engine.chain.sync()
        node.drain()
        if proof is None:
            assert not node.requests(honest)
            continue
        assert node.requests(honest) == [ChainRequest(from_window=1, to_window=5)]
        _serve_honestly(node, honest, chain)
        assert node.engine.head == chain[5][0] and not any(node.requests(liar) for liar in liars)


def test_a_head_the_peer_sent_and_that_verified_is_proof_too():
    chain = real_chain(6)
    node = Node(chain_parallel=1)
    liars = [ident(200 + i) for i in range(4)]
    for liar in liars:
        node.connect(liar, head_window=10**12)
    node.connect(STRANGER, head_window=6)  # an old peer: no certificate in its hello
    node.deliver(STRANGER, CertifiedHead(head=chain[5][0], certificate=chain[5][1]))
    assert node.requests(STRANGER) == [ChainRequest(from_window=1, to_window=5)]
    assert not any(node.requests(liar) for liar in liars)


def test_a_forged_hello_certificate_is_refused_and_charged_and_the_peer_not_greeted():
    chain = real_chain(6)
    head = chain[5][0]
    node = Node()
    for peer, cert, reason in [
        (ident(200), certify(REV, head, FAKES), "not-a-validator"),
        (ident(201), certify(REV, head, VALS[:2]), "no-quorum"),
        (ident(202), certify(REV, head, VALS[:3], step="prevote"), "bad-signature"),
    ]:
        node.connect(peer, head_window=6, certificate=cert)
        assert node.engine.rejected_by_reason[reason] == 1
        assert node.engine.peers[peer.peer_id].penalty == 1 and not node.engine.peers[peer.peer_id].greeted
    # a certificate for another window than the hello's head_window does not even decode
    node.engine.handle(ev.PeerConnected(now=node.now, peer=ident(203).peer_id))
    node.deliver(ident(203), Hello(revision=REV.id, roles=("trainer",), head_window=7, certificate=chain[5][1]))
    assert node.engine.rejected_by_reason["decode-bad-field"] == 1


def test_a_hello_certificate_is_checked_once_and_only_when_the_peer_could_be_asked():
    chain = real_chain(6)
    node = Node(records=previous_life(chain, range(1, 7), head=6))
    calls = []
    verify = QuorumCertificate.verify_votes
    QuorumCertificate.verify_votes = lambda self, revision: (calls.append(self.window), verify(self, revision))[1]
    try:
        node.connect(SEED, head_window=6, certificate=chain[5][1])  # not ahead of us: not checked
        later = real_chain(8)
        node.connect(STRANGER, head_window=8, certificate=later[7][1])
        node.connect(ident(52), head_window=8, certificate=later[7][1])  # the same certificate: checked once
    finally:
        QuorumCertificate.verify_votes = verify
    assert calls == [8]
    assert node.engine.peers[ident(52).peer_id].head_proven == 8


def test_a_next_head_that_does_not_link_sets_no_sync_goal_unless_its_certificate_verifies():
    chain = real_chain(6)
    node = Node(records=previous_life(chain, (1, 2), head=2))
    head6, cert6 = chain[5]
    forged = NextHead.of(head6, chain[4][0], certify(REV, head6, FAKES))
    node.connect(SEED, head_window=2)
    node.deliver(SEED, forged)
    assert node.engine.rejected_by_reason["not-a-validator"] == 1 and not node.requests(SEED)
    other = NextHead.of(head6, chain[4][0], chain[4][1])  # a real certificate, of another head
    node.deliver(SEED, other)
    assert node.engine.rejected_by_reason["wrong-head"] == 1 and not node.requests(SEED)
    node.deliver(SEED, NextHead.of(head6, chain[4][0], cert6))
    assert node.requests(SEED) == [ChainRequest(from_window=3, to_window=6)]
    assert node.engine.peers[SEED.peer_id].head_proven == 6


def test_a_peer_that_claims_a_head_and_leaves_chain_gets_unanswered_is_hung_up_on_and_stays_backed_off():
    """Not charged (a slow honest peer redials), but a reconnect does not buy it a fresh turn; an honest
    peer that answers, if only with no entries, is never hung up on."""
    chain = real_chain(6)
    node = Node(chain_parallel=1)
    liar = ident(200)
    node.connect(liar, head_window=10**12, roles=("validator",))
    node.connect(SEED, head_window=6)
    node.engine.chain.target = (chain[5][0], chain[5][1], SEED.peer_id)
    node.engine.peers[SEED.peer_id].chain_lacks = 1  # only the liar is willing
    node.engine.chain.sync()
    node.drain()
    timeout = node.engine.config.chain_request_timeout_s
    now = 0.0
    while len(node.requests(liar)) < CHAIN_SILENT_LIMIT or not node.hangups:
        now += 0.5
        node.tick(now)
        assert now < 60 * timeout
    assert node.hangups == [(liar.peer_id, "chain-silent")] and len(node.requests(liar)) == CHAIN_SILENT_LIMIT
    assert node.engine.peers[liar.peer_id].penalty == 0 and not node.engine.rejected_by_reason
    node.disconnect(liar)
    node.connect(liar, head_window=10**12, roles=("validator",))
    node.tick(now + 0.5)
    assert len(node.requests(liar)) == CHAIN_SILENT_LIMIT  # still backing off after its reconnect
    node.engine.peers[SEED.peer_id].chain_lacks = None
    node.engine.chain.sync()
    node.drain()
    for _ in range(CHAIN_SILENT_LIMIT + 1):
        node.deliver(SEED, ChainEntries(entries=()))
        node.engine.peers[SEED.peer_id].chain_lacks = None
        node.engine.chain.sync()
        node.drain()
    assert len(node.requests(SEED)) == CHAIN_SILENT_LIMIT + 2 and not node.engine.rejected_by_reason
    assert all(peer != SEED.peer_id for peer, _ in node.hangups)
