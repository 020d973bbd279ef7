"""Heads without their roster (spec/protocol.md §2 and §8): the head id hashes the header, which names the
roster by digest; `next-head` carries the header and the roster entries new since the parent; a peer
holding the parent derives the roster and checks it, and a peer that missed a head fetches whole heads."""

import attrs
import pytest

from peerloom.core.encoding import encode
from peerloom.core.errors import DecodeError
from peerloom.core.messages import ChainEntries, ChainRequest, NextHead, decode_message, encode_message
from peerloom.core.objects import Head, roster_digest
from tests.core.test_chainsync import REV, SEED, VALS, Node
from tests.helpers import certify, child, ident

T = [ident(i).peer_id for i in (20, 21, 22, 23)]


def heads_with_churn():
    """Window 1 adds T0 and T1; window 2: T0 leaves, T2 joins; window 3: T1 expires."""
    genesis = REV.genesis()
    h1 = child(REV, genesis, roster=tuple(sorted([*genesis.roster, (T[0], 1), (T[1], 2)])))
    h2 = child(REV, h1, left=(T[0],), roster=tuple(sorted([*(e for e in h1.roster if e[0] != T[0]), (T[2], 1)])))
    h3 = child(REV, h2, expired=(T[1],), roster=tuple(e for e in h2.roster if e[0] != T[1]))
    return [(h, certify(REV, h, VALS[:3])) for h in (h1, h2, h3)]


def test_head_id_hashes_the_header_and_a_whole_head_must_match_its_roster_digest():
    (h1, _), *_ = heads_with_churn()
    assert h1.header_cbor()["roster_digest"] == roster_digest(h1.roster) and "roster" not in h1.header_cbor()
    assert Head.from_cbor(h1.to_cbor()) == h1
    assert attrs.evolve(h1, roster=h1.roster[:-1]).id != h1.id  # the roster counts, through its digest
    forged = h1.to_cbor() | {"roster": h1.to_cbor()["roster"][:-1]}
    with pytest.raises(DecodeError) as err:
        Head.from_cbor(forged)
    assert err.value.reason == "roster-mismatch"


def test_next_head_derives_each_roster_from_the_parent_through_joins_leaves_and_expiries():
    parent = REV.genesis()
    for head, cert in heads_with_churn():
        message = NextHead.of(head, parent, cert)
        wire = encode_message(message)
        assert len(wire) < len(encode_message_whole(head, cert))
        received = decode_message(wire, max_bytes=1 << 20)
        assert received.head_id == head.id
        derived = received.head_after(parent)
        assert derived == head and derived.id == head.id
        parent = head
    # no roster change: the parent's roster is reused as is
    same = child(REV, parent)
    assert NextHead.of(same, parent, certify(REV, same, VALS[:3])).head_after(parent).roster is parent.roster


def encode_message_whole(head, cert):
    from peerloom.core.messages import CertifiedHead
    return encode_message(CertifiedHead(head=head, certificate=cert))


def test_a_wrong_joined_list_is_refused():
    (h1, c1), _, _ = heads_with_churn()
    genesis = REV.genesis()
    honest = NextHead.of(h1, genesis, c1)
    short = attrs.evolve(honest, joined=honest.joined[:1])
    with pytest.raises(DecodeError) as err:
        short.head_after(genesis)
    assert err.value.reason == "roster-mismatch"
    kept = attrs.evolve(honest, joined=tuple(sorted([*honest.joined, genesis.roster[0]])))
    with pytest.raises(DecodeError) as err:
        kept.head_after(genesis)
    assert err.value.reason == "bad-field"


def test_a_bad_header_is_a_decode_error():
    (h1, c1), _, _ = heads_with_churn()
    body = NextHead.of(h1, REV.genesis(), c1).body()
    for header in ({k: v for k, v in body["header"].items() if k != "roster_digest"},
                   body["header"] | {"roster": []}, body["header"] | {"window": -1}):
        with pytest.raises(DecodeError):
            decode_message(encode(["next-head", body | {"header": header}]), max_bytes=1 << 20)


def test_a_node_that_missed_a_head_fetches_whole_heads_and_adopts_the_last():
    chain = heads_with_churn()
    node = Node()
    node.connect(SEED, head_window=0)
    node.deliver(SEED, NextHead.of(chain[0][0], REV.genesis(), chain[0][1]))
    assert node.engine.head == chain[0][0]
    # window 2 never arrives; window 3's next-head does not link: ask for 2..3, adopt 3 once verified
    node.deliver(SEED, NextHead.of(chain[2][0], chain[1][0], chain[2][1]))
    assert node.engine.head == chain[0][0]
    assert node.requests(SEED) == [ChainRequest(from_window=2, to_window=3)]
    node.deliver(SEED, ChainEntries(entries=tuple(chain[1:])))
    assert node.engine.head == chain[2][0] and node.engine.head.roster == chain[2][0].roster
    # a forged joined list costs the sender
    node2 = Node()
    node2.connect(SEED, head_window=0)
    forged = attrs.evolve(NextHead.of(chain[0][0], REV.genesis(), chain[0][1]), joined=())
    node2.deliver(SEED, forged)
    assert node2.engine.head.window == 0
    assert node2.engine.rejected_by_reason["roster-mismatch"] == 1
    assert node2.engine.peers[SEED.peer_id].penalty == 1
