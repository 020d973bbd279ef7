"""The auth service: volunteers log in with GitHub or an OIDC provider and receive an admission certificate
(spec/auth.md). An aiohttp app; `peerloom auth serve` (peerloom/auth.py) runs it.

The service holds the experiment's admission key (the manifest's ``admission_authority``) and drives the
OAuth 2.0 device authorization grant (RFC 8628) itself, so provider tokens reach it straight from the
provider's token endpoint and never pass through the client:

==============================  =================================================================================
``POST /v1/login/start``        JSON ``{"provider": "github"|"oidc", "peer": <peer id>}`` → 200 ``{"session",
                                "nonce", "verification_uri", "user_code", "interval", "expires_in", "revision",
                                "fingerprint", "approval_path"}``; 429 ``slow-down`` over the start rate
``POST /v1/login/poll``         JSON ``{"session", "signature": <hex>}`` → 202 ``{"status": "pending",
                                "interval"}``, or 200 ``{"certificate": <hex of the SignedEnvelope>, "login",
                                "expires_window"}``; a used or unknown session is 404 ``unknown-session``
``GET /v1/login/approve/{p}``   200 an HTML page naming the key (peer id) being approved, the provider, the
                                user code and its link (RFC 8628 §5.4); 404 once the login is over
``GET /v1/revocations``         200 ``{"revoked": [{"login_digest": <hex>, "peers": [<peer id>...]}]}``
``GET /healthz``                200 ``{"status": "ok", "sessions", "issued", "evicted"}``
==============================  =================================================================================

Refusals are JSON ``{"error": <code>, "detail": <text>}`` with a 4xx/5xx status, and issue nothing.
`signature` is the peer's Ed25519 signature over `login_proof_preimage` (domain-separated, binding the
revision, session, nonce, peer and provider): a certificate is never issued for a peer id whose key the
client does not hold (spec/auth.md §2). A session is consumed by its first completed poll, and a provider
token is accepted once (its SHA-256 is kept for a day in ``used-tokens.sqlite3`` in the state directory, so
a restart forgets none), so neither a session nor a code can be replayed. Pending logins are bounded per
remote address and in all, and a full table evicts the oldest first rather than refuse (spec/auth.md §2
"Limits"), so no one address can lock others out. ID tokens are validated with PyJWT and the provider's
JWKS (`jwt.PyJWKClient`): signature, ``iss``, ``aud``, ``exp``, ``iat``; GitHub access tokens by GitHub's
REST API (``/user``, ``/user/orgs``, ``/user/teams``). Everything a provider or client sends is
size-bounded before it is parsed.
"""

from __future__ import annotations

import asyncio
import hashlib
import html
import ipaddress
import json
import secrets
import sqlite3
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import jwt
from aiohttp import web

from peerloom.adapters.auth_proof import LOGIN_PROOF_DOMAIN, login_digest, login_proof_preimage
from peerloom.core.errors import DecodeError
from peerloom.core.identity import Identity, PeerId
from peerloom.core.objects import AdmissionCertificate, Revision, check_admission, seal

DEVICE_GRANT = "urn:ietf:params:oauth:grant-type:device_code"  # RFC 8628 §3.4
PROVIDERS = ("github", "oidc")
__all__ = ["LOGIN_PROOF_DOMAIN", "AuthRefused", "AuthService", "AuthSettings", "GithubPolicy", "Ledger",
           "OidcPolicy", "login_digest", "login_proof_preimage"]
MAX_REQUEST_BYTES = 16 * 1024  # a client's JSON body
MAX_PROVIDER_BYTES = 256 * 1024  # one provider response (discovery, token, user, orgs, teams)
PROVIDER_TIMEOUT_S = 10.0
USED_TOKEN_MEMORY_S = 86400.0  # how long a used provider token is remembered (longer than any token lives)
MAX_START_BUCKETS = 65536  # addresses whose login-start rate is tracked at once (least recently seen forgotten)
ID_TOKEN_ALGORITHMS = ("RS256", "RS384", "RS512", "ES256", "ES384", "PS256", "EdDSA")


class AuthRefused(Exception):
    """A login the service refuses: HTTP `status`, a stable `code` and a human `detail`. Nothing is issued."""

    def __init__(self, status: int, code: str, detail: str) -> None:
        super().__init__(f"{code}: {detail}")
        self.status, self.code, self.detail = status, code, detail


# --- policies ---------------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class GithubPolicy:
    """GitHub OAuth app (device flow enabled) and whom it admits. Any of `users` / `orgs` / `teams`
    (``org/team-slug``) that is non-empty must match (one match admits); `min_account_age_days` applies
    to everyone. URLs are configurable so tests point them at a local fake."""

    client_id: str
    users: frozenset[str] = frozenset()
    orgs: frozenset[str] = frozenset()
    teams: frozenset[str] = frozenset()
    min_account_age_days: float = 0.0
    device_url: str = "https://github.com/login/device/code"
    token_url: str = "https://github.com/login/oauth/access_token"
    api_url: str = "https://api.github.com"
    scope: str = "read:org"


@dataclass(frozen=True, kw_only=True)
class OidcPolicy:
    """An OIDC provider, configured from its discovery document (``{issuer}/.well-known/openid-configuration``),
    and whom it admits: any of `subjects` / `email_domains` / `groups` (read from the `groups_claim` claim)
    that is non-empty must match (one match admits). An email counts only with ``email_verified`` true."""

    issuer: str
    client_id: str
    client_secret: str | None = None
    subjects: frozenset[str] = frozenset()
    email_domains: frozenset[str] = frozenset()
    groups: frozenset[str] = frozenset()
    groups_claim: str = "groups"
    scope: str = "openid email profile"
    leeway_s: float = 30.0


@dataclass(frozen=True, kw_only=True)
class AuthSettings:
    """Everything the service needs. `validity_windows` > 0 makes certificates expire that many windows
    after the window being collected when they are issued (read from `edge_url`'s ``/v1/heads/latest``);
    0 issues certificates without expiry. `max_peers_per_login` bounds the peer ids one login may hold.

    Pending logins (spec/auth.md §2 "Limits"): at most `max_sessions` in all and `max_sessions_per_address`
    per remote address (`address_key`); one address starts at most `starts_per_minute` logins a minute (a
    token bucket of that many, refilled at that rate), because each start costs a request to the provider."""

    revision: Revision
    authority: Identity
    state_dir: Path
    github: GithubPolicy | None = None
    oidc: OidcPolicy | None = None
    max_capacity: int = 1
    validity_windows: int = 0
    edge_url: str | None = None
    session_ttl_s: float = 600.0
    max_sessions: int = 1024
    max_sessions_per_address: int = 8
    starts_per_minute: float = 30.0
    max_peers_per_login: int = 1


# --- the ledger: issued certificates and revoked logins ---------------------------------------------------

class Ledger:
    """Append-only JSON-lines files under `state_dir`: ``issued.jsonl`` (one line per certificate: login,
    its digest, peer, expires_window, time) and ``revoked.jsonl`` (one line per revoked login). Read anew on
    every question, so `peerloom auth revoke` in another process takes effect at the next login."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        state_dir.mkdir(parents=True, exist_ok=True)
        self.issued_path = state_dir / "issued.jsonl"
        self.revoked_path = state_dir / "revoked.jsonl"

    @staticmethod
    def _lines(path: Path) -> list[dict[str, Any]]:
        if not path.exists():
            return []
        out = []
        for line in path.read_text().splitlines():
            try:
                item = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by a crash
            if isinstance(item, dict):
                out.append(item)
        return out

    @staticmethod
    def _append(path: Path, item: dict[str, Any]) -> None:
        with open(path, "a") as fh:
            fh.write(json.dumps(item, sort_keys=True) + "\n")

    def issued(self) -> list[dict[str, Any]]:
        return self._lines(self.issued_path)

    def revoked_logins(self) -> set[str]:
        return {str(item.get("login")) for item in self._lines(self.revoked_path)}

    def peers_of(self, login: str) -> set[str]:
        return {str(item["peer"]) for item in self.issued() if item.get("login") == login}

    def logins_of_peer(self, peer: str) -> set[str]:
        return {str(item["login"]) for item in self.issued() if item.get("peer") == peer}

    def record_issue(self, *, login: str, peer: PeerId, expires_window: int | None, now: float) -> None:
        self._append(self.issued_path, {"login": login, "login_digest": login_digest(login).hex(),
                                        "peer": peer.to_text(), "expires_window": expires_window, "at": now})

    def revoke(self, login: str, *, reason: str, now: float) -> set[str]:
        """Record `login` as revoked; returns the peer ids issued to it."""
        self._append(self.revoked_path, {"login": login, "reason": reason, "at": now})
        return self.peers_of(login)

    def revocations(self) -> list[dict[str, Any]]:
        """Revoked logins (as digests) with the peers issued to them, for validators and admins."""
        return [{"login_digest": login_digest(login).hex(), "peers": sorted(self.peers_of(login))}
                for login in sorted(self.revoked_logins())]


# --- remote addresses and used tokens ------------------------------------------------------------------------

def address_key(remote: str | None) -> str:
    """What the per-address limits count a client by (spec/auth.md §2 "Limits"): an IPv4 address itself, an
    IPv6 address by its /64 prefix (one subscriber commonly holds a whole /64), an IPv4-mapped IPv6 address as
    its IPv4 address; ``"?"`` when the transport gives none."""
    try:
        ip = ipaddress.ip_address(remote or "")
    except ValueError:
        return "?"
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


class UsedTokens:
    """The SHA-256 digests of provider tokens that were accepted, each until a time (wall seconds), in the
    SQLite database ``used-tokens.sqlite3`` of the state directory (spec/auth.md §2 "Replay"): a token stays
    used across restarts. One row per login that reached the provider's approval, so the table grows only
    with real logins; expired rows are deleted on every claim."""

    def __init__(self, path: Path) -> None:
        self.path = path
        # autocommit: each claim is durable at once; one thread at a time uses it (the service's event loop),
        # which need not be the thread that built the service
        self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA synchronous = FULL")
        self._db.execute("CREATE TABLE IF NOT EXISTS used (digest BLOB PRIMARY KEY, until REAL NOT NULL)")

    def claim(self, digest: bytes, *, now: float, until: float) -> bool:
        """Record `digest` as used until `until`; False if it is already used (and not expired at `now`)."""
        self._db.execute("DELETE FROM used WHERE until <= ?", (now,))
        cursor = self._db.execute("INSERT OR IGNORE INTO used (digest, until) VALUES (?, ?)", (digest, until))
        return cursor.rowcount == 1

    def __len__(self) -> int:
        return int(self._db.execute("SELECT COUNT(*) FROM used").fetchone()[0])

    def close(self) -> None:
        self._db.close()


# --- provider adapters --------------------------------------------------------------------------------------

async def _read_json(resp: aiohttp.ClientResponse, what: str) -> Any:
    """The response's JSON body, at most MAX_PROVIDER_BYTES; AuthRefused 502 otherwise."""
    body = await resp.content.read(MAX_PROVIDER_BYTES + 1)
    if len(body) > MAX_PROVIDER_BYTES:
        raise AuthRefused(502, "provider-error", f"{what}: response over {MAX_PROVIDER_BYTES} bytes")
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise AuthRefused(502, "provider-error", f"{what}: not JSON (HTTP {resp.status})") from None


def _text(obj: dict[str, Any], key: str, what: str, max_len: int = 2048) -> str:
    value = obj.get(key)
    if not isinstance(value, str) or not value or len(value) > max_len:
        raise AuthRefused(502, "provider-error", f"{what}: no valid {key!r}")
    return value


@dataclass(frozen=True)
class DeviceStart:
    """A provider's device authorization response (RFC 8628 §3.2)."""

    device_code: str
    user_code: str
    verification_uri: str
    interval: float
    expires_in: float


class _DeviceFlow:
    """The RFC 8628 parts GitHub and OIDC providers share."""

    name = ""

    async def endpoints(self, http: aiohttp.ClientSession) -> tuple[str, str]:  # (device, token)
        raise NotImplementedError

    def client_params(self) -> dict[str, str]:
        raise NotImplementedError

    async def identify(self, http: aiohttp.ClientSession, tokens: dict[str, Any]) -> str:
        """The login name the provider vouches for, after the policy admitted it; AuthRefused otherwise."""
        raise NotImplementedError

    def token_key(self, tokens: dict[str, Any]) -> str:
        """The token whose reuse is refused (the credential the service validates)."""
        raise NotImplementedError

    async def start(self, http: aiohttp.ClientSession) -> DeviceStart:
        device_url, _ = await self.endpoints(http)
        async with http.post(device_url, data={**self.client_params(), "scope": self.scope},
                             headers={"Accept": "application/json"}) as resp:
            body = await _read_json(resp, "device authorization")
        if resp.status != 200 or not isinstance(body, dict):
            raise AuthRefused(502, "provider-error", f"device authorization: HTTP {resp.status}")
        uri = body.get("verification_uri") or body.get("verification_url")  # some providers spell it _url
        interval, expires_in = body.get("interval", 5), body.get("expires_in", 600)
        if not isinstance(interval, int | float) or not isinstance(expires_in, int | float):
            raise AuthRefused(502, "provider-error", "device authorization: bad interval or expires_in")
        return DeviceStart(device_code=_text(body, "device_code", "device authorization"),
                           user_code=_text(body, "user_code", "device authorization", 64),
                           verification_uri=_text({"u": uri}, "u", "device authorization"),
                           interval=min(max(float(interval), 0.0), 60.0),
                           expires_in=min(max(float(expires_in), 1.0), 3600.0))

    async def poll(self, http: aiohttp.ClientSession, device_code: str) -> dict[str, Any] | None:
        """The token response, or None while the user has not yet approved (pending / slow_down)."""
        _, token_url = await self.endpoints(http)
        async with http.post(token_url, data={**self.client_params(), "device_code": device_code,
                                              "grant_type": DEVICE_GRANT},
                             headers={"Accept": "application/json"}) as resp:
            body = await _read_json(resp, "token")
        if not isinstance(body, dict):
            raise AuthRefused(502, "provider-error", "token: not a JSON object")
        error = body.get("error")
        if error in ("authorization_pending", "slow_down"):
            return None
        if error is not None:
            # access_denied, expired_token, invalid_grant (a used or unknown device code), ...
            raise AuthRefused(403, "login-refused", f"provider says {str(error)[:64]!r}")
        if resp.status != 200:
            raise AuthRefused(502, "provider-error", f"token: HTTP {resp.status}")
        return body

    scope = ""


class GithubProvider(_DeviceFlow):
    """GitHub's device flow and REST API (docs.github.com: "Authorizing OAuth apps", device flow)."""

    name = "github"

    def __init__(self, policy: GithubPolicy, now: Callable[[], float]) -> None:
        self.policy, self.now, self.scope = policy, now, policy.scope

    async def endpoints(self, http: aiohttp.ClientSession) -> tuple[str, str]:
        return self.policy.device_url, self.policy.token_url

    def client_params(self) -> dict[str, str]:
        return {"client_id": self.policy.client_id}

    def token_key(self, tokens: dict[str, Any]) -> str:
        return _text(tokens, "access_token", "token")

    async def _api(self, http: aiohttp.ClientSession, path: str, token: str) -> Any:
        async with http.get(self.policy.api_url.rstrip("/") + path,
                            headers={"Authorization": f"Bearer {token}",
                                     "Accept": "application/vnd.github+json"}) as resp:
            body = await _read_json(resp, f"GitHub {path}")
        if resp.status in (401, 403):
            raise AuthRefused(403, "bad-token", f"GitHub {path}: HTTP {resp.status}")
        if resp.status != 200:
            raise AuthRefused(502, "provider-error", f"GitHub {path}: HTTP {resp.status}")
        return body

    async def identify(self, http: aiohttp.ClientSession, tokens: dict[str, Any]) -> str:
        p, token = self.policy, self.token_key(tokens)
        user = await self._api(http, "/user", token)
        if not isinstance(user, dict) or not isinstance(user.get("id"), int) or not isinstance(user.get("login"), str):
            raise AuthRefused(502, "provider-error", "GitHub /user: no id or login")
        name = user["login"].lower()
        if p.min_account_age_days > 0:
            try:
                created = datetime.fromisoformat(str(user.get("created_at")).replace("Z", "+00:00"))
            except ValueError:
                raise AuthRefused(502, "provider-error", "GitHub /user: no valid created_at") from None
            age_days = (self.now() - created.astimezone(UTC).timestamp()) / 86400
            if age_days < p.min_account_age_days:
                raise AuthRefused(403, "policy-refused", f"account {age_days:.0f} days old, the policy asks "
                                                         f"for {p.min_account_age_days:g}")
        if p.users or p.orgs or p.teams:
            allowed = name in {u.lower() for u in p.users}
            if not allowed and p.orgs:
                orgs = await self._api(http, "/user/orgs", token)
                mine = {str(o.get("login", "")).lower() for o in orgs if isinstance(o, dict)} \
                    if isinstance(orgs, list) else set()
                allowed = bool(mine & {o.lower() for o in p.orgs})
            if not allowed and p.teams:
                teams = await self._api(http, "/user/teams", token)
                mine = {f"{t['organization'].get('login', '')}/{t.get('slug', '')}".lower()
                        for t in teams if isinstance(t, dict) and isinstance(t.get("organization"), dict)} \
                    if isinstance(teams, list) else set()
                allowed = bool(mine & {t.lower() for t in p.teams})
            if not allowed:
                raise AuthRefused(403, "policy-refused", f"GitHub user {name} is in none of the allowed users, "
                                                         "organisations or teams")
        return f"github:{user['id']}"


class OidcProvider(_DeviceFlow):
    """A generic OIDC provider: endpoints from its discovery document (OpenID Connect Discovery 1.0 §4),
    ID tokens validated by PyJWT against its JWKS (OpenID Connect Core 1.0 §3.1.3.7)."""

    name = "oidc"

    def __init__(self, policy: OidcPolicy) -> None:
        self.policy, self.scope = policy, policy.scope
        self._discovery: dict[str, Any] | None = None
        self._jwks: jwt.PyJWKClient | None = None

    async def discover(self, http: aiohttp.ClientSession) -> dict[str, Any]:
        if self._discovery is None:
            url = self.policy.issuer.rstrip("/") + "/.well-known/openid-configuration"
            async with http.get(url) as resp:
                doc = await _read_json(resp, "discovery")
            if resp.status != 200 or not isinstance(doc, dict):
                raise AuthRefused(502, "provider-error", f"discovery: HTTP {resp.status}")
            if doc.get("issuer") != self.policy.issuer:  # Discovery 1.0 §4.3: must match exactly
                raise AuthRefused(502, "provider-error", f"discovery names issuer {str(doc.get('issuer'))[:200]!r}, "
                                                         f"not {self.policy.issuer!r}")
            for key in ("jwks_uri", "token_endpoint", "device_authorization_endpoint"):
                _text(doc, key, "discovery")
            self._jwks = jwt.PyJWKClient(doc["jwks_uri"], cache_keys=True, lifespan=300,
                                         timeout=int(PROVIDER_TIMEOUT_S))
            self._discovery = doc
        return self._discovery

    async def endpoints(self, http: aiohttp.ClientSession) -> tuple[str, str]:
        doc = await self.discover(http)
        return doc["device_authorization_endpoint"], doc["token_endpoint"]

    def client_params(self) -> dict[str, str]:
        params = {"client_id": self.policy.client_id}
        if self.policy.client_secret:
            params["client_secret"] = self.policy.client_secret
        return params

    def token_key(self, tokens: dict[str, Any]) -> str:
        return _text(tokens, "id_token", "token", 64 * 1024)

    def validate(self, id_token: str) -> dict[str, Any]:
        """The ID token's claims after PyJWT checked its signature (JWKS key by ``kid``), ``iss``, ``aud``,
        ``exp`` and ``iat``; AuthRefused 403 ``bad-token`` naming what failed. Blocking (JWKS fetch)."""
        assert self._jwks is not None
        p = self.policy
        try:
            key = self._jwks.get_signing_key_from_jwt(id_token)
            return jwt.decode(id_token, key=key.key, algorithms=list(ID_TOKEN_ALGORITHMS), audience=p.client_id,
                              issuer=p.issuer, leeway=p.leeway_s,
                              options={"require": ["iss", "aud", "exp", "iat", "sub"]})
        except jwt.ExpiredSignatureError:
            raise AuthRefused(403, "bad-token", "ID token expired") from None
        except jwt.InvalidAudienceError:
            raise AuthRefused(403, "bad-token", "ID token is for another audience") from None
        except jwt.InvalidIssuerError:
            raise AuthRefused(403, "bad-token", "ID token from another issuer") from None
        except jwt.InvalidSignatureError:
            raise AuthRefused(403, "bad-token", "ID token signature does not verify") from None
        except jwt.PyJWKClientError as exc:
            raise AuthRefused(403, "bad-token", f"ID token key: {exc}") from None
        except jwt.PyJWTError as exc:
            raise AuthRefused(403, "bad-token", f"ID token: {exc}") from None

    async def identify(self, http: aiohttp.ClientSession, tokens: dict[str, Any]) -> str:
        await self.discover(http)
        claims = await asyncio.to_thread(self.validate, self.token_key(tokens))
        p, sub = self.policy, str(claims["sub"])
        if p.subjects or p.email_domains or p.groups:
            allowed = sub in p.subjects
            email = claims.get("email")
            if not allowed and p.email_domains and isinstance(email, str) and claims.get("email_verified") is True:
                allowed = email.rpartition("@")[2].lower() in {d.lower() for d in p.email_domains}
            groups = claims.get(p.groups_claim)
            if not allowed and p.groups and isinstance(groups, list):
                allowed = bool({g for g in groups if isinstance(g, str)} & p.groups)
            if not allowed:
                raise AuthRefused(403, "policy-refused", "no allowed subject, verified email domain or group")
        return f"oidc:{p.issuer}#{sub}"


# --- the service ----------------------------------------------------------------------------------------

@dataclass
class _Session:
    provider: str
    peer: PeerId
    nonce: bytes
    device_code: str
    interval: float
    expires_at: float
    address: str  # `address_key` of the client that started it
    page: str  # the approval page's id (`GET /v1/login/approve/{page}`)
    user_code: str
    verification_uri: str
    next_poll_at: float = 0.0


@dataclass
class AuthService:
    """The aiohttp application's state. `now` gives wall time in seconds (tests pass their own);
    `current_window` the window being collected (default: read from `settings.edge_url`)."""

    settings: AuthSettings
    now: Callable[[], float] = time.time
    current_window: Callable[[], Awaitable[int]] | None = None
    ledger: Ledger = field(init=False)
    providers: dict[str, _DeviceFlow] = field(init=False)
    sessions: dict[str, _Session] = field(init=False, default_factory=dict)  # oldest first (insertion order)
    pages: dict[str, str] = field(init=False, default_factory=dict)  # approval page id -> session id
    used_tokens: UsedTokens = field(init=False)
    # start buckets per address_key: (tokens, at), least recently used first, at most MAX_START_BUCKETS
    start_buckets: OrderedDict[str, tuple[float, float]] = field(init=False, default_factory=OrderedDict)
    evicted: int = field(init=False, default=0)
    issued: int = field(init=False, default=0)
    _http: aiohttp.ClientSession | None = field(init=False, default=None)
    _issue_lock: asyncio.Lock = field(init=False, default_factory=asyncio.Lock)

    def __post_init__(self) -> None:
        s = self.settings
        if s.revision.manifest.admission_authority != s.authority.peer_id:
            raise ValueError(f"the key's peer id {s.authority.peer_id.to_text()} is not the manifest's "
                             f"admission_authority")
        if s.validity_windows > 0 and s.edge_url is None and self.current_window is None:
            raise ValueError("validity_windows needs edge (an HTTP edge of the fleet) to read the current window")
        if s.max_sessions < 1 or s.max_sessions_per_address < 1 or not s.starts_per_minute > 0:
            raise ValueError("max_sessions, max_sessions_per_address and starts_per_minute must be positive")
        self.ledger = Ledger(s.state_dir)
        self.used_tokens = UsedTokens(s.state_dir / "used-tokens.sqlite3")
        self.providers = {}
        if s.github is not None:
            self.providers["github"] = GithubProvider(s.github, self.now)
        if s.oidc is not None:
            self.providers["oidc"] = OidcProvider(s.oidc)
        if not self.providers:
            raise ValueError("configure at least one provider ([github] or [oidc])")

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_REQUEST_BYTES, middlewares=[_refusals])
        app.router.add_post("/v1/login/start", self.start)
        app.router.add_post("/v1/login/poll", self.poll)
        app.router.add_get("/v1/login/approve/{page}", self.approval_page)
        app.router.add_get("/v1/revocations", self.revocations)
        app.router.add_get("/healthz", self.healthz)
        app.on_cleanup.append(self._close)
        return app

    async def _close(self, app: web.Application) -> None:
        if self._http is not None:
            await self._http.close()
        self.used_tokens.close()

    def http(self) -> aiohttp.ClientSession:
        if self._http is None:
            self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=PROVIDER_TIMEOUT_S))
        return self._http

    def _sweep(self) -> None:
        now = self.now()
        for sid in [sid for sid, s in self.sessions.items() if s.expires_at <= now]:
            self._end(sid)

    def _end(self, sid: str) -> _Session | None:
        session = self.sessions.pop(sid, None)
        if session is not None:
            self.pages.pop(session.page, None)
        return session

    def _take_start(self, address: str) -> None:
        """One token of `address`'s start bucket (`starts_per_minute`, refilled at that rate per minute);
        AuthRefused 429 ``slow-down`` when it is empty. At most MAX_START_BUCKETS addresses are tracked (the
        least recently seen is forgotten: it comes back with a full bucket)."""
        rate, now = self.settings.starts_per_minute, self.now()
        tokens, at = self.start_buckets.pop(address, (rate, now))
        tokens = min(rate, tokens + (now - at) * rate / 60.0)
        if tokens < 1.0:
            self.start_buckets[address] = (tokens, now)
            raise AuthRefused(429, "slow-down", f"at most {rate:g} logins a minute from one address")
        self.start_buckets[address] = (tokens - 1.0, now)
        while len(self.start_buckets) > MAX_START_BUCKETS:
            self.start_buckets.popitem(last=False)

    def _make_room(self, address: str) -> None:
        """Evict pending logins so that one more from `address` fits (spec/auth.md §2 "Limits"): if the address
        holds `max_sessions_per_address`, its own oldest; then, while the table holds `max_sessions`, the oldest
        of the address that holds the most (ties: the one whose oldest is older). Never refuses."""
        s = self.settings
        mine = [sid for sid, session in self.sessions.items() if session.address == address]
        while len(mine) >= s.max_sessions_per_address:
            self._end(mine.pop(0))
            self.evicted += 1
        while len(self.sessions) >= s.max_sessions:
            held: dict[str, list[str]] = {}
            for sid, session in self.sessions.items():  # oldest first, so each list is too
                held.setdefault(session.address, []).append(sid)
            heaviest = max(held.values(), key=len)  # max keeps the first of equals: the oldest address
            self._end(heaviest[0])
            self.evicted += 1

    async def healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "sessions": len(self.sessions), "issued": self.issued,
                                  "evicted": self.evicted})

    async def approval_page(self, request: web.Request) -> web.Response:
        """The page the volunteer opens before approving at the provider (RFC 8628 §5.4): the key being
        approved (its peer id, in full), the provider and where the login was started from, and the
        provider's link and user code. 404 once the login is over (used, expired or evicted)."""
        self._sweep()
        sid = self.pages.get(request.match_info["page"])
        session = self.sessions.get(sid) if sid is not None else None
        if session is None:
            return web.Response(status=404, content_type="text/html",
                                text="<!doctype html><title>peerloom login</title><p>No such login in progress "
                                     "(unknown, expired or already used).</p>")
        e = html.escape
        expires = datetime.fromtimestamp(session.expires_at, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
        page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>peerloom login: approve a node key</title></head>
<body>
<h1>Approve this node key?</h1>
<p>Approving gives the node with this key an admission certificate under <b>your</b> {e(session.provider)}
login. Approve only if <b>you</b> ran <code>peerloom login</code> and it printed exactly this key:</p>
<p><code id="fingerprint">{e(session.peer.to_text())}</code></p>
<p>If you did not start this login, or the key differs, close this page: someone else is asking you to
approve their key.</p>
<ul>
<li>revision: <code>{e(self.settings.revision.id.hex())}</code></li>
<li>started from: <code>{e(session.address)}</code></li>
<li>expires: {e(expires)}</li>
</ul>
<p>To approve, open <a href="{e(session.verification_uri)}">{e(session.verification_uri)}</a> and enter the
code <code id="user-code">{e(session.user_code)}</code>.</p>
</body></html>
"""
        return web.Response(text=page, content_type="text/html",
                            headers={"Cache-Control": "no-store", "Referrer-Policy": "no-referrer",
                                     "X-Frame-Options": "DENY", "Content-Security-Policy": "default-src 'none'"})

    async def revocations(self, request: web.Request) -> web.Response:
        return web.json_response({"revoked": self.ledger.revocations()})

    async def start(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        provider_name, peer_text = body.get("provider"), body.get("peer")
        if provider_name not in self.providers:
            raise AuthRefused(400, "unknown-provider", f"this service logs in with {', '.join(sorted(self.providers))}")
        try:
            peer = PeerId.from_text(str(peer_text)[:128])
        except (DecodeError, ValueError):
            raise AuthRefused(400, "bad-peer", "peer is not a peer id") from None
        address = address_key(request.remote)
        self._take_start(address)  # first: each start below costs a ledger read and a provider request
        if self.ledger.logins_of_peer(peer.to_text()) & self.ledger.revoked_logins():
            raise AuthRefused(403, "revoked", "this peer's login is revoked")
        device = await self.providers[provider_name].start(self.http())
        self._sweep()
        self._make_room(address)  # after the provider's answer: evicting is the last thing before the insert
        sid, nonce, page = secrets.token_urlsafe(24), secrets.token_bytes(32), secrets.token_urlsafe(16)
        now = self.now()
        ttl = min(device.expires_in, self.settings.session_ttl_s)
        self.sessions[sid] = _Session(provider=provider_name, peer=peer, nonce=nonce, device_code=device.device_code,
                                      interval=device.interval, expires_at=now + ttl, address=address, page=page,
                                      user_code=device.user_code, verification_uri=device.verification_uri)
        self.pages[page] = sid
        return web.json_response({"session": sid, "nonce": nonce.hex(), "verification_uri": device.verification_uri,
                                  "user_code": device.user_code, "interval": device.interval, "expires_in": ttl,
                                  "revision": self.settings.revision.id.hex(), "fingerprint": peer.to_text(),
                                  "approval_path": f"/v1/login/approve/{page}"})

    async def poll(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        sid = body.get("session")
        sid = sid if isinstance(sid, str) else ""  # no session is named ""
        self._sweep()
        session = self.sessions.get(sid)
        if session is None:
            raise AuthRefused(404, "unknown-session", "no such login in progress (unknown, expired or already used)")
        try:
            signature = bytes.fromhex(str(body.get("signature", ""))[:256])
        except ValueError:
            signature = b""
        preimage = login_proof_preimage(self.settings.revision.id, sid, session.nonce, session.peer, session.provider)
        if not session.peer.verify(preimage, signature):  # checked on every poll, before the provider is asked
            self._end(sid)  # one try: a client without the key learns nothing by guessing
            raise AuthRefused(403, "bad-proof", "the signature is not the peer key's over this login's nonce")
        now = self.now()
        if now < session.next_poll_at:
            return web.json_response({"status": "pending", "interval": session.interval}, status=202)
        session.next_poll_at = now + session.interval
        provider = self.providers[session.provider]
        try:
            tokens = await provider.poll(self.http(), session.device_code)
        except AuthRefused:
            self._end(sid)
            raise
        if tokens is None:
            return web.json_response({"status": "pending", "interval": session.interval}, status=202)
        if self.sessions.get(sid) is not session:  # evicted or used while the provider was asked
            raise AuthRefused(404, "unknown-session", "this login ended while the provider was asked")
        self._end(sid)  # consumed: a second poll of this session is unknown-session
        token_digest = hashlib.sha256(provider.token_key(tokens).encode()).digest()
        if not self.used_tokens.claim(token_digest, now=now, until=now + USED_TOKEN_MEMORY_S):  # durable first
            raise AuthRefused(403, "replayed", "this provider token was used for a certificate already")
        login = await provider.identify(self.http(), tokens)
        return web.json_response(await self._issue(login, session.peer))

    async def _issue(self, login: str, peer: PeerId) -> dict[str, Any]:
        s = self.settings
        async with self._issue_lock:  # one issuance at a time: the per-login count stays exact
            if login in self.ledger.revoked_logins():
                raise AuthRefused(403, "revoked", "this login is revoked")
            held = self.ledger.peers_of(login) - {peer.to_text()}
            if len(held) >= s.max_peers_per_login:
                raise AuthRefused(403, "too-many-peers", f"this login holds {len(held)} peer id(s) already "
                                                         f"(at most {s.max_peers_per_login})")
            expires_window = None
            if s.validity_windows > 0:
                expires_window = await self._window() + s.validity_windows
            envelope = seal(s.authority, AdmissionCertificate(
                revision=s.revision.id, peer=peer, max_capacity=s.max_capacity, expires_window=expires_window,
                login=login_digest(login)))
            check_admission(envelope, s.revision.id, s.revision.manifest, peer)  # as validators will
            self.ledger.record_issue(login=login, peer=peer, expires_window=expires_window, now=self.now())
            self.issued += 1
        return {"certificate": envelope.to_bytes().hex(), "login": login, "expires_window": expires_window}

    async def _window(self) -> int:
        if self.current_window is not None:
            return await self.current_window()
        assert self.settings.edge_url is not None
        url = self.settings.edge_url.rstrip("/") + "/v1/heads/latest"
        try:
            async with self.http().get(url) as resp:
                head = await _read_json(resp, "edge")
        except aiohttp.ClientError as exc:
            raise AuthRefused(503, "edge-unavailable", f"cannot read the current window: {exc}") from None
        window = head.get("window") if isinstance(head, dict) else None
        if resp.status != 200 or not isinstance(window, int) or window < 0:
            raise AuthRefused(503, "edge-unavailable", f"the edge gave no head (HTTP {resp.status})")
        return window + 1  # the window being collected


async def _json_body(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError, web.HTTPRequestEntityTooLarge):
        raise AuthRefused(400, "bad-request", f"the body must be a JSON object of at most {MAX_REQUEST_BYTES} "
                                              "bytes") from None
    if not isinstance(body, dict):
        raise AuthRefused(400, "bad-request", "the body must be a JSON object")
    return body


@web.middleware
async def _refusals(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                    ) -> web.StreamResponse:
    """Every refusal as JSON ``{"error", "detail"}``; a provider that cannot be reached is a 502."""
    try:
        return await handler(request)
    except AuthRefused as exc:
        return web.json_response({"error": exc.code, "detail": exc.detail}, status=exc.status)
    except (aiohttp.ClientError, TimeoutError) as exc:
        return web.json_response({"error": "provider-unavailable", "detail": f"{type(exc).__name__}: {exc}"[:300]},
                                 status=502)


def allowed(values: Iterable[Any]) -> frozenset[str]:
    """A config list as a set of strings."""
    return frozenset(str(v) for v in values)
