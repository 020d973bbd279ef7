"""`peerloom verify PATH`: check a chain from genesis against its signed manifest.

PATH is either

- a chain directory: ``manifest.cbor`` (the signed revision manifest) and one ``NNNNNN.cbor`` per window
  (a head with its quorum certificate), as the demo and `peerloom sim` write them; a node's own
  ``store/chain/`` works too (its manifest is the store's, one level up); or
- a node store: the directory holding ``node.db``, or a node directory with ``store/`` inside. The chain
  is every certified head in the store's database (`Database.heads`: promoted and archived), the
  manifest the store's ``manifest.cbor`` (`peerloom node` keeps it there). When the store has a
  ``chain/`` directory, it must hold exactly the same heads; or
- an experiment directory (`peerloom init`'s, with ``experiment.toml``): its first validator's node
  directory, ``nodes/validator-1``.

``manifest`` names the manifest file instead (for a store or directory without one). Checks, in order:
the manifest's signature (and its authority, when given); for every head, its certificate's signatures
and quorum against the manifest's validator set, its parent link and window number, with no window
missing from 1 to the last (`peerloom.core.chain.verify_chain`; a hole fails naming the missing window);
and the manifest's cohort and roster rules (`check_rules`). Prints what it checked; exit status 0 only if
everything verified.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

from peerloom.core.audit import AUDIT_WINDOWS, audit_selected, check_audit_evidence
from peerloom.core.chain import decode_chain_entry, verify_chain
from peerloom.core.envelope import SignedEnvelope
from peerloom.core.errors import DecodeError, PeerloomError, VerificationError
from peerloom.core.identity import PeerId
from peerloom.core.leases import demotable, lease_window, leases_of
from peerloom.core.objects import Head, QuorumCertificate, Revision, check_revocation


def check_rules(revision: Revision, entries: Sequence[tuple[Head, QuorumCertificate]]) -> list[str]:
    """The manifest's cohort and roster rules, head by head (spec/protocol.md).

    A certified (not skipped) head has at least ``min_updates`` distinct updates in its cohort; every
    roster is sorted, names each trainer once, with a capacity in 1..``max_capacity``; a trainer leaves
    the roster only by a signed leave, which the head records in ``left``, or by idle expiry (manifest
    ``idle_windows`` > 0), recorded in ``expired``: the roster shrinks by exactly the head's ``left`` and
    ``expired`` (disjoint peers of the previous roster, absent from the new one), and by the peers of the
    admission authority's revocations the head carries in ``revoked`` (each well signed, naming a peer of
    the previous roster and none of the new one; spec/auth.md §6), and by no other peer (quarantine, not
    removal, takes a misbehaving peer out of the leases); with ``idle_windows`` = 0 only
    unproven trainers expire. A head adds at most ``max_joins`` trainers, and lists every one of them in
    ``unproven``; a trainer turns unproven only by joining or, in a head that is not skipped, by holding a
    lease of its window (the authors of updates are not in the chain, so this is a bound: `demotable`,
    spec/protocol.md §4.1). Failed sampled audits a head carries must hold (`check_audits`). Raises
    VerificationError naming the window at the first failure.
    """
    m = revision.manifest
    previous = revision.genesis()
    by_window = {0: previous} | {head.window: head for head, _ in entries}
    audits = 0
    for head, _ in entries:
        where = f"window {head.window}"
        audits += check_audits(revision, head, previous, by_window)
        if not head.skipped and len(head.cohort) < m.min_updates:
            raise VerificationError("cohort-too-small", f"{where}: {len(head.cohort)} < {m.min_updates}")
        if len(set(head.cohort)) != len(head.cohort):
            raise VerificationError("cohort-duplicate", where)
        peers = [p for p, _ in head.roster]
        if len(set(peers)) != len(peers):
            raise VerificationError("roster-duplicate", where)
        if any(not 1 <= cap <= m.max_capacity for _, cap in head.roster):
            raise VerificationError("roster-capacity", where)
        before = {p for p, _ in previous.roster}
        dropped, added = before - set(peers), set(peers) - before
        revoked: set[PeerId] = set()
        for envelope in head.revoked:
            named = set(check_revocation(envelope, revision.id, m).peers)  # raises bad-revocation
            if not named & before or named & set(peers):
                raise VerificationError("bad-revocation", f"{where}: a revocation that removes no rostered peer")
            revoked |= named
        if m.idle_windows == 0 and not set(head.expired) <= set(previous.unproven):
            raise VerificationError("expired-disabled", f"{where}: idle expiry is off in this manifest, and "
                                                        "only unproven trainers may be dropped (§4.1)")
        if m.max_joins and len(added) > m.max_joins:
            raise VerificationError("too-many-joins", f"{where}: {len(added)} joins > max_joins {m.max_joins}")
        unproven = set(head.unproven)
        # the window's leases come from its lease head: the parent, or older with overlap (spec/protocol.md §5.2)
        lease_head = by_window.get(lease_window(head.window, m))
        leases = {} if lease_head is None else leases_of(lease_head, m, head.window)
        may = set(previous.unproven) | added | demotable(leases, head.skipped)
        if not added <= unproven or not unproven <= set(peers) or not unproven <= may:
            raise VerificationError("unproven-mismatch", f"{where}: unproven must hold every joiner, and only "
                                                         "rostered trainers that joined or held a lease since "
                                                         "they were proven")
        if set(head.left) & set(head.expired) or \
                not set(head.left) | set(head.expired) <= dropped <= set(head.left) | set(head.expired) | revoked:
            raise VerificationError("roster-shrunk", f"{where}: {len(dropped)} trainer(s) dropped, "
                                                     f"{len(head.left)} left, {len(head.expired)} expired")
        check_private(revision, head, previous)
        check_ledger(revision, head, previous)
        previous = head
    ledger = f" and the privacy ledger of {len(previous.privacy)} trainer(s) (epsilon recomputed, budget " \
             f"{m.privacy.epsilon_budget:g} at delta {m.privacy.delta:g})" if m.privacy is not None else ""
    return [f"cohort and roster rules hold for {len(entries)} heads (cohort >= {m.min_updates}, "
            f"capacity <= {m.max_capacity}, roster shrinks only by signed leaves, expiry and revocations, "
            f"joins bounded and unproven){ledger}"] + \
        ([f"{audits} failed sampled audit(s): verdicts signed, updates certified and selected, authors "
          f"quarantined"] if audits else [])


def check_private(revision: Revision, head: Head, previous: Head) -> None:
    """The head's `private` list (spec/protocol.md §10): rostered peers only, none unless the manifest
    admits private data, and a trainer that stays in the roster keeps its flag. Raises VerificationError
    (``private-mismatch``)."""
    private, before = set(head.private), previous.roster_peers
    if not private <= head.roster_peers or (private and not revision.manifest.private_data) or \
            any((p in private) != (p in previous.private_peers) for p in head.roster_peers & before):
        raise VerificationError("private-mismatch", f"window {head.window}: private lists peers outside the "
                                                    "roster, without private_data, or changes a member's flag")


def check_ledger(revision: Revision, head: Head, previous: Head,
                 accountant: Callable[[float, float, int, float], float] | None = None) -> None:
    """The head's privacy ledger (spec/protocol.md §10), recomputed from the previous head's: under a
    manifest without `privacy` it is empty; else no entry goes away or shrinks, every cohort update spent
    the manifest's `inner_steps` H (the chain names cohort updates, not their authors, so: the entries' steps
    grow by H per cohort update in all, each by a multiple of H, only for trainers of the previous roster),
    every epsilon is the accountant's for its steps (`peerloom.privacy.accountant`, Opacus's RDP accountant)
    and none is over the budget. Raises VerificationError (``privacy-mismatch``, ``privacy-budget``)."""
    m, where = revision.manifest, f"window {head.window}"
    params = m.privacy
    if params is None:
        if head.privacy:
            raise VerificationError("privacy-mismatch", f"{where}: a privacy ledger in a revision without privacy")
        return
    from peerloom.core.privacy import ledger_epsilon

    if accountant is None:
        from peerloom.privacy import PrivacyUnavailable, privacy_accountant

        try:
            accountant = privacy_accountant(m)
        except PrivacyUnavailable as exc:  # the chain cannot be checked here, which is not a verdict on it
            raise VerificationError("privacy-unavailable", str(exc)) from None
        assert accountant is not None
    before = {p: steps for p, steps, _ in previous.privacy}
    grown = 0
    for peer, steps, epsilon in head.privacy:
        spent = steps - before.pop(peer, 0)
        if spent < 0 or spent % m.inner_steps or (spent and peer not in previous.roster_peers):
            raise VerificationError("privacy-mismatch", f"{where}: {peer} spent {spent} steps, not a multiple "
                                                        f"of inner_steps {m.inner_steps} as a rostered trainer")
        grown += spent
        if spent and epsilon != ledger_epsilon(accountant, params, steps):
            raise VerificationError("privacy-mismatch", f"{where}: {peer}'s epsilon {epsilon} is not the "
                                                        f"accountant's {ledger_epsilon(accountant, params, steps)} "
                                                        f"for {steps} steps")
        if epsilon > params.epsilon_budget:
            raise VerificationError("privacy-budget", f"{where}: {peer}'s epsilon {epsilon} is over the budget "
                                                      f"{params.epsilon_budget}")
    if before or grown != m.inner_steps * len(head.cohort):
        raise VerificationError("privacy-mismatch", f"{where}: the ledger grew by {grown} steps for "
                                                    f"{len(head.cohort)} cohort updates of {m.inner_steps}, or "
                                                    "lost an entry")


def check_audits(revision: Revision, head: Head, previous: Head, by_window: dict[int, Head]) -> int:
    """Check the failed sampled audits `head` carries (spec/protocol.md §6.2); returns how many.

    Each entry's verdicts prove a failed audit (`check_audit_evidence`: enough distinct validators, one
    update); the update's window is within `AUDIT_WINDOWS` before `head`'s; it was trained on a base
    its window allows (the parent of its certified head, or with `overlap` k up to k heads before it,
    spec/protocol.md §5.2) and `audit_selected` picked it with that head's id and
    the manifest's `audit_rate` (it may be outside the cohort: an update the loss check rejected is
    audited too, and the chain does not record those); its author was not quarantined by `previous` and
    is quarantined by `head` for `quarantine_windows` windows; entries are sorted by update id, one per author. Raises
    VerificationError (``bad-audit``)."""
    m, where = revision.manifest, f"window {head.window}"
    if head.audits and not (m.audit and m.audit_rate > 0):
        raise VerificationError("bad-audit", f"{where}: audits in a revision without sampled audits")
    ids, authors = [], set()
    release = dict(head.quarantine)
    for verdicts in head.audits:
        try:
            update, ann = check_audit_evidence(verdicts, revision.id, m)
        except (DecodeError, VerificationError) as exc:
            raise VerificationError("bad-audit", f"{where}: {exc.reason} {exc.detail}".rstrip()) from exc
        certified = by_window.get(ann.window)
        stale = range(max(0, ann.window - 1 - m.overlap), ann.window - 1)  # overlap k: k heads before the parent
        bases = {certified.parent} if certified is not None else set()
        bases |= {by_window[w].id if w else revision.genesis().id for w in stale if w in by_window or not w}
        parent = by_window.get(ann.window - 1)
        grandparent = revision.genesis() if ann.window == 2 else by_window.get(ann.window - 2)
        prior_ok = ann.prior is None or (parent is not None and grandparent is not None
                                         and ann.prior in parent.cohort and ann.base == grandparent.id)
        if not head.window - AUDIT_WINDOWS <= ann.window < head.window or certified is None or not prior_ok or \
                ann.base not in bases or not audit_selected(certified.id, update.id, m.audit_rate):
            raise VerificationError("bad-audit", f"{where}: update of window {ann.window} was not trained on "
                                                 "a base its window allows and selected for audit")
        if update.signer in (parent or revision.genesis()).private_peers:
            raise VerificationError("bad-audit", f"{where}: {update.signer} trains on private data: no audit")
        if update.signer in previous.quarantined or update.signer in authors or \
                release.get(update.signer, 0) < head.window + 1 + m.quarantine_windows:
            raise VerificationError("bad-audit", f"{where}: {update.signer} must be quarantined once, by this head")
        ids.append(update.id)
        authors.add(update.signer)
    if ids != sorted(ids):
        raise VerificationError("bad-audit", f"{where}: audits must be sorted by update id")
    return len(ids)


def _chain_dir_entries(chain_dir: Path) -> list[tuple[int, bytes]]:
    return [(int(path.stem), path.read_bytes()) for path in sorted(chain_dir.glob("[0-9]*.cbor"))]


def _store_entries(store: Path) -> list[tuple[int, bytes]]:
    """(window, chain entry) of every certified head in the store's database, in window order."""
    from peerloom.adapters.database import DB_NAME, Database

    db = Database(store / DB_NAME)
    try:
        return [(window, entry) for window, _, entry in reversed(db.heads()) if window > 0]
    finally:
        db.close()


def _locate(path: Path, manifest: Path | None) -> tuple[Path, list[tuple[int, bytes]], list[str]]:
    """(manifest file, (window, entry) in window order, lines saying what was read) for PATH (see the module
    docstring). FileNotFoundError when PATH is neither form, or no manifest is found."""
    from peerloom.adapters.database import DB_NAME
    from peerloom.experiment import chain_node_dir
    from peerloom.inspect import find_store

    node = chain_node_dir(path)
    if node is not None:  # an experiment directory: its first validator holds the chain
        manifest_path, entries, lines = _locate(node, manifest)
        return manifest_path, entries, [f"experiment {path}: the chain of its first validator, {node}", *lines]
    if (path / DB_NAME).exists() or (path / "store" / DB_NAME).exists():
        store = find_store(path)
        manifest = manifest or store / "manifest.cbor"
        if not manifest.is_file():
            raise FileNotFoundError(errno.ENOENT, "node store without manifest.cbor (pass --manifest FILE)",
                                    str(manifest))
        entries = _store_entries(store)
        lines = [f"node store {store}: {len(entries)} certified heads in {DB_NAME}"]
        chain_dir = store / "chain"
        if chain_dir.is_dir():
            files = dict(_chain_dir_entries(chain_dir))
            files.pop(0, None)
            held = dict(entries)
            lacking = sorted(set(held) - set(files))
            if lacking:
                raise VerificationError("chain-dir", f"{chain_dir} lacks window(s) {_windows(lacking)} of the "
                                                     "store's database")
            extra = sorted(set(files) - set(held))
            if extra:
                raise VerificationError("chain-dir", f"{chain_dir} holds window(s) {_windows(extra)} that the "
                                                     "store's database does not")
            differ = sorted(w for w in held if files[w] != held[w])
            if differ:
                raise VerificationError("chain-dir", f"{chain_dir}: window(s) {_windows(differ)} differ from "
                                                     "the store's database")
            lines.append(f"chain directory {chain_dir}: the same {len(files)} heads")
        return manifest, entries, lines
    if manifest is None:
        manifest = path / "manifest.cbor"
        if not manifest.is_file() and (path.parent / "manifest.cbor").is_file() and path.name == "chain":
            manifest = path.parent / "manifest.cbor"  # a node's store/chain/: the store keeps the manifest
        if not manifest.is_file():
            raise FileNotFoundError(errno.ENOENT, f"not a chain directory (no manifest.cbor) nor a node store "
                                                  f"(no {DB_NAME})", str(path))
    return manifest, _chain_dir_entries(path), []


def _windows(windows: Sequence[int]) -> str:
    """``3``, ``3, 7`` or ``3-5, 9``: windows in order, runs shortened."""
    runs: list[list[int]] = []
    for w in windows:
        if runs and w == runs[-1][1] + 1:
            runs[-1][1] = w
        else:
            runs.append([w, w])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def verified_chain(path: Path, authority: str | None = None, *, manifest: Path | None = None,
                   checked: list[str] | None = None) -> tuple[Revision, list[tuple[Head, QuorumCertificate]]]:
    """The revision and certified heads (window 1 on, in order) of the chain at `path`, a chain directory or
    a node store (module docstring), after every check `peerloom verify` makes (spec/protocol.md §3).

    `manifest` names the manifest file instead of the one `path` holds; `authority` (a peer id's text) must
    have signed it. `checked`, when given, collects a line per check as it passes, so that a caller can show
    how far verification got before a failure. Raises FileNotFoundError when `path` is neither form or no
    manifest is found; `PeerloomError` (VerificationError, DecodeError) at the first check that fails;
    OSError for an unreadable file. An empty chain (no certified head yet) is returned, not refused.
    """
    checked = [] if checked is None else checked
    manifest_path, raw, lines = _locate(path, manifest)
    checked += lines
    envelope = SignedEnvelope.from_bytes(manifest_path.read_bytes())
    revision = Revision.verify(envelope, PeerId.from_text(authority) if authority else None)
    entries = []
    for window, data in raw:
        try:
            entries.append(decode_chain_entry(data))
        except PeerloomError as exc:
            raise PeerloomError(f"{window:06d}.cbor: {exc}") from exc
    checked += verify_chain(revision, entries)
    checked += check_rules(revision, entries)
    return revision, entries


class VerifiedChain(NamedTuple):
    """What `verify` returns: the chain at a path, every check passed. Unpacks as ``revision, entries, checked``.

    `revision` is the signed manifest's `Revision`; `entries` the certified heads from window 1 on, in order,
    each with its `QuorumCertificate`; `checked` one line per check that passed, as `peerloom verify` prints.
    """

    revision: Revision
    entries: list[tuple[Head, QuorumCertificate]]
    checked: list[str]

    @property
    def head(self) -> Head:
        """The latest certified head (the genesis head while the chain is empty)."""
        return self.entries[-1][0] if self.entries else self.revision.genesis()


def verify(path: str | os.PathLike[str], *, authority: str | None = None,
           manifest: str | os.PathLike[str] | None = None) -> VerifiedChain:
    """Verify the chain at `path` from genesis, as `peerloom verify PATH` does, and return it (`peerloom.verify`).

    `path` is a chain directory, a node store, a node directory or an experiment directory (module docstring);
    `manifest` names the manifest file instead of the one `path` holds; `authority` (a peer id's text), when
    given, must have signed it. Checks the manifest's signature, every head's certificate against the
    manifest's validator set, parents and window numbers with no window missing (spec/protocol.md §3), and the
    cohort, roster, audit and privacy rules (`check_rules`). Raises FileNotFoundError when `path` holds no
    chain or no manifest is found, `peerloom.PeerloomError` (VerificationError, DecodeError) at the first check
    that fails, OSError for an unreadable file. An empty chain (no certified head yet) is returned, not refused.
    """
    checked: list[str] = []
    revision, entries = verified_chain(Path(path), authority, manifest=None if manifest is None else Path(manifest),
                                       checked=checked)
    return VerifiedChain(revision, entries, checked)


def run_verify(path: Path, authority: str | None = None, *, echo: Callable[[str], None] = print,
               brief: bool = False, manifest: Path | None = None) -> int:
    """Verify the chain at `path`, a chain directory or a node store (module docstring), against
    `manifest` (default: the one `path` holds); print (via `echo`) each check (`brief`: first and last few
    windows only); return 0 if all passed, 1 otherwise. FileNotFoundError when `path` is neither a chain
    directory nor a node store, or holds no manifest and none is given."""
    checked: list[str] = []
    try:
        _, entries = verified_chain(path, authority, manifest=manifest, checked=checked)
    except FileNotFoundError:
        raise
    except (OSError, PeerloomError) as exc:
        for line in checked[:1]:
            echo(line)
        echo(f"FAILED: {exc}")
        return 1
    shown = checked if not brief or len(checked) <= 8 else [*checked[:3], f"... {len(checked) - 6} more windows ...",
                                               *checked[-3:]]
    for line in shown:
        echo(line)
    if not entries:
        echo("FAILED: no certified heads in the chain")
        return 1
    echo(f"OK: {len(entries)} certified heads verified from genesis")
    return 0
