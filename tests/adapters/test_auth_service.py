"""The auth service (adapters/auth_service.py, spec/auth.md) against the fake provider of tests/fake_oidc.py on
127.0.0.1: a valid login yields a certificate validators accept; every bad case (expired token, wrong
audience or issuer, tampered or foreign signature, a disallowed claim, org or account age, a replayed session
or token, a peer key the client does not hold, a revoked login, too many peers) is refused and issues
nothing. Pending logins are bounded per address and evict the oldest first, starts are rate-limited per
address, used tokens survive a restart, and the approval page and the client show the key being approved.
Clients on other addresses bind 127.0.0.2 and 127.0.0.3, which are loopback on Linux."""

from __future__ import annotations

import dataclasses
import http.client
import io
import json
import subprocess
import sys
import urllib.request

import attrs
import pytest

from peerloom.adapters.auth_service import (
    AuthService,
    AuthSettings,
    GithubPolicy,
    OidcPolicy,
    address_key,
    login_digest,
    login_proof_preimage,
)
from peerloom.adapters.keys import save_identity
from peerloom.adapters.storage import atomic_write
from peerloom.core.envelope import SignedEnvelope
from peerloom.core.objects import (
    PROTOCOL_VERSION,
    AdmissionCertificate,
    Revision,
    check_admission,
    check_revocation,
    seal,
)
from peerloom.login import LoginError, login
from tests.fake_oidc import CLIENT_ID, FakeProvider, running_service
from tests.helpers import ident, make_revision

AUTHORITY = ident(200)
GATE = ident(201)  # the manifest's admission_authority, held by the service
PEER = ident(5)
WINDOW = 7  # the window being collected, as the service's window source reports it


def certificate_revision() -> Revision:
    base = make_revision(authority=AUTHORITY)
    manifest = attrs.evolve(base.manifest, admission="certificate", admission_authority=GATE.peer_id)
    return Revision.verify(manifest.seal(AUTHORITY), AUTHORITY.peer_id)


REVISION = certificate_revision()


async def _window() -> int:
    return WINDOW


def make_service(tmp_path, provider: FakeProvider, now=None, **overrides) -> AuthService:
    oidc = overrides.pop("oidc", OidcPolicy(issuer=provider.issuer, client_id=CLIENT_ID,
                                            email_domains=frozenset({"example.edu"})))
    github = overrides.pop("github", GithubPolicy(
        client_id=CLIENT_ID, orgs=frozenset({"good-org"}), teams=frozenset({"other/trainers"}),
        min_account_age_days=30, device_url=f"{provider.issuer}/login/device/code",
        token_url=f"{provider.issuer}/login/oauth/access_token", api_url=f"{provider.issuer}/api"))
    settings = AuthSettings(revision=REVISION, authority=GATE, state_dir=tmp_path / "state", oidc=oidc, github=github,
                            max_capacity=2, validity_windows=10, **overrides)
    if now is not None:
        return AuthService(settings, current_window=_window, now=now)
    return AuthService(settings, current_window=_window)


def post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def request_from(source: str, url: str, body: dict | None = None) -> tuple[int, str]:
    """POST `body` as JSON (GET when None) to `url` from the loopback address `source`: (status, body text)."""
    rest = url.removeprefix("http://")
    hostport, _, path = rest.partition("/")
    host, _, port = hostport.partition(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10, source_address=(source, 0))
    try:
        if body is None:
            conn.request("GET", "/" + path)
        else:
            conn.request("POST", "/" + path, body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read().decode()
    finally:
        conn.close()


def start_from(source: str, url: str, peer=PEER) -> tuple[int, dict]:
    status, text = request_from(source, f"{url}/v1/login/start", {"provider": "oidc", "peer": peer.peer_id.to_text()})
    return status, json.loads(text)


def poll_status(url: str, started: dict, peer=PEER) -> int:
    body = {"session": started["session"], "signature": proof(started, signer=peer, peer=peer)}
    return post(f"{url}/v1/login/poll", body)[0]


def proof(started: dict, provider: str = "oidc", signer=PEER, peer=PEER) -> str:
    preimage = login_proof_preimage(bytes.fromhex(started["revision"]), started["session"],
                                    bytes.fromhex(started["nonce"]), peer.peer_id, provider)
    return signer.sign(preimage).hex()


def refused(service: AuthService, provider: FakeProvider, grant: dict, tmp_path, code: str, match: str = "",
            provider_name: str = "oidc") -> None:
    """A login approved with `grant` is refused with error `code` and nothing is issued."""
    provider.auto = grant
    with running_service(service) as url, pytest.raises(LoginError, match=code) as info:
        login(url, provider_name, PEER, out=io.StringIO(), timeout_s=30)
    assert match in str(info.value)
    assert service.issued == 0 and service.ledger.issued() == []


# --- valid logins ---------------------------------------------------------------------------------------

def test_valid_oidc_login_issues_a_certificate_validators_accept(tmp_path):
    with FakeProvider(auto={"claims": {}}) as provider:
        service = make_service(tmp_path, provider)
        out = io.StringIO()
        with running_service(service) as url:
            envelope = login(url, "oidc", PEER, out=out, timeout_s=30)
    assert f"{provider.issuer}/activate" in out.getvalue() and "enter the code" in out.getvalue()
    cert = check_admission(envelope, REVISION.id, REVISION.manifest, PEER.peer_id, window=WINDOW + 10)
    assert cert.max_capacity == 2 and cert.expires_window == WINDOW + 10
    assert cert.login == login_digest(f"oidc:{provider.issuer}#volunteer-1")
    with pytest.raises(Exception, match="expired"):  # a join for the window after its last
        check_admission(envelope, REVISION.id, REVISION.manifest, PEER.peer_id, window=WINDOW + 11)
    [record] = service.ledger.issued()
    assert record["peer"] == PEER.peer_id.to_text() and record["expires_window"] == WINDOW + 10


def test_github_login_admits_by_team_and_account_age(tmp_path):
    user = {"login": "Ada", "id": 42, "created_at": "2015-01-01T00:00:00Z", "orgs": [], "teams": ["other/trainers"]}
    with FakeProvider(auto={"github": user}) as provider:
        service = make_service(tmp_path, provider)
        with running_service(service) as url:
            envelope = login(url, "github", PEER, out=io.StringIO(), timeout_s=30)
    cert = check_admission(envelope, REVISION.id, REVISION.manifest, PEER.peer_id, window=WINDOW)
    assert cert.login == login_digest("github:42")


def test_pending_until_the_user_approves(tmp_path):
    with FakeProvider() as provider:
        service = make_service(tmp_path, provider)
        with running_service(service) as url:
            status, started = post(f"{url}/v1/login/start", {"provider": "oidc", "peer": PEER.peer_id.to_text()})
            assert status == 200
            body = {"session": started["session"], "signature": proof(started)}
            assert post(f"{url}/v1/login/poll", body) == (202, {"status": "pending", "interval": 0.0})
            provider.approve(started["user_code"], {"claims": {}})
            status, answer = post(f"{url}/v1/login/poll", body)
    assert status == 200 and answer["login"] == f"oidc:{provider.issuer}#volunteer-1"


# --- refusals -------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("grant", "match"), [
    ({"claims": {"exp": 1_000_000, "iat": 999_000}}, "expired"),
    ({"claims": {"aud": "someone-else"}}, "another audience"),
    ({"claims": {"iss": "https://evil.example"}}, "another issuer"),
    ({"tamper": True}, "does not verify"),
    ({"key": "rogue"}, "does not verify"),
])
def test_bad_id_tokens_are_refused(tmp_path, grant, match):
    with FakeProvider() as provider:
        refused(make_service(tmp_path, provider), provider, grant, tmp_path, "bad-token", match)


@pytest.mark.parametrize("claims", [
    {"email": "eve@elsewhere.org"},
    {"email_verified": False},  # an unverified address in an allowed domain
])
def test_disallowed_claims_are_refused(tmp_path, claims):
    with FakeProvider() as provider:
        refused(make_service(tmp_path, provider), provider, {"claims": claims}, tmp_path, "policy-refused")


def test_oidc_group_claim_admits(tmp_path):
    with FakeProvider(auto={"claims": {"email": "x@elsewhere.org"}}) as provider:
        oidc = OidcPolicy(issuer=provider.issuer, client_id=CLIENT_ID, groups=frozenset({"ml-volunteers"}))
        service = make_service(tmp_path, provider, oidc=oidc)
        with running_service(service) as url:
            assert login(url, "oidc", PEER, out=io.StringIO(), timeout_s=30) is not None
    assert service.issued == 1


@pytest.mark.parametrize(("user", "match"), [
    ({"login": "eve", "id": 9, "created_at": "2015-01-01T00:00:00Z", "orgs": ["bad-org"]}, "none of the allowed"),
    ({"login": "kid", "id": 10, "created_at": "2099-01-01T00:00:00Z", "orgs": ["good-org"]}, "days old"),
])
def test_github_disallowed_org_or_young_account_is_refused(tmp_path, user, match):
    with FakeProvider() as provider:
        refused(make_service(tmp_path, provider), provider, {"github": user}, tmp_path, "policy-refused", match,
                provider_name="github")


def test_peer_key_not_held_is_refused(tmp_path):
    """A client asks for PEER's certificate but signs with another key: refused, the session is gone, and
    the provider's token endpoint was never asked (so no login was spent)."""
    with FakeProvider(auto={"claims": {}}) as provider:
        service = make_service(tmp_path, provider)
        with running_service(service) as url:
            _, started = post(f"{url}/v1/login/start", {"provider": "oidc", "peer": PEER.peer_id.to_text()})
            body = {"session": started["session"], "signature": proof(started, signer=ident(6))}
            status, answer = post(f"{url}/v1/login/poll", body)
            assert (status, answer["error"]) == (403, "bad-proof")
            body["signature"] = proof(started)  # the right key now: too late, the session is spent
            status, answer = post(f"{url}/v1/login/poll", body)
            assert (status, answer["error"]) == (404, "unknown-session")
            # a signature over another provider's preimage does not pass either
            _, started = post(f"{url}/v1/login/start", {"provider": "oidc", "peer": PEER.peer_id.to_text()})
            status, answer = post(f"{url}/v1/login/poll", {"session": started["session"],
                                                           "signature": proof(started, provider="github")})
            assert (status, answer["error"]) == (403, "bad-proof")
    assert provider.token_requests == 0 and service.issued == 0 and service.ledger.issued() == []


def test_replayed_session_and_replayed_token_are_refused(tmp_path):
    with FakeProvider(auto={"claims": {}}) as provider:
        service = make_service(tmp_path, provider, max_peers_per_login=4)
        with running_service(service) as url:
            _, started = post(f"{url}/v1/login/start", {"provider": "oidc", "peer": PEER.peer_id.to_text()})
            body = {"session": started["session"], "signature": proof(started)}
            assert post(f"{url}/v1/login/poll", body)[0] == 200
            status, answer = post(f"{url}/v1/login/poll", body)  # the same session, used
            assert (status, answer["error"]) == (404, "unknown-session")
            # A provider (or a thief) hands the same ID token to a second login: refused.
            token = provider.id_token()
            provider.auto = {"token": token}
            assert login(url, "oidc", ident(7), out=io.StringIO(), timeout_s=30) is not None
            with pytest.raises(LoginError, match="replayed"):
                login(url, "oidc", ident(8), out=io.StringIO(), timeout_s=30)
    assert [r["peer"] for r in service.ledger.issued()] == [PEER.peer_id.to_text(), ident(7).peer_id.to_text()]


def test_used_device_code_is_refused_by_the_provider(tmp_path):
    """The device code itself cannot be spent twice (the fake, like real providers, says invalid_grant)."""
    with FakeProvider(auto={"claims": {}}) as provider:
        code = provider.device()["device_code"]
        assert provider.token({"client_id": CLIENT_ID, "device_code": code}, github=False)[0] == 200
        assert provider.token({"client_id": CLIENT_ID, "device_code": code}, github=False) == \
            (400, {"error": "invalid_grant"})


def test_one_login_holds_at_most_max_peers(tmp_path):
    with FakeProvider(auto={"claims": {}}) as provider:
        service = make_service(tmp_path, provider)
        with running_service(service) as url:
            login(url, "oidc", PEER, out=io.StringIO(), timeout_s=30)
            login(url, "oidc", PEER, out=io.StringIO(), timeout_s=30)  # renewal for the same peer: fine
            with pytest.raises(LoginError, match="too-many-peers"):
                login(url, "oidc", ident(6), out=io.StringIO(), timeout_s=30)
    assert {r["peer"] for r in service.ledger.issued()} == {PEER.peer_id.to_text()}


def test_revoked_login_gets_nothing_and_is_listed(tmp_path):
    """`peerloom auth revoke --peer` (another process) revokes the login the peer was issued to: the same
    login is refused afterwards, the peer cannot start a login, and /v1/revocations lists it."""
    with FakeProvider(auto={"claims": {}}) as provider:
        service = make_service(tmp_path, provider)
        config = write_auth_config(tmp_path, provider)
        with running_service(service) as url:
            login(url, "oidc", PEER, out=io.StringIO(), timeout_s=30)
            out = subprocess.run([sys.executable, "-m", "peerloom", "auth", "revoke", "--config", str(config),
                                  "--peer", PEER.peer_id.to_text(), "--reason", "test",
                                  "--out", str(tmp_path / "revocation.cbor")],
                                 capture_output=True, text=True)
            assert out.returncode == 0, out.stderr
            with pytest.raises(LoginError, match="revoked"):
                login(url, "oidc", PEER, out=io.StringIO(), timeout_s=30)
            with urllib.request.urlopen(f"{url}/v1/revocations", timeout=10) as resp:
                listed = json.loads(resp.read())
    digest = login_digest(f"oidc:{provider.issuer}#volunteer-1").hex()
    assert listed == {"revoked": [{"login_digest": digest, "peers": [PEER.peer_id.to_text()]}]}
    assert service.issued == 1
    # --out: the admission authority's signed revocation of the peer, for validators (spec/auth.md §6)
    revocation = check_revocation(SignedEnvelope.from_bytes((tmp_path / "revocation.cbor").read_bytes()),
                                  service.settings.revision.id, service.settings.revision.manifest)
    assert revocation.peers == (PEER.peer_id,)


def test_malformed_requests_are_refused(tmp_path):
    with FakeProvider() as provider:
        service = make_service(tmp_path, provider)
        with running_service(service) as url:
            assert post(f"{url}/v1/login/start", {"provider": "saml", "peer": "x"})[1]["error"] == "unknown-provider"
            assert post(f"{url}/v1/login/start", {"provider": "oidc", "peer": "not-a-peer"})[1]["error"] == "bad-peer"
            assert post(f"{url}/v1/login/poll", {"session": 3})[1]["error"] == "unknown-session"
            request = urllib.request.Request(f"{url}/v1/login/start", data=b"x" * 100_000, method="POST",
                                             headers={"Content-Type": "application/json"})
            with pytest.raises(urllib.error.HTTPError) as info:
                urllib.request.urlopen(request, timeout=10)
            assert info.value.code in (400, 413)


def test_discovery_with_another_issuer_is_refused(tmp_path):
    with FakeProvider(auto={"claims": {}}) as provider:
        oidc = OidcPolicy(issuer=provider.issuer + "/", client_id=CLIENT_ID)  # not the document's issuer
        refused(make_service(tmp_path, provider, oidc=oidc), provider, {"claims": {}}, tmp_path, "provider-error")


# --- the certificate object and the config ----------------------------------------------------------------

def test_certificate_fields_are_optional_and_strict():
    plain = AdmissionCertificate(revision=REVISION.id, peer=PEER.peer_id, max_capacity=1)
    assert set(plain.to_cbor()) == {"revision", "peer", "max_capacity"}  # encodes as before the fields existed
    full = attrs.evolve(plain, expires_window=3, login=bytes(32))
    assert AdmissionCertificate.from_cbor(full.to_cbor()) == full
    with pytest.raises(Exception, match="login"):
        AdmissionCertificate.from_cbor({**full.to_cbor(), "login": bytes(31)})
    envelope = seal(GATE, full)
    assert check_admission(envelope, REVISION.id, REVISION.manifest, PEER.peer_id, window=3) == full
    assert check_admission(envelope, REVISION.id, REVISION.manifest, PEER.peer_id) == full  # no window: no expiry
    assert AdmissionCertificate.from_cbor(envelope.open("admission", PROTOCOL_VERSION)) == full


def write_auth_config(tmp_path, provider: FakeProvider, extra: str = ""):
    if not (tmp_path / "gate.key").exists():
        save_identity(GATE, tmp_path / "gate.key")
    atomic_write(tmp_path / "manifest.cbor", REVISION.envelope.to_bytes())
    path = tmp_path / "auth.toml"
    path.write_text(f'listen = "127.0.0.1:0"\nkey = "gate.key"\nmanifest = "manifest.cbor"\nstate = "state"\n'
                    f'{extra}\n[oidc]\nissuer = "{provider.issuer}"\nclient_id = "{CLIENT_ID}"\n'
                    f'email_domains = ["example.edu"]\n')
    return path


def test_auth_config_is_checked(tmp_path):
    from peerloom.auth import AuthConfigError, load_settings

    with FakeProvider() as provider:
        settings, host, port = load_settings(write_auth_config(tmp_path, provider, "max_capacity = 3"))
        assert (host, port, settings.max_capacity, settings.oidc.email_domains) == \
            ("127.0.0.1", 0, 3, frozenset({"example.edu"}))
        for extra, match in [("colour = 1", "unknown keys colour"), ("max_capacity = 0", "max_capacity"),
                             ('validity_windows = "x"', "wrong type")]:
            with pytest.raises(AuthConfigError, match=match):
                load_settings(write_auth_config(tmp_path, provider, extra))
        with pytest.raises(ValueError, match="edge"):  # expiry needs a source of the current window
            AuthService(dataclasses.replace(settings, validity_windows=5))


def test_login_client_needs_no_extra_and_a_missing_extra_is_named(tmp_path):
    """`peerloom login` runs on the base install (no aiohttp, no PyJWT); `peerloom auth` without PyJWT
    names the 'auth' extra in one line."""
    hide = "import sys; sys.modules['aiohttp'] = sys.modules['jwt'] = None; "
    out = subprocess.run([sys.executable, "-c", hide + "import peerloom.login, peerloom.cli; print('ok')"],
                         capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
    out = subprocess.run([sys.executable, "-c", hide + "from peerloom.cli import main; main()", "auth", "serve",
                          "--config", str(tmp_path / "auth.toml")], capture_output=True, text=True)
    assert out.returncode == 2 and "pip install 'peerloom[auth]'" in out.stderr, out.stderr


# --- login that cannot be locked (spec/auth.md §2 "Limits", §7) --------------------------------------------

def test_address_keys():
    assert address_key("127.0.0.2") == "127.0.0.2"
    assert address_key("::ffff:192.0.2.7") == "192.0.2.7"
    assert address_key("2001:db8:1:2:3:4:5:6") == address_key("2001:db8:1:2::9") == "2001:db8:1:2::/64"
    assert address_key("2001:db8:1:3::1") != address_key("2001:db8:1:2::1")
    assert address_key(None) == address_key("not an address") == "?"


def test_pending_logins_are_bounded_per_address_and_evict_the_oldest(tmp_path):
    """One address holds at most max_sessions_per_address pending logins (its own oldest go first); a full
    table evicts the oldest login of the address that holds the most; the newcomer on another address is
    never refused and logs in."""
    with FakeProvider() as provider:
        service = make_service(tmp_path, provider, max_sessions=6, max_sessions_per_address=3,
                               starts_per_minute=1000)
        with running_service(service) as url:
            flood = [start_from("127.0.0.2", url) for _ in range(10)]
            assert all(status == 200 for status, _ in flood)
            assert len(service.sessions) == 3 and service.evicted == 7
            assert [poll_status(url, s) for _, s in flood[:7]] == [404] * 7  # its own oldest went first
            assert [poll_status(url, s) for _, s in flood[7:]] == [202] * 3
            other = [start_from("127.0.0.3", url, ident(9)) for _ in range(3)]  # the table is full now
            assert len(service.sessions) == 6
            status, mine = start_from("127.0.0.1", url, PEER)  # full: the oldest of the heaviest (.2) goes
            assert status == 200 and len(service.sessions) == 6
            assert poll_status(url, flood[7][1]) == 404
            assert [poll_status(url, s) for _, s in (*flood[8:], (0, mine))] == [202] * 3
            assert [poll_status(url, s, ident(9)) for _, s in other] == [202] * 3
            provider.approve(mine["user_code"], {"claims": {}})
            status, answer = post(f"{url}/v1/login/poll", {"session": mine["session"], "signature": proof(mine)})
    assert status == 200 and "certificate" in answer


def test_login_starts_are_rate_limited_per_address(tmp_path):
    clock = [1000.0]
    with FakeProvider() as provider:
        service = make_service(tmp_path, provider, now=lambda: clock[0], starts_per_minute=5)
        with running_service(service) as url:
            statuses = [start_from("127.0.0.2", url)[0] for _ in range(8)]
            assert statuses == [200] * 5 + [429] * 3
            assert start_from("127.0.0.2", url)[1]["error"] == "slow-down"
            assert start_from("127.0.0.1", url)[0] == 200  # another address has its own bucket
            requests = len(provider.devices)
            clock[0] += 12.0  # 5 a minute: one more start after 12 s
            assert [start_from("127.0.0.2", url)[0] for _ in range(2)] == [200, 429]
    assert requests == 6 and len(provider.devices) == 7  # a refused start never reached the provider


def test_used_token_is_refused_after_a_restart(tmp_path):
    """The used-token table is SQLite in the state directory: a new service on the same directory (a
    restart) refuses a token the old one accepted."""
    with FakeProvider() as provider:
        provider.auto = {"token": provider.id_token()}
        first = make_service(tmp_path, provider, max_peers_per_login=4)
        with running_service(first) as url:
            login(url, "oidc", ident(7), out=io.StringIO(), timeout_s=30)
        second = make_service(tmp_path, provider, max_peers_per_login=4)
        with running_service(second) as url:
            with pytest.raises(LoginError, match="replayed"):
                login(url, "oidc", ident(8), out=io.StringIO(), timeout_s=30)
            provider.auto = {"claims": {}}  # a fresh token is fine
            login(url, "oidc", ident(8), out=io.StringIO(), timeout_s=30)
    assert [r["peer"] for r in second.ledger.issued()] == [ident(7).peer_id.to_text(), ident(8).peer_id.to_text()]


def test_approval_page_and_client_show_the_key_being_approved(tmp_path):
    """RFC 8628 §5.4: the service's approval page names the peer id (the key's fingerprint) in full, with the
    provider's link and user code; the client prints the same key and the page's address. The page is gone
    once the login is used."""
    with FakeProvider() as provider:
        service = make_service(tmp_path, provider)
        with running_service(service) as url:
            status, started = start_from("127.0.0.1", url)
            assert status == 200 and started["fingerprint"] == PEER.peer_id.to_text()
            status, page = request_from("127.0.0.1", url + started["approval_path"])
            assert status == 200
            assert f'<code id="fingerprint">{PEER.peer_id.to_text()}</code>' in page
            assert started["user_code"] in page and f"{provider.issuer}/activate" in page
            assert request_from("127.0.0.1", url + "/v1/login/approve/nothing")[0] == 404
            provider.approve(started["user_code"], {"claims": {}})
            assert post(f"{url}/v1/login/poll", {"session": started["session"], "signature": proof(started)})[0] \
                == 200
            assert request_from("127.0.0.1", url + started["approval_path"])[0] == 404
            provider.auto = {"claims": {"sub": "volunteer-2"}}
            out = io.StringIO()
            login(url, "oidc", ident(6), out=out, timeout_s=30)
    printed = out.getvalue()
    assert f"This node's key (its fingerprint): {ident(6).peer_id.to_text()}" in printed
    assert f"{url}/v1/login/approve/" in printed
