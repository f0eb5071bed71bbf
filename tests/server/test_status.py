"""The status page of `rngcoord serve`: who may see it, what it and its API show, and (in a
real headless Chromium) that it follows a 4-rank gloo job live through a re-formed epoch."""

from __future__ import annotations

import http.client
import importlib.util
import json
import signal
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from harness import CoordinatorFactory, CoordinatorProcess, PostgresDatabases, join_all
from rngcoord.v1 import coordinator_pb2 as pb


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
) -> tuple[int, dict[str, str], str]:
    """One HTTP request; (status, headers, body). Redirects are not followed."""
    host, _, port = address.rpartition(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    try:
        sent = dict(headers or {})
        if token is not None:
            sent["Authorization"] = f"Bearer {token}"
        conn.request(method, path, body=body, headers=sent)
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read().decode()
    finally:
        conn.close()


def _diverge(server: CoordinatorProcess, job: str) -> None:
    """Form a 2-rank group "g" of `job`, grant seq 0 to rank 0, and make rank 1 disagree."""
    stub = server.stub()
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
            ),
            timeout=10,
            metadata=metadata,
        )

    reserve(0, 64)
    with pytest.raises(Exception, match="divergence"):
        reserve(1, 128)


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


def test_login_form_keeps_the_token_in_a_cookie(guarded: CoordinatorProcess) -> None:
    address = http_address(guarded)
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    status, _, body = get(address, "/login", method="POST", body="token=memtok", headers=form)
    assert status == 403 and "trainer" in body
    assert get(address, "/login", method="POST", body="token=x", headers=form)[0] == 401
    status, headers, _ = get(
        address,
        "/login",
        method="POST",
        body=urllib.parse.urlencode({"token": "audtok"}),
        headers=form,
    )
    assert status == 303 and headers["Location"] == "/"
    cookie = headers["Set-Cookie"]
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie
    status, _, body = get(address, "/", headers={"Cookie": cookie.split(";")[0]})
    assert status == 200 and "Signed in as <b>alice</b>" in body
    status, headers, _ = get(address, "/logout", method="POST")
    assert status == 303 and 'rngcoord_token=""' in headers["Set-Cookie"]


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
def test_workers_supervisor_serves_the_page_and_reloads_tokens_on_sighup(
    coordinator_factory: CoordinatorFactory, tmp_path: Path
) -> None:
    tokens = _tokens_file(tmp_path)
    server = coordinator_factory(
        args=["--workers", "2", "--metrics", "127.0.0.1:0", "--tokens", str(tokens)]
    )
    (serving,) = [e for e in server.log_events() if e.get("event") == "workers_serving"]
    address = serving["fields"]["metrics"]
    _diverge(server, "bert")
    assert get(address, "/", token="memtok")[0] == 403
    status, _, body = get(address, "/api/status", token="audtok")
    assert status == 200
    state = json.loads(body)
    assert [g["job"] for g in state["groups"]] == ["bert"]
    assert state["anchor"] == f"{state['store_id']}:{state['head_id']}:{state['head_hash']}:"
    assert "rngcoord_grants_total 1.0" in get(address, "/metrics")[2]
    tokens.write_text("ops admin * admtok\n")
    assert server.popen is not None
    server.popen.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while get(address, "/", token="audtok")[0] != 401:
        assert time.monotonic() < deadline, "the token file was not reloaded"
        time.sleep(0.1)
    assert get(address, "/", token="admtok")[0] == 200


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


def chromium(width: int = 1280, height: int = 1000) -> Any:
    """A headless Chromium under chromedriver (the Debian packages)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in (
        "--headless=new",
        "--no-sandbox",  # CI runs as root, where Chromium's sandbox cannot start
        "--disable-dev-shm-usage",
        "--disable-gpu",
        f"--window-size={width},{height}",
    ):
        options.add_argument(flag)
    return webdriver.Chrome(options=options, service=Service(str(CHROMEDRIVER)))


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
    args = {"addr": server.address, "ops": 100_000, "pace_s": 0.05}
    first = start_gloo("chaos", 4, tmp_path / "first", **args)
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
        second = start_gloo("chaos", 4, tmp_path / "second", **args)
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
            "return [...document.querySelectorAll('tr.record td:nth-child(5)')]"
            ".map(td => td.textContent)"
        )
        assert "epoch" in kinds and "grant" in kinds
    finally:
        driver.quit()
        for job in (first, second):
            if job is not None:
                for proc in job.procs:
                    proc.kill()
                    proc.wait()
