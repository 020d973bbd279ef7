"""`peerloom node` membership keys: ``admission`` (an admission certificate, checked at start against the
manifest and the node's key), ``leave_on_exit`` / ``leave_grace_s`` (leave the roster on SIGTERM before
shutting down), and `peerloom admit`, which issues certificates (spec/protocol.md §5 "Admission", "Leave")."""

from __future__ import annotations

import json
import subprocess
import sys

import attrs
import pytest
import trio

from peerloom.adapters.keys import generate_identity, save_identity
from peerloom.adapters.storage import atomic_write
from peerloom.cli import main as cli_main
from peerloom.core.envelope import SignedEnvelope
from peerloom.core.objects import AdmissionCertificate, JoinRequest, Revision, seal
from peerloom.node import ConfigError, leave_roster, load_admission, load_config
from tests.adapters.test_runtime_admission import TRAINER, running_node, trio_test, wait_for
from tests.helpers import NODE_CONFIG, ident, make_revision, node_config
from tests.node_cluster import chain, make_fleet, wait_until

AUTHORITY = ident(200)  # signs the manifest (NODE_CONFIG's authority)
GATE = ident(201)  # the manifest's admission_authority
NODE = ident(5)  # the trainer whose key is "k"


def certificate_revision() -> Revision:
    base = make_revision(authority=AUTHORITY)
    manifest = attrs.evolve(base.manifest, admission="certificate", admission_authority=GATE.peer_id)
    return Revision.verify(manifest.seal(AUTHORITY), AUTHORITY.peer_id)


def certificate(revision: Revision, *, signer=GATE, peer=NODE, max_capacity=2) -> SignedEnvelope:
    return seal(signer, AdmissionCertificate(revision=revision.id, peer=peer.peer_id, max_capacity=max_capacity))


def setup_node(tmp_path, admission: bytes | None, revision: Revision | None = None, key=NODE):
    """Write manifest "m", key "k" and (if given) "a.cbor"; return the config path
    (tests/peerloom/test_node_config.py)."""
    revision = revision or certificate_revision()
    atomic_write(tmp_path / "m", revision.envelope.to_bytes())
    if key is not None:
        save_identity(key, tmp_path / "k")
    if admission is not None:
        atomic_write(tmp_path / "a.cbor", admission)
    return node_config(tmp_path, 'admission = "a.cbor"\n')


def test_valid_certificate_is_accepted(tmp_path):
    revision = certificate_revision()
    cert = certificate(revision)
    config = load_config(setup_node(tmp_path, cert.to_bytes(), revision))
    assert config["admission"] == tmp_path / "a.cbor"
    assert load_admission(config["admission"], revision, NODE.peer_id) == cert


@pytest.mark.parametrize(("case", "message"), [
    ("missing", r"admission: .*No such file"),
    ("garbage", "not a signed envelope"),
    ("wrong-signer", "not by the manifest's admission_authority"),
    ("wrong-peer", "for peer .* not this node's"),
    ("wrong-revision", "for revision .* not the manifest's"),
    ("wrong-kind", "not an admission certificate"),
    ("zero-capacity", "join-not-admitted"),
    ("open-manifest", "names no admission_authority"),
    ("no-key", "does not exist"),
])
def test_bad_admission_is_a_config_error(tmp_path, case, message):
    revision = certificate_revision()
    data = {
        "missing": None,
        "garbage": b"\x00 not cbor",
        "wrong-signer": certificate(revision, signer=ident(202)).to_bytes(),
        "wrong-peer": certificate(revision, peer=ident(6)).to_bytes(),
        "wrong-revision": certificate(make_revision(authority=AUTHORITY, window_s=7.0)).to_bytes(),
        "wrong-kind": seal(GATE, JoinRequest(revision=revision.id, window=1, capacity=1)).to_bytes(),
        "zero-capacity": certificate(revision, max_capacity=0).to_bytes(),
    }.get(case, certificate(revision).to_bytes())
    path = setup_node(tmp_path, data, make_revision(authority=AUTHORITY) if case == "open-manifest" else revision,
                      key=None if case == "no-key" else NODE)
    with pytest.raises(ConfigError, match=message) as info:
        load_config(path)
    assert str(info.value).startswith(str(path))  # names the config file, like every other key


@pytest.mark.parametrize(("roles", "extra", "message"), [
    ('["validator"]', "leave_on_exit = true\n", "leave_on_exit applies to nodes with the trainer role"),
    ('["reducer"]', 'admission = "a.cbor"\n', "admission applies to nodes with the trainer role"),
    ('["trainer"]', 'leave_on_exit = "yes"\n', "leave_on_exit must be true or false"),
    ('["trainer"]', "leave_grace_s = -1.0\n", "leave_grace_s must be a finite number"),
    ('["trainer"]', "leave_grace_s = nan\n", "leave_grace_s must be a number, got nan"),
    ('["trainer"]', "leave_grace_s = true\n", "leave_grace_s must be a number, got True"),
])
def test_membership_keys_are_checked(tmp_path, roles, extra, message):
    path = tmp_path / "node.toml"
    path.write_text(NODE_CONFIG.replace('["trainer"]', roles) + extra)
    with pytest.raises(ConfigError, match=message):
        load_config(path)


def test_leave_keys_on_a_trainer(tmp_path):
    config = load_config(node_config(tmp_path, "leave_on_exit = true\nleave_grace_s = 5\n"))
    assert config["leave_on_exit"] is True and config["leave_grace_s"] == 5
    assert "leave_on_exit" not in load_config(node_config(tmp_path))  # off unless asked for


def test_admit_cli_issues_a_certificate_load_config_accepts(tmp_path, capsys):
    revision = certificate_revision()
    path = setup_node(tmp_path, None, revision)
    save_identity(GATE, tmp_path / "gate.key")
    args = ["admit", "--authority-key", str(tmp_path / "gate.key"), "--manifest", str(tmp_path / "m"),
            "--peer", NODE.peer_id.to_text(), "--max-capacity", "3", "--out", str(tmp_path / "a.cbor")]
    with pytest.raises(SystemExit) as done:
        cli_main(args)
    assert done.value.code == 0 and NODE.peer_id.to_text() in capsys.readouterr().out
    config = load_config(path)
    cert = AdmissionCertificate.from_cbor(load_admission(config["admission"], revision, NODE.peer_id)
                                          .open(AdmissionCertificate.KIND, 1))
    assert (cert.peer, cert.revision, cert.max_capacity) == (NODE.peer_id, revision.id, 3)


@pytest.mark.parametrize(("change", "message"), [
    ({"--authority-key": "absent.key"}, "does not exist"),
    ({"--authority-key": "other.key"}, "is not the manifest's admission_authority"),
    ({"--peer": "12D3KooWnotapeer"}, "is not a peer id"),
    ({"--max-capacity": "0"}, "max capacity must be 1..65536"),
    ({"--manifest": "k"}, "is not a signed manifest"),
])
def test_admit_cli_refuses_bad_input(tmp_path, capsys, change, message):
    setup_node(tmp_path, None)
    save_identity(GATE, tmp_path / "gate.key")
    save_identity(ident(202), tmp_path / "other.key")
    options = {"--authority-key": "gate.key", "--manifest": "m", "--peer": NODE.peer_id.to_text(),
               "--max-capacity": "1", "--out": "a.cbor"} | change
    args = ["admit"]
    for key, value in options.items():
        args += [key, str(tmp_path / value) if key in ("--authority-key", "--manifest", "--out") else value]
    with pytest.raises(SystemExit) as done:
        cli_main(args)
    err = capsys.readouterr().err
    assert done.value.code == 2 and message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "a.cbor").exists() and not (tmp_path / "absent.key").exists()


# --- the runtime API (in process, no validator: nothing can take the leave) ---------------------------

@trio_test
async def test_runtime_passes_admission_and_leave_waits_out_the_grace(tmp_path):
    revision = make_revision(trainers=(TRAINER,))
    cert = seal(GATE, AdmissionCertificate(revision=revision.id, peer=TRAINER.peer_id, max_capacity=1))
    async with running_node(tmp_path, revision=revision, admission=cert) as runtime:
        assert runtime.engine.config.admission == cert
        assert TRAINER.peer_id in runtime.engine.head.roster_peers  # genesis rosters it
        signal_in, signals = trio.open_memory_channel(1)  # stands in for trio's signal receiver
        started = trio.current_time()
        assert await leave_roster(runtime, 0.3, signals) == "grace-expired"
        assert trio.current_time() - started >= 0.3
        trainer = next(r for r in runtime.engine.roles if hasattr(r, "membership"))
        assert trainer.membership == "leaving"  # the event reached the engine; no validator to send it to
        signal_in.send_nowait(15)  # a second SIGTERM while waiting: stop waiting at once
        with trio.fail_after(5):
            assert await leave_roster(runtime, 30.0, signals) == "interrupted"


@trio_test
async def test_leave_of_an_unrostered_trainer_returns_at_once(tmp_path):
    async with running_node(tmp_path, revision=make_revision()) as runtime:  # an empty roster
        _, signals = trio.open_memory_channel(1)
        with trio.fail_after(1):
            assert await leave_roster(runtime, 30.0, signals) == "not-rostered"
            await runtime.wait_unrostered()
        trainer = next(r for r in runtime.engine.roles if hasattr(r, "membership"))
        # the main loop takes the queued event: it stops joining (it would be rostered after it is gone)
        await wait_for(lambda: trainer.membership == "left", 2.0)


class _PendingJoinRuntime:
    """Stands in for a NodeRuntime whose trainer has a join in flight: `heads` are the rosters of the heads
    promoted one by one after each `wait_head_change`."""

    def __init__(self, heads: list[frozenset]) -> None:
        self.identity = TRAINER
        self.heads = list(heads)
        self.engine = attrs.make_class("E", ["head"])(attrs.make_class("H", ["roster_peers", "window"])(
            frozenset(), 3))
        self.leaves_requested = 0

    def join_pending(self) -> bool:
        return True

    def request_leave(self) -> None:
        self.leaves_requested += 1

    async def wait_head_change(self) -> None:
        await trio.sleep(0.01)
        if self.heads:
            self.engine.head.roster_peers = self.heads.pop(0)
        else:
            await trio.sleep_forever()

    async def wait_unrostered(self) -> None:
        while TRAINER.peer_id in self.engine.head.roster_peers:
            await self.wait_head_change()


@trio_test
async def test_leave_with_a_pending_join_withdraws_it_and_waits_for_one_head():
    _, signals = trio.open_memory_channel(1)
    runtime = _PendingJoinRuntime([frozenset()])  # the next head does not roster us: withdrawn
    with trio.fail_after(2):
        assert await leave_roster(runtime, 30.0, signals) == "withdrawn"
    assert runtime.leaves_requested == 1
    late = _PendingJoinRuntime([frozenset({TRAINER.peer_id}), frozenset()])  # a head had rostered us already
    with trio.fail_after(2):
        assert await leave_roster(late, 30.0, signals) == "left"
    quiet = _PendingJoinRuntime([])  # no head at all within the grace
    with trio.fail_after(2):
        assert await leave_roster(quiet, 0.2, signals) == "withdrawn"


# --- end to end: real `peerloom node` processes on 127.0.0.1 --------------------------------------------

@pytest.mark.slow
def test_certificate_admits_and_leave_on_exit_leaves_before_exiting(tmp_path):
    """One validator; the manifest admits by certificate and rosters only trainer-3 (a window with no
    reachable leaseholder never closes, so someone must train). trainer-1 has a certificate from
    `peerloom admit` and leave_on_exit; trainer-2 has none. trainer-1 enters the roster (with the
    certificate's capacity), trainer-2 never does; SIGTERM makes trainer-1 leave via a head's `left`
    before it exits 0."""
    nodes = make_fleet(tmp_path, validators=1, trainers=3, quorum=1, window_s=1.0)
    validator, admitted, stranger, member = nodes
    # The same fleet under a re-sealed manifest: admission by certificate, trainer-3 alone in the roster.
    manifest = Revision.verify(SignedEnvelope.from_bytes((tmp_path / "manifest.cbor").read_bytes())).manifest
    authority, gate = generate_identity(), generate_identity()
    save_identity(gate, tmp_path / "gate.key")
    manifest = attrs.evolve(manifest, roster=((member.identity.peer_id, 1),), admission="certificate",
                            admission_authority=gate.peer_id)
    atomic_write(tmp_path / "manifest.cbor", manifest.seal(authority).to_bytes())
    for node in nodes:
        node.write_config(authority=authority.peer_id.to_text())
    out = subprocess.run([sys.executable, "-m", "peerloom", "admit", "--authority-key", str(tmp_path / "gate.key"),
                          "--manifest", str(tmp_path / "manifest.cbor"), "--peer", admitted.identity.peer_id.to_text(),
                          "--max-capacity", "2", "--out", str(admitted.directory / "admission.cbor")],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    admitted.write_config(admission="admission.cbor", capacity=3, leave_on_exit=True, leave_grace_s=20.0)
    me, other = admitted.identity.peer_id, stranger.identity.peer_id
    try:
        for node in nodes:
            node.start()
        for node in nodes:
            node.wait_port()

        def rostered() -> bool:
            heads = chain(validator)
            return bool(heads) and me in heads[-1].roster_peers

        wait_until(rostered, 40.0, "the admitted trainer in a certified roster", nodes)
        window = chain(validator)[-1].window
        wait_until(lambda: chain(validator)[-1].window >= window + 2, 20.0, "two more heads", nodes)
        # declared 3, clamped to the certificate's 2
        assert dict(chain(validator)[-1].roster) == {me: 2, member.identity.peer_id: 1}
        assert all(other not in h.roster_peers for h in chain(validator))

        def stranger_refused() -> bool:
            return any(e["event"] == "reject" and e.get("peer") == other.to_text()
                       and e["reason"] == "join-not-admitted" for e in validator.events())

        # its joins go out once it has connected and seen a head: on a loaded machine that may come late
        wait_until(stranger_refused, 40.0, "the uncertified trainer's join refused (join-not-admitted)", nodes)
        assert all(other not in h.roster_peers for h in chain(validator))

        assert admitted.stop(timeout_s=40.0) == 0
        heads = chain(validator)
        gone = [h for h in heads if h.left]
        assert [h.left for h in gone] == [(me,)]
        assert all(me not in h.roster_peers for h in heads if h.window >= gone[0].window)
        assert member.identity.peer_id in heads[-1].roster_peers  # nobody else left
        # trainer-1 saw that head before it exited: its engine logged "left", its node said so, and the head
        # it ended on is at least that one
        assert any(e["event"] == "left" for e in admitted.events())
        assert "left the roster" in (admitted.directory / "node.log").read_text()
        assert json.loads((admitted.directory / "stats.json").read_text())["head_window"] >= gone[0].window
    finally:
        for node in nodes:
            node.stop()
