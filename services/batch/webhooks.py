"""Outbound webhooks (batch job callbacks): where they may go and how they are signed
(`api/webhooks.py` sends them over HTTP).

A callback URL is chosen by a tenant, so the server must never become its proxy into the
private network. The address check runs in the connector's socket factory, on the exact
address each connection attempt uses (after DNS, for every record tried), so a name that
resolves to a public address at submit time and to 127.0.0.1 later (DNS rebinding), an IP
literal, or an IPv4 address wrapped in IPv6 are all refused alike. Only globally routable
unicast addresses pass, plus what the operator allow-lists (`[batch] callback_allow_hosts`:
host names, addresses or CIDR ranges). Redirects are never followed and proxies from the
environment are never used. Every body is signed with the job's own secret:
`X-Galley-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256(secret, "<t>.<body>")>`.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import secrets
import socket
import time
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import urlparse

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
SIGNATURE_HEADER = "X-Galley-Signature"
SECRET_PREFIX = "whsec_"
NAT64 = ipaddress.IPv6Network("64:ff9b::/96")


class CallbackRefused(ValueError):
    """A callback URL or address the policy does not allow."""


def embedded_ipv4(ip: IPAddress) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 one carries (mapped, 6to4, NAT64), which is where it really goes."""
    if isinstance(ip, ipaddress.IPv4Address):
        return None
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip in NAT64:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


def is_public(ip: IPAddress) -> bool:
    """Globally routable unicast: not loopback, private, shared, link-local, multicast, reserved or unspecified."""
    inner = embedded_ipv4(ip)
    if inner is not None and not is_public(inner):
        return False
    special = (ip.is_loopback or ip.is_private or ip.is_link_local or ip.is_multicast or ip.is_reserved
               or ip.is_unspecified or (isinstance(ip, ipaddress.IPv6Address) and ip.is_site_local))
    return ip.is_global and not special


def parse_ip(value: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(value.split("%", 1)[0])  # drop an IPv6 zone (fe80::1%eth0)
    except ValueError:
        return None


@dataclass(frozen=True)
class CallbackPolicy:
    """Which callback hosts and addresses are allowed. Invariant: `hosts` are lower-case names."""

    networks: tuple[IPNetwork, ...] = ()
    hosts: frozenset[str] = frozenset()

    @classmethod
    def from_entries(cls, entries: tuple[str, ...]) -> CallbackPolicy:
        """Allow-list entries: an address or CIDR range (`127.0.0.1`, `10.0.0.0/8`), else a host name."""
        networks, hosts = [], set()
        for entry in entries:
            try:
                networks.append(ipaddress.ip_network(entry, strict=False))
            except ValueError:
                hosts.add(entry.strip().lower().rstrip("."))
        return cls(tuple(networks), frozenset(hosts))

    def allows_address(self, ip: IPAddress) -> bool:
        return is_public(ip) or any(ip.version == net.version and ip in net for net in self.networks)

    def allows_host(self, host: str) -> bool:
        """An allow-listed host name: the operator trusts wherever it resolves."""
        return host.lower().rstrip(".") in self.hosts

    def check_url(self, url: str) -> None:
        """At submit time: http(s) with a host, and an IP literal host must be an allowed address
        (names are checked on every connection, where their addresses are known)."""
        parsed = urlparse(url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise CallbackRefused("must be an http:// or https:// URL with a host")
        ip = parse_ip(parsed.hostname)
        if ip is not None and not self.allows_address(ip) and not self.allows_host(parsed.hostname):
            raise CallbackRefused(f"{ip} is not a public address (loopback, private, link-local, multicast and "
                                  "reserved addresses are refused unless [batch] callback_allow_hosts lists them)")

    def socket_factory(self, addr_info: tuple) -> socket.socket:
        """The HTTP client's socket factory: refuses a connection attempt to an address the policy does not allow."""
        family, type_, proto, _, address = addr_info
        ip = parse_ip(address[0])
        if ip is None or not self.allows_address(ip):
            raise OSError(f"callback address {address[0]} is not allowed (not a public address)")
        return socket.socket(family=family, type=type_, proto=proto)


def new_secret() -> str:
    return SECRET_PREFIX + secrets.token_hex(32)


def signature(secret: str, body: bytes, timestamp: int | None = None) -> str:
    """The `X-Galley-Signature` value for `body`: a receiver recomputes v1 and compares in constant time."""
    t = int(time.time()) if timestamp is None else timestamp
    digest = hmac.new(secret.encode(), f"{t}.".encode() + body, hashlib.sha256).hexdigest()
    return f"t={t},v1={digest}"


class CallbackUnreachable(OSError):
    """The receiver could not be reached, or broke off the exchange (connection, TLS or HTTP errors)."""


class Transport(Protocol):
    """Sends one POST and returns the response status, keeping to the policy it was built with
    (`api/webhooks.py`: the address check on every connection, no redirects, no proxies);
    raises CallbackUnreachable or TimeoutError."""

    async def post(self, url: str, body: bytes, headers: dict[str, str]) -> int: ...
    async def close(self) -> None: ...


class WebhookClient:
    """POSTs signed JSON bodies to callback URLs the policy allows, through `transport`."""

    def __init__(self, policy: CallbackPolicy, transport: Transport) -> None:
        self.policy = policy
        self.transport = transport

    async def post(self, url: str, body: bytes, secret: str | None, headers: dict[str, str]) -> int:
        """The response status (a redirect is returned as it is, not followed); raises CallbackUnreachable,
        TimeoutError, or CallbackRefused for a URL the policy refuses."""
        self.policy.check_url(url)
        headers = {**headers, "Content-Type": "application/json"}
        if secret is not None:
            headers[SIGNATURE_HEADER] = signature(secret, body)
        return await self.transport.post(url, body, headers)

    async def close(self) -> None:
        await self.transport.close()
