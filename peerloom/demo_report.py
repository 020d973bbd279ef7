"""The demo's report: what happened in a fleet run, read back from the nodes' logs and the signed chain.

Everything here is derived after the run from artifacts anyone can inspect: each node's ``events.jsonl``
(one JSON object per engine log event, with a wall-clock ``t`` in seconds) and ``stats.json``, and the
certified heads in ``chain/``. The numbers that matter for trust (cohorts, quarantine, signers) come from
the chain, never from what a trainer says about itself.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from peerloom.core.objects import (
    PROTOCOL_VERSION,
    AuditFailure,
    Head,
    Manifest,
    QuorumCertificate,
    UpdateAnnouncement,
)

# How each strike reason (spec/protocol.md §6) names the check that caught the update.
CAUGHT_BY_REASON = {
    "screen-loss": "loss-check", "screen-norm-outlier": "screening", "screen-cosine": "screening",
    "screen-norm-bound": "screening", "screen-audit": "inline-audit", "screen-undecodable": "screening",
    "screen-schema": "screening", "screen-non-finite": "screening", "screen-digest-mismatch": "screening",
}

# A final accuracy this many points below the centralized baseline counts as degraded (spec/design.md §8).
DEGRADED_POINTS = 2.0


def read_events(path: Path) -> list[dict[str, Any]]:
    """All JSON lines of an event log; a torn last line (a SIGKILLed writer) is skipped, not fatal."""
    if not path.exists():
        return []
    events = []
    for line in path.read_bytes().splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            continue
    return events


def _window_of_time(opens: list[tuple[float, int]], t: float) -> int:
    """The window that was open at wall time `t`, from (time, window) pairs of window-open events."""
    current = 0
    for opened_at, window in opens:
        if opened_at > t:
            break
        current = window
    return current


def window_bytes(sent_at: dict[int, int]) -> dict[int, int]:
    """Bytes one node sent in each window, from its cumulative counter logged at each head (window ->
    bytes). A restarted process counts from zero again, so a drop starts a new life, all of it new."""
    out, previous = {}, 0
    for window in sorted(sent_at):
        sent = sent_at[window]
        out[window] = sent - previous if sent >= previous else sent
        previous = sent
    return out


def head_audits(head: Head) -> list[dict[str, Any]]:
    """The failed sampled audits a head carries (spec/protocol.md §6.2), one per quarantined author: the
    author (peer id text), the audited update (id hex) and its window, and how many validators' verdicts
    prove it. The head's certificate already vouches for them (`peerloom verify` checks them again)."""
    out = []
    for verdicts in head.audits:
        update = AuditFailure.from_cbor(verdicts[0].open(AuditFailure.KIND, PROTOCOL_VERSION)).update
        announcement = UpdateAnnouncement.from_cbor(update.open(UpdateAnnouncement.KIND, PROTOCOL_VERSION))
        out.append({"author": str(update.signer), "update": update.id.hex(), "update_window": announcement.window,
                    "verdicts": len(verdicts)})
    return out


def verification_settings(manifest: Manifest) -> dict[str, Any]:
    """How a revision verifies updates (spec/protocol.md §6-§6.3), for ``report.json``'s ``verification``:
    the screening thresholds (``max_update_norm``, 0 for none; cohort ``norm_ratio`` and ``min_cosine``),
    the loss check's sample count, and ``audit_mode``: ``off``, ``inline`` (every update replayed at
    screening), ``sampled`` (certified updates replayed whole after the fact, each with probability
    ``audit_rate``) or ``sampled-segments`` (the same, replaying one of ``audit_segments`` committed
    segments)."""
    if not manifest.audit:
        mode = "off"
    elif manifest.audit_rate <= 0:
        mode = "inline"
    else:
        mode = "sampled-segments" if manifest.audit_segments else "sampled"
    return {"max_update_norm": manifest.max_update_norm, "norm_ratio": manifest.norm_ratio,
            "min_cosine": manifest.min_cosine,
            "loss_check_samples": manifest.loss_check_samples, "audit": manifest.audit, "audit_mode": mode,
            "audit_rate": manifest.audit_rate, "audit_segments": manifest.audit_segments,
            "inner_steps": manifest.inner_steps}


def privacy_sections(manifest: Manifest, head: Head, names: dict[str, str]) -> dict[str, Any]:
    """``report.json``'s sections on private data and differential privacy (spec/protocol.md §10), from the
    manifest and the last head; `names` maps peer id text to node name. ``privacy`` (only under a manifest
    with `privacy`): the per-trainer ``epsilon_budget``, ``delta``, ``noise_multiplier`` (sigma),
    ``max_grad_norm`` (C), ``sample_rate`` (q), the head's ``window`` and ``trainers``: each ledger entry's
    ``name``, ``peer_id``, DP-SGD ``steps`` and ``epsilon`` (and ``private``). ``private_data`` (only under a
    manifest with `private_data`): ``private``, the names of the trainers the head lists as private."""
    sections: dict[str, Any] = {}
    private = {p.to_text() for p in head.private}
    if manifest.privacy is not None:
        p = manifest.privacy
        sections["privacy"] = {
            "epsilon_budget": p.epsilon_budget, "delta": p.delta, "noise_multiplier": p.noise_multiplier,
            "max_grad_norm": p.max_grad_norm, "sample_rate": p.sample_rate, "window": head.window,
            "trainers": [{"name": names.get(peer.to_text(), peer.to_text()), "peer_id": peer.to_text(),
                          "steps": steps, "epsilon": eps, "private": peer.to_text() in private}
                         for peer, steps, eps in head.privacy]}
    if manifest.private_data:
        sections["private_data"] = {"window": head.window, "private": sorted(names.get(p, p) for p in private)}
    return sections


def build_report(*, nodes: Sequence[dict[str, Any]], entries: Sequence[tuple[Head, QuorumCertificate]],
                 observer: str) -> dict[str, Any]:
    """The per-node and per-window parts of ``report.json``.

    `nodes` are dicts with ``name``, ``role``, ``peer_id`` (text), ``behaviour`` and ``directory`` (Path);
    `observer` names the validator whose logs stand for "the network's view" of rejections and head times.
    Returns the keys ``per_node``, ``per_window``, ``quarantine_over_time``, ``quarantined``,
    ``bytes_by_role``, ``double_votes`` (conflicting votes a validator logged), ``head_lag_s``, ``chain``,
    ``audits`` (every failed audit a head carries: the head's window, the author's name, the audited
    update's window, the verdicts and the reasons validators logged for their failed audit) and
    ``audit_counters`` (audits started, passed, failed, errored... summed over the validators' stats).

    Each node says how it was caught: ``rejected_by_reason`` (the observer's screening rejections, the loss
    check's ``screen-loss`` among them), ``failed_audits`` (how many heads carry a failed audit of one of
    its updates) with ``failed_audit_windows`` (those heads' windows), and ``caught_by`` (the checks that
    did: ``screening``, ``loss-check``, ``inline-audit``, ``audit``).
    """
    events = {n["name"]: read_events(n["directory"] / "events.jsonl") for n in nodes}
    stats = {}
    for n in nodes:
        path = n["directory"] / "stats.json"
        if path.exists():
            stats[n["name"]] = json.loads(path.read_text())
    by_peer = {n["peer_id"]: n["name"] for n in nodes}

    # Who announced which update: trainers log the envelope id of every announcement they send.
    author: dict[str, str] = {}
    for n in nodes:
        for e in events[n["name"]]:
            if e["event"] == "announce":
                author[e["update"]] = n["name"]

    # Accepted and rejected updates as the chain records them: cohorts, and the ids screening rejected.
    accepted: Counter[str] = Counter()
    accepted_windows: dict[str, list[int]] = defaultdict(list)
    rejected_in_chain: Counter[str] = Counter()
    for head, _ in entries:
        for update in head.cohort:
            accepted[author.get(update.hex(), "unknown")] += 1
            accepted_windows[author.get(update.hex(), "unknown")].append(head.window)
        for update in head.rejected:
            rejected_in_chain[author.get(update.hex(), "unknown")] += 1

    # Failed sampled audits, from the chain (the heads' `audits`); the reasons from the validators' logs.
    reasons: dict[tuple[str, int], set[str]] = defaultdict(set)
    for n in nodes:
        if n["role"] == "validator":
            for e in events[n["name"]]:
                if e["event"] == "audit-failed":
                    reasons[(e["author"], e["window"])].add(str(e["reason"]))
    audits = [{"window": head.window, **a, "author": by_peer.get(a["author"], a["author"]), "peer_id": a["author"],
               "reasons": sorted(reasons.get((a["author"], a["update_window"]), ()))}
              for head, _ in entries for a in head_audits(head)]
    failed_audit_windows: dict[str, list[int]] = defaultdict(list)
    for a in audits:
        failed_audit_windows[a["author"]].append(a["window"])
    audit_counters: Counter[str] = Counter()
    for n in nodes:
        if n["role"] == "validator":
            counters = stats.get(n["name"], {}).get("counters", {})
            audit_counters.update({k: int(v) for k, v in counters.items() if k.startswith("audits_")})

    observed = events.get(observer, [])
    opens = sorted((e["t"], e["window"]) for e in observed if e["event"] == "window-open")
    rejected: dict[str, Counter[str]] = defaultdict(Counter)
    rejected_per_window: Counter[int] = Counter()
    for e in observed:
        if e["event"] == "reject" and e.get("peer"):
            rejected[by_peer.get(e["peer"], e["peer"])][e["reason"]] += 1
            rejected_per_window[_window_of_time(opens, e["t"])] += 1

    # Head lag: how long after the observer promoted a head each trainer promoted the same head.
    head_times = {e["window"]: e["t"] for e in observed if e["event"] == "head"}
    head_lag: dict[str, dict[str, float]] = {}
    for n in nodes:
        if n["role"] != "trainer":
            continue
        lags = [e["t"] - head_times[e["window"]] for e in events[n["name"]]
                if e["event"] == "head" and e["window"] in head_times]
        if lags:
            head_lag[n["name"]] = {"median_s": round(statistics.median(lags), 3), "max_s": round(max(lags), 3),
                                   "heads": len(lags)}

    # Bytes per window: every node logs its cumulative bytes sent when it promotes a head.
    sent_at: dict[str, dict[int, int]] = {n["name"]: {} for n in nodes}
    for n in nodes:
        for e in events[n["name"]]:
            if e["event"] == "wire":
                sent_at[n["name"]][e["window"]] = e["sent"]
    bytes_per_window: Counter[int] = Counter()
    for node_sent in sent_at.values():
        bytes_per_window.update(window_bytes(node_sent))

    bytes_by_role: Counter[str] = Counter()
    for n in nodes:
        bytes_by_role[n["role"]] += int(stats.get(n["name"], {}).get("bytes_sent", 0))

    # A head's quarantine set is the peers barred from window + 1 (records expire at their release window).
    # No validator may sign two different values for one (window, round, step), across all its lives.
    double_votes = []
    for n in nodes:
        if n["role"] != "validator":
            continue
        cast: dict[tuple[int, int, str], Any] = {}
        for e in events[n["name"]]:
            if e["event"] != "vote":
                continue
            slot = (e["window"], e["round"], e["step"])
            if slot in cast and cast[slot] != e["head"]:
                double_votes.append({"validator": n["name"], "window": slot[0], "round": slot[1], "step": slot[2]})
            cast.setdefault(slot, e["head"])

    quarantine_over_time = [{"window": h.window, "quarantined": sorted(by_peer.get(str(p), str(p))
                                                                      for p in h.quarantined)}
                            for h, _ in entries]
    per_node: list[dict[str, Any]] = []
    for n in nodes:
        caught = {CAUGHT_BY_REASON[r] for r in rejected[n["name"]] if r in CAUGHT_BY_REASON}
        if failed_audit_windows.get(n["name"]):
            caught.add("audit")
        per_node.append({
            "name": n["name"], "role": n["role"], "peer_id": n["peer_id"], "behaviour": n["behaviour"],
            "accepted": accepted.get(n["name"], 0),
            "accepted_windows": sorted(set(accepted_windows.get(n["name"], []))),
            "rejected": max(rejected_in_chain.get(n["name"], 0), sum(rejected[n["name"]].values())),
            "rejected_in_chain": rejected_in_chain.get(n["name"], 0),
            "rejected_by_reason": dict(sorted(rejected[n["name"]].items())),
            "failed_audits": len(failed_audit_windows.get(n["name"], [])),
            "failed_audit_windows": sorted(failed_audit_windows.get(n["name"], [])),
            "caught_by": sorted(caught),
            "bytes_sent": int(stats.get(n["name"], {}).get("bytes_sent", 0)),
        })
    per_window = [{"window": h.window, "skipped": h.skipped, "accepted": len(h.cohort),
                   "rejected": max(len(h.rejected), rejected_per_window.get(h.window, 0)),
                   "failed_audits": len(h.audits),
                   "bytes": bytes_per_window.get(h.window, 0),
                   "roster": len(h.roster), **dict(h.metrics)}
                  for h, _ in entries]
    return {
        "per_node": per_node,
        "per_window": per_window,
        "quarantine_over_time": quarantine_over_time,
        "quarantined": sorted(str(p) for p in entries[-1][0].quarantined) if entries else [],
        "bytes_by_role": dict(sorted(bytes_by_role.items())),
        "double_votes": double_votes,
        "head_lag_s": head_lag,
        "chain": [{"window": h.window, "head": h.id.hex(), "skipped": h.skipped,
                   "signers": [str(p) for p, _ in c.votes]} for h, c in entries],
        "audits": audits,
        "audit_counters": dict(sorted(audit_counters.items())),
    }


def defence_verdict(*, rule: str, defended: bool, final: float, baseline: float,
                    higher_is_better: bool = True, max_gap_points: float = DEGRADED_POINTS) -> dict[str, Any]:
    """Did the run keep up with the centralized baseline? `final` and `baseline` are accuracies (or losses
    when `higher_is_better` is False); the gap is in percentage points for accuracy, in nats for loss.
    `defended` says whether outlier screening and a robust rule were on (the undefended baseline is the
    plain mean with screening off); more than `max_gap_points` behind counts as degraded."""
    gap = (baseline - final) * 100 if higher_is_better else final - baseline
    degraded: bool | None = gap > max_gap_points
    unit = "points" if higher_is_better else "nats"
    setting = f"rule {rule!r} with outlier screening" if defended else f"rule {rule!r}, outlier screening off"
    if not higher_is_better:
        # A loss gap between federated and centralized training at equal epochs says little about the
        # defences by itself: reported, not judged.
        degraded = None
        outcome = (f"{final / math.log(2):.3f} vs {baseline / math.log(2):.3f} bits per character "
                   "(federated vs centralized at equal epochs; reported, not judged)")
    elif not degraded:
        outcome = "within the bound"
    elif defended:
        outcome = "DEGRADED: the defences did not hold off the Byzantine trainers"
    else:
        outcome = "DEGRADED, as expected without defences: this is what the robust rule and screening prevent"
    text = f"{setting}: final {final:.4f} vs baseline {baseline:.4f}, {gap:+.2f} {unit} behind; {outcome}"
    return {"rule": rule, "defended": defended, "gap": round(gap, 4), "unit": unit, "degraded": degraded,
            "summary": text}


def plot_report(out: Path, report: dict[str, Any]) -> list[Path]:
    """Write ``plots/accuracy.png`` (or ``loss.png``), ``plots/updates.png`` and ``plots/bytes.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    plots = out / "plots"
    plots.mkdir(exist_ok=True)
    windows = report.get("per_window", [])
    written = []
    metric = "test_accuracy" if report.get("metric", "test_accuracy") == "test_accuracy" else "test_loss"
    shown = [w for w in windows if metric in w and not math.isnan(w[metric])]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    ax.plot([w["window"] for w in shown], [w[metric] for w in shown], marker="o",
            label=f"peerloom, rule {report.get('rule', '?')} (certified heads)")
    ax.axhline(report["baseline"][metric], color="grey", linestyle="--", label="centralized baseline")
    ax.set_xlabel("window")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel(metric.replace("_", " "))
    ax.set_title(f"{report.get('workload', '')}: {sum(1 for n in report['nodes'] if n['role'] == 'trainer')} "
                 "trainers")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right" if metric == "test_accuracy" else "upper right")
    fig.tight_layout()
    path = plots / ("accuracy.png" if metric == "test_accuracy" else "loss.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    written.append(path)

    xs = [w["window"] for w in windows]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    ax.bar(xs, [w["accepted"] for w in windows], color="tab:green", label="accepted (in the cohort)")
    ax.bar(xs, [w["rejected"] for w in windows], bottom=[w["accepted"] for w in windows], color="tab:red",
           label="rejected (screening, loss check)")
    if any(w.get("failed_audits") for w in windows):
        ax.bar(xs, [w.get("failed_audits", 0) for w in windows],
               bottom=[w["accepted"] + w["rejected"] for w in windows], color="tab:orange",
               label="failed audits the head carries")
    ax.set_xlabel("window")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("updates")
    ax.set_title("updates per window")
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(plots / "updates.png", dpi=100)
    plt.close(fig)
    written.append(plots / "updates.png")

    fig, ax = plt.subplots(figsize=(6.5, 4))
    ax.bar(xs, [w["bytes"] / 1e6 for w in windows], color="tab:blue")
    ax.set_xlabel("window")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("MB sent (all nodes)")
    ax.set_title("bytes on the wire per window")
    fig.tight_layout()
    fig.savefig(plots / "bytes.png", dpi=100)
    plt.close(fig)
    written.append(plots / "bytes.png")
    return written
