"""urllib handlers that only connect to public internet addresses (SSRF protection).

A server that fetches URLs for its clients must not become their way into its own
network: ``http://127.0.0.1:6379``, ``http://10.0.0.5/admin`` or the cloud metadata
service at ``169.254.169.254``. Checking the URL's host is not enough (a public name may
resolve to a private address, and a public URL may redirect to a private one), so the
check happens where the socket is opened: every connection, the first and each one a
redirect leads to, resolves the host, refuses if any of its addresses is not public,
and then connects to exactly the address it checked (so a DNS answer that changes
between check and connect cannot slip through). Proxies are disabled, since a proxy
would reach the target on our behalf, unchecked.
"""

from __future__ import annotations

import http.client
import ipaddress
import socket
import urllib.request


class BlockedAddressError(OSError):
    """The URL's host is, or resolves to, an address that is not on the public internet."""


# IPv6 forms that carry an IPv4 address in their last 32 bits: NAT64's well-known prefix
# (RFC 6052), IPv4-compatible (deprecated, RFC 4291) and IPv4-translated (SIIT, RFC 2765)
# addresses. A NAT64 gateway or a dual-stack host would deliver them to the IPv4 address,
# so they are judged by it (``64:ff9b::a9fe:a9fe`` is the metadata service).
_EMBEDS_LAST_32_BITS = tuple(ipaddress.ip_network(n) for n in (
    "64:ff9b::/96", "::/96", "::ffff:0:0:0/96",
))
# NAT64's local-use prefix (RFC 8215): the IPv4 may sit at any of RFC 6052's offsets and
# the translator is by definition inside someone's network, so none of it is public.
_NEVER_PUBLIC = ipaddress.ip_network("64:ff9b:1::/48")


def _embedded_ipv4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip.teredo is not None:
        return ip.teredo[1]  # the client's address (Python undoes the XOR)
    if any(ip in network for network in _EMBEDS_LAST_32_BITS):
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


def is_public_address(address: str) -> bool:
    """Whether ``address`` (an IP literal) is a public, unicast internet address. An IPv6
    address that embeds an IPv4 one (mapped, compatible, NAT64, 6to4, Teredo) is judged
    by the IPv4 address it leads to."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])  # drop an IPv6 zone id
    if isinstance(ip, ipaddress.IPv6Address):
        if ip in _NEVER_PUBLIC:
            return False
        embedded = _embedded_ipv4(ip)
        if embedded is not None:
            ip = embedded
    return ip.is_global and not ip.is_multicast


def public_addresses(host: str, port: int) -> list[tuple]:
    """The socket addresses of ``host``; BlockedAddressError if any one is not public."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise OSError(f"cannot resolve {host!r} ({e.strerror})") from e
    for *_, sockaddr in infos:
        if not is_public_address(sockaddr[0]):
            target = sockaddr[0] if host == sockaddr[0] else f"{host} (resolves to {sockaddr[0]})"
            raise BlockedAddressError(
                f"{target} is not a public internet address (private, loopback, "
                "link-local and reserved networks are refused)"
            )
    return [(family, sockaddr) for family, _, _, _, sockaddr in infos]


def create_public_connection(address, timeout=socket._GLOBAL_DEFAULT_TIMEOUT,
                             source_address=None) -> socket.socket:
    """``socket.create_connection`` that only connects to a checked public address."""
    host, port = address
    error: OSError | None = None
    for family, sockaddr in public_addresses(host, port):
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            if timeout is not socket._GLOBAL_DEFAULT_TIMEOUT:
                sock.settimeout(timeout)
            if source_address:
                sock.bind(source_address)
            sock.connect(sockaddr)
            return sock
        except OSError as e:
            error = e
            sock.close()
    raise error or OSError(f"cannot connect to {host!r}")


class _PublicHTTPConnection(http.client.HTTPConnection):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._create_connection = create_public_connection


class _PublicHTTPSConnection(http.client.HTTPSConnection):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._create_connection = create_public_connection


class PublicHTTPHandler(urllib.request.HTTPHandler):
    def http_open(self, req):
        return self.do_open(_PublicHTTPConnection, req)


class PublicHTTPSHandler(urllib.request.HTTPSHandler):
    def https_open(self, req):
        return self.do_open(_PublicHTTPSConnection, req, context=self._context)


def public_only_handlers() -> list[urllib.request.BaseHandler]:
    """Handlers for ``urllib.request.build_opener`` that confine it to public addresses."""
    return [urllib.request.ProxyHandler({}), PublicHTTPHandler(), PublicHTTPSHandler()]
