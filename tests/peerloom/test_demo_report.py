"""The demo report's verdicts and log reading (peerloom/demo_report.py); the whole report is checked end to
end in tests/e2e/test_demo_e2e.py."""

import json

from peerloom.demo_report import defence_verdict, read_events, window_bytes


def test_defended_run_within_two_points_keeps_up_and_a_bigger_gap_is_degraded():
    ok = defence_verdict(rule="centered_clip", defended=True, final=0.9756, baseline=0.9778)
    assert ok["degraded"] is False and ok["unit"] == "points" and abs(ok["gap"] - 0.22) < 1e-9
    bad = defence_verdict(rule="centered_clip", defended=True, final=0.90, baseline=0.9778)
    assert bad["degraded"] is True and "did not hold off" in bad["summary"]
    loose = defence_verdict(rule="centered_clip", defended=True, final=0.94, baseline=0.9778, max_gap_points=5.0)
    assert loose["degraded"] is False


def test_undefended_degradation_is_named_as_expected_and_loss_gaps_are_reported_not_judged():
    mean = defence_verdict(rule="mean", defended=False, final=0.10, baseline=0.9778)
    assert mean["degraded"] is True and "as expected without defences" in mean["summary"]
    charlm = defence_verdict(rule="centered_clip", defended=True, final=1.9, baseline=1.44, higher_is_better=False)
    assert charlm["degraded"] is None and charlm["unit"] == "nats" and "bits per character" in charlm["summary"]


def test_read_events_skips_a_line_torn_by_sigkill(tmp_path):
    path = tmp_path / "events.jsonl"
    path.write_text(json.dumps({"t": 1.0, "event": "head", "window": 1}) + "\n" + '{"t": 2.0, "event": "he')
    assert read_events(path) == [{"t": 1.0, "event": "head", "window": 1}]
    assert read_events(tmp_path / "missing.jsonl") == []


def test_window_bytes_counts_a_restarted_nodes_new_life_in_full():
    # cumulative counter 100, 250, then killed and restarted: 30, 90
    assert window_bytes({1: 100, 2: 250, 4: 30, 5: 90}) == {1: 100, 2: 150, 4: 30, 5: 60}


def _audited_head():
    """A revision with sampled segment audits, and a head of window 4 carrying one validator's verdict on
    trainer ident(10)'s update of window 3."""
    import attrs

    from peerloom.core.objects import AuditFailure, UpdateAnnouncement, make_artifact_ref, seal
    from tests.helpers import ident, make_revision

    revision = make_revision(trainers=(ident(10),))
    manifest = attrs.evolve(revision.manifest, audit=True, audit_rate=0.5, inner_steps=8, audit_segments=4,
                            loss_check_samples=64)
    ref = make_artifact_ref(b"delta", 64 * 1024)
    update = seal(ident(10), UpdateAnnouncement(revision=revision.id, window=3, base=revision.genesis().id,
                                                shards=(0,), delta=ref, delta_digest=ref.digest, train_loss=0.5))
    verdict = seal(ident(1), AuditFailure(revision=revision.id, update=update))
    head = attrs.evolve(revision.genesis(), window=4, audits=((verdict,),))
    return manifest, head, update


def test_verification_settings_name_the_audit_mode():
    import attrs

    from peerloom.demo_report import verification_settings

    manifest, _, _ = _audited_head()
    assert verification_settings(manifest) == {"max_update_norm": 0.0, "norm_ratio": manifest.norm_ratio,
                                               "min_cosine": manifest.min_cosine, "loss_check_samples": 64,
                                               "audit": True,
                                               "audit_mode": "sampled-segments", "audit_rate": 0.5,
                                               "audit_segments": 4, "inner_steps": 8}
    whole = attrs.evolve(manifest, audit_segments=0)
    assert verification_settings(whole)["audit_mode"] == "sampled"
    inline = attrs.evolve(whole, audit_rate=0.0)
    assert verification_settings(inline)["audit_mode"] == "inline"
    off = attrs.evolve(inline, audit=False, loss_check_samples=0)
    assert verification_settings(off)["audit_mode"] == "off" and verification_settings(off)["loss_check_samples"] == 0


def test_report_names_the_trainer_a_head_carries_a_failed_audit_of(tmp_path):
    from types import SimpleNamespace

    from peerloom.demo_report import build_report, head_audits
    from tests.helpers import ident

    _, head, update = _audited_head()
    author = ident(10).peer_id.to_text()
    assert head_audits(head) == [{"author": author, "update": update.id.hex(), "update_window": 3, "verdicts": 1}]
    nodes = []
    for name, role, peer in (("validator-1", "validator", ident(1)), ("trainer-1", "trainer", ident(10)),
                             ("trainer-2", "trainer", ident(11))):
        directory = tmp_path / name
        directory.mkdir()
        nodes.append({"name": name, "role": role, "peer_id": peer.peer_id.to_text(), "behaviour": "honest",
                      "directory": directory})
    (tmp_path / "validator-1" / "events.jsonl").write_text("\n".join(json.dumps(e) for e in (
        {"t": 1.0, "event": "window-open", "window": 4},
        {"t": 1.5, "event": "reject", "peer": ident(11).peer_id.to_text(), "reason": "screen-loss"},
        {"t": 2.0, "event": "audit-failed", "window": 3, "author": author, "reason": "inconsistent", "segment": 1},
    )) + "\n")
    (tmp_path / "validator-1" / "stats.json").write_text(json.dumps(
        {"bytes_sent": 10, "counters": {"audits_started": 2, "audits_failed": 1, "audits_passed": 1, "other": 5}}))
    report = build_report(nodes=nodes, entries=[(head, SimpleNamespace(votes=()))], observer="validator-1")
    by_name = {n["name"]: n for n in report["per_node"]}
    assert by_name["trainer-1"]["failed_audits"] == 1 and by_name["trainer-1"]["failed_audit_windows"] == [4]
    assert by_name["trainer-1"]["caught_by"] == ["audit"]
    assert by_name["trainer-2"]["failed_audits"] == 0 and by_name["trainer-2"]["caught_by"] == ["loss-check"]
    assert report["audits"] == [{"window": 4, "author": "trainer-1", "update": update.id.hex(), "update_window": 3,
                                 "verdicts": 1, "peer_id": author, "reasons": ["inconsistent"]}]
    assert report["audit_counters"] == {"audits_failed": 1, "audits_passed": 1, "audits_started": 2}
    assert report["per_window"][0]["failed_audits"] == 1


def test_report_privacy_section_holds_the_budget_and_each_trainers_epsilon_from_the_last_head():
    """``report.json``'s ``privacy``: the manifest's DP-SGD parameters and budget and the last head's ledger,
    by node name (a peer that is no node keeps its peer id); ``private_data``: the private trainers; neither
    for a manifest without them."""
    import attrs

    from peerloom.core.objects import PrivacyParams
    from peerloom.demo_report import privacy_sections
    from tests.helpers import ident, make_revision

    revision = make_revision(trainers=(ident(10), ident(11)))
    params = PrivacyParams(noise_multiplier=1.1, max_grad_norm=0.5, delta=1e-5, sample_rate=0.05, epsilon_budget=8.0)
    manifest = attrs.evolve(revision.manifest, inner_steps=8, privacy=params, private_data=True)
    a, b, c = ident(10).peer_id, ident(11).peer_id, ident(12).peer_id
    ledger = tuple(sorted([(a, 40, 1.5), (b, 16, 0.75), (c, 8, 0.5)]))
    head = attrs.evolve(revision.genesis(), window=5, privacy=ledger, private=(b,))
    names = {a.to_text(): "trainer-1", b.to_text(): "trainer-2"}
    sections = privacy_sections(manifest, head, names)
    privacy = sections["privacy"]
    assert {k: v for k, v in privacy.items() if k != "trainers"} == {
        "epsilon_budget": 8.0, "delta": 1e-5, "noise_multiplier": 1.1, "max_grad_norm": 0.5, "sample_rate": 0.05,
        "window": 5}
    by_peer = {t["peer_id"]: t for t in privacy["trainers"]}
    assert by_peer[a.to_text()] == {"name": "trainer-1", "peer_id": a.to_text(), "steps": 40, "epsilon": 1.5,
                                    "private": False}
    assert by_peer[b.to_text()]["private"] is True and by_peer[b.to_text()]["epsilon"] == 0.75
    assert by_peer[c.to_text()]["name"] == c.to_text() and by_peer[c.to_text()]["steps"] == 8
    assert sections["private_data"] == {"window": 5, "private": ["trainer-2"]}
    json.dumps(sections)  # report.json holds it as is
    assert privacy_sections(revision.manifest, head, names) == {}
    assert set(privacy_sections(attrs.evolve(manifest, private_data=False), head, names)) == {"privacy"}
