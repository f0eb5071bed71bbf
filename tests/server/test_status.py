"""The status page of `rngcoord serve`: who may see it, what it and its API show, and (in a
real headless Chromium) that it follows a 4-rank gloo job live through a re-formed epoch."""

from __future__ import annotations

import http.client
import importlib.util
import json
import re
import shutil
import signal
import ssl
import subprocess
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from harness import CoordinatorFactory, CoordinatorProcess, PostgresDatabases, join_all, secret_for
from rngcoord.server.web.views import GroupView, group_state
from rngcoord.v1 import coordinator_pb2 as pb
from rngcoord.v1 import coordinator_pb2_grpc


def _tokens_file(tmp_path: Path) -> Path:
    path = tmp_path / "tokens"
    path.write_text(
        "alice auditor * audtok\n"
        "trainer member * memtok\n"
        "ops admin * admtok\n"
        "llama-watcher auditor llama-* llamatok\n"
    )
    return path


def http_address(server: CoordinatorProcess) -> str:
    """The bound HTTP address of `server` ("HOST:PORT"), from its `serving` log event."""
    (serving,) = [e for e in server.log_events() if e.get("event") == "serving"]
    address: str = serving["fields"]["metrics"]
    return address


def get(
    address: str,
    path: str,
    *,
    token: str | None = None,
    headers: dict[str, str] | None = None,
    method: str = "GET",
    body: str | None = None,
    timeout_s: float = 10.0,
    tls: ssl.SSLContext | None = None,
) -> tuple[int, http.client.HTTPMessage, str]:
    """One HTTP request (HTTPS with `tls`); (status, headers, body). Redirects are not
    followed; `headers.get_all("Set-Cookie")` lists every cookie set."""
    host, _, port = address.rpartition(":")
    conn = (
        http.client.HTTPSConnection(host, int(port), timeout=timeout_s, context=tls)
        if tls is not None
        else http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    )
    try:
        sent = dict(headers or {})
        if token is not None:
            sent["Authorization"] = f"Bearer {token}"
        conn.request(method, path, body=body, headers=sent)
        response = conn.getresponse()
        return response.status, response.msg, response.read().decode()
    finally:
        conn.close()


FORM = {"Content-Type": "application/x-www-form-urlencoded"}


def set_cookies(headers: http.client.HTTPMessage) -> dict[str, tuple[str, str]]:
    """The cookies a response sets: name -> (value, the attributes as sent)."""
    found = {}
    for line in headers.get_all("Set-Cookie") or []:
        pair, _, attributes = line.partition(";")
        name, _, value = pair.partition("=")
        found[name.strip()] = (value.strip(), attributes)
    return found


def login_form(address: str, tls: ssl.SSLContext | None = None) -> tuple[str, str]:
    """GET /login: ("NAME=VALUE" of its pre-session cookie, the form token in it)."""
    status, headers, body = get(address, "/login", tls=tls)
    assert status == 200
    ((name, (value, _)),) = set_cookies(headers).items()
    found = re.search(r'name="form_token" value="([0-9a-f]+)"', body)
    assert found is not None
    return f"{name}={value}", found.group(1)


def sign_in(
    address: str,
    token: str,
    *,
    tls: ssl.SSLContext | None = None,
    origin: str | None = None,
    form: tuple[str, str] | None = None,
) -> tuple[int, http.client.HTTPMessage, str]:
    """Sign in as the page's form does: load it, post it back from this origin."""
    cookie, form_token = form if form is not None else login_form(address, tls)
    scheme = "https" if tls is not None else "http"
    return get(
        address,
        "/login",
        method="POST",
        body=urllib.parse.urlencode({"form_token": form_token, "token": token}),
        headers={**FORM, "Cookie": cookie, "Origin": origin or f"{scheme}://{address}"},
        tls=tls,
    )


def session_cookie(headers: http.client.HTTPMessage, name: str = "rngcoord_session") -> str:
    """The "NAME=VALUE" of the session cookie a sign-in set."""
    value, _ = set_cookies(headers)[name]
    return f"{name}={value}"


def logout_token(page: str) -> str:
    found = re.search(r'action="/logout".*?name="form_token" value="([^"]+)"', page, re.S)
    assert found is not None, "the page has no sign-out form"
    return found.group(1)


def _diverge(server: CoordinatorProcess, job: str, stub: Any = None) -> None:
    """Form a 2-rank group "g" of `job`, grant seq 0 to rank 0, and make rank 1 disagree."""
    stub = stub if stub is not None else server.stub()
    metadata = (("authorization", "Bearer memtok"),)
    replies = join_all(stub, job, "g", 2, metadata=metadata)
    ids = [r.members[i] for i, r in enumerate(replies)]
    epoch = replies[0].epoch

    def reserve(rank: int, size: int) -> None:
        stub.Reserve(
            pb.ReserveRequest(
                job=job,
                group="g",
                epoch=epoch,
                seq=0,
                size=size,
                fingerprint=b"f",
                rank=rank,
                member_id=ids[rank],
                member_secret=secret_for(ids[rank]),
            ),
            timeout=10,
            metadata=metadata,
        )

    reserve(0, 64)
    with pytest.raises(Exception, match="divergence"):
        reserve(1, 128)


def make_certificate(workdir: Path) -> tuple[Path, Path, ssl.SSLContext]:
    """A self-signed certificate for 127.0.0.1 and localhost: (cert, key, a client context
    that trusts it)."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl CLI is needed to make a test certificate")
    cert, key = workdir / "http.pem", workdir / "http.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return cert, key, ssl.create_default_context(cafile=str(cert))


@pytest.fixture
def guarded(coordinator_factory: CoordinatorFactory, tmp_path: Path) -> CoordinatorProcess:
    """A coordinator with a token file and its HTTP side on a free port."""
    return coordinator_factory(
        args=["--metrics", "127.0.0.1:0", "--tokens", str(_tokens_file(tmp_path))]
    )


def test_page_and_api_need_an_auditor_or_admin_token_and_metrics_none(
    guarded: CoordinatorProcess,
) -> None:
    address = http_address(guarded)
    assert get(address, "/")[0] == 401
    assert "Sign in" in get(address, "/")[2]
    assert get(address, "/", token="memtok")[0] == 403
    assert get(address, "/", token="nope")[0] == 401
    assert get(address, "/", headers={"Authorization": "Basic YTpi"})[0] == 401
    assert get(address, "/", token="audtok")[0] == 200
    assert get(address, "/", token="admtok")[0] == 200
    status, _, body = get(address, "/api/status")
    assert status == 401 and "auditor or admin" in json.loads(body)["error"]
    assert get(address, "/api/audit", token="memtok")[0] == 403
    assert get(address, "/partials/groups", token="memtok")[0] == 403
    status, headers, body = get(address, "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    assert "rngcoord_grants_total" in body
    # A cookie holding a token is no way in: only a session id is.
    assert get(address, "/", headers={"Cookie": "rngcoord_session=audtok"})[0] == 401
    assert get(address, "/", headers={"Cookie": "rngcoord_token=audtok"})[0] == 401


def test_sign_in_opens_a_server_side_session_that_sign_out_ends(
    guarded: CoordinatorProcess,
) -> None:
    address = http_address(guarded)
    status, _, body = sign_in(address, "memtok")
    assert status == 403 and "trainer" in body
    assert sign_in(address, "x")[0] == 401
    status, headers, _ = sign_in(address, "audtok")
    assert status == 303 and headers["Location"] == "/"
    cookies = set_cookies(headers)
    value, attributes = cookies["rngcoord_session"]
    assert "audtok" not in value and len(value) >= 43  # 256 random bits, url-safe base64
    assert {"HttpOnly", "SameSite=Strict", "Path=/", "Max-Age=43200"} <= {
        a.strip() for a in attributes.split(";")
    }
    assert "Secure" not in attributes  # plain HTTP: a Secure cookie would never come back
    assert not any("audtok" in line for line in headers.get_all("Set-Cookie") or [])
    cookie = session_cookie(headers)
    assert session_cookie(sign_in(address, "audtok")[1]) != cookie
    status, headers, page = get(address, "/", headers={"Cookie": cookie})
    assert status == 200 and "Signed in as <b>alice</b>" in page
    assert headers["Cache-Control"] == "no-store"
    assert get(address, "/api/status", headers={"Cookie": cookie})[0] == 200

    here = {**FORM, "Cookie": cookie, "Origin": f"http://{address}"}
    form_token = logout_token(page)
    for refused in (
        get(address, "/logout", method="POST", body="", headers=here),
        get(address, "/logout", method="POST", body="form_token=00", headers=here),
        get(
            address,
            "/logout",
            method="POST",
            body=f"form_token={form_token}",
            headers={**here, "Origin": "http://evil.example"},
        ),
    ):
        assert refused[0] == 403
    assert get(address, "/", headers={"Cookie": cookie})[0] == 200
    status, headers, _ = get(
        address, "/logout", method="POST", body=f"form_token={form_token}", headers=here
    )
    assert status == 303 and headers["Location"] == "/login"
    assert set_cookies(headers)["rngcoord_session"][0] in ("", '""')
    # Ended on the server: the old id, replayed, is refused.
    assert get(address, "/", headers={"Cookie": cookie})[0] == 401
    events = [e["event"] for e in guarded.log_events()]
    assert "status_login" in events and "status_logout" in events


def test_sign_in_refuses_cross_site_posts_and_bad_form_tokens(guarded: CoordinatorProcess) -> None:
    address = http_address(guarded)
    cookie, form_token = login_form(address)
    for origin in ("http://evil.example", "null", f"https://{address}"):
        status, headers, _ = sign_in(address, "audtok", origin=origin, form=(cookie, form_token))
        assert status == 403 and "rngcoord_session" not in set_cookies(headers), origin
    token_only = urllib.parse.urlencode({"form_token": form_token, "token": "audtok"})
    # Neither Origin nor Referer: nothing says where the form came from.
    status, _, _ = get(
        address, "/login", method="POST", body=token_only, headers={**FORM, "Cookie": cookie}
    )
    assert status == 403
    cross_referer = {**FORM, "Cookie": cookie, "Referer": "http://evil.example/x"}
    assert get(address, "/login", method="POST", body=token_only, headers=cross_referer)[0] == 403
    other_cookie, other_token = login_form(address)
    assert other_cookie != cookie
    for form in ((cookie, ""), (cookie, "0" * 64), (cookie, other_token), ("x=y", form_token)):
        assert sign_in(address, "audtok", form=form)[0] == 403, form
    refused = [e for e in guarded.log_events() if e.get("event") == "status_csrf_refused"]
    assert len(refused) == 9
    # The same form, from this site (a Referer is enough without an Origin), signs in.
    own_referer = {**FORM, "Cookie": cookie, "Referer": f"http://{address}/login"}
    status, headers, _ = get(address, "/login", method="POST", body=token_only, headers=own_referer)
    assert status == 303 and "rngcoord_session" in set_cookies(headers)


def test_every_response_carries_the_security_headers(guarded: CoordinatorProcess) -> None:
    address = http_address(guarded)
    for path, token, status in (
        ("/", None, 401),
        ("/", "audtok", 200),
        ("/login", None, 200),
        ("/api/status", None, 401),
        ("/api/status", "audtok", 200),
        ("/partials/groups", "audtok", 200),
        ("/metrics", None, 200),
        ("/static/status.js", None, 200),
        ("/static/nope.js", None, 404),
        ("/nope", "audtok", 404),
    ):
        got, headers, _ = get(address, path, token=token)
        assert got == status, path
        csp = headers["Content-Security-Policy"]
        assert "default-src 'none'" in csp and "script-src 'self'" in csp, path
        assert "frame-ancestors 'none'" in csp and "unsafe-inline" not in csp
        assert headers["X-Frame-Options"] == "DENY"
        assert headers["X-Content-Type-Options"] == "nosniff"
        assert headers["Referrer-Policy"] == "same-origin"
        if not path.startswith("/static/"):
            assert headers["Cache-Control"] == "no-store", path
    # The CSP allows no inline script or style, so the page must carry none.
    page = get(address, "/", token="audtok")[2]
    assert re.findall(r"<script[^>]*>", page) == ['<script src="/static/status.js">']
    assert "<style" not in page and " style=" not in page
    assert "audtok" not in page
    status, headers, script = get(address, "/static/status.js")
    assert headers["Content-Type"].startswith("text/javascript") and "applyFilter" in script


@pytest.mark.slow
def test_a_session_ends_when_its_lifetime_is_over(
    coordinator_factory: CoordinatorFactory, tmp_path: Path
) -> None:
    server = coordinator_factory(
        args=["--metrics", "127.0.0.1:0", "--tokens", str(_tokens_file(tmp_path))],
        env={"RNGCOORD_STATUS_SESSION_S": "2"},
    )
    address = http_address(server)
    signed_in = time.monotonic()
    status, headers, _ = sign_in(address, "audtok")
    assert status == 303 and "Max-Age=2" in set_cookies(headers)["rngcoord_session"][1]
    cookie = session_cookie(headers)
    assert get(address, "/", headers={"Cookie": cookie})[0] == 200
    # The browser would drop the cookie at Max-Age; the server must not rely on it.
    time.sleep(max(0.0, signed_in + 2.3 - time.monotonic()))
    assert get(address, "/", headers={"Cookie": cookie})[0] == 401


def test_a_token_reload_ends_every_session(guarded: CoordinatorProcess, tmp_path: Path) -> None:
    address = http_address(guarded)
    admin = session_cookie(sign_in(address, "admtok")[1])
    auditor = session_cookie(sign_in(address, "audtok")[1])
    assert get(address, "/", headers={"Cookie": auditor})[0] == 200
    # alice's token changes; ops keeps his: the server keeps no token to tell them apart, so
    # both sessions end, and ops signs in again with the same token.
    (tmp_path / "tokens").write_text("alice auditor * audtok2\nops admin * admtok\n")
    assert guarded.popen is not None
    guarded.popen.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while get(address, "/", headers={"Cookie": auditor})[0] != 401:
        assert time.monotonic() < deadline, "the reload did not end the session"
        time.sleep(0.05)
    assert get(address, "/", headers={"Cookie": admin})[0] == 401
    assert get(address, "/", token="audtok")[0] == 401
    assert sign_in(address, "admtok")[0] == 303
    ended = [e for e in guarded.log_events() if e.get("event") == "status_sessions_ended"]
    assert ended and ended[0]["fields"]["sessions"] == 2


def test_the_http_side_serves_tls_with_the_server_certificate(
    coordinator_factory: CoordinatorFactory, tmp_path: Path
) -> None:
    cert, key, trust = make_certificate(tmp_path)
    server = coordinator_factory(
        args=["--metrics", "127.0.0.1:0", "--tokens", str(_tokens_file(tmp_path)),
              "--tls-cert", str(cert), "--tls-key", str(key)]
    )  # fmt: skip
    address = http_address(server)
    assert get(address, "/api/status", token="audtok", tls=trust)[0] == 200
    assert get(address, "/metrics", tls=trust)[0] == 200
    with pytest.raises((http.client.HTTPException, OSError)):
        get(address, "/metrics")  # plain HTTP on the TLS port
    status, headers, _ = sign_in(address, "audtok", tls=trust)
    assert status == 303
    value, attributes = set_cookies(headers)["__Host-rngcoord_session"]
    assert {"Secure", "HttpOnly", "SameSite=Strict", "Path=/"} <= {
        a.strip() for a in attributes.split(";")
    }
    cookie = f"__Host-rngcoord_session={value}"
    assert get(address, "/", headers={"Cookie": cookie}, tls=trust)[0] == 200
    # The same session id sent over another scheme's cookie name is not a session.
    assert get(address, "/", headers={"Cookie": f"rngcoord_session={value}"}, tls=trust)[0] == 401


def test_page_and_api_show_groups_members_leases_and_a_divergence(
    coordinator_factory: CoordinatorFactory, store_url: str, tmp_path: Path
) -> None:
    guarded = coordinator_factory(
        store_url, args=["--metrics", "127.0.0.1:0", "--tokens", str(_tokens_file(tmp_path))]
    )
    _diverge(guarded, "bert")
    _diverge(guarded, "llama-7b")
    address = http_address(guarded)
    everything = json.loads(get(address, "/api/audit?limit=500", token="admtok")[2])
    # The anchored head is the coordinator's, read by its change feed: a poll behind at most.
    deadline = time.monotonic() + 10
    while True:
        status, _, body = get(address, "/api/status", token="audtok")
        assert status == 200
        state = json.loads(body)
        if state["head_id"] == everything["last_id"] or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert state["store_id"] and state["anchor"].startswith(state["store_id"] + ":")
    assert state["head_id"] == everything["last_id"] > 0
    (bert,) = [g for g in state["groups"] if g["job"] == "bert"]
    assert (bert["epoch"], bert["world_size"], bert["leases"], bert["leases_total"]) == (1, 2, 1, 1)
    assert bert["diverged_ranks"] == [0, 1] and "disagree" in bert["divergence"]
    assert [m["rank"] for m in bert["members"]] == [0, 1]
    assert all(m["member_id"] and m["peer"] and m["left_us"] is None for m in bert["members"])
    assert int(bert["high_water"]) == 64 and 0 < bert["used_share"] < 1e-15

    status, _, page = get(address, "/", token="audtok")
    assert status == 200
    assert 'data-group="g"' in page and "ranks 0, 1 disagree" in page
    assert state["store_id"] in page and state["anchor"] in page
    assert 'class="record"' in page and "grant" in page

    # An auditor of llama-* sees only that job, in the groups and in the audit tail.
    restricted = json.loads(get(address, "/api/status", token="llamatok")[2])
    assert {g["job"] for g in restricted["groups"]} == {"llama-7b"}
    tail = json.loads(get(address, "/api/audit?limit=500", token="llamatok")[2])
    assert tail["records"] and {r["job"] for r in tail["records"]} == {"llama-7b"}

    ids = [r["id"] for r in everything["records"]]
    assert ids == sorted(ids) and everything["last_id"] == ids[-1]
    newer = json.loads(get(address, f"/api/audit?after={ids[-1]}", token="admtok")[2])
    assert newer == {"records": [], "last_id": ids[-1]}
    assert get(address, "/api/audit?after=x", token="admtok")[0] == 400
    assert get(address, "/api/audit?limit=501", token="admtok")[0] == 400


def _leave_all(stub: Any, job: str, replies: list[Any], metadata: Any) -> None:
    for rank, reply in enumerate(replies):
        stub.LeaveGroup(
            pb.LeaveGroupRequest(
                job=job,
                group="g",
                epoch=reply.epoch,
                rank=rank,
                member_id=reply.members[rank],
                member_secret=secret_for(reply.members[rank]),
            ),
            timeout=10,
            metadata=metadata,
        )


def _job_order(page: str) -> list[tuple[str, str]]:
    """(state, job) of each job on `page`, in page order."""
    return re.findall(r'<div class="job" data-job="([^"]+)" data-state="([^"]+)"', page)


def test_page_groups_jobs_by_state_newest_first_with_a_readable_audit_tail(
    guarded: CoordinatorProcess,
) -> None:
    stub = guarded.stub()
    metadata = (("authorization", "Bearer memtok"),)
    done = join_all(stub, "done-job", "g", 2, metadata=metadata)
    _leave_all(stub, "done-job", done, metadata)
    _diverge(guarded, "older-job")
    time.sleep(0.05)
    _diverge(guarded, "newer-job")
    address = http_address(guarded)
    state = json.loads(get(address, "/api/status", token="audtok")[2])
    states = {g["job"]: g["state"] for g in state["groups"]}
    assert states == {"done-job": "finished", "older-job": "active", "newer-job": "active"}
    page = get(address, "/", token="audtok")[2]
    assert _job_order(page) == [
        ("newer-job", "active"),
        ("older-job", "active"),
        ("done-job", "finished"),
    ]
    assert '<section class="state" data-state="idle">' not in page  # no idle job: no section
    assert 'id="filter"' in page
    # The audit tail: newest first, a column each for kind, job, group, epoch, offsets,
    # actor; hashes only on hover.
    rows = re.findall(r'<tr class="record" data-id="(\d+)" title="([^"]*)">(.*?)</tr>', page, re.S)
    ids = [int(i) for i, _, _ in rows]
    assert ids == sorted(ids, reverse=True)
    grant = next(r for r in rows if ">grant<" in r[2] and ">older-job<" in r[2])
    cells = [re.sub(r"<[^>]+>", "", c).strip() for c in re.findall(r"<td.*?</td>", grant[2], re.S)]
    assert cells[2:7] == ["grant", "older-job", "g", "1", "0\u201364"]
    assert "seq 0" in cells[7] and "rank 0" in cells[7] and "rank " in cells[8]
    assert "hash " in grant[1] and "prev " in grant[1] and "fingerprint 66" in grant[1]
    assert not re.search(r"[0-9a-f]{32}", grant[2]), "a hash is shown in the row itself"


def test_group_states_from_activity_and_members() -> None:
    now = 1_000_000_000_000

    def view(**kw: Any) -> GroupView:
        base: dict[str, Any] = dict(
            job="j", group="g", epoch=1, world_size=2, epoch_start=0,
            epoch_created_us=now - 3_600_000_000, high_water=0, leases=0, leases_total=0,
            restores=0, left=0, waiting=0, divergence=None, diverged_ranks=(),
        )  # fmt: skip
        return GroupView(**{**base, **kw})

    assert group_state(view(), now, 60) == "idle"
    assert group_state(view(last_grant_us=now - 5_000_000), now, 60) == "active"
    assert group_state(view(waiting=1), now, 60) == "active"
    assert group_state(view(left=2, last_grant_us=now), now, 60) == "finished"
    assert group_state(view(world_size=0, epoch=0, epoch_created_us=0), now, 60) == "idle"


def test_page_is_open_without_a_token_file_or_with_status_open(
    coordinator_factory: CoordinatorFactory, tmp_path: Path
) -> None:
    bare = coordinator_factory(args=["--metrics", "127.0.0.1:0"])
    assert get(http_address(bare), "/")[0] == 200
    opened = [e for e in bare.log_events() if e.get("event") == "status_page_open"]
    assert opened and opened[0]["fields"]["reason"] == "no token file"
    flagged = coordinator_factory(
        args=["--metrics", "127.0.0.1:0", "--tokens", str(_tokens_file(tmp_path)), "--status-open"]
    )
    assert get(http_address(flagged), "/api/status")[0] == 200


def test_metrics_off_opens_no_http_port(coordinator: CoordinatorProcess) -> None:
    assert http_address(coordinator) == "off"


@pytest.mark.slow  # each read waits out the pool's connection timeout
def test_a_lost_database_is_answered_503(
    coordinator_factory: CoordinatorFactory, postgres_url_factory: Callable[[], str]
) -> None:
    url = postgres_url_factory()
    server = coordinator_factory(url, args=["--metrics", "127.0.0.1:0"])
    address = http_address(server)
    assert get(address, "/api/status")[0] == 200
    PostgresDatabases().drop(url)
    # The first read after the drop waits for the reader pool's connect timeout (10 s) before
    # it knows the database is gone; on two busy cores the answer can take a little longer.
    status, _, body = get(address, "/api/status", timeout_s=60)
    assert status == 503 and "the store is unavailable" in json.loads(body)["error"]
    status, _, body = get(address, "/", timeout_s=60)
    assert status == 503 and "the store is unavailable" in body


@pytest.mark.slow
def test_workers_supervisor_serves_the_page_over_tls_and_reloads_tokens_on_sighup(
    coordinator_factory: CoordinatorFactory, tmp_path: Path
) -> None:
    tokens = _tokens_file(tmp_path)
    cert, key, trust = make_certificate(tmp_path)
    server = coordinator_factory(
        args=["--workers", "2", "--metrics", "127.0.0.1:0", "--tokens", str(tokens),
              "--tls-cert", str(cert), "--tls-key", str(key)]
    )  # fmt: skip
    (serving,) = [e for e in server.log_events() if e.get("event") == "workers_serving"]
    address = serving["fields"]["metrics"]
    stub = coordinator_pb2_grpc.CoordinatorStub(
        server.channel(grpc.ssl_channel_credentials(cert.read_bytes()))
    )
    _diverge(server, "bert", stub)
    with pytest.raises((http.client.HTTPException, OSError)):
        get(address, "/metrics")  # plain HTTP on the TLS port
    assert get(address, "/", token="memtok", tls=trust)[0] == 403
    status, _, body = get(address, "/api/status", token="audtok", tls=trust)
    assert status == 200
    state = json.loads(body)
    assert [g["job"] for g in state["groups"]] == ["bert"]
    assert state["anchor"] == f"{state['store_id']}:{state['head_id']}:{state['head_hash']}:"
    assert "rngcoord_grants_total 1.0" in get(address, "/metrics", tls=trust)[2]
    status, headers, _ = sign_in(address, "audtok", tls=trust)
    assert status == 303 and "Secure" in set_cookies(headers)["__Host-rngcoord_session"][1]
    cookie = session_cookie(headers, "__Host-rngcoord_session")
    assert get(address, "/", headers={"Cookie": cookie}, tls=trust)[0] == 200
    tokens.write_text("ops admin * admtok\n")
    assert server.popen is not None
    server.popen.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while get(address, "/", token="audtok", tls=trust)[0] != 401:
        assert time.monotonic() < deadline, "the token file was not reloaded"
        time.sleep(0.1)
    assert get(address, "/", token="admtok", tls=trust)[0] == 200
    assert get(address, "/", headers={"Cookie": cookie}, tls=trust)[0] == 401


# ------------------------------------------------------------------------------ browser

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")


def browser_missing() -> str | None:
    """Why no headless Chromium can run here, or None."""
    if importlib.util.find_spec("selenium") is None:
        return "selenium is not installed (it is in the dev extra)"
    for path in (CHROMIUM, CHROMEDRIVER):
        if not path.exists():
            return f"{path} is missing: apt-get install chromium chromium-driver"
    return None


def chromium(width: int = 1280, height: int = 1000, *, insecure_certs: bool = False) -> Any:
    """A headless Chromium under chromedriver (the Debian packages); its console log is
    kept (`driver.get_log("browser")`). With `insecure_certs` it accepts a self-signed
    server certificate."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    options.accept_insecure_certs = insecure_certs
    for flag in (
        "--headless=new",
        "--no-sandbox",  # CI runs as root, where Chromium's sandbox cannot start
        "--disable-dev-shm-usage",
        "--disable-gpu",
        f"--window-size={width},{height}",
    ):
        options.add_argument(flag)
    return webdriver.Chrome(options=options, service=Service(str(CHROMEDRIVER)))


def _await_element(driver: Any, element_id: str, timeout_s: float = 20.0) -> None:
    """Wait for the page that a click started to show `element_id`. A click that submits a
    form returns before the next page loads (CI once looked for sign-in on the page it was
    leaving), so a plain find_element after it races the navigation."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(driver, timeout_s).until(
        expected_conditions.presence_of_element_located((By.ID, element_id))
    )


def _group_state(driver: Any, job: str) -> dict[str, Any] | None:
    """What the page in `driver` shows of `job`'s group (the first), or None."""
    state: dict[str, Any] | None = driver.execute_script(
        """
        const g = document.querySelector(`.group[data-job="${arguments[0]}"]`);
        if (!g) return null;
        return {epoch: Number(g.dataset.epoch), leases: Number(g.dataset.leases),
                world: Number(g.dataset.members),
                members: g.querySelectorAll("tr.member:not(.left)").length,
                marker: window.rngcoordTestMarker === true};
        """,
        job,
    )
    return state


def _wait_for(
    driver: Any, job: str, test: Any, what: str, timeout_s: float = 60.0
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    state = None
    while time.monotonic() < deadline:
        state = _group_state(driver, job)
        if state is not None and test(state):
            return state
        time.sleep(0.2)
    raise AssertionError(f"the page never showed {what}; last seen: {state}")


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_page_follows_a_gloo_job_live_through_a_new_epoch(
    coordinator_factory: CoordinatorFactory, tmp_path: Path
) -> None:
    reason = browser_missing()
    if reason is not None:
        pytest.skip(reason)
    from client.programs import start_gloo

    server = coordinator_factory(args=["--metrics", "127.0.0.1:0"])
    address = http_address(server)
    args: dict[str, Any] = {"addr": server.address, "ops": 100_000, "pace_s": 0.05}
    first = start_gloo("chaos", 4, tmp_path / "first", run_id="chaos-run", **args)
    second = None
    driver = chromium()
    try:
        driver.get(f"http://{address}/")
        # Set once: a full reload of the page would lose it.
        driver.execute_script("window.rngcoordTestMarker = true;")
        state = _wait_for(
            driver, "chaos", lambda s: s["members"] == 4 and s["leases"] > 0, "4 members"
        )
        assert (state["epoch"], state["world"]) == (1, 4)
        grown = _wait_for(
            driver, "chaos", lambda s: s["leases"] > state["leases"] + 2, "the leases grow"
        )
        assert grown["epoch"] == 1 and grown["marker"]

        # A rank dies; as torchelastic would, the others are stopped and all 4 start again.
        first.procs[3].kill()
        for proc in first.procs:
            proc.kill()
            proc.wait()
        second = start_gloo("chaos", 4, tmp_path / "second", run_id="chaos-run", restart=1, **args)
        reformed = _wait_for(
            driver,
            "chaos",
            lambda s: s["epoch"] == 2 and s["members"] == 4 and s["leases"] > 0,
            "epoch 2 with 4 members",
        )
        assert reformed["marker"], "the page was reloaded"
        rows = driver.execute_script("return document.querySelectorAll('tr.record').length")
        assert rows > 0
        kinds = driver.execute_script(
            "return [...document.querySelectorAll('tr.record td.kind')].map(td => td.textContent)"
        )
        assert "epoch" in kinds and "grant" in kinds
    finally:
        driver.quit()
        for job in (first, second):
            if job is not None:
                for proc in job.procs:
                    proc.kill()
                    proc.wait()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_browser_signs_in_over_tls_and_filters_jobs_under_the_csp(
    coordinator_factory: CoordinatorFactory, tmp_path: Path
) -> None:
    reason = browser_missing()
    if reason is not None:
        pytest.skip(reason)
    from selenium.webdriver.common.by import By

    cert, key, _ = make_certificate(tmp_path)
    server = coordinator_factory(
        args=["--metrics", "127.0.0.1:0", "--tokens", str(_tokens_file(tmp_path)),
              "--tls-cert", str(cert), "--tls-key", str(key)]
    )  # fmt: skip
    address = http_address(server)
    stub = coordinator_pb2_grpc.CoordinatorStub(
        server.channel(grpc.ssl_channel_credentials(cert.read_bytes()))
    )
    metadata = (("authorization", "Bearer memtok"),)
    done = join_all(stub, "finished-run_with_a_long_name", "g", 2, metadata=metadata)
    _leave_all(stub, "finished-run_with_a_long_name", done, metadata)
    for job in ("bert-large", "llama-7b-pretraining-run-0042"):
        _diverge(server, job, stub)
    # Narrow, so that long names would wrap if they could.
    driver = chromium(700, 1200, insecure_certs=True)
    try:
        driver.get(f"https://{address}/")
        driver.find_element(By.ID, "token").send_keys("audtok")
        driver.find_element(By.ID, "sign-in").click()
        _await_element(driver, "sign-out")
        cookies = {c["name"]: c for c in driver.get_cookies()}
        session = cookies["__Host-rngcoord_session"]
        assert session["secure"] and session["httpOnly"] and session["sameSite"] == "Strict"
        assert session["value"] != "audtok"
        assert driver.execute_script("return document.cookie") == ""

        def visible_jobs() -> list[str]:
            jobs: list[str] = driver.execute_script(
                "return [...document.querySelectorAll('#groups .job')]"
                ".filter(j => !j.hidden).map(j => j.dataset.job)"
            )
            return jobs

        assert visible_jobs() == [
            "llama-7b-pretraining-run-0042",
            "bert-large",
            "finished-run_with_a_long_name",
        ]
        driver.execute_script("window.rngcoordTestMarker = true;")
        driver.find_element(By.ID, "filter").send_keys("llama")
        assert visible_jobs() == ["llama-7b-pretraining-run-0042"]
        # The filter holds across the live refreshes that replace the groups.
        before = driver.execute_script("return document.getElementById('groups-body').dataset.now")
        deadline = time.monotonic() + 20
        while (
            driver.execute_script("return document.getElementById('groups-body').dataset.now")
            == before
        ):
            assert time.monotonic() < deadline, "the page never refreshed (is its script blocked?)"
            time.sleep(0.2)
        assert visible_jobs() == ["llama-7b-pretraining-run-0042"]
        assert driver.execute_script("return window.rngcoordTestMarker === true")
        driver.find_element(By.ID, "filter").clear()
        driver.find_element(By.CSS_SELECTOR, "input.show-state[value=active]").click()
        assert visible_jobs() == ["finished-run_with_a_long_name"]
        wrapped = driver.execute_script(
            "return [...document.querySelectorAll('.name')]"
            ".filter(e => e.offsetParent !== null && e.getClientRects().length > 1)"
            ".map(e => e.textContent)"
        )
        assert wrapped == []
        heights = driver.execute_script(
            "return [...document.querySelectorAll('tr.record td.name')]"
            ".filter(e => e.textContent.length > 20)"
            ".map(e => [e.getBoundingClientRect().height, "
            "e.parentElement.querySelector('td.kind').getBoundingClientRect().height])"
        )
        assert heights and all(abs(name - kind) < 1 for name, kind in heights)
        title = driver.execute_script("return document.querySelector('tr.record').title")
        assert "hash " in title
        # The first load's 401 and the favicon's 404 are expected; a refused script or
        # style, or a script error, is not.
        problems = [
            entry["message"]
            for entry in driver.get_log("browser")
            if "Content Security Policy" in entry["message"]
            or (entry["level"] == "SEVERE" and "Failed to load resource" not in entry["message"])
        ]
        assert problems == []
        driver.find_element(By.ID, "sign-out").click()
        _await_element(driver, "sign-in")
        driver.get(f"https://{address}/")
        assert driver.find_element(By.ID, "sign-in")
    finally:
        driver.quit()
    assert get(address, "/", headers={"Cookie": f"__Host-rngcoord_session={session['value']}"},
               tls=ssl.create_default_context(cafile=str(cert)))[0] == 401  # fmt: skip
