"""The demo report's verdicts and log reading (peerloom/demo_report.py); the whole report is checked end to
end in test_demo_e2e.py."""

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
