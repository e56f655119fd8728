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


def is_public_address(address: str) -> bool:
    """Whether ``address`` (an IP literal) is a public, unicast internet address."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])  # drop an IPv6 zone id
    if isinstance(ip, ipaddress.IPv6Address):
        # Addresses that carry an IPv4 address are judged by it.
        embedded = ip.ipv4_mapped or ip.sixtofour or (ip.teredo[1] if ip.teredo else None)
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
