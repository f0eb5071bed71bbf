"""Group commit: one writer thread turns many callers' write operations into few transactions.

Callers on any thread hand an operation (a function of a `Tx`) to `GroupCommitWriter.submit`
and block. The writer thread takes every operation waiting (up to `max_batch`), opens one
transaction, runs each operation so that its writes alone can be taken back (`Tx.begin_op`:
a savepoint, where the backend needs one) and commits once, so the whole batch shares one
fsync. Then it completes every caller:

- an operation that returned: its result, once the commit has succeeded;
- a `CoordinatorError`: its writes are taken back and the error goes to that caller only;
  with `keep_writes` they are kept instead and the error is raised after the commit;
- any other exception: its writes are taken back and the exception goes to that caller,
  unless the backend classifies it as retryable (a serialization failure or deadlock), which
  aborts the attempt: the whole batch is rolled back and run again, at most `max_attempts`
  times, with exponential backoff and jitter;
- a failed BEGIN, savepoint or COMMIT, or an operation failing because the database cannot
  serve (`is_unavailable`: disk full, I/O error, tables gone): every operation of the batch
  gets `Unavailable`.

Backends supply the transaction control as callbacks, so SQLite and PostgreSQL share this one
implementation. Operations must be pure functions of the transaction, as they may run again.

An operation may name its first query (`store.ReadAhead`). The writer then sends the batch's
read-aheads in one round trip (`Tx.read_ahead`) before it runs any operation, and answers each
operation's query from it unless an earlier operation of the batch may have changed its rows:
one with the same key, or one without a read-ahead. On PostgreSQL, which holds every write back
until something needs an answer, a batch of grants then waits on the database four times
(lock, reads, writes, commit) instead of once or more per grant.

Nothing a caller does can stop the thread (docs/design.md §7.3). A caller that gave up (its
future was cancelled, as `asyncio.wrap_future` does when a client cancels its call) before the
writer took its operation is dropped: the operation never runs. Once taken, a future is marked
running, so no later cancel can race the writer's `set_result`. Any unexpected exception while
running a batch is logged and fails that batch's callers with `Unavailable`, and the thread
goes on. `problem()` says when the writer has died or stopped making progress, which the
server reports as NOT_SERVING.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from rngcoord.server.errors import CoordinatorError, Unavailable
from rngcoord.server.logs import event, get_logger
from rngcoord.server.storage.store import ReadAhead, Tx, WriteProblem

__all__ = ["GroupCommitWriter"]

T = TypeVar("T")
_log = get_logger("writer")


@dataclass(slots=True)
class _Op:
    fn: Callable[[Tx], Any]
    future: Future[Any]
    ahead: ReadAhead | None = None


class _Primed:
    """A `Tx` that answers the operation's first statement from the row the writer read
    ahead, when it is that query, and passes every other statement to the transaction."""

    def __init__(self, tx: Tx, ahead: ReadAhead, row: tuple[Any, ...] | None) -> None:
        self._tx = tx
        self._ahead: ReadAhead | None = ahead
        self._row = row

    @property
    def head(self) -> tuple[int, str] | None:
        return self._tx.head

    @head.setter
    def head(self, value: tuple[int, str] | None) -> None:
        self._tx.head = value

    def execute(self, sql: str, params: Sequence[object] = ()) -> int:
        self._ahead = None  # the row predates whatever the operation does from here on
        return self._tx.execute(sql, params)

    def write(self, sql: str, params: Sequence[object] = ()) -> None:
        self._ahead = None
        self._tx.write(sql, params)

    def executemany(self, sql: str, params: Sequence[Sequence[object]]) -> None:
        self._ahead = None
        self._tx.executemany(sql, params)

    def fetchone(self, sql: str, params: Sequence[object] = ()) -> tuple[Any, ...] | None:
        ahead, self._ahead = self._ahead, None
        if ahead is not None and sql == ahead.sql and tuple(params) == ahead.params:
            return self._row
        return self._tx.fetchone(sql, params)

    def fetchall(self, sql: str, params: Sequence[object] = ()) -> list[tuple[Any, ...]]:
        self._ahead = None
        return self._tx.fetchall(sql, params)

    def read_ahead(self, reads: Sequence[ReadAhead]) -> list[tuple[Any, ...] | None] | None:
        return None

    def begin_op(self) -> None:
        self._tx.begin_op()

    def end_op(self, keep: bool) -> None:
        self._tx.end_op(keep)


class _AttemptFailed(Exception):
    """The batch's transaction cannot commit; `phase` says which step failed."""

    def __init__(self, phase: str, cause: BaseException) -> None:
        super().__init__(f"{phase}: {cause}")
        self.phase = phase
        self.cause = cause


_STOP = object()


class GroupCommitWriter:
    """The single writer thread of one store.

    Args:
        begin: opens a write transaction on the writer's connection and returns the `Tx` to
            run operations in (SQLite: `BEGIN IMMEDIATE`; PostgreSQL: `BEGIN` and lock
            `audit_head`). It may reconnect when the previous connection broke.
        commit: commits the open transaction durably.
        rollback: rolls the open transaction back; called after any failed attempt, so it
            must tolerate a broken connection or no open transaction without raising.
        is_retryable: True for an exception after which the whole batch should run again
            (serialization failure, deadlock, a busy lock). Default: nothing is retryable.
        retry_reason: what a retryable exception means, for the error once the attempts are
            spent ("conflicting writes", "a lost database connection"). Default: "conflicting
            writes".
        is_unavailable: True for an exception raised inside an operation that means the
            database cannot serve (disk full, I/O error, connection lost): the whole batch
            gets `Unavailable`, as for a failed commit. Default: none does.
        rerun: True for an exception after which the batch runs again at once, without
            counting as an attempt, in a mode where it cannot recur in the same way
            (PostgreSQL: an error of a write held back; `rollback` turns holding back
            off for the rerun). A predicate: it must be False for the rerun's own errors.
            Default: never.
        name: the writer thread's name. Default "rngcoord-writer".
        max_batch: most operations in one transaction. Default 256.
        max_attempts: most runs of one batch when attempts fail retryably. Default 5.
        backoff_s: the delay before the second attempt; it doubles on each further one, with
            +-50% jitter so that competing replicas drift apart. Default 0.01.
    """

    def __init__(
        self,
        *,
        begin: Callable[[], Tx],
        commit: Callable[[], None],
        rollback: Callable[[], None],
        is_retryable: Callable[[BaseException], bool] = lambda exc: False,
        retry_reason: Callable[[BaseException], str] = lambda exc: "conflicting writes",
        is_unavailable: Callable[[BaseException], bool] = lambda exc: False,
        rerun: Callable[[BaseException], bool] = lambda exc: False,
        name: str = "rngcoord-writer",
        max_batch: int = 256,
        max_attempts: int = 5,
        backoff_s: float = 0.01,
    ) -> None:
        if max_batch < 1 or max_attempts < 1:
            raise ValueError("max_batch and max_attempts must be at least 1")
        self._begin = begin
        self._commit = commit
        self._rollback = rollback
        self._is_retryable = is_retryable
        self._retry_reason = retry_reason
        self._is_unavailable = is_unavailable
        self._rerun = rerun
        self._max_batch = max_batch
        self._max_attempts = max_attempts
        self._backoff_s = backoff_s
        self._queue: queue.SimpleQueue[_Op | object] = queue.SimpleQueue()
        # Guards `_closed` together with the enqueue, so no operation lands behind _STOP.
        self._lock = threading.Lock()
        self._closed = False
        # When the batch being run began (None while idle), and why the thread died, if it did:
        # read by `problem()` from other threads, written only by the writer.
        self._batch_started: float | None = None
        self._died: str | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[Tx], T], ahead: ReadAhead | None = None) -> Future[T]:
        """Queue `fn` for the next batch; the future completes once the batch has committed.

        The future's exception is what `fn` raised (a `CoordinatorError`, or any other
        exception, whose writes are rolled back), or `Unavailable` when the batch could not
        commit or the writer is closed. `ahead`: the query `fn` reads first, or None.
        """
        future: Future[T] = Future()
        with self._lock:
            if self._closed:
                future.set_exception(Unavailable("store is closed"))
                return future
            self._queue.put(_Op(fn, future, ahead))
        return future

    def write(self, fn: Callable[[Tx], T]) -> T:
        """Run `fn` in the next batch and wait for the commit; return its result."""
        return self.submit(fn).result()

    def close(self) -> None:
        """Run the operations already submitted, then stop the thread. Idempotent."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._queue.put(_STOP)
        self._thread.join()

    def problem(self, stall_s: float) -> WriteProblem | None:
        """Why writes cannot be trusted to complete, or None: the thread died (fatal), or the
        batch it is running has not finished within `stall_s` seconds (a database that hangs)."""
        if self._died is not None:
            return WriteProblem(f"the store's writer thread stopped: {self._died}", fatal=True)
        started = self._batch_started
        if started is not None:
            stalled = time.monotonic() - started
            if stalled >= stall_s:
                waiting = self._queue.qsize()
                return WriteProblem(
                    f"a write batch has run for {stalled:.0f} s without committing, "
                    f"{waiting} more writes queued behind it",
                    fatal=False,
                )
        if not self._closed and not self._thread.is_alive():
            return WriteProblem("the store's writer thread is not running", fatal=True)
        return None

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as exc:
            # Only something like MemoryError gets here: say so, and fail whoever waits.
            self._died = f"{type(exc).__name__}: {exc}"
            event(_log, logging.CRITICAL, "writer_died", exc_info=True, error=self._died)
            with self._lock:
                self._closed = True
            self._fail_queued(Unavailable(f"the store's writer thread stopped: {self._died}"))
            raise

    def _serve(self) -> None:
        stopping = False
        while not stopping:
            item = self._queue.get()
            if item is _STOP:
                return
            batch: list[_Op] = []
            while True:
                op = cast(_Op, item)
                # False: the caller cancelled before the writer took it; it must not run.
                if op.future.set_running_or_notify_cancel():
                    batch.append(op)
                if len(batch) >= self._max_batch:
                    break
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is _STOP:
                    stopping = True
                    break
            if not batch:
                continue
            self._batch_started = time.monotonic()
            try:
                self._run_batch(batch)
            except BaseException as exc:
                error = Unavailable(f"the store's writer failed: {type(exc).__name__}: {exc}")
                for op in batch:
                    if not op.future.done():
                        _settle(op.future, False, error)
                if not isinstance(exc, Exception):
                    raise
                event(_log, logging.ERROR, "write_batch_failed", exc_info=True, ops=len(batch))
            finally:
                self._batch_started = None

    def _fail_queued(self, error: Unavailable) -> None:
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is not _STOP:
                future = cast(_Op, item).future
                if future.set_running_or_notify_cancel():
                    future.set_exception(error)

    def _run_batch(self, batch: list[_Op]) -> None:
        attempt = 0
        while attempt < self._max_attempts:
            attempt += 1
            try:
                outcomes = self._attempt(batch)
            except _AttemptFailed as failure:
                self._rollback()
                if not self._is_retryable(failure.cause) and self._rerun(failure.cause):
                    attempt -= 1
                    continue
                if self._is_retryable(failure.cause) and attempt < self._max_attempts:
                    delay = self._backoff_s * 2 ** (attempt - 1)
                    time.sleep(delay * random.uniform(0.5, 1.5))
                    continue
                if self._is_retryable(failure.cause):
                    message = (
                        f"store {failure.phase} failed {attempt} times on "
                        f"{self._retry_reason(failure.cause)}, giving up: {failure.cause}"
                    )
                else:
                    message = f"store {failure.phase} failed: {failure.cause}"
                for op in batch:
                    error = Unavailable(message)
                    error.__cause__ = failure.cause  # a StoreLost tells the coordinator
                    _settle(op.future, False, error)
                return
            except Exception as exc:
                # A failing callback must not leave callers blocked or stop the writer thread:
                # the callers get the exception (the servicer logs it as INTERNAL).
                self._rollback()
                for op in batch:
                    _settle(op.future, False, exc)
                return
            for op, (ok, value) in zip(batch, outcomes, strict=True):
                _settle(op.future, ok, value)
            return

    def _attempt(self, batch: list[_Op]) -> list[tuple[bool, Any]]:
        """Run the batch in one transaction; return (succeeded, result or exception) per op."""
        try:
            tx = self._begin()
        except Exception as exc:
            raise _AttemptFailed("begin", exc) from exc
        rows = self._read_ahead(tx, batch)
        # Keys an earlier operation of the batch may have written; None: any key.
        written: set[tuple[str, ...]] | None = set()
        outcomes: list[tuple[bool, Any]] = []
        for i, op in enumerate(batch):
            try:
                tx.begin_op()
            except Exception as exc:
                raise _AttemptFailed("write", exc) from exc
            head = tx.head
            run_in: Tx = tx
            if op.ahead is not None and rows is not None and written is not None:
                if op.ahead.key not in written:
                    run_in = _Primed(tx, op.ahead, rows[i])
                written.add(op.ahead.key)
            else:
                written = None
            try:
                value = op.fn(run_in)
            except CoordinatorError as exc:
                if not exc.keep_writes:
                    tx.head = head
                self._end_op(tx, keep=exc.keep_writes)
                outcomes.append((False, exc))
            except Exception as exc:
                if self._is_retryable(exc) or self._is_unavailable(exc) or self._rerun(exc):
                    raise _AttemptFailed("write", exc) from exc
                tx.head = head
                self._end_op(tx, keep=False)
                outcomes.append((False, exc))
            else:
                self._end_op(tx, keep=True)
                outcomes.append((True, value))
        try:
            self._commit()
        except Exception as exc:
            raise _AttemptFailed("commit", exc) from exc
        return outcomes

    @staticmethod
    def _read_ahead(tx: Tx, batch: list[_Op]) -> list[tuple[Any, ...] | None] | None:
        """Each operation's read-ahead row, by position in the batch (None for an operation
        without one), or None when the backend reads nothing ahead."""
        reads = [op.ahead for op in batch if op.ahead is not None]
        if not reads:
            return None
        try:
            found = tx.read_ahead(reads)
        except Exception as exc:
            raise _AttemptFailed("read", exc) from exc
        if found is None:
            return None
        rows = iter(found)
        return [None if op.ahead is None else next(rows) for op in batch]

    @staticmethod
    def _end_op(tx: Tx, *, keep: bool) -> None:
        try:
            tx.end_op(keep)
        except Exception as exc:
            raise _AttemptFailed("write", exc) from exc


def _settle(future: Future[Any], ok: bool, value: Any) -> None:
    """Complete a running future once; a second completion is a bug, logged, never raised in
    the writer thread."""
    try:
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value)
    except InvalidStateError:
        event(_log, logging.ERROR, "write_completed_twice", state=repr(future))
