"""`peerloom export PATH --out model.safetensors` and `peerloom.load_head`: a certified head's weights.

PATH is what `peerloom verify` reads (peerloom/verify.py): a node store (``node.db`` and ``artifacts/``), a
node directory with ``store/`` inside, a node's ``store/chain/``, or an experiment directory (`peerloom
init`'s: its first validator's node directory is read). Export first verifies the whole chain
from genesis with every check `peerloom verify` makes (spec/protocol.md §3), then reads the chosen head's
``params`` artifact from the store (`adapters/storage.py`), checks its bytes against the artifact's content
id and its tensors against the head's certified ``params_digest`` (the tensor digest, spec/protocol.md §2),
and only then writes the file, atomically (temporary file, fsync, rename): a chain or store that fails any
check leaves no file behind. A bare chain directory (``manifest.cbor`` + ``NNNNNN.cbor``, as `peerloom sim`
and `peerloom demo` write them) holds heads but no weights; export refuses it and names a node directory
beside it that has them, when there is one.

The file is plain safetensors: the head's tensors under the workload's names (for the torch workloads, the
floating-point entries of the model's ``state_dict``: ``0.weight``, ``0.bias``, ...) and this metadata, all
strings:

    peerloom.head            the head id in hex (the 34-byte multihash, as report.json and the HTTP edge print it)
    peerloom.window          the head's window, decimal
    peerloom.revision        the revision id (the manifest envelope's id) in hex
    peerloom.experiment      the manifest's experiment name
    peerloom.workload        the manifest's workload (registry name or ``module:function``)
    peerloom.tensor_digest   the head's params_digest in hex: the tensor digest of the tensors in the file

`peerloom export` exits 0 once the file is written, 1 when the chain or the weights fail verification (the
failure is named; nothing is written) and 2 for a user error (a path that is neither form, a bare chain
directory, an unknown ``--head``), in one line.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from peerloom.core.errors import PeerloomError, VerificationError

if TYPE_CHECKING:
    import numpy as np

    from peerloom.core.objects import Head, QuorumCertificate, Revision

META_HEAD = "peerloom.head"
META_WINDOW = "peerloom.window"
META_REVISION = "peerloom.revision"
META_EXPERIMENT = "peerloom.experiment"
META_WORKLOAD = "peerloom.workload"
META_TENSOR_DIGEST = "peerloom.tensor_digest"
METADATA_KEYS = (META_HEAD, META_WINDOW, META_REVISION, META_EXPERIMENT, META_WORKLOAD, META_TENSOR_DIGEST)

# A local file or the store's own certified artifact is not a peer's upload: allow more tensors than the
# wire limit (`from_safetensors` still bounds the header at 16 MiB).
_MAX_LOCAL_TENSORS = 1 << 16


class ExportError(PeerloomError):
    """A path, head or file that cannot be exported or loaded (a user error: one line, exit status 2)."""


class ParamsMismatchError(PeerloomError, ValueError):
    """Params that do not fit a module (``load_state_dict(strict=True)`` semantics): `missing` keys the
    module has and the params lack, `unexpected` keys the params have and the module lacks, and `mismatched`
    ``(key, what the params hold, what the module holds)`` for keys whose shape or dtype differ."""

    def __init__(self, missing: Sequence[str], unexpected: Sequence[str],
                 mismatched: Sequence[tuple[str, str, str]]) -> None:
        self.missing, self.unexpected, self.mismatched = tuple(missing), tuple(unexpected), tuple(mismatched)
        parts = []
        if self.missing:
            parts.append(f"missing keys (in the module, not in the params): {', '.join(self.missing)}")
        if self.unexpected:
            parts.append(f"unexpected keys (in the params, not in the module): {', '.join(self.unexpected)}")
        parts += [f"{key}: params hold {held}, the module has {wanted}" for key, held, wanted in self.mismatched]
        super().__init__("params do not fit the module: " + "; ".join(parts))


# --- choosing a head and finding its weights ---------------------------------------------------------------


def _select(revision: Revision, entries: Sequence[tuple[Head, QuorumCertificate]], head: int | str | None) -> Head:
    """The head `head` names among genesis and the verified `entries` (windows 1..n): None for the latest
    certified head, a window number (int or decimal text), or a head id in hex (the full id, or a prefix of
    16+ hex digits with or without the ``1220`` multihash prefix, as `verify` and `inspect` print it)."""
    heads = [revision.genesis(), *(h for h, _ in entries)]  # verify_chain made heads[w].window == w
    if head is None:
        if not entries:
            raise ExportError("the chain has no certified head yet (--head 0 selects the genesis params)")
        return heads[-1]
    text = str(head).strip().lower()
    if isinstance(head, int) or (text.isdigit() and len(text) < 16):
        window = int(text)
        if not 0 <= window < len(heads):
            raise ExportError(f"no window {window} in the chain: it holds windows 0-{len(heads) - 1}")
        return heads[window]
    text = text.removeprefix("0x")
    if len(text) < 16 or any(c not in "0123456789abcdef" for c in text):
        raise ExportError(f"head {head!r}: give a window number or a head id in hex (16 or more digits)")
    found = [h for h in heads if h.id.hex().startswith(text) or h.id[2:].hex().startswith(text)]
    if not found:
        raise ExportError(f"no head {text} in the chain (windows 0-{len(heads) - 1})")
    if len(found) > 1:
        raise ExportError(f"head {text} is ambiguous: windows {', '.join(str(h.window) for h in found)}")
    return found[0]


def _store_of(path: Path) -> Path | None:
    """The node store holding the artifacts of the chain at `path` (module docstring), or None for a bare
    chain directory."""
    from peerloom.adapters.database import DB_NAME

    for candidate in (path, path / "store"):
        if (candidate / DB_NAME).is_file():
            return candidate
    if path.name == "chain" and (path.parent / DB_NAME).is_file():
        return path.parent  # a node's store/chain/
    return None


def _node_with_weights(path: Path) -> Path | None:
    """A node directory near the chain directory `path` whose store holds artifacts (a validator's first):
    the demo's ``DIR/chain`` sits beside ``DIR/nodes/``, an experiment directory holds ``nodes/`` itself."""
    from peerloom.adapters.database import DB_NAME

    for nodes in (path / "nodes", path.parent / "nodes"):
        if nodes.is_dir():
            found = [d for d in nodes.iterdir()
                     if (d / "store" / DB_NAME).is_file() and (d / "store" / "artifacts").is_dir()]
            found.sort(key=lambda d: ("validator" not in d.name, d.name))
            if found:
                return found[0]
    return None


def _no_weights(path: Path) -> ExportError:
    near = _node_with_weights(path)
    where = (f"a node directory such as {near}" if near is not None else
             "a node directory (with store/node.db and store/artifacts/), a validator's for instance")
    return ExportError(f"{path} is a chain directory: it holds certified heads but no weights; "
                       f"export from {where}")


def _params_of(store: Path, revision: Revision, head: Head) -> dict[str, np.ndarray]:
    """The head's params from the store's artifacts, checked against the artifact's content id and the head's
    params_digest. ExportError if the store lacks them; VerificationError if they do not match."""
    from peerloom.adapters.storage import read_artifact
    from peerloom.backends.numpy.tensors import from_safetensors, tensor_digest

    try:
        data = read_artifact(store, head.params.digest)
    except FileNotFoundError:
        raise ExportError(f"{store} does not hold the params of window {head.window} (artifact "
                          f"{head.params.digest.hex()}); try another node's store, a validator's for instance"
                          ) from None
    tensors = from_safetensors(data, max_tensors=max(_MAX_LOCAL_TENSORS, len(revision.manifest.schema)))
    digest = tensor_digest(tensors)
    if digest != head.params_digest:
        raise VerificationError("params-digest", f"window {head.window}: the params artifact's tensor digest "
                                f"{digest.hex()} is not the head's params_digest {head.params_digest.hex()}")
    return tensors


def _certified(path: Path, *, head: int | str | None, manifest: Path | None, authority: str | None,
               ) -> tuple[Revision, Head, dict[str, np.ndarray], int]:
    """(revision, chosen head, its verified params, certified heads verified) for a store or chain path."""
    from peerloom.adapters.database import DB_NAME
    from peerloom.experiment import chain_node_dir
    from peerloom.verify import verified_chain

    if not path.exists():
        raise FileNotFoundError(errno.ENOENT, "no such file or directory", str(path))
    if path.name == DB_NAME and path.is_file():
        path = path.parent
    path = chain_node_dir(path) or path  # an experiment directory: its first validator's store
    store = _store_of(path)
    if store is None and (path / "manifest.cbor").is_file():
        raise _no_weights(path)
    revision, entries = verified_chain(path, authority, manifest=manifest)  # FileNotFoundError if neither form
    if store is None:
        raise _no_weights(path)
    chosen = _select(revision, entries, head)
    return revision, chosen, _params_of(store, revision, chosen), len(entries)


def _metadata(revision: Revision, head: Head) -> dict[str, str]:
    return {META_HEAD: head.id.hex(), META_WINDOW: str(head.window), META_REVISION: revision.id.hex(),
            META_EXPERIMENT: revision.manifest.experiment, META_WORKLOAD: revision.manifest.workload,
            META_TENSOR_DIGEST: head.params_digest.hex()}


# --- export --------------------------------------------------------------------------------------------------


def export_head(path: str | os.PathLike[str], out: str | os.PathLike[str], *, head: int | str | None = None,
                manifest: str | os.PathLike[str] | None = None, authority: str | None = None) -> dict[str, str]:
    """Verify the chain at `path` and write the chosen head's params to `out` as safetensors (module
    docstring); returns the metadata written (``peerloom.*`` keys, string values).

    `head`: None for the latest certified head, a window number (0 is genesis), or a head id in hex (full,
    or a prefix of 16+ digits). `manifest` names the signed manifest for a store without one; `authority`
    (peer id text) must have signed it. Tensors keep the dtypes and shapes of the manifest's schema
    (float32 for the shipped workloads). Nothing is written unless every check passes.

    Raises FileNotFoundError (`path` is neither a store nor a chain directory, or no manifest, or `out`'s
    directory is missing), IsADirectoryError (`out` is a directory), ExportError (a bare chain directory,
    an unknown head, a store without that head's params), VerificationError / DecodeError / PeerloomError
    (the chain, the artifact or its tensor digest fails verification, spec/protocol.md §2-3).
    """
    return _export(Path(path), Path(out), head=head, authority=authority,
                   manifest=None if manifest is None else Path(manifest))[0]


def _export(path: Path, out: Path, *, head: int | str | None, manifest: Path | None, authority: str | None,
            ) -> tuple[dict[str, str], int, int]:
    """(metadata written, certified heads verified, tensors written)."""
    import safetensors.numpy

    from peerloom.adapters.storage import atomic_write

    if out.is_dir():
        raise IsADirectoryError(errno.EISDIR, "is a directory; --out names the file to write", str(out))
    if not out.parent.is_dir():
        raise FileNotFoundError(errno.ENOENT, "no such directory for --out", str(out.parent))
    revision, chosen, tensors, verified = _certified(path, head=head, manifest=manifest, authority=authority)
    metadata = _metadata(revision, chosen)
    atomic_write(out, safetensors.numpy.save(tensors, metadata=metadata))
    return metadata, verified, len(tensors)


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "export", help="verify a chain, then write a certified head's weights as a safetensors file")
    parser.add_argument("path", type=Path, metavar="STORE_OR_CHAIN",
                        help="an experiment directory (its first validator's store is read), a node directory "
                             "or store (node.db + artifacts/), or a node's store/chain/")
    parser.add_argument("--head", default=None, metavar="ID",
                        help="a window number or a head id in hex (default: the latest certified head)")
    parser.add_argument("--manifest", type=Path, default=None, metavar="FILE",
                        help="the signed manifest, for a store that holds no manifest.cbor")
    parser.add_argument("--authority", default=None, metavar="PEERID",
                        help="peer id that must have signed the manifest")
    parser.add_argument("--out", type=Path, required=True, metavar="FILE", help="the .safetensors file to write")


def run(args: argparse.Namespace) -> int:
    """`peerloom export`: 0 written, 1 verification failed (nothing written); user errors raise (exit 2)."""
    try:
        metadata, verified, count = _export(args.path, args.out, head=args.head, manifest=args.manifest,
                                            authority=args.authority)
    except ExportError:
        raise
    except PeerloomError as exc:
        print(f"peerloom export: FAILED: {exc} (nothing written)", file=sys.stderr)
        return 1
    print(f"verified {verified} certified heads from genesis; wrote window {metadata[META_WINDOW]} (head "
          f"{metadata[META_HEAD]}, {count} tensors) to {args.out}")
    return 0


# --- load ----------------------------------------------------------------------------------------------------


def _file_metadata(data: bytes) -> dict[str, str]:
    """The ``__metadata__`` of safetensors bytes that `from_safetensors` has already accepted."""
    header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
    metadata = header.get("__metadata__") or {}
    return {str(k): str(v) for k, v in metadata.items()}


def _load_file(path: Path, *, head: int | str | None, manifest: Path | None,
               authority: str | None) -> dict[str, np.ndarray]:
    from peerloom.backends.numpy.tensors import from_safetensors, tensor_digest
    from peerloom.core.envelope import SignedEnvelope
    from peerloom.core.identity import PeerId
    from peerloom.core.objects import Revision

    data = path.read_bytes()
    try:
        tensors = from_safetensors(data, max_tensors=_MAX_LOCAL_TENSORS)
    except PeerloomError as exc:
        raise ExportError(f"{path}: not a safetensors file ({exc})") from exc
    metadata = _file_metadata(data)
    lacking = [key for key in METADATA_KEYS if key not in metadata]
    if lacking:
        raise ExportError(f"{path}: not a peerloom export (its metadata lacks {', '.join(lacking)})")
    if tensor_digest(tensors).hex() != metadata[META_TENSOR_DIGEST]:
        raise VerificationError("tensor-digest", f"{path}: the tensors do not match the {META_TENSOR_DIGEST} "
                                                 "in its metadata")
    if head is not None:
        text = str(head).strip().lower().removeprefix("0x")
        held = metadata[META_HEAD]
        if not (text == metadata[META_WINDOW] or (len(text) >= 16 and (held.startswith(text) or
                                                                        held[4:].startswith(text)))):
            raise ExportError(f"{path} holds window {metadata[META_WINDOW]} (head {held}), not {head}")
    if manifest is not None:
        revision = Revision.verify(SignedEnvelope.from_bytes(Path(manifest).read_bytes()),
                                   PeerId.from_text(authority) if authority else None)
        if revision.id.hex() != metadata[META_REVISION]:
            raise VerificationError("revision-mismatch", f"{path} is from revision {metadata[META_REVISION]}, "
                                                         f"{manifest} signs revision {revision.id.hex()}")
    return tensors


def _load_into(module: Any, params: dict[str, np.ndarray]) -> Any:
    """Copy `params` into `module`'s floating-point state (its params, as the torch workload defines them)."""
    import numpy as np
    import torch

    state = module.state_dict()
    expected = {name: t for name, t in state.items() if t.is_floating_point()}
    tensors = {name: torch.from_numpy(np.array(array)) for name, array in params.items()}
    mismatched = []
    for name in sorted(set(expected) & set(tensors)):
        have, want = tensors[name], expected[name]
        if have.shape != want.shape or have.dtype != want.dtype:
            mismatched.append((name, f"{have.dtype} {list(have.shape)}", f"{want.dtype} {list(want.shape)}"))
    missing, unexpected = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing or unexpected or mismatched:
        raise ParamsMismatchError(missing, unexpected, mismatched)
    module.load_state_dict({**state, **tensors}, strict=True)  # copies into the module's own tensors
    return module


def load_head(path_or_store: str | os.PathLike[str], module: Any = None, *, head: int | str | None = None,
              manifest: str | os.PathLike[str] | None = None, authority: str | None = None) -> Any:
    """A certified head's params, verified: as ``{name: numpy array}``, or loaded into a torch `module`.

    `path_or_store` is a file `peerloom export` wrote, or what `peerloom verify` reads (an experiment
    directory, whose first validator's store is read; a node directory or store; a node's store/chain/).
    For a file, its ``peerloom.*`` metadata must be present and its
    ``peerloom.tensor_digest`` must match the tensors; `head` (if given) must be the file's window or head
    id, and `manifest` (if given, signed by `authority` if given) must be the revision the file names. For a
    store, the whole chain is verified from genesis against its manifest (or `manifest`) first, then the
    chosen head's params against the head's certified params_digest (spec/protocol.md §2-3); `head` is a
    window number or a head id in hex, default the latest certified head.

    Returns a dict of writable numpy arrays keyed by the workload's tensor names, with the manifest
    schema's dtypes and shapes (float32 for the shipped workloads). With `module` (a ``torch.nn.Module``)
    the arrays are copied into it and the module is returned: its floating-point ``state_dict`` entries
    (the params of `backends/torch/workload.py`: ``0.weight``, ``0.bias``, ... for the digits MLP) must
    match them exactly, names, shapes and dtypes, as ``load_state_dict(strict=True)`` would require; integer
    buffers are left alone. Works on any device the module lives on.

    Raises FileNotFoundError (no such path, or no manifest), ExportError (a bare chain directory, an unknown
    head, a file that is not a peerloom export), VerificationError / DecodeError / PeerloomError (a chain,
    artifact or digest that does not verify), ParamsMismatchError (a ValueError) naming the missing,
    unexpected and mismatched keys when the params do not fit `module`.
    """
    import numpy as np

    from peerloom.adapters.database import DB_NAME

    path = Path(path_or_store)
    manifest_path = None if manifest is None else Path(manifest)
    if path.is_file() and path.name != DB_NAME:
        params = _load_file(path, head=head, manifest=manifest_path, authority=authority)
    else:
        _, _, params, _ = _certified(path, head=head, manifest=manifest_path, authority=authority)
    if module is not None:
        return _load_into(module, params)
    return {name: np.array(array) for name, array in params.items()}
