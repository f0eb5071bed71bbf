"""Addresses and URLs as the server takes and prints them: HOST:PORT, the host of a gRPC
peer, and store URLs shown without their passwords."""

from __future__ import annotations

from urllib.parse import parse_qsl, urlsplit, urlunsplit

__all__ = ["join_host_port", "peer_host", "redact_url", "split_host_port"]


def split_host_port(address: str) -> tuple[str, int]:
    """Split "HOST:PORT" (IPv6 hosts in brackets) into (host, port).

    Raises ValueError naming the address when it is malformed.

    >>> split_host_port("[::1]:29520")
    ('::1', 29520)
    """
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"address {address!r} is not HOST:PORT")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


def join_host_port(host: str, port: int) -> str:
    """ "HOST:PORT", with an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def redact_url(url: str) -> str:
    """`url` with any password (in the authority or a `password=` query) replaced by "***".

    >>> redact_url("postgresql://u:secret@db/x?password=also")
    'postgresql://u:***@db/x?password=***'
    """
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    if parts.password is None and all(k != "password" for k, _ in query):
        return url
    netloc = parts.netloc
    if parts.password is not None:
        netloc = netloc.replace(f":{parts.password}@", ":***@", 1)
    shown = "&".join(f"{k}={'***' if k == 'password' else v}" for k, v in query)
    return urlunsplit(parts._replace(netloc=netloc, query=shown))


def peer_host(peer: str) -> str:
    """The host part of a gRPC peer string: "ipv4:10.0.0.7:41234" -> "ipv4:10.0.0.7"."""
    if peer.startswith("unix:"):
        return "unix"
    host, sep, port = peer.rpartition(":")
    return host if sep and port.isdigit() else peer
