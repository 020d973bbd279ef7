"""`peerloom login --edge URL --provider github|oidc`: get an admission certificate from an auth service by
logging in (spec/auth.md §2; the service is `peerloom auth serve`).

It asks the service to start a device-flow login for this node's peer id, prints that peer id (the key's
fingerprint), the service's approval page, which shows the same key, and the provider's verification URL
and user code for the volunteer to open (RFC 8628 §5.4: a volunteer approves only the key it sees its own
node print), signs the service's nonce with the node's key
(`login_proof_preimage`: the proof that it holds the key of the peer id it asks for) and polls until the
service answers with a certificate or a refusal. It checks the certificate against the manifest
(`check_admission`, as validators do) and writes it where the node config's ``admission`` key points
(``--config node.toml``), or to ``--out``. Exit status 0 with a certificate written, 1 on a refusal or a
timeout, 2 on bad arguments or files. It needs only the base install (no aiohttp, no PyJWT).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import tomllib
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

MAX_RESPONSE_BYTES = 64 * 1024  # a service answer (a certificate is a few hundred bytes)


class LoginError(Exception):
    """The service refused the login (its error code and detail), or could not be reached."""


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("login", help="log in with GitHub or OIDC at an auth service and write this node's "
                                     "admission certificate")
    p.add_argument("--edge", required=True, metavar="URL", help="the auth service's base URL")
    p.add_argument("--provider", required=True, choices=("github", "oidc"))
    p.add_argument("--config", type=Path, default=None,
                   help="node.toml: its key, its manifest, and its admission path (default admission.cbor)")
    p.add_argument("--key", type=Path, default=None, help="identity key file (instead of --config)")
    p.add_argument("--manifest", type=Path, default=None, help="the signed manifest, to check the certificate")
    p.add_argument("--out", type=Path, default=None, help="where to write the certificate (instead of --config)")
    p.add_argument("--timeout", type=float, default=900.0, metavar="SECONDS", help="give up after this long")


def _post(url: str, body: dict[str, Any], timeout_s: float) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json", "Accept": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            status, raw = resp.status, resp.read(MAX_RESPONSE_BYTES + 1)
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read(MAX_RESPONSE_BYTES + 1)
    except (urllib.error.URLError, OSError) as exc:
        raise LoginError(f"cannot reach {url}: {getattr(exc, 'reason', exc)}") from None
    if len(raw) > MAX_RESPONSE_BYTES:
        raise LoginError(f"{url}: answer over {MAX_RESPONSE_BYTES} bytes")
    try:
        answer = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        answer = None
    if not isinstance(answer, dict):
        raise LoginError(f"{url}: HTTP {status}, not a JSON object")
    if status >= 400:
        raise LoginError(f"refused ({status} {answer.get('error')}): {answer.get('detail')}")
    return status, answer


def login(edge: str, provider: str, identity: Any, *, timeout_s: float = 900.0, out: Any = None,
          sleep: Any = time.sleep) -> Any:
    """Run the client side of a login; returns the certificate's `SignedEnvelope` (not yet checked against
    a manifest). Prints the verification URL and user code to `out`. LoginError on a refusal or timeout."""
    from peerloom.adapters.auth_proof import login_proof_preimage
    from peerloom.core.envelope import SignedEnvelope
    from peerloom.core.errors import PeerloomError

    base = edge.rstrip("/")
    _, started = _post(f"{base}/v1/login/start", {"provider": provider, "peer": identity.peer_id.to_text()}, 30.0)
    try:
        session, nonce = str(started["session"]), bytes.fromhex(started["nonce"])
        revision, interval = bytes.fromhex(started["revision"]), float(started["interval"])
        uri, code = str(started["verification_uri"]), str(started["user_code"])
        fingerprint, page = str(started["fingerprint"]), str(started["approval_path"])
    except (KeyError, ValueError, TypeError):
        raise LoginError("the service's answer to login/start is malformed") from None
    if fingerprint != identity.peer_id.to_text() or not page.startswith("/v1/login/approve/"):
        raise LoginError("the service started a login for another key")
    print(f"This node's key (its fingerprint): {fingerprint}\n"
          f"Check it at {base}{page} : that page shows the key you are about to approve, and it must be this one.\n"
          f"Open {uri} and enter the code {code}", file=out or sys.stdout, flush=True)
    signature = identity.sign(login_proof_preimage(revision, session, nonce, identity.peer_id, provider))
    deadline = time.monotonic() + timeout_s
    while True:
        sleep(min(max(interval, 0.05), 60.0))
        status, answer = _post(f"{base}/v1/login/poll", {"session": session, "signature": signature.hex()}, 60.0)
        if status == 200:
            try:
                return SignedEnvelope.from_bytes(bytes.fromhex(answer["certificate"]))
            except (KeyError, ValueError, TypeError, PeerloomError) as exc:
                raise LoginError(f"the service sent no valid certificate: {exc}") from None
        interval = float(answer.get("interval", interval)) if isinstance(answer.get("interval"), int | float) \
            else interval
        if time.monotonic() > deadline:
            raise LoginError(f"no approval within {timeout_s:g} s")


def _paths(args: argparse.Namespace) -> tuple[Path, Path, Path | None]:
    """(key, out, manifest) from --config or --key/--out/--manifest; ValueError names what is missing."""
    if args.config is not None:
        with open(args.config, "rb") as fh:
            config = tomllib.load(fh)
        base = args.config.parent
        if not isinstance(config.get("key"), str) or not isinstance(config.get("manifest"), str):
            raise ValueError(f"{args.config} names no key or manifest")
        admission = config.get("admission", "admission.cbor")
        if "admission" not in config:
            print(f"note: add  admission = \"{admission}\"  to {args.config} so the node sends it", file=sys.stderr)
        return (base / config["key"], args.out or base / str(admission),
                args.manifest or base / config["manifest"])
    if args.key is None or args.out is None:
        raise ValueError("give --config node.toml, or --key and --out")
    return args.key, args.out, args.manifest


def run(args: argparse.Namespace) -> int:
    from peerloom.adapters.keys import load_identity
    from peerloom.adapters.storage import atomic_write
    from peerloom.core.envelope import SignedEnvelope
    from peerloom.core.errors import PeerloomError
    from peerloom.core.objects import PROTOCOL_VERSION, AdmissionCertificate, Revision, check_admission

    try:
        key, out, manifest_path = _paths(args)
        identity = load_identity(key)
        revision = None
        if manifest_path is not None:
            revision = Revision.verify(SignedEnvelope.from_bytes(manifest_path.read_bytes()))
    except (OSError, ValueError, tomllib.TOMLDecodeError, PeerloomError) as exc:
        print(f"peerloom login: {exc}", file=sys.stderr)
        return 2
    try:
        envelope = login(args.edge, args.provider, identity, timeout_s=args.timeout)
        if revision is not None:
            cert = check_admission(envelope, revision.id, revision.manifest, identity.peer_id)
        else:
            cert = AdmissionCertificate.from_cbor(envelope.open(AdmissionCertificate.KIND, PROTOCOL_VERSION))
            if cert.peer != identity.peer_id:
                raise LoginError("the certificate is for another peer")
    except (LoginError, PeerloomError) as exc:
        print(f"peerloom login: {exc}", file=sys.stderr)
        return 1
    try:
        atomic_write(out, envelope.to_bytes())
    except OSError as exc:
        print(f"peerloom login: {exc}", file=sys.stderr)
        return 2
    expiry = "no expiry" if cert.expires_window is None else f"valid for joins up to window {cert.expires_window}"
    print(f"admitted {identity.peer_id.to_text()} ({expiry}): {out}", flush=True)
    return 0
