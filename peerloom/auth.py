"""`peerloom auth serve|revoke|revocations`: the auth service that issues admission certificates to volunteers
who log in with GitHub or an OIDC provider (spec/auth.md; the app is `adapters.auth_service`).

An ``auth.toml`` (relative paths are relative to its directory)::

    listen = "127.0.0.1:8400"          # where `peerloom login --edge http://HOST:PORT` reaches it
    key = "gate.key"                   # the manifest's admission_authority key
    manifest = "manifest.cbor"         # the signed revision manifest
    state = "auth-state"               # issued.jsonl and revoked.jsonl
    max_capacity = 1                   # the max_capacity of every certificate (1..65536)
    validity_windows = 100             # certificates expire this many windows on (0: never)
    edge = "http://127.0.0.1:8001"     # an HTTP edge of the fleet: the current window (if validity_windows)
    max_peers_per_login = 1            # peer ids one login may hold
    session_ttl_s = 600.0              # a login not finished in this long is forgotten
    max_sessions = 1024                # logins in progress, in all (a full table evicts the oldest first)
    max_sessions_per_address = 8       # logins in progress from one address (IPv6: one /64)
    starts_per_minute = 30             # logins one address may start a minute (each asks the provider)

    [github]                           # optional: GitHub OAuth app with the device flow enabled
    client_id = "Iv1.0123456789abcdef"
    orgs = ["my-org"]                  # any non-empty one of orgs / teams / users must match
    teams = ["my-org/trainers"]
    users = ["octocat"]
    min_account_age_days = 30          # applies to everyone
    # device_url, token_url, api_url: GitHub's by default (tests point them at a fake)

    [oidc]                             # optional: an OIDC provider with the device grant (RFC 8628)
    issuer = "https://accounts.example.com"  # discovery: {issuer}/.well-known/openid-configuration
    client_id = "peerloom"
    client_secret = ""                 # only for confidential clients
    subjects = []                      # any non-empty one of subjects / email_domains / groups must match
    email_domains = ["example.edu"]    # only with email_verified = true
    groups = ["ml-volunteers"]
    groups_claim = "groups"

`auth revoke --login NAME` (or `--peer ID`, which revokes the login that peer was issued to) records the
revocation; the service then refuses that login and its peers, and lists them at ``/v1/revocations``. With
``--out FILE`` it also writes the admission authority's signed revocation of those peers (an
`AdmissionRevocation` envelope, spec/auth.md §6); POST it to a validator's HTTP edge
(``POST /v1/revocations``, application/cbor) and the fleet drops the peers from the roster.
"""

from __future__ import annotations

import argparse
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

CONFIG_KEYS: dict[str, tuple[type, ...]] = {
    "listen": (str,), "key": (str,), "manifest": (str,), "state": (str,), "max_capacity": (int,),
    "validity_windows": (int,), "edge": (str,), "max_peers_per_login": (int,), "session_ttl_s": (int, float),
    "max_sessions": (int,), "max_sessions_per_address": (int,), "starts_per_minute": (int, float),
    "github": (dict,), "oidc": (dict,),
}
GITHUB_KEYS: dict[str, tuple[type, ...]] = {
    "client_id": (str,), "orgs": (list,), "teams": (list,), "users": (list,), "min_account_age_days": (int, float),
    "device_url": (str,), "token_url": (str,), "api_url": (str,), "scope": (str,),
}
OIDC_KEYS: dict[str, tuple[type, ...]] = {
    "issuer": (str,), "client_id": (str,), "client_secret": (str,), "subjects": (list,), "email_domains": (list,),
    "groups": (list,), "groups_claim": (str,), "scope": (str,), "leeway_s": (int, float),
}


class AuthConfigError(ValueError):
    """auth.toml is missing a key or has a bad one; the message says which."""


def _check(table: dict[str, Any], schema: dict[str, tuple[type, ...]], where: str, required: tuple[str, ...]) -> None:
    unknown = set(table) - set(schema)
    if unknown:
        raise AuthConfigError(f"{where}: unknown keys {', '.join(sorted(unknown))}")
    for key in required:
        if key not in table:
            raise AuthConfigError(f"{where}: missing key {key!r}")
    for key, value in table.items():
        if not isinstance(value, schema[key]) or isinstance(value, bool):
            raise AuthConfigError(f"{where}: {key} has the wrong type")


def load_settings(path: Path) -> tuple[Any, str, int]:
    """(AuthSettings, host, port) from an auth.toml; AuthConfigError (or OSError) says what is wrong."""
    from peerloom.adapters.auth_service import AuthSettings, GithubPolicy, OidcPolicy, allowed
    from peerloom.adapters.keys import load_identity
    from peerloom.core.envelope import SignedEnvelope
    from peerloom.core.errors import PeerloomError
    from peerloom.core.objects import Revision

    with open(path, "rb") as fh:
        config = tomllib.load(fh)
    _check(config, CONFIG_KEYS, str(path), ("listen", "key", "manifest", "state"))
    base = path.parent
    host, sep, port = config["listen"].rpartition(":")
    if not sep or not port.isdigit():
        raise AuthConfigError(f"listen {config['listen']!r} must be host:port")
    try:
        authority = load_identity(base / config["key"])
    except (OSError, ValueError) as exc:
        raise AuthConfigError(f"key: {exc}") from None
    try:
        revision = Revision.verify(SignedEnvelope.from_bytes((base / config["manifest"]).read_bytes()))
    except OSError as exc:
        raise AuthConfigError(f"manifest: {exc}") from None
    except PeerloomError as exc:
        raise AuthConfigError(f"manifest: not a signed manifest: {exc}") from None
    if revision.manifest.admission != "certificate":
        raise AuthConfigError("the manifest admits every joiner (admission = \"open\"): it needs no auth service")
    github = oidc = None
    if "github" in config:
        g = config["github"]
        _check(g, GITHUB_KEYS, "[github]", ("client_id",))
        github = GithubPolicy(client_id=g["client_id"], orgs=allowed(g.get("orgs", ())),
                              teams=allowed(g.get("teams", ())), users=allowed(g.get("users", ())),
                              min_account_age_days=float(g.get("min_account_age_days", 0.0)),
                              **{k: g[k] for k in ("device_url", "token_url", "api_url", "scope") if k in g})
    if "oidc" in config:
        o = config["oidc"]
        _check(o, OIDC_KEYS, "[oidc]", ("issuer", "client_id"))
        oidc = OidcPolicy(issuer=o["issuer"], client_id=o["client_id"], client_secret=o.get("client_secret") or None,
                          subjects=allowed(o.get("subjects", ())), email_domains=allowed(o.get("email_domains", ())),
                          groups=allowed(o.get("groups", ())),
                          **{k: o[k] for k in ("groups_claim", "scope", "leeway_s") if k in o})
    numbers = {k: config[k] for k in ("max_capacity", "validity_windows", "max_peers_per_login", "max_sessions",
                                      "max_sessions_per_address", "starts_per_minute", "session_ttl_s")
               if k in config}
    if not 1 <= numbers.get("max_capacity", 1) <= 1 << 16:
        raise AuthConfigError("max_capacity must be 1..65536")
    if numbers.get("validity_windows", 0) < 0 or numbers.get("max_peers_per_login", 1) < 1:
        raise AuthConfigError("validity_windows must be >= 0 and max_peers_per_login >= 1")
    if min(numbers.get(k, 1) for k in ("max_sessions", "max_sessions_per_address", "starts_per_minute")) <= 0:
        raise AuthConfigError("max_sessions, max_sessions_per_address and starts_per_minute must be positive")
    settings = AuthSettings(revision=revision, authority=authority, state_dir=base / config["state"], github=github,
                            oidc=oidc, edge_url=config.get("edge"), **numbers)
    return settings, host, int(port)


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("auth", help="issue admission certificates to volunteers who log in with GitHub or OIDC")
    cmds = p.add_subparsers(dest="auth_command", required=True)
    serve = cmds.add_parser("serve", help="run the auth service (spec/auth.md)")
    serve.add_argument("--config", type=Path, required=True, help="auth.toml")
    revoke = cmds.add_parser("revoke", help="revoke a login (and the peers issued to it)")
    revoke.add_argument("--config", type=Path, required=True, help="auth.toml")
    who = revoke.add_mutually_exclusive_group(required=True)
    who.add_argument("--login", help="a login name as the service records it, e.g. github:583231")
    who.add_argument("--peer", help="a peer id: revokes the login(s) it was issued to")
    revoke.add_argument("--reason", default="", help="recorded with the revocation")
    revoke.add_argument("--out", type=Path, help="write the signed revocation of the peers here (for validators)")
    listing = cmds.add_parser("revocations", help="print the revoked logins and their peers as JSON")
    listing.add_argument("--config", type=Path, required=True, help="auth.toml")


def run(args: argparse.Namespace) -> int | str:
    """Exit status for `sys.exit`: 0, or a one-line message naming what is wrong."""
    import json

    import jwt  # noqa: F401  (first, so that a missing extra is named as 'auth', cli.EXTRA_OF)

    try:
        settings, host, port = load_settings(args.config)
    except (AuthConfigError, tomllib.TOMLDecodeError) as exc:
        return f"peerloom auth: {args.config}: {exc}"
    except OSError as exc:
        return f"peerloom auth: {exc}"
    from peerloom.adapters.auth_service import Ledger

    ledger = Ledger(settings.state_dir)
    if args.auth_command == "revoke":
        logins = {args.login} if args.login else ledger.logins_of_peer(args.peer)
        if not logins:
            return f"peerloom auth revoke: no certificate was issued to peer {args.peer}"
        revoked: set[str] = set()
        for login in sorted(logins):
            peers = ledger.revoke(login, reason=args.reason, now=time.time())
            revoked |= peers
            print(f"revoked {login} (peers: {', '.join(sorted(peers)) or 'none'})")
        if args.out is not None:
            return write_revocation(settings, revoked, args.out)
        return 0
    if args.auth_command == "revocations":
        print(json.dumps({"revoked": ledger.revocations()}, indent=2))
        return 0
    return serve(settings, host, port)


def write_revocation(settings: Any, peers: set[str], out: Path) -> int | str:
    """Write the admission authority's signed `AdmissionRevocation` of `peers` (peer id texts) to `out`:
    0, or a message when there is nothing to revoke or more than `MAX_REVOKED_PEERS` peers."""
    from peerloom.adapters.storage import atomic_write
    from peerloom.core.errors import VerificationError
    from peerloom.core.identity import PeerId
    from peerloom.core.objects import MAX_REVOKED_PEERS, AdmissionRevocation, check_revocation, seal

    if not peers or len(peers) > MAX_REVOKED_PEERS:
        return f"peerloom auth revoke: {len(peers)} peers to revoke; a revocation names 1..{MAX_REVOKED_PEERS}"
    revocation = AdmissionRevocation(revision=settings.revision.id,
                                     peers=tuple(sorted(PeerId.from_text(p) for p in peers)))
    envelope = seal(settings.authority, revocation)
    try:  # as validators will check it: the key must be the manifest's admission_authority
        check_revocation(envelope, settings.revision.id, settings.revision.manifest)
    except VerificationError as exc:
        return f"peerloom auth revoke: {exc}"
    atomic_write(out, envelope.to_bytes())
    print(f"wrote {out}: POST it to a validator's edge at /v1/revocations")
    return 0


def serve(settings: Any, host: str, port: int) -> int:
    """Run the service until SIGINT/SIGTERM; prints ``auth service on http://HOST:PORT`` once it listens."""
    import asyncio
    import signal

    from aiohttp import web

    from peerloom.adapters.auth_service import AuthService

    async def main() -> None:
        service = AuthService(settings)
        runner = web.AppRunner(service.app())
        await runner.setup()
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound = runner.addresses[0][1] if runner.addresses else port
        print(f"auth service on http://{host}:{bound} for revision {settings.revision.id.hex()}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await runner.cleanup()

    try:
        asyncio.run(main())
    except ValueError as exc:  # AuthService's own checks (the key is not the admission authority, ...)
        print(f"peerloom auth: {exc}", file=sys.stderr)
        return 2
    return 0
