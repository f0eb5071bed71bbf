"""The database primary dies and a standby is promoted, under two coordinator replicas.

PostgreSQL clusters of the test's own (tests/pg_clusters.py): a primary and a streaming
standby on ephemeral ports; the replicas' ``--db`` is libpq's multi-host URL with
``target_session_attrs=read-write``, so every connection they open finds whichever cluster is
the writable primary. The storm of tests/server/storm.py runs while the whole primary is
SIGKILLed (postmaster and children, as a host crash) and the standby is promoted with
``pg_ctl promote``: with synchronous replication every lease a client was given before the
kill reads back identically from the promoted store, no two grants overlap, the coordinators
go on granting without a restart, and ``rngcoord verify`` passes. Each replica logs the
primary's replication mode when it connects and again when a reconnect finds another mode;
``--require-sync-replication`` refuses an asynchronous primary.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families
from replica_client import FINGERPRINT, lease_size
from storm import JOB, Storm, check_agreement, check_read_back, check_verify

import pg_clusters
from harness import CoordinatorProcess, join_all, run_cli, secret_for
from rngcoord.client import CoordinatorClient
from rngcoord.client._connection import adopt_member_secret
from rngcoord.server.errors import Unavailable
from rngcoord.server.storage.postgres import PostgresStore
from rngcoord.v1 import coordinator_pb2 as pb
from rngcoord.v1.status import HEAD_TRAILER
from rngcoord.v1.types import Lease

pytestmark = pytest.mark.slow


def test_a_synchronous_standby_is_promoted_and_no_acknowledged_lease_is_lost(
    pg_pair: Callable[..., pg_clusters.PostgresPair],
    coordinator_factory: Callable[..., CoordinatorProcess],
    tmp_path: Path,
) -> None:
    pair = pg_pair(synchronous=True)
    pair.create_database("rngcoord")
    db_url = pair.database_url("rngcoord")
    metrics = ("--metrics", "127.0.0.1:0")
    replicas = [coordinator_factory(db_url, args=metrics), coordinator_factory(db_url)]
    assert _replication_shown(replicas[0]) == (1.0, True)
    with Storm(replicas, tmp_path) as storm:
        storm.wait_for_progress({})
        before = storm.lease_counts()
        pair.kill_primary()
        killed = time.monotonic()
        pair.promote()
        promoted = time.monotonic() - killed
        # When every member had received another lease (docs/operations.md records it): how
        # long the failover held up the slowest rank, at most.
        while not all(n > before[m] for m, n in storm.lease_counts().items()):
            assert time.monotonic() - killed < 90, "a member got no lease after the kill"
            time.sleep(0.01)
        all_served = time.monotonic() - killed
        # Every member gets more leases from the promoted store, from the same processes.
        storm.wait_for_progress(before, timeout_s=90)
        chains = check_agreement(storm.finish(), one_grant_each=False)
    assert all(r.popen is not None and r.popen.poll() is None for r in replicas), "a replica exited"
    for replica in replicas:
        check_read_back(replica.address, chains)
    check_verify(db_url)
    # Each replica logged the synchronous primary, then, after its writer reconnected, the
    # promoted one, which has no standby of its own and so no longer replicates synchronously.
    # A write through each one first: the storm's clients may all have failed over to the
    # other replica, and reads alone never reconnect a writer.
    for n, replica in enumerate(replicas):
        join_all(replica.stub(), "after-failover", f"g{n}", 1)
    for replica in replicas:
        assert [e["synchronous"] for e in _replication_events(replica)] == [True, False]
    # /metrics and the status page show it too.
    assert _replication_shown(replicas[0]) == (0.0, False)
    print(
        f"promoted {promoted:.2f} s after the kill, every member served again after "
        f"{all_served:.2f} s; "
        f"{sum(before.values())} leases before the kill"
    )


def test_a_standby_that_lost_acknowledged_grants_is_served_again_never_regranted(
    pg_pair: Callable[..., pg_clusters.PostgresPair],
    coordinator_factory: Callable[..., CoordinatorProcess],
    tmp_path: Path,
) -> None:
    """Asynchronous replication, and a standby cut off from the primary's WAL while grants go
    on being acknowledged: promoted, it lacks them. Every replica notices that the store went
    back in time (the audit record it saw committed is gone) before it grants from it, drops
    what it believed about the lost records, audits a `rewind` and serves the store as it now
    is: a job the loss never touched is served on, a lost lease asked again is granted anew
    with the same range (never answered from memory as existing), and an epoch formed
    afterwards starts past what its members report, as a failover gap. Nothing granted after
    the failover overlaps a grant acknowledged before it."""
    pair = pg_pair(synchronous=False)
    pair.create_database("rngcoord")
    db_url = pair.database_url("rngcoord")
    replicas = [coordinator_factory(db_url), coordinator_factory(db_url)]
    quiet = CoordinatorClient([r.address for r in replicas], deadline_s=10.0)
    quiet_joined = quiet.join_group("quiet", "q", rank=0, world_size=1, member_id="quiet-0")
    quiet_leases = [_quiet_reserve(quiet, quiet_joined.epoch, seq) for seq in range(3)]
    _wait_replicated(pair, "SELECT count(*) FROM leases WHERE job = 'quiet'", 3)
    with Storm(replicas, tmp_path) as storm:
        storm.wait_for_progress({})
        pair.cut_standby()
        # Every member gets more leases, acknowledged by the primary alone: the lost tail.
        storm.wait_for_progress(storm.lease_counts())
        pair.kill_primary()
        killed = time.monotonic()
        # What the promoted store starts from, read on the standby (a hot standby answers
        # reads) before the promotion: once served again, ranks that ask for lost leases get
        # them granted anew, and the store holds them again.
        kept = {
            (str(group), int(str(epoch)), int(str(seq)))
            for group, epoch, seq in pair.standby.execute_in(
                "rngcoord", "SELECT grp, epoch, seq FROM leases WHERE job = 'replicas'"
            )
        }
        pair.promote()
        for replica in replicas:
            while not [e for e in replica.log_events() if e["event"] == "store_rewound_served"]:
                assert time.monotonic() - killed < 90, replica.output()[-3000:]
                time.sleep(0.1)
        served_again = time.monotonic() - killed
        records = storm.finish(clean=False)
    # The promoted store lost leases that clients hold: the fault happened.
    acknowledged = {(r["group"], r["epoch"], r["seq"]) for r in records}
    lost = acknowledged - kept
    assert lost, "the promoted standby holds every acknowledged lease: no tail was lost"
    assert acknowledged & kept, "the promoted standby holds none of the leases: no head either"
    # Both ranks of a group agree on every seq, before the failover and after it, and each
    # group's leases form one chain: whatever was granted again is what was lost, range for
    # range, and nothing overlaps.
    check_agreement(records, one_grant_each=False, lost_grants=True)
    for replica in replicas:
        assert replica.popen is not None and replica.popen.poll() is None, "a replica exited"
        (lost_event,) = [e for e in replica.log_events() if e["event"] == "store_lost"]
        assert "went back in time" in lost_event["fields"]["reason"]
        _wait_for_health(replica, "SERVING", timeout_s=30)
    # A lost lease asked again is granted anew from its predecessor, the range it had: never
    # answered as existing from what a replica remembered of the lost store.
    by_key = {(r["group"], r["epoch"], r["seq"]): r for r in records}
    first_lost = min(lost, key=lambda k: (k[0], k[2]))
    r = by_key[first_lost]
    adopt_member_secret(r["member_id"], bytes.fromhex(r["secret"]))
    with CoordinatorClient([replicas[0].address], deadline_s=10.0) as client:
        again = client.reserve(
            JOB, r["group"], epoch=r["epoch"], seq=r["seq"], size=lease_size(r["seq"]),
            fingerprint=FINGERPRINT, rank=r["rank"], member_id=r["member_id"],
        )  # fmt: skip
        assert (again.start, again.end) == (r["start"], r["end"])
        # The audit-head trailer names a record that is in the chain now.
        reply = replicas[1].stub().JoinGroup.with_call(
            pb.JoinGroupRequest(
                job="trailer", group="t", rank=0, world_size=1, member_id="t0",
                member_secret=secret_for("t0"),
            ),
            timeout=10,
        )  # fmt: skip
        trailer = str(dict(reply[1].trailing_metadata())[HEAD_TRAILER])
        _, head_id, head_hash, _ = trailer.split(":")
        assert pair.standby.execute_in(
            "rngcoord", f"SELECT hash FROM audit WHERE id = {int(head_id)}"
        ) == [(head_hash,)]
    # The job the loss never touched is served on by the same replicas.
    nxt = _quiet_reserve(quiet, quiet_joined.epoch, 3)
    assert nxt.start == quiet_leases[-1].end and not nxt.existing
    quiet.close()
    # The ranks that come back report where they know each group's grants reach (a tracker
    # sends its checkpoint's cursor): each new epoch starts past every grant acknowledged
    # before the failover, and each move is audited as a failover gap.
    reach: dict[str, int] = {}
    for rec in records:
        reach[rec["group"]] = max(reach.get(rec["group"], 0), int(rec["end"]))
    lost_groups = {group for group, _, _ in lost}
    with CoordinatorClient([replicas[1].address], deadline_s=10.0) as client:
        for group, end in sorted(reach.items()):
            member = f"back-{group}"
            joined = client.join_group(
                JOB, group, rank=0, world_size=1, member_id=member, position=end
            )
            assert joined.start >= end
            lease = client.reserve(
                JOB, group, epoch=joined.epoch, seq=0, size=lease_size(0),
                fingerprint=FINGERPRINT, rank=0, member_id=member,
            )  # fmt: skip
            overlapping = [
                rec for rec in records
                if rec["group"] == group and rec["start"] < lease.end and lease.start < rec["end"]
            ]  # fmt: skip
            assert not overlapping, (lease, overlapping[:3])
    audited = run_cli("audit", "--db", db_url, "--json", "--kind", "failover-gap")
    assert audited.returncode == 0, audited.stderr
    gaps = [json.loads(line) for line in audited.stdout.splitlines()]
    # Groups whose lost leases no rank asked for again still end below what ranks hold.
    assert {g["group"] for g in gaps} <= lost_groups
    assert all(g["detail"]["to"] == reach[g["group"]] for g in gaps)
    verified = run_cli("verify", "--db", db_url)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert verified.stdout.count("the store went back in time") == 2  # one rewind a replica
    assert verified.stdout.count(": failover gap in job") == len(gaps)
    print(
        f"{len(lost)} acknowledged leases lost by the promotion; both replicas served the "
        f"promoted store again {served_again:.2f} s after the kill; {len(gaps)} groups moved "
        "past what ranks held"
    )


def _quiet_reserve(client: CoordinatorClient, epoch: int, seq: int) -> Lease:
    return client.reserve(
        "quiet", "q", epoch=epoch, seq=seq, size=64, fingerprint=FINGERPRINT, rank=0,
        member_id="quiet-0",
    )  # fmt: skip


def _wait_replicated(pair: pg_clusters.PostgresPair, sql: str, count: int) -> None:
    """Wait until the standby has replayed what `sql` counts."""
    deadline = time.monotonic() + 30
    while pair.standby.execute_in("rngcoord", sql) != [(count,)]:
        assert time.monotonic() < deadline, "the standby did not catch up"
        time.sleep(0.05)


def _health(replica: CoordinatorProcess) -> str:
    try:
        return replica.health()
    except grpc.RpcError as exc:
        return f"unreachable ({exc.code()})"


def _replication_shown(replica: CoordinatorProcess) -> tuple[float, bool]:
    """The replication gauge of /metrics, and the status API's `replication_synchronous`."""
    (serving,) = [e for e in replica.log_events() if e["event"] == "serving"]
    base = f"http://{serving['fields']['metrics']}"
    with urllib.request.urlopen(f"{base}/metrics", timeout=10) as response:
        text = response.read().decode()
    (gauge,) = [
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "rngcoord_store_replication_synchronous"
    ]
    with urllib.request.urlopen(f"{base}/api/status", timeout=10) as response:
        state = json.loads(response.read())
    assert state["replication"].startswith(
        "synchronous" if state["replication_synchronous"] else "asynchronous"
    )
    return gauge, state["replication_synchronous"]


def _replication_events(replica: CoordinatorProcess) -> list[dict[str, object]]:
    lines = replica.log_path.read_text().splitlines()
    events = [json.loads(line) for line in lines if '"store_replication"' in line]
    return [e["fields"] for e in events if e["event"] == "store_replication"]


def test_serve_refuses_an_asynchronous_primary_when_sync_replication_is_required(
    postgres_url_factory: Callable[[], str],
    coordinator_factory: Callable[..., CoordinatorProcess],
) -> None:
    db_url = postgres_url_factory()  # the shared test server: no standby at all
    # Without the flag the mode is a warning in the log, and serve runs.
    replica = coordinator_factory(db_url, args=("--metrics", "127.0.0.1:0"))
    assert _replication_shown(replica) == (0.0, False)
    (logged,) = _replication_events(replica)
    assert logged["synchronous"] is False and logged["synchronous_standby_names"] == ""
    assert "synchronous_standby_names is empty" in str(logged["description"])
    done = run_cli(
        "serve", "--db", db_url, "--listen", "127.0.0.1:0", "--metrics", "off",
        "--require-sync-replication",
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "--require-sync-replication asks that it does" in done.stderr
    assert "synchronous_standby_names is empty" in done.stderr
    # An SQLite store has no standby: the flag is refused for it too.
    sqlite = run_cli("serve", "--db", "sqlite:///unused.db", "--require-sync-replication")
    assert sqlite.returncode == 2 and "needs a PostgreSQL store" in sqlite.stderr


def test_a_write_with_no_primary_left_names_the_lost_connection(
    pg_pair: Callable[..., pg_clusters.PostgresPair],
) -> None:
    """The primary dies and nothing is promoted: writes fail as the database being
    unreachable, never as conflicting writes, and the store writes again once a primary
    answers."""
    pair = pg_pair(synchronous=False)
    pair.create_database("rngcoord")
    store = PostgresStore(
        pair.database_url("rngcoord"), create=True, max_attempts=2, connect_timeout_s=2
    )
    try:
        assert store.write(lambda tx: tx.fetchone("SELECT 1")) == (1,)
        pair.kill_primary()
        with pytest.raises(Unavailable) as failed:
            store.write(lambda tx: tx.fetchone("SELECT 1"))
        assert "failed 2 times on a lost database connection" in failed.value.message
        assert "conflicting writes" not in failed.value.message
        pair.promote()
        assert store.write(lambda tx: tx.fetchone("SELECT 1")) == (1,)
    finally:
        store.close()


def test_health_is_not_serving_while_no_primary_answers_then_serving_again(
    pg_pair: Callable[..., pg_clusters.PostgresPair],
    coordinator_factory: Callable[..., CoordinatorProcess],
) -> None:
    """No call needs to come for health to tell: the once-a-second store check finds no
    primary, and finds the promoted one, without a restart."""
    pair = pg_pair(synchronous=False)
    pair.create_database("rngcoord")
    replica = coordinator_factory(pair.database_url("rngcoord"))
    join_all(replica.stub(), "before", "g", 1)
    assert _health(replica) == "SERVING"
    pair.kill_primary()
    _wait_for_health(replica, "NOT_SERVING")
    pair.promote()
    _wait_for_health(replica, "SERVING")
    assert replica.popen is not None and replica.popen.poll() is None
    join_all(replica.stub(), "after", "g", 1)
    events = [e["event"] for e in replica.log_events()]
    assert events.count("not_serving") == 1 and events.count("serving_again") == 1


def _wait_for_health(replica: CoordinatorProcess, wanted: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while (found := _health(replica)) != wanted:
        assert time.monotonic() < deadline, f"health stayed {found}, not {wanted}"
        time.sleep(0.2)
