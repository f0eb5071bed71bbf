"""`rngcoord report`: one offline HTML file per job, from a real store written by a real
coordinator; readable (bounded) at 100,000 grants; never creates a store."""

from __future__ import annotations

import re
import threading
from pathlib import Path

import pytest
from test_status import browser_missing, chromium

from harness import CoordinatorProcess, join_all, run_cli, secret_for
from rngcoord.server.audit.chain import Chain
from rngcoord.server.report import MAX_BARS
from rngcoord.server.storage import queries
from rngcoord.server.storage.sqlite import SqliteStore
from rngcoord.server.storage.store import Tx
from rngcoord.v1 import coordinator_pb2 as pb
from rngcoord.v1 import coordinator_pb2_grpc

JOB = "report-job"
REPLICA_GROUP = "tp:1[0]/replica:1"


def _grants(
    stub: coordinator_pb2_grpc.CoordinatorStub,
    group: str,
    epoch: int,
    members: list[str],
    seqs: range,
) -> None:
    for seq in seqs:
        for rank, member_id in enumerate(members):
            stub.Reserve(
                pb.ReserveRequest(
                    job=JOB,
                    group=group,
                    epoch=epoch,
                    seq=seq,
                    size=64,
                    fingerprint=b"f",
                    rank=rank,
                    member_id=member_id,
                    member_secret=secret_for(member_id),
                ),
                timeout=10,
            )


def build_history(server: CoordinatorProcess) -> None:
    """Job `JOB`: groups "a" and "b" of 2 ranks with 4 leases each; group "elastic" whose
    epoch 1 grants 4 leases, whose epoch 2 (new members) restores seq 0 to cursor 64 by both
    members' votes, then grants 3; and REPLICA_GROUP, a torchft replica's, of 1 rank with 2
    leases and a quorum record."""
    stub = server.stub()
    for group in ("a", "b"):
        replies = join_all(stub, JOB, group, 2)
        _grants(stub, group, replies[0].epoch, list(replies[0].members), range(4))
    first = join_all(stub, JOB, "elastic", 2)
    _grants(stub, "elastic", first[0].epoch, list(first[0].members), range(4))
    second = join_all(stub, JOB, "elastic", 2)
    epoch, members = second[0].epoch, list(second[0].members)
    assert epoch == first[0].epoch + 1

    def vote(rank: int) -> None:
        stub.Restore(
            pb.RestoreRequest(
                job=JOB,
                group="elastic",
                epoch=epoch,
                seq=0,
                cursor=64,
                rank=rank,
                member_id=members[rank],
                member_secret=secret_for(members[rank]),
                timeout_ms=10_000,
            ),
            timeout=20,
        )

    voters = [threading.Thread(target=vote, args=(rank,)) for rank in range(2)]
    for t in voters:
        t.start()
    for t in voters:
        t.join()
    _grants(stub, "elastic", epoch, members, range(3))
    # A torchft replica's group: 2 leases, then the quorum in which it healed from replica 0.
    (replica,) = join_all(stub, JOB, REPLICA_GROUP, 1)
    _grants(stub, REPLICA_GROUP, replica.epoch, list(replica.members), range(2))
    stub.RecordQuorum(
        pb.RecordQuorumRequest(
            job=JOB, group=REPLICA_GROUP, epoch=replica.epoch, quorum_id=7, step=12,
            participants=2, healed_from="0", rank=0, member_id=replica.members[0],
            member_secret=secret_for(replica.members[0]),
        ),
        timeout=10,
    )  # fmt: skip


@pytest.fixture(scope="module")
def history(module_store_url: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The URL of a store holding `build_history`'s job (the server has stopped), once per
    backend."""
    workdir = tmp_path_factory.mktemp("report")
    server = CoordinatorProcess(module_store_url, workdir / "server")
    try:
        server.start()
        build_history(server)
        assert server.terminate() == 0
    finally:
        server.close()
    return server.db_url


def _report(db_url: str, out: Path, job: str = JOB) -> str:
    done = run_cli("report", "--db", db_url, "--job", job, "-o", str(out))
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_report_draws_each_group_with_epochs_leases_and_the_restore(
    history: str, tmp_path: Path
) -> None:
    out = tmp_path / "report.html"
    assert "4 groups, 17 leases" in _report(history, out)
    page = out.read_text()
    assert page.count('<section class="group"') == 4
    assert page.count("<svg") == 4
    # Self-contained: nothing to fetch, nothing to run.
    assert "<script" not in page and not re.search(r'(src|href)="(https?:)?//', page)
    summary = dict(re.findall(r'data-group="([^"]+)" data-epochs="(\d+)"', page))
    assert summary == {"a": "1", "b": "1", "elastic": "2", REPLICA_GROUP: "1"}
    elastic = page[page.index('data-group="elastic">') :]
    assert "epoch 1 (2 ranks)" in elastic and "epoch 2 (2 ranks)" in elastic
    assert "restore: epoch 2 seq 0 to 64" in elastic
    assert elastic.count('id="g2-lease-1-') == 4 and elastic.count('id="g2-lease-2-') == 3
    replica = page[page.index(f'data-group="{REPLICA_GROUP}">') :]
    assert "quorum 7: step 12, 2 replicas, healed from replica 0" in replica
    assert 'id="g3-quorum-7"' in replica


def test_report_refuses_a_missing_store_or_job_and_creates_nothing(tmp_path: Path) -> None:
    missing = tmp_path / "none.db"
    done = run_cli("report", "--db", f"sqlite:///{missing}", "--job", JOB, "-o", "x.html")
    assert done.returncode == 2 and "no rngcoord store" in done.stderr
    assert not missing.exists()
    SqliteStore(tmp_path / "empty.db", create=True).close()
    empty = f"sqlite:///{tmp_path / 'empty.db'}"
    done = run_cli("report", "--db", empty, "--job", "nope", "-o", str(tmp_path / "x.html"))
    assert done.returncode == 2 and "has no job 'nope'" in done.stderr
    assert not (tmp_path / "x.html").exists()


@pytest.mark.slow
def test_report_renders_in_chromium(history: str, tmp_path: Path) -> None:
    reason = browser_missing()
    if reason is not None:
        pytest.skip(reason)
    out = tmp_path / "report.html"
    _report(history, out)
    driver = chromium()
    try:
        driver.get(out.as_uri())
        seen = driver.execute_script(
            """
            const groups = [...document.querySelectorAll("section.group")];
            return groups.map(s => ({
              group: s.dataset.group,
              width: s.querySelector("svg").getBoundingClientRect().width,
              texts: [...s.querySelectorAll("svg text")].map(t => t.textContent),
              bands: s.querySelectorAll("svg [id*='-epoch-']").length,
              restores: s.querySelectorAll("svg [id*='-restore-']").length,
            }));
            """
        )
    finally:
        driver.quit()
    assert [g["group"] for g in seen] == ["a", "b", "elastic", REPLICA_GROUP]
    assert all(g["width"] > 300 for g in seen)
    elastic = seen[2]
    assert elastic["bands"] == 2 and elastic["restores"] == 1
    assert {"epoch 1 (2 ranks)", "epoch 2 (2 ranks)"} <= set(elastic["texts"])
    assert "restore: epoch 2 seq 0 to 64" in elastic["texts"]
    assert [g["bands"] for g in seen[:2]] == [1, 1]
    assert any("quorum 7: step 12, 2 replicas" in t for t in seen[3]["texts"]), seen[3]["texts"]


def _many_grants(
    tx: Tx, grants: int, chain: Chain, *, job: str = "big", every_us: int = 1000
) -> None:
    queries.insert_job(tx, job, 1, 1_000_000)
    queries.insert_group(tx, job, "g", 2)
    queries.insert_epoch(tx, job, "g", 1, world_size=1, start=0, digest=b"", now_us=1_000_000)
    tx.executemany(
        'INSERT INTO leases (job, grp, epoch, seq, start, "end", size, fingerprint, rank, '
        "member_id, created_us) VALUES (?, 'g', 1, ?, ?, ?, ?, X'00', 0, 'm', ?)",
        [
            (
                job,
                seq,
                (seq << 10) - (1 << 63),
                ((seq + 1) << 10) - (1 << 63),
                1024 - (1 << 63),
                1_000_000 + seq * every_us,
            )
            for seq in range(grants)
        ],
    )
    tx.execute("UPDATE groups SET high_water = ? WHERE job = ?", ((grants << 10) - (1 << 63), job))


@pytest.mark.slow
def test_report_of_100000_grants_draws_at_most_max_bars(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "big.db", create=True)
    try:
        store.write(lambda tx: _many_grants(tx, 100_000, Chain(store.store_id)))
    finally:
        store.close()
    out = tmp_path / "big.html"
    assert "1 groups, 100000 leases" in _report(f"sqlite:///{tmp_path / 'big.db'}", out, "big")
    page = out.read_text()
    assert page.count('id="g0-lease-1-') == MAX_BARS
    assert len(page) < 1_500_000


@pytest.mark.slow
def test_report_of_a_job_of_seconds_reads_in_seconds_with_visible_bars(tmp_path: Path) -> None:
    reason = browser_missing()
    if reason is not None:
        pytest.skip(reason)
    store = SqliteStore(tmp_path / "short.db", create=True)
    try:
        # 6 leases over 3 s: one every 600 ms.
        store.write(
            lambda tx: _many_grants(tx, 6, Chain(store.store_id), job="short", every_us=600_000)
        )
    finally:
        store.close()
    out = tmp_path / "short.html"
    _report(f"sqlite:///{tmp_path / 'short.db'}", out, "short")
    page = out.read_text()
    assert "seconds since 1970-01-01 00:00:01 UTC" in page
    driver = chromium()
    try:
        driver.get(out.as_uri())
        seen = driver.execute_script(
            """
            const axes = document.querySelector("svg [id^='axes_']").getBoundingClientRect();
            const bars = [...document.querySelectorAll("svg [id^='g0-lease-1-']")];
            return {axes: axes.width,
                    bars: bars.map(b => b.getBoundingClientRect().width),
                    ticks: [...document.querySelectorAll("svg [id^='xtick_'] text")]
                             .map(t => t.textContent)};
            """
        )
    finally:
        driver.quit()
    assert len(seen["bars"]) == 6
    # Each bar is a visible block, not a hairline, and they do not run into each other.
    assert all(seen["axes"] / 60 < w < seen["axes"] / 6 for w in seen["bars"]), seen
    assert {"0", "1", "2", "3"} <= set(seen["ticks"]), seen["ticks"]
