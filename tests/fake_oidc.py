"""A fake OIDC and GitHub provider on 127.0.0.1 for the auth tests (no network): discovery, JWKS, the device
authorization and token endpoints (RFC 8628), and GitHub-like ``/login/device/code``,
``/login/oauth/access_token``, ``/api/user``, ``/api/user/orgs`` and ``/api/user/teams``.

A test decides what a login yields by approving its user code (`FakeProvider.approve`) or by setting
`FakeProvider.auto` before the login starts (approved at once). A grant is a dict:

- OIDC: ``{"claims": {...}}`` merged over valid defaults (iss, aud, sub, iat, exp, email, email_verified);
  ``"key": "rogue"`` signs with a key the JWKS does not hold (same ``kid``); ``"tamper": True`` flips a
  byte of the signature; ``"token": "<jwt>"`` returns that exact ID token.
- GitHub: ``{"github": {"login", "id", "created_at", "orgs": [...], "teams": ["org/slug", ...]}}``.

A device code yields its tokens once; asking again is ``invalid_grant``. Keys are EC P-256 made by
`cryptography` when the provider starts; ID tokens are ES256, minted with PyJWT.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import subprocess
import sys
import threading
import time
import urllib.parse
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import jwt
from cryptography.hazmat.primitives.asymmetric import ec

CLIENT_ID = "peerloom-test"
KID = "test-key-1"


@dataclass
class _Device:
    user_code: str
    grant: dict[str, Any] | None = None
    used: bool = False


@dataclass
class FakeProvider:
    """Start with `with FakeProvider() as provider:`; `provider.issuer` is its base URL."""

    auto: dict[str, Any] | None = None
    interval: int = 0
    devices: dict[str, _Device] = field(default_factory=dict)
    github_tokens: dict[str, dict[str, Any]] = field(default_factory=dict)
    token_requests: int = 0

    def __post_init__(self) -> None:
        self.key = ec.generate_private_key(ec.SECP256R1())
        self.rogue_key = ec.generate_private_key(ec.SECP256R1())
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.issuer = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeProvider:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    # --- what a test calls ---

    def approve(self, user_code: str, grant: dict[str, Any]) -> None:
        with self.lock:
            for device in self.devices.values():
                if device.user_code == user_code:
                    device.grant = grant
                    return
        raise KeyError(user_code)

    def id_token(self, claims: dict[str, Any] | None = None, *, key: str = "good", tamper: bool = False) -> str:
        now = int(time.time())
        body = {"iss": self.issuer, "aud": CLIENT_ID, "sub": "volunteer-1", "iat": now, "exp": now + 300,
                "email": "ada@example.edu", "email_verified": True, "groups": ["ml-volunteers"], **(claims or {})}
        token = jwt.encode(body, self.key if key == "good" else self.rogue_key, algorithm="ES256",
                           headers={"kid": KID})
        if tamper:
            head, payload, sig = token.split(".")
            token = f"{head}.{payload}.{sig[:5]}{'A' if sig[5] != 'A' else 'B'}{sig[6:]}"  # one byte differs
        return token

    def jwks(self) -> dict[str, Any]:
        jwk = json.loads(jwt.algorithms.ECAlgorithm.to_jwk(self.key.public_key()))
        return {"keys": [{**jwk, "kid": KID, "use": "sig", "alg": "ES256"}]}

    # --- endpoints ---

    def discovery(self) -> dict[str, Any]:
        return {"issuer": self.issuer, "jwks_uri": f"{self.issuer}/jwks", "token_endpoint": f"{self.issuer}/token",
                "device_authorization_endpoint": f"{self.issuer}/device",
                "authorization_endpoint": f"{self.issuer}/authorize", "response_types_supported": ["code"],
                "subject_types_supported": ["public"], "id_token_signing_alg_values_supported": ["ES256"]}

    def device(self) -> dict[str, Any]:
        code, user_code = secrets.token_urlsafe(16), secrets.token_hex(4).upper()
        with self.lock:
            self.devices[code] = _Device(user_code=user_code, grant=self.auto)
        return {"device_code": code, "user_code": user_code, "verification_uri": f"{self.issuer}/activate",
                "expires_in": 600, "interval": self.interval}

    def token(self, form: dict[str, str], github: bool) -> tuple[int, dict[str, Any]]:
        pending = 200 if github else 400  # GitHub answers errors with 200 and an "error" key
        with self.lock:
            self.token_requests += 1
            device = self.devices.get(form.get("device_code", ""))
            if form.get("client_id") != CLIENT_ID or device is None or device.used:
                return pending, {"error": "invalid_grant"}
            if device.grant is None:
                return pending, {"error": "authorization_pending"}
            device.used = True
            grant = device.grant
        if github:
            access = secrets.token_hex(20)
            self.github_tokens[access] = grant["github"]
            return 200, {"access_token": access, "token_type": "bearer", "scope": "read:org"}
        token = grant.get("token") or self.id_token(grant.get("claims"), key=grant.get("key", "good"),
                                                    tamper=grant.get("tamper", False))
        return 200, {"access_token": secrets.token_hex(16), "token_type": "Bearer", "id_token": token,
                     "expires_in": 300}

    def github_api(self, path: str, authorization: str) -> tuple[int, Any]:
        user = self.github_tokens.get(authorization.removeprefix("Bearer ").strip())
        if user is None:
            return 401, {"message": "Bad credentials"}
        if path == "/api/user":
            return 200, {"login": user["login"], "id": user["id"], "created_at": user["created_at"]}
        if path == "/api/user/orgs":
            return 200, [{"login": o} for o in user.get("orgs", ())]
        if path == "/api/user/teams":
            return 200, [{"slug": t.split("/")[1], "organization": {"login": t.split("/")[0]}}
                         for t in user.get("teams", ())]
        return 404, {"message": "Not Found"}


def _handler(provider: FakeProvider) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def _send(self, status: int, body: Any) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            path = self.path.split("?")[0]
            if path == "/.well-known/openid-configuration":
                self._send(200, provider.discovery())
            elif path == "/jwks":
                self._send(200, provider.jwks())
            elif path.startswith("/api/"):
                self._send(*provider.github_api(path, self.headers.get("Authorization", "")))
            else:
                self._send(404, {"error": "not_found"})

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            form = {k: v[0] for k, v in urllib.parse.parse_qs(self.rfile.read(length).decode()).items()}
            path = self.path.split("?")[0]
            if path in ("/device", "/login/device/code"):
                self._send(200, provider.device())
            elif path in ("/token", "/login/oauth/access_token"):
                self._send(*provider.token(form, github=path != "/token"))
            else:
                self._send(404, {"error": "not_found"})

    return Handler


@contextmanager
def running_service(service: Any):  # type: ignore[no-untyped-def]  # yields the base URL (str)
    """Serve an `AuthService`'s app on 127.0.0.1 from a background thread; yields its base URL."""
    from aiohttp import web

    loop = asyncio.new_event_loop()
    runner = web.AppRunner(service.app())
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", 0).start())
    port = runner.addresses[0][1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


# --- the auth service under test (`peerloom auth serve`, spec/auth.md) ----------------------------------------


def auth_config(provider: FakeProvider, port: int, *, edge_port: int | None = None, extra: str = "") -> str:
    """An auth.toml for `peerloom auth serve` on 127.0.0.1:`port` against `provider`, with gate.key,
    manifest.cbor and auth-state beside it; `edge_port`: the validator edge it reads the window from."""
    edge = f'validity_windows = 1000\nedge = "http://127.0.0.1:{edge_port}"\n' if edge_port is not None else ""
    return (f'listen = "127.0.0.1:{port}"\nkey = "gate.key"\nmanifest = "manifest.cbor"\nstate = "auth-state"\n'
            f'{extra}{edge}'
            f'[oidc]\nissuer = "{provider.issuer}"\nclient_id = "{CLIENT_ID}"\nemail_domains = ["example.edu"]\n')


def serve_auth(config: Path, log_path: Path, timeout_s: float = 30.0) -> subprocess.Popen[bytes]:
    """Start `peerloom auth serve --config config` (output appended to `log_path`) and wait for its
    listening line."""
    with open(log_path, "ab") as log:
        process = subprocess.Popen([sys.executable, "-m", "peerloom", "auth", "serve", "--config", str(config)],
                                   stdout=log, stderr=subprocess.STDOUT, env={**os.environ})
    deadline = time.monotonic() + timeout_s
    while "auth service on" not in log_path.read_text():
        assert process.poll() is None and time.monotonic() < deadline, log_path.read_text()
        time.sleep(0.1)
    return process


def log_in(node: Any, auth_port: int, log_path: Path) -> str:
    """`peerloom login` of fleet `node` at the auth service on `auth_port` (the provider approves it); the
    node's config then names the admission certificate it got. Returns what login printed."""
    from tests.node_cluster import peerloom

    login = peerloom("login", "--edge", f"http://127.0.0.1:{auth_port}", "--provider", "oidc",
                     "--config", str(node.config_path), "--timeout", "60")
    assert login.returncode == 0, login.stderr + log_path.read_text()
    assert "valid for joins up to window" in login.stdout, login.stdout
    node.write_config(admission="admission.cbor")
    return login.stdout


def stop_fleet(auth: subprocess.Popen[bytes] | None, nodes: Any) -> None:
    """The auth service (when it started) and then every fleet node stopped: a fleet test's `finally`."""
    if auth is not None:
        auth.terminate()
        auth.wait(timeout=15)
    for node in nodes:
        node.stop()
