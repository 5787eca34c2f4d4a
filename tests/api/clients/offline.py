"""Loopback only: a client library that reaches for the network (a tokenizer download, a price
list, telemetry) fails at once, naming where it went, instead of hanging or passing by luck.
Used by the in-process client tests and imported first by the scripts run in the clients' venvs."""

from __future__ import annotations

import ipaddress
import socket
from typing import Any

LOCAL_NAMES = {"localhost", "127.0.0.1", "::1", "", None}


def _is_loopback(host: Any) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host in LOCAL_NAMES


def guarded_connect(connect):
    def connect_loopback_only(sock: socket.socket, address: Any, *rest: Any) -> Any:
        if sock.family in (socket.AF_INET, socket.AF_INET6) and not _is_loopback(address[0]):
            raise ConnectionRefusedError(f"offline test: a connection to {address[0]} was attempted")
        return connect(sock, address, *rest)
    return connect_loopback_only


def guarded_getaddrinfo(getaddrinfo):
    def getaddrinfo_loopback_only(host: Any, *args: Any, **kwargs: Any) -> Any:
        if not _is_loopback(host.decode() if isinstance(host, bytes) else host):
            raise socket.gaierror(f"offline test: a lookup of {host} was attempted")
        return getaddrinfo(host, *args, **kwargs)
    return getaddrinfo_loopback_only


def patches() -> list[tuple[Any, str, Any]]:
    """(object, attribute, replacement) for monkeypatch.setattr or `install`."""
    return [(socket.socket, "connect", guarded_connect(socket.socket.connect)),
            (socket.socket, "connect_ex", guarded_connect(socket.socket.connect_ex)),
            (socket, "getaddrinfo", guarded_getaddrinfo(socket.getaddrinfo))]


def install() -> None:
    """For a whole process (the client scripts)."""
    for target, name, replacement in patches():
        setattr(target, name, replacement)
