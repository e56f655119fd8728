"""The public-address check behind remote media (SSRF): IPv6 forms that carry an IPv4
address are judged by the IPv4 address they lead to."""

from __future__ import annotations

import ipaddress

import pytest

from mlxvlm.media import public_net

PRIVATE_V4 = ["127.0.0.1", "10.0.0.5", "192.168.1.1", "172.16.0.1", "169.254.169.254",
              "100.64.0.1", "0.0.0.0"]


def nat64(v4: str) -> str:
    return str(ipaddress.IPv6Address(int(ipaddress.ip_address("64:ff9b::"))
                                     | int(ipaddress.IPv4Address(v4))))


def compatible(v4: str) -> str:
    return str(ipaddress.IPv6Address(int(ipaddress.IPv4Address(v4))))


def mapped(v4: str) -> str:
    return f"::ffff:{v4}"


def translated(v4: str) -> str:  # ::ffff:0:a.b.c.d (SIIT)
    return str(ipaddress.IPv6Address((0xFFFF << 32) << 16 | int(ipaddress.IPv4Address(v4))))


def sixtofour(v4: str) -> str:
    return str(ipaddress.IPv6Address((0x2002 << 112) | (int(ipaddress.IPv4Address(v4)) << 80)))


def teredo(v4: str, server: str = "65.54.227.120") -> str:
    # 2001:0:<server>:<flags>:<port ^ ffff>:<client ^ ffffffff>
    client = int(ipaddress.IPv4Address(v4)) ^ 0xFFFFFFFF
    value = (0x20010000 << 96) | (int(ipaddress.IPv4Address(server)) << 64) | (0x8000 << 48) \
        | ((0x1234 ^ 0xFFFF) << 32) | client
    return str(ipaddress.IPv6Address(value))


FORMS = [nat64, compatible, mapped, translated, sixtofour, teredo]


@pytest.mark.parametrize("form", FORMS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("v4", PRIVATE_V4)
def test_embedded_private_ipv4_is_refused(form, v4):
    address = form(v4)
    assert ipaddress.ip_address(address)  # a well-formed IPv6 literal
    assert public_net.is_public_address(address) is False, address


@pytest.mark.parametrize("form", [nat64, mapped, sixtofour, teredo], ids=lambda f: f.__name__)
def test_embedded_public_ipv4_is_judged_by_it(form):
    assert public_net.is_public_address(form("8.8.8.8")) is True


def test_the_metadata_service_through_nat64():
    assert public_net.is_public_address("64:ff9b::a9fe:a9fe") is False
    assert public_net.is_public_address("64:ff9b::169.254.169.254") is False


def test_nat64_local_use_prefix_is_never_public():
    # RFC 8215's 64:ff9b:1::/48 may place the IPv4 anywhere; it is local by definition.
    assert public_net.is_public_address("64:ff9b:1::808:808") is False
    assert public_net.is_public_address("64:ff9b:1:808:800:8::") is False


@pytest.mark.parametrize("address", ["2001:4860:4860::8888", "2606:4700::1111", "8.8.8.8"])
def test_ordinary_public_addresses_pass(address):
    assert public_net.is_public_address(address) is True


def test_resolution_to_an_embedded_private_address_is_blocked(monkeypatch):
    def fake(host, port, *args, **kwargs):
        assert host == "metadata.rebind.test"
        return [(10, 1, 6, "", ("64:ff9b::a9fe:a9fe", port, 0, 0))]

    monkeypatch.setattr(public_net.socket, "getaddrinfo", fake)
    with pytest.raises(public_net.BlockedAddressError, match="64:ff9b::a9fe:a9fe"):
        public_net.public_addresses("metadata.rebind.test", 80)
