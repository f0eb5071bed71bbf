"""Group commit: one writer thread turns many callers' write operations into few transactions.

Callers on any thread hand an operation (a function of a `Tx`) to `GroupCommitWriter.submit`
and block. The writer thread takes every operation waiting (up to `max_batch`), opens one
transaction, runs each operation inside its own SAVEPOINT and commits once, so the whole
batch shares one fsync. Then it completes every caller:

- an operation that returned: its result, once the commit has succeeded;
- a `CoordinatorError`: its savepoint is rolled back and the error goes to that caller only;
  with `keep_writes` the savepoint is kept instead and the error is raised after the commit;
- any other exception: its savepoint is rolled back and the exception goes to that caller,
  unless the backend classifies it as retryable (a serialization failure or deadlock), which
  aborts the attempt: the whole batch is rolled back and run again, at most `max_attempts`
  times, with exponential backoff and jitter;
- a failed BEGIN, SAVEPOINT or COMMIT, or an operation failing because the database cannot
  serve (`is_unavailable`: disk full, I/O error, tables gone): every operation of the batch
  gets `Unavailable`.

Backends supply the transaction control as callbacks, so SQLite and PostgreSQL share this one
implementation. Operations must be pure functions of the transaction, as they may run again.
"""

from __future__ import annotations

import queue
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from rngcoord.server.errors import CoordinatorError, Unavailable
from rngcoord.server.store import Tx

__all__ = ["GroupCommitWriter"]

T = TypeVar("T")


@dataclass(slots=True)
class _Op:
    fn: Callable[[Tx], Any]
    future: Future[Any]


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
        is_unavailable: True for an exception raised inside an operation that means the
            database cannot serve (disk full, I/O error, connection lost): the whole batch
            gets `Unavailable`, as for a failed commit. Default: none does.
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
        is_unavailable: Callable[[BaseException], bool] = lambda exc: False,
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
        self._is_unavailable = is_unavailable
        self._max_batch = max_batch
        self._max_attempts = max_attempts
        self._backoff_s = backoff_s
        self._queue: queue.SimpleQueue[_Op | object] = queue.SimpleQueue()
        # Guards `_closed` together with the enqueue, so no operation lands behind _STOP.
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[Tx], T]) -> Future[T]:
        """Queue `fn` for the next batch; the future completes once the batch has committed.

        The future's exception is what `fn` raised (a `CoordinatorError`, or any other
        exception, whose writes are rolled back), or `Unavailable` when the batch could not
        commit or the writer is closed.
        """
        future: Future[T] = Future()
        with self._lock:
            if self._closed:
                future.set_exception(Unavailable("store is closed"))
                return future
            self._queue.put(_Op(fn, future))
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

    def _run(self) -> None:
        stopping = False
        while not stopping:
            item = self._queue.get()
            if item is _STOP:
                return
            batch = [cast(_Op, item)]
            while len(batch) < self._max_batch:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is _STOP:
                    stopping = True
                    break
                batch.append(cast(_Op, item))
            self._run_batch(batch)

    def _run_batch(self, batch: list[_Op]) -> None:
        for attempt in range(1, self._max_attempts + 1):
            try:
                outcomes = self._attempt(batch)
            except _AttemptFailed as failure:
                self._rollback()
                if self._is_retryable(failure.cause) and attempt < self._max_attempts:
                    delay = self._backoff_s * 2 ** (attempt - 1)
                    time.sleep(delay * random.uniform(0.5, 1.5))
                    continue
                if self._is_retryable(failure.cause):
                    message = (
                        f"store {failure.phase} failed {attempt} times on conflicting writes, "
                        f"giving up: {failure.cause}"
                    )
                else:
                    message = f"store {failure.phase} failed: {failure.cause}"
                for op in batch:
                    error = Unavailable(message)
                    error.__cause__ = failure.cause  # a StoreLost tells the coordinator
                    op.future.set_exception(error)
                return
            except Exception as exc:
                # A failing callback must not leave callers blocked or stop the writer thread:
                # the callers get the exception (the servicer logs it as INTERNAL).
                self._rollback()
                for op in batch:
                    op.future.set_exception(exc)
                return
            for op, (ok, value) in zip(batch, outcomes, strict=True):
                if ok:
                    op.future.set_result(value)
                else:
                    op.future.set_exception(value)
            return

    def _attempt(self, batch: list[_Op]) -> list[tuple[bool, Any]]:
        """Run the batch in one transaction; return (succeeded, result or exception) per op."""
        try:
            tx = self._begin()
        except Exception as exc:
            raise _AttemptFailed("begin", exc) from exc
        outcomes: list[tuple[bool, Any]] = []
        for op in batch:
            try:
                tx.execute("SAVEPOINT op")
            except Exception as exc:
                raise _AttemptFailed("write", exc) from exc
            try:
                value = op.fn(tx)
            except CoordinatorError as exc:
                self._end_savepoint(tx, keep=exc.keep_writes)
                outcomes.append((False, exc))
            except Exception as exc:
                if self._is_retryable(exc) or self._is_unavailable(exc):
                    raise _AttemptFailed("write", exc) from exc
                self._end_savepoint(tx, keep=False)
                outcomes.append((False, exc))
            else:
                self._end_savepoint(tx, keep=True)
                outcomes.append((True, value))
        try:
            self._commit()
        except Exception as exc:
            raise _AttemptFailed("commit", exc) from exc
        return outcomes

    @staticmethod
    def _end_savepoint(tx: Tx, *, keep: bool) -> None:
        try:
            if not keep:
                tx.execute("ROLLBACK TO SAVEPOINT op")
            tx.execute("RELEASE SAVEPOINT op")
        except Exception as exc:
            raise _AttemptFailed("write", exc) from exc
