"""`rngcoord serve --workers N`: N server processes on one port, over one store.

A Python process serves from one core (the GIL). To use every core, the supervisor starts N
worker processes that each run `rngcoord.server.app.run_server` with SO_REUSEPORT on the same
port; the kernel spreads incoming connections over them. They share the store, which already
serialises writers (SQLite's file lock with BEGIN IMMEDIATE; PostgreSQL's `audit_head` row
lock), and each follows the others' changes through the change feed (rngcoord.server.core.feed):
a join barrier that forms in one worker wakes the joins waiting in the others.

The supervisor:
- catches SIGTERM, SIGINT and SIGHUP before it does anything else, and acts on them from its
  main loop only: a SIGHUP during start-up is applied once every worker serves, a SIGTERM
  during start-up stops the workers started so far;
- reserves the port first with a bound, non-listening SO_REUSEPORT socket (so port 0 resolves
  once, and the port stays theirs while a worker restarts), after checking that nothing else
  holds it;
- reads the token file itself, at start and on SIGHUP, and hands the parsed table (token
  digests, never tokens) to its workers over a pipe each; a file that no longer parses is
  logged and the last good table stays, for the running workers and for those it restarts;
- serves the HTTP side itself (status page, its API, and Prometheus /metrics aggregating the
  workers' metrics with prometheus_client's multiprocess mode: rngcoord.server.web.status);
- writes the ready file once every worker serves;
- restarts a worker that dies (after 1 s, doubling up to 30 s while it keeps dying before it
  serves), and on SIGTERM or SIGINT tells every worker to drain; a second one kills them.

A worker never outlives its supervisor: it asks the kernel for SIGTERM when the supervisor
dies (PR_SET_PDEATHSIG), and it watches its pipe, whose end of file means the same; either way
it stops serving at once and exits within `_ORPHAN_GRACE_S`.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_for_any
from multiprocessing.process import BaseProcess
from pathlib import Path
from types import FrameType
from typing import Any

from rngcoord.server.addresses import join_host_port, split_host_port
from rngcoord.server.app import open_for_serving, run_server, write_atomically
from rngcoord.server.auth import TokenTable, load_tokens
from rngcoord.server.logs import configure, event, get_logger
from rngcoord.server.options import ServerOptions, with_port
from rngcoord.server.storage.store import Store
from rngcoord.server.web.status import StatusThread

__all__ = ["serve_workers", "supervise"]

START_TIMEOUT_S = 120.0
_RESTART_BACKOFF_S = 1.0
_MAX_RESTART_BACKOFF_S = 30.0
_ORPHAN_GRACE_S = 2.0
"""How long a worker whose supervisor died may finish the calls in flight before it exits."""
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_STOPS = (signal.SIGTERM, signal.SIGINT)
_log = get_logger("workers")


class _Signals:
    """SIGTERM, SIGINT and SIGHUP as the supervisor receives them, from its first moment.

    The handlers only take note (and wake the main loop through a socket pair): a signal may
    arrive anywhere, in the middle of creating the store or of starting a worker, and acting
    on it there could leave workers unsupervised. The main loop acts on what was noted.
    """

    def __init__(self) -> None:
        self.stop: signal.Signals | None = None
        self.hangups = 0
        self.workers: dict[int, _Worker] = {}
        """Killed by a second SIGTERM or SIGINT, which cannot wait for the main loop."""
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._previous = {s: signal.getsignal(s) for s in (*_STOPS, signal.SIGHUP)}
        for signum in self._previous:
            signal.signal(signum, self._note)
        # `rngcoord serve` blocked SIGHUP first thing; one held since then is taken now.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGHUP})

    def _note(self, signum: int, _frame: FrameType | None) -> None:
        if signum == signal.SIGHUP:
            self.hangups += 1
        elif self.stop is None:
            self.stop = signal.Signals(signum)
        else:
            # A second stop: the drain is not wanted. The workers would follow anyway (their
            # parent-death signal), but killed here they cannot serve one more call.
            for worker in list(self.workers.values()):
                worker.kill()
            os._exit(128 + signum)
        with contextlib.suppress(OSError):  # full: the loop is already due to wake
            self._wake_w.send(b"\0")

    def take_hangup(self) -> bool:
        """Whether a SIGHUP arrived since the last call."""
        if not self.hangups:
            return False
        self.hangups = 0
        return True

    @property
    def waker(self) -> socket.socket:
        """Readable once a signal arrived; `drain_waker` empties it."""
        return self._wake_r

    def drain_waker(self) -> None:
        with contextlib.suppress(OSError):
            while self._wake_r.recv(4096):
                pass

    def close(self) -> None:
        for signum, handler in self._previous.items():
            # None: a handler installed outside Python, which cannot be put back.
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self._wake_r.close()
        self._wake_w.close()


@dataclass
class _Worker:
    """One worker process and the supervisor's end of its pipe."""

    index: int
    proc: BaseProcess
    conn: Connection
    serving: bool = False
    conn_open: bool = True

    def alive(self) -> bool:
        return self.proc.is_alive()

    def kill(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            if self.proc.pid is not None and self.proc.exitcode is None:
                os.kill(self.proc.pid, signal.SIGKILL)

    def messages(self) -> list[tuple[Any, ...]]:
        """What the worker sent since the last call (its pipe is closed at its end of file)."""
        received: list[tuple[Any, ...]] = []
        try:
            while self.conn_open and self.conn.poll():
                received.append(self.conn.recv())
        except (EOFError, OSError):
            self.close_pipe()
        return received

    def send(self, message: object) -> None:
        if not self.conn_open:
            return
        try:
            self.conn.send(message)
        except OSError:
            self.close_pipe()  # it died: a restart hands it the same table

    def close_pipe(self) -> None:
        self.conn_open = False
        self.conn.close()


def serve_workers(
    options: ServerOptions,
    workers: int,
    *,
    ready_file: Path | None = None,
    grace_s: float = 10.0,
    log_level: int | str = logging.INFO,
) -> int:
    """`rngcoord serve --workers N` (N > 1): create, key and floor the store once, here (the
    workers only open it), then `supervise` the workers. Arguments as for
    rngcoord.server.app.serve."""
    # First of all: until now a SIGHUP (a reload, for us) would have ended this process.
    signals = _Signals()
    try:
        configure(log_level)
        store, _chain = open_for_serving(options)
        store.close()
        options = replace(options, init=False, floor_from=())
        return supervise(options, workers, ready_file=ready_file, grace_s=grace_s, signals=signals)
    finally:
        signals.close()


def supervise(
    options: ServerOptions,
    workers: int,
    *,
    ready_file: Path | None,
    grace_s: float,
    signals: _Signals | None = None,
) -> int:
    """Serve `options` from `workers` processes until SIGTERM or SIGINT; return 0.

    Must run on the main thread: it handles SIGTERM, SIGINT and SIGHUP (`signals`, when the
    caller installed them earlier, else from here on), and a worker's parent-death signal
    follows the thread that started it.

    Raises:
        OSError: the port is taken, or a worker could not start (its error is named).
        ValueError: the token file does not parse (naming its line, never a token).
    """
    own_signals = signals is None
    signals = signals if signals is not None else _Signals()
    try:
        return _Supervisor(options, workers, signals, ready_file, grace_s).run()
    finally:
        if own_signals:
            signals.close()


class _Supervisor:
    def __init__(
        self,
        options: ServerOptions,
        workers: int,
        signals: _Signals,
        ready_file: Path | None,
        grace_s: float,
    ) -> None:
        self.options = options
        self.count = workers
        self.signals = signals
        self.ready_file = ready_file
        self.grace_s = grace_s
        self.tokens: TokenTable | None = None
        self.workers = signals.workers
        self.restart_at: dict[int, float] = {}
        self.backoff: dict[int, float] = {}
        self.context = multiprocessing.get_context("spawn")
        self.level = logging.getLogger("rngcoord").level
        self.worker_options = options
        self.status_http: StatusThread | None = None

    def run(self) -> int:
        options = self.options
        # Read once here, before any worker starts: a file that does not parse now is an
        # error to the operator, and later reloads fall back to this table.
        self.tokens = load_tokens(options.tokens) if options.tokens is not None else None
        host, port = split_host_port(options.listen)
        holder = _reserve_port(host, port)
        port = int(holder.getsockname()[1])
        metrics_dir = tempfile.mkdtemp(prefix="rngcoord-metrics-")
        # Read by prometheus_client when a worker imports it: every worker writes its counters
        # to files there, which the supervisor's endpoint adds up.
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
        self.worker_options = replace(
            with_port(options, port), reuse_port=True, metrics_listen=None
        )
        status_store: Store | None = None
        try:
            for index in range(self.count):
                if self.signals.stop is not None:
                    break
                self.start(index)
            if self.signals.stop is None and self.await_ready():
                if options.metrics_listen is not None:
                    self.status_http, status_store = _serve_status(
                        options, metrics_dir, self.tokens
                    )
                address = join_host_port(host, port)
                event(
                    _log,
                    logging.INFO,
                    "workers_serving",
                    address=address,
                    workers=self.count,
                    metrics=self.status_http.address if self.status_http is not None else "off",
                )
                if self.ready_file is not None:
                    write_atomically(self.ready_file, address)
                self.serve()
            self.drain()
            event(_log, logging.INFO, "stopped")
            return 0
        finally:
            for worker in self.workers.values():
                worker.kill()
                worker.proc.join()
                worker.close_pipe()
            if self.status_http is not None:
                self.status_http.stop()
            if status_store is not None:
                status_store.close()
            holder.close()
            shutil.rmtree(metrics_dir, ignore_errors=True)

    def start(self, index: int) -> None:
        ours, theirs = self.context.Pipe()
        proc = self.context.Process(
            target=_worker_main,
            args=(
                replace(self.worker_options, worker=index),
                theirs,
                self.tokens,
                self.level,
                self.grace_s,
                os.getpid(),
            ),
            name=f"rngcoord-worker-{index}",
            daemon=False,
        )
        # The child inherits the blocked mask through fork and exec, so a SIGHUP that reaches
        # it before it ignores SIGHUP waits, and is then dropped, instead of killing it.
        # (SIGTERM and SIGINT cannot be held this way: multiprocessing unblocks them while it
        # starts its resource tracker. Before the worker serves, dying of them is right.)
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGHUP})
        try:
            proc.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
            theirs.close()
        self.workers[index] = _Worker(index, proc, ours)

    def wait(self, timeout_s: float) -> None:
        """Until a signal, a message or a worker's exit, or `timeout_s`."""
        waitables: list[Any] = [self.signals.waker]
        for worker in self.workers.values():
            if worker.proc.exitcode is None:  # a dead one's sentinel would end every wait
                waitables.append(worker.proc.sentinel)
            if worker.conn_open:
                waitables.append(worker.conn)
        wait_for_any(waitables, timeout=max(timeout_s, 0.0))
        self.signals.drain_waker()

    def await_ready(self) -> bool:
        """Wait until every worker serves; False when a SIGTERM or SIGINT came first.

        Raises:
            OSError: a worker failed or exited before serving, or START_TIMEOUT_S passed.
        """
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.signals.stop is not None:
                return False
            if time.monotonic() > deadline:
                raise OSError(f"workers did not start within {START_TIMEOUT_S:.0f}s")
            for worker in self.workers.values():
                for message in worker.messages():
                    if message[0] == "ready":
                        worker.serving = True
                    else:
                        raise OSError(f"worker {worker.index} could not start: {message[1]}")
                if not worker.serving and not worker.alive():
                    raise OSError(
                        f"worker {worker.index} exited with status {worker.proc.exitcode} "
                        "before serving (see its log lines)"
                    )
            if all(w.serving for w in self.workers.values()):
                return True
            self.wait(min(deadline - time.monotonic(), 1.0))

    def serve(self) -> None:
        """Until SIGTERM or SIGINT: apply reloads, restart workers that die."""
        while self.signals.stop is None:
            if self.signals.take_hangup():
                self.reload_tokens()
            now = time.monotonic()
            for index, worker in list(self.workers.items()):
                for message in worker.messages():
                    if message[0] == "ready":
                        worker.serving = True
                        self.backoff.pop(index, None)
                        event(_log, logging.INFO, "worker_serving", worker=index)
                    else:
                        event(_log, logging.ERROR, "worker_failed", worker=index, error=message[1])
                if index in self.restart_at or worker.alive():
                    continue
                worker.proc.join()
                worker.close_pipe()
                backoff = _RESTART_BACKOFF_S
                if not worker.serving:  # died again before serving: a crash loop slows down
                    backoff = min(2 * self.backoff.get(index, 0.0), _MAX_RESTART_BACKOFF_S)
                    backoff = max(backoff, _RESTART_BACKOFF_S)
                self.backoff[index] = backoff
                self.restart_at[index] = now + backoff
                event(
                    _log,
                    logging.ERROR,
                    "worker_died",
                    worker=index,
                    exitcode=worker.proc.exitcode,
                    restart_in_s=backoff,
                )
            for index, at in list(self.restart_at.items()):
                if at <= now:
                    del self.restart_at[index]
                    self.start(index)
            wake = min([1.0, *(at - now for at in self.restart_at.values())])
            self.wait(wake)

    def reload_tokens(self) -> None:
        path = self.options.tokens
        if path is None:
            event(_log, logging.INFO, "tokens_not_reloaded", reason="no token file (--tokens)")
            return
        try:
            table = load_tokens(path)
        except (OSError, ValueError) as exc:
            # load_tokens names the file and line, never a token.
            event(_log, logging.ERROR, "tokens_reload_failed", error=str(exc), kept="previous")
            return
        self.tokens = table
        for worker in self.workers.values():
            worker.send(("tokens", table))
        if self.status_http is not None:
            self.status_http.reload(table)
        event(_log, logging.INFO, "tokens_reloaded", tokens=len(table), file=str(path))

    def drain(self) -> None:
        stop = self.signals.stop
        if stop is None:
            return
        event(_log, logging.INFO, "draining", grace_s=self.grace_s, signal=stop.name)
        for worker in self.workers.values():
            if worker.alive() and worker.proc.pid is not None:
                os.kill(worker.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s + 10
        for worker in self.workers.values():
            worker.proc.join(max(deadline - time.monotonic(), 0.0))


def _reserve_port(host: str, port: int) -> socket.socket:
    """A bound, non-listening SO_REUSEPORT socket on (host, port) that keeps the port.

    A fixed port is first bound without SO_REUSEPORT, which fails if any other socket holds
    it: a second `rngcoord serve` must not silently share a port with this one.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    if port:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((host, port))
            except OSError as exc:
                raise OSError(f"cannot listen on {join_host_port(host, port)}: {exc}") from exc
    holder = socket.socket(family, socket.SOCK_STREAM)
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        holder.bind((host, port))
    except OSError as exc:
        holder.close()
        raise OSError(f"cannot listen on {join_host_port(host, port)}: {exc}") from exc
    return holder


def _serve_status(
    options: ServerOptions, metrics_dir: str, tokens: TokenTable | None
) -> tuple[StatusThread, Store]:
    """The HTTP side of the supervisor: the status page over the store (returned too: the
    caller closes it after the thread), and /metrics adding up the workers' counters."""
    from prometheus_client import CollectorRegistry, multiprocess

    from rngcoord.server.audit.chain import Chain, load_key
    from rngcoord.server.storage.stores import open_store
    from rngcoord.server.web.status import StatusServer, StoreSource

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=metrics_dir)  # type: ignore[no-untyped-call]
    key = load_key(str(options.audit_key)) if options.audit_key is not None else None
    store = open_store(options.db_url)
    server = StatusServer(
        StoreSource(store, Chain(store.store_id, key)),
        registry,
        tokens,
        open_access=options.status_open,
        tls=options.tls,
    )
    host, port = split_host_port(options.metrics_listen or "")
    try:
        status = StatusThread(server, host, port)
    except BaseException:
        store.close()
        raise
    if server.is_open:
        event(
            _log,
            logging.WARNING,
            "status_page_open",
            address=status.address,
            reason="--status-open" if options.status_open else "no token file",
        )
    return status, store


def _die_with_supervisor(supervisor: int) -> None:
    """Have the kernel send SIGTERM when the supervisor dies; exit if it already has."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"prctl(PR_SET_PDEATHSIG): {os.strerror(errno)}")
    # The signal only covers a death from now on: one before it was set left this process to
    # another parent already. (Elsewhere the pipe's end of file is the only watch.)
    if os.getppid() != supervisor:
        os._exit(1)


def _worker_main(
    options: ServerOptions,
    conn: Connection,
    tokens: TokenTable | None,
    level: int,
    grace_s: float,
    supervisor: int,
) -> None:
    """A worker process: serve until SIGTERM, telling the supervisor when it serves."""
    _die_with_supervisor(supervisor)
    configure(level)
    # Ctrl-C reaches the whole process group; the supervisor decides, and sends SIGTERM.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # A hangup of the terminal reaches the whole group too; tokens come from the supervisor.
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGHUP})
    try:
        asyncio.run(_serve_worker(options, conn, tokens, grace_s))
    except BaseException as exc:
        with contextlib.suppress(OSError):
            conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        raise


async def _serve_worker(
    options: ServerOptions, conn: Connection, tokens: TokenTable | None, grace_s: float
) -> None:
    stop = asyncio.Event()
    reload = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    current = tokens

    def use(table: TokenTable) -> None:
        nonlocal current
        current = table
        reload.set()

    def orphaned() -> None:
        event(_log, logging.WARNING, "supervisor_gone", worker=options.worker)
        stop.set()
        # The drain may wait on calls that run for minutes (a JoinGroup); with nobody left to
        # stop or restart this worker, it must not outlive its supervisor by more than this.
        exit_timer = threading.Timer(_ORPHAN_GRACE_S, os._exit, (1,))
        exit_timer.daemon = True
        exit_timer.start()

    def listen() -> None:
        while True:
            try:
                kind, table = conn.recv()
            except (EOFError, OSError):
                with contextlib.suppress(RuntimeError):  # a closed loop: it stopped already
                    loop.call_soon_threadsafe(orphaned)
                return
            if kind == "tokens":
                try:
                    loop.call_soon_threadsafe(use, table)
                except RuntimeError:
                    return

    threading.Thread(target=listen, name="supervisor-pipe", daemon=True).start()

    def started(address: str, _metrics: str | None) -> None:
        conn.send(("ready", address))

    await run_server(
        options,
        stop,
        started=started,
        grace_s=grace_s,
        reload=reload,
        token_loader=lambda _path: _table(current),
    )


def _table(tokens: TokenTable | None) -> TokenTable:
    # Only called when the options name a token file, which the supervisor read first.
    assert tokens is not None, "the supervisor hands its workers a table with a token file"
    return tokens
