"""Small network-address predicates shared by the router, the engine adapters and their settings."""
from __future__ import annotations

import ipaddress

__all__ = ["is_loopback", "url_host"]

_LOOPBACK_NAMES = frozenset(("localhost", "ip6-localhost", "ip6-loopback"))


def is_loopback(host: str) -> bool:
    """True when ``host`` (an IP literal or a name) is a loopback address: ``127.0.0.0/8``, ``::1`` or one of the
    standard loopback host names (``localhost``, ``ip6-localhost``, ``ip6-loopback``). Other names are not resolved
    (False): a name that needs DNS is not treated as loopback. Never raises."""
    if host in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def url_host(host: str) -> str:
    """The host part of a URL that reaches a server bound to ``host`` from the same machine: a wildcard bind address
    becomes loopback (``0.0.0.0`` -> ``127.0.0.1``, ``::`` -> ``[::1]``; a wildcard is no address to connect to), an
    IPv6 literal gets its brackets (``fe80::1`` -> ``[fe80::1]``), anything else (names, IPv4, ``$(POD_IP)``) is
    returned as it is. Never raises."""
    h = host.strip("[]")
    try:
        ip = ipaddress.ip_address(h)
    except ValueError:
        return host
    if ip.is_unspecified:
        return "127.0.0.1" if ip.version == 4 else "[::1]"
    return f"[{h}]" if ip.version == 6 else h
