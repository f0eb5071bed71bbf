"""The connection guard: one peer host's connections can never lock the others out.

gRPC core caps a process's connections (`grpc.max_allowed_incoming_connections`), but it
closes whatever arrives past the cap at accept, whoever sent it: one host that opens
connections and never calls takes every place, and then health checks and every other client
are refused. gRPC Python has no hook at accept, so `ConnectionGuard` looks from outside: it
reads which of this process's sockets are connections to the listening port
and where they come from (the kernel's /proc/net/tcp and /proc/net/tcp6 map a socket's inode to
its remote address; /proc/self/fd maps the inode to this process's descriptor), and

1. closes a peer host's connections past `per_host` (the newest first, and those with a call in
   flight only after the idle ones), so that one host holds at most a quarter of the places by
   default;
2. while the process holds more than half of `max_connections`, closes every connection that
   had no call for `crowded_idle_s` (the gate counts calls per connection: `PeerActivity`);
3. keeps `reserve` places free for newcomers (health checks first of all): past
   `max_connections - reserve` it also closes connections idle for a second, newest first,
   from the hosts holding the most.

A connection is closed with shutdown(SHUT_RDWR) on a duplicate of gRPC's descriptor, after
checking that the duplicate is still the socket that was scanned (descriptors are reused);
gRPC then sees the end of its stream and closes its own descriptor. The peer sees EOF; a gRPC
client reconnects on its next call. Each closing is logged, at most one line per peer host per
10 s with a count (`RefusalLog`).

The scan costs nothing while /proc/net/sockstat's count of TCP sockets in use shows that no
host can be past its cap and the process cannot be crowded; otherwise the reading runs on a
worker thread every 0.5 s while it finds something to close, every 2 s when calm (at once when
many sockets appear), and the decisions (a pass over the connections) on the event loop.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import socket
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from rngcoord.server.logs import event, get_logger
from rngcoord.server.rpc.gate import PeerActivity, RefusalLog

__all__ = ["Connection", "ConnectionGuard", "scan_connections", "tcp_in_use"]

_log = get_logger("connections")
_TICK_S = 0.5
_CALM_S = 2.0
_SURGE = 64
"""TCP sockets more than at the last scan that call for the next one at once."""
_GRACE_S = 1.0
"""How long a fresh connection has for its first call before the headroom rule may close it:
a health check calls within milliseconds of connecting."""
_TCP_FILES = (("/proc/net/tcp", False), ("/proc/net/tcp6", True))
_LISTEN = "0A"
_V4_MAPPED = b"\x00" * 10 + b"\xff\xff"


@dataclass(frozen=True, slots=True)
class Connection:
    """One accepted TCP connection of this process.

    Attributes:
        inode: the socket's inode, which identifies it for as long as it is open.
        fd: this process's descriptor for it when scanned.
        host: the peer host as the gate names it, "ipv4:10.0.0.7" or "ipv6:%5B::1%5D".
        peer: the peer as gRPC's `context.peer()` spells it, "ipv4:10.0.0.7:41234".
    """

    inode: int
    fd: int
    host: str
    peer: str


def tcp_in_use(path: str = "/proc/net/sockstat") -> int | None:
    """The TCP sockets in use in this network namespace (all processes'), or None when the
    kernel does not say."""
    try:
        with open(path, encoding="ascii") as f:
            for line in f:
                if line.startswith("TCP:"):
                    fields = line.split()
                    return int(fields[fields.index("inuse") + 1])
    except (OSError, ValueError, IndexError):
        return None
    return None


@functools.lru_cache(maxsize=1 << 16)
def _address(hex_addr: str, v6: bool) -> tuple[str, int]:
    """("ipv4:1.2.3.4" or "ipv6:%5B::1%5D", port) of a /proc/net/tcp* address "HEX:PORT"."""
    addr, _, port = hex_addr.partition(":")
    raw = bytes.fromhex(addr)
    # The kernel prints the address as 32-bit words in host (little-endian) order.
    raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    if v6 and raw[:12] == _V4_MAPPED:
        v6, raw = False, raw[12:]  # gRPC names an IPv4 peer of a dual-stack socket ipv4:
    if v6:
        # Spelled as gRPC spells it in `context.peer()`, brackets URI-escaped.
        return f"ipv6:%5B{socket.inet_ntop(socket.AF_INET6, raw)}%5D", int(port, 16)
    return f"ipv4:{socket.inet_ntop(socket.AF_INET, raw)}", int(port, 16)


def _proc_available() -> bool:
    return os.path.isdir("/proc/self/fd") and tcp_in_use() is not None


class SocketFds:
    """inode -> descriptor of this process's sockets, kept between scans: only descriptors
    that are new, or whose socket is gone, are read again (a readlink each), so a scan of
    thousands of steady connections costs no syscall per connection."""

    def __init__(self) -> None:
        self._inode_of: dict[int, int] = {}

    def refresh(self, live: Iterable[int]) -> dict[int, int]:
        """The map, for the sockets whose inodes are `live` (listed by the kernel now)."""
        live = set(live)
        known = self._inode_of
        fresh: dict[int, int] = {}
        for name in os.listdir("/proc/self/fd"):
            fd = int(name)
            inode = known.get(fd)
            if inode is None or inode not in live:
                # New, or its socket is gone and the number may name another file now.
                try:
                    target = os.readlink(f"/proc/self/fd/{name}")
                except OSError:  # closed since the listing
                    continue
                inode = int(target[8:-1]) if target.startswith("socket:[") else 0
            fresh[fd] = inode
        self._inode_of = fresh
        return {inode: fd for fd, inode in fresh.items() if inode in live}


def scan_connections(port: int, fds: SocketFds | None = None) -> list[Connection]:
    """This process's TCP connections whose local port is `port` (accepted ones: a listening
    socket and the connections still in its accept queue have no descriptor here).

    Args:
        port: the listening port.
        fds: the descriptor map kept from the previous scan. Default: a fresh one.
    """
    needle = f":{port:04X} "
    found: dict[int, tuple[str, str]] = {}
    for path, v6 in _TCP_FILES:
        try:
            with open(path, encoding="ascii") as f:
                lines = f.read().splitlines()[1:]
        except OSError:  # no IPv6 here
            continue
        for line in lines:
            if needle not in line:
                continue
            fields = line.split(None, 10)
            if len(fields) < 10 or fields[3] == _LISTEN or not fields[1].endswith(needle[:-1]):
                continue
            inode = int(fields[9])
            if inode:
                host, peer_port = _address(fields[2], v6)
                found[inode] = (host, f"{host}:{peer_port}")
    if not found:
        return []
    by_inode = (fds if fds is not None else SocketFds()).refresh(found)
    return [
        Connection(inode, by_inode[inode], host, peer)
        for inode, (host, peer) in found.items()
        if inode in by_inode
    ]


def shut_down(connection: Connection) -> bool:
    """Shut `connection` down (both ways) through a duplicate of its descriptor; False when
    the descriptor no longer holds that socket. gRPC's descriptor is never closed here."""
    try:
        dup = os.dup(connection.fd)
    except OSError:
        return False
    try:
        if os.fstat(dup).st_ino != connection.inode:
            return False  # gRPC closed it, and the number now names another file
        sock = socket.socket(fileno=dup)
    except OSError:
        os.close(dup)
        return False
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:  # already shut down, or reset by the peer
        return False
    finally:
        sock.close()  # closes the duplicate only
    return True


class ConnectionGuard:
    """Enforces the per-host cap, the crowded idle timeout and the headroom; see the module.

    Args:
        port: the gRPC listening port.
        max_connections: the process's connection cap (gRPC core's).
        per_host: most connections of one peer host.
        crowded_idle_s: above half of `max_connections`, connections idle this long close.
        activity: calls in flight and the last call per connection, kept by the gate.
        refusals: where closings are logged, rate-limited per host.
        now: the clock. Default time.monotonic.
    """

    def __init__(
        self,
        port: int,
        *,
        max_connections: int,
        per_host: int,
        crowded_idle_s: float,
        activity: PeerActivity,
        refusals: RefusalLog,
        now: Callable[[], float] = time.monotonic,
    ) -> None:
        if per_host < 1 or max_connections < 1:
            raise ValueError(f"connection caps must be at least 1, got {per_host}")
        self.port = port
        self.max_connections = max_connections
        self.per_host = per_host
        self.crowded_at = max_connections // 2
        self.crowded_idle_s = crowded_idle_s
        # Enough places for a burst of health checks and reconnecting clients, and never
        # more than a sixteenth of the cap.
        self.reserve = max(1, min(64, max_connections // 16))
        self._activity = activity
        self._refusals = refusals
        self._now = now
        self._first_seen: dict[int, float] = {}
        self._fds = SocketFds()
        self.closed = 0
        """Connections closed so far (for tests and metrics)."""

    async def run(self) -> None:
        """Guard until cancelled."""
        if not _proc_available():
            event(_log, logging.WARNING, "connection_guard_off", reason="no /proc (not Linux)")
            return
        loop = asyncio.get_running_loop()
        next_scan, scanned_at_use = 0.0, 0
        while True:
            await asyncio.sleep(_TICK_S)
            self._refusals.flush()
            in_use = tcp_in_use() or 0
            # No host can be past its cap, nor the process crowded, while the whole namespace
            # has fewer TCP sockets than that.
            if in_use <= min(self.per_host, self.crowded_at):
                self._first_seen.clear()
                self._activity.forget_older(self._now() - self.crowded_idle_s)
                continue
            # A calm scan is repeated every few seconds only, unless sockets keep arriving.
            now = self._now()
            if now < next_scan and in_use < scanned_at_use + _SURGE:
                continue
            try:
                connections = await loop.run_in_executor(
                    None, scan_connections, self.port, self._fds
                )
            except OSError as exc:
                event(_log, logging.WARNING, "connection_scan_failed", error=str(exc))
                continue
            doomed = self.decide(connections)
            if doomed:
                await loop.run_in_executor(None, self._close, doomed)
            next_scan = now + (_TICK_S if doomed else _CALM_S)
            scanned_at_use = in_use

    def decide(self, connections: Iterable[Connection]) -> list[tuple[Connection, str]]:
        """The connections to close now, each with why; remembers when each was first seen."""
        now = self._now()
        seen = self._first_seen
        current: list[Connection] = []
        for c in connections:
            seen.setdefault(c.inode, now)
            current.append(c)
        if len(seen) > len(current):
            live = {c.inode for c in current}
            for inode in [i for i in seen if i not in live]:
                del seen[inode]
            self._activity.forget({c.peer for c in current})
        # Newest last: first seen later, then the higher inode (the kernel numbers sockets in
        # order of creation, nearly).
        current.sort(key=lambda c: (seen[c.inode], c.inode))
        activity = self._activity
        doomed: list[tuple[Connection, str]] = []
        gone: set[int] = set()
        by_host: dict[str, list[Connection]] = {}
        for c in current:
            by_host.setdefault(c.host, []).append(c)
        for host_connections in by_host.values():
            excess = len(host_connections) - self.per_host
            if excess <= 0:
                continue
            # Newest first, and connections with a call in flight only after the idle ones.
            newest = sorted(
                reversed(host_connections), key=lambda c: activity.in_flight(c.peer) > 0
            )
            for c in newest[:excess]:
                doomed.append((c, "per_host_cap"))
                gone.add(c.inode)
        left = len(current) - len(gone)
        if left > self.crowded_at:
            for c in current:
                if c.inode not in gone and self._idle_for(c, now) >= self.crowded_idle_s:
                    doomed.append((c, "idle_while_crowded"))
                    gone.add(c.inode)
            left = len(current) - len(gone)
        room = self.max_connections - self.reserve
        if left > room:
            # The hosts holding the most give first, newest first.
            order = sorted(
                (c for c in reversed(current) if c.inode not in gone),
                key=lambda c: -len(by_host[c.host]),
            )
            for c in order:
                if left <= room:
                    break
                if self._idle_for(c, now) >= _GRACE_S:
                    doomed.append((c, "headroom"))
                    gone.add(c.inode)
                    left -= 1
        return doomed

    def _idle_for(self, c: Connection, now: float) -> float:
        """Seconds since `c` last had a call in flight (or since it was first seen); 0 while
        one is."""
        if self._activity.in_flight(c.peer):
            return 0.0
        last = self._activity.last_call(c.peer)
        since = self._first_seen.get(c.inode, now)
        return now - (since if last is None else max(last, since))

    def _close(self, doomed: list[tuple[Connection, str]]) -> None:
        closed: dict[tuple[str, str], int] = {}
        for c, why in doomed:
            if shut_down(c):
                closed[c.host, why] = closed.get((c.host, why), 0) + 1
        for (host, why), count in closed.items():
            self.closed += count
            self._refusals.note(
                host,
                "connections_closed",
                why,
                count,
                cap=self.per_host if why == "per_host_cap" else self.max_connections,
            )
