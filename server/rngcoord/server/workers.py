"""`rngcoord serve --workers N`: N server processes on one port, over one store.

A Python process serves from one core (the GIL). To use every core, the supervisor starts N
worker processes that each run `rngcoord.server.app.run_server` with SO_REUSEPORT on the same
port; the kernel spreads incoming connections over them. They share the store, which already
serialises writers (SQLite's file lock with BEGIN IMMEDIATE; PostgreSQL's `audit_head` row
lock), and each follows the others' changes through the change feed (rngcoord.server.feed):
a join barrier that forms in one worker wakes the joins waiting in the others.

The supervisor:
- reserves the port first with a bound, non-listening SO_REUSEPORT socket (so port 0 resolves
  once, and the port stays theirs while a worker restarts), after checking that nothing else
  holds it;
- serves the HTTP side itself (status page, its API, and Prometheus /metrics aggregating the
  workers' metrics with prometheus_client's multiprocess mode: rngcoord.server.status);
- writes the ready file once every worker serves;
- restarts a worker that dies, passes SIGHUP on to every worker (each reloads its token
  file), and on SIGTERM or SIGINT tells every worker to drain.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
import time
from dataclasses import replace
from multiprocessing.connection import wait as wait_for_any
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from rngcoord.server.addresses import join_host_port, split_host_port
from rngcoord.server.app import (
    ServerOptions,
    open_for_serving,
    run_server,
    with_port,
    write_atomically,
)
from rngcoord.server.auth import load_tokens
from rngcoord.server.logs import configure, event, get_logger
from rngcoord.server.status import StatusThread
from rngcoord.server.store import Store

__all__ = ["supervise"]

START_TIMEOUT_S = 120.0
_RESTART_BACKOFF_S = 1.0
_log = get_logger("workers")


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
    configure(log_level)
    store, _chain = open_for_serving(options)
    store.close()
    options = replace(options, init=False, floor_from=())
    return supervise(options, workers, ready_file=ready_file, grace_s=grace_s)


def supervise(
    options: ServerOptions, workers: int, *, ready_file: Path | None, grace_s: float
) -> int:
    """Serve `options` from `workers` processes until SIGTERM or SIGINT; return 0.

    Raises:
        OSError: the port is taken, or a worker could not start (its error is named).
    """
    host, port = split_host_port(options.listen)
    holder = _reserve_port(host, port)
    port = int(holder.getsockname()[1])
    metrics_dir = tempfile.mkdtemp(prefix="rngcoord-metrics-")
    # Read by prometheus_client when a worker imports it: every worker writes its counters to
    # files there, which the supervisor's endpoint adds up.
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    worker_options = replace(with_port(options, port), reuse_port=True, metrics_listen=None)
    context = multiprocessing.get_context("spawn")
    ready: Any = context.SimpleQueue()
    level = logging.getLogger("rngcoord").level
    procs: dict[int, BaseProcess] = {}
    status_http: StatusThread | None = None
    status_store: Store | None = None
    stopping = False

    def start(index: int) -> None:
        proc = context.Process(
            target=_worker_main,
            args=(replace(worker_options, worker=index), ready, level, grace_s),
            name=f"rngcoord-worker-{index}",
            daemon=False,
        )
        proc.start()
        procs[index] = proc

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal stopping
        if stopping:
            os._exit(128 + signum)
        stopping = True
        event(_log, logging.INFO, "draining", grace_s=grace_s, signal=signal.Signals(signum).name)
        for proc in procs.values():
            if proc.pid is not None and proc.is_alive():
                os.kill(proc.pid, signal.SIGTERM)

    def on_hangup(_signum: int, _frame: object) -> None:
        if status_http is not None and options.tokens is not None:
            try:
                status_http.reload(load_tokens(options.tokens))
            except (OSError, ValueError) as exc:
                event(_log, logging.ERROR, "tokens_reload_failed", error=str(exc), kept="previous")
        for proc in procs.values():
            if proc.pid is not None and proc.is_alive():
                os.kill(proc.pid, signal.SIGHUP)

    try:
        for index in range(workers):
            start(index)
        _await_ready(ready, procs, workers)
        if options.metrics_listen is not None:
            status_http, status_store = _serve_status(options, metrics_dir)
        address = join_host_port(host, port)
        event(
            _log,
            logging.INFO,
            "workers_serving",
            address=address,
            workers=workers,
            metrics=status_http.address if status_http is not None else "off",
        )
        if ready_file is not None:
            write_atomically(ready_file, address)
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, on_signal)
        signal.signal(signal.SIGHUP, on_hangup)
        while not stopping:
            wait_for_any([p.sentinel for p in procs.values()], timeout=1.0)
            for index, proc in list(procs.items()):
                if proc.is_alive() or stopping:
                    continue
                event(_log, logging.ERROR, "worker_died", worker=index, exitcode=proc.exitcode)
                time.sleep(_RESTART_BACKOFF_S)
                start(index)
        for proc in procs.values():
            proc.join(grace_s + 10)
        event(_log, logging.INFO, "stopped")
        return 0
    finally:
        for proc in procs.values():
            if proc.is_alive():
                proc.kill()
                proc.join()
        if status_http is not None:
            status_http.stop()
        if status_store is not None:
            status_store.close()
        holder.close()
        shutil.rmtree(metrics_dir, ignore_errors=True)


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


def _await_ready(ready: Any, procs: dict[int, BaseProcess], workers: int) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    serving = 0
    while serving < workers:
        if time.monotonic() > deadline:
            raise OSError(f"workers did not start within {START_TIMEOUT_S:.0f}s")
        if ready.empty():
            dead = [i for i, p in procs.items() if not p.is_alive()]
            if dead:
                raise OSError(f"worker {dead[0]} exited before serving (see its log lines)")
            time.sleep(0.02)
            continue
        status, index, detail = ready.get()
        if status != "ready":
            raise OSError(f"worker {index} could not start: {detail}")
        serving += 1


def _serve_status(options: ServerOptions, metrics_dir: str) -> tuple[StatusThread, Store]:
    """The HTTP side of the supervisor: the status page over the store (returned too: the
    caller closes it after the thread), and /metrics adding up the workers' counters."""
    from prometheus_client import CollectorRegistry, multiprocess

    from rngcoord.server.audit import Chain, load_key
    from rngcoord.server.status import StatusServer, StoreSource
    from rngcoord.server.stores import open_store

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=metrics_dir)  # type: ignore[no-untyped-call]
    key = load_key(str(options.audit_key)) if options.audit_key is not None else None
    tokens = load_tokens(options.tokens) if options.tokens is not None else None
    store = open_store(options.db_url)
    server = StatusServer(
        StoreSource(store, Chain(store.store_id, key)),
        registry,
        tokens,
        open_access=options.status_open,
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


def _worker_main(options: ServerOptions, ready: Any, level: int, grace_s: float) -> None:
    """A worker process: serve until SIGTERM, telling the supervisor when it serves."""
    configure(level)
    # Ctrl-C reaches the whole process group; the supervisor decides, and sends SIGTERM.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Until the event loop takes SIGHUP over, a reload must not end the worker.
    signal.signal(signal.SIGHUP, signal.SIG_IGN)

    parent = os.getppid()

    async def orphaned(stop: asyncio.Event) -> None:
        # A supervisor killed outright (SIGKILL) cannot tell its workers: they drain by
        # themselves rather than keep serving the port unsupervised.
        while os.getppid() == parent:
            await asyncio.sleep(1.0)
        event(_log, logging.WARNING, "supervisor_gone", worker=options.worker)
        stop.set()

    async def main() -> None:
        stop = asyncio.Event()
        reload = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        loop.add_signal_handler(signal.SIGHUP, reload.set)
        watchdog = loop.create_task(orphaned(stop))

        def started(address: str, _metrics: str | None) -> None:
            ready.put(("ready", options.worker, address))

        try:
            await run_server(options, stop, started=started, grace_s=grace_s, reload=reload)
        finally:
            watchdog.cancel()

    try:
        asyncio.run(main())
    except BaseException as exc:
        ready.put(("failed", options.worker, f"{type(exc).__name__}: {exc}"))
        raise
