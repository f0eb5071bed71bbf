"""Shared test infrastructure: a store URL per backend, and coordinator server subprocesses.

Fixtures
--------
`store_url` (function scope) and `module_store_url` (module scope)
    A URL of a fresh, empty store, parametrized over the backends (test ids `sqlite` and
    `postgresql`), so a test that takes it runs once per backend:
    - sqlite: `sqlite:////<tmp>/rngcoord.db`, a file in a temporary directory.
    - postgresql: a database created for the test (module) on the server named by the
      environment variable RNGCOORD_TEST_POSTGRES (default
      postgresql://postgres@127.0.0.1:5432/postgres) and dropped afterwards.
    The postgresql case is skipped, with the reason printed by `-ra`, while the backend module
    `rngcoord.server.storage.postgres` does not exist, or when RNGCOORD_TEST_POSTGRES is unset
    and the default server is unreachable. When RNGCOORD_TEST_POSTGRES is set (CI sets it), an
    unreachable server is an error, never a skip. Select one backend with `-k sqlite` or
    `-k postgresql`.

`postgres_url_factory` (session scope)
    `postgres_url_factory()` creates one more fresh database and returns its URL (dropped at the
    end of the session); skips like the postgresql case above.

`pg_pair` (function scope)
    `pg_pair(synchronous=...)` makes a PostgreSQL primary and a streaming standby of the test's
    own (tests/pg_clusters.py), to kill and promote; skipped without PostgreSQL's binaries.

`coordinator_factory` (function scope)
    `coordinator_factory(db_url=None, *, args=(), env=None)` starts a `CoordinatorProcess`
    (a real `rngcoord serve` subprocess on 127.0.0.1 and an ephemeral port) and waits until it
    serves. `db_url` defaults to a fresh SQLite file. Every process it started is killed at
    the end of the test.

`coordinator` (function scope)
    One `CoordinatorProcess` on a fresh SQLite store.

Helpers live in tests/harness.py (`from harness import ...`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

import pg_clusters
from harness import (
    BACKENDS,
    CoordinatorFactory,
    CoordinatorProcess,
    PostgresDatabases,
    token_leaks,
)


@pytest.fixture(scope="session")
def _postgres() -> PostgresDatabases:
    return PostgresDatabases()


@contextlib.contextmanager
def _fresh_store(backend: str, tmp_dir: Path, postgres: PostgresDatabases) -> Iterator[str]:
    if backend == "sqlite":
        yield f"sqlite:///{tmp_dir / 'rngcoord.db'}"
        return
    reason = postgres.unavailable()
    if reason is not None:
        pytest.skip(reason)
    url = postgres.create()
    try:
        yield url
    finally:
        postgres.drop(url)


@pytest.fixture(params=BACKENDS)
def store_url(
    request: pytest.FixtureRequest, tmp_path: Path, _postgres: PostgresDatabases
) -> Iterator[str]:
    """A fresh, empty store for one test, once per backend."""
    with _fresh_store(request.param, tmp_path, _postgres) as url:
        yield url


@pytest.fixture(scope="module", params=BACKENDS)
def module_store_url(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    _postgres: PostgresDatabases,
) -> Iterator[str]:
    """A fresh, empty store shared by the tests of one module, once per backend."""
    with _fresh_store(request.param, tmp_path_factory.mktemp("store"), _postgres) as url:
        yield url


@pytest.fixture(scope="session")
def postgres_url_factory(_postgres: PostgresDatabases) -> Iterator[Callable[[], str]]:
    """`postgres_url_factory()` returns the URL of another fresh PostgreSQL database."""
    made: list[str] = []

    def make() -> str:
        reason = _postgres.unavailable()
        if reason is not None:
            pytest.skip(reason)
        made.append(_postgres.create())
        return made[-1]

    yield make
    for url in made:
        _postgres.drop(url)


@pytest.fixture
def pg_pair() -> Iterator[Callable[..., pg_clusters.PostgresPair]]:
    """`pg_pair(synchronous=...)` makes a primary and a standby; both go when the test ends."""
    reason = pg_clusters.unavailable()
    if reason is not None:
        pytest.skip(reason)
    pairs: list[pg_clusters.PostgresPair] = []

    def make(*, synchronous: bool) -> pg_clusters.PostgresPair:
        pairs.append(pg_clusters.PostgresPair(synchronous=synchronous))
        return pairs[-1]

    yield make
    for pair in pairs:
        pair.close()


@pytest.fixture
def coordinator_factory(tmp_path: Path) -> Iterator[CoordinatorFactory]:
    """Starts `CoordinatorProcess`es; all of them are killed when the test ends."""
    started: list[CoordinatorProcess] = []

    def start(
        db_url: str | None = None,
        *,
        args: Sequence[str] = (),
        env: dict[str, str] | None = None,
    ) -> CoordinatorProcess:
        n = len(started) + 1
        url = db_url if db_url is not None else f"sqlite:///{tmp_path / f'coordinator-{n}.db'}"
        proc = CoordinatorProcess(url, tmp_path / f"coordinator-{n}", args=args, env=env)
        started.append(proc)
        return proc.start()

    yield start
    for proc in started:
        proc.close()


@pytest.fixture
def coordinator(coordinator_factory: CoordinatorFactory) -> CoordinatorProcess:
    """A coordinator server on a fresh SQLite store."""
    return coordinator_factory()


@pytest.fixture(scope="module")
def module_coordinator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CoordinatorProcess]:
    """One coordinator server on a fresh SQLite store, shared by the tests of a module (on
    each xdist worker that runs some of them) that need none of their own: each of them uses
    job names of its own, never stops the server, and reads only its own jobs' records. A
    start costs about 0.9 s on 2 cores."""
    workdir = tmp_path_factory.mktemp("module-coordinator")
    proc = CoordinatorProcess(f"sqlite:///{workdir / 'coordinator.db'}", workdir / "coordinator")
    proc.start()
    yield proc
    proc.close()


# ---------------------------------------------------------------------- the longest first


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Start the end-to-end runs (the suite's longest: 40 to 110 s each, mostly waiting on
    torchrun and on outages held on purpose) first, alternately at the head of each half of
    the list, the longest allowed (their timeout) first.

    `make test` runs two workers with `--dist worksteal`, which hands each worker one half of
    the list and lets an idle one steal from the other's tail. In collection order tests/e2e
    sat near the middle, at the tail of the first half, so the 90 s outage run began last and
    ran alone for its last two minutes. Every worker collects the same order (xdist requires
    it); the order changes nothing else, since every test stands alone.
    """
    e2e = [item for item in items if item.get_closest_marker("e2e") is not None]
    if not e2e or len(e2e) == len(items):
        return
    # Longest allowed first (the timeout marker), so the two outage runs start one per worker.
    e2e.sort(key=lambda item: -_timeout_s(item, config))
    rest = [item for item in items if item.get_closest_marker("e2e") is None]
    first, second = e2e[0::2], e2e[1::2]
    split = max(0, len(items) // 2 - len(first))
    items[:] = [*first, *rest[:split], *second, *rest[split:]]


def _timeout_s(item: pytest.Item, config: pytest.Config) -> float:
    marker = item.get_closest_marker("timeout")
    if marker is not None and marker.args:
        return float(marker.args[0])
    return float(config.getini("timeout") or 0)


# ---------------------------------------------------------------------- no token in any log


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the run if any file the servers and tools wrote under the tests' temporary
    directories (their logs, anchor files, reports) holds the text of a test token."""
    factory = getattr(session.config, "_tmp_path_factory", None)
    if factory is None:
        return
    try:
        root = factory.getbasetemp()
    except (OSError, ValueError):
        return
    leaks = token_leaks(root)
    if leaks:
        print("\ntoken text found in files the suite wrote:\n" + "\n".join(leaks[:20]))
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
